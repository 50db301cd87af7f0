"""The ``ironloop`` command: parse, build, run, close. No training logic lives here."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ironloop.errors import Preempted, RankZeroError, StoppedInSetup, UserError


def _keys_help(args) -> bool:
    """``ironloop train|doctor|tune help``: every config key with its default, printed."""
    if args.config != "help":
        return False
    from ironloop.config import describe

    print(describe())
    return True


def _train(args) -> int:
    if _keys_help(args):
        return 0
    from ironloop.engine import slurm

    if slurm.job_id() is not None:  # before torch's import: a warning signal may come now
        slurm.EarlySignals().install()
        return _train_run(args, slurm)
    before = slurm.SetupSignals().install()  # a signal now stops the setup with one line
    try:
        return _train_run(args, slurm)
    finally:
        slurm.restore(before)  # main() may be called again in this process (tests, tools)


def _train_run(args, slurm) -> int:
    from ironloop.config import load_config

    slurm.adopt_step_env()  # srun --ntasks=N: the ranks torchrun would have described
    config, overrides = _config_and_overrides(args.config, args.overrides)
    if args.strict:
        overrides.append("doctor.strict=true")
    cfg = load_config(config, overrides)
    from ironloop.state import lock  # no torch: it takes a fraction of a second

    main = os.environ.get("RANK", "0") == "0"
    try:
        # run.dir is held from here, not from after torch's import and the data's build
        # (seconds, or minutes of download): a second run started meanwhile names this one
        # as the holder instead of finding run.dir free and an older run in it.
        with lock.hold(Path(cfg.run.dir), main):
            if main:  # before torch's import: seconds of silence otherwise
                print(f"ironloop train: {cfg.model.name} on {cfg.data.name} from "
                      f"{config or 'the defaults'}, run.dir {cfg.run.dir}"
                      f"{' (resuming)' if args.resume else ''}; loading torch...", flush=True)
            from ironloop.tools.recipe import train_config

            # held here, so the front door (tools/recipe.run_fit) does not take it again
            result = train_config(cfg, resume=args.resume, overwrite=args.overwrite,
                                  allow_config_change=args.allow_config_change,
                                  run_dir_held=True)
    except Preempted as stop:  # under SLURM: requeue the job, or not (engine/slurm.py)
        slurm.after_stop(Path(cfg.run.dir), stop, cfg.checkpoint.slurm_requeue,
                         cfg.checkpoint.slurm_min_steps)
        raise
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun, rank 0 speaks for the run
    print(done_line(result.results, result.run_dir))
    return 0


def done_line(r: dict, run_dir) -> str:
    """The run's last console line, as text: ``done: best_val_acc 0.9012  test_acc 0.8950
    30 steps  train 1.0 s  outputs in runs/x`` (a figure the run has not: left out)."""
    parts = [f"{k} {r[k]:.4f}" for k in ("best_val_acc", "test_acc") if r.get(k) is not None]
    parts.append(f"{r['steps']} steps")
    if r.get("train_seconds") is not None:
        parts.append(f"train {r['train_seconds']:.1f} s")
    return f"done: {'  '.join(parts)}  outputs in {run_dir}"


def _doctor(args) -> int:
    if _keys_help(args):
        return 0
    from ironloop.config import load_config

    cfg = load_config(*_config_and_overrides(args.config, args.overrides))
    if args.resume_check:  # before torch's import: the scratch runs import it themselves
        from ironloop.tools.doctor.resume_check import DEFAULT_STEPS, doctor_resume_check

        steps = DEFAULT_STEPS if args.steps is None else args.steps
        return 0 if doctor_resume_check(cfg, steps, args.nproc).exact else 1
    from ironloop.tools.doctor.run import doctor_config

    doctor_config(cfg, lr_find=args.lr_find, strict=args.strict)
    return 0


def _export(args) -> int:
    from ironloop.state.export import export_run

    # a remote run (checkpoint.remote's URL) keeps its "://"; Path() would fold it
    run_dir = args.run_dir if "://" in args.run_dir else Path(args.run_dir)
    out = export_run(run_dir, Path(args.out), args.which, force=args.force)
    print(f"wrote {out}")
    return 0


def _report(args) -> int:
    from ironloop.tools.doctor.logs import diagnose_logs
    from ironloop.tools.report import render_report

    paths = render_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print("\n".join(f"wrote {p}" for p in paths))
    for finding in diagnose_logs(Path(args.run_dir)):  # also in report.md's Diagnosis section
        print(finding.render())
    return 0


def _tune(args) -> int:
    if _keys_help(args):
        return 0
    from ironloop.tools.tune import tune_config
    from ironloop.tools.tune.stop import Stopped

    try:
        tune_config(args.config, args.overrides, budget=args.budget,
                    apply_trajectory_changes=args.apply_trajectory_changes)
    except Stopped as e:  # Ctrl-C or SIGTERM: stopped, nothing written, 128 + the signal
        print(f"ironloop: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def _lab(args) -> int:
    from ironloop.tools.lab.run import run_lab

    report = run_lab(args.data, Path(args.out), root=args.root, overwrite=args.overwrite)
    print(f"lab report: {report}")
    return 0


def _config_and_overrides(config: str | None, overrides: list[str]):
    """(config file or None, overrides): with no YAML file, the first positional that looks
    like ``key=value`` is an override, and the defaults plus the overrides are the config."""
    overrides = list(overrides)
    if config is not None and "=" in config and not Path(config).exists():
        return None, [config, *overrides]
    return config, overrides


def train_argv(argv: list[str], valued: tuple[str, ...] = ()) -> list[str]:
    """``train``'s arguments in argparse's order: positionals (the config, then the overrides),
    then the flags, so that overrides and flags mix in any order.

    ``--resume`` takes the next argument as its PATH only when it is one: not a flag, not a YAML
    config, and either without '=' or an existing path. ``--resume train.epochs=3`` is a bare
    ``--resume`` followed by an override. A flag in ``valued`` (tune's ``--budget``) always takes
    the next argument.
    """
    positionals, flags = [], []
    i = 0
    while i < len(argv):
        arg, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        if arg == "--resume" and nxt is not None and _is_resume_path(nxt):
            flags.append(f"--resume={nxt}")
            i += 1
        elif arg in valued and nxt is not None:
            flags.append(f"{arg}={nxt}")
            i += 1
        elif arg == "--":
            positionals += argv[i + 1:]
            break
        else:
            (flags if arg.startswith("-") else positionals).append(arg)
        i += 1
    return positionals + flags


def _is_resume_path(arg: str) -> bool:
    if arg.startswith("-") or arg.endswith((".yaml", ".yml")):
        return False
    return "=" not in arg or Path(arg).exists()


def parser() -> argparse.ArgumentParser:
    from ironloop.version import __version__

    p = argparse.ArgumentParser(prog="ironloop", description="A training loop you can trust "
                                "with a 72-hour run.")
    p.add_argument("--version", action="version", version=f"ironloop {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The order here is the order `ironloop --help` lists the commands in.
    for add in (_add_train, _add_doctor, _add_export, _add_report, _add_tune, _add_lab):
        add(sub)
    return p


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train from a YAML config and/or key=value overrides",
                       description="Train from a YAML config (or the defaults) and dotted "
                       "key=value overrides. `ironloop train help` lists every config key "
                       "with its default.")
    t.add_argument("config", nargs="?", default=None,
                   help="YAML config file (or `help` to list the keys); without one, the "
                   "defaults plus the overrides")
    # default=[]: argparse marks a "*" positional without a default as required (the CLI
    # page then said so), though none is needed
    t.add_argument("overrides", nargs="*", default=[], metavar="dotted.key=value",
                   help="override config values, e.g. optim.lr=3e-4 train.epochs=5")
    t.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH",
                   help="continue from the newest valid checkpoint in run.dir (fresh start "
                   "when there is none), or from PATH")
    t.add_argument("--overwrite", action="store_true",
                   help="delete a previous run's outputs in run.dir and start over")
    t.add_argument("--allow-config-change", action="store_true",
                   help="resume even though keys that change the training trajectory differ "
                   "from the checkpoint's config (e.g. a larger train.max_steps)")
    t.add_argument("--strict", action="store_true",
                   help="stop (exit 2) when the preflight doctor finds an error")
    t.set_defaults(func=_train)


def _add_doctor(sub) -> None:
    d = sub.add_parser("doctor", help="check model, data and loader for common bugs",
                       description="Run every doctor check on the config's model and data: "
                       "initial loss, probabilities fed to a logits loss, overfit one batch, "
                       "dead parameters, labels, train/val/test leakage, input-bound, memory.")
    d.add_argument("config", nargs="?", default=None,
                   help="YAML config file (or `help` to list the keys); without one, the "
                   "defaults plus the overrides")
    d.add_argument("overrides", nargs="*", default=[], metavar="dotted.key=value",
                   help="override config values, as for train")
    d.add_argument("--lr-find", action="store_true",
                   help="also run the LR range test and write run.dir/lr_find.png")
    d.add_argument("--strict", action="store_true", help="exit 2 when a check finds an error")
    d.add_argument("--resume-check", action="store_true",
                   help="instead of the checks: train --steps steps uninterrupted, and again "
                   "killed between checkpoints and resumed in a new process, in a scratch "
                   "directory; exit 0 when the two runs are bit-identical, 1 when not, naming "
                   "the first step and the thing that differs")
    d.add_argument("--steps", type=int, default=None, metavar="N",
                   help="optimizer steps of the resume check (default 24)")
    d.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="run the resume check's scratch runs under torchrun with N processes "
                   "(every rank is compared)")
    # The same command line as `train` works: its run-directory flags mean nothing here.
    for flag in ("--overwrite", "--allow-config-change"):
        d.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    d.add_argument("--resume", nargs="?", const=True, default=False, help=argparse.SUPPRESS)
    d.set_defaults(func=_doctor)


def _add_export(sub) -> None:
    e = sub.add_parser("export", help="write a run's weights as safetensors",
                       description="Write a run's weights (its best, last or averaged "
                       "checkpoint) as one safetensors file that loads with "
                       "safetensors.torch.load_file, without ironloop.")
    e.add_argument("run_dir", help="a run.dir, or a checkpoint.remote URL (s3://...)")
    e.add_argument("--out", required=True, help="output file, e.g. model.safetensors")
    e.add_argument("--which", choices=("best", "last", "avg"), default="best",
                   help="avg: the averaged weights (average.kind) of the last checkpoint")
    e.add_argument("--force", action="store_true", help="replace --out if it exists")
    e.set_defaults(func=_export)


def _add_report(sub) -> None:
    r = sub.add_parser("report", help="plots and a summary for a run directory",
                       description="Read a run directory's logs and write report.md, "
                       "report.html and their plots (loss, accuracy or validation, LR, gradient "
                       "norms, a resume's curve) to RUN_DIR/report, then print the diagnosis of "
                       "the logs (a flat loss, overfitting, NaN, clipping).")
    r.add_argument("run_dir", help="a run.dir, finished or not")
    r.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    r.set_defaults(func=_report)


def _add_tune(sub) -> None:
    u = sub.add_parser("tune", help="measure faster settings for a config; write tuned.yaml",
                       description="Measure the config's own run (samples/s, time split, "
                       "memory), try the settings that cannot change the trajectory (data "
                       "workers, pinned memory, compile) and those that do (precision, "
                       "micro-batch), each as a short measured run within --budget, and write "
                       "run.dir/tune.json and run.dir/tuned.yaml.")
    u.add_argument("config", help="YAML config file (or `help` to list the keys)")
    u.add_argument("overrides", nargs="*", default=[], metavar="dotted.key=value",
                   help="override config values, as for train")
    u.add_argument("--budget", type=float, default=120.0, metavar="SECONDS",
                   help="wall time for all trials together (default 120)")
    u.add_argument("--apply-trajectory-changes", action="store_true",
                   help="also put the winners of the trajectory-changing table into tuned.yaml")
    u.set_defaults(func=_tune)


def _add_lab(sub) -> None:
    lab = sub.add_parser("lab", help="the seven-step production-loop lab, with a report",
                         description="Run the production-loop lab: seven cumulative short "
                         "runs on one dataset (baseline, OneCycle, clipping, accumulation, AMP, "
                         "checkpointing, a crash and its resume), each adding one piece to the "
                         "one before, and write report.md, report.html and the plots to --out.")
    lab.add_argument("--data", default="digits", help="digits, mnist1d or fashion-mnist")
    lab.add_argument("--out", default="lab-out", help="output directory")
    lab.add_argument("--root", default="data", help="data.root for fashion-mnist")
    lab.add_argument("--overwrite", action="store_true", help="replace an existing lab output")
    lab.set_defaults(func=_lab)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train", "tune", "doctor"):  # overrides and flags in any order
        valued = ("--budget",) if argv[0] == "tune" else ("--steps", "--nproc") \
            if argv[0] == "doctor" else ()
        argv = [argv[0], *train_argv(argv[1:], valued=valued)]
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        # A mistake the user can fix: one line, exit 2, no traceback (rank 0's refusal once).
        if not isinstance(e, RankZeroError):
            print(f"ironloop: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # 3: the guard stopped the run (guard/reporter.py)
    except Preempted as e:  # a signal stopped the run after a checkpoint: not an error
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
            print(f"ironloop: {e}", file=sys.stderr)
        return e.exit_code
    except StoppedInSetup as e:  # SIGTERM or SIGUSR1 before the first step (engine/slurm.py)
        print(f"ironloop: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("ironloop: interrupted; resume with --resume", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``ironloop`` command and ``python -m ironloop``: ``main()``, then leave with its exit
    code without the interpreter's teardown. That teardown took 5-25 s after a finished run on a
    busy machine (garbage-collecting torch's and the datasets' objects) and, under torchrun, now
    and then aborted a finished rank in gloo's and the TCPStore's C++ destructors ("terminate
    called without an active exception", exit -6). fit() has closed every output (logs, loggers,
    checkpoint writers) and destroyed its process group by then, so nothing is left to flush but
    what Python buffers; a preempted run must leave within the scheduler's grace period."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
