"""outputs/loggers.py against stand-ins of the trackers' own APIs (TensorBoard's SummaryWriter,
wandb, MLflow's client), in this process: what each tracker is asked to start with, what it is
sent for each row, and how a run's end reaches it. The real trackers' files are read back in
tests/outputs/test_loggers.py."""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace
from typing import ClassVar

import pytest

from ironloop.config import Config
from ironloop.errors import UserError
from ironloop.outputs import durable, loggers


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
