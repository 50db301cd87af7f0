"""How a number reads on the console and in the report: ``number(v)``, one format everywhere.

Four significant figures, so an MSE of 4e-5 is not ``0.0000`` and a loss of 0.1234 keeps its
digits; scientific notation past 1e5 or under 1e-3, so a divergence reads ``4.656e+25`` rather
than 27 digits; trailing zeros kept, so a column of losses keeps its width.
"""

from __future__ import annotations

import math

#: Significant figures shown.
DIGITS = 4
#: Magnitudes at or above LARGE, or below SMALL (zero apart), are written in scientific notation.
LARGE, SMALL = 1e5, 1e-3


def number(v: float, digits: int = DIGITS) -> str:
    """``0.1234``, ``12.35``, ``1234``, ``0.001234``, ``4.000e-05``, ``4.656e+25``, ``0``;
    ``inf``, ``-inf`` and ``nan`` as Python writes them; an int as itself."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) and abs(v) < LARGE:
        return str(v)
    if not math.isfinite(v):
        return str(float(v))
    if v == 0:
        return "0"
    sci = f"{v:.{digits - 1}e}"
    exponent = int(sci.split("e")[1])  # of the rounded value: 99999.7 is 1.000e+05
    if not math.log10(SMALL) <= exponent < math.log10(LARGE):
        return sci
    return f"{v:.{max(0, digits - 1 - exponent)}f}"
