"""Memory: error feedback (GRACE's "memory" part).

The residual state itself lives in TensorFlow variables owned by the optimizer or
strategy (so checkpoints save it); these classes only define the arithmetic.

* :class:`ResidualMemory` — gtopk-ssgd-shi2019 Alg. 1 line 4 and line 8:
  ``acc = residual + grad``; after the exchange, every entry of ``acc`` that was
  *not* contributed to the global result stays in the residual.
* :class:`NoMemory` — for lossless aggregation (dense).
"""
from __future__ import annotations

import numpy as np


class NoMemory:
    stateful = False

    def compensate(self, grad: np.ndarray, residual) -> np.ndarray:
        return grad

    def update(self, acc: np.ndarray, contributed) -> None:
        return None


class ResidualMemory:
    """Residual accumulation (error feedback)."""

    stateful = True

    def compensate(self, grad: np.ndarray, residual: np.ndarray) -> np.ndarray:
        return grad + residual

    def update(self, acc: np.ndarray, contributed) -> np.ndarray:
        """New residual: ``acc`` with the contributed entries removed.

        ``contributed`` is an index array (or ``None`` meaning "everything").
        """
        if contributed is None:
            return np.zeros_like(acc)
        residual = acc.copy()
        residual[contributed] = 0.0
        return residual
