"""Compressors decide *what* a rank sends: a sparse (indices, values) payload of its
accumulated gradient (GRACE's "compressor" part).

Each compressor maps ``acc`` (float32, 1-D: gradient + residual) and a budget ``k``
to ``(indices, values)`` with ``indices`` int64 and ascending.
"""
from __future__ import annotations

import numpy as np


class Compressor:
    """Base class; subclasses implement :meth:`compress`."""

    name = "base"

    def compress(self, acc: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Returns (indices, values) of the entries to send."""
        raise TypeError(f"{type(self).__name__} does not define compress()")

    def __repr__(self):
        return f"{type(self).__name__}()"


def topk_indices(acc: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the ``k`` entries of largest ``|acc|`` (exact selection).

    Ties at the threshold are broken arbitrarily but deterministically for a given input.
    NaN compares larger than any number, so non-finite gradients are always sent
    (and show up in the result instead of hiding in the residual).
    """
    n = acc.size
    k = int(min(max(k, 0), n))
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if k == n:
        return np.arange(n, dtype=np.int64)
    mag = np.abs(acc)
    part = np.argpartition(mag, n - k)[n - k:]
    return np.sort(part).astype(np.int64, copy=False)


class TopK(Compressor):
    """Exact local top-k by magnitude (gtopk-ssgd-shi2019 Alg. 1 lines 5-7)."""

    name = "topk"

    def compress(self, acc, k):
        idx = topk_indices(acc, k)
        return idx, acc[idx]


class Identity(Compressor):
    """Sends everything (dense)."""

    name = "identity"

    def compress(self, acc, k):
        return np.arange(acc.size, dtype=np.int64), acc.copy()
