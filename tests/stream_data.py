"""Stream factories for the CLI tests (``data.name=tests.stream_data:NAME``), the small files
they read, and a model that can pause mid-step so that a test can SIGKILL it there.

Every format holds the same samples: Gaussian blobs (8 features, 3 classes) with an ``id``.
"""

from __future__ import annotations

import glob
import json
import os
import random
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from tests.conftest import blobs

N, SHARDS, BATCH = 240, 4, 16


def write_files(root: Path, fmt: str, n: int = N, shards: int = SHARDS,
                corrupt: int | None = None) -> Path:
    """``n`` samples in ``shards`` files of ``fmt`` (jsonl, parquet, tar) under ``root``.
    ``corrupt``: that shard's bytes are cut in half (a damaged download)."""
    data = blobs(n, seed=1)
    root.mkdir(parents=True, exist_ok=True)
    per = n // shards
    for s in range(shards):
        ids = range(s * per, (s + 1) * per)
        path = root / f"part-{s:02d}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps({"id": i, "x": data.x[i].tolist(),
                                                "y": int(data.y[i])}) + "\n" for i in ids))
        elif fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"id": list(ids), "x": [data.x[i].tolist() for i in ids],
                                     "y": [int(data.y[i]) for i in ids]}), path)
        else:
            import webdataset as wds

            with wds.TarWriter(str(path)) as w:
                for i in ids:
                    w.write({"__key__": f"{i:06d}", "x.pth": data.x[i].clone(),
                             "cls": int(data.y[i])})
        if s == corrupt:
            raw = path.read_bytes()
            path.write_bytes(raw[:len(raw) // 2])
    return root


def val_split():
    v = blobs(48, seed=2)
    return v.x, v.y


def xy(rows):
    """HF rows (dicts) -> an (inputs, targets) batch."""
    x = torch.tensor([r["x"] for r in rows], dtype=torch.float32)
    return x, torch.tensor([r["y"] for r in rows])


def hf(root, fmt: str = "json", buffer: int = 64, seed: int = 0, rank: int = 0,
       world_size: int = 1):
    """A Hugging Face streaming dataset with a shuffle buffer (``buffer`` > 0), one disjoint
    share per rank."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    ext = "jsonl" if fmt == "json" else fmt
    files = sorted(glob.glob(f"{root}/*.{ext}"))
    ds = load_dataset(fmt, data_files=files, split="train", streaming=True)
    if buffer:  # without one, HF's own state_dict is the exact position (no replay)
        ds = ds.shuffle(seed=seed, buffer_size=buffer)
    if world_size > 1:
        ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
    return DataLoader(ds, batch_size=BATCH, collate_fn=xy), val_split()


class Shards(IterableDataset):
    """WebDataset tar shards; the shard order and a shuffle buffer follow (seed, epoch)."""

    def __init__(self, urls: list[str], seed: int = 0, buffer: int = 64):
        self.urls, self.seed, self.buffer, self.epoch = urls, seed, buffer, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        import webdataset as wds

        rng = random.Random(self.seed * 1000 + self.epoch)
        urls = list(self.urls)
        rng.shuffle(urls)
        return iter(wds.DataPipeline(
            wds.SimpleShardList(urls), wds.split_by_node, wds.split_by_worker,
            wds.tarfile_to_samples(), wds.shuffle(self.buffer, initial=self.buffer, rng=rng),
            wds.decode(), wds.to_tuple("x.pth", "cls")))


def tars(root, seed: int = 0):
    return Shards(sorted(glob.glob(f"{root}/*.tar")), seed), val_split()


class PausingMLP(nn.Module):
    """The tests' MLP. With IRONLOOP_TEST_PAUSE_AT=k, its k-th training forward in this process
    writes IRONLOOP_TEST_PAUSE_FILE and waits there to be killed."""

    def __init__(self, d: int = 8, c: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, c))
        self.calls = 0
        self.pause_at = int(os.environ.get("IRONLOOP_TEST_PAUSE_AT", "0"))

    def forward(self, x):
        if self.training and self.pause_at:
            self.calls += 1
            if self.calls == self.pause_at:
                Path(os.environ["IRONLOOP_TEST_PAUSE_FILE"]).touch()
                time.sleep(600)  # the test SIGKILLs the process here
        return self.net(x)


def model():
    return PausingMLP()
