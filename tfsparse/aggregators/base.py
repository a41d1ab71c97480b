"""Aggregator interface: a sparse allreduce algorithm over a Communicator."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from ..collectives.communicator import Communicator


@dataclass
class AllreduceResult:
    """Result of one sparse allreduce.

    Attributes:
      indices: int64 indices of the global result, ascending and unique; ``None``
        for a dense result (``values`` then holds every element).
      values: float32 values at ``indices``, **summed** over ranks; identical on all ranks.
      contributed: this rank's indices whose values went into the result (residual
        bookkeeping); ``None`` means every element was contributed.
      sent_elements: gradient elements (values) this rank contributed, for density stats.
    """

    indices: np.ndarray | None
    values: np.ndarray
    contributed: np.ndarray | None
    sent_elements: int

    def to_dense(self, n: int) -> np.ndarray:
        if self.indices is None:
            return self.values.reshape(-1).astype(np.float32, copy=False)
        out = np.zeros(n, dtype=np.float32)
        out[self.indices] = self.values
        return out


class Aggregator:
    """Base class.  Subclasses set ``name`` and implement :meth:`allreduce`.

    ``uses_memory``: whether error feedback applies (False for lossless dense).
    """

    name = "base"
    uses_memory = True

    def allreduce(self, comm: Communicator, acc: np.ndarray, k: int) -> AllreduceResult:
        raise TypeError(f"{type(self).__name__} does not define allreduce()")

    def reset(self) -> None:
        """Forgets cached state (thresholds, boundaries); called when the gradient layout changes."""

    def __repr__(self):
        return f"{type(self).__name__}()"


def check_acc(acc: np.ndarray, k: int) -> np.ndarray:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise ValueError(f"k={k!r} must be an integer number of elements to keep")
    acc = np.ascontiguousarray(acc, dtype=np.float32).reshape(-1)
    if not 0 <= k <= acc.size:
        raise ValueError(f"k={k} must be in [0, {acc.size}] (the gradient has {acc.size} elements)")
    return acc


def sum_sparse(parts_idx: list[np.ndarray], parts_val: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sums sparse vectors given as (indices, values) pairs, in list order.

    Returns unique ascending indices and their float32 sums.  The summation order
    (list order, then position) is fixed, so every rank computing this on the same
    inputs gets bit-identical values.
    """
    if not parts_idx:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    idx = np.concatenate(parts_idx).astype(np.int64, copy=False)
    val = np.concatenate(parts_val).astype(np.float32, copy=False)
    uniq, inverse = np.unique(idx, return_inverse=True)
    out = np.zeros(uniq.size, dtype=np.float32)
    np.add.at(out, inverse, val)
    return uniq, out
