"""When the loop logs, evaluates and checkpoints: one answer per step, in one place
(as ignite's ``every=n`` event filters and torchtitan's ``CheckpointManager._should_save``),
instead of each caller computing ``step % n``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cadence:
    log_every: int          # log.every_steps: a metrics.jsonl line (a host read)
    eval_every: int         # eval.every_steps with validation data, else 0 (epoch ends only)
    checkpoint_every: int   # checkpoint.every_steps (0: at epoch ends only)
    total_steps: int        # the run's end
    validates: bool         # the run has validation data
    fault_steps: frozenset[int] = frozenset()  # steps where the fault injector acts (settled)

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0

    def evaluates(self, step: int) -> bool:
        """An evaluation after this step (eval.every_steps; epoch ends are the loop's)."""
        return bool(self.eval_every) and step % self.eval_every == 0

    def saves(self, step: int) -> bool:
        """A checkpoint after this step: checkpoint.every_steps, and after every step-path
        evaluation (best.pt follows evaluations, and a resume continues from the evaluated
        state)."""
        return self.evaluates(step) or (bool(self.checkpoint_every)
                                        and step % self.checkpoint_every == 0)
