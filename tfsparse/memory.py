"""Memory: error feedback (GRACE's "memory" part).

The residual itself is state of the exchange (one float32 vector per bucket, saved in
checkpoints); these classes only define the arithmetic.

* :class:`ResidualMemory` -- gtopk-ssgd-shi2019 Alg. 1 line 4 and line 8:
  ``acc = residual + grad``; after the exchange, every entry of ``acc`` that was *not*
  contributed to the global result stays in the residual, and so does what the wire lost on
  the values that were (``acc - decode(encode(acc))``, :class:`~tfsparse.wire.WireLoss`).
* :class:`NoMemory` -- for lossless aggregation over a lossless wire (dense, float32).
"""
from __future__ import annotations

import numpy as np


class NoMemory:
    stateful = False

    def compensate(self, grad: np.ndarray, residual, out: np.ndarray) -> np.ndarray:
        """``out[:] = grad`` (the gradient travels as it is)."""
        np.copyto(out, np.reshape(grad, -1), casting="same_kind")
        return out

    def update(self, acc: np.ndarray, result) -> None:
        return None


class ResidualMemory:
    """Residual accumulation (error feedback)."""

    stateful = True

    def compensate(self, grad: np.ndarray, residual: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out[:] = grad + residual`` (float32, in one pass)."""
        np.add(np.reshape(grad, -1), residual, out=out, casting="same_kind")
        return out

    def update(self, acc: np.ndarray, result) -> np.ndarray:
        """The new residual, in place of ``acc``: the contributed entries removed
        (``result.contributed``; ``None`` means everything), plus what the wire lost
        (``result.loss``)."""
        if result.contributed is None:
            acc.fill(0.0)
        else:
            acc[result.contributed] = 0.0
        result.loss.apply_to(acc)
        return acc
