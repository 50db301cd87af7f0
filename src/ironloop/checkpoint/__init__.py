"""Checkpoints: atomic verified files (``io``) and the run directory's rolling set (``manager``)."""

from .io import (
    FORMAT_VERSION,
    load_model_state,
    load_verified,
    save_atomic,
    state_digest,
    strip_prefixes,
    temp_path,
)
from .manager import CheckpointManager, has_checkpoints, latest_valid, retention_victims

__all__ = [
    "FORMAT_VERSION",
    "CheckpointManager",
    "has_checkpoints",
    "latest_valid",
    "load_model_state",
    "load_verified",
    "retention_victims",
    "save_atomic",
    "state_digest",
    "strip_prefixes",
    "temp_path",
]
