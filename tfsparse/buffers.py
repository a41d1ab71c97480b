"""Host buffers the exchange hands out again: no round maps fresh pages.

A large numpy array is memory fresh from the system (glibc maps it anew and returns it when it is
freed), so every page is faulted in on first touch, on every round.  The exchange
therefore keeps its per-round buffers (result vectors, encoded messages, receive buffers) and
hands one out again once **nothing refers to it any more**: no view, no pending MPI request, no
TensorFlow tensor, no caller -- Python's reference counts say so.  A buffer still referred to is
never written; a caller that keeps every result simply gets a new buffer each time.

Every buffer is 64-byte aligned (:func:`aligned_empty`): TensorFlow takes an aligned array that a
``tf.numpy_function`` returns as the tensor itself, without copying it.
"""
from __future__ import annotations

import sys
import threading

import numpy as np

# A reused buffer's pages are mapped already: an encoding into new pages pays for mapping them
# (the ``message_buffer`` rows of docs/engine_choices.json, ``tools/bench_choices.py``).

#: alignment of the buffers: Eigen's, what TensorFlow needs to use a numpy array's memory as is
ALIGN = 64


def aligned_empty(n: int, dtype=np.float32) -> np.ndarray:
    """An uninitialised vector of ``n`` elements of ``dtype`` whose data is :data:`ALIGN`-byte
    aligned (a view of a slightly larger byte array, its ``base``)."""
    dtype = np.dtype(dtype)
    nbytes = int(n) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.__array_interface__["data"][0] % ALIGN
    return raw[skip:skip + nbytes].view(dtype)


def _refs(v) -> tuple[int, int]:
    """The reference counts of a pooled vector and of the array that owns its memory (every view
    of the vector refers to that owner)."""
    return sys.getrefcount(v), sys.getrefcount(v.base)


class Reusable:
    """Buffers of any size and dtype, handed out by :meth:`take` and reused once released.

    Up to ``keep`` buffers are kept (a larger request replaces the smallest free one); each is
    a byte array, viewed as the dtype asked for."""

    def __init__(self, keep: int = 8):
        self.keep = int(keep)
        self._buffers: list = []
        self._lock = threading.Lock()  # the caller's thread and the communication thread both take
        probe = [aligned_empty(1, np.uint8)]
        for v in probe:  # the counts of a buffer nothing else refers to, taken as take() takes them
            self._idle = _refs(v)

    def take(self, count: int, dtype=np.float32) -> np.ndarray:
        """A vector of ``count`` elements of ``dtype`` that nothing else refers to (contents
        undefined)."""
        dtype = np.dtype(dtype)
        with self._lock:
            return self._take(int(count) * dtype.itemsize).view(dtype)

    def _take(self, nbytes: int) -> np.ndarray:
        spare = None
        i = 0
        for v in self._buffers:  # (the loop of __init__'s counts)
            if _refs(v) == self._idle:
                if v.size >= nbytes:
                    return v[:nbytes]
                if spare is None or v.size < self._buffers[spare].size:
                    spare = i
            i += 1
        v = aligned_empty(nbytes, np.uint8)
        if len(self._buffers) < self.keep:
            self._buffers.append(v)
        elif spare is not None:
            self._buffers[spare] = v
        return v[:nbytes]


class HostOutputs:
    """The result vectors of one bucket on the host, handed out by :meth:`take`: float32 vectors
    of the bucket's size, aligned and reused (see the module docstring), so that the exchange
    decodes straight into the tensor the optimizer applies.  Up to ``keep`` are kept.

    Each vector's memory runs on to a multiple of 16 elements (64 bytes): :meth:`padded` gives
    that longer view, which TensorFlow can cut into per-tensor slices without copying them (its
    slicing shares memory only where a slice's start and length are 64-byte multiples)."""

    def __init__(self, n: int, keep: int = 3):
        self.n = int(n)
        self.n_padded = -(-self.n // 16) * 16
        self._pool = Reusable(keep)

    def take(self) -> np.ndarray:
        """A float32 vector of ``n`` elements that nothing else refers to (contents undefined:
        TensorFlow, which had it last, may have written it -- its element-wise ops reuse an
        input's memory for their output where nothing else holds that tensor)."""
        return self._pool.take(self.n_padded, np.float32)[:self.n]

    def padded(self, vec) -> np.ndarray | None:
        """The :attr:`n_padded`-element view of ``vec``'s memory, when ``vec`` is a vector
        :meth:`take` handed out (its tail is undefined); None otherwise."""
        if not isinstance(vec, np.ndarray) or vec.size != self.n:
            return None
        start = vec.__array_interface__["data"][0]
        for v in self._pool._buffers:
            if v.__array_interface__["data"][0] == start and v.size >= 4 * self.n_padded:
                return v[:4 * self.n_padded].view(np.float32)
        return None
