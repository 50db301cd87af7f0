"""What a remote checkpoint's manifest may say, checked before any object it names is fetched.

Every byte from ``checkpoint.remote`` is untrusted input, as a local checkpoint is: a manifest's
file names become local paths (under a fetch's temp folder), and its step decides what a
resume deletes. ``checked`` accepts only the shape ``Mirror`` writes and raises a
CheckpointError naming the first thing wrong, so the caller falls back past it:

* the manifest is a JSON object whose ``step`` is the step in its own name;
* ``kind`` is ``file`` (``files`` names exactly ``step-N.pt``) or ``dcp`` (every name is
  ``step-N.dcp/<file>``, ``<file>`` a plain file name: no separator, no ``..``);
* ``logs``, when present, names only ``logs/step-N/<log>`` for the run's own ``LOGS``;
* every entry is ``{"blake2b": 128 hex digits, "size": a non-negative int}``.

Nothing here touches the store or the disk: it is a pure check on parsed JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ironloop.errors import CheckpointError
from ironloop.state.run_dir import MIRRORED as LOGS, SUFFIXES as KINDS, step_name

_DIGEST_RE = re.compile(r"^[0-9a-f]{128}$")  # blake2b's default 64-byte digest, hex
# the files DCP and ironloop write in a .dcp folder: .metadata, __0_0.distcp, manifest.json,
# extras-rank0.pt; a leading dot only for .metadata, so neither "." nor ".." can pass
_DCP_FILE_RE = re.compile(r"^(\.metadata|[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})$")
_MAX_SIZE = 1 << 44  # 16 TiB: larger than any one checkpoint file, small enough to be a size


def checked(data: bytes, step: int) -> dict:
    """The manifest ``data`` (the bytes of ``manifests/step-N.json``) once its shape is right;
    CheckpointError naming what is wrong otherwise."""
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"its manifest is not JSON ({str(e)[:80]})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"its manifest is a {_kind(manifest)}, not an object")
    if _int(manifest.get("step")) != step:
        raise CheckpointError(f"its manifest's step {manifest.get('step')!r} is not {step}")
    kind = manifest.get("kind")
    if kind not in KINDS:
        raise CheckpointError(f"its manifest's kind {kind!r} is not one of {sorted(KINDS)}")
    if not isinstance(manifest.get("best", False), bool):
        raise CheckpointError("its manifest's best is not true or false")
    world = manifest.get("world_size", 1)
    if _int(world) is None or world < 1:
        raise CheckpointError(f"its manifest's world_size {world!r} is not a positive integer")
    checked_files(manifest.get("files"), step, kind)
    logs = manifest.get("logs")
    if logs is not None:  # older manifests have no logs
        _entries(logs, "logs", lambda name: _is_log(name, step))
    return manifest


def checked_files(files: Any, step: int, kind: str) -> dict:
    """``files`` (a manifest's, or a rank's marker's) naming one checkpoint of ``step``."""
    stem = step_name(step, kind)
    if kind == "file":
        def plain(name: str) -> bool:
            return name == stem
    else:
        def plain(name: str) -> bool:
            head, _, tail = name.partition("/")
            return head == stem and _DCP_FILE_RE.match(tail) is not None
    _entries(files, "files", plain)
    if not files or (kind == "file" and len(files) != 1):
        raise CheckpointError(f"its manifest's files do not name one checkpoint {stem}")
    return files


def _entries(entries: Any, key: str, allowed) -> None:
    if not isinstance(entries, dict):
        raise CheckpointError(f"its manifest's {key} is a {_kind(entries)}, not an object")
    for name, entry in entries.items():
        if not allowed(name):
            raise CheckpointError(f"its manifest's {key} names {name[:120]!r}, which is not a "
                                  f"file of this checkpoint")
        if not isinstance(entry, dict):
            raise CheckpointError(f"its manifest's entry for {name} is a {_kind(entry)}, not "
                                  f"an object")
        size = _int(entry.get("size"))
        if size is None or not 0 <= size <= _MAX_SIZE:
            raise CheckpointError(f"its manifest's size of {name} is {entry.get('size')!r}")
        digest = entry.get("blake2b")
        if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
            raise CheckpointError(f"its manifest's digest of {name} is not a blake2b digest")


def _is_log(name: str, step: int) -> bool:
    head, _, log = name.rpartition("/")
    return head == f"logs/step-{step:08d}" and log in LOGS


def _int(value: Any) -> int | None:
    """``value`` when it is an integer (JSON's true is not a step)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_JSON_NAMES: dict[type, str] = {dict: "object", list: "list", str: "string"}


def _kind(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)
