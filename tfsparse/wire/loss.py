"""What the wire lost: each rank's record of ``value - decode(encode(value))``, for error feedback."""
from __future__ import annotations

import numpy as np

from .. import traffic
from ..space import HOST


class WireLoss:
    """This rank's record of ``value - decode(encode(value))`` for the values it encoded.

    ``where`` is an int64 index array or a ``slice`` of the exchanged vector.  Aggregators
    record every encoding they perform (:meth:`add`, with the loss :meth:`Wire.encode` wrote)
    and keep, at the end of the exchange, the losses of the values that reached the global
    result (:meth:`restrict`); the memory adds them to the residual.  Nothing is recorded for
    a lossless wire.
    """

    def __init__(self):
        self.parts: list = []

    def add(self, where, loss) -> None:
        """Records what one encoding lost.

        Args:
          where: an int64 index array or a ``slice`` of the exchanged vector.
          loss: one float32 value per element of ``where``; None (a lossless wire) records nothing.
        """
        if loss is not None:
            self.parts.append((where, loss))

    def restrict(self, g_idx) -> "WireLoss":
        """Keeps only the entries whose index reached the global result.

        Args:
          g_idx: the result's indices (ascending, unique); None: a dense result, everything reached it.

        Returns:
          A :class:`WireLoss` (this one where ``g_idx`` is None).
        """
        if g_idx is None:  # a dense result: everything reached it
            return self
        out = WireLoss()
        g_idx = np.asarray(g_idx)
        if g_idx.size == 0:
            return out
        for where, loss in self.parts:
            if isinstance(where, slice):
                where = np.arange(where.start, where.stop, dtype=np.int64)
            pos = np.minimum(np.searchsorted(g_idx, where), g_idx.size - 1)
            hit = g_idx[pos] == where
            if hit.any():
                out.parts.append((where[hit], loss[hit]))
        return out

    def apply_to(self, residual, space=HOST) -> None:
        """``residual[where] += loss`` for every record (indices are unique within a record).

        Args:
          residual: the memory's float32 residual.
          space: where ``residual`` lives (:mod:`tfsparse.space`: a device residual is added to on
            the device).
        """
        for where, loss in self.parts:
            traffic.count("update", read=2 * loss.nbytes, written=loss.nbytes)
            space.add_at(residual, where, loss)

    def __bool__(self):
        return bool(self.parts)
