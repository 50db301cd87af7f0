"""tools.doctor.resume_record: what a scratch run records (digests, attributes, module outputs,
micro-batches and losses, the end record) and how it starts."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch import nn

from ironloop.config import load_config
from ironloop.tools.doctor import resume_check as rc, resume_record
from ironloop.tools.doctor.resume_compare import read_records
from tests.tools.doctor.resume_helpers import CASES, config

# --- resume_record: what a scratch run records ----------------------------------------------

def test_a_digest_hashes_dtype_shape_bytes_and_the_structure_around_them():
    import hashlib

    class Output:  # a Hugging Face ModelOutput's way to give its tensors
        def to_tuple(self):
            return (torch.tensor([2], dtype=torch.int8),)

    t = torch.tensor([[1.0, 2.0]])
    h = hashlib.blake2b(digest_size=8)
    for part in (b"K'a'", b"L4", b"Ttorch.float32(1, 2)", t.numpy().tobytes(), b"3", b"'s'",
                 b"None", b"K'b'", b"L1", b"Ttorch.int8(1,)", b"\x02", b"K'c'", b"object"):
        h.update(part)
    assert resume_record.digest({"a": [t, 3, "s", None], "b": Output(), "c": object()}) == \
        h.hexdigest()


def test_a_digest_tells_apart_what_a_step_could_see_differently():
    d = resume_record.digest
    x = torch.zeros(2)
    assert d(x) == d(x.clone()) and len(d(x)) == 16
    assert d(torch.zeros(2)) != d(torch.zeros(1, dtype=torch.float64))  # the same 8 bytes
    assert d(torch.zeros(2)) != d(torch.zeros(1, 2))
    assert d([[1], [2]]) != d([[1, 2]])
    assert d({"a": 1}) != d({"b": 1})
    assert d((1, 2)) == d([1, 2])
    assert d(1) != d("1") and d(True) != d(1)
    t = torch.arange(6.0).reshape(2, 3)
    assert d(t.t()) == d(t.t().contiguous())  # values, not the memory layout
    assert d(t.requires_grad_()) == d(t.detach())


class Holder:
    pass


def test_plain_attributes_are_scalars_short_plain_lists_and_hashed_tensors():
    obj = Holder()
    obj.n, obj.s, obj.none, obj.flag, obj.rate = 3, "x", None, True, 0.5
    setattr(obj, "__private", 1)
    obj.ok_list, obj.ok_tuple = list(range(64)), (1, "a")
    obj.long, obj.mixed, obj.other = list(range(65)), [1, object()], object()
    obj.small = torch.arange(4.0)
    obj.limit = torch.zeros(1_000_000, dtype=torch.uint8)
    obj.big = torch.zeros(1_000_001, dtype=torch.uint8)
    obj.param = nn.Parameter(torch.ones(2))
    found = resume_record.plain_attributes(obj, frozenset({"rate"}))
    assert found == {"n": 3, "s": "x", "none": None, "flag": True, "ok_list": list(range(64)),
                     "ok_tuple": [1, "a"], "small": f"tensor {resume_record.digest(obj.small)}",
                     "limit": f"tensor {resume_record.digest(obj.limit)}"}
    assert list(found) == sorted(found)
    assert resume_record.plain_attributes(obj)["rate"] == 0.5
    assert resume_record.plain_attributes(5) == {}


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.factor = 2.0

    def forward(self, x):
        return self.fc(x) * self.factor


def test_module_attributes_are_named_by_class_and_module_without_the_mode():
    found = resume_record.module_attributes(Scaled())
    assert found["Scaled.factor"] == 2.0
    assert found["Linear.in_features (module fc)"] == 2
    assert found["Linear.out_features (module fc)"] == 3
    assert not any(k.startswith(("Scaled.training", "Linear.training", "Scaled.calls",
                                 "Linear.weight")) for k in found)


def test_user_modules_follow_a_wrapped_function_and_skip_what_is_not_imported(monkeypatch):
    from tests import resume_cases

    class Wrapper:
        __wrapped__ = resume_cases.counting_step

    nameless = Holder()
    nameless.__module__ = None  # its class's module stands
    lost = Holder()
    lost.__module__ = "not_imported_anywhere"
    assert resume_record.user_modules(Wrapper()) == [resume_cases]
    assert resume_record.user_modules(nameless, lost) == [sys.modules[__name__]]
    assert resume_record.user_modules(nn.Linear, resume_record.digest, torch.zeros) == []


def test_module_globals_are_the_plain_module_level_values(monkeypatch):
    import types

    mod = types.ModuleType("my_counters")
    mod.N, mod.name, mod.rate, mod.off = 3, "x", 0.5, None
    mod.items, mod.fn, mod.__secret__ = [1], len, 1
    other = types.ModuleType("other_counters")
    other.A = 1
    found = resume_record.module_globals([mod, other])
    assert found == {"my_counters.N": 3, "my_counters.name": "x", "my_counters.off": None,
                     "my_counters.rate": 0.5, "other_counters.A": 1}
    assert list(found)[:4] == ["my_counters.N", "my_counters.name", "my_counters.off",
                               "my_counters.rate"]


def test_the_recorder_hashes_every_modules_training_output_not_evaluations(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    recorder = resume_record.Recorder(tmp_path / "r.jsonl", model, None, [], None)
    x = torch.ones(1, 2)
    hidden = model[0](x)
    recorder.outputs.clear()
    out = model(x)
    assert recorder.outputs == [["0 (Linear)", resume_record.digest(hidden)],
                                ["1 (ReLU)", resume_record.digest(out)],
                                ["the model (Sequential)", resume_record.digest(out)]]
    model.eval()
    model(x)
    assert len(recorder.outputs) == 3
    recorder.file.close()


def test_the_recorder_records_training_micro_batches_and_losses_of_either_kind_of_step(
        tmp_path):
    model = nn.Linear(2, 1)
    recorder = resume_record.Recorder(tmp_path / "r.jsonl", model, None, [], None)
    batch = (torch.ones(1, 2), torch.zeros(1))

    def plain(model, batch):
        return torch.tensor(0.25), {"acc": 1}

    def stateful(model, batch, state):
        return torch.tensor(1.5), {}, state + 1

    assert recorder.wrap(plain)(model, batch) == (torch.tensor(0.25), {"acc": 1})
    assert recorder.wrap(stateful)(model, batch, 4)[2] == 5
    model.eval()  # evaluation runs the step too: not recorded
    recorder.wrap(plain)(model, batch)
    assert recorder.batches == [resume_record.digest(batch)] * 2
    assert recorder.losses == [0.25, 1.5]
    recorder.on_step_end(None, {"step": 7})
    assert (recorder.batches, recorder.losses, recorder.outputs) == ([], [], [])
    recorder.file.close()
    line = json.loads((tmp_path / "r.jsonl").read_text())
    assert line == {"step": 7, "batches": [resume_record.digest(batch)] * 2,
                    "losses": [0.25, 1.5], "modules": [],
                    "weights": resume_record.digest(list(model.parameters()))}


def _module(monkeypatch, name: str, **values):
    import types

    mod = types.ModuleType(name)
    vars(mod).update(values)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_the_end_record_holds_the_attributes_and_globals_a_checkpoint_does_not(
        tmp_path, monkeypatch):
    from ironloop.callbacks import Callback

    for name in ("u_step", "u_model", "u_layer", "u_data", "u_callback"):
        _module(monkeypatch, name, VALUE=name)
    Net = type("Net", (nn.Module,), {"__module__": "u_model"})
    Layer = type("Layer", (nn.Identity,), {"__module__": "u_layer"})
    Data = type("Data", (), {"__module__": "u_data"})
    Saved = type("Saved", (Callback,), {"__module__": "u_callback", "state_dict": lambda s: {}})
    Counter = type("Counter", (Callback,), {"__module__": "tests.resume_cases"})

    def step(model, batch):
        return torch.tensor(0.0), {}

    step.__module__ = "u_step"
    model = Net()
    model.inner, model.calls = Layer(), 4
    data = Data()
    data.reads = 11
    saved, counter = Saved(), Counter()
    counter.seen = 2
    path = tmp_path / "r.jsonl"
    recorder = resume_record.Recorder(path, model, data, [counter, saved], step)
    recorder.on_train_end(None, {"step": 9})
    assert recorder.file.closed
    end = json.loads(path.read_text())
    assert end["end"] == 9
    from tests import resume_cases

    assert end["state"] == {
        "model": resume_record.module_attributes(model), "data": {"Data.reads": 11},
        "callbacks": {"0:Counter": {"state_dict": False, "attributes": {"seen": 2}},
                      "1:Saved": {"state_dict": True, "attributes": {}}},
        "globals": {**{f"{n}.VALUE": n for n in ("u_step", "u_model", "u_layer", "u_data",
                                                  "u_callback")},
                    "tests.resume_cases.CALLS": resume_cases.CALLS,
                    "tests.resume_cases.N": resume_cases.N}}
    assert end["state"]["model"]["Net.calls"] == 4


def test_the_recorded_step_is_the_one_fit_would_run(tmp_path, monkeypatch):
    from ironloop.data.bundle import DataBundle
    from ironloop.engine.step_fns import lm_step
    from ironloop.errors import ConfigError
    from tests import resume_cases

    bundle = DataBundle(None, None, None, (2,), 3)
    model = nn.Linear(2, 3)
    x, y = torch.randn(4, 2), torch.tensor([0, 1, 2, 0])
    cfg = load_config(None, [])
    loss, _ = resume_record.run_step(cfg, model, bundle)(model, (x, y))
    assert torch.equal(loss, nn.functional.cross_entropy(model(x), y))
    smooth = load_config(None, ["loss.label_smoothing=0.2"])
    loss, _ = resume_record.run_step(smooth, model, bundle)(model, (x, y))
    assert torch.equal(loss, nn.functional.cross_entropy(model(x), y, label_smoothing=0.2))
    with pytest.raises(ConfigError, match="2 entries but the data has 3 classes"):
        resume_record.run_step(load_config(None, ["loss.class_weights=[1, 2]"]), model, bundle)
    _module(monkeypatch, "u_loss", seven=lambda out, target: torch.tensor(7.0))
    loss, _ = resume_record.run_step(load_config(None, ["loss.name=u_loss:seven"]), model,
                                     bundle)(model, (x, y))
    assert loss.item() == 7.0
    named = load_config(None, [f"train.step_fn={CASES}:counting_step"])
    assert resume_record.run_step(named, model, bundle) is resume_cases.counting_step
    assert resume_record.run_step(load_config(None, ["train.step_fn=lm"]), model,
                                  bundle) is lm_step


def test_warm_imports_import_the_modules_the_config_names_and_skip_broken_ones(
        tmp_path, monkeypatch):
    for name in ("warm_data", "warm_model", "warm_step", "warm_loss"):
        (tmp_path / f"{name}.py").write_text("X = 1\n")
    (tmp_path / "warm_broken.py").write_text("raise RuntimeError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("warm_data", "warm_model", "warm_step", "warm_loss", "warm_broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    cfg = load_config(None, ["data.name=warm_data:d", "model.name=warm_model:m",
                             "train.step_fn=warm_step:s", "loss.name=warm_loss:l"])
    try:
        resume_record.warm_imports(cfg)
        assert all(n in sys.modules for n in ("warm_data", "warm_model", "warm_step",
                                              "warm_loss"))
        resume_record.warm_imports(load_config(None, ["data.name=warm_broken:d",
                                                      "model.name=warm_missing:m"]))
        assert "warm_broken" not in sys.modules
    finally:
        for name in ("warm_data", "warm_model", "warm_step", "warm_loss"):
            sys.modules.pop(name, None)


def test_a_scratch_run_that_fails_on_a_user_error_exits_2_with_the_error_in_its_log(
        tmp_path, monkeypatch):
    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    threads = []
    monkeypatch.setattr(resume_record.os, "_exit", exit_)
    monkeypatch.setattr(resume_record.torch, "set_num_threads", threads.append)
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps({"config": {"nosuch": {}}}))
    saved = os.dup(1), os.dup(2)
    try:
        with pytest.raises(Exited) as e:
            resume_record.forked(str(spec), str(tmp_path / "bad.log"), 3)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    # one line-buffered stream on fd 1 for both: a kill keeps every line; fd 1 stays open
    assert sys.stdout is sys.stderr and sys.stdout.fileno() == 1
    assert sys.stdout.line_buffering and not sys.stdout.buffer.raw.closefd
    assert e.value.args == (2,) and threads == [3]
    assert (tmp_path / "bad.log").read_text().startswith(
        "ironloop: error: unknown config section 'nosuch'")


def test_a_scratch_run_records_every_step_and_resumes_in_its_own_directory(tmp_path,
                                                                         monkeypatch):
    """record_run in this process, as each scratch process runs it: the config's model and
    data, the spec's callbacks, the record of the rank, and the resume flag."""
    monkeypatch.delenv("RANK", raising=False)  # rank 0's record when not under torchrun
    cfg = config(tmp_path, "train.step_fn=tests.resume_cases:counting_step")
    spec = {"config": rc.scratch_config(cfg, rc.plan_for(3), tmp_path / "straight", False),
            "record": str(tmp_path / "straight-rank{rank}.jsonl"),
            "callbacks": [f"{CASES}:StepCounter"], "resume": False}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert resume_record.main([str(path)]) == 0
    records = read_records(tmp_path / "straight-rank0.jsonl")
    assert sorted(records.steps) == [1, 2, 3]
    assert all(len(r["batches"]) == len(r["losses"]) == 1 for r in records.steps.values())
    assert records.state["callbacks"] == {"0:StepCounter": {"state_dict": False,
                                                            "attributes": {"seen": 3}}}
    assert "tests.resume_cases.CALLS" in records.state["globals"]  # the step's module
    assert records.state["data"]["TensorData.x"].startswith("tensor ")
    # the same run resumed: nothing left to train, only the end of the run recorded again
    path.write_text(json.dumps({**spec, "resume": True}))
    assert resume_record.main([str(path)]) == 0
    again = read_records(tmp_path / "straight-rank0.jsonl")
    assert again.steps == records.steps
    assert (tmp_path / "straight-rank0.jsonl").read_text().count('"end"') == 2
    assert resume_record.main([str(tmp_path / "missing.json")]) == 70
