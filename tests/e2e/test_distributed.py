"""Multi-process (torchrun, gloo on CPU) runs must train exactly like one process.

With a model that has no dropout and no BatchNorm, R ranks at ``train.batch_size=B`` see the
same global batches of R*B samples as one process at ``B*R``; the loop weights each micro-batch
loss so that DDP's average over ranks is the global batch's mean gradient. So the final weights
match to fp32 rounding, the step counts match, and validation, sharded over ranks and
all-reduced, reports the same metrics as validation of the full set in one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO

pytestmark = pytest.mark.slow

N_VAL = 359  # digits: 1438 train / 359 val
TIMEOUT = 600  # seconds per run, a limit only: ~3-6 s on 2 idle cores, 10x that at load 15+
# SGD, not the config's AdamW: AdamW divides each update by the root of its second moment, so an
# element whose gradient is near 0 turns the summation-order difference between ranks and one
# process into an update difference of up to ~lr; SGD keeps it at rounding, where 1e-6 holds.
ARGS = ["configs/digits.yaml", "model.name=mlp", "train.epochs=2", "log.progress=off",
        "log.every_steps=5", "optim.name=sgd", "optim.lr=0.05", "optim.momentum=0.9"]


def launch(run_dir: Path, *overrides: str, ranks: int = 1,
           torchrun: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
    """Start `ironloop train` in one process, or under torchrun with ``ranks`` processes;
    returns the process and the file its output goes to."""
    launcher = [sys.executable, "-m", "ironloop"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
         "--standalone", *torchrun, "-m", "ironloop"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = run_dir.parent / f"{run_dir.name}.log"  # a file, not a pipe: see _stop
    with log.open("w") as out:
        proc = subprocess.Popen([*launcher, "train", *ARGS, f"run.dir={run_dir}", *overrides],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def finish(proc: subprocess.Popen, log: Path, ranks: int) -> None:
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        _stop(proc)
        pytest.fail(f"{ranks} rank(s) still running after {TIMEOUT}s (a hung "
                    f"collective?):\n{log.read_text()[-5000:]}")
    assert proc.returncode == 0, f"{ranks} rank(s) failed:\n{log.read_text()[-8000:]}"


def train(run_dir: Path, *overrides: str, ranks: int = 1) -> Path:
    """`ironloop train` to the end; fails the test on a non-zero exit or a hang."""
    finish(*launch(run_dir, *overrides, ranks=ranks), ranks=ranks)
    return run_dir


def train_here(run_dir: Path, *overrides: str) -> Path:
    """The one-process reference runs: `ironloop train` as ``train`` runs it (the same
    arguments, from the repository, one thread as OMP_NUM_THREADS=1 gives the subprocess), but
    in this process through cli.main: no interpreter start. What the tests compare with it is
    the multi-rank runs, which stay real torchrun launches."""
    from ironloop.cli import main

    with contextlib.chdir(REPO):
        code = main(["train", *ARGS, f"run.dir={run_dir}", *overrides, "run.threads=1"])
    assert code == 0, f"the one-process run into {run_dir} failed (exit {code})"
    return run_dir


def rank_pids(proc: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the ranks torchrun started (read from their environment)."""
    found = {}
    for pid in map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
        if ranks:
            found[int(ranks[0])] = pid
    return found


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, log: Path) -> None:
    """Until rank 0 has logged ``step`` (log.every_steps=1)."""
    deadline = time.monotonic() + TIMEOUT
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and any(json.loads(line)["step"] >= step for line in
                                    metrics.read_text().splitlines() if line.endswith("}")):
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before step {step}:\n{log.read_text()[-5000:]}")
        time.sleep(0.02)
    _stop(proc)
    pytest.fail(f"no step {step} after {TIMEOUT}s:\n{log.read_text()[-5000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """End a hung run and its ranks. torchrun starts each rank in a session of its own, so
    killing torchrun's process group misses them (and orphans would hold a stdout pipe open
    forever); SIGTERM makes torchrun stop its ranks, and any rank that survives is killed."""
    try:
        ranks = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        ranks = []
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in map(int, ranks):
        try:
            if b"ironloop" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def read(run_dir: Path) -> dict:
    return {
        "weights": load_file(run_dir / "final.safetensors"),
        "results": json.loads((run_dir / "results.json").read_text()),
        "epochs": [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text()
                   .splitlines()],
        "metric_steps": [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl")
                         .read_text().splitlines()],
    }


def assert_same_run(one: dict, many: dict, n_val: int = N_VAL) -> None:
    assert one["weights"].keys() == many["weights"].keys()
    for name, w in one["weights"].items():
        torch.testing.assert_close(many["weights"][name], w, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert many["results"]["steps"] == one["results"]["steps"]
    assert many["results"]["epochs"] == one["results"]["epochs"] == 2
    # Only rank 0 logs: each step and each epoch once, as in one process.
    assert many["metric_steps"] == one["metric_steps"]
    assert [r["step"] for r in many["epochs"]] == [r["step"] for r in one["epochs"]]
    for a, b in zip(one["epochs"], many["epochs"]):
        assert b["val_acc"] is not None, "the multi-rank run reported no validation metrics"
        # Sharded validation covers the whole val set: acc is (correct samples) / n_val.
        # (batch accuracies x batch sizes add up in float32: 1e-4 is rounding, a sample is 1)
        assert round(b["val_acc"] * n_val) == pytest.approx(b["val_acc"] * n_val, abs=1e-4)
        assert b["val_acc"] == pytest.approx(a["val_acc"], abs=1e-6)  # one sample: 2.8e-3
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
        # the logged train loss covers every rank's samples, not only rank 0's
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
    assert many["results"]["best_val_acc"] == pytest.approx(one["results"]["best_val_acc"],
                                                            abs=1e-6)


@pytest.fixture(scope="module")
def single_64(tmp_path_factory) -> dict:
    """The reference: one process, batch 64 (23 steps per epoch)."""
    run_dir = train_here(tmp_path_factory.mktemp("one") / "run", "train.batch_size=64",
                    "checkpoint.every_steps=10", "checkpoint.keep_last=10")
    return {**read(run_dir), "dir": run_dir}


#: The two-rank runs that start from nothing (or from a checkpoint of an earlier one), in the
#: order they run: name -> overrides ({root} is the fixture's folder). One torchrun job runs them
#: all (tests/ranks_main.py), each rank training them one after another: a torchrun job per run
#: started 3 interpreters (torchrun's and two ranks', each importing torch) for seconds of
#: training. The tests below read their outputs.
TWO_RANK_RUNS = {
    # DDP, 2 ranks x 32, checkpointing every 10 steps (resumed elsewhere on 1 rank)
    "ddp_2x32": ["train.batch_size=32", "checkpoint.every_steps=10", "checkpoint.keep_last=10"],
    # FSDP2, 2 ranks x 32, its sharded checkpoints mirrored to a file:// checkpoint.remote
    "fsdp_2x32": ["dist.strategy=fsdp", "train.batch_size=32", "checkpoint.every_steps=10",
                  "checkpoint.remote=file://{root}/remote", "--resume"],
    # the same run on a new node: an empty run.dir, its checkpoints in fsdp_2x32's remote only
    "fsdp_new_node": ["dist.strategy=fsdp", "train.batch_size=32", "checkpoint.every_steps=10",
                      "checkpoint.remote=file://{root}/remote", "--resume"],
    "accumulation": ["train.batch_size=16", "train.accumulation_steps=2",
                     "checkpoint.enabled=false"],
    "tail": ["train.batch_size=179", "checkpoint.enabled=false", "dist.strategy=fsdp"],
    "no_val": ["train.batch_size=32", "data.val_fraction=0.0006", "checkpoint.enabled=false"],
    # the world-size changes: 1 x 64 -> 2 x 32 (single_64's checkpoint), 2 x 32 -> 2 x 32
    "one_to_two": ["train.batch_size=32", "--resume", "{single_64}/checkpoints/step-00000010.pt"],
    "two_to_two": ["train.batch_size=32", "--resume",
                   "{root}/ddp_2x32/checkpoints/step-00000030.pt"],
}


def one_job(root: Path, runs: list[tuple[str, list[str]]]) -> Path:
    """``ironloop train`` with each (run.dir name, overrides) of ``runs``, in order, all in one
    torchrun job of 2 ranks (tests/ranks_main.py; a name may come back: a resume of that run);
    fails the test unless every run exited 0 on both ranks. Returns the job's log (each run's
    part starts at a ``=== ranks_main: rank R:`` line)."""
    argvs = [["train", *ARGS, f"run.dir={root / name}", *overrides] for name, overrides in runs]
    (root / "runs.json").write_text(json.dumps(argvs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = root / "ranks.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                                 "--nproc_per_node=2", "--standalone", "tests/ranks_main.py",
                                 str(root / "runs.json")],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    finish(proc, log, ranks=2)
    for name, _ in runs:  # a failed run ends the job: the runs after it leave no exit file
        files = [root / f"{name}.rank{r}.exit" for r in (0, 1)]
        codes = [f.read_text().strip() if f.exists() else "none" for f in files]
        assert codes == ["0", "0"], f"{name}: exit codes {codes}:\n{log.read_text()[-8000:]}"
    return log


def run_output(log: Path, run_dir: Path, rank: int = 0) -> str:
    """What ``rank`` printed in ``one_job``'s run into ``run_dir`` (its first one there)."""
    text = log.read_text()
    head = f"=== ranks_main: rank {rank}: ironloop "
    parts = [p for p in text.split(head)[1:] if f" run.dir={run_dir} " in p.splitlines()[0] + " "]
    assert parts, f"no run into {run_dir} in {log}"
    return parts[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, single_64) -> dict[str, Path]:
    """TWO_RANK_RUNS, trained by one torchrun job: {name: its run.dir}, and "log": the job's
    log."""
    root = tmp_path_factory.mktemp("ranks")
    log = one_job(root, [(name, [o.format(root=root, single_64=single_64["dir"])
                                 for o in overrides])
                         for name, overrides in TWO_RANK_RUNS.items()])
    return {**{name: root / name for name in TWO_RANK_RUNS}, "log": log}


@pytest.fixture(scope="module")
def ddp_2x32(two_ranks) -> dict:
    """DDP, 2 ranks x 32, checkpointing every 10 steps (resumed elsewhere on 1 rank)."""
    return {**read(two_ranks["ddp_2x32"]), "dir": two_ranks["ddp_2x32"]}


def test_two_ranks_equal_one_process_with_the_global_batch(single_64, ddp_2x32):
    two = ddp_2x32
    assert two["results"]["steps"] == 2 * 23  # ceil(1438 / 64) per epoch
    assert_same_run(single_64, two)
    # Checkpoints (on by default) are written by rank 0 alone, from the unwrapped model.
    ckpts = list((two["dir"] / "checkpoints").glob("*.pt"))
    assert ckpts, "rank 0 wrote no checkpoint"


def grad_norms(run_dir: Path) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (run_dir / "metrics.jsonl").read_text()
            .splitlines()]


@pytest.fixture(scope="module")
def fsdp_2x32(two_ranks) -> dict:
    """FSDP2, 2 ranks x 32, its sharded checkpoints (every 10 steps) mirrored to a file://
    checkpoint.remote: the run that test_fsdp_equals_ddp_and_one_process compares and that
    test_fsdp_two_ranks_each_upload_their_shards_and_a_new_node_resumes_them resumes on a new
    node (one run for both; saving changes no weight)."""
    run_dir = two_ranks["fsdp_2x32"]
    return {**read(run_dir), "dir": run_dir, "grad_norms": grad_norms(run_dir),
            "url": f"file://{run_dir.parent}/remote"}


def test_fsdp_equals_ddp_and_one_process(single_64, ddp_2x32, fsdp_2x32):
    # FSDP2: each Linear sharded, then the root; the logged grad norm is the global one.
    fsdp = fsdp_2x32
    assert_same_run(single_64, fsdp)
    assert_same_run(ddp_2x32, fsdp)
    norms = [fsdp["grad_norms"], grad_norms(single_64["dir"])]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_fsdp_two_ranks_each_upload_their_shards_and_a_new_node_resumes_them(fsdp_2x32,
                                                                            two_ranks):
    # (checkpoint.remote's multi-rank case, with tests/state/test_remote.py's others until the two
    # runs here shared one launch with the FSDP equality test above; the new node's resume is the
    # next run of two_ranks' job, into a run.dir of its own that holds nothing)
    from ironloop.state.remote.store import open_remote

    url, new_node = fsdp_2x32["url"], two_ranks["fsdp_new_node"]
    remote = open_remote(url)
    newest = remote.manifest(remote.manifests()[-1])
    assert newest["kind"] == "dcp" and newest["world_size"] == 2
    names = {name.split("/", 1)[1] for name in newest["files"]}
    assert {"extras-rank0.pt", "extras-rank1.pt", ".metadata", "manifest.json"} <= names
    assert {n.split("_")[2] for n in names if n.endswith(".distcp")} == {"0", "1"}  # both ranks
    first = fsdp_2x32["weights"]
    assert f"fetched {url}/step-" in run_output(two_ranks["log"], new_node)
    again = load_file(new_node / "final.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_two_ranks_with_accumulation_equal_one_process(single_64, two_ranks):
    # 2 ranks x 16 x 2 micro-steps = 64 per optimizer step; the first micro-step of each
    # window runs under DDP's no_sync, the second all-reduces the accumulated gradients.
    two = read(two_ranks["accumulation"])
    assert_same_run(single_64, two)


def test_sharded_validation_covers_a_tail_smaller_than_the_ranks(tmp_path, two_ranks):
    # 359 % (179 * 2) == 1: the training sampler's rule would drop the 359th val sample (one
    # sample cannot be split between two ranks). Validation must not: same val_acc as one
    # process, whose denominator is 359. (Training: 1438 % 358 == 6, nothing dropped.)
    # Under FSDP2 (each forward all-gathers) rank 1, with one batch fewer, must run a discarded
    # forward so that rank 0's last one is not left waiting.
    one = read(train_here(tmp_path / "one", "train.batch_size=358",
                          "checkpoint.enabled=false"))
    two = read(two_ranks["tail"])  # 2 x 179, FSDP2
    assert_same_run(one, two)


def test_a_rank_without_validation_samples_still_joins_the_reduction(tmp_path, two_ranks):
    # data.val_fraction=0.0006: 1 val sample of 1797, so rank 1 evaluates nothing. It must
    # still take part in the all-reduce (no hang) and both runs must report that sample.
    extra = ("data.val_fraction=0.0006", "checkpoint.enabled=false")
    one = read(train_here(tmp_path / "one", "train.batch_size=64", *extra))
    two = read(two_ranks["no_val"])  # 2 x 32, the same val_fraction
    assert all(r["val_acc"] in (0.0, 1.0) for r in one["epochs"])
    assert_same_run(one, two, n_val=1)


def assert_same_weights(one: dict, other: dict) -> None:
    assert one["weights"].keys() == other["weights"].keys()
    for name, w in one["weights"].items():
        torch.testing.assert_close(other["weights"][name], w, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert other["results"]["steps"] == one["results"]["steps"]


def test_fsdp_elastic_restart_after_sigkill_then_reshard_to_one_process(single_64, tmp_path):
    # torchrun --max-restarts=1 ... --resume: one rank is SIGKILLed mid-run; torchrun stops the
    # other, starts both again, and they resume from the newest DCP directory on their own.
    # FSDP2 with accumulation, too: 2 ranks x 16 x 2 micro-steps = 64 per step, with no
    # reduce-scatter (and no reshard) after the first backward of each window.
    run_dir = tmp_path / "fsdp"
    proc, log = launch(run_dir, "train.batch_size=16", "train.accumulation_steps=2",
                       "dist.strategy=fsdp",
                       "checkpoint.every_steps=4", "checkpoint.keep_last=20", "log.every_steps=1",
                       "checkpoint.async=true",  # dcp.async_save; committed at the next save
                       "--resume", ranks=2, torchrun=("--max-restarts=1",))
    wait_for_step(run_dir, 14, proc, log)
    os.kill(rank_pids(proc)[1], signal.SIGKILL)
    finish(proc, log, ranks=2)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["from"].endswith(".dcp"), events
    elastic = read(run_dir)
    assert_same_run({**single_64, "metric_steps": list(range(1, 47))}, elastic)
    # The same job's sharded checkpoint of step 8, resumed on ONE process (DCP reshards 2 -> 1)
    # with the same global batch of 64: the rest of the run matches too. (It was written in the
    # background while steps 9-12 ran: async_save must have snapshotted step 8's state.)
    one = read(train_here(tmp_path / "one", "train.batch_size=64",
                          "--resume", str(run_dir / "checkpoints" / "step-00000008.dcp")))
    assert_same_weights(single_64, one)
    # and export consolidates the shards into one safetensors file equal to final.safetensors
    out = tmp_path / "export.safetensors"
    from ironloop.state.export import export_run
    export_run(run_dir, out, which="last")
    for k, w in load_file(out).items():
        torch.testing.assert_close(w, elastic["weights"][k], rtol=0, atol=0)


def test_ddp_checkpoints_resume_on_another_world_size(single_64, ddp_2x32, two_ranks,
                                                      tmp_path):
    # 2 ranks x 32 -> 1 x 64 and 1 x 64 -> 2 x 32: the data position is in samples of the global
    # permutation, so with the global batch kept no sample is repeated or skipped.
    two_to_one = read(train_here(tmp_path / "one", "train.batch_size=64",
                            "--resume", str(ddp_2x32["dir"] / "checkpoints" / "step-00000030.pt")))
    assert_same_weights(single_64, two_to_one)
    one_to_two = read(two_ranks["one_to_two"])  # from single_64's step-00000010.pt
    assert_same_weights(single_64, one_to_two)
    # Every rank's meter is in the checkpoint: the epoch that the resume split (epoch 2, steps
    # 24-46; the checkpoint is at step 30) logs the uninterrupted run's train_loss. 2 -> 1:
    # rank 0 takes both ranks' sums; equal up to fp32 rounding of the batch means (32 vs 64
    # samples). 2 -> 2: each rank its own sums; equal up to the order of float64 additions.
    two_to_two = read(two_ranks["two_to_two"])  # from ddp_2x32's step-00000030.pt
    uninterrupted = ddp_2x32["epochs"][1]["train_loss"]
    assert [r["epoch"] for r in two_to_one["epochs"]] == [2]
    assert two_to_one["epochs"][0]["train_loss"] == pytest.approx(uninterrupted, rel=1e-5)
    assert two_to_two["epochs"][0]["train_loss"] == pytest.approx(uninterrupted, rel=1e-12)


def _two_ranks_by_hand(tmp_path: Path, overrides: list[str],
                       late: float = 0) -> tuple[list[subprocess.Popen], list[Path]]:
    """`ironloop train` as ranks 0 and 1 of one group, started by hand (not torchrun, which
    would tear the job down itself), each writing to tmp_path/rank{r}.log; rank 1 ``late``
    seconds after rank 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        logs.append(tmp_path / f"rank{rank}.log")
        with logs[-1].open("w") as out:
            wait = ["sh", "-c", f'sleep {late:g} && exec "$0" "$@"'] if rank == 1 and late else []
            procs.append(subprocess.Popen(
                [*wait, sys.executable, "-m", "ironloop", "train", *ARGS, *overrides],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs, logs


def test_a_stopped_rank_makes_the_others_fail_naming_the_timeout(tmp_path):
    # Two ranks started by hand (not torchrun, which would tear the job down itself): rank 1 is
    # SIGSTOPped mid-run. Rank 0's next collective gives up after dist.timeout_s and it exits
    # non-zero with a one-line message naming the setting, instead of hanging forever.
    # Rank 1 also starts 2 x dist.timeout_s late: joining the group has its own, generous
    # timeout (RENDEZVOUS_TIMEOUT_S), so a slow start is not a hang.
    run_dir = tmp_path / "run"
    procs, logs = _two_ranks_by_hand(tmp_path, [
        f"run.dir={run_dir}", "train.epochs=100", "train.batch_size=32", "log.every_steps=1",
        "checkpoint.enabled=false", "dist.timeout_s=3"], late=6)
    try:
        wait_for_step(run_dir, 3, procs[0], logs[0])
        os.kill(procs[1].pid, signal.SIGSTOP)
        try:
            procs[0].wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still waits for the stopped rank after {TIMEOUT}s")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = logs[0].read_text()
    assert procs[0].returncode != 0
    assert "dist.timeout_s" in out and "Timed out" in out, out[-3000:]


class _LiveLease:
    """Another node's live lease: refreshed every second, as its run would, so that neither a
    slow start nor the clock-skew bound (a lease from the future is stale) makes it look gone."""

    def __init__(self, path: Path):
        import threading

        self.path, self.done = path, threading.Event()
        self.thread = threading.Thread(target=self._refresh, daemon=True)
        self.thread.start()

    def _refresh(self) -> None:
        while not self.done.is_set():
            lease = {**json.loads(self.path.read_text()), "refreshed": time.time()}
            tmp = self.path.with_name(".lease.json.tmp")
            tmp.write_text(json.dumps(lease))
            os.replace(tmp, self.path)
            self.done.wait(1.0)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def test_rank_zeros_refusal_stops_every_rank_with_one_line_and_no_traceback(tmp_path):
    """A fresh two-rank run onto a checkpoint.remote another node holds (a live lease): rank 0
    refuses before anything is written; rank 1, waiting at the next collective, stopped with
    gloo's "Connection closed by peer" traceback (#42). Now both exit 2, the line once."""
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "lease.json").write_text(json.dumps({
        "lineage": "l" * 32, "run": "r" * 32, "host": "node-b", "pid": 77,
        "refreshed": time.time(), "released": False}))
    procs, logs = _two_ranks_by_hand(tmp_path, [
        f"run.dir={tmp_path / 'run'}", f"checkpoint.remote=file://{remote}",
        "doctor.preflight=false"])
    holder = _LiveLease(remote / "lease.json")  # node-b refreshes its lease while it lives
    try:
        codes = [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        holder.stop()
        for p in procs:
            p.kill()
    text = [log.read_text() for log in logs]
    assert codes == [2, 2], text
    assert not any("Traceback" in t for t in text), text
    said = [line for t in text for line in t.splitlines() if line.startswith("ironloop: error")]
    assert len(said) == 1 and "is in use by run rrrrrrrr (pid 77 on node-b)" in said[0], text
    assert not (tmp_path / "run").exists()


def test_a_two_rank_checkpoint_resumed_by_one_process_keeps_the_global_batch(ddp_2x32, tmp_path,
                                                                             capsys):
    # The same per-rank batch of 32 on 1 process: two micro-batches per step keep the global
    # batch of 64, so the step count, the LR schedule and the data position are the
    # uninterrupted 2-rank run's (a global batch of 32 trained 92 steps).
    step30 = str(ddp_2x32["dir"] / "checkpoints" / "step-00000030.pt")
    one = read(train_here(tmp_path / "one", "train.batch_size=32", "--resume", step30))
    assert_same_weights(ddp_2x32, one)
    assert one["metric_steps"] == [s for s in ddp_2x32["metric_steps"] if s > 30]
    out = capsys.readouterr().out
    assert "world size 2 -> 1: accumulation 1 -> 2, global batch 64 kept" in out
    events = [json.loads(x) for x in (tmp_path / "one" / "events.jsonl").read_text()
              .splitlines()]
    assert [(e["event"], e["world_size"], e["global_batch"]) for e in events] == \
        [("start", 1, 64), ("resume", 1, 64)]
    # 48 per rank cannot make 64: refused before anything runs, in one line, exit 2
    from ironloop.cli import main

    with contextlib.chdir(REPO):
        code = main(["train", *ARGS, f"run.dir={tmp_path / 'bad'}", "train.batch_size=48",
                     "--resume", step30])
    captured = capsys.readouterr()
    errors = [line for line in (captured.out + captured.err).splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1, captured
    assert "global batch of 64" in errors[0] and "train.batch_size=48 x 1 rank(s)" in errors[0]
    assert "Traceback" not in captured.out + captured.err
    assert not (tmp_path / "bad" / "config.yaml").exists()


def two_agents(run_dir: Path, *overrides: str) -> list[tuple[subprocess.Popen, Path]]:
    """Two torchrun agents as two "nodes" on 127.0.0.1 (c10d rendezvous, one rank each,
    ``--nnodes=1:2 --max-restarts=3 --resume``), each writing to run_dir.agent{n}.log; agent 0
    hosts the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agents = []
    for n in (0, 1):
        log = run_dir.parent / f"{run_dir.name}.agent{n}.log"
        with log.open("w") as out:
            agents.append((subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
                 "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-id=t{port}",
                 f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=3", "-m", "ironloop",
                 "train", *ARGS, f"run.dir={run_dir}", *overrides, "--resume"],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT), log))
    return agents


def worker_env(agent: subprocess.Popen) -> tuple[int, dict[str, str]] | None:
    """(pid, environment) of the worker ``agent`` runs now, or None between two of them."""
    for pid in map(int, Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text()
                   .split()):
        try:
            env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text()
                       .split("\0") if "=" in e)
        except OSError:
            continue
        if "TORCHELASTIC_RESTART_COUNT" in env:
            return pid, env
    return None


def next_group(run_dir: Path, starts: int, before: list[int], agents: list) -> list[dict]:
    """Once the group after ``starts`` start events has formed (rank 0 wrote its start event)
    of workers other than ``before``: each agent's worker's environment. Bounded by TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        live = [w for w in (worker_env(proc) for proc, _ in agents) if w is not None]
        if sum(e["event"] == "start" for e in events) > starts and len(live) == len(agents) \
                and not {pid for pid, _ in live} & set(before):
            return [env for _, env in live]
        for proc, log in agents:
            if proc.poll() is not None:
                pytest.fail(f"an agent ended before the group re-formed:\n"
                            f"{log.read_text()[-5000:]}")
        time.sleep(0.02)
    for proc, _ in agents:
        _stop(proc)
    pytest.fail(f"no group re-formed after {TIMEOUT}s (a hang)")


def wait_signalled(pid: int, sig: int) -> None:
    """Until ``sig`` is pending on the stopped process ``pid`` (its agent is stopping it)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        if any(line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) >> (sig - 1)
               & 1 for line in status):
            return
        time.sleep(0.02)
    pytest.fail(f"no signal {sig} reached the stopped worker {pid} after {TIMEOUT}s")


def test_a_crashed_worker_restarts_both_agents_groups_though_their_restart_counts_differ(
        ddp_2x32, tmp_path):
    # One worker SIGKILLed, both agents alive: its agent restarts it with a higher
    # TORCHELASTIC_RESTART_COUNT; the other agent's count rises only when its own worker failed
    # first (its collective broke), not when it restarts for the membership change. Which comes
    # first is a race, which the failure wins on a loaded machine (3 kills of 3 at load 18). So
    # agent 0's worker is paused (SIGSTOP, a slow node) while agent 1's is killed, until agent 0
    # stops it for the membership change; repeated after each new group (at most
    # --max-restarts=3 times) until the two workers of one group hold different counts, read
    # from their environment. The attempt's store is named by what both agree on, so the group
    # meets again (it hung 15 minutes when each rank looked for the store under its own agent's
    # count) and finishes as the uninterrupted run.
    run_dir = tmp_path / "run"
    agents = two_agents(run_dir, "train.batch_size=32", "checkpoint.every_steps=5",
                        "checkpoint.keep_last=20", "log.every_steps=1")
    (proc0, log0), _ = agents
    wait_for_step(run_dir, 12, proc0, log0)
    seen = []  # per group after a kill: each agent's worker's (RANK, TORCHELASTIC_RESTART_COUNT)
    for kill in range(3):
        live = [w for w in (worker_env(proc) for proc, _ in agents) if w is not None]
        assert len(live) == 2, f"a worker is missing before kill {kill + 1}"
        os.kill(live[0][0], signal.SIGSTOP)
        try:
            os.kill(live[1][0], signal.SIGKILL)
            wait_signalled(live[0][0], signal.SIGTERM)
        finally:
            os.kill(live[0][0], signal.SIGCONT)
        envs = next_group(run_dir, kill + 1, [pid for pid, _ in live], agents)
        seen.append([(e["RANK"], int(e["TORCHELASTIC_RESTART_COUNT"])) for e in envs])
        if seen[-1][0][1] != seen[-1][1][1]:
            break
    else:
        for proc, _ in agents:
            _stop(proc)
        pytest.fail(f"the agents' restart counts never differed in 3 kills: {seen}")
    for proc, log in agents:
        finish(proc, log, ranks=2)  # a bounded wait: TIMEOUT, then the test fails
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["world_size"] for e in events if e["event"] == "start"] == [2] * (kill + 2), events
    assert_same_run({**ddp_2x32, "metric_steps": list(range(1, 47))}, read(run_dir))
