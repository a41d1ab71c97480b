"""Sparse messages: ``[indices | encoded values]`` (:func:`pack_sparse`), the indices by an index
codec (:func:`index_codec`: :class:`BlockedIndices` or :class:`PlainIndices`)."""
from __future__ import annotations

import math

import numpy as np

from .values import FLOAT32, Wire, _corrupt


def index_dtype(n: int):
    """The dtype indices into ``n`` elements travel as: int32 when they fit (the papers' 2k-element COO volume), else int64.

    Args:
      n: the vector's elements.

    Returns:
      ``np.int32`` or ``np.int64``.
    """
    return np.int32 if n < 2**31 else np.int64


#: elements per block of :class:`BlockedIndices` (an index's low 16 bits travel, the block's
#: number is implied by the count of each block)
INDEX_BLOCK = 1 << 16


class PlainIndices:
    """Indices as they are: int32 (int64 from ``2**31`` elements), in any order.

    Args:
      n: the elements of the vector the indices point into.
    """

    header_bytes = 0

    def __init__(self, n: int):
        self.itype = np.dtype(index_dtype(n))
        self.index_bytes = self.itype.itemsize

    def nbytes(self, m) -> int:
        """Bytes of the indices of ``m`` entries (with any header).

        Args:
          m: the entries (may be an expected count, not an int).

        Returns:
          ``m * index_bytes``.
        """
        return m * self.index_bytes

    def encode(self, idx) -> np.ndarray:
        """The indices as the bytes of contiguous int32 (int64 from ``2**31`` elements), in the order given.

        Args:
          idx: the indices.

        Returns:
          A ``uint8`` view.
        """
        return np.ascontiguousarray(idx, dtype=self.itype).reshape(-1).view(np.uint8)

    def split(self, buf, wire) -> tuple[np.ndarray, int]:
        """Splits a message ``[indices | values]``.

        Args:
          buf: the message (``uint8``).
          wire: the :class:`Wire` its values were encoded with (it tells how many entries the length holds).

        Returns:
          ``(indices, offset)``: int64 indices, and the byte offset where the values start.

        Raises:
          RuntimeError: the length fits no number of entries.
        """
        m = wire.entries(buf.size, self.index_bytes)
        return buf[:m * self.index_bytes].copy().view(self.itype).astype(np.int64), m * self.index_bytes

    def __repr__(self):
        return f"PlainIndices({self.itype.name})"


class BlockedIndices:
    """Ascending indices in three quarters of int32's bytes, losslessly.

    The count of indices in each block of :data:`INDEX_BLOCK` elements (uint32, one per block of
    the vector), then each index's low 16 bits (uint16, padded to 4 bytes so that float32 values
    after them stay aligned).  ``header_bytes + 2m`` against int32's ``4m``: chosen by
    :func:`index_codec` where it is smaller.  Decoding rebuilds the same int64 indices; encoding
    checks that they ascend.

    Args:
      n: the elements of the vector the indices point into.
    """

    index_bytes = 2

    def __init__(self, n: int):
        self.n = int(n)
        self.blocks = max(1, -(-self.n // INDEX_BLOCK))
        self.header_bytes = 4 * self.blocks

    def nbytes(self, m) -> int:
        """The counts per block (``header_bytes``) and ``m`` uint16 low parts padded to 4 bytes.

        Args:
          m: the entries (may be an expected count, not an int).

        Returns:
          ``header_bytes + 4 ceil(m / 2)``.
        """
        return self.header_bytes + 4 * math.ceil(m / 2)

    def encode(self, idx) -> np.ndarray:
        """The count of indices in each block, then each index's low 16 bits (:func:`tfsparse.ops.cpu.blocked_indices_encode`).

        Args:
          idx: strictly ascending indices in ``[0, n)``.

        Returns:
          A ``uint8`` vector of :meth:`nbytes` bytes.

        Raises:
          ValueError: ``idx`` does not ascend strictly within ``[0, n)``.
        """
        from ..ops import cpu

        return cpu.blocked_indices_encode(idx, self.n, self.blocks)

    def split(self, buf, wire) -> tuple[np.ndarray, int]:
        """Splits a message ``[indices | values]``, rebuilding the int64 indices from the counts and the low bits.

        Args:
          buf: the message (``uint8``).
          wire: the :class:`Wire` its values were encoded with.

        Returns:
          ``(indices, offset)``: int64 indices, and the byte offset where the values start.

        Raises:
          RuntimeError: the length does not match the counts (a corrupt message).
        """
        from ..ops import cpu

        if buf.size < self.header_bytes:
            raise _corrupt(wire, buf.size, self.index_bytes)
        counts = buf[:self.header_bytes].copy().view(np.uint32)
        m = int(counts.sum(dtype=np.int64))
        end = self.nbytes(m)
        if buf.size < end or wire.entries(buf.size - end, 0) != m:
            raise _corrupt(wire, buf.size, self.index_bytes)
        low = buf[self.header_bytes:self.header_bytes + 2 * m].copy().view(np.uint16)
        return cpu.blocked_indices_decode(counts, low), end

    def __repr__(self):
        return f"BlockedIndices(n={self.n})"


def index_codec(n: int, k: int, ascending: bool = True):
    """How the indices of an ``n``-element vector's sparse messages of about ``k`` entries travel.

    Every rank derives the same codec from ``(n, k)``.

    Args:
      n: the vector's elements.
      k: the expected entries per message.
      ascending: whether the indices sent ascend (every selection but a custom compressor's).

    Returns:
      :class:`BlockedIndices` where the indices ascend and it takes fewer bytes than int32 for
      ``k`` entries, else :class:`PlainIndices`.
    """
    plain = PlainIndices(n)
    if ascending and k > 0:
        blocked = BlockedIndices(n)
        if blocked.nbytes(k) < plain.nbytes(k):
            return blocked
    return plain


def pack_sparse(idx, val, codec, wire: Wire = FLOAT32) -> tuple[np.ndarray, np.ndarray | None]:
    """One message ``[indices by codec | values encoded by wire]``.

    Args:
      idx: the entries' indices.
      val: their float32 values.
      codec: an index codec (:func:`index_codec`).
      wire: the value encoding.

    Returns:
      ``(buffer, loss)``: the message, and what the encoding lost on each value (None on a
      lossless wire).

    Raises:
      ValueError: a :class:`BlockedIndices` codec given indices that do not ascend strictly.
    """
    loss = np.empty(np.size(val), np.float32) if wire.lossy else None
    enc = wire.encode(val, loss)
    return np.concatenate([codec.encode(idx), enc]), loss


def unpack_sparse(buf, codec, wire: Wire = FLOAT32) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_sparse`.

    Args:
      buf: the message.
      codec: the index codec it was packed with.
      wire: the value encoding it was packed with.

    Returns:
      ``(indices, values)``: int64 and float32.

    Raises:
      RuntimeError: a corrupt message (its length fits no entries, or not the counts).
    """
    buf = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    idx, offset = codec.split(buf, wire)
    return idx, wire.decode(buf[offset:], idx.size)
