"""Loggers: a failing one warns once and never stops training; W&B (offline) and MLflow log
what metrics.jsonl holds, across a SIGKILL and a resume."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ironloop
from ironloop.config import Config
from ironloop.outputs import durable, loggers, wandb_file
from tests.conftest import REPO, blobs, cfg, piped_stderr, tiny_mlp, wait_running


class Broken(loggers.Logger):
    name = "broken"
    calls = 0

    def write(self, kind, row):
        Broken.calls += 1
        raise OSError(28, "No space left on device")


def test_a_logger_whose_write_raises_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(loggers, "build",
                        lambda *a: [loggers.Guarded(durable.Durable(Broken(), 0))])
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


def test_a_tracker_that_raises_gives_one_runtime_warning_and_is_dropped(monkeypatch):
    monkeypatch.setattr(Broken, "calls", 0)  # the count the test above reads is left as it was
    guarded = loggers.Guarded(durable.Durable(Broken(), 0, passthrough=True))
    with pytest.warns(RuntimeWarning, match=r"broken logging failed \(OSError: .*No space left "
                                            r"on device\); training continues without broken"):
        guarded.write("metrics", {"step": 1, "loss": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        guarded.write("metrics", {"step": 2, "loss": 1.0})
    assert guarded.failed and guarded.confirmed() is None and guarded.held() == {}


def test_a_resumed_fit_continues_the_trackers_run_its_checkpoint_names(tmp_path, monkeypatch):
    """The checkpoint keeps each tracker's run id (``ids()``); a resume hands it back, so W&B
    continues the same run instead of starting another."""
    started: list = []

    class Tracker(loggers.Logger):
        name = "wandb"

        def __init__(self, conf, run_dir, run_id):
            started.append(run_id)
            self.run_id = run_id or f"run-{len(started)}"

        def ids(self):
            return {"wandb": self.run_id}

    monkeypatch.setattr(loggers, "WandB", Tracker)
    ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, log__wandb=True, train__epochs=1))
    ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, log__wandb=True, train__epochs=2),
                 resume=True, allow_config_change=True)
    assert started == [None, "run-1"]


def test_on_resume_tensorboard_drops_what_it_had_not_confirmed(tmp_path):
    """A killed process wrote steps 4 and 5 past the checkpoint it confirmed (3); the resumed
    one writes them again, and TensorBoard's reader shows each step once (purge_step)."""
    first = loggers.TensorBoard(tmp_path, None)
    for s in range(1, 6):
        first.write("metrics", {"step": s, "loss": 1.0 / s})
    first.write("epochs", {"step": 5, "val_acc": 0.5})
    first.close()
    again = loggers.TensorBoard(tmp_path, 3)
    for s in (4, 5):
        again.write("metrics", {"step": s, "loss": 2.0 / s})
    again.write("epochs", {"step": 5, "val_acc": 0.75})
    again.close()
    assert once(tensorboard_scalars(tmp_path, "metrics/loss")) == \
        pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3, 4: 0.5, 5: 0.4})
    assert once(tensorboard_scalars(tmp_path, "epochs/val_acc")) == {5: 0.75}


def test_mlflow_says_what_its_store_holds_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    # MLflow's file store: the default sqlite one spends seconds creating its tables
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    conf = Config().with_overrides({"log.mlflow": True, "log.mlflow_tracking_uri": uri})
    (first,) = loggers.build(conf, tmp_path, None, {})
    for s in range(1, 5):
        first.write("metrics", {"step": s, "loss": 1.0 / s})
    first.write("epochs", {"step": 2, "val_loss": 0.5})
    ids = first.ids()
    first.close()  # a run that ends normally
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ironloop").experiment_id])
    assert run.info.status == "FINISHED"

    (again,) = loggers.build(conf, tmp_path, 4, ids)  # ids as the checkpoint keeps them
    assert again.held() == {"metrics": 4, "epochs": 2}  # read back from the store
    try:
        raise RuntimeError("a crash inside fit()")
    except RuntimeError:
        again.close()  # as fit()'s finally does while the exception leaves it
    (run,) = client.search_runs([client.get_experiment_by_name("ironloop").experiment_id])
    assert run.info.status == "FAILED"


def test_wandb_continues_the_run_id_it_is_given_and_its_file_says_what_it_holds(
        tmp_path, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    conf = Config().with_overrides({"log.wandb": True, "log.wandb_mode": "offline"})
    logger = loggers.WandB(conf, tmp_path, "resumed1")  # the id a checkpoint kept
    assert logger.ids() == {"wandb": "resumed1"}
    assert logger.run.settings.resume == "allow"  # online, the id's existing run continues
    logger.write_rows([("scalars", {"step": 0, "lr_probe": 0.1})]  # a callback, before step 1
                      + [("metrics", {"step": s, "loss": 1.0 / s}) for s in range(1, 4)]
                      + [("epochs", {"step": 3, "val_loss": 0.5})])
    logger.close()  # a run that ends normally
    import wandb

    wandb.teardown()  # wandb's own process writes the file: wait until it has exited
    (path,) = tmp_path.glob("wandb/offline-run-*-resumed1/run-resumed1.wandb")
    assert logger.held_steps() == {"scalars": 0, "metrics": 3, "epochs": 3}
    assert [row["step"] for row in wandb_rows(tmp_path)] == [0, 1, 2, 3, 3]
    (end,) = [r.exit for r in wandb_file.records(path) if r.WhichOneof("record_type") == "exit"]
    assert end.exit_code == 0


def _wandb_log(path: Path, chunks: list[tuple[int, bytes, int]]) -> None:
    """A .wandb file by hand: its header, then (length, payload, kind) records (kind 1: FULL);
    a length over the payload's is a record the kill tore."""
    import struct

    path.write_bytes(b":W&B\x00\x00\x00" + b"".join(
        struct.pack("<IHB", 0, length, kind) + payload for length, payload, kind in chunks))


def _history(step: int) -> bytes:
    from wandb.proto import wandb_internal_pb2 as pb

    record = pb.Record()
    record.history.item.add(key="step", value_json=str(step))
    return record.SerializeToString()


def test_the_wandb_file_reader_stops_at_a_torn_record_even_when_its_start_parses(tmp_path):
    whole, torn = _history(1), _history(2)
    _wandb_log(tmp_path / "run.wandb", [(len(whole), whole, 1), (len(torn) + 5, torn, 1)])
    steps = [r.history.item[0].value_json for r in wandb_file.records(tmp_path / "run.wandb")]
    assert steps == ["1"]  # the torn one's bytes are a record's start, not a record


def test_the_wandb_file_reader_reads_on_past_an_empty_record(tmp_path):
    _wandb_log(tmp_path / "run.wandb", [(0, b"", 1), (len(_history(3)), _history(3), 1)])
    records = list(wandb_file.records(tmp_path / "run.wandb"))
    assert [r.WhichOneof("record_type") for r in records] == [None, "history"]


def test_the_wandb_file_reader_skips_a_blocks_zero_padding_to_the_next_block(tmp_path):
    import struct

    first, second = _history(1), _history(2)
    head = b":W&B\x00\x00\x00" + struct.pack("<IHB", 0, len(first), 1) + first
    padded = head + b"\x00" * (wandb_file.BLOCK - len(head))  # a zero header, then zeros
    (tmp_path / "run.wandb").write_bytes(
        padded + struct.pack("<IHB", 0, len(second), 1) + second)
    steps = [r.history.item[0].value_json for r in wandb_file.records(tmp_path / "run.wandb")]
    assert steps == ["1", "2"]


def test_the_wandb_file_reader_gives_each_record_back_as_written_across_its_chunks(tmp_path):
    """Records one after another, and one split in first, middle and last chunks (kinds 2, 3,
    4): each comes back byte for byte, nothing of one carried into the next."""
    one, two, three = _history(1), _history(22), _history(333)
    a, b = len(two) // 3, 2 * len(two) // 3
    _wandb_log(tmp_path / "run.wandb", [(len(one), one, 1), (a, two[:a], 2),
                                        (b - a, two[a:b], 3), (len(two) - b, two[b:], 4),
                                        (len(three), three, 1)])
    got = [r.SerializeToString() for r in wandb_file.records(tmp_path / "run.wandb")]
    assert got == [one, two, three]


def test_wandb_holds_the_last_step_of_each_kind_its_history_records_name(tmp_path):
    from wandb.proto import wandb_internal_pb2 as pb

    def history(step: int, *keys: str, nested: tuple = ()) -> bytes:
        record = pb.Record()
        record.history.item.add(key="step", value_json=str(step))
        for key in keys:
            record.history.item.add(key=key, value_json="0.5")
        if nested:
            record.history.item.add(nested_key=list(nested), value_json="0.5")
        return record.SerializeToString()

    rows = [history(2, "metrics/loss"), history(3, nested=("epochs", "val_loss")),
            history(4, "metrics/loss", "lr"), history(1, "scalars/x"), history(3, "metrics/loss")]
    run = tmp_path / "wandb" / "offline-run-1-abc"
    run.mkdir(parents=True)
    _wandb_log(run / "run-abc.wandb", [(len(r), r, 1) for r in rows])
    assert wandb_file.held_steps(tmp_path) == {"metrics": 4, "epochs": 3, "scalars": 1}


# --- reading back what W&B (offline) and MLflow hold --------------------------------------

def wandb_rows(run_dir: Path) -> list[dict]:
    """History rows of every offline .wandb file of the run, oldest process first (the record
    log is decoded by ironloop's reader of W&B's file format; the rows are read here)."""
    from ironloop.outputs.wandb_file import records

    rows = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        for record in records(Path(path)):
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in record.history.item})
    return rows


def once(pairs) -> dict[int, float]:
    """{step: value}, asserting that no step was logged twice."""
    pairs = list(pairs)
    steps = [int(s) for s, _ in pairs]
    assert len(steps) == len(set(steps)), f"steps logged more than once: {sorted(steps)}"
    return {int(s): v for s, v in pairs}


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """What TensorBoard itself shows: its event reader, which honours purge_step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_every_tracker_holds_each_step_once_across_sigkills_and_resumes(tmp_path, monkeypatch,
                                                                         capsys):
    """Two real kills (SIGKILL mid-run) and resumes; then TensorBoard's, W&B's and MLflow's own
    files hold every step of metrics.jsonl exactly once, with its value."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ironloop", "train", "configs/digits.yaml", "model.name=mlp",
           f"run.dir={run_dir}", "train.epochs=2", "train.batch_size=256",
           "checkpoint.every_steps=3", "doctor.preflight=false", "log.tensorboard=true",
           "log.every_steps=1", "log.progress=off", "log.wandb=true", "log.wandb_mode=offline",
           "log.mlflow=true", "--resume"]
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(REPO / "src")}
    metrics = run_dir / "metrics.jsonl"
    for kill_after in (4, 8):  # metrics lines: past a checkpoint at 3, then at 6
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        wait_running(proc, lambda n=kill_after: metrics.exists() and
                     len(metrics.read_text().splitlines()) >= n,
                     f"{kill_after} metrics lines", piped_stderr(proc))
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    # The last resume, to the end, through the CLI's main in this process: the kills above are
    # the real processes'; resuming from what they left needs no fresh interpreter (issue 45).
    from ironloop.cli import main

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(REPO)
    capsys.readouterr()
    code = main(cmd[3:])
    assert code == 0, capsys.readouterr().err
    import wandb

    wandb.teardown()  # wandb's own process writes the file: wait until it has exited
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert len(events) == 2 and all(e["steps_redone"] >= 1 for e in events)  # kills cost work

    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    epochs = [json.loads(x) for x in (run_dir / "epochs.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))  # 6 steps per epoch
    want = {k: {r["step"]: r[k] for r in rows} for k in ("loss", "lr", "grad_norm")}
    want["val_acc"] = {e["step"]: e["val_acc"] for e in epochs}

    for key in ("loss", "lr", "grad_norm"):
        assert once(tensorboard_scalars(run_dir, f"metrics/{key}")) == pytest.approx(want[key])
    assert once(tensorboard_scalars(run_dir, "epochs/val_acc")) == pytest.approx(want["val_acc"])

    history = wandb_rows(run_dir)
    assert len(glob.glob(str(run_dir / "wandb" / "offline-run-*"))) == 3  # one per process
    for key in ("loss", "lr", "grad_norm"):
        got = once((h["step"], h[f"metrics/{key}"]) for h in history if f"metrics/{key}" in h)
        assert got == pytest.approx(want[key]), key
    got = once((h["step"], h["epochs/val_acc"]) for h in history if "epochs/val_acc" in h)
    assert got == pytest.approx(want["val_acc"])

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("ironloop").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["train.epochs"] == "2"
    for key in ("loss", "lr", "grad_norm"):
        history = client.get_metric_history(run.info.run_id, f"metrics/{key}")
        assert once((m.step, m.value) for m in history) == pytest.approx(want[key]), key
    history = client.get_metric_history(run.info.run_id, "epochs/val_acc")
    assert once((m.step, m.value) for m in history) == pytest.approx(want["val_acc"])
