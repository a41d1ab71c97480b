"""The exchange's memory traffic, counted where the bytes move: "passes" over the gradient.

Each stage of a round that touches gradient-sized memory adds the bytes it reads and writes
(:func:`count`) under its name:

* ``compensate`` -- the memory's error feedback (``acc = grad + residual``; momentum correction's
  velocity update; a plain copy where nothing is kept);
* ``finite``     -- the finiteness check of the offered vector;
* ``select``     -- the local selection (top-k, threshold, hash: every streaming pass the kernel
  makes, the radix select's histogram passes included);
* ``encode``     -- encoding values for the wire (16/8-bit codes and what they lost);
* ``decode``     -- decoding received values and building the dense result;
* ``update``     -- the memory's update (the new residual: sent entries cleared, the wire's loss added);
* ``copy``       -- copies between the stages (concatenations, host copies).

Counting costs nothing unless a benchmark records (:func:`recording`): then every count is
added, under a lock, to each active :class:`Traffic`.  ``Traffic.passes(gradient_bytes)``
divides by the gradient's bytes (``4 n``): one pass reads or writes the whole gradient once.
Work on k-sized arrays (a sparse payload's packing, the tree merges of gTop-k, Ok-Topk's
partitions) is not counted: it is at most a few times the density.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

STAGES = ("compensate", "finite", "select", "encode", "decode", "update", "copy")


class Traffic:
    """Bytes read and written per stage while :func:`recording`."""

    def __init__(self):
        self.read = dict.fromkeys(STAGES, 0)
        self.written = dict.fromkeys(STAGES, 0)
        self._lock = threading.Lock()

    def add(self, stage: str, read: int, written: int) -> None:
        """Adds bytes to a stage (from any thread).

        Args:
          stage: one of :data:`STAGES`.
          read: bytes read.
          written: bytes written.
        """
        with self._lock:
            self.read[stage] += read
            self.written[stage] += written

    def bytes(self) -> int:
        """The bytes read and written so far, over every stage.

        Returns:
          An int.
        """
        return sum(self.read.values()) + sum(self.written.values())

    def passes(self, gradient_bytes: float, rounds: int = 1) -> dict:
        """The traffic in passes over the gradient, per stage and in total.

        Args:
          gradient_bytes: the bytes of one gradient (one pass).
          rounds: the rounds recorded.

        Returns:
          ``{stage: (read + written) / gradient_bytes / rounds, ..., "total": ...}``, rounded to 2 places.
        """
        per = {s: (self.read[s] + self.written[s]) / gradient_bytes / rounds for s in STAGES}
        per["total"] = sum(per.values())
        return {s: round(v, 2) for s, v in per.items()}


_recording: list = []


def count(stage: str, read: int = 0, written: int = 0) -> None:
    """Adds bytes to ``stage`` of every recording :class:`Traffic` (nothing when none records).

    Args:
      stage: one of :data:`STAGES`.
      read: bytes read.
      written: bytes written.
    """
    if _recording:
        for t in tuple(_recording):
            t.add(stage, int(read), int(written))


@contextmanager
def recording():
    """``with recording() as t:`` counts the traffic of everything the block runs (every thread)."""
    t = Traffic()
    _recording.append(t)
    try:
        yield t
    finally:
        _recording.remove(t)
