"""checkpoint.remote: the mirror of a run's checkpoints and logs on object storage (or any
fsspec URL), behind the checkpointer (``state/checkpointer.py``).

``mirror.py`` uploads in the background and fetches the newest complete checkpoint back;
``store.py`` is the store's operations; ``lease.py`` keeps one writer per prefix;
``manifest.py`` checks a manifest's every name and digest before anything is fetched.
"""

from .mirror import STAGING, Mirror, fetch_newest, is_remote, remove_leftovers, restore_logs
from .store import Remote, StoreUnavailable, open_remote

__all__ = ["STAGING", "Mirror", "Remote", "StoreUnavailable", "fetch_newest", "is_remote",
           "open_remote", "remove_leftovers", "restore_logs"]
