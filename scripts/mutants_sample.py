"""A seeded random sample of the mutants, run and scored per package: ./scripts/mutants sample N.

The seven packages (engine, state, guard, data, tools, outputs, parallel) make tens of
thousands of mutants; every one against the fast suite is days on 2 cores. A uniform random
sample, drawn per package (N / 7 each, or all of a smaller one), gives
each package's score with its 95% interval (Wilson) in a fraction of that, and the same seed
draws the same mutants again after a fix. The mutants come from mutmut's own list (the .meta
files its generation writes), and mutmut runs them; this only draws and counts.

    ./scripts/mutants sample 350 2        350 mutants (50 per package), seed 2
    ./scripts/mutants sample 350 7        another 350 (seed 7)
    ./scripts/mutants sample 400 0 again  after adding tests: run seed 0's mutants that were not
                                          caught once more (mutmut maps the new tests first)
    ./scripts/mutants sample 350 2 report the scores of what has run so far (a sample stopped
                                          part way); runs no mutant

Writes mutants/sample-<seed>.json: every drawn mutant's status, and the scores.
"""

from __future__ import annotations

import glob
import json
import math
import os
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

#: Every package [tool.mutmut] only_mutate names (tools/ and outputs/ since issue 45).
PACKAGES = ("engine", "state", "guard", "data", "tools", "outputs", "parallel")
# mutmut's exit codes (mutmut/stats.py): caught = killed or timed out
CAUGHT = {1: "killed", 3: "killed", 36: "timeout", -24: "timeout", 24: "timeout",
          152: "timeout", 255: "timeout", 37: "type check"}
OTHER = {0: "survived", 5: "no tests", 33: "no tests", -11: "segfault", -9: "segfault",
         None: "not checked"}


def exit_codes() -> dict[str, int | None]:
    codes: dict[str, int | None] = {}
    # recursive: tools/ has packages of its own (doctor, tune, lab)
    for meta in glob.glob("mutants/src/ironloop/*/**/*.py.meta", recursive=True):
        codes.update(json.loads(Path(meta).read_text())["exit_code_by_key"])
    return codes


def draw(names: list[str], n: int, seed: int) -> list[str]:
    by_package: dict[str, list[str]] = defaultdict(list)
    for name in sorted(names):
        by_package[name.split(".")[1]].append(name)
    rng = random.Random(seed)
    per = n // len(PACKAGES)
    return [m for p in PACKAGES for m in rng.sample(by_package[p], min(per, len(by_package[p])))]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (mid - half) / (1 + z * z / n), (mid + half) / (1 + z * z / n)


def status(code: int | None) -> str:
    return CAUGHT.get(code) or OTHER.get(code) or f"suspicious ({code})"  # type: ignore[arg-type]


def report(sample: list[str], codes: dict[str, int | None], total: dict[str, int]) -> dict:
    rows, lines = {}, []
    for p in [*PACKAGES, "all"]:
        ms = [m for m in sample if p == "all" or m.split(".")[1] == p]
        ran = [m for m in ms if codes.get(m) is not None]
        caught = sum(codes[m] in CAUGHT for m in ran)
        lo, hi = wilson(caught, len(ran))
        rows[p] = {"mutants": total.get(p, sum(total.values())), "drawn": len(ms),
                   "ran": len(ran), "caught": caught, "interval_95": [lo, hi]}
        rate = 100 * caught / max(len(ran), 1)
        lines.append(f"  {p:<7} {caught:>4}/{len(ran):<4} caught  {rate:5.1f}%  (95%: "
                     f"{100 * lo:.1f}-{100 * hi:.1f}%)  of {rows[p]['mutants']:,} mutants")
    # the packages' sizes differ, so the whole is the size-weighted mean of their rates
    # (a run restricted to some packages, e.g. a helper's practice draw, has no others)
    share = {p: rows[p]["caught"] / max(rows[p]["ran"], 1) for p in PACKAGES}
    weighted = (sum(share[p] * total.get(p, 0) for p in PACKAGES)
                / max(sum(total.get(p, 0) for p in PACKAGES), 1))
    rows["weighted"] = weighted
    print("mutation score, a random sample per package:", *lines,
          f"  weighted by package size: {100 * weighted:.1f}%", sep="\n")
    not_caught = sorted(m for m in sample if codes.get(m) is not None and codes[m] not in CAUGHT)
    print(f"not caught ({len(not_caught)}): `./scripts/mutants show NAME` shows one")
    for m in not_caught:
        print(f"  {status(codes[m]):<10} {m}")
    return rows


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    again = sys.argv[3:4] == ["again"]
    scored_only = sys.argv[3:4] == ["report"]  # score what has run, run nothing more
    mutmut = [sys.executable, "-m", "mutmut"]
    if not exit_codes():  # generate the mutants (mutmut's run does; no mutant has this name)
        subprocess.run([*mutmut, "run", "ironloop.no_such_module.*"], check=False)
    codes = exit_codes()
    if not codes:
        print("mutmut generated no mutants: see its output above", file=sys.stderr)
        return 1
    total: dict[str, int] = defaultdict(int)
    for name in codes:
        total[name.split(".")[1]] += 1
    sample = draw(list(codes), n, seed)
    out = Path("mutants") / f"sample-{seed}.json"
    if again and out.exists():  # the same mutants, though code changed since shifts the draw
        sample = [m for m in json.loads(out.read_text())["status"] if m in codes]
    # mutmut reruns every mutant it is given by name: only those without a result go, so an
    # interrupted sample goes on where it stopped
    todo = [m for m in sample if codes.get(m) is None
            or (again and codes[m] not in CAUGHT)]
    if todo and not scored_only:
        workers = os.environ.get("IRONLOOP_MUTANT_WORKERS", "2")
        done = subprocess.run([*mutmut, "run", "--max-children", workers, *todo], check=False)
        if done.returncode != 0:  # e.g. "Failed to run clean test": a test fails unmutated
            print(f"mutmut stopped (exit {done.returncode}) before the sample ran; to see the "
                  f"failing test, set debug = true under [tool.mutmut] in pyproject.toml and "
                  f"run this again", file=sys.stderr)
            return done.returncode
    codes = exit_codes()
    rows = report(sample, codes, dict(total))
    out.write_text(json.dumps({"seed": seed, "scores": rows,
                               "status": {m: status(codes.get(m)) for m in sample}}, indent=1))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
