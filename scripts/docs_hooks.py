"""The reference pages, generated from the code and committed under docs/, so that their links
read on GitHub as on the site. ``python scripts/docs_hooks.py`` writes them; as an MkDocs hook
(mkdocs.yml `hooks`) it fails the build when one is stale, and tests/e2e/test_docs.py checks the
same without a build. Never written by hand, so they cannot drift from the code:

- reference/config.md: every config key, read off the config dataclasses (``ironloop.config``:
  the same fields ``ironloop train help`` prints), with its type, default, allowed values, doc,
  and whether ``--resume`` lets it change (``ironloop.state.drift``);
- reference/cli.md: every command and flag, walked from the argparse parser (``ironloop.cli``);
- reference/run-files.md: the files a run writes, from ``ironloop.state.run_dir.OUTPUTS``,
  each with its description below (a name without one fails the build, naming this file);
- project/benchmark-figures.md: BENCHMARKS.md as it is.

The Python API page (reference/api.md) is mkdocstrings directives over the docstrings.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import os
import sys
import typing
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
# The checkout's own code, even where another ironloop is installed.
sys.path.insert(0, str(REPO / "src"))

from ironloop import cli, config as config_mod  # noqa: E402
from ironloop.state import drift, run_dir  # noqa: E402

GENERATED = ("*Generated from {source} by `python scripts/docs_hooks.py`; do not edit by "
             "hand.*")

#: What each file or directory in OUTPUTS holds. A file added to OUTPUTS without a line
#: here fails the docs build: say what it holds.
RUN_FILES: dict[str, str] = {
    "config.yaml": "the resolved config, and a `used:` block with what the run actually used: "
    "the model's class and parameter count, each dataset's type and size, the optimizer's and "
    "scheduler's classes, a custom `loss_fn`/`step_fn`. For a `fit()` run, `model.name` and "
    "`data.name` read `user: <ClassName>` (never a default that was not used). `ironloop "
    "report` shows the same",
    "run.json": "the environment: torch version, device and its name, world size, git commit of "
    "the working directory (`+dirty` when it has changes; null outside a git checkout), the "
    "command line, Python, host; then one such entry per resume under `resumes`",
    "metrics.jsonl": "one line per logged optimizer step: `step`, `epoch`, `loss` (mean since "
    "the previous line), `lr` (the LR that step used), `grad_norm` (pre-clip), `clipped` "
    "(clipped steps since the previous line), `steps`, `skipped` (fp16 overflow skips), "
    "`samples_per_s`, `time`",
    "epochs.jsonl": "one line per epoch: `epoch`, `step`, `train_loss`, `val_loss`, `val_acc`, "
    "`lr`, `seconds` (training + validation), `train_seconds`, `val_seconds`, `samples_per_s` "
    "(training), `clipped_frac`, `skipped`, `time_split` (seconds per part, see "
    "[Find where the time goes](../how-to/timing.md); this process's share of an epoch that a "
    "resume split). With `eval.every_steps`, the `val_*` are those of the latest evaluation. "
    "An epoch that a resume split counts both processes' training time for its samples: the "
    "same figures as an uninterrupted epoch",
    "evals.jsonl": "one line per evaluation: `step`, `epoch`, `val_loss`, `val_acc` and the "
    "step's other metrics, `lr`, `seconds`",
    "scalars.jsonl": "what callbacks log with `run.log_scalars({...})`: `step`, `epoch`, their "
    "values, `time`",
    "events.jsonl": "one line per resume: the step resumed from and its `epoch` (1-based, as "
    "the console says it), the last step the dead process logged, and `steps_redone` (the "
    "work the crash cost); one per preemption (signal, step)",
    "guard.jsonl": "one line per bad step, rollback and guard stop (see "
    "[The guard](../how-to/guard.md))",
    "checkpoints": "`last.pt`, `best.pt`, rolling `step-NNNNNNNN.pt` (under FSDP, `.dcp` "
    "directories)",
    "final.safetensors": "the final weights, after any best-weights restore",
    "final_avg.safetensors": "the averaged weights (average.kind: EMA or SWA, SWA's BatchNorm "
                             "statistics recomputed); only with weight averaging on",
    "results.json": "`best_val_acc`, `final_val_acc`, `test_acc`/`test_loss`/`test_ppl` "
    "(datasets with a test split; `test_ppl` with `eval.perplexity`) and `test_weights` (`best` "
    "when a best exists: restored by early stopping, or `best.pt`; else `last`), `steps`, "
    "`epochs` (1-based like the console: the epochs trained in, one "
    "that `train.max_steps` ended the run inside included), `seconds` (sum of the epochs' "
    "training + validation, and that open epoch's so far), "
    "`train_seconds` (training time over every process of the run), "
    "`wall_seconds_this_process`, `stopped_mid_epoch` (when `train.max_steps` ended the run "
    "inside an epoch), `bad_steps`, `rollbacks`, `skipped_samples`, `time_split` (seconds per "
    "part, this process), ...",
    "trace": "a `torch.profiler` trace of a few steps, with `profile.trace=true`",
    "tb": "TensorBoard events, with `log.tensorboard=true` (`pip install "
    "'ironloop[tensorboard]'`)",
    "wandb": "W&B's offline files, with `log.wandb=true` (see "
    "[Trackers](../how-to/trackers.md))",
    "mlflow.db": "MLflow's SQLite store, with `log.mlflow=true` and no "
    "`log.mlflow_tracking_uri`",
    "trackers.json": "how far each tracker has been handed the logs, so a resume sends each "
    "step exactly once",
    "report": "`ironloop report`'s plots, `report.md` and `report.html`",
}

#: Files other commands write into run.dir; --overwrite leaves them (they are not OUTPUTS).
OTHER_FILES: dict[str, str] = {
    "doctor.json": "the preflight's findings (`ironloop doctor` writes it too; "
    "`--resume-check` adds `resume_check`)",
    "lr_find.png": "`ironloop doctor --lr-find`'s LR range test",
    "tune.json": "`ironloop tune`'s measurements: `info`, `baseline`, `trials`, `chosen`, "
    "`trajectory_winners`, `speedup`",
    "tuned.yaml": "`ironloop tune`'s config with the chosen overrides",
    ".ironloop.lock": "the run directory's lock; it names the last process that held it",
}


def pages() -> dict[str, str]:
    """docs/-relative path -> the page as the code generates it now."""
    return {"reference/config.md": config_page(), "reference/cli.md": cli_page(),
            "reference/run-files.md": run_files_page(),
            "project/benchmark-figures.md": (REPO / "BENCHMARKS.md").read_text()}


def stale() -> list[str]:
    """The committed pages that differ from what the code generates (missing ones too)."""
    docs = REPO / "docs"
    return [f"docs/{path}" for path, text in pages().items()
            if not (docs / path).is_file() or (docs / path).read_text() != text]


def on_pre_build(config):
    """Stop the build on a stale page, with the command that regenerates it."""
    if stale():
        from mkdocs.exceptions import PluginError  # the build stops with this one line

        raise PluginError(f"{', '.join(stale())} differ from the code; run `python "
                          f"scripts/docs_hooks.py` to regenerate them, and commit them")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _literal(text: str) -> str:
    """Plain text (a field's doc, a flag's help) as it reads on a terminal: ``__getitem__`` and
    ``<run.dir>`` stay as they are, not bold or an HTML tag."""
    escaped = html.escape(text, quote=False)
    for char in "_*`[]|\\":
        escaped = escaped.replace(char, f"&#{ord(char)};")
    return escaped.replace("\n", " ")


def _yaml(value: typing.Any) -> str:
    """A default as it is written in a YAML config (true, null, [0.9, 0.999])."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def _type(hint: typing.Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def config_page() -> str:
    out = ["# Config keys", "",
           GENERATED.format(source="the config dataclasses (`ironloop.config.SECTIONS`), the "
                            "same fields `ironloop train help` prints"), "",
           "A key is set in a YAML file (`section:` then `key: value`), on the command line as "
           "`section.key=value` (parsed as YAML), or in `fit(config={\"section.key\": value})`. "
           "**On resume** says whether `--resume` lets the key change: *free* keys cannot "
           "change the weights; a *trajectory* key that differs from the checkpoint's is "
           "refused unless `--allow-config-change` (see "
           "[Resume and preemption](../how-to/resume.md)).", ""]
    for name, cls in config_mod.SECTIONS.items():
        hints = typing.get_type_hints(cls)
        defaults = cls()
        out += [f"## {name}", "", "| key | type | default | allowed | on resume | doc |",
                "|---|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.metadata.get('key') or f.name}"
            choices = f.metadata.get("choices")
            allowed = ", ".join(f"`{c}`" for c in choices) if choices else ""
            resume = "free" if drift.is_free(key) else \
                "global batch kept" if key in drift.WINDOW else "trajectory"
            out.append(f"| <code id=\"{key}\">{key}</code> | `{_type(hints[f.name])}` | "
                       f"`{_cell(_yaml(getattr(defaults, f.name)))}` | {allowed} | {resume} | "
                       f"{_literal(f.metadata['doc'])} |")
        out.append("")
    return "\n".join(out)


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _arguments(p: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for a in p._actions:
        if a.help == argparse.SUPPRESS or isinstance(a, argparse._SubParsersAction):
            continue
        if a.option_strings:
            name = ", ".join(a.option_strings)
            if a.nargs != 0:
                name += f" {a.metavar or a.dest.upper()}"
                if a.nargs == "?":
                    name = name.replace(f" {a.metavar}", f" [{a.metavar}]")
        else:
            name = a.metavar or a.dest
            if a.nargs == "*":
                name += " ..."
        choices = f" One of {', '.join(f'`{c}`' for c in a.choices)}." if a.choices else ""
        default = "" if a.default in (None, False, argparse.SUPPRESS) or a.nargs == "*" \
            else f"`{a.default}`"
        if a.required:
            default = "required"
        rows.append(f"| `{_cell(name)}` | {default} | {_literal(a.help or '')}{choices} |")
    return rows


def cli_page() -> str:
    """The CLI page, its usage lines wrapped at 100 columns on every terminal (argparse reads
    COLUMNS), so the committed page is the same wherever it is regenerated."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        return _cli_page()
    finally:
        os.environ.pop("COLUMNS") if before is None else os.environ.update(COLUMNS=before)


def _cli_page() -> str:
    top = cli.parser()
    out = ["# CLI", "", GENERATED.format(source="the argparse parser in `ironloop/cli.py`"), "",
           top.description or "", "", "```", top.format_usage().strip(), "```", "",
           *_arguments(top), "",
           "`ironloop train`, `tune` and `doctor` take their flags and `dotted.key=value` "
           "overrides in any order. Every mistake you can fix is one line on stderr and exit "
           "code 2; see [Exit codes](exit-codes.md).", ""]
    for name, sub in _subcommands(top).items():
        out += [f"## ironloop {name}", "", sub.description or "", "", "```",
                sub.format_usage().strip(), "```", "", *_arguments(sub), ""]
    return "\n".join(out)


def run_files_page() -> str:
    missing = [n for n in run_dir.OUTPUTS if n not in RUN_FILES]
    stale = [n for n in RUN_FILES if n not in run_dir.OUTPUTS]
    if missing or stale:
        from mkdocs.exceptions import PluginError  # the build stops with this one line

        raise PluginError(f"scripts/docs_hooks.py: RUN_FILES must describe exactly "
                         f"ironloop.state.run_dir.OUTPUTS; missing {missing}, not a run "
                         f"output {stale}: add or remove their lines in RUN_FILES")
    out = ["# Files a run writes", "",
           GENERATED.format(source="`ironloop.state.run_dir.OUTPUTS`, the names "
                            "`--overwrite` removes"), "",
           "Everything a run writes goes into `run.dir`. `--overwrite` deletes these names and "
           "nothing else: anything else you put in `run.dir` stays.", "",
           "| file | content |", "|---|---|"]
    out += [f"| `{n}` | {_cell(RUN_FILES[n])} |" for n in run_dir.OUTPUTS]
    out += ["", "Other commands write beside them (kept by `--overwrite`):", "",
            "| file | content |", "|---|---|"]
    out += [f"| `{n}` | {_cell(d)} |" for n, d in OTHER_FILES.items()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    for path, text in pages().items():
        (REPO / "docs" / path).write_text(text)
        print(f"wrote docs/{path}")
