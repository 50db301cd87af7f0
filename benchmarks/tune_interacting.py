"""``ironloop tune`` against an exhaustive grid on a workload whose knobs interact.

The workload is ``examples/cpu_reads.yaml`` (each sample costs about 1 ms of CPU in
``__getitem__``, a tiny MLP): workers take the reads off the main process, and the main
process's threads compete with them for the cores, so ``data.num_workers`` x ``run.threads``
interact. Runs tune within its default budget, then measures every cell of the grid and tune's
applied config in interleaved rounds (each round measures every config once, in a rotated
order, so a load that drifts favours none), and prints JSON: each config's median samples/s and
min-max, and tune's share of the grid's best (goal >= 0.90). Run from the repository root::

    python benchmarks/tune_interacting.py --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def main() -> None:
    from ironloop.config import load_config
    from ironloop.tools.tune import DEFAULT_BUDGET, config_subject, tune_config
    from ironloop.tools.tune.trials import Plan, run_trial

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "examples/cpu_reads.yaml"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    base = ["log.progress=off", "doctor.preflight=false", "run.dir=/tmp/tune_interacting"]
    with contextlib.redirect_stdout(io.StringIO()):
        result = tune_config(args.config, base, budget=args.budget)
    picked = dict(result.chosen)
    grid = [{"data.num_workers": w, "run.threads": t} for w, t in itertools.product(
        (int(x) for x in args.workers.split(",")), (int(x) for x in args.threads.split(",")))]
    configs = {json.dumps(c, sort_keys=True): c for c in grid}
    tuned_key = json.dumps({**{"data.num_workers": 0, "run.threads": 1}, **picked},
                           sort_keys=True)
    configs.setdefault(tuned_key, {**{"data.num_workers": 0, "run.threads": 1}, **picked})
    subject = config_subject(load_config(args.config, base))
    plan = Plan(3, 10, 3)  # the same steps for every config: their rates compare directly
    rates: dict[str, list[float]] = {k: [] for k in configs}
    keys = list(configs)
    for r in range(args.rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            with contextlib.redirect_stdout(io.StringIO()):
                m = run_trial(subject, configs[k], plan, deadline=float("inf"))
            rates[k].append(m.samples_per_s)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    best = max((k for k in configs if configs[k] in grid), key=medians.get)
    print(json.dumps({
        "load_avg": os.getloadavg(), "cpus": os.cpu_count(), "budget_s": args.budget,
        "tune_used_s": result.info.get("used_s"), "tune_applied": picked,
        "tune_speedup_claimed": round(result.speedup, 3),
        "configs": {k: {"median": round(medians[k], 1),
                        "min_max": [round(min(v), 1), round(max(v), 1)]}
                    for k, v in rates.items()},
        "grid_best": best, "share_of_best": round(medians[tuned_key] / medians[best], 3),
    }, indent=1))


if __name__ == "__main__":
    main()
