"""pytorch/examples' word_language_model: its main.py, run unmodified, against ironloop.fit on
its unmodified data.py and model.py (examples/word_language_model.py's factories and step).

Data: wikitext-2's train.txt is missing from the snapshot, so valid.txt is the training split
and test.txt is cut in two halves by lines (valid, test). Size: LSTM, 2 layers, emsize = nhid =
SIZE, bptt 35, batch 20, one epoch (main.py's defaults otherwise: lr 20, clip 0.25,
dropout 0.2, seed 1111).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.outside import common

SIZE, EPOCHS = 64, 1
WLM = common.OUTSIDE / "word_language_model"


def corpus_dir(root: Path) -> Path:
    src = WLM / "data" / "wikitext-2"
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.txt").write_text((src / "valid.txt").read_text())
    lines = (src / "test.txt").read_text().splitlines(True)
    (root / "valid.txt").write_text("".join(lines[:len(lines) // 2]))
    (root / "test.txt").write_text("".join(lines[len(lines) // 2:]))
    return root


def reference(data: Path, out: Path) -> tuple[str, list[float]]:
    """main.py as published, on one thread; its own test ppl and ms/batch lines."""
    r = subprocess.run([sys.executable, "main.py", "--data", str(data), "--epochs", str(EPOCHS),
                        "--emsize", str(SIZE), "--nhid", str(SIZE), "--log-interval", "20",
                        "--save", str(out / "model.pt")], cwd=WLM, capture_output=True,
                       text=True, check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    ms = [float(m) for m in re.findall(r"ms/batch\s+([\d.]+)", r.stdout)]
    ppl = re.search(r"End of training \| test loss\s+[\d.]+ \| test ppl\s+([\d.]+)", r.stdout)
    return f"test ppl {float(ppl.group(1)):.1f}", ms


def ironloop_user(data, run_dir, resume=False, callbacks=()):
    import ironloop
    from examples import word_language_model as wlm
    splits = wlm.data(str(data), str(WLM))
    torch.manual_seed(1111)  # main.py seeds before it builds the model; so does every process
    return ironloop.fit(
        wlm.model(splits["vocab_size"], str(WLM), emsize=SIZE, nhid=SIZE),
        splits["train"], splits["val"], {
            "run.dir": str(run_dir), "run.seed": 1111, "run.threads": 1,
            "train.epochs": EPOCHS, "train.batch_size": 20, "data.shuffle": False,
            "optim.name": "sgd", "optim.lr": 20.0, "optim.momentum": 0.0,
            "optim.weight_decay": 0.0, "clip.max_norm": 0.25, "eval.perplexity": True,
            "log.progress": "off", "checkpoint.every_steps": 50},
        step_fn=wlm.step, test_data=splits["test"], resume=resume, callbacks=list(callbacks))


def main() -> None:
    common.one_thread()
    child = common.child_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus_dir(Path(tmp) / "wikitext-2")
        if child:
            ironloop_user(data, child[0], resume=child[1])
            return
        ref_metric, ref_ms = reference(data, Path(tmp))
        clock = common.StepClock()
        ours = ironloop_user(data, Path(tmp) / "straight", callbacks=[clock])
        resume = common.kill_and_resume("benchmarks.outside.word_lm", Path(tmp) / "killed",
                                        100, Path(tmp) / "straight" / "final.safetensors")
    from examples import word_language_model as wlm
    common.print_row("word_language_model (LSTM)", {
        "ref_metric": ref_metric, "ours_metric": f"test ppl {ours.results['test_ppl']:.1f}",
        "ref_ms": common.median(ref_ms), "ours_ms": common.median(clock.ms),
        "ref_lines": common.file_lines(WLM / "main.py"),
        "ours_lines": common.lines_of(ironloop_user, wlm.data, wlm.model, wlm.step),
        "resume": resume})


if __name__ == "__main__":
    main()
