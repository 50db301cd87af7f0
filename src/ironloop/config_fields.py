"""The machinery under config.py's sections: a field with its doc, allowed values and YAML key;
a section that validates itself on construction and is built from parsed YAML; the coercion of
a value to a field's type; and the parse of a ``dotted.key=value`` override. Every error names
the dotted key and what is allowed (a ``ConfigError``, exit code 2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any, ClassVar

import yaml

from ironloop.errors import ConfigError


def doc_field(default: Any, doc: str, choices: tuple | None = None, key: str | None = None) -> Any:
    """A field with its one-line doc, its allowed values and its YAML key (when not the name)."""
    meta = {"doc": doc, "choices": choices, "key": key}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class Section:
    """Shared validation helpers; ``_name`` is the section's dotted prefix."""

    _name = ""
    __dataclass_fields__: ClassVar[dict[str, Any]]  # every section is a dataclass

    def __post_init__(self) -> None:
        for fl in dataclasses.fields(self):
            choices = fl.metadata.get("choices")
            if choices and getattr(self, fl.name) not in choices:
                self._bad(fl.name, f"must be one of {', '.join(map(str, choices))}")
        self.validate()

    def validate(self) -> None:
        """Range checks that the field types cannot express."""

    def _bad(self, name: str, why: str) -> None:
        value = getattr(self, name)
        raise ConfigError(f"{self._name}.{yaml_key(self, name)}={value!r}: {why}")

    def _positive(self, *names: str) -> None:
        for n in names:
            if getattr(self, n) <= 0:
                self._bad(n, "must be > 0")

    def _non_negative(self, *names: str) -> None:
        for n in names:
            if getattr(self, n) < 0:
                self._bad(n, "must be >= 0 (0 disables it)")


def yaml_key(obj: Any, name: str) -> str:
    # The field by name, not a dict of them all per call: Config.to_dict asks for every field
    # (every checkpoint and the guard's rollback point), which that made quadratic
    fl = obj.__dataclass_fields__[name]
    return fl.metadata.get("key") or name


def coerce(dotted: str, value: Any, typ: Any, meta: Any) -> Any:
    """Check ``value`` against the field type, undoing two YAML 1.1 quirks: '1e-3' is read as a
    string (it becomes a float) and on/off are read as booleans (they become 'on'/'off')."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):  # Optional[X]: null allowed
        if value is None:
            return None
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    want = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            list: "a list", dict: "a mapping"}[typ]
    if typ is list and isinstance(value, int) and not isinstance(value, bool):
        return [value]  # a single step for a list of steps (fault.nan_at_step=10)
    if typ is float and isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if typ is float and isinstance(value, float) and not math.isfinite(value):
        # nan passes every "> 0" check (all comparisons with nan are false); inf is never meant
        raise ConfigError(f"{dotted}={value!r}: must be a finite number")
    if typ is str and isinstance(value, bool) and "on" in (meta.get("choices") or ()):
        return "on" if value else "off"
    ok = isinstance(value, typ) and not (typ in (int, float) and isinstance(value, bool))
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        allowed = f" (one of {', '.join(map(str, meta['choices']))})" if meta.get("choices") else ""
        raise ConfigError(f"{dotted}={value!r}: expected {want}{allowed}")
    if typ is int and not -INT64 <= value < INT64:
        # torch and numpy take 64-bit integers: a larger one fails deep in torch (run.seed)
        raise ConfigError(f"{dotted}={value}: out of range; an integer key takes values of "
                          f"magnitude below 2**63")
    return value


#: Integer keys hold values that torch takes as a 64-bit signed integer.
INT64 = 2**63


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: YAML lets the last one win
    silently, so a stray second ``seed:`` would quietly replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<': merging is meant to override
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            with contextlib.suppress(TypeError):  # an unhashable key: construct_mapping says so
                if key in first:
                    raise ConfigError(f"{key_node.start_mark.name} line {line}: the key {key!r} "
                                      f"is given twice in one mapping (first on line "
                                      f"{first[key]}); YAML would keep only the last: delete "
                                      f"one of them")
                first[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(text: str, name: str) -> Any:
    """A config file's YAML, safely (no object construction), with no key given twice; errors
    name the file (``name``) and the line."""
    loader = UniqueKeyLoader(text)
    loader.name = name  # the marks in its errors name the file, not "<unicode string>"
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def build_section(cls: type[Section], raw: Any) -> Any:
    """A section from its parsed YAML mapping (None: the defaults), each key coerced to its
    field's type; an unknown key is named with the keys the section has."""
    name = cls._name
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: must be a mapping of keys, got {raw!r}")
    by_key = {f.metadata.get("key") or f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in by_key:
            raise ConfigError(f"unknown config key '{name}.{key}'; "
                              f"known keys in '{name}': {', '.join(by_key)}")
        fl = by_key[key]
        kwargs[fl.name] = coerce(f"{name}.{key}", value, hints[fl.name], fl.metadata)
    return cls(**kwargs)


def split_override(item: str) -> tuple[str, Any]:
    """``dotted.key=value`` -> (key, the value parsed as YAML, or the text when it is not)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form dotted.key=value "
                          f"(for example optim.lr=3e-4)")
    key, text = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return key.strip(), text
