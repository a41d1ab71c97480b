"""The CPU selection kernels (:mod:`tfsparse.ops.cpu`): the skip-scanning threshold select
with its staging and compaction, the radix and sampled top-k, error feedback's fused add and
select, and the hashed selections.  The design is in :mod:`tfsparse.ops.cpu`'s docstring."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import _common as C
from ._atomics import atomic_max_i64
from ._cpu_bits import (_ABS, _BLK, _CH, _COMPRESS, _INFK, _NANK, _STG, _SUB, _U1, _add_stream16, _block_hit,
                        _compress16, _float_bits, _key, _slot, _store_fence, _sub_hit)

@njit(cache=True, inline="always")
def _count_ge(xu, b0, b1, klo):
    """Number of keys ``>= klo`` in ``xu[b0:b1]`` (branch-free, vectorised)."""
    y = xu[b0:b1]
    c = 0
    for i in range(y.size):
        c += np.int64(_key(y[i]) >= klo)
    return c


@njit(cache=True, inline="always")
def _stage_one(xu, x, i, klo, st_idx, st_val, bs, w, shift):
    """Stages element ``i`` (as ``i + shift``) when its key is ``>= klo`` and the chunk's staging
    area has room; returns the new count (counting past the area's end)."""
    if _key(xu[i]) >= klo:
        if w < _STG:
            st_idx[bs + w] = i + shift
            st_val[bs + w] = x[i]
        w += 1
    return w


@njit(cache=True, inline="always")
def _stage_hits(xu, x, b0, b1, t2, klo, st_idx, st_val, bs, w, shift=0):
    """Stages the elements of ``xu[b0:b1]`` with ``key >= klo`` at ``st_idx/st_val[bs + w:]`` (up to
    ``_STG`` per chunk, counting the rest; index ``i`` staged as ``i + shift``) and returns the new
    count: a full block 16 elements at a time by compressing stores where the CPU has them
    (:data:`_COMPRESS`: a store per 16 elements instead of a test per element, which pays
    most where hits are many), else narrowed by its ``_SUB``-element
    sub-blocks' maxima; a short one element by element."""
    if b1 - b0 == _BLK and _COMPRESS:
        kmin = np.int64(klo) if 0 <= klo <= _NANK else np.int64(0 if klo < 0 else 0xFFFFFFFF)
        for s0 in range(b0, b1, 16):
            if w + 16 <= _STG:
                w += _compress16(xu, x, s0, kmin, st_idx, st_val, bs + w, np.int64(s0 + shift))
            else:
                for i in range(s0, s0 + 16):
                    w = _stage_one(xu, x, i, klo, st_idx, st_val, bs, w, shift)
    elif b1 - b0 == _BLK:
        for s0 in range(b0, b1, _SUB):
            if _sub_hit(xu, s0, t2):
                for i in range(s0, s0 + _SUB):
                    w = _stage_one(xu, x, i, klo, st_idx, st_val, bs, w, shift)
    else:
        for i in range(b0, b1):
            w = _stage_one(xu, x, i, klo, st_idx, st_val, bs, w, shift)
    return w


@njit(parallel=True, cache=True, nogil=True)
def _compact(xu, x, klo, base, counts, st_idx, st_val):
    """The staged hits of every chunk, in index order, as ``(idx + base, val)``; a chunk with more
    than ``_STG`` hits is rescanned with unconditional stores (advancing on a hit; the guard keeps
    to the chunk's slice of the output)."""
    n = xu.size
    nch = counts.size
    offs = np.empty(nch + 1, np.int64)
    offs[0] = 0
    for c in range(nch):
        offs[c + 1] = offs[c] + counts[c]
    out_idx = np.empty(offs[nch], np.int64)
    out_val = np.empty(offs[nch], np.float32)
    for c in prange(nch):
        o = offs[c]
        if counts[c] <= _STG:
            bs = c * _STG
            for j in range(counts[c]):
                out_idx[o + j] = st_idx[bs + j] + base
                out_val[o + j] = st_val[bs + j]
        else:
            end = offs[c + 1]
            for i in range(c * _CH, min(c * _CH + _CH, n)):
                if o < end:
                    out_idx[o] = i + base
                    out_val[o] = x[i]
                o += np.int64(_key(xu[i]) >= klo)
    return out_idx, out_val


@njit(parallel=True, cache=True, nogil=True)
def _select_ge(xu, x, klo, st_idx, st_val):
    """Indices (ascending) and values of the elements with ``key >= klo``.

    One pass in the sparse case: each chunk stages up to ``_STG`` hits in its slice of
    ``st_idx``/``st_val`` (at least ``nchunks * _STG`` long); a chunk with more hits only
    counts the rest (vectorised) and is rescanned when the output is written.
    """
    n = xu.size
    nch = (n + _CH - 1) // _CH
    counts = np.zeros(nch, np.int64)
    t2 = np.uint32(klo << 1)
    for c in prange(nch):
        lo = c * _CH
        hi = min(lo + _CH, n)
        w = 0
        for b0 in range(lo, hi, _BLK):
            if w > _STG:  # overflowed: count the rest of the chunk, write it in the second phase
                w += _count_ge(xu, b0, hi, klo)
                break
            b1 = min(b0 + _BLK, hi)
            if b1 - b0 < _BLK or _block_hit(xu, b0, t2):
                w = _stage_hits(xu, x, b0, b1, t2, klo, st_idx, st_val, c * _STG, w)
        counts[c] = w
    return _compact(xu, x, klo, 0, counts, st_idx, st_val)


@njit(parallel=True, cache=True, nogil=True)
def _radix_hist(xu, shift, nbits, prefix, nthreads):
    """Histogram of the digit ``(key >> shift) & (2**nbits - 1)`` over the keys whose bits
    above the digit equal ``prefix`` (all keys on the first level, ``shift + nbits == 31``)."""
    n = xu.size
    nb = 1 << nbits
    mask = nb - 1
    pshift = shift + nbits
    nch = max(1, min((n + _CH - 1) // _CH, nthreads), (n >> 30) + 1)  # int32 counts per chunk
    hists = np.zeros((nch, 4, nb), np.int32)
    for c in prange(nch):
        lo = c * n // nch
        hi = (c + 1) * n // nch
        h = hists[c]
        if pshift >= C.KEY_BITS:
            # four interleaved sub-histograms: consecutive increments of one bin do not wait
            # for each other (store-to-load forwarding)
            i = lo
            while i + 4 <= hi:
                h[0, _key(xu[i]) >> shift] += 1
                h[1, _key(xu[i + 1]) >> shift] += 1
                h[2, _key(xu[i + 2]) >> shift] += 1
                h[3, _key(xu[i + 3]) >> shift] += 1
                i += 4
            for j in range(i, hi):
                h[0, _key(xu[j]) >> shift] += 1
        else:
            for i in range(lo, hi):
                kk = _key(xu[i])
                if (kk >> pshift) == prefix:
                    h[0, (kk >> shift) & mask] += 1
    hist = np.zeros(nb, np.int64)
    for c in range(nch):
        for q in range(4):
            for j in range(nb):
                hist[j] += hists[c, q, j]
    return hist


@njit(cache=True, nogil=True)
def _radix_select(xu, k, nthreads):
    """Exact k-th largest key ``t`` and ``r``, how many of the keys equal to ``t`` the top-k
    takes: three histogram passes over the 11 + 10 + 10 bits of the key."""
    prefix = 0
    need = k
    for level in range(3):
        nbits = 11 if level == 0 else 10
        shift = 20 - 10 * level
        hist = _radix_hist(xu, shift, nbits, prefix, nthreads)
        b = (1 << nbits) - 1
        while b > 0 and hist[b] < need:
            need -= hist[b]
            b -= 1
        prefix = (prefix << nbits) | b
    return prefix, need


@njit(parallel=True, cache=True, nogil=True)
def _select_top(xu, x, t, r, k):
    """The top-k given its exact k-th key ``t`` and tie quota ``r``: every key above ``t`` and
    the first ``r`` keys equal to ``t`` (index order), written once in index order.  Two
    branch-free passes (count, then write) -- the dense-k path."""
    n = xu.size
    nch = (n + _CH - 1) // _CH
    gt = np.zeros(nch, np.int64)
    eq = np.zeros(nch, np.int64)
    for c in prange(nch):
        y = xu[c * _CH:min(c * _CH + _CH, n)]
        g = 0
        e = 0
        for i in range(y.size):
            kk = _key(y[i])
            g += np.int64(kk > t)
            e += np.int64(kk == t)
        gt[c] = g
        eq[c] = e
    offs = np.empty(nch + 1, np.int64)
    quota = np.empty(nch, np.int64)
    offs[0] = 0
    ties_before = 0
    for c in range(nch):
        quota[c] = min(max(r - ties_before, 0), eq[c])
        ties_before += eq[c]
        offs[c + 1] = offs[c] + gt[c] + quota[c]
    out_idx = np.empty(k, np.int64)
    out_val = np.empty(k, np.float32)
    for c in prange(nch):
        o = offs[c]
        end = offs[c + 1]
        left = quota[c]
        for i in range(c * _CH, min(c * _CH + _CH, n)):
            kk = _key(xu[i])
            tie = (kk == t) and left > 0
            left -= np.int64(tie)
            if o < end:
                out_idx[o] = i
                out_val[o] = x[i]
            o += np.int64(kk > t or tie)
    return out_idx, out_val


@njit(cache=True, nogil=True)
def _keys_of(val):
    u = val.view(np.uint32)
    keys = np.empty(u.size, np.int64)
    for j in range(u.size):
        keys[j] = _key(u[j])
    return keys


_RADIX_MIN = 1 << 16  # from this many keys the radix select beats introselect (~10x at 213K-17M keys)


@njit(cache=True, nogil=True)
def _radix_kth(keys, k, hist):
    """k-th largest (1-based) of int64 ``keys`` all in ``[0, 2**32)`` by two 16-bit histogram
    passes (``hist``: 65,536 int64 of scratch), or -1 when some key is outside that range."""
    hist[:] = 0
    m = keys.size
    bad = False
    for j in range(m):
        kk = keys[j]
        bad |= (kk >> 32) != 0
        hist[(kk >> 16) & 0xFFFF] += 1
    if bad:
        return np.int64(-1)
    left = k
    hi = 0xFFFF
    while hist[hi] < left:
        left -= hist[hi]
        hi -= 1
    hist[:] = 0
    for j in range(m):
        kk = keys[j]
        if (kk >> 16) == hi:
            hist[kk & 0xFFFF] += 1
    lo = 0xFFFF
    while hist[lo] < left:
        left -= hist[lo]
        lo -= 1
    return (np.int64(hi) << 16) | np.int64(lo)


@njit(cache=True, nogil=True)
def _kth_key(keys, k):
    """k-th largest (1-based, ``0 < k <= keys.size``) of an int64 key array (``keys`` is not
    modified): a radix select over the magnitude keys' 32 bits for large arrays, numpy's
    introselect (a partitioned copy) for small ones or keys outside ``[0, 2**32)``."""
    m = keys.size
    if m >= _RADIX_MIN and 0 < k <= m:
        t = _radix_kth(keys, k, np.empty(1 << 16, np.int64))
        if t >= 0:
            return t
    return np.partition(keys, m - k)[m - k]


@njit(cache=True, inline="always")
def _sample_at(j, s, step, a, b, n64):
    """The ``j``-th of ``s`` stratified sample positions in ``n64`` elements: stratum ``j`` spans
    ``[j * step >> 32, (j + 1) * step >> 32)`` (the last one ends at ``n64``), and a hash of ``j``
    picks the position within it."""
    j64 = np.uint64(j)
    lo = (j64 * step) >> np.uint64(32)
    hi = ((j64 + np.uint64(1)) * step) >> np.uint64(32) if j + 1 < s else n64
    h = (a * j64 + b) >> np.uint64(32)
    return lo + ((h * (hi - lo)) >> np.uint64(32))


@njit(parallel=True, cache=True, nogil=True)
def _sample_keys(xu, s, step, a, b):
    """Keys at ``s`` stratified sample positions (one hashed position per stratum, see
    :func:`tfsparse.ops._common.sample_step`)."""
    n64 = np.uint64(xu.size)
    out = np.empty(s, np.int64)
    for j in prange(s):
        out[j] = _key(xu[_sample_at(j, s, step, a, b, n64)])
    return out


@njit(parallel=True, cache=True, nogil=True)
def _sample_positions(n, s, step, a, b):
    """The ``s`` stratified sample positions of :func:`_sample_keys` (where it reads)."""
    n64 = np.uint64(n)
    out = np.empty(s, np.int64)
    for j in prange(s):
        out[j] = np.int64(_sample_at(j, s, step, a, b, n64))
    return out


@njit(parallel=True, cache=True, nogil=True)
def _add_select_ge(g, r, acc, klo, base, st_idx, st_val, addr, stream):
    """``acc = g + r`` (float32) and, in the same pass, the indices (``+ base``, ascending) and
    values of ``acc``'s elements with ``key >= klo`` -- error feedback, the finite check and a
    threshold selection fused.  Per block of ``_BLK`` elements: the sums' keys' maximum (the
    block's ``g`` and ``r`` come into the cache), the hits of a block that has any (staged as
    :func:`_select_ge` stages them, from the block's sums made again in a small buffer), then the
    sums written to ``acc`` -- with ``stream``, by non-temporal stores (:func:`_add_stream16`;
    ``addr``: ``acc``'s address; each chunk's blocks start at its first 64-byte aligned element),
    so that ``acc``'s old lines are never read: three streams over memory, not four (timed by
    tools/bench_choices.py: the ``stream`` rows of docs/engine_choices.json); without, by plain stores, which
    leave ``acc`` in the cache for the next stage (the caller streams from ``STREAM_MIN`` on).
    Returns ``(idx, val, top)``, ``top`` the largest ``bits << 1`` of the sums
    (``>= INF_KEY << 1``: some sum is not finite)."""
    n = g.size
    nch = (n + _CH - 1) // _CH
    counts = np.zeros(nch, np.int64)
    tops = np.zeros(nch, np.uint32)
    t2 = np.uint32(klo << 1)
    for c in prange(nch):
        lo = c * _CH
        hi = min(lo + _CH, n)
        w = 0
        top = np.uint32(0)
        buf = np.empty(_BLK, np.float32)
        bu = buf.view(np.uint32)
        head = min(hi, lo + (-(addr // 4 + lo)) % 16)  # elements before the first aligned one
        b0 = lo
        while b0 < hi:
            b1 = head if b0 < head else min(b0 + _BLK, hi)
            ga = g[b0:b1]
            ra = r[b0:b1]
            m = np.uint32(0)
            for j in range(ga.size):
                m = max(m, np.uint32(_float_bits(ga[j] + ra[j]) << _U1))
            top = max(top, m)
            if m >= t2:
                for j in range(ga.size):
                    buf[j] = ga[j] + ra[j]
                w = _stage_hits(bu, buf, 0, b1 - b0, t2, klo, st_idx, st_val, c * _STG, w, b0)
            i = b0
            if stream and b0 >= head:
                while i + 16 <= b1:
                    _add_stream16(acc, i, g, r)
                    i += 16
            aa = acc[i:b1]
            gi = g[i:b1]
            ri = r[i:b1]
            for j in range(aa.size):
                aa[j] = gi[j] + ri[j]
            b0 = b1
        _store_fence()
        counts[c] = w
        tops[c] = top
    out_idx, out_val = _compact(acc.view(np.uint32), acc, klo, base, counts, st_idx, st_val)
    top = np.uint32(0)
    for c in range(nch):
        top = max(top, tops[c])
    return out_idx, out_val, top


@njit(cache=True, nogil=True)
def _hash_positions(idx, val, tkey, a, b, pos):
    """DRAGONN Alg. 1 over candidates (ascending indices, every element of the vector whose key is
    ``>= tkey`` among them), as positions: ``pos[slot]`` (filled with -1 by the caller) becomes
    the position among the candidates of the entry that keeps the slot -- the largest index hashed
    to it, the later of an ascending walk, as :func:`_hash_select` keeps of the whole vector."""
    m64 = np.uint64(pos.size)
    vu = val.view(np.uint32)
    for j in range(idx.size):
        if _key(vu[j]) >= tkey:
            pos[_slot(idx[j], a, b, m64)] = j


def _positions(idx, m):
    """The slot table :func:`_hash_positions` fills: int32 (half the bytes) where every position
    fits, -1 everywhere."""
    return np.full(m, -1, np.int32 if idx.size < 2**31 else np.int64)


@njit(cache=True, nogil=True)
def _hash_candidates(idx, val, tkey, a, b, pos):
    """:func:`_hash_select`'s table and values from candidates: the slots' positions
    (:func:`_hash_positions`), then each occupied slot's index and value."""
    _hash_positions(idx, val, tkey, a, b, pos)
    table = np.full(pos.size, -1, np.int64)
    out = np.zeros(pos.size, np.float32)
    for s in range(pos.size):
        j = pos[s]
        if j >= 0:
            table[s] = idx[j]
            out[s] = val[j]
    return table, out


@njit(cache=True, nogil=True)
def _hash_survivors(idx, val, tkey, a, b, pos):
    """The entries of :func:`_hash_candidates`' table in index order, without building it: the
    slots' positions (:func:`_hash_positions`), then the candidates walked again (ascending) and
    each one that kept its slot taken."""
    _hash_positions(idx, val, tkey, a, b, pos)
    m64 = np.uint64(pos.size)
    vu = val.view(np.uint32)
    out_idx = np.empty(idx.size, np.int64)
    out_val = np.empty(idx.size, np.float32)
    o = 0
    for j in range(idx.size):
        if _key(vu[j]) >= tkey and pos[_slot(idx[j], a, b, m64)] == j:
            out_idx[o] = idx[j]
            out_val[o] = val[j]
            o += 1
    return out_idx[:o], out_val[:o]


@njit(cache=True, nogil=True)
def _magnitude_keys(x):
    """``|x|``'s keys (int64, ordered as the magnitudes), NaN counted as +-Inf."""
    xu = x.view(np.uint32)
    keys = np.empty(xu.size, np.int64)
    for j in range(xu.size):
        keys[j] = min(np.int64(xu[j]) & _ABS, _INFK)
    return keys


@njit(cache=True, nogil=True)
def _take_keyed(val, keys, k, t, idx, positions):
    """The ``k`` largest ``keys`` given the k-th largest ``t``, in index order: every key above
    ``t``, then the ties at ``t`` with the lowest indices.  Returns their indices -- the positions
    in ``val`` (``positions``) or ``idx`` at those positions (candidates with ascending indices)
    -- and ``val`` there."""
    ties = k
    for j in range(keys.size):
        ties -= np.int64(keys[j] > t)
    out_idx = np.empty(k, np.int64)
    out_val = np.empty(k, np.float32)
    o = 0
    for j in range(keys.size):
        kk = keys[j]
        if kk > t or (kk == t and ties > 0):
            if kk == t:
                ties -= 1
            out_idx[o] = j if positions else idx[j]
            out_val[o] = val[j]
            o += 1
    return out_idx, out_val


_NO_INDEX = np.empty(0, np.int64)


def _top_of_candidates(idx, val, k):
    """:func:`_take_keyed` of candidates: their keys (NaN above Inf) computed once, for the k-th
    key and the take."""
    keys = _keys_of(val)
    return _take_keyed(val, keys, k, _kth_key(keys, k), idx, False)


@njit(cache=True, nogil=True)
def _lower_key(xu, s, step, kp, a, b):
    """A key that is <= the k-th largest key with high probability (rank ``kp`` of ``s`` samples)."""
    return _kth_key(_sample_keys(xu, s, step, a, b), kp)


# ----------------------------------------------------------------------------- hashing

@njit(parallel=True, cache=True, nogil=True)
def _hash_select(xu, x, tkey, a, b, m):
    """DRAGONN Alg. 1 with atomic max per slot (deterministic: the largest index wins)."""
    n = xu.size
    table = np.empty(m, np.int64)
    for j in prange(m):
        table[j] = -1
    m64 = np.uint64(m)
    t2 = np.uint32(tkey << 1)
    nch = (n + _CH - 1) // _CH
    for c in prange(nch):
        lo = c * _CH
        hi = min(lo + _CH, n)
        for b0 in range(lo, hi, _BLK):
            b1 = min(b0 + _BLK, hi)
            if b1 - b0 == _BLK:
                if _block_hit(xu, b0, t2):
                    for s0 in range(b0, b1, _SUB):
                        if _sub_hit(xu, s0, t2):
                            for i in range(s0, s0 + _SUB):
                                if _key(xu[i]) >= tkey:
                                    atomic_max_i64(table, _slot(i, a, b, m64), np.int64(i))
            else:
                for i in range(b0, b1):
                    if _key(xu[i]) >= tkey:
                        atomic_max_i64(table, _slot(i, a, b, m64), np.int64(i))
    val = np.empty(m, np.float32)
    for j in prange(m):
        t = table[j]
        val[j] = x[t] if t >= 0 else np.float32(0.0)
    return table, val
