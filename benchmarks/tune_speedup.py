"""``ironloop tune`` on a loader-bound example, and whether its speedup holds when trained.

Tunes ``--config`` (default ``examples/cpu_reads.yaml``: each sample costs about 1 ms of CPU,
a tiny MLP, no workers; ``examples/slow_reads.yaml`` sleeps instead), then trains the input
config and the tuned one in alternating order, ``--reps`` times each, and prints JSON: the
speedup the tune projected (the median of its paired ratios) and the measured ones (training
samples/s of the tuned run over the input's, one ratio per pair), with the load average. Run
from the repository root, as a new user would (no OMP_NUM_THREADS)::

    python benchmarks/tune_speedup.py --epochs 1 --reps 2 --budget 120
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def train_rate(config: Path, run_dir: Path, epochs: int) -> float:
    """Training samples/s of one run (results.json: samples over training seconds)."""
    from ironloop.config import load_config
    from ironloop.tools.recipe import train_config

    cfg = load_config(config, [f"run.dir={run_dir}", f"train.epochs={epochs}",
                               "doctor.preflight=false", "log.progress=off",
                               "checkpoint.enabled=false"])
    with contextlib.redirect_stdout(io.StringIO()):
        result = train_config(cfg)
    n = cfg.data.kwargs.get("n", 2048)
    return n * epochs / result.results["train_seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--budget", type=float, default=120.0)
    p.add_argument("--config", default="examples/cpu_reads.yaml")
    args = p.parse_args()
    os.chdir(REPO)  # examples.slow_reads is imported from the repository root
    sys.path.insert(0, str(REPO))
    from ironloop.tools.tune import tune_config

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = Path(args.config)
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            tuned = tune_config(str(config), [f"run.dir={tmp / 'tune'}",
                                              f"train.epochs={args.epochs}"], args.budget)
        print(table.getvalue(), file=sys.stderr)  # the tune's own table, for the README
        tuned_yaml = tmp / "tuned.yaml"
        tuned_yaml.write_text((tmp / "tune" / "tuned.yaml").read_text())
        ratios, rates = [], {"input": [], "tuned": []}
        for rep in range(args.reps):
            order = [("input", config), ("tuned", tuned_yaml)]
            pair = {}
            for name, path in order if rep % 2 == 0 else order[::-1]:
                pair[name] = train_rate(path, tmp / f"{name}-{rep}", args.epochs)
                rates[name].append(round(pair[name], 2))
            ratios.append(pair["tuned"] / pair["input"])
        tuned_config = yaml.safe_load(tuned_yaml.read_text())
    print(json.dumps({
        "chosen": tuned.chosen, "tune_speedup": round(tuned.speedup, 3),
        "tune_table_ratio": {r.setting: r.ratio and round(r.ratio, 3) for r in tuned.rows},
        "tune_pairs": {r.setting: r.pairs for r in tuned.rows if r.pairs},
        "tune_verdicts": {r.setting: r.verdict or r.reason for r in tuned.rows},
        "trained_speedup_median": round(statistics.median(ratios), 3),
        "trained_speedup_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "samples_per_s": rates, "epochs": args.epochs, "budget_s": args.budget,
        "config": args.config, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "tuned_yaml": tuned_config,
        "load_average": {"before": load_before, "after": os.getloadavg()}}, indent=2))


if __name__ == "__main__":
    main()
