"""Loggers: a failing one warns once and never stops training; W&B (offline) and MLflow log
what metrics.jsonl holds, across a SIGKILL and a resume.

outputs/loggers.py against stand-ins of the trackers' own APIs (TensorBoard's SummaryWriter,
wandb, MLflow's client), in this process: what each tracker is asked to start with, what it is
sent for each row, and how a run's end reaches it (the real trackers' files are read back
above)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

import ironloop
from ironloop.config import Config
from ironloop.errors import UserError
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
    events = [e for e in events if e["event"] == "resume"]  # not the starts
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


class Calls:
    """Records every call made on it (and on what its calls return), by dotted name."""

    def __init__(self, log=None, prefix=""):
        self._log, self._prefix = ([] if log is None else log), prefix

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self._log.append((self._prefix + name, args, kwargs))
            return Calls(self._log, self._prefix + name + "().")
        return call


def fake_modules(monkeypatch, **modules):
    """``require(module, ...)`` gives these stand-ins; the rest is not installed."""
    def require(module, extra, what):
        if module in modules:
            return modules[module]
        raise UserError(f"{what} needs {module}")

    monkeypatch.setattr(loggers, "require", require)


def test_only_finite_numbers_of_a_row_are_its_scalars():
    row = {"step": 3, "epoch": 1, "time": 9.5, "loss": 0.25, "count": 4, "flag": True,
           "note": "text", "missing": None}
    assert loggers._scalars(row) == {"loss": 0.25, "count": 4.0}
    assert isinstance(loggers._scalars(row)["count"], float)


def test_failing_is_true_only_while_an_exception_is_being_handled():
    assert loggers._failing() is False
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        assert loggers._failing() is True


def test_tensorboard_gets_each_number_under_its_kind_against_the_step(monkeypatch, tmp_path):
    writers = []

    class Writer:
        def __init__(self, log_dir, purge_step):
            self.args, self.scalars, self.calls = (log_dir, purge_step), [], []
            writers.append(self)

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

        def flush(self):
            self.calls.append("flush")

        def close(self):
            self.calls.append("close")

    fake_modules(monkeypatch, **{"torch.utils.tensorboard": SimpleNamespace(SummaryWriter=Writer)})
    tb = loggers.TensorBoard(tmp_path, None)
    assert writers[0].args == (str(tmp_path / "tb"), None)
    tb.write("epochs", {"step": 5, "epoch": 1, "val_loss": 0.5, "val_acc": 1, "note": "x"})
    assert writers[0].scalars == [("epochs/val_loss", 0.5, 5), ("epochs/val_acc", 1, 5)]
    tb.flush()
    tb.close()
    assert writers[0].calls == ["flush", "close"]
    loggers.TensorBoard(tmp_path, 7)  # a resume: what the killed process had not confirmed goes
    assert writers[1].args == (str(tmp_path / "tb"), 8)


def wandb_config(**log):
    return Config().with_overrides({"log.wandb": True, **{f"log.{k}": v for k, v in log.items()}})


def test_wandb_starts_one_run_per_run_dir_that_a_resume_continues(monkeypatch, tmp_path):
    calls: list = []
    fake_modules(monkeypatch, wandb=Calls(calls))
    conf = wandb_config()
    logger = loggers.WandB(conf, tmp_path, "abc123")
    (name, args, kwargs), *defines = calls
    assert name == "init" and args == ()
    assert kwargs == {"project": "ironloop", "name": tmp_path.name, "dir": str(tmp_path),
                      "mode": None, "id": "abc123", "resume": "allow",
                      "config": conf.to_dict()}
    assert defines == [("init().define_metric", ("step",), {}),
                       ("init().define_metric", ("metrics/*",), {"step_metric": "step"}),
                       ("init().define_metric", ("epochs/*",), {"step_metric": "step"})]
    calls.clear()
    logger.write("metrics", {"step": 4, "time": 1.0, "loss": 0.5, "lr": 0.1})
    assert calls == [("init().log", ({"step": 4, "metrics/loss": 0.5, "metrics/lr": 0.1},), {})]


def test_wandb_takes_the_configured_name_and_mode(monkeypatch, tmp_path):
    calls: list = []
    fake_modules(monkeypatch, wandb=Calls(calls))
    loggers.WandB(wandb_config(wandb_name="mine", wandb_mode="offline", wandb_project="p"),
                  tmp_path, None)
    kwargs = calls[0][2]
    assert (kwargs["name"], kwargs["mode"], kwargs["project"], kwargs["id"]) == \
        ("mine", "offline", "p", None)


def test_wandb_says_its_run_id_and_ends_its_run_with_the_runs_outcome(monkeypatch, tmp_path):
    finished = []
    run = SimpleNamespace(id="xyz", define_metric=lambda *a, **k: None,
                          finish=lambda exit_code: finished.append(exit_code))
    fake_modules(monkeypatch, wandb=SimpleNamespace(init=lambda **k: run))
    logger = loggers.WandB(wandb_config(), tmp_path, None)
    assert logger.ids() == {"wandb": "xyz"}
    logger.close()
    try:
        raise RuntimeError("a crash inside fit()")
    except RuntimeError:
        logger.close()
    assert finished == [0, 1]


class Client:
    """MLflow's MlflowClient: what it was asked, and a store of logged metrics."""

    made: ClassVar[list] = []

    def __init__(self, tracking_uri):
        self.uri, self.calls, self.ops = tracking_uri, [], []
        self.history: dict = {}
        Client.made.append(self)

    def get_experiment_by_name(self, name):
        return SimpleNamespace(experiment_id="e7") if name == "there" else None

    def create_experiment(self, name):
        self.calls.append(("create_experiment", name))
        return "e1"

    def create_run(self, exp_id, run_name):
        self.calls.append(("create_run", exp_id, run_name))
        return SimpleNamespace(info=SimpleNamespace(run_id="r1"))

    def update_run(self, run_id, status):
        self.calls.append(("update_run", run_id, status))

    def log_batch(self, run_id, metrics=(), params=(), synchronous=True):
        self.calls.append(("log_batch", run_id, len(metrics), len(params), synchronous))
        for m in metrics:
            self.history.setdefault(m.key, []).append(m)
        op = SimpleNamespace(waited=False)
        op.wait = lambda: setattr(op, "waited", True)
        self.ops.append(op)
        return op

    def get_run(self, run_id):
        return SimpleNamespace(data=SimpleNamespace(metrics=dict.fromkeys(self.history, 0.0)))

    def get_metric_history(self, run_id, key):
        return self.history[key]

    def set_terminated(self, run_id, status):
        self.calls.append(("set_terminated", run_id, status))


def mlflow_modules(monkeypatch):
    Client.made = []
    entities = SimpleNamespace(
        Param=lambda k, v: SimpleNamespace(key=k, value=v),
        Metric=lambda key, value, timestamp, step: SimpleNamespace(key=key, value=value,
                                                                   timestamp=timestamp,
                                                                   step=step))
    fake_modules(monkeypatch, **{"mlflow.tracking": SimpleNamespace(MlflowClient=Client),
                                 "mlflow.entities": entities})


def test_an_mlflow_without_its_entities_module_names_the_setting_that_asked_for_it(
        monkeypatch, tmp_path):
    fake_modules(monkeypatch, **{"mlflow.tracking": SimpleNamespace(MlflowClient=Client)})
    with pytest.raises(UserError, match=r"^log\.mlflow=true needs mlflow\.entities$"):
        loggers.MLflow(Config().with_overrides({"log.mlflow": True}), tmp_path, None)


def test_mlflow_starts_a_run_in_its_experiment_with_the_config_as_params(monkeypatch, tmp_path):
    mlflow_modules(monkeypatch)
    conf = Config().with_overrides({"log.mlflow": True})
    logger = loggers.MLflow(conf, tmp_path, None)
    (client,) = Client.made
    assert client.uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert logger.run_id == "r1" and logger.ids() == {"mlflow": "r1"}
    assert client.calls[:2] == [("create_experiment", "ironloop"),
                                ("create_run", "e1", tmp_path.name)]
    batches = [c for c in client.calls if c[0] == "log_batch"]
    sizes = [c[3] for c in batches]
    assert all(size == 100 for size in sizes[:-1]) and 0 < sizes[-1] <= 100  # MLflow's limit
    from ironloop.state.drift import flatten

    assert sum(sizes) == len(flatten(conf.to_dict()))


def test_mlflow_uses_the_given_uri_and_an_existing_experiment(monkeypatch, tmp_path):
    mlflow_modules(monkeypatch)
    conf = Config().with_overrides({"log.mlflow": True, "log.mlflow_tracking_uri": "file:/x",
                                    "log.mlflow_experiment": "there"})
    loggers.MLflow(conf, tmp_path, None)
    (client,) = Client.made
    assert client.uri == "file:/x"
    assert client.calls[0] == ("create_run", "e7", tmp_path.name)  # no experiment created


def test_mlflow_params_are_cut_to_6000_characters(monkeypatch, tmp_path):
    mlflow_modules(monkeypatch)
    seen: list = []
    monkeypatch.setattr(Client, "log_batch", lambda self, run_id, metrics=(), params=(),
                        synchronous=True: seen.extend(params))
    conf = Config().with_overrides({"log.mlflow": True, "log.wandb_name": "n" * 7000})
    loggers.MLflow(conf, tmp_path, None)
    (name,) = [p for p in seen if p.key == "log.wandb_name"]
    assert name.value == "n" * 6000
    (lr,) = [p for p in seen if p.key == "optim.lr"]
    assert lr.value == str(conf.optim.lr)


def test_a_resumed_mlflow_run_is_set_running_again_and_nothing_is_created(monkeypatch, tmp_path):
    mlflow_modules(monkeypatch)
    logger = loggers.MLflow(Config().with_overrides({"log.mlflow": True}), tmp_path, "r9")
    (client,) = Client.made
    assert logger.run_id == "r9" and client.calls == [("update_run", "r9", "RUNNING")]


def test_mlflow_writes_whole_rows_in_batches_of_at_most_1000_and_waits_at_flush(
        monkeypatch, tmp_path):
    mlflow_modules(monkeypatch)
    logger = loggers.MLflow(Config().with_overrides({"log.mlflow": True}), tmp_path, "r9")
    (client,) = Client.made
    client.calls.clear()
    row = {"step": 1, "time": 2.5, **{f"m{i}": float(i) for i in range(400)}}
    logger.write_rows([("metrics", {**row, "step": s}) for s in (1, 2, 3)])  # 1200 metrics
    assert client.calls == [("log_batch", "r9", 800, 0, False), ("log_batch", "r9", 400, 0, False)]
    first = client.history["metrics/m5"][0]
    assert (first.value, first.timestamp, first.step) == (5.0, 2500, 1)
    logger.write("epochs", {"step": 3, "val_loss": 0.5})  # no time: now
    assert client.calls[-1] == ("log_batch", "r9", 1, 0, False)
    assert not any(op.waited for op in client.ops)
    logger.flush()
    assert all(op.waited for op in client.ops) and logger._ops == []
    assert logger.held_steps() == {"metrics": 3, "epochs": 3}
    logger.close()
    assert client.calls[-1] == ("set_terminated", "r9", "FINISHED")
    try:
        raise RuntimeError("a crash inside fit()")
    except RuntimeError:
        logger.close()
    assert client.calls[-1] == ("set_terminated", "r9", "FAILED")


def test_exactly_1000_metrics_go_in_one_batch(monkeypatch, tmp_path):
    mlflow_modules(monkeypatch)
    logger = loggers.MLflow(Config().with_overrides({"log.mlflow": True}), tmp_path, "r9")
    (client,) = Client.made
    client.calls.clear()
    row = {f"m{i}": 1.0 for i in range(500)}
    logger.write_rows([("metrics", {**row, "step": 1}), ("metrics", {**row, "step": 2})])
    assert client.calls == [("log_batch", "r9", 1000, 0, False)]
    logger.write_rows([])
    assert len(client.calls) == 1  # nothing to send: no empty batch


class Tracker(loggers.Logger):
    name = "tracker"

    def __init__(self, *args):
        self.args = args


def test_build_starts_the_trackers_asked_for_behind_the_checkpoints(monkeypatch, tmp_path):
    monkeypatch.setattr(loggers, "TensorBoard", lambda run_dir, mark: Tracker("tb", mark))
    monkeypatch.setattr(loggers, "WandB", lambda cfg, run_dir, run_id: Tracker("wandb", run_id))
    monkeypatch.setattr(loggers, "MLflow", lambda cfg, run_dir, run_id: Tracker("mlflow", run_id))
    conf = Config().with_overrides({"log.tensorboard": True, "log.wandb": True,
                                    "log.mlflow": True})
    assert loggers.build(Config(), tmp_path, None, {}) == []
    fresh = loggers.build(conf, tmp_path, None, {})
    assert [g.inner.inner.args for g in fresh] == [("tb", None), ("wandb", None),
                                                   ("mlflow", None)]
    assert all(g.inner.confirmed == 0 and not g.inner.passthrough for g in fresh)
    durable.write_marks(tmp_path, {"tensorboard": 4, "wandb": 6})
    resumed = loggers.build(conf, tmp_path, 8, {"wandb": "w1", "mlflow": "m1"})
    assert [g.inner.inner.args for g in resumed] == [("tb", 4), ("wandb", "w1"), ("mlflow", "m1")]
    assert [g.inner.confirmed for g in resumed] == [4, 6, 0]
    no_ckpt = conf.with_overrides({"checkpoint.enabled": False, "log.wandb": False,
                                   "log.mlflow": False})
    (tb,) = loggers.build(no_ckpt, tmp_path, None, {})
    assert tb.inner.passthrough and tb.inner.inner.args == ("tb", None)
    (tb,) = loggers.build(no_ckpt, tmp_path / "fresh", 3, {})  # a resume without marks: 0
    assert tb.inner.inner.args == ("tb", 0)


def test_a_tracker_that_fails_to_start_warns_and_one_not_installed_is_an_error(
        monkeypatch, tmp_path):
    def broken(cfg, run_dir, run_id):
        raise ConnectionError("no server")

    def missing(cfg, run_dir, run_id):
        raise UserError("log.mlflow=true needs the mlflow package")

    monkeypatch.setattr(loggers, "WandB", broken)
    monkeypatch.setattr(loggers, "MLflow", missing)
    wandb_only = Config().with_overrides({"log.wandb": True})
    with pytest.warns(RuntimeWarning, match=r"^wandb logging failed to start \(ConnectionError: "
                                            r"no server\); training continues without wandb$"):
        assert loggers.build(wandb_only, tmp_path, None, {}) == []
    with pytest.raises(UserError, match="needs the mlflow package"):
        loggers.build(Config().with_overrides({"log.mlflow": True}), tmp_path, None, {})


class Flaky(loggers.Logger):
    name = "flaky"

    def __init__(self):
        self.rows, self.closed = [], False

    def write_rows(self, rows):
        if any(r.get("boom") for _, r in rows):
            raise OSError(28, "No space left on device")
        self.rows += rows

    def held_steps(self):
        return {"metrics": 2}

    def ids(self):
        return {"flaky": "f1"}

    def close(self):
        self.closed = True


def test_a_guarded_tracker_warns_once_then_is_dropped_for_good():
    inner = Flaky()
    guarded = loggers.Guarded(durable.Durable(inner, 0, passthrough=True))
    assert guarded.name == "flaky" and guarded.held() == {"metrics": 2}
    assert guarded.ids() == {"flaky": "f1"} and guarded.confirmed() == 0
    guarded.write("metrics", {"step": 1})
    with pytest.warns(RuntimeWarning, match=r"^flaky logging failed \(OSError: \[Errno 28\] No "
                                            r"space left on device\); training continues "
                                            r"without flaky$"):
        guarded.write("metrics", {"step": 2, "boom": True})
    assert guarded.failed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        guarded.write("metrics", {"step": 3})
        guarded.durable(3)
        guarded.rewind(1)
        assert guarded.held() == {} and guarded.ids() == {} and guarded.confirmed() is None
        guarded.close()
    assert inner.rows == [("metrics", {"step": 1})] and not inner.closed


class Pointing(Flaky):
    """Fails every write, noting where the frame that called ``Guarded._call`` stood."""

    def write_rows(self, rows):
        frame = sys._getframe()
        while "_call" not in frame.f_code.co_name:  # Guarded._call (or mutmut's copy of it)
            frame = frame.f_back
        caller = frame.f_back.f_back  # _call's caller (Guarded.write), then that one's caller
        self.caller = (caller.f_code.co_filename, caller.f_lineno)
        raise OSError(28, "No space left on device")


def test_a_guarded_trackers_warning_points_at_the_line_that_logged():
    inner = Pointing()
    guarded = loggers.Guarded(durable.Durable(inner, 0, passthrough=True))
    with pytest.warns(RuntimeWarning) as got:
        line = sys._getframe().f_lineno + 1
        guarded.write("metrics", {"step": 2})
    assert (got[0].filename, got[0].lineno) == inner.caller
    # mutmut's trampolines put two frames of their own around each call: the caller above is
    # theirs there; a plain run sees this test's line
    if not hasattr(loggers.Guarded.write, "__wrapped__"):
        assert inner.caller == (__file__, line)


def test_a_guarded_tracker_passes_its_calls_through():
    inner = Flaky()
    guarded = loggers.Guarded(durable.Durable(inner, 0))
    guarded.write("metrics", {"step": 1})
    guarded.write("metrics", {"step": 2})
    guarded.rewind(1)
    guarded.durable(5)
    assert inner.rows == [("metrics", {"step": 1})] and guarded.confirmed() == 5
    guarded.close()
    assert inner.closed


def test_the_base_logger_does_nothing_and_writes_rows_one_by_one():
    seen = []

    class One(loggers.Logger):
        def write(self, kind, row):
            seen.append((kind, row["step"]))

    One().write_rows([("metrics", {"step": 1}), ("epochs", {"step": 2})])
    assert seen == [("metrics", 1), ("epochs", 2)]
    base = loggers.Logger()
    assert base.held_steps() is None and base.ids() == {} and base.name == "logger"
    assert base.asynchronous is False
    base.write("metrics", {"step": 1})
    base.flush()
    base.close()


def test_each_tracker_missing_its_package_is_a_user_error_naming_its_setting(monkeypatch,
                                                                            tmp_path):
    fake_modules(monkeypatch)  # nothing installed
    with pytest.raises(UserError, match=r"^log\.tensorboard=true needs torch\.utils\.tensorboard$"):
        loggers.TensorBoard(tmp_path, None)
    with pytest.raises(UserError, match=r"^log\.wandb=true needs wandb$"):
        loggers.WandB(wandb_config(), tmp_path, None)
    with pytest.raises(UserError, match=r"^log\.mlflow=true needs mlflow\.tracking$"):
        loggers.MLflow(Config(), tmp_path, None)


def test_mlflow_holding_only_step_0_says_step_0_not_more(monkeypatch, tmp_path):
    mlflow_modules(monkeypatch)
    logger = loggers.MLflow(Config().with_overrides({"log.mlflow": True}), tmp_path, "r9")
    logger.write_rows([("evals", {"step": 0, "time": 1.0, "val_loss": 2.0, "val_acc": 0.1})])
    assert logger.held_steps() == {"evals": 0}  # an evaluation before the first step
    logger.write_rows([("metrics", {"step": 2, "time": 1.0, "loss": 1.0})])
    assert logger.held_steps() == {"evals": 0, "metrics": 2}


def test_a_guarded_tracker_closed_while_fit_fails_is_told_it_failed():
    finished = []
    inner = SimpleNamespace(name="t", finish=finished.append)
    loggers.Guarded(inner).close()
    try:
        raise RuntimeError("a crash inside fit()")
    except RuntimeError:
        loggers.Guarded(inner).close()
    assert finished == [False, True]


@pytest.mark.parametrize("tracker, module, extra", [
    ("tensorboard", "torch.utils.tensorboard", "tensorboard"), ("wandb", "wandb", "wandb"),
    ("mlflow", "mlflow.tracking", "mlflow")])
def test_a_tracker_not_installed_names_the_extra_that_installs_it(monkeypatch, tmp_path,
                                                                  tracker, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    make = {"tensorboard": lambda: loggers.TensorBoard(tmp_path, None),
            "wandb": lambda: loggers.WandB(wandb_config(), tmp_path, None),
            "mlflow": lambda: loggers.MLflow(Config(), tmp_path, None)}[tracker]
    with pytest.raises(UserError, match=rf"^log\.{tracker}=true needs the .* package, which is "
                                        rf"not installed: pip install 'ironloop\[{extra}\]' "
                                        rf"\(or 'ironloop\[all\]'\)$"):
        make()


def test_a_trackers_start_warning_points_at_the_line_that_built_the_trackers(monkeypatch,
                                                                              tmp_path):
    def broken(cfg, run_dir, run_id):
        frame = sys._getframe()
        while "build" not in frame.f_code.co_name:  # loggers.build (or mutmut's copy of it)
            frame = frame.f_back
        broken.caller = (frame.f_back.f_code.co_filename, frame.f_back.f_lineno)
        raise ConnectionError("no server")

    monkeypatch.setattr(loggers, "WandB", broken)
    with pytest.warns(RuntimeWarning) as got:
        line = sys._getframe().f_lineno + 1
        loggers.build(Config().with_overrides({"log.wandb": True}), tmp_path, None, {})
    assert (got[0].filename, got[0].lineno) == broken.caller
    if not hasattr(loggers.build, "__wrapped__"):  # mutmut's trampolines add frames of their own
        assert broken.caller == (__file__, line)
