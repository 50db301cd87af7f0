"""Typed, self-validating configuration.

One dataclass per section, one line of doc per field (the sections live in ``config_training``:
what is trained and how, and ``config_running``: how the run is watched, kept and spread; this
module re-exports them all, so import every config name from here). ``load_config`` reads YAML,
applies dotted ``key=value`` overrides and validates everything; every error names the dotted
key and the allowed values, and is a ``ConfigError`` (the CLI turns it into exit code 2, no
traceback). No ``exec``, no ``eval``: values are parsed with a safe YAML loader (that refuses a
key given twice: ``config_fields.load_yaml``) and coerced to the field type.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ironloop.config_fields import Section, build_section, load_yaml, split_override, yaml_key
from ironloop.config_running import (
    CheckpointConfig,
    DistConfig,
    DoctorConfig,
    FaultConfig,
    GuardConfig,
    LogConfig,
    ProfileConfig,
)
from ironloop.config_training import (
    AVERAGES,
    BUILT_IN_OPTIMIZERS,
    COMPILE_MODES,
    LOSSES,
    MAX_PROCS,
    NAME_MAX,
    SCHEDULES,
    AverageConfig,
    ClipConfig,
    DataConfig,
    EarlyStopConfig,
    EvalConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    torch_optimizer,
)
from ironloop.errors import ConfigError

__all__ = [
    "AVERAGES", "BUILT_IN_OPTIMIZERS", "COMPILE_MODES", "LOSSES", "MAX_PROCS", "NAME_MAX",
    "SCHEDULES", "SECTIONS", "AverageConfig", "CheckpointConfig", "ClipConfig", "Config",
    "DataConfig", "DistConfig", "DoctorConfig", "EarlyStopConfig", "EvalConfig", "FaultConfig",
    "GuardConfig", "LogConfig", "LossConfig", "ModelConfig", "OptimConfig", "ProfileConfig",
    "RunConfig", "ScheduleConfig", "TrainConfig", "describe", "load_config", "torch_optimizer",
]


@dataclass
class Config:
    """The whole resolved configuration; ``to_dict`` round-trips through ``from_dict``."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    average: AverageConfig = field(default_factory=AverageConfig)

    @classmethod
    def from_dict(cls, raw: dict | None) -> Config:
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
        # config.yaml's `used:` block is a record of the run, not config (see records.py).
        raw = {k: v for k, v in raw.items() if k != "used"}
        unknown = sorted(set(raw) - set(SECTIONS))
        if unknown:
            raise ConfigError(f"unknown config section '{unknown[0]}'; "
                              f"known sections: {', '.join(SECTIONS)}")
        return cls(**{name: build_section(SECTIONS[name], raw.get(name)) for name in SECTIONS})

    def to_dict(self) -> dict:
        return {name: {yaml_key(sec, f.name): getattr(sec, f.name) for f in dataclasses.fields(sec)}
                for name, sec in ((n, getattr(self, n)) for n in SECTIONS)}

    def with_overrides(self, overrides: list[str] | dict) -> Config:
        raw = self.to_dict()
        items = overrides.items() if isinstance(overrides, dict) else map(split_override, overrides)
        for dotted, value in items:
            _set_dotted(raw, dotted, value)
        return Config.from_dict(raw)


#: section name -> its dataclass, read off Config's fields so the two cannot drift apart.
SECTIONS: dict[str, type[Section]] = {f.name: typing.cast("type[Section]", f.default_factory)
                                      for f in dataclasses.fields(Config)}


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) < 2 or parts[0] not in SECTIONS:
        raise ConfigError(f"unknown config key '{dotted}'; keys look like section.key with "
                          f"section one of {', '.join(SECTIONS)}")
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (or the defaults when ``path`` is None) and apply overrides."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found; pass the path of a YAML file, "
                              f"e.g. configs/digits.yaml")
        try:
            raw = load_yaml(path.read_text(), str(path)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}".replace("\n", " ")) from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start} is "
                              f"{e.object[e.start:e.start + 1]!r}); save it as UTF-8") from None
    return Config.from_dict(raw).with_overrides(overrides or [])


def describe() -> str:
    """Every key with its default and doc, for ``ironloop train help``."""
    lines = []
    for name, cls in SECTIONS.items():
        defaults = cls()
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            choices = f.metadata.get("choices")
            doc = f.metadata["doc"]
            # the allowed values, unless the doc already lists them (as "a | b | c")
            allowed = f" (one of: {' | '.join(map(str, choices))})" if choices and \
                " | " not in doc else ""
            shown = "null" if default is None else repr(default)  # what an override accepts
            lines.append(f"{name}.{f.metadata.get('key') or f.name} = {shown}  "
                         f"# {doc}{allowed}")
    return "\n".join(lines)
