"""The tune's decisions and its table: the ``Tuner`` runs the rows within the budget, and the
functions beside it judge them (a screen's verdict, the paired runs' ``paired``) and plan the
trials (``plan_for``); ``ironloop.tools.tune`` wires it to a model, data and config and writes
the results."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from ironloop.config import Config
from ironloop.errors import UserError, flag, speaks_python
from ironloop.tools.tune import spend
from ironloop.tools.tune.rows import Row
from ironloop.tools.tune.trials import Measure, Plan, Subject, TrialFailed, run_trial

#: A winner is more than this much faster: the median of its paired ratios.
NOISE = 0.05
#: Paired measurements (the config, the setting) a winner must win, every one of them: by
#: chance alone a setting no faster than the config wins all four with odds of 1 in 16, and
#: its median must also clear NOISE.
PAIRS = 4
#: Settings of one group that get the paired runs, fastest screen first (a loser's pairs
#: usually stop at the first).
CONFIRMS = 3
#: Seconds held back for a compile trial, beyond a trial's usual share.
COMPILE_RESERVE = 30.0
#: CUDA: the largest micro-batch's peak may use at most this share of the device's memory.
HEADROOM = 0.85


@dataclass
class Paired:
    """The verdict on paired ratios (the config's projected run time over the setting's, one
    per pair): their median and spread, and whether they agree that the setting is faster."""

    ratios: list[float]
    wins: bool
    median: float
    spread: tuple[float, float]
    why: str

    def to_dict(self) -> dict:
        return {"ratios": [round(r, 4) for r in self.ratios], "median": round(self.median, 4),
                "spread": [round(x, 4) for x in self.spread], "wins": self.wins, "why": self.why}


def paired(ratios: list[float], pairs: int = PAIRS, margin: float = NOISE) -> Paired:
    """Faster beyond the noise: ``pairs`` ratios, each above 1 (every pair agrees), with a
    median above ``1 + margin``. Fewer ratios than ``pairs`` never win (the budget ran out, or
    a pair said slower and the rest were not run)."""
    med = statistics.median(ratios) if ratios else 1.0
    spread = (min(ratios), max(ratios)) if ratios else (1.0, 1.0)
    slower = sum(r <= 1.0 for r in ratios)
    wins = not slower and len(ratios) >= pairs and med > 1 + margin
    if slower:
        why = f"{slower} of {len(ratios)} pairs not faster"
    elif len(ratios) < pairs:
        why = f"{len(ratios)} of {pairs} pairs measured"
    elif not wins:
        why = f"median {med:.2f}x is within {100 * margin:.0f}%"
    else:
        why = f"{len(ratios)} of {pairs} pairs faster"
    return Paired(list(ratios), wins, med, spread, why)


def planned_samples(cfg: Config, n: int) -> int:
    """Samples the configured run trains on (one process): its epochs, or its max_steps."""
    window = cfg.train.batch_size * cfg.train.accumulation_steps
    per_epoch = -(-n // window)
    steps = per_epoch * cfg.train.epochs
    if cfg.train.max_steps:
        steps = min(steps, cfg.train.max_steps)
    return (steps // per_epoch) * n + (steps % per_epoch) * window


def plan_for(step_s: float, seconds: float) -> Plan:
    """Warm-up and windows that fill about ``seconds`` at ``step_s`` seconds a step; every
    trial then measures the seconds those windows take at that speed (``Plan.measure_s``)."""
    steps = max(3, int(seconds / max(step_s, 1e-6)))
    warmup = 3 if steps >= 30 else 1
    repeats = 5 if steps >= 10 else 2
    window = max(1, (steps - warmup) // repeats)
    return Plan(warmup, window, repeats, measure_s=window * repeats * step_s)


class Tuner:
    """Runs the rows within the budget and keeps the table; decisions use the functions above."""

    pairs = PAIRS  # paired runs a winner must win (tune.json's info says how many)

    reserved = 0.0  # seconds held for the kept settings' confirmation

    def __init__(self, subject: Subject, budget: float, bar):
        self.subject, self.bar = subject, bar
        self.started = time.perf_counter()
        self.deadline = self.started + budget
        self.plan = Plan(1, 1, 2)
        self.est_s = 0.0                 # a trial's expected seconds at the baseline's speed
        self.samples = planned_samples(subject.cfg, subject.samples)
        self.epochs = math.ceil(self.samples / subject.samples)  # epochs the run starts
        self.rows: list[Row] = []
        self.baseline: Row | None = None

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def measure(self, overrides: dict, extra_s: float = 0.0) -> Measure:
        """One trial; its deadline is its share of the budget, three times over at most."""
        now = time.perf_counter()
        est = self.est_s + extra_s
        deadline = min(self.deadline, now + max(3 * est, est + 5.0))
        return run_trial(self.subject, overrides, self.plan, deadline)

    def start(self, planned_rows: int) -> Row:
        """Probe a step's time, plan the trials, measure the baseline."""
        try:
            probe = run_trial(self.subject, {}, Plan(1, 1, 2), self.deadline)
        except TrialFailed as e:
            if e.overrun:
                budget = flag("budget")
                raise UserError(f"{budget}={self.deadline - self.started:.0f} s does not fit "
                                f"even a 3-step probe of this run; raise {budget}") from None
            same = "fit()" if speaks_python() else "ironloop train"
            raise UserError(f"the config does not train as it stands ({e}); fix that first "
                            f"({same} fails the same way)") from None
        step_s = probe.step_ms / 1000
        # The probe also paid the process's first-fit costs (lazy imports, first allocations):
        # a trial's own set-up is timed on the baseline instead.
        setup = min(1.0, max(0.0, probe.seconds - 2 * step_s))
        # Shares for the screen's rows, the baseline, and about one and a half groups' paired
        # runs (2 trials a pair).
        share = max(1.0, min(10.0, 0.85 * self.left() / (planned_rows + 1 + 3 * PAIRS) - setup))
        self.plan = plan_for(step_s, share)
        self.est_s = setup + self.plan.steps * step_s
        base = Row("baseline (the config as it is)", {})
        self.run_row(base, {})
        if base.status != "ok":
            raise UserError(f"the baseline could not be measured ({base.reason})")
        self.baseline = base
        self.est_s = base.measured.seconds  # what a trial at the baseline's speed takes
        return base

    def run_row(self, row: Row, base: dict, extra_s: float = 0.0, hold_s: float = 0.0) -> None:
        """Measure one row (a screen), unless the budget left, less ``hold_s`` kept for the
        paired runs, cannot fit it."""
        row.base = dict(base)
        row.est_s = cost = spend.row_cost(self.est_s, extra_s)  # before it starts
        hold_s += self.reserved
        if row.status == "skipped":
            pass
        elif self.left() - hold_s < cost:
            held = f", {hold_s:.0f} s of them held for the paired runs" if hold_s else ""
            row.status, row.reason = "skipped", (f"budget: needs ~{cost:.0f} s, "
                                                 f"{max(0.0, self.left()):.0f} s left{held}")
        else:
            self.bar.set_description(row.setting)
            try:
                row.measure, row.status = self.measure({**base, **row.overrides}, extra_s), "ok"
            except TrialFailed as e:
                row.status, row.reason = "failed", str(e)
            self._figures(row)
        self.bar.update(1)
        if self.baseline is not None:  # the baseline has a line of its own
            self.rows.append(row)

    def _figures(self, row: Row) -> None:
        if row.measure is None:
            return
        m = row.measure
        base = self.baseline.measured if self.baseline else m
        row.ratio = m.samples_per_s / base.samples_per_s
        row.projected_s = self.projected(m, {**row.base, **row.overrides})

    def projected(self, m: Measure, overrides: dict) -> float:
        """The configured run's training time at this speed, plus its one-off costs (the
        warm-up's time beyond its steady steps): a compile once, and the workers' start-up at
        every epoch (the DataLoader starts them per epoch unless they persist)."""
        cfg = self.subject.cfg.with_overrides(overrides)
        per_epoch = cfg.data.num_workers and not getattr(cfg.data, "persistent_workers", False)
        starts = self.epochs if per_epoch and not cfg.train.compile else 1
        return self.samples / m.samples_per_s + starts * m.extra_s

    def group(self, rows: list[Row], current: dict, best: Row, extra_s: float = 0.0,
              keep: bool = False) -> Row | None:
        """Run the rows on top of ``current`` (the screen); the fastest ones that project more
        than NOISE faster than ``best`` are measured in pairs, fastest first: the first against
        ``current``, each after a winner against the winner. The last to win its pairs is the
        group's winner (a screen is one measurement: its order may be the load's). With
        ``keep``, a fastest row that screened clearly faster (spend.clearly_faster) is returned
        ``kept`` instead, without pairs: ``confirm`` pairs the kept rows together."""
        # A screen is one measurement, so nothing wins without its paired runs: once a row
        # has screened faster, the screen leaves the budget its pairs need (on an H200, a
        # 60 s budget screened every row and left none, and a 3.5x faster num_workers went
        # unconfirmed and unapplied).
        hold = 0.0
        for row in rows:
            self.run_row(row, current, extra_s, hold)
            if row.status == "ok" and _screened_faster(row, best):
                hold = 2 * PAIRS * self.est_s + extra_s
        ok = [r for r in rows if r.status == "ok"]
        for r in ok:
            r.verdict = _verdict(r, best)
        contenders = sorted((r for r in ok if _screened_faster(r, best)), key=lambda r: r.run_s)
        if keep and contenders and spend.clearly_faster(contenders[0], best):
            return self._keep(contenders, best, extra_s)
        for r in contenders[CONFIRMS:]:
            r.verdict = "faster, but other settings were faster still"
        winner: Row | None = None
        for r in contenders[:CONFIRMS]:
            against = {**current, **(winner.overrides if winner else {})}
            verdict = self._pairs(against, {**current, **r.overrides}, extra_s)
            r.pairs = {**verdict.to_dict(), "against": against}
            if not verdict.wins:
                r.verdict = (f"faster once, not in the paired runs against "
                             f"{_name(winner, 'the config')} ({verdict.why}; "
                             f"{_ratios(verdict.ratios)}): within the machine's noise")
                continue
            r.won, r.gain = True, verdict.median * (winner.gain if winner else 1.0)
            r.verdict = (f"{'chosen' if r.kind == 'free' else 'winner'} (paired against "
                         f"{_name(winner, 'the config')}: median {verdict.median:.2f}x, "
                         f"{verdict.spread[0]:.2f}-{verdict.spread[1]:.2f}x, {verdict.why})")
            if winner is not None:
                winner.won = False
                winner.verdict = winner.verdict.replace("chosen (", "won its pairs (", 1) \
                    .replace("winner (", "won its pairs (", 1) + f"; {r.setting} beat it"
            winner = r
        return winner

    def _keep(self, contenders: list[Row], best: Row, extra_s: float) -> Row:
        """The clearly fastest row stays on for the next screens; the budget now holds the
        paired runs that will confirm it with the other kept rows."""
        top = contenders[0]
        top.kept, top.gain = True, best.run_s / top.run_s  # the screen's gain, until confirmed
        top.verdict = (f"kept on for the next screens (screened {best.run_s / top.run_s:.2f}x "
                       f"faster than {_name(best if best.overrides else None, 'the config')}, "
                       f"clearly: every window faster); to be confirmed in pairs")
        for r in contenders[1:]:
            r.verdict = f"faster, but {top.setting} was clearly faster"
        # One confirmation for all kept rows: the largest extra (a compile) is the one held.
        self.reserved = max(self.reserved, spend.confirm_cost(self.est_s, PAIRS, extra_s))
        return top

    def confirm(self, chosen: dict, kept: list[Row], extra_s: float = 0.0) -> dict:
        """Paired runs of ``chosen`` (the settings that won their own pairs, on top of the kept
        ones) against ``chosen`` plus the kept rows; if the combination does not win them, the
        last kept row is dropped and the rest paired again, while the budget holds. Returns the
        free overrides to apply: nothing kept is applied unconfirmed."""
        self.reserved = 0.0  # what was held is now spent
        chosen_rows = [r for r in self.rows if r.won and r.kind == "free"]
        kept = list(kept)
        while kept:
            combo = {**chosen, **{k: v for r in kept for k, v in r.overrides.items()}}
            verdict = self._pairs(chosen, combo, extra_s, extra_s)
            if verdict.wins:
                ratios = [r.gain for r in kept]  # each one's screened gain
                for r, gain in zip(kept, spend.apportion(kept, ratios, verdict.median)):
                    r.won, r.gain, r.pairs = True, gain, {**verdict.to_dict(), "against": chosen}
                    r.verdict = (f"chosen (kept, then {_names(kept)} paired against "
                                 f"{_names(chosen_rows) or 'the config'}: "
                                 f"median {verdict.median:.2f}x, {verdict.spread[0]:.2f}-"
                                 f"{verdict.spread[1]:.2f}x, {verdict.why})")
                return combo
            last = kept.pop()
            last.kept, last.pairs = False, {**verdict.to_dict(), "against": chosen}
            last.verdict = (f"kept for the screens, but the combination with it was not faster "
                            f"in the paired runs ({verdict.why}; "
                            f"{_ratios(verdict.ratios)})")
        return chosen

    def _pairs(self, a: dict, b: dict, extra_s: float, extra_a: float = 0.0) -> Paired:
        """Up to PAIRS interleaved measurements of config ``a`` (A) and ``b`` (B), in the order
        A B, B A, A B, B A; stops at the first pair that says B is not faster, since the rule
        needs them all."""
        ratios: list[float] = []
        for i in range(PAIRS):
            if self.left() - self.reserved < 2 * self.est_s + extra_s + extra_a:
                break  # the budget holds: fewer pairs than PAIRS never win
            try:
                if i % 2 == 0:
                    ma, mb = self.measure(a, extra_a), self.measure(b, extra_s)
                else:
                    mb, ma = self.measure(b, extra_s), self.measure(a, extra_a)
            except TrialFailed as e:
                return Paired(ratios, False, 1.0, (1.0, 1.0), f"a paired trial failed: {e}")
            ratios.append(self.projected(ma, a) / self.projected(mb, b))
            if ratios[-1] <= 1.0:
                break
        return paired(ratios)

    def largest_fit(self, current: dict, device: torch.device) -> Row | None:
        """CUDA: double the micro-batch (no accumulation) until a step runs out of memory or
        its peak passes HEADROOM of the device's memory; the last that fit is reported, never
        applied (it changes the global batch unless accumulation is lowered to match)."""
        if device.type != "cuda":
            return None
        total_mb = torch.cuda.get_device_properties(device).total_memory / 2**20
        batch = self.subject.cfg.with_overrides(current).train.batch_size
        row = Row("largest micro-batch that fits", {}, kind="trajectory", status="skipped",
                  reason=f"train.batch_size={batch} is the largest that fits with "
                  f"{100 * (1 - HEADROOM):.0f}% of the memory free")
        while 2 * batch <= self.subject.samples and self.left() > self.est_s:
            batch *= 2
            trial = {"train.batch_size": batch, "train.accumulation_steps": 1}
            try:
                m = run_trial(self.subject, {**current, **trial}, Plan(1, 1, 2),
                              min(self.deadline, time.perf_counter() + 3 * self.est_s))
            except TrialFailed:
                break  # out of memory, most likely: the previous size is the answer
            if (m.peak_mb or 0.0) > HEADROOM * total_mb:  # run_trial always sets it
                break
            row = Row(f"train.batch_size={batch} train.accumulation_steps=1", trial,
                      kind="trajectory", status="ok", measure=m, base=dict(current),
                      note=f"the largest that fits: peak {m.peak_mb:,.0f} of {total_mb:,.0f} "
                      f"MiB; a larger global batch unless accumulation drops to match")
            self._figures(row)
            row.verdict = "reported, not applied"
        self.rows.append(row)
        return row


def _verdict(row: Row, best: Row) -> str:
    """The screen, judged on the run's projected time, which charges a compile and the
    workers' start-up: "faster" sends the row to the paired runs. A row is judged against the
    best so far, while the table's "x base" is against the baseline: once a setting has won,
    the verdict names it, so a 1.9x row "within noise" of a 1.9x winner does not read as noise."""
    than = f" than {best.setting}" if best.overrides else ""
    if _screened_faster(row, best):
        return "faster" + than
    if row.run_s * (1 - NOISE) > best.run_s:
        faster_steps = row.measured.samples_per_s > best.measured.samples_per_s
        return ("faster steps, but the compile does not pay for itself in this run"
                if faster_steps and row.overrides.get("train.compile") else "slower" + than)
    return "within noise" + (f" of {best.setting}" if best.overrides else "")


def _screened_faster(row: Row, best: Row) -> bool:
    return row.run_s < best.run_s * (1 - NOISE)


def _name(row: Row | None, default: str) -> str:
    return row.setting if row is not None else default


def _names(rows: list[Row]) -> str:
    return " + ".join(r.setting for r in rows)


def _ratios(ratios: list[float]) -> str:
    return "ratios " + ", ".join(f"{r:.2f}" for r in ratios) if ratios else "no pairs"
