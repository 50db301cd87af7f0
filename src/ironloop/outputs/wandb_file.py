"""What W&B has written to its own files: the last step of each kind in the history records of
a run directory's ``wandb/*run-*/run-*.wandb`` transaction logs (offline and online runs keep
one per process).

A killed process loses what wandb had not yet written (it writes on its own schedule), so only
the file says what survived; a resume sends the rest (``durable.catch_up``). The file is W&B's
record log (LevelDB's log format): a 7-byte header, then 32 KiB blocks of chunks, each with a
7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) holding a ``Record``
protobuf. wandb >= 0.20 ships no Python reader of it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768


def records(path: Path):
    """The complete Record protobufs of one .wandb file; a torn tail is ignored."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        return
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        if pos + 7 + length > len(data):
            return  # the write the kill interrupted
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            try:
                record.ParseFromString(buf)
            except Exception:  # noqa: BLE001 - a damaged record: stop where it starts
                return
            buf = b""
            yield record


def held_steps(run_dir: Path) -> dict[str, int]:
    """{kind: last step} over every W&B transaction log in run_dir/wandb."""
    held: dict[str, int] = {}
    for path in sorted(run_dir.glob("wandb/*run-*/run-*.wandb")):
        for record in records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            if "step" not in items:
                continue
            step = int(json.loads(items["step"]))
            for key in items:
                if "/" in key:
                    kind = key.split("/", 1)[0]
                    held[kind] = max(held.get(kind, 0), step)
    return held
