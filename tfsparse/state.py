"""Explicit state: what a part of the exchange carries from one step to the next, as data.

Compressors and aggregators that remember anything between calls (Ok-Topk's thresholds and
boundaries, DGC's random generator) expose it as ``get_state() -> {name: numpy array}`` and take
it back with ``set_state(state)``, so that checkpoints hold it and a resumed run continues
bit-identically (the optax idea of explicit state, in the GRACE parts' vocabulary).
"""
from __future__ import annotations


class Stateful:
    """Base of the parts with explicit state; stateless by default."""

    name = "base"

    def get_state(self) -> dict:
        """What this part carries between calls, as ``{name: numpy array}`` (a copy)."""
        return {}

    def set_state(self, state: dict) -> None:
        """Restores :meth:`get_state`'s output (an empty dict: nothing saved, start afresh).
        Subclasses restore their keys after calling this check."""
        unknown = sorted(set(state) - set(self.get_state()))
        if unknown:
            raise ValueError(f"state keys {unknown} do not belong to {type(self).__name__} {self.name!r}")
