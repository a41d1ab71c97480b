"""The CPU kernels of sparse payloads (:mod:`tfsparse.ops.cpu`): sorted index sets (gTop-k's
merge, Ok-Topk's intersection, the blocked index code) and the decoding scatter and densify."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._cpu_bits import as_f32

# ----------------------------------------------------------------------------- sorted index sets

@njit(cache=True, nogil=True)
def _merge_sum(a_idx, a_val, b_idx, b_val):
    """The union of two ascending unique index arrays, with ``a``'s value plus ``b``'s where both
    have an index (float32, ``a + b`` in that order), in one linear merge; ``b``'s own entries are
    ``0 + b`` (a -0.0 becomes +0.0, as adding into zeros does)."""
    zero = np.float32(0.0)
    na, nb = a_idx.size, b_idx.size
    idx = np.empty(na + nb, np.int64)
    val = np.empty(na + nb, np.float32)
    i = j = o = 0
    while i < na and j < nb:
        x, y = a_idx[i], b_idx[j]
        if x < y:
            idx[o] = x
            val[o] = a_val[i]
            i += 1
        elif y < x:
            idx[o] = y
            val[o] = zero + b_val[j]
            j += 1
        else:
            idx[o] = x
            val[o] = a_val[i] + b_val[j]
            i += 1
            j += 1
        o += 1
    while i < na:
        idx[o] = a_idx[i]
        val[o] = a_val[i]
        i += 1
        o += 1
    while j < nb:
        idx[o] = b_idx[j]
        val[o] = zero + b_val[j]
        j += 1
        o += 1
    return idx[:o], val[:o]


@njit(cache=True, nogil=True)
def _intersect_sorted(a, b):
    """The indices in both ascending unique arrays ``a`` and ``b``, ascending (a linear merge)."""
    out = np.empty(min(a.size, b.size), np.int64)
    i = j = o = 0
    while i < a.size and j < b.size:
        x, y = a[i], b[j]
        if x < y:
            i += 1
        elif y < x:
            j += 1
        else:
            out[o] = x
            o += 1
            i += 1
            j += 1
    return out[:o]


def merge_sum(a_idx, a_val, b_idx, b_val):
    """``(union, summed)`` of two sparse vectors given as ascending unique int64 indices with
    float32 values: every index of either, ascending, with ``a_val + b_val`` (float32, in that
    order) where both hold it, and ``0 + b_val`` where only ``b`` does -- what ``np.unique`` of
    the concatenation, an assignment of ``a`` into zeros and an addition of ``b`` give, in one
    pass instead of a sort."""
    return _merge_sum(np.ascontiguousarray(a_idx, np.int64), as_f32(a_val),
                      np.ascontiguousarray(b_idx, np.int64), as_f32(b_val))


def intersect_sorted(a, b) -> np.ndarray:
    """``np.intersect1d(a, b, assume_unique=True)`` of two ascending unique int64 index arrays
    (the same array), in one linear merge instead of a sort."""
    return _intersect_sorted(np.ascontiguousarray(a, np.int64), np.ascontiguousarray(b, np.int64))


@njit(cache=True, nogil=True)
def _blocked_encode(idx, n, counts, low):
    """Counts per 64K-element block and low 16 bits of ascending indices; False if they do not
    strictly ascend within ``[0, n)``."""
    prev = np.int64(-1)
    ok = True
    for j in range(idx.size):
        i = np.int64(idx[j])
        ok = ok and prev < i < n
        prev = i
        if ok:
            counts[i >> 16] += 1
            low[j] = np.uint16(i & 0xFFFF)
    return ok


@njit(cache=True, nogil=True)
def _blocked_decode(counts, low, out):
    j = 0
    for blk in range(counts.size):
        base = np.int64(blk) << 16
        for _ in range(counts[blk]):
            out[j] = base | np.int64(low[j])
            j += 1
    return out


def blocked_indices_encode(idx, n: int, blocks: int) -> np.ndarray:
    """:class:`tfsparse.wire.BlockedIndices`' bytes of strictly ascending indices in ``[0, n)``:
    ``blocks`` uint32 counts, then the uint16 low bits padded to 4 bytes.  ValueError when the
    indices do not ascend."""
    idx = np.ascontiguousarray(idx).reshape(-1)
    m = idx.size
    out = np.zeros(4 * blocks + 4 * (-(-m // 2)), np.uint8)
    counts = out[:4 * blocks].view(np.uint32)
    low = out[4 * blocks:4 * blocks + 2 * m].view(np.uint16)
    if not _blocked_encode(idx, np.int64(n), counts, low):
        raise ValueError(f"blocked index coding needs strictly ascending indices in [0, {n}); got {m} that are not")
    return out


def blocked_indices_decode(counts, low) -> np.ndarray:
    """The int64 indices of :func:`blocked_indices_encode`'s counts and low bits."""
    counts = np.ascontiguousarray(counts, np.uint32).reshape(-1)
    low = np.ascontiguousarray(low, np.uint16).reshape(-1)
    if int(counts.sum(dtype=np.int64)) != low.size:
        raise ValueError(f"blocked indices: the counts add up to {int(counts.sum(dtype=np.int64))}, "
                         f"not to the {low.size} low parts")
    return _blocked_decode(counts, low, np.empty(low.size, np.int64))


# ----------------------------------------------------------------------------- decoding

@njit(parallel=True, cache=True, nogil=True)
def _scatter_add(out, idx, val, nblocks):
    """``out[idx] += val`` in payload order; block ``b`` of the output is owned by one thread
    (each scans all payload entries, so every element is summed in payload order)."""
    n = out.size
    p = idx.size
    for blk in prange(nblocks):
        lo = blk * n // nblocks
        hi = (blk + 1) * n // nblocks
        for j in range(p):
            i = np.int64(idx[j])
            if i >= lo and i < hi:
                out[i] += val[j]
    return out


@njit(cache=True, nogil=True)
def _index_range(idx):
    mx = -1
    for j in range(idx.size):
        mx = max(mx, np.int64(idx[j]))
    return mx


@njit(cache=True, nogil=True)
def _ascending_pieces(idx, starts, n):
    """Whether every piece ``idx[starts[p]:starts[p + 1]]`` is strictly ascending within
    ``[0, n)``."""
    for p in range(starts.size - 1):
        prev = np.int64(-1)
        for j in range(starts[p], starts[p + 1]):
            i = np.int64(idx[j])
            if i <= prev or i >= n:
                return False
            prev = i
    return True


@njit(cache=True, inline="always")
def _lower_bound(idx, lo, hi, value):
    """The first ``j`` in ``[lo, hi)`` with ``idx[j] >= value`` (``idx`` ascending there)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if np.int64(idx[mid]) < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


_TILE = 1 << 13  # elements of output one thread zeroes and then fills while they stay in its cache


@njit(parallel=True, cache=True, nogil=True)
def _densify(out, idx, val, starts, add, nblocks):
    """``out`` = the dense vector of the sparse pieces ``(idx, val)[starts[p]:starts[p + 1]]``
    (each strictly ascending), tile by tile: a tile of ``_TILE`` elements is zeroed and then gets
    the pieces' entries in it, piece after piece, while it is in the cache -- one sequential write
    of the output, no scattered misses.  At an index in several pieces the values are summed in
    piece order from +0.0 (``add``: what ``np.add.at`` into zeros gives); ``add=False`` (one
    piece) stores the value itself.  Block ``b`` of the output is one thread's; each finds its
    cursors by binary search."""
    n = out.size
    P = starts.size - 1
    for blk in prange(nblocks):
        lo = blk * n // nblocks
        hi = (blk + 1) * n // nblocks
        cur = np.empty(P, np.int64)
        for p in range(P):
            cur[p] = _lower_bound(idx, starts[p], starts[p + 1], lo)
        for t0 in range(lo, hi, _TILE):
            t1 = min(t0 + _TILE, hi)
            y = out[t0:t1]
            for j in range(y.size):
                y[j] = np.float32(0.0)
            for p in range(P):
                c = cur[p]
                e = starts[p + 1]
                if add:
                    while c < e and np.int64(idx[c]) < t1:
                        out[idx[c]] += val[c]
                        c += 1
                else:
                    while c < e and np.int64(idx[c]) < t1:
                        out[idx[c]] = val[c]
                        c += 1
                cur[p] = c
    return out
