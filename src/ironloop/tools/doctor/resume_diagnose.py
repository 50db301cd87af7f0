"""The resume check's verdict as doctor findings: the headline, and for a resume that is not
exact the first difference with what most likely causes it and the fix."""

from __future__ import annotations

from collections.abc import Sequence

from ironloop.tools.doctor.findings import Finding
from ironloop.tools.doctor.resume_compare import Difference

CHECK = "resume_check"

DATA = ("the data holds a state that a new process starts without (a counter or a cache in "
        "__getitem__, an RNG that ironloop does not seed per sample, a sampler that ignores "
        "set_epoch)",
        "make each sample a function of its index (and the epoch): keep no counter or cache "
        "that changes what __getitem__ returns, draw randomness from torch/numpy/random's "
        "global generators (seeded from (seed, epoch, index)), and give a stream or a custom "
        "sampler state_dict/load_state_dict")
MODEL = ("the model or the step: the batches are equal, the outputs are not; a Python "
         "attribute that forward reads or changes is not in the state_dict, or the step keeps "
         "a global",
         "keep what forward reads in the state_dict: a buffer (self.register_buffer('calls', "
         "torch.zeros((), dtype=torch.long))) instead of a Python attribute; a step with state "
         "takes a `state` argument (ironloop saves it) instead of a global")
OPTIMIZER = ("the optimizer step: the gradients, the optimizer's or the scheduler's state, the "
             "LR or the gradient scaler is not what it was: a callback or a custom optimizer "
             "or scheduler that keeps state outside its state_dict",
             "give every callback that changes the optimizer or the LR state_dict and "
             "load_state_dict, and keep a custom optimizer's and scheduler's state in theirs")
FRESH = ("two fresh processes with the same config differ before any crash: the run is not "
         "reproducible, so no resume can be exact (an RNG without a seed, iteration over a set "
         "of strings (PYTHONHASHSEED), the time or the process id in the data or the model, "
         "non-deterministic kernels on CUDA)",
         "draw randomness only from the generators ironloop seeds from run.seed (python, "
         "numpy, torch), or from generators seeded from it; on CUDA set "
         "torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8")
CALLBACK = ("a callback that holds state but has no state_dict: a crash resets it",
            "give the callback state_dict() and load_state_dict(): every checkpoint then holds "
            "its state (ironloop.callbacks)")
#: What a process held outside the checkpoint and a new one starts over: the cause and the fix.
HIDDEN = {
    "model": ("a Python attribute of a module, not in its state_dict: a new process starts it "
              "over", MODEL[1]),
    "global": ("a module-level global of the user's code that the run changes: a new process "
               "starts it over", MODEL[1]),
    "data": ("an attribute of the dataset that reading it changes: a new process starts it "
             "over", DATA[1]),
    "callback": CALLBACK,
}


def cause_and_fix(d: Difference, plan_resume_from: int) -> tuple[str, str]:
    what = d.what.removeprefix("fresh ")
    if d.what.startswith("fresh"):
        return FRESH
    if what == "batch":
        first = d.step == plan_resume_from + 1
        where = "at the first step after the resume" if first else \
            f"{d.step - plan_resume_from} steps after the resume"
        return f"the batches differ {where}, so {DATA[0]}", DATA[1]
    if what == "loss" and "module" not in d.detail:
        return ("the step: the batches and every module's output are equal, the loss is not: "
                "the step keeps a global or some state outside its `state`", MODEL[1])
    if what == "loss":
        return MODEL
    if what == "checkpoint":
        if ".callbacks." in f".{d.detail}" or "at callbacks" in d.detail:
            return ("a callback's state_dict does not give back what it held",
                    "make the callback's load_state_dict restore everything its state_dict "
                    "saves")
        return ("a part's state_dict misses state that the training changes (see the key)",
                "keep that part's whole state in its state_dict")
    if what in HIDDEN:
        return HIDDEN[what]
    return OPTIMIZER


#: A module or dataset attribute that a resume starts over, while every step was equal.
UNREAD = ("nothing the run computed read it: every batch, module output, loss and weight after "
          "the resume is equal (a counter that forward or __getitem__ only increments)",
          "nothing to do while nothing reads it; if forward (or __getitem__) ever will, keep it "
          "in the state_dict: a buffer (self.register_buffer('calls', torch.zeros((), "
          "dtype=torch.long))) instead of a Python attribute")


def findings_for(headline: str, differences: list[Difference], resume_from: int, steps: int,
                 stateless: list[str], unread: Sequence[Difference] = ()) -> list[Finding]:
    """The headline finding (info when exact, error when not), then every hidden state found
    (errors), then, when the run is exact, attributes that differ but that nothing read and
    callbacks without state_dict (warnings)."""
    if not differences:
        found = [Finding(CHECK, "info", headline, "", "")]
        found += [Finding(CHECK, "warning", f"{d.what} attribute differs after the resume, "
                          f"unread: {d.detail}", *UNREAD) for d in unread]
        return found + [Finding(CHECK, "warning", f"callback {name} holds attributes and has "
                                f"no state_dict; they did not change these {steps} steps",
                                *CALLBACK) for name in stateless]
    first = differences[0]
    where = f"step {first.step} is the first that differs" if first.step else \
        "every step is equal"
    cause, fix = cause_and_fix(first, resume_from)
    found = [Finding(CHECK, "error", f"{headline}: {where}: {first.what}: {first.detail}",
                     cause, fix)]
    for d in differences[1:]:
        if d.what in HIDDEN:
            found.append(Finding(CHECK, "error", f"not restored ({d.what}): {d.detail}",
                                 *HIDDEN[d.what]))
        elif d.what == "checkpoint":  # where the drift ends up: often names the part
            found.append(Finding(CHECK, "error", f"also: {d.detail}",
                                 *cause_and_fix(d, resume_from)))
    return found
