"""Checkpoint files: atomic, durable writes and safe, verified reads.

A checkpoint is one ``torch.save`` file holding a nested dict of tensors and plain Python values,
plus an ``"integrity"`` entry with a blake2b digest of everything else. The rules here exist
because a training run is usually killed at the worst moment:

* Writes go to a temp file in the same directory, are fsynced, then ``os.replace``-d over the
  target. A crash or a full disk leaves either the old file or the new one, never half of each.
* Reads use ``weights_only=True``, so a checkpoint cannot run code, and check the digest, so a
  flipped bit on disk is caught here instead of surfacing as a NaN hours later.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ironloop.errors import CheckpointError

FORMAT_VERSION = 1

_PREFIXES = ("module.", "_orig_mod.")
_tmp_counter = itertools.count()


# ----------------------------------------------------------------------------------- digest --
def _feed(h: hashlib.blake2b, tag: bytes, data: Any) -> None:
    """Hash a tagged, length-prefixed chunk so that no two different structures collide."""
    n = data.nbytes if hasattr(data, "nbytes") else len(data)
    h.update(tag + n.to_bytes(8, "little"))
    h.update(data)


def _walk(h: hashlib.blake2b, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        _feed(h, b"T", f"{t.dtype}|{tuple(t.shape)}".encode())
        # A uint8 view of the same memory: works for bf16 and 0-dim tensors, and hashlib
        # reads the numpy buffer directly, so a multi-GB model is not copied to be hashed.
        _feed(h, b"B", t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        _feed(h, b"D", str(len(obj)).encode())
        for key, value in obj.items():
            _feed(h, b"K", repr(key).encode())
            _walk(h, value)
    elif isinstance(obj, (list, tuple)):
        _feed(h, b"L", str(len(obj)).encode())
        for item in obj:
            _walk(h, item)
    else:
        _feed(h, b"V", repr(obj).encode())


def state_digest(state: dict) -> str:
    """blake2b hex digest of a checkpoint state, ignoring its top-level ``"integrity"`` key.

    Tensors are hashed by dtype, shape and raw bytes (not by device or storage sharing), dicts in
    insertion order and other leaves by ``repr``, so the state in memory before saving and the one
    ``torch.load`` returns give the same digest.
    """
    h = hashlib.blake2b()
    _walk(h, {k: v for k, v in state.items() if k != "integrity"})
    return h.hexdigest()


# ------------------------------------------------------------------------------------ write --
def file_digest(path: Path) -> str:
    """blake2b hex digest of a file's bytes, read a MiB at a time (DCP shards, remote copies)."""
    h = hashlib.blake2b()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(directory: Path) -> None:
    """fsync a directory so that a rename or link in it survives a power cut.

    ``os.replace`` only changes the directory entry; until the directory itself is flushed, a
    crash can bring back the old entry (or none). Some platforms (Windows) cannot open a
    directory; there the rename is as durable as the OS makes it, so the error is ignored.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """A temp name next to ``path``: same filesystem, so ``os.replace`` is atomic; the leading
    dot keeps it out of checkpoint listings."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{next(_tmp_counter)}")


def write_atomic(path: Path, text: str) -> None:
    """Write a small text file so a reader never sees half of it."""
    tmp = temp_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)  # a full disk leaves no stray temp file behind
        raise


def remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _os_error_in_chain(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc``. torch.save turns a failed ``write`` (e.g. ENOSPC) into a
    RuntimeError from its zip writer, with the OSError only as ``__context__``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def write_failed(path: Path, err: OSError) -> CheckpointError:
    """The CheckpointError for an OS-level failure writing ``path``."""
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        fix = "free disk space or point run.dir at a disk with room, then resume"
    else:
        fix = "check that run.dir is writable and healthy (or change run.dir), then resume"
    return CheckpointError(
        f"could not write checkpoint {path}: {reason}. The previous checkpoint there is intact; "
        f"{fix}."
    )


def save_atomic(state: dict, path: Path) -> None:
    """Write ``state`` to ``path`` so that ``path`` is always either the old or the new file.

    Adds ``state["integrity"]`` (mutating ``state``). On an OS error (full disk, I/O error) the
    temp file is removed, ``path`` is left untouched and a CheckpointError is raised.
    """
    path = Path(path)
    state.pop("integrity", None)
    state["integrity"] = {"algo": "blake2b", "digest": state_digest(state)}
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # data on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException as e:
        remove_quietly(tmp)
        os_err = _os_error_in_chain(e)
        if os_err is None:
            raise  # not an I/O problem (e.g. an unpicklable object): a bug, keep the traceback
        raise write_failed(path, os_err) from os_err
    fsync_dir(path.parent)


# ------------------------------------------------------------------------------------- read --
class LoadFailure(Exception):
    """Why a file could not be loaded; ``reason`` is short enough for a one-line warning."""

    def __init__(self, path: Path, reason: str, message: str):
        super().__init__(message)
        self.path, self.reason = path, reason


_REFUSE_MARKERS = ("GLOBAL", "Can only build", "Can only create new object", "add_safe_globals")


def _short(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    text = text.split(". ")[0] or type(e).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _not_torch(path: Path) -> str | None:
    """What a file that torch.save did not write starts with (torch writes a zip, or a pickle
    in the legacy format); None when it looks like one of those (then it is damaged)."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError:
        return None
    if head.startswith((b"PK", b"\x80")):
        return None
    text = head.decode("utf-8", errors="replace").split("\n")[0]
    return f"not a file torch.save wrote: it starts with {text!r}"


def load_checked(path: Path, map_location: Any) -> dict:
    """Load and verify, raising LoadFailure (a CheckpointError's message plus a short reason)."""
    def damaged(reason: str) -> LoadFailure:
        return LoadFailure(path, reason, f"{path} is damaged or not a checkpoint ({reason}); "
                                         "resume from another checkpoint or start over")

    if not path.exists():
        raise LoadFailure(path, "missing",
                          f"no checkpoint at {path}; check the path (ls the run directory)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        msg = str(e)
        if any(m in msg for m in _REFUSE_MARKERS):
            raise LoadFailure(
                path, "contains pickled code or non-tensor objects",
                f"refused to load {path}: it contains pickled code or objects that are not plain "
                "tensors/containers; ironloop only loads weights_only checkpoints. Only load files "
                "you trust, and re-save them as plain state dicts (tensors, dicts, lists, "
                "numbers).",
            ) from None
        op = re.search(r"Unsupported operand \S+", msg)
        raise damaged("unreadable pickle data" + (f": {op.group(0)}" if op else "")) from None
    except (PermissionError, IsADirectoryError) as e:
        raise LoadFailure(path, e.strerror or type(e).__name__,
                          f"could not read checkpoint {path}: {e.strerror}; "
                          "check the path and its permissions") from None
    except Exception as e:  # noqa: BLE001 - truncated zip, random bytes, EOF: not loadable
        empty = path.is_file() and path.stat().st_size == 0
        raise damaged("empty file" if empty else _not_torch(path) or _short(e)) from None
    if not isinstance(state, dict) or not isinstance(state.get("integrity"), dict):
        raise LoadFailure(path, "not an ironloop checkpoint",
                          f"{path} is not an ironloop checkpoint (no integrity record); "
                          "pass a file written by ironloop")
    if state["integrity"].get("digest") != state_digest(state):
        raise LoadFailure(path, "checksum mismatch",
                          f"{path} is damaged: checksum mismatch; the file changed after it was "
                          "written (disk or copy error). Resume from another checkpoint.")
    return state


def load_verified(path: Path, map_location: Any = "cpu") -> dict:
    """Load a checkpoint with ``weights_only=True`` and check its digest.

    ``weights_only`` means unpickling can only build tensors and plain containers, so a malicious
    file is refused before any of its code runs. Every failure is a CheckpointError saying what
    is wrong with which file.
    """
    try:
        return load_checked(Path(path), map_location)
    except LoadFailure as e:
        raise CheckpointError(str(e)) from None


# ------------------------------------------------------------------------------ model state --
def _strip(key: str) -> str:
    while key.startswith(_PREFIXES):
        for p in _PREFIXES:
            key = key[len(p):] if key.startswith(p) else key
    return key


def strip_prefixes(state_dict: dict) -> dict:
    """Drop leading ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) from every key, so a
    checkpoint loads whether or not the model that wrote it, or reads it, was wrapped."""
    return {_strip(k): v for k, v in state_dict.items()}


def _listing(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    more = f", ... (+{len(items) - limit} more)" if len(items) > limit else ""
    return f"[{shown}{more}]"


def load_model_state(model: torch.nn.Module, state_dict: dict, source: str) -> None:
    """Load ``state_dict`` into ``model``, ignoring DDP/compile prefixes on either side.

    Unlike ``load_state_dict``'s error, the CheckpointError lists missing keys, unexpected keys
    and shape mismatches together, each capped, so the user sees the whole misfit at once.
    """
    ckpt = strip_prefixes(state_dict)
    own = model.state_dict()
    real = {_strip(k): k for k in own}  # stripped key -> the model's own (maybe prefixed) key
    missing = [k for k in real if k not in ckpt]
    unexpected = [k for k in ckpt if k not in real]
    shapes = []
    for k, real_key in real.items():
        a, b = ckpt.get(k), own[real_key]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
            shapes.append(f"{k}: ckpt {tuple(a.shape)} vs model {tuple(b.shape)}")
    if missing or unexpected or shapes:
        parts = [f"{name}: {_listing(items)}" for name, items in
                 (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
                 if items]
        raise CheckpointError(
            f"checkpoint {source} does not fit this model: {'; '.join(parts)}. "
            "Check that model.name and model.kwargs match the run that wrote it."
        )
    try:
        model.load_state_dict({real[k]: v for k, v in ckpt.items()}, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {source} does not fit this model: {_short(e)}. "
                              "Check that model.name and model.kwargs match.") from e
