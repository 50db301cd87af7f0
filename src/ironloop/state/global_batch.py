"""The global batch is a run's contract: ``batch_size x accumulation_steps x ranks`` at its
start, or ``train.global_batch_size`` when given. A start on another number of ranks (an
elastic restart after a lost node, a requeue onto a smaller allocation, a manual ``--resume``)
keeps it by re-deriving ``train.accumulation_steps``, so the step count, the LR schedule and
the data position (in samples of the global order) stay those of the uninterrupted run; a
global batch that the new ranks x batch_size do not divide is refused, naming the sizes that
would work. Pure decisions: the config is resolved once, before anything reads it
(``engine.fit.resolved``), from the checkpoint the resume will load (``Checkpointer.peek``).
"""

from __future__ import annotations

from ironloop.config import Config
from ironloop.errors import ConfigError


def target(given: int, checkpoint: dict | None, world: int) -> int:
    """The global batch this start must keep: ``train.global_batch_size`` when given (> 0);
    else, on a resume at another number of ranks, the checkpoint's; else 0 (nothing to
    keep: the config's own product is the run's global batch)."""
    if given:
        return given
    if not checkpoint or checkpoint.get("world_size", world) == world:
        return 0
    train = (checkpoint.get("config") or {}).get("train") or {}
    if "batch_size" not in train:
        return 0
    kept = train.get("global_batch_size") or train["batch_size"] * train.get(
        "accumulation_steps", 1) * checkpoint["world_size"]
    return int(kept)


def accumulation_for(batch_size: int, accumulation: int, world: int, global_batch: int) -> int:
    """The accumulation steps that make ``batch_size x accumulation x world == global_batch``
    (``accumulation`` itself when it does, or when there is nothing to keep); ConfigError in
    one line naming the per-rank batch sizes and the world sizes that would divide it."""
    per_step = batch_size * world
    if not global_batch or batch_size * accumulation * world == global_batch:
        return accumulation
    if global_batch % per_step == 0:
        return global_batch // per_step
    sizes = [b for b in range(1, global_batch // world + 1) if global_batch % (b * world) == 0]
    worlds = [w for w in range(1, global_batch // batch_size + 1)
              if global_batch % (batch_size * w) == 0]
    options = []
    if sizes:
        options.append(f"train.batch_size one of {_few(sizes)} on {world} rank(s)")
    if worlds:
        options.append(f"{_few(worlds)} rank(s) at train.batch_size={batch_size}")
    raise ConfigError(
        f"the run's global batch of {global_batch} samples per optimizer step does not divide "
        f"into train.batch_size={batch_size} x {world} rank(s); to keep it, run with "
        f"{' or '.join(options) or 'another train.batch_size'}; to change it, pass "
        f"train.global_batch_size=N with --allow-config-change")


def keep(cfg: Config, world: int, checkpoint: dict | None) -> Config:
    """``cfg`` with the accumulation steps that keep the run's global batch on ``world``
    ranks (``checkpoint``: the state the resume loads, or None for a fresh start)."""
    t = cfg.train
    wanted = target(t.global_batch_size, checkpoint, world)
    steps = accumulation_for(t.batch_size, t.accumulation_steps, world, wanted)
    if steps == t.accumulation_steps:
        return cfg
    return cfg.with_overrides({"train.accumulation_steps": steps})


def _few(values: list[int]) -> str:
    """The largest few of ``values``, comma-separated (the likeliest to fit in memory)."""
    shown = values[-6:]
    return ("..., " if len(values) > len(shown) else "") + ", ".join(map(str, shown))
