"""The twelve mutants named in earlier audits, each put back by hand: ./scripts/mutants named.

Issue 37 found ten one-line bugs that passed every fast test, and two resume contracts (the RNG
state and the guard's skip list put back on resume) that only a slow test caught. Each now has a
fast test named for its contract. This script puts each bug back into src/ironloop (an exact
old -> new string replacement), runs the fast test(s) named for it, and restores the file, so a
later change that weakens one of those tests, or moves the code, shows at once. A sample of
mutmut's mutants (`./scripts/mutants sample`) draws new bugs; this one re-checks known ones, in a
few minutes.

    ./scripts/mutants named                  all twelve: one line each, then "N/12 caught"
    ./scripts/mutants named lock_shared ...  only these (the names in MUTANTS)

Each test first runs on the unmutated code (a test that already fails would "catch" anything).
Exit status 0 only when every mutant run was caught. An old string that is not found exactly
once stops the script naming the mutant: the code moved, and MUTANTS needs updating
(tests/test_named_mutants.py checks that in the fast suite).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src" / "ironloop"
#: Per run of a mutant's tests; a mutant that hangs them counts as caught (as in mutmut).
TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str                             # under src/ironloop
    edits: tuple[tuple[str, str], ...]    # (old, new): each old found exactly once in file
    tests: tuple[str, ...]                # "tests/test_x.py::test_name", fast (not slow)
    why: str                              # the contract it breaks, in a line


MUTANTS = (
    Mutant("zero_grad_keeps_zeros", "engine/train_module.py",
           (("            self.optimizer.zero_grad(set_to_none=True)\n\n",
             "            self.optimizer.zero_grad(set_to_none=False)\n\n"),),
           ("tests/engine/test_loop.py::"
            "test_a_branch_unused_after_its_first_step_is_not_moved_by_adamw_again",),
           "a parameter unused in a window keeps a zero gradient, so AdamW still moves it"),
    Mutant("early_stop_tie_improves", "engine/early_stop.py",
           (("if gain > self.min_delta:", "if gain >= self.min_delta:"),),
           ("tests/engine/test_early_stop.py::"
            "test_a_tie_with_the_best_or_a_gain_of_exactly_min_delta_is_no_improvement",),
           "a metric sitting at its best resets patience forever"),
    Mutant("python_random_not_restored", "state/rng.py",
           (('random.setstate(_as_tuple(state["python"]))', "pass"),),
           ("tests/state/test_rng.py::"
            "test_python_numpy_and_torch_generators_round_trip_through_a_checkpoint",),
           "python's random diverges after a resume"),
    Mutant("verdict_reads_only_the_norm", "guard/verdict.py",
           (("return finite(total + norm)", "return finite(norm)"),),
           ("tests/guard/test_guard.py::"
            "test_a_nonfinite_loss_with_finite_gradients_is_skipped_and_reported",),
           "a non-finite loss with finite gradients is neither skipped nor reported"),
    # The floor lives in two places, the device verdict (what the loop runs) and decide.py's
    # reference (`0.01 * abs(med)`); the same test compares both. Counted once, on the device.
    Mutant("spike_floor_a_tenth", "guard/verdict.py",
           (("0.01 * med.abs()", "0.001 * med.abs()"),),
           ("tests/guard/test_guard.py::"
            "test_a_flat_history_floors_sigma_at_one_percent_of_the_median_on_both_guards",),
           "on a flat history noise is called a spike"),
    Mutant("spike_warmup_off_by_one", "guard/verdict.py",
           (("take = good & (self.good > self.warmup)",
             "take = good & (self.good >= self.warmup)"),),
           ("tests/guard/test_guard.py::"
            "test_the_device_verdict_keeps_the_reference_window_at_every_step_around_warm_up",),
           "the device's spike window differs from the reference guard's by a sample"),
    Mutant("lock_shared", "state/lock.py",
           (("fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
             "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)"),),
           ("tests/state/test_lock.py::"
            "test_a_second_process_is_refused_naming_the_holder_and_a_sigkill_frees_the_lock",),
           "two runs could own one run.dir"),
    Mutant("lock_not_released", "state/lock.py",
           (("fcntl.flock(fd, fcntl.LOCK_UN)", "pass"),),
           ("tests/state/test_lock.py::"
            "test_the_lock_ends_with_the_holder_whatever_copies_of_its_descriptor_live_on",),
           "a child holding a copy of the descriptor keeps run.dir locked after fit()"),
    Mutant("duplicate_signal_window_inverted", "engine/preempt.py",
           (("elif time.monotonic() - self._first_at > DUPLICATE_S:",
             "elif time.monotonic() - self._first_at < DUPLICATE_S:"),),
           ("tests/engine/test_preempt.py::"
            "test_the_same_signal_twice_within_the_window_is_one_request_and_later_kills",),
           "one SIGTERM forwarded twice kills the run with no checkpoint"),
    # A mean of batch means takes both edits (each alone is a different, louder bug).
    Mutant("validation_mean_of_batch_means", "engine/evaluate.py",
           (("values = values * n if weight is None", "values = values if weight is None"),
            ("count = count + (n if weight is None else weight)",
             "count = count + (1 if weight is None else weight)")),
           ("tests/engine/test_evaluate.py::"
            "test_a_ragged_last_validation_batch_weighs_by_its_samples_not_as_a_batch",),
           "a ragged last validation batch weighs as much as a full one"),
    Mutant("resume_rng_not_restored", "engine/run.py",
           (("restore_rng(state)", "pass"),),
           ("tests/state/test_resume.py::"
            "test_a_resume_continues_the_random_streams_a_step_draws_from",),
           "a resumed run's random streams (augmentation, dropout) differ from the unbroken run's"),
    Mutant("resume_skip_list_not_restored", "engine/run.py",
           (('self.data.source.set_skip(guard.get("skip", []))', "pass"),),
           ("tests/state/test_resume.py::"
            "test_a_resume_after_a_rollback_keeps_skipping_the_poisoned_window",),
           "a resume after a rollback trains on the poisoned samples again"),
)


class MovedCode(Exception):
    """An old string is not in its file exactly once: the code moved since MUTANTS was written."""


def mutated(m: Mutant, text: str) -> str:
    for old, new in m.edits:
        found = text.count(old)
        if found != 1:
            raise MovedCode(f"mutant {m.name}: {old!r} is in src/ironloop/{m.file} {found} "
                            f"times, not once: the code moved; update MUTANTS in "
                            f"scripts/named_mutants.py")
        text = text.replace(old, new)
    return text


def run_tests(tests: tuple[str, ...] | list[str]) -> tuple[int | None, str]:
    """pytest's exit code (None: timed out) and its output's tail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"),
           # no .pyc from mutated source: one the same size and second as the original (a `>`
           # for a `<`) would be taken for the original's afterwards
           "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
           "-x", *tests]
    # its own session, so a timeout ends the tests' children too (the lock tests fork)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out[-2000:]
    except BaseException:  # Ctrl-C: its own session does not get the terminal's SIGINT
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc.returncode, out[-2000:]


def try_mutant(m: Mutant) -> tuple[bool, str]:
    """Apply, test, restore: whether the tests caught it, and a word on how."""
    path = SRC / m.file
    original, times = path.read_bytes(), path.stat()
    text = mutated(m, original.decode("utf-8"))  # raises before the file is touched
    try:
        path.write_text(text, encoding="utf-8")
        code, out = run_tests(m.tests)
    finally:
        path.write_bytes(original)
        # the original's mtime too, so that its existing .pyc stays valid
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
        if path.read_bytes() != original:
            raise RuntimeError(f"{path} was not restored after mutant {m.name}: "
                               f"`git checkout {path.relative_to(REPO)}`")
    if code is None:
        return True, "caught (timed out)"
    if code == 1:  # a test failed
        return True, "caught"
    if code == 0:
        return False, "NOT caught"
    # 2-5: an error in collection, no test selected (slow, renamed), ...: no verdict
    print(out, file=sys.stderr)
    return False, f"NOT caught: pytest exit {code}, see its output above"


def main(argv: list[str]) -> int:
    names = {m.name for m in MUTANTS}
    unknown = [a for a in argv if a not in names]
    if unknown:
        print(f"unknown mutant(s) {unknown}; the names: {sorted(names)}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not argv or m.name in argv]
    for m in chosen:  # every old string before any test runs: a moved line fails fast
        try:
            mutated(m, (SRC / m.file).read_text(encoding="utf-8"))
        except MovedCode as e:
            print(e, file=sys.stderr)
            return 2
    tests = sorted({t for m in chosen for t in m.tests})
    code, out = run_tests(tests)
    if code != 0:  # a test that fails on clean code would "catch" every mutant
        print(out, file=sys.stderr)
        print(f"the named tests do not pass on the unmutated code (pytest exit {code}); fix "
              f"that first", file=sys.stderr)
        return 2
    caught = 0
    for m in chosen:
        ok, verdict = try_mutant(m)
        caught += ok
        print(f"{verdict:<18} {m.name:<34} {m.file}: {m.why}", flush=True)
    print(f"{caught}/{len(chosen)} caught")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
