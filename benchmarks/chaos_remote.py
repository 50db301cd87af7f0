"""The remote store's chaos campaign (issue #42), rerun as a user meets it: kills, damage, two
writers, outages; each case tried and whether it survived.

Every case runs ``ironloop train`` in subprocesses (digits, an MLP, 4 epochs = 92 steps, a
checkpoint every 10 steps, ``keep_last=3``), mirrored to a local store behind a protocol of
this file's (``chaos://``) whose every request fails while a flag file exists: an outage that
can begin and end mid-run. What "survived" means, per class:

- **kill**: SIGKILL at a random step, run.dir wiped (a new node), ``--resume``: exit 0 and the
  final weights ``torch.equal`` to an uninterrupted run's.
- **damage**: the newest remote checkpoint damaged one way (flipped byte, truncated, missing,
  garbled manifest, ``../`` or absolute names, wrong JSON types, a pickle payload with a
  matching digest), run.dir wiped, ``--resume``: exit 0, fell back to an older one, weights
  equal, no byte outside run.dir changed, no payload ran. Every manifest garbled: exit 2 and
  every remote object kept.
- **writers**: two fresh runs at once (one refused, exit 2), a stray fresh run and a stray
  ``--resume`` elsewhere while a run lives (refused; the live run ends equal), a resume onto
  a prefix another run took over (refused; that run's objects unchanged).
- **outage**: the store down for a fresh run, a new node and ``export`` (exit 2, one line, no
  traceback); down for a whole resume with local checkpoints (exit 0, equal, said); down at
  a resume's start and back mid-run (exit 0, equal, the last checkpoint uploaded).

    python benchmarks/chaos_remote.py [--quick]   # --quick: 2 kills instead of 8
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FLAG = "IRONLOOP_CHAOS_DOWN"  # the store fails every request while this file exists
BASE = ["configs/digits.yaml", "model.name=mlp", "train.epochs=4", "checkpoint.every_steps=10",
        "checkpoint.keep_last=3", "log.every_steps=1", "log.progress=off",
        "doctor.preflight=false", "checkpoint.remote_retries=3", "checkpoint.remote_wait_s=20"]
STEPS = 92


def register() -> None:
    """The ``chaos://`` protocol: file:// that fails while the flag file exists (run in each
    subprocess before the CLI, and here)."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class Chaos(LocalFileSystem):
        protocol = "chaos"

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(str(path).removeprefix("chaos://"))

    def failing(name):
        original = getattr(LocalFileSystem, name)

        def method(self, *args, **kwargs):
            flag = os.environ.get(FLAG)
            if flag and os.path.exists(flag):
                raise ConnectionError("chaos: the store does not answer")
            return original(self, *args, **kwargs)
        return method

    for name in ("put_file", "pipe_file", "cat_file", "get_file", "ls", "rm", "rm_file", "info",
                 "exists", "makedirs", "mkdir", "find", "_open"):
        setattr(Chaos, name, failing(name))
    fsspec.register_implementation("chaos", Chaos, clobber=True)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ironloop-chaos-PWNED",))


class Campaign:
    def __init__(self, root: Path):
        self.root = root
        self.flag = root / "DOWN"
        self.rows: dict[str, list[tuple[str, bool, str]]] = {}
        self.n = 0

    # -- running the CLI ------------------------------------------------------------------
    def cli(self, *args: str) -> subprocess.Popen:
        code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import chaos_remote; "
                f"chaos_remote.register(); from ironloop.cli import entry; entry()")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               FLAG: str(self.flag)}
        return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def train(self, run_dir: Path, url: str, *extra: str) -> subprocess.Popen:
        return self.cli("train", *BASE, f"run.dir={run_dir}", f"checkpoint.remote={url}", *extra)

    @staticmethod
    def done(proc: subprocess.Popen) -> tuple[int, str, str]:
        out, err = proc.communicate(timeout=900)
        return proc.returncode, out, err

    @staticmethod
    def logged(run_dir: Path) -> int:
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            return json.loads(lines[-1])["step"] if lines else 0
        except (OSError, ValueError, KeyError):
            return 0

    def kill_at(self, proc: subprocess.Popen, run_dir: Path, step: int) -> None:
        while self.logged(run_dir) < step and proc.poll() is None:
            time.sleep(0.02)
        proc.kill()
        proc.communicate()

    def fresh(self) -> tuple[Path, str]:
        self.n += 1
        case = self.root / f"case{self.n}"
        case.mkdir()
        return case, f"chaos://{case}/remote"

    # -- what is compared -----------------------------------------------------------------
    def weights(self, run_dir: Path) -> dict | None:
        from safetensors.torch import load_file

        path = run_dir / "final.safetensors"
        return load_file(path) if path.exists() else None

    def equal(self, run_dir: Path) -> bool:
        import torch

        mine = self.weights(run_dir)
        return mine is not None and mine.keys() == self.reference.keys() and all(
            torch.equal(mine[k], self.reference[k]) for k in mine)

    @staticmethod
    def tree(root: Path) -> dict[str, bytes]:
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and p.name != "lease.json"}

    def record(self, kind: str, case: str, ok: bool, why: str = "") -> None:
        self.rows.setdefault(kind, []).append((case, ok, "" if ok else why[-400:]))
        print(f"{kind:8s} {'survived' if ok else 'FAILED  '} {case} {'' if ok else why[-400:]}",
              file=sys.stderr)

    # -- the cases ------------------------------------------------------------------------
    def reference_run(self) -> None:
        run_dir = self.root / "reference"
        code, _, err = self.done(self.cli("train", *BASE, f"run.dir={run_dir}"))
        assert code == 0, err
        self.reference = self.weights(run_dir)

    def stopped_run(self, at: int) -> tuple[Path, str, Path]:
        """A run SIGKILLed once step ``at`` is logged; (case folder, url, run.dir)."""
        case, url = self.fresh()
        run_dir = case / "run"
        self.kill_at(self.train(run_dir, url), run_dir, at)
        return case, url, run_dir

    def kills(self, count: int) -> None:
        rng = random.Random(0)
        for _ in range(count):
            at = rng.randint(5, STEPS - 5)
            _case, url, run_dir = self.stopped_run(at)
            shutil.rmtree(run_dir)
            code, _out, err = self.done(self.train(run_dir, url, "--resume"))
            self.record("kill", f"SIGKILL at step {at}, run.dir wiped",
                        code == 0 and self.equal(run_dir), err)

    def damage(self) -> None:
        from ironloop.state.io import file_digest

        def flip(p):
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0xFF
            p.write_bytes(bytes(data))

        kinds = {
            "a flipped byte": lambda store, m, pt, outside: flip(pt),
            "truncated": lambda store, m, pt, outside: pt.write_bytes(pt.read_bytes()[:100]),
            "missing object": lambda store, m, pt, outside: pt.unlink(),
            "garbled manifest": lambda store, m, pt, outside: m.write_bytes(b'{"step": '),
            "a ../ name": lambda store, m, pt, outside: _rename_in(m, pt.name, "../escape.pt"),
            "an absolute name": lambda store, m, pt, outside: _rename_in(
                m, pt.name, str(outside / "victim.bin")),
            "files a list": lambda store, m, pt, outside: _edit(m, lambda d: {
                **d, "files": list(d["files"])}),
            "a pickle payload, digest matching": lambda store, m, pt, outside: (
                pt.write_bytes(pickle.dumps(_Payload())),
                _edit(m, lambda d: {**d, "files": {**d["files"], pt.name: {
                    "blake2b": file_digest(pt), "size": pt.stat().st_size}}})),
        }
        for name, spoil in kinds.items():
            case, url, run_dir = self.stopped_run(45)
            store = case / "remote"
            newest = sorted((store / "manifests").glob("step-*.json"))[-1]
            pt = store / newest.name.replace(".json", ".pt")
            outside = case / "outside"
            outside.mkdir()
            (outside / "victim.bin").write_bytes(b"precious")
            spoil(store, newest, pt, outside)
            before = self.tree(outside)
            shutil.rmtree(run_dir)
            code, out, err = self.done(self.train(run_dir, url, "--resume"))
            ok = code == 0 and self.equal(run_dir) and self.tree(outside) == before and \
                not Path("/tmp/ironloop-chaos-PWNED").exists()
            self.record("damage", name, ok, err + out[-300:])
        case, url, run_dir = self.stopped_run(45)
        for m in (case / "remote" / "manifests").glob("step-*.json"):
            m.write_bytes(b"\x00" * 64)
        held = self.tree(case / "remote")
        shutil.rmtree(run_dir)
        code, _, err = self.done(self.train(run_dir, url, "--resume"))
        self.record("damage", "every manifest garbled", code == 2 and err.count("\n") == 1 and
                    self.tree(case / "remote") == held, err)

    def writers(self) -> None:
        case, url = self.fresh()
        procs = [self.train(case / f"run{i}", url, "train.epochs=1000") for i in range(2)]
        while all(p.poll() is None for p in procs):
            time.sleep(0.05)
        refused = next(p for p in procs if p.poll() is not None)
        other = next(p for p in procs if p is not refused)
        alive = other.poll() is None
        other.kill()
        other.communicate()
        code, _, err = self.done(refused)
        self.record("writers", "two fresh runs at once", code == 2 and alive and
                    ("in use by run" in err or "at the same moment" in err), err)
        for stray in ("a stray fresh run", "a stray --resume elsewhere"):
            case, url = self.fresh()
            live = self.train(case / "run", url)
            while not list((case / "remote" / "manifests").glob("step-*.json")) and \
                    live.poll() is None:
                time.sleep(0.05)
            # held still while the stray starts: on a loaded machine the live run would
            # otherwise end (its lease released) before the stray's first look
            live.send_signal(signal.SIGSTOP)
            extra = ("--resume",) if "resume" in stray else ()
            code, _, err = self.done(self.train(case / "stray", url, *extra))
            live.send_signal(signal.SIGCONT)
            live_code, _, live_err = self.done(live)
            self.record("writers", stray, code == 2 and "in use by run" in err and
                        live_code == 0 and self.equal(case / "run"), err + live_err)
        case, url, run_dir = self.stopped_run(45)
        code, _, err = self.done(self.train(case / "b", url, "--overwrite"))
        held = self.tree(case / "remote")
        code2, _, err2 = self.done(self.train(run_dir, url, "--resume"))
        self.record("writers", "a resume onto a prefix another run took over",
                    code == 0 and code2 == 2 and "another run" in err2 and
                    self.tree(case / "remote") == held, err + err2)

    def outages(self) -> None:
        for what in ("a fresh run", "a new node's resume", "export"):
            case, url = self.fresh()
            if what != "a fresh run":
                self.kill_at(self.train(case / "run", url), case / "run", 25)
                shutil.rmtree(case / "run")
            self.flag.touch()
            proc = self.cli("export", url, "--out", str(case / "m.safetensors")) \
                if what == "export" else self.train(case / "run", url,
                                                    *(("--resume",) if "resume" in what else ()))
            code, _, err = self.done(proc)
            self.flag.unlink()
            self.record("outage", f"store down: {what}", code == 2 and err.count("\n") == 1 and
                        "Traceback" not in err and "cannot be used" in err, err)
        for what in ("down for the whole resume", "down at the start, back mid-run"):
            case, url, run_dir = self.stopped_run(35)
            self.flag.touch()
            proc = self.train(run_dir, url, "--resume")
            if "back" in what:
                while self.logged(run_dir) < 45 and proc.poll() is None:
                    time.sleep(0.02)
                self.flag.unlink()
            code, out, err = self.done(proc)
            self.flag.unlink(missing_ok=True)
            newest = max((int(p.stem.split("-")[1]) for p in
                          (case / "remote" / "manifests").glob("step-*.json")), default=0)
            landed = newest == STEPS if "back" in what else True
            self.record("outage", what, code == 0 and self.equal(run_dir) and landed and
                        "cannot be used" in out + err, f"newest remote {newest}; " + err)


def _edit(manifest: Path, change) -> None:
    manifest.write_text(json.dumps(change(json.loads(manifest.read_text()))))


def _rename_in(manifest: Path, old: str, new: str) -> None:
    _edit(manifest, lambda d: {**d, "files": {new if k == old else k: v
                                              for k, v in d["files"].items()}})


def run(quick: bool) -> dict:
    register()
    Path("/tmp/ironloop-chaos-PWNED").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as d:
        c = Campaign(Path(d))
        started = time.perf_counter()
        c.reference_run()
        c.kills(2 if quick else 8)
        c.damage()
        c.writers()
        c.outages()
        seconds = time.perf_counter() - started
    classes = {k: {"tried": len(v), "survived": sum(ok for _, ok, _ in v),
                   "failed": [(case, why) for case, ok, why in v if not ok]}
               for k, v in c.rows.items()}
    return {"name": "chaos_remote", "seconds": seconds, "classes": classes}


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    from _common import main
    main(run)
