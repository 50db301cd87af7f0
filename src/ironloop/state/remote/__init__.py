"""checkpoint.remote: the mirror of a run's checkpoints and logs on object storage (or any
fsspec URL), behind the checkpointer (``state/checkpointer.py``).

``mirror.py`` uploads in the background (what the remote holds, retention); ``fetch.py``
fetches the newest complete checkpoint and its logs back; ``store.py`` is the store's
operations; ``lease.py`` keeps one writer per prefix; ``manifest.py`` checks a manifest's
every name and digest before anything is fetched.
"""

from .fetch import fetch_newest, remove_leftovers, restore_logs
from .mirror import STAGING, Mirror
from .store import Remote, StoreUnavailable, is_remote, open_remote

__all__ = ["STAGING", "Mirror", "Remote", "StoreUnavailable", "fetch_newest", "is_remote",
           "open_remote", "remove_leftovers", "restore_logs"]
