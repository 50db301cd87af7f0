"""Reading a run directory back: its JSONL logs and its JSON/YAML records. Tolerant by design:
missing files, missing keys, nulls, NaNs and a partial line left by a crash are skipped. The
report, the doctor's log diagnoses, fit's results and the lab all read through these."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read_jsonl(path: Path | str) -> list[dict]:
    """Rows of a JSONL file; [] when it is missing. Unparsable lines (a crash's partial line) are
    skipped; a full row that a resumed run appended to such a partial line is recovered."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        for i in [i for i, c in enumerate(line) if c == "{"]:  # later '{' = row glued to a stub
            try:
                row = json.loads(line[i:])
            except ValueError:
                continue
            # A glued row starts with the stub's first key; a nested object of a stub does not.
            if isinstance(row, dict) and (i == 0 or _first_key(line) == _first_key(line[i:])):
                rows.append(row)
                break
    return rows


def _first_key(text: str) -> str | None:
    m = re.match(r'\{\s*"([^"]*)"', text)
    return m.group(1) if m else None


def num(v: Any) -> float | None:
    """A finite float, or None for missing, null, NaN, inf, bools and strings."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def continuous(rows: Sequence[dict], key: str = "step") -> list[dict]:
    """One trajectory: where ``key`` goes back (a resume) the later rows replace the earlier rows
    they overlap, so steps logged before a crash and replayed after the resume count once."""
    out: list[dict] = []
    for r in rows:
        k = num(r.get(key))
        if k is None:
            continue
        while out and out[-1][key] >= k:
            out.pop()
        out.append(r)
    return out


def load_mapping(path: Path) -> tuple[dict, str | None]:
    """(mapping, problem) for a JSON or YAML file: missing or unreadable gives {} and a note."""
    import yaml

    if not path.is_file():
        return {}, f"no {path.name}"
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        return {}, f"{path.name} is unreadable ({type(e).__name__})"
    return (data, None) if isinstance(data, dict) else ({}, f"{path.name} is not a mapping")


def get_dotted(cfg: Any, dotted: str) -> Any:
    for k in dotted.split("."):
        cfg = cfg.get(k) if isinstance(cfg, dict) else None
    return cfg
