"""benchmarks/run.py --quick at tiny sizes: the runner, every benchmark and the table still work.

No timing is asserted (benchmarks report, tests check behaviour): only that each benchmark
wrote its JSON with numbers in it and that the table was written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def _standalone() -> set[str]:
    """benchmarks/run.py's STANDALONE: the scripts it leaves to be run by hand."""
    import ast

    for node in ast.parse((REPO / "benchmarks" / "run.py").read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == \
                ["STANDALONE"]:
            return set(ast.literal_eval(node.value))
    return set()


def test_run_quick_writes_every_json_and_the_table(tmp_path):
    env = {**os.environ, "IRONLOOP_BENCH_TINY": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    table = tmp_path / "BENCHMARKS.md"
    table.write_text("# Benchmarks\n\nHand-written text that must survive.\n")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick",
                          "--out", str(tmp_path / "out"), "--table", str(table)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    # Every benchmark in benchmarks/ is registered, and every one of them ran: "not built" is
    # for a registered name whose module does not exist, and all of them exist now.
    standalone = _standalone()
    assert all((REPO / 'benchmarks' / f'{n}.py').is_file() for n in standalone)
    built = {p.stem for p in (REPO / "benchmarks").glob("*.py")} - {"_common", "run"} - standalone
    written = {p.stem for p in (tmp_path / "out").glob("*.json")}
    assert written == built, f"unregistered: {built - written}, not built: {written - built}"
    for name in sorted(built):
        result = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert result["status"] == "ok", (name, result["status"])
        assert result["machine"]["torch"]
        medians = [r["median"] for r in result["results"] if r.get("median") is not None]
        assert medians and all(isinstance(m, float) for m in medians), name
        assert all(len(r["raw"]) == r["n"] for r in result["results"] if r.get("n"))
    peers = json.loads((tmp_path / "out" / "peers.json").read_text())
    labels = {r["label"] for r in peers["results"]}
    assert {"mlp: hand DataLoader", "mlp: ironloop", "small_cnn: ironloop"} <= labels
    text = table.read_text()
    assert "Hand-written text that must survive." in text
    assert "### peers" in text and "| mlp: ironloop s/epoch |" in text
    assert "torch " in text
    assert ("GPU none (these are CPU figures" in text) != torch.cuda.is_available()
    assert "no GPU figure exists yet" not in text  # the H200 sections above say otherwise

