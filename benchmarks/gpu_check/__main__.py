"""``scripts/gpu-check``: issue 46's GPU check, one command, at most 8 minutes on the device.

    scripts/gpu-check [--out DIR] [--only PART ...] [--budget SECONDS] [--dry-run]

Runs the seven parts, each in its own process under its own time cap (its share of
``--budget``, 450 s by default, plus what the parts before it left unused), one after the
other: a part that fails, crashes or runs past its cap is recorded as such, and the next one
starts. Each part writes its rows as it measures them, so a part stopped at its cap keeps the
rows it finished. After every part, DIR (default ``$OUT``, else ``gpu-check-out``) gets
``gpu-check.json`` (every row, each naming its device), ``gpu-check.md`` (the same as tables)
and ``gpu-check.log`` (the parts' own output). Exit status 0 when no row failed, 1 otherwise.

``--dry-run`` runs every part at tiny sizes on whatever device there is: on a CPU every code
path that can run there does, and what needs CUDA is a "skipped: no CUDA" row. CI runs it
(tests/e2e/test_gpu_check.py), so the check cannot rot before a GPU is lent.

GPU_CHECK_FAULT=PART:crash or PART:hang (comma-separated) makes a part crash at its start or
hang until its cap: the test of the isolation between parts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: (module, title, seconds of the default budget), in the order of the issue and the tables.
#: The seconds, from the H200 runs of 2026-11-26/27: story 154 with a 60 s tune and 213 with
#: 120 s (now 100 s); syncs 15; peers 53 at 10 ResNet steps an epoch, 173 at 30 with char_gpt
#: left out (now 20 steps, the profile last); resume 28; CUDA tests 19. Issue 58's overhead
#: part (not yet run on a GPU) takes 30 s from the story's slack and 30 from the peers'.
PARTS = [
    ("story", "1. The seed's story: same model, same GPU", 165),
    ("syncs", "2. Host syncs in plain steps (goal: 0)", 25),
    ("peers", "3. ironloop against a hand loop, Lightning and Accelerate", 110),
    ("resume", "4. Bit-exact resume after kill -9, deterministic algorithms", 40),
    ("cuda_tests", "5. The CUDA-only tests (pytest -m gpu)", 35),
    ("rollback", "6. The guard's rollback point at a save: pageable against pinned", 15),
    ("overhead", "7. The loop's overhead to 2%: data on the device, CUDA events, graphed", 60),
]
BUDGET = sum(s for _, _, s in PARTS)  # 450 s: with the grace below and start-up, < 8 minutes
#: A dry run's caps only stop a runaway: on a loaded 2-core CI machine its CPU runs are slow.
DRY_BUDGET = 4 * BUDGET
#: The order they run in: the short verdicts first; each part's cap is its share of the
#: budget plus what the parts before it left unused, so the story, last, gets the slack.
RUN_ORDER = ["syncs", "resume", "cuda_tests", "rollback", "overhead", "peers", "story"]
#: Seconds a part may take past its cap to stop on its own, before it is killed.
GRACE_S = 5.0


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "cpu"


def run_part(name: str, cap: float, rows: Path, log: Path, dry: bool) -> dict:
    """Run one part in its own process group (its DataLoader workers and CLI runs too), kill
    the group at the cap; returns how it ended."""
    deadline = time.time() + cap
    cmd = [sys.executable, "-m", f"benchmarks.gpu_check.{name}", "--rows", str(rows),
           "--deadline", str(deadline), *(["--dry-run"] if dry else [])]
    # A dry run's processes run side by side on a small CPU (the resume's two CLI runs): one
    # torch thread each, or OpenMP's spin-waiting slows them all several times over.
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if dry else {}
    env = {**os.environ, **threads, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    start = time.time()
    with log.open("a") as out:
        out.write(f"\n===== {name} (cap {cap:.0f} s) =====\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code: int | str = proc.wait(timeout=cap + GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "killed at its cap"
    return {"cap_s": round(cap), "seconds": round(time.time() - start, 1), "exit": code}


def part_rows(name: str, rows: Path, ended: dict, device: str) -> list[dict]:
    """The rows the part wrote, plus one for how it ended when it did not end well."""
    found = [json.loads(line) for line in rows.read_text().splitlines()] \
        if rows.exists() else []
    if ended["exit"] != 0 or not found:
        why = (f"killed at its {ended['cap_s']} s cap" if ended["exit"] == "killed at its cap"
               else f"exited {ended['exit']}" if ended["exit"] != 0 else "wrote no rows")
        found.append({"part": name, "row": "the part itself", "device": device,
                      "status": f"failed: {why} (gpu-check.log has its output)",
                      "figures": {"seconds": ended["seconds"]}})
    return found


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    if isinstance(value, list):
        return "-".join(cell(v) for v in value)
    return str(value).replace("|", "\\|")


def markdown(report: dict) -> str:
    lines = [f"# GPU check on {report['device']}", "",
             f"torch {report['torch']}, {report['started']}, "
             f"{'dry run (tiny sizes)' if report['dry_run'] else 'full run'}, "
             f"{report['seconds']:.0f} s in all. Each row names the device it ran on.", ""]
    for name, title, _ in PARTS:  # the order, whatever order they ran in
        rows = [r for r in report["rows"] if r["part"] == name]
        if name not in report["parts"]:
            continue
        ended = report["parts"][name]
        keys = list(dict.fromkeys(k for r in rows for k in r["figures"]))
        lines += [f"## {title}", "",
                  f"{ended['seconds']:.0f} s of its {ended['cap_s']} s cap.", "",
                  "| " + " | ".join(["row", "device", "status", *keys]) + " |",
                  "|" + "---|" * (3 + len(keys))]
        lines += ["| " + " | ".join([cell(r["row"]), cell(r["device"]), cell(r["status"]),
                                     *(cell(r["figures"].get(k)) for k in keys)]) + " |"
                  for r in rows]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [name for name, _, _ in PARTS]
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
    parser.add_argument("--only", nargs="+", choices=names, default=names, metavar="PART",
                        help=f"run these parts only: {', '.join(names)}")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the parts together (default {BUDGET}, a dry run "
                             f"{DRY_BUDGET}); each gets its share, and what one leaves unused "
                             f"goes to the next")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on whatever device there is (CPU: CI)")
    args = parser.parse_args()
    args.budget = args.budget or (DRY_BUDGET if args.dry_run else BUDGET)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # torch's version from its metadata: importing torch here would cost each call 2-3 s of CPU
    # (the parts import it in their own processes)
    report = {"device": device_name(), "torch": metadata.version("torch"),
              "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "dry_run": args.dry_run, "budget_s": args.budget, "seconds": 0.0,
              "parts": {}, "rows": []}
    log, start = out / "gpu-check.log", time.time()
    log.write_text("")
    titles, unused = {name: (title, share) for name, title, share in PARTS}, 0.0
    for name in RUN_ORDER:
        if name not in args.only:
            continue
        title, share = titles[name]
        print(f"gpu-check: {title} ...", flush=True)
        # In DIR while the part runs: if the whole command is stopped, its rows still come back.
        rows = out / f"{name}.rows"
        rows.unlink(missing_ok=True)
        cap = share * args.budget / BUDGET + unused
        ended = run_part(name, cap, rows, log, args.dry_run)
        unused = max(0.0, cap - ended["seconds"])
        report["parts"][name] = ended
        report["rows"] += part_rows(name, rows, ended, report["device"])
        rows.unlink(missing_ok=True)
        report["seconds"] = round(time.time() - start, 1)
        (out / "gpu-check.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "gpu-check.md").write_text(markdown(report))
    print(markdown(report))
    failed = [r for r in report["rows"] if r["status"].startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
