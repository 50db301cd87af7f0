"""A doctor finding: what was measured, what it likely means, and the one-line fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: "skipped": the check could not run here (it raised, or does not apply); ``measured`` says why.
SEVERITIES = ("error", "warning", "info", "skipped")


@dataclass
class Finding:
    check: str      # the check's name, e.g. "probabilities"
    severity: str   # error | warning | info | skipped
    measured: str   # what was measured, with the numbers
    cause: str      # the likely cause ("" for an info finding that only reports)
    fix: str        # the fix, in one line ("" when nothing needs fixing)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        lines = [f"{self.severity}: [{self.check}] {self.measured}"]
        if self.cause:
            lines.append(f"    cause: {self.cause}")
        if self.fix:
            lines.append(f"    fix:   {self.fix}")
        return "\n".join(lines)


def info(check: str, measured: str) -> Finding:
    return Finding(check, "info", measured, "", "")
