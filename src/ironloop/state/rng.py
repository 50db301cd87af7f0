"""Seeding, capturing and restoring every random number generator a run draws from: Python's,
numpy's, torch's CPU generator and every CUDA device's. One capture serves checkpoints (as
weights_only-loadable values) and the doctor (which must leave the run's RNG untouched)."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Python, numpy, torch CPU and every CUDA device, as weights_only-loadable values."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])


def _as_tuple(x):
    """random.setstate wants tuples all the way down; a round trip may give lists."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


@contextlib.contextmanager
def preserved_rng():
    """Run a block that draws random numbers without moving the caller's generators."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)

