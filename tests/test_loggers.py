"""Loggers: a failing one warns once and never stops training; W&B (offline) and MLflow log
what metrics.jsonl holds, across a SIGKILL and a resume."""

from __future__ import annotations

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ironloop
from ironloop.outputs import loggers
from tests.conftest import REPO, blobs, cfg, tiny_mlp


class Broken(loggers.Logger):
    name = "broken"
    calls = 0

    def write(self, kind, row):
        Broken.calls += 1
        raise OSError(28, "No space left on device")


def test_a_logger_whose_write_raises_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(loggers, "build", lambda *a: [loggers.Guarded(Broken())])
    with pytest.warns(RuntimeWarning, match="broken logging failed .*No space left") as caught:
        res = ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path))
    assert len([w for w in caught if "logging failed" in str(w.message)]) == 1
    assert Broken.calls == 1 and res.results["steps"] == 14  # dropped after its first failure
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 14


def test_mlflow_with_a_bad_tracking_uri_warns_and_trains(tmp_path):
    with pytest.warns(RuntimeWarning, match="mlflow logging failed to start"):
        res = ironloop.fit(tiny_mlp(), blobs(), None,
                           cfg(tmp_path, log__mlflow=True,
                               log__mlflow_tracking_uri="nosuchscheme://nowhere"))
    assert res.results["steps"] == 14


# --- reading back what W&B (offline) and MLflow hold --------------------------------------

def wandb_rows(run_dir: Path) -> list[dict]:
    """History rows of every offline .wandb file of the run, oldest process first.

    The file is W&B's record log: a 7-byte header, then 32 KiB blocks of chunks, each with a
    7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) holding a Record
    protobuf. wandb >= 0.20 ships no Python reader, hence these few lines."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data = Path(path).read_bytes()
        assert data[:4] == b":W&B"
        pos, buf = 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if length == 0 and kind == 0:  # zero padding to the end of the block
                pos += left
                continue
            buf += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = pb.Record()
                record.ParseFromString(buf)
                buf = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                 for i in record.history.item})
    return rows


def by_step(pairs) -> dict[int, float]:
    """The last value logged for each step: a step redone after a crash is logged twice."""
    out: dict[int, float] = {}
    for step, value in pairs:
        out[int(step)] = value
    return out


@pytest.mark.slow
def test_wandb_offline_and_mlflow_match_metrics_jsonl_across_a_sigkill(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ironloop", "train", "configs/digits.yaml", "model.name=mlp",
           f"run.dir={run_dir}", "train.epochs=2", "train.batch_size=256",
           "checkpoint.every_steps=3",
           "log.every_steps=1", "log.progress=off", "log.wandb=true", "log.wandb_mode=offline",
           "log.mlflow=true", "--resume"]
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None and \
            (not metrics.exists() or len(metrics.read_text().splitlines()) < 7):
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert len(events) == 1 and events[0]["steps_redone"] >= 1  # the kill cost work

    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    epochs = [json.loads(x) for x in (run_dir / "epochs.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))  # 6 steps per epoch
    want = {k: {r["step"]: r[k] for r in rows} for k in ("loss", "lr", "grad_norm")}
    want["val_acc"] = {e["step"]: e["val_acc"] for e in epochs}

    history = wandb_rows(run_dir)
    assert len(glob.glob(str(run_dir / "wandb" / "offline-run-*"))) == 2  # one per process
    for key in ("loss", "lr", "grad_norm"):
        got = by_step((h["step"], h[f"metrics/{key}"]) for h in history if f"metrics/{key}" in h)
        assert got == pytest.approx(want[key]), key
    got = by_step((h["step"], h["epochs/val_acc"]) for h in history if "epochs/val_acc" in h)
    assert got == pytest.approx(want["val_acc"])

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("ironloop").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["train.epochs"] == "2"
    for key in ("loss", "lr", "grad_norm"):
        history = client.get_metric_history(run.info.run_id, f"metrics/{key}")
        got = by_step((m.step, m.value) for m in sorted(history, key=lambda m: m.timestamp))
        assert got == pytest.approx(want[key]), key
    history = client.get_metric_history(run.info.run_id, "epochs/val_acc")
    assert by_step((m.step, m.value) for m in history) == pytest.approx(want["val_acc"])
