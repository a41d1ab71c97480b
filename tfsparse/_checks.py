"""Argument checks shared by every public constructor: one message format for bad numbers, one
for a value outside a set of choices.

:func:`real` and :func:`integer` raise ``ValueError("<name>=<value!r> is not valid; accepted:
<what>")`` -- naming the argument, the value and the accepted values -- before any communication,
and return the value as a Python ``float``/``int``.  bools are refused (``True`` is not a
density), and so are NaN and infinities.  :func:`choice` raises ``ValueError("<name>=<value!r>
is not supported; accepted: <choices>")``.  Imports nothing from the package, so every module may
use it.
"""
from __future__ import annotations

import math
import numbers


def _reject(name: str, value, accepted: str, hint: str):
    raise ValueError(f"{name}={value!r} is not valid; accepted: {accepted}{hint}")


def real(name: str, value, lo: float | None = None, hi: float | None = None, *,
         lo_open: bool = False, hi_open: bool = False, hint: str = "") -> float:
    """``value`` as a float if it is a finite real number in the interval from ``lo`` to ``hi``
    (None: unbounded; ``lo_open``/``hi_open``: the bound itself excluded)."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        left = "(-inf" if lo is None else f"{'(' if lo_open else '['}{lo:g}"
        right = "inf)" if hi is None else f"{hi:g}{')' if hi_open else ']'}"
        _reject(name, value, f"a number in {left}, {right}", hint)
    return float(value)


def integer(name: str, value, minimum: int | None = None, maximum: int | None = None, *, hint: str = "") -> int:
    """``value`` as an int if it is an integer (Python or numpy) from ``minimum`` to ``maximum``
    (None: unbounded)."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Integral)
    if ok and minimum is not None:
        ok = value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        if maximum is None:
            accepted = "an integer" if minimum is None else f"an integer >= {minimum}"
        else:
            accepted = f"an integer in [{'-inf' if minimum is None else minimum}, {maximum}]"
        _reject(name, value, accepted, hint)
    return int(value)


def choice(name: str, value, choices, *, accepted: str | None = None):
    """``value`` if it equals one of ``choices`` and is of its type (or a subclass: a numpy
    string is a string; but ``True`` is not 1) -- an integer of any kind (numpy's too, not a
    bool) as a Python ``int``; else ``ValueError`` naming ``name``, the value and ``accepted``
    (default: the choices' reprs joined by commas)."""
    if not isinstance(value, bool) and isinstance(value, numbers.Integral):
        value = int(value)

    def same(c) -> bool:
        try:
            equal = bool(c == value)
        except (TypeError, ValueError):  # an array, or a value that cannot compare
            return False
        return equal and (type(value) is type(c) or (not isinstance(value, bool) and isinstance(value, type(c))))

    ok = any(same(c) for c in choices)
    if not ok:
        raise ValueError(f"{name}={value!r} is not supported; accepted: "
                         f"{', '.join(repr(c) for c in choices) if accepted is None else accepted}")
    return value
