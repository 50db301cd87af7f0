"""User-facing errors.

Anything derived from ``UserError`` is a mistake the user can fix (a bad config key, a missing
file, a damaged checkpoint). The CLI prints its message on one line and exits 2 with no traceback.
Everything else is a bug in ironloop and keeps its traceback.
"""


class UserError(Exception):
    """A mistake the user can fix. The message names the bad thing and the fix."""


class ConfigError(UserError):
    """A config value is unknown, mistyped or out of range."""


class DataError(UserError):
    """A dataset is missing, damaged or inconsistent."""


class CheckpointError(UserError):
    """A checkpoint is missing, damaged, unsafe or does not fit the model."""
