"""CPU kernels (Numba ``@njit``, parallel over chunks) behind :mod:`tfsparse.ops`.

Inputs are coerced to contiguous 1-D float32 numpy arrays; results are numpy arrays
(indices int64 ascending, values float32).  Semantics (magnitude keys, NaN policy,
tie-breaking, hashing, sampling) are defined in :mod:`tfsparse.ops._common` and
:mod:`tfsparse.ops.reference`, which the tests compare against bit for bit.

Why these algorithms: the seeds agree that once gradients are sparse the compression
kernels, not the network, bound the step time (dragonn-wang2022 §2.4, Fig. 1;
gtopk-ssgd-shi2019 §IV-E, Fig. 11; oktopk-li2022 §3.1.3), and that the lower bound
is one read of the gradient with one comparison per element (dragonn-wang2022 §3.2,
Table 1).  Every kernel here therefore makes one streaming pass in the common case:

* the scan tests blocks of 64 elements with a vectorised max of the keys and only
  looks at elements of blocks that hold a hit (at density 0.001 most blocks have
  none), and writes hits to a small per-chunk staging area, compacted afterwards;
* hit blocks are staged 16 elements at a time by compressing stores (AVX-512), or, on CPUs
  without them, narrowed by a second test on 8-element sub-blocks before the scalar
  per-element work (branchy code only runs where a hit is);
* exact top-k uses a stratified sample to get a key that is very likely below the
  k-th largest, gathers the (1.5-3 k) candidates in that single pass and selects
  exactly among them; if the sample was unlucky (fewer than k candidates), and for
  small inputs or dense k (k > n/64), it finds the exact k-th key by radix select
  (histograms of 11 + 10 + 10 key bits) and writes the top-k in one count + write.

Inputs below :data:`PARALLEL_MIN` elements run on the calling thread only.  Every kernel
releases the GIL (``nogil``), so the exchange's communication thread keeps running Python
(packing, MPI calls) while a bucket is being selected.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.extending import intrinsic

from .. import _checks, traffic
from . import _common as C
from ._atomics import atomic_max_i64

_ABS = C.ABS_MASK
_NANK = C.NAN_KEY
_INFK = C.INF_KEY
_CH = 1 << 16        # elements per parallel chunk
_STG = 4096          # staging slots per chunk (a chunk with more hits is rescanned)
_BLK = 64            # elements per skip test
_SUB = 8             # elements per second-level test inside a hit block
_U1 = np.uint32(1)
_RADIX_PASSES = 3          # the radix select's histogram passes (11 + 10 + 10 key bits)
_PAR_SCATTER = 1 << 14   # payload entries from which scatter_add splits the output over threads

#: Inputs with fewer elements run on the calling thread only ("parallel where it pays"):
#: below this a scan takes well under a millisecond on one core, less than the parallel
#: launch costs -- and far less than waiting for a second core on a busy machine.
PARALLEL_MIN = 1 << 22

#: Error feedback's pass (:func:`add_select`) writes its sums with non-temporal stores from this
#: many elements on (32 MiB of float32), where ``acc`` would not stay in the cache for the stage
#: that reads it next anyway; below, plain stores leave it there (the crossover measured at
#: :func:`add_select`).
STREAM_MIN = 1 << 23


# ----------------------------------------------------------------------------- conversions

@intrinsic
def _to_half(typingctx, x):
    """float32 -> IEEE binary16 bits, round to nearest even: LLVM's ``fptrunc`` to ``half``, one
    instruction where the CPU has it (x86 F16C ``vcvtps2ph``, vectorised)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def _from_half(typingctx, h):
    """IEEE binary16 bits -> float32 (exact): LLVM's ``fpext`` (``vcvtph2ps``)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _add_stream16(typingctx, dst, i, a, b):
    """``dst[i:i + 16] = a[i:i + 16] + b[i:i + 16]`` (float32) with one non-temporal vector store:
    the 64-byte line goes to memory without being read first (a plain store reads every line it
    writes into the cache -- "read for ownership", a fourth stream for ``acc = g + r``).
    ``dst[i]`` must be 64-byte aligned; the stores are ordered only by :func:`_store_fence`."""
    def codegen(context, builder, signature, args):
        darr, di, aarr, barr = args
        vt = ir.VectorType(ir.FloatType(), 16)

        def at(arr, aty):
            data = context.make_array(aty)(context, builder, arr).data
            return builder.bitcast(builder.gep(data, [di]), vt.as_pointer())
        total = builder.fadd(builder.load(at(aarr, signature.args[2]), align=4),
                             builder.load(at(barr, signature.args[3]), align=4))
        store = builder.store(total, at(darr, signature.args[0]), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return types.void(dst, i, a, b), codegen


@intrinsic
def _copy_stream16(typingctx, dst, i, src, j):
    """``dst[i:i + 16] = src[j:j + 16]`` (float32) with one non-temporal vector store, as
    :func:`_add_stream16` stores (``dst[i]`` 64-byte aligned; ordered by :func:`_store_fence`)."""
    def codegen(context, builder, signature, args):
        darr, di, sarr, sj = args
        vt = ir.VectorType(ir.FloatType(), 16)

        def at(arr, aty, k):
            data = context.make_array(aty)(context, builder, arr).data
            return builder.bitcast(builder.gep(data, [k]), vt.as_pointer())
        value = builder.load(at(sarr, signature.args[2], sj), align=4)
        store = builder.store(value, at(darr, signature.args[0], di), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return types.void(dst, i, src, j), codegen


def _compress_store_fast() -> bool:
    """Whether the host CPU compresses a vector into memory in one cheap instruction: AVX-512F's
    ``vpcompressd/q`` on Intel.  Elsewhere LLVM expands :func:`_compress16` into a branch per
    lane (AVX2), or the store form is reported slow (AMD Zen 4; not measured here), so the
    sub-block tests stay."""
    from llvmlite import binding

    avx512 = bool(binding.get_host_cpu_features().get("avx512f"))
    return avx512 and not binding.get_host_cpu_name().startswith("znver")


#: :func:`_stage_hits` stages a hit block 16 elements at a time by :func:`_compress16` (read when
#: a kernel compiles: Numba freezes it into the machine code it caches for this CPU)
_COMPRESS = _compress_store_fast()


@intrinsic
def _compress16(typingctx, xu, x, i, kmin, st_idx, st_val, at, first):
    """Stages the elements of ``x[i:i + 16]`` whose magnitude bits ``xu & 0x7FFFFFFF`` are at
    least ``kmin`` (uint32; ``key >= klo`` for ``kmin = klo <= NAN_KEY``) at
    ``st_idx/st_val[at:]`` -- their indices numbered from ``first`` -- in order, with two
    compressing stores (``llvm.masked.compressstore``: AVX-512's ``vpcompressd/q``, no branch per
    element), and returns how many (the mask's population count).  ``st_idx/st_val[at:at + 16]``
    must exist."""
    def codegen(context, builder, signature, args):
        from numba.core import cgutils

        axu, ax, ai, akmin, aidx, aval, aat, afirst = args
        i1, i16, i32, i64 = (ir.IntType(b) for b in (1, 16, 32, 64))
        v32, v64, vf, vm = (ir.VectorType(t, 16) for t in (i32, i64, ir.FloatType(), i1))

        def at(arr, aty, k, vt=None):
            p = builder.gep(context.make_array(aty)(context, builder, arr).data, [k])
            return p if vt is None else builder.bitcast(p, vt.as_pointer())

        def splat(value, vt):
            v = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(i32, 0))
            return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(v32, [0] * 16))
        bits = builder.and_(builder.load(at(axu, signature.args[0], ai, v32), align=4),
                            ir.Constant(v32, [0x7FFFFFFF] * 16))
        mask = builder.icmp_unsigned(">=", bits, splat(builder.trunc(akmin, i32), v32))
        module = builder.module
        values = builder.load(at(ax, signature.args[1], ai, vf), align=4)
        indices = builder.add(splat(afirst, v64), ir.Constant(v64, list(range(16))))
        for value, arr, aty, vt, name in ((values, aval, signature.args[5], vf, "v16f32"),
                                          (indices, aidx, signature.args[4], v64, "v16i64")):
            fnty = ir.FunctionType(ir.VoidType(), [vt, vt.element.as_pointer(), vm])
            store = cgutils.get_or_insert_function(module, fnty, "llvm.masked.compressstore." + name)
            builder.call(store, [value, at(arr, aty, aat), mask])
        ctpop = cgutils.get_or_insert_function(module, ir.FunctionType(i16, [i16]), "llvm.ctpop.i16")
        return builder.zext(builder.call(ctpop, [builder.bitcast(mask, i16)]), i64)
    return types.int64(xu, x, i, kmin, st_idx, st_val, at, first), codegen


@intrinsic
def _store_fence(typingctx):
    """A fence after :func:`_add_stream16`'s stores (``mfence`` on x86), before others read them."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _float_bits(typingctx, x):
    """float32 -> its uint32 bits (a bit cast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _as_float(typingctx, u):
    """uint32 bits -> the float32 they encode (a bit cast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


# ----------------------------------------------------------------------------- helpers

@njit(cache=True, inline="always")
def _key(u):
    """Magnitude key of float32 bits ``u`` (see :mod:`._common`), as int64."""
    return min(np.int64(u) & _ABS, _NANK)


@njit(cache=True, inline="always")
def _shifted_max(xu, b0, b1):
    """max of ``bits << 1`` (uint32: the sign bit falls off) over ``xu[b0:b1]``; vectorises
    to 8 lanes, and is ``>= key << 1`` iff some key in the range is ``>= key`` (any NaN
    shifts above every ``key << 1``, ``key <= NAN_KEY``)."""
    y = xu[b0:b1]  # a slice from 0: LLVM vectorises it (``range(b0, b1)`` stays scalar)
    m = np.uint32(0)
    for i in range(y.size):
        m = max(m, np.uint32(y[i] << _U1))
    return m


@njit(cache=True, inline="always")
def _block_hit(xu, b0, t2):
    """Whether the full block ``xu[b0:b0+_BLK]`` holds a key ``>= t2 >> 1`` (fixed trip count,
    over a slice from 0: LLVM vectorises that, not ``xu[b0 + j]`` -- measured 5x faster)."""
    y = xu[b0:b0 + _BLK]
    m = np.uint32(0)
    for j in range(_BLK):
        m = max(m, np.uint32(y[j] << _U1))
    return m >= t2


@njit(cache=True, inline="always")
def _sub_hit(xu, b0, t2):
    """The same test for the ``_SUB`` elements from ``b0`` (second level, inside a hit block)."""
    y = xu[b0:b0 + _SUB]
    m = np.uint32(0)
    for j in range(_SUB):
        m = max(m, np.uint32(y[j] << _U1))
    return m >= t2


@njit(cache=True, inline="always")
def _slot(i, a, b, m64):
    h = (a * np.uint64(i) + b) >> np.uint64(32)
    return np.int64((h * m64) >> np.uint64(32))


# ----------------------------------------------------------------------------- selection

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
    (:data:`_COMPRESS`; error feedback's pass over 17.1M elements on one core, 196K hits:
    19.2 -> 15.3 ms, 513K hits: 27.0 -> 15.4 ms), else narrowed by its ``_SUB``-element
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
    so that ``acc``'s old lines are never read: three streams over memory, not four (17.1M
    elements on one core, 12.8 -> 9.3 ms collecting nothing); without, by plain stores, which
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


# ----------------------------------------------------------------------------- quantization

@njit(parallel=True, cache=True, nogil=True)
def _max_key(xu):
    n = xu.size
    nch = (n + _CH - 1) // _CH
    part = np.zeros(max(nch, 1), np.int64)
    for c in prange(nch):
        lo = c * _CH
        hi = min(lo + _CH, n)
        part[c] = _shifted_max(xu, lo, hi) >> 1
    return min(part.max(), _NANK)


@njit(parallel=True, cache=True, nogil=True)
def _quantize(x, inv, q):
    for i in prange(x.size):
        q[i] = np.int8(min(max(np.rint(x[i] * inv), np.float32(-127.0)), np.float32(127.0)))
    return q


@njit(parallel=True, cache=True, nogil=True)
def _dequantize(q, scale, out):
    for i in prange(q.size):
        out[i] = np.float32(q[i]) * scale
    return out


@njit(parallel=True, cache=True, nogil=True)
def _half_rne(xu, x, table, out, loss):
    """float32 bits -> IEEE binary16 bits, round to nearest even (numpy's ``astype(float16)``),
    and ``loss = x - decoded`` (0 for NaN/Inf, which travel as they are; ``x`` itself where a
    finite value overflowed to Inf, so that a caller writing the loss over ``x`` keeps it);
    returns how many finite values overflowed to Inf.  ``loss`` may be ``x`` itself.

    The conversion is the CPU's (:func:`_to_half`, branch-free and vectorised: measured 3.0 vs
    8.5 ms for 4.3M elements on one core); NaN keeps the top payload bits and is made quiet
    explicitly, so the codes do not depend on how a CPU converts NaN.  ``table`` is unused (the
    decoding table's place in the signature)."""
    over = 0
    for i in prange(xu.size):
        u = xu[i]
        a = u & np.uint32(_ABS)
        v = x[i]
        code = _to_half(v)
        if a > np.uint32(_INFK):             # NaN: quiet, keep the top payload bits
            code = np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7E00)
                             | ((a >> np.uint32(13)) & np.uint32(0x3FF)))
        big = a >= np.uint32(0x477FF000)     # >= 65520 rounds to Inf
        finite = a < np.uint32(_INFK)
        over += np.int64(big and finite)
        lost = v - _from_half(code)
        lost = v if big else lost
        out[i] = code
        loss[i] = lost if finite else np.float32(0.0)
    return over


@njit(parallel=True, cache=True, nogil=True)
def _bf16_truncate(xu, x, table, out, loss):
    """float32 bits -> their high 16 bits (bfloat16 by truncation; a NaN stays a NaN), and
    ``loss = x - decoded`` (the dropped low bits; 0 for NaN/Inf).  ``table`` is unused."""
    for i in prange(xu.size):
        u = xu[i]
        a = u & np.uint32(_ABS)
        h = u >> np.uint32(16)
        if a > np.uint32(_INFK):
            h |= np.uint32(0x40)
        out[i] = np.uint16(h)
        lost = x[i] - _as_float(u & np.uint32(0xFFFF0000))
        loss[i] = lost if a < np.uint32(_INFK) else np.float32(0.0)
    return out


@njit(parallel=True, cache=True, nogil=True)
def _half_into(codes, table, out, accumulate):
    """``out[i] (+)= decode(codes[i])`` for binary16 codes: the CPU's conversion (:func:`_from_half`),
    the 65536-entry table only for NaN (numpy's NaN bits, whatever the CPU does).  Codes without a
    NaN (a vectorised test first) take a loop without the table, which vectorises (one core, 17.1M
    codes: 5.0 against 8.0 ms, the test 0.7 ms of it)."""
    if not _has_half_nan(codes):
        if accumulate:
            for i in prange(codes.size):
                out[i] += _from_half(codes[i])
        else:
            for i in prange(codes.size):
                out[i] = _from_half(codes[i])
    elif accumulate:
        for i in prange(codes.size):
            c = codes[i]
            out[i] += table[c] if (c & np.uint16(0x7C00)) == np.uint16(0x7C00) else _from_half(c)
    else:
        for i in prange(codes.size):
            c = codes[i]
            out[i] = table[c] if (c & np.uint16(0x7C00)) == np.uint16(0x7C00) else _from_half(c)
    return out


@njit(cache=True, nogil=True)
def _has_half_nan(codes):
    """Whether some binary16 code is a NaN (``|code| > 0x7C00``)."""
    m = np.uint16(0)
    for i in range(codes.size):
        m = max(m, np.uint16(codes[i] & np.uint16(0x7FFF)))
    return m > np.uint16(0x7C00)


@njit(parallel=True, cache=True, nogil=True)
def _bf16_into(codes, out, accumulate):
    """``out[i] (+)= decode(codes[i])`` for bfloat16 codes: the bits shifted into a float32."""
    if accumulate:
        for i in prange(codes.size):
            out[i] += _as_float(np.uint32(codes[i]) << np.uint32(16))
    else:
        for i in prange(codes.size):
            out[i] = _as_float(np.uint32(codes[i]) << np.uint32(16))
    return out


@njit(parallel=True, cache=True, nogil=True)
def _lookup_into(codes, table, out, accumulate):
    """``out[i] (+)= table[codes[i]]``: 16-bit decoding through a 65536-entry table."""
    if accumulate:
        for i in prange(codes.size):
            out[i] += table[codes[i]]
    else:
        for i in prange(codes.size):
            out[i] = table[codes[i]]
    return out


@njit(cache=True, inline="always")
def _quantize_chunk(y, xs, qs, ls, in_place):
    """One chunk of :func:`_quantize_chunks`: ``xs`` (``y``: its bits) into the codes ``qs`` and
    the loss ``ls`` (``xs`` itself with ``in_place``); returns the chunk's scale."""
    top = np.uint32(0)  # the largest magnitude's bits (vectorised; NaN's are above Inf's)
    for i in range(y.size):
        top = max(top, y[i] & np.uint32(_ABS))
    nan = top > np.uint32(_INFK)
    amax = _as_float(top)
    scale = np.float32(np.nan) if nan else np.float32(amax / np.float32(127.0))
    if nan or amax == np.inf or amax == 0:
        for i in range(qs.size):
            qs[i] = 0
            ls[i] = np.float32(0.0)
    else:
        inv = np.float32(np.float32(127.0) / amax)
        if inv == np.inf:  # max|x| below 127 / FLT_MAX: the ratio in float64
            for i in range(xs.size):
                v = xs[i]
                code = np.int8(min(max(np.rint(np.float64(v) * 127.0 / np.float64(amax)), -127.0), 127.0))
                qs[i] = code
                ls[i] = v - np.float32(code) * scale
        elif in_place:
            for i in range(xs.size):
                v = xs[i]
                code = np.int8(min(max(np.rint(v * inv), np.float32(-127.0)), np.float32(127.0)))
                qs[i] = code
                xs[i] = v - np.float32(code) * scale
        else:
            for i in range(xs.size):
                v = xs[i]
                code = np.int8(min(max(np.rint(v * inv), np.float32(-127.0)), np.float32(127.0)))
                qs[i] = code
                ls[i] = v - np.float32(code) * scale
    return scale


@njit(parallel=True, cache=True, nogil=True)
def _quantize_chunks(x, chunk, q, scales, loss, in_place):
    """Per chunk: ``scale = max|x| / 127``, ``q = clip(rint(x * (127 / max|x|)), -127, 127)``;
    a chunk holding NaN/Inf (or only zeros) gets ``q = 0`` and a NaN/Inf (or zero) scale.
    ``loss = x - q * scale`` (0 in a non-finite chunk: it decodes to NaN everywhere);
    ``in_place``: ``loss`` is ``x``.

    Every loop runs over a chunk's slices from 0 (``range(lo, hi)`` over the whole arrays
    defeats LLVM's vectoriser: 33 against 5.3 ms for 17.1M values on one core here), and the
    in-place loop reads and writes one array, which the vectoriser's overlap check passes."""
    n = x.size
    xu = x.view(np.uint32)
    for c in prange(scales.size):
        lo = c * chunk
        hi = min(lo + chunk, n)
        scales[c] = _quantize_chunk(xu[lo:hi], x[lo:hi], q[lo:hi], loss[lo:hi], in_place)
    return q


@njit(cache=True, inline="always")
def _store_block(acc, lo, hi, buf, addr, stream):
    """``acc[lo:hi] = buf[:hi - lo]`` -- with ``stream``, by non-temporal stores from ``acc``'s
    first 64-byte aligned element on (``addr``: ``acc``'s address), so that its old lines are
    never read; ordered by the caller's :func:`_store_fence`."""
    m = hi - lo
    i = 0
    if stream:
        head = min(m, (-(addr // 4 + lo)) % 16)  # elements before the first aligned one
        a = acc[lo:lo + head]
        for j in range(head):
            a[j] = buf[j]
        i = head
        while i + 16 <= m:
            _copy_stream16(acc, lo + i, buf, i)
            i += 16
    a, b = acc[lo + i:hi], buf[i:m]
    for j in range(a.size):
        a[j] = b[j]


@njit(parallel=True, cache=True, nogil=True)
def _add_quantize_chunks(g, r, acc, chunk, q, scales, addr, stream):
    """``acc = g + r`` quantized as :func:`_quantize_chunks` does in place -- error feedback and
    the int8 encoding in one pass: per chunk the sums are made in a chunk-sized buffer (in the
    cache), quantized there into ``q`` and ``scales``, and what that lost is written to ``acc``
    -- with ``stream``, by non-temporal stores from its first 64-byte aligned element on
    (``addr``: ``acc``'s address), so that ``acc``'s old lines are never read.  Memory traffic:
    ``g`` and ``r`` read, ``acc`` and the codes written, against the separate passes' ``g``,
    ``r`` read, ``acc`` written, read again and written again."""
    n = g.size
    nch = scales.size
    per = max(1, _CH // chunk)  # chunks per parallel task: one buffer each
    for t in prange((nch + per - 1) // per):
        buf = np.empty(chunk, np.float32)
        bu = buf.view(np.uint32)
        for c in range(t * per, min((t + 1) * per, nch)):
            lo = c * chunk
            hi = min(lo + chunk, n)
            m = hi - lo
            bs, gs, rs = buf[:m], g[lo:hi], r[lo:hi]
            for i in range(m):
                bs[i] = gs[i] + rs[i]
            scales[c] = _quantize_chunk(bu[:m], bs, q[lo:hi], bs, True)
            _store_block(acc, lo, hi, buf, addr, stream)
        _store_fence()
    return scales


_SUM16 = 2048  # elements summed and encoded per step of _add_encode16 (8 KiB: stays in L1)


@njit(parallel=True, cache=True, nogil=True)
def _add_encode16(g, r, acc, codes, addr, stream, half):
    """``acc = g + r`` encoded to 16 bits -- error feedback and the float16 (``half``: as
    :func:`_half_rne`) or bfloat16 (as :func:`_bf16_truncate`) encoding in one pass: per
    :data:`_SUM16` elements the sums are made in a buffer (in the cache), encoded there into
    ``codes``, and what that lost is written to ``acc`` -- with ``stream``, by non-temporal stores
    from its first 64-byte aligned element on (``addr``: ``acc``'s address).  Returns
    ``(overflowed, nonfinite)``: how many finite sums float16 turned into Inf (their loss is not
    kept: the caller encodes again, scaled) and how many sums are NaN/Inf (their codes and loss
    are undefined: the caller drops the round)."""
    n = g.size
    over = 0
    bad = 0
    for t in prange((n + _CH - 1) // _CH):
        buf = np.empty(_SUM16, np.float32)
        bu = buf.view(np.uint32)
        for lo in range(t * _CH, min((t + 1) * _CH, n), _SUM16):
            hi = min(lo + _SUM16, n, (t + 1) * _CH)
            m = hi - lo
            bs, ys, gs, rs, cs = buf[:m], bu[:m], g[lo:hi], r[lo:hi], codes[lo:hi]
            for i in range(m):
                bs[i] = gs[i] + rs[i]
            if half:
                for i in range(m):
                    a = ys[i] & np.uint32(_ABS)
                    v = bs[i]
                    code = _to_half(v)
                    big = a >= np.uint32(0x477FF000)  # >= 65520 rounds to Inf
                    finite = a < np.uint32(_INFK)
                    over += np.int64(big and finite)
                    bad += np.int64(not finite)
                    cs[i] = code
                    bs[i] = v - _from_half(code)
            else:
                for i in range(m):
                    u = ys[i]
                    bad += np.int64((u & np.uint32(_ABS)) >= np.uint32(_INFK))
                    cs[i] = np.uint16(u >> np.uint32(16))
                    bs[i] = bs[i] - _as_float(u & np.uint32(0xFFFF0000))
            _store_block(acc, lo, hi, buf, addr, stream)
        _store_fence()
    return over, bad


@njit(parallel=True, cache=True, nogil=True)
def _dequantize_chunks_into(q, scales, chunk, out, accumulate):
    n = q.size
    for c in prange(scales.size):
        lo = c * chunk
        hi = min(lo + chunk, n)
        s = scales[c]
        qs, os = q[lo:hi], out[lo:hi]  # slices from 0: vectorised (see _quantize_chunks)
        if accumulate:
            for i in range(qs.size):
                os[i] = os[i] + np.float32(qs[i]) * s
        else:
            for i in range(qs.size):
                os[i] = np.float32(qs[i]) * s
    return out


@njit(parallel=True, cache=True, nogil=True)
def _truncate_fp16(xu, out):
    """float32 bits -> IEEE binary16 bits, rounding toward zero (drops mantissa bits)."""
    for i in prange(xu.size):
        u = np.int64(xu[i])
        sign = (u >> 16) & 0x8000
        a = u & _ABS
        e = a >> 23
        if a > _INFK:                        # NaN: quiet, keep the top payload bits
            h = 0x7E00 | ((a >> 13) & 0x3FF)
        elif a == _INFK:
            h = 0x7C00
        elif e >= 143:                       # beyond 65504: saturate (round toward zero)
            h = 0x7BFF
        elif e >= 113:                       # normal half
            h = (a >> 13) - (112 << 10)
        elif e >= 102:                       # subnormal half
            h = ((a & 0x7FFFFF) | 0x800000) >> (126 - e)
        else:                                # below the smallest subnormal
            h = 0
        out[i] = np.uint16(sign | h)
    return out


@njit(cache=True, fastmath={"reassoc"}, inline="always")
def _abs_sum32(x, b0, b1):
    y = x[b0:b1]
    s = np.float32(0.0)
    for i in range(y.size):
        s += abs(y[i])
    return s


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc"})
def _chunk_l1(x, chunk, out):
    """float32 sums of 256-element blocks (vectorised: 8 elements per lane) added in float64."""
    n = x.size
    for c in prange(out.size):
        lo = c * chunk
        hi = min(lo + chunk, n)
        s = 0.0
        for b0 in range(lo, hi, 4 * _BLK):
            s += np.float64(_abs_sum32(x, b0, min(b0 + 4 * _BLK, hi)))
        out[c] = np.float32(s)
    return out


# ============================================================================= public API

_LAUNCH = threading.Lock()
_THREAD_LIMIT = [0]  # 0: Numba's NUMBA_NUM_THREADS


def set_thread_limit(threads: int) -> None:
    """At most ``threads`` Numba threads per kernel launch, in every thread of this process (the
    communication thread's included); 0 restores Numba's default.  ``tfsparse.init()`` sets it
    to this rank's share of the node's cores."""
    threads = _checks.integer("threads", threads, 0, hint=" (0: Numba's default)")
    _THREAD_LIMIT[0] = min(threads, numba.config.NUMBA_NUM_THREADS)


def _serialized() -> bool:
    """Numba's ``workqueue`` threading layer aborts when two threads launch parallel kernels at
    once (the exchange encodes on the training thread while its communication thread decodes);
    with it, kernel launches are serialized.  ``omp`` and ``tbb`` need nothing."""
    try:
        return numba.threading_layer() == "workqueue"
    except ValueError:  # no parallel kernel has run yet: the layer is chosen by the first one
        return True


@contextmanager
def _threads_for(n: int):
    """Runs the enclosed kernels single-threaded when ``n < PARALLEL_MIN``, else on at most
    :func:`set_thread_limit` threads (a thread-local setting), one launch at a time under the
    ``workqueue`` threading layer."""
    old = numba.get_num_threads()
    want = 1 if n < PARALLEL_MIN else (_THREAD_LIMIT[0] or old)
    lock = _LAUNCH if _serialized() else None
    if lock is not None:
        lock.acquire()
    try:
        if want == old:
            yield
        else:
            numba.set_num_threads(want)
            try:
                yield
            finally:
                numba.set_num_threads(old)
    finally:
        if lock is not None:
            lock.release()


_TLS = threading.local()


def _staging(n: int):
    """Per-thread staging buffers of :func:`_select_ge`, kept between calls: a fresh buffer
    would page-fault once per chunk on every call (about 20% of a 512 MB scan).  Only the
    pages the sparse hits touch become resident (two per 64K-element chunk)."""
    need = max(1, -(-n // _CH)) * _STG
    buf = getattr(_TLS, "staging", None)
    if buf is None or buf[0].size < need:
        buf = _TLS.staging = (np.empty(need, np.int64), np.empty(need, np.float32))
    return buf


def as_f32(x) -> np.ndarray:
    """Contiguous 1-D float32 view (or copy, if ``x`` is not already one)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    C.check_n(x.size)
    return x


def _empty_payload():
    return np.empty(0, np.int64), np.empty(0, np.float32)


def _prefilter_samples(n: int) -> int:
    # the samples only set a lower bound: fewer samples give a lower bound and more candidates
    # (about k + 12 n / sqrt(s) ... at k/n = 0.001: 1.6 k for n = 128M), more samples cost
    # random cache misses; n / 512 clamped to [8192, 65536] balances the two
    return int(min(n, max(8192, min(n >> 9, 1 << 16))))


def _sampled_lower_key(xu, k: int):
    """A key at most the k-th largest with high probability, from a stratified sample;
    None where sampling does not pay (small inputs, k above n / 64: the radix path is as fast)."""
    n = xu.size
    s = _prefilter_samples(n)
    kp = C.prefilter_rank(k, n, s)
    if n <= _CH or 64 * k > n or 4 * kp > s:
        return None
    a, b = C.hash_params(0, C.SALT_SAMPLE)
    return int(_lower_key(xu, s, C.sample_step(n, s), kp, a, b))


def _sampled_candidates(xu, x, k: int):
    """``(idx, val)`` of every element at or above the sampled lower key, which then holds the
    top-k; None when there is no sample or it was unlucky (fewer than k candidates)."""
    lower = _sampled_lower_key(xu, k)
    if lower is None:
        return None
    idx, val = _select_ge(xu, x, lower, *_staging(xu.size))
    return (idx, val) if idx.size >= k else None


def _radix(xu, k: int):
    t, r = _radix_select(xu, k, numba.get_num_threads())
    return int(t), int(r)


def topk_abs(x, k):
    x = as_f32(x)
    n = x.size
    k = C.check_k(k, n)
    if k == 0:
        return _empty_payload()
    if k == n:
        return np.arange(n, dtype=np.int64), x.copy()
    xu = x.view(np.uint32)
    with _threads_for(n):
        cand = _sampled_candidates(xu, x, k)
        if cand is None:  # exact k-th key by radix select, then one count + write
            traffic.count("select", read=(_RADIX_PASSES + 2) * x.nbytes)  # 3 histograms, count, write
            t, r = _radix(xu, k)
            return _select_top(xu, x, t, r, k)
        traffic.count("select", read=x.nbytes)  # the candidates' streaming pass
        idx, val = cand
        return _top_of_candidates(idx, val, k)


def kth_largest_abs(x, k):
    x = as_f32(x)
    k = C.check_k(k, x.size)
    if k == 0:
        return np.float32(np.nan)
    xu = x.view(np.uint32)
    with _threads_for(x.size):
        cand = _sampled_candidates(xu, x, k)
        traffic.count("select", read=x.nbytes * (1 if cand is not None else _RADIX_PASSES))
        key = _radix(xu, k)[0] if cand is None else _kth_key(_keys_of(cand[1]), k)
    return C.key_to_float(key)


def sample_threshold(x, k, ratio=0.01, seed=0):
    x = as_f32(x)
    n = x.size
    k = C.check_k(k, n)
    s = C.sample_count(n, ratio)
    if k == 0:
        return np.float32(np.nan)
    a, b = C.hash_params(seed, C.SALT_SAMPLE)
    with _threads_for(s):
        keys = _sample_keys(x.view(np.uint32), s, C.sample_step(n, s), a, b)
        return C.key_to_float(_kth_key(keys, C.sample_rank(k, n, s)))


def select_threshold(x, t):
    x = as_f32(x)
    traffic.count("select", read=x.nbytes)
    with _threads_for(x.size):
        return _select_ge(x.view(np.uint32), x, C.threshold_key(t), *_staging(x.size))


def hash_select(x, t, capacity, seed=0):
    x = as_f32(x)
    capacity = C.check_capacity(capacity)
    a, b = C.hash_params(seed, C.SALT_HASH)
    traffic.count("select", read=x.nbytes)
    with _threads_for(x.size):
        return _hash_select(x.view(np.uint32), x, C.threshold_key(t), a, b, capacity)


def _as_index(idx) -> np.ndarray:
    idx = np.asarray(idx).reshape(-1)
    if idx.dtype not in (np.int32, np.int64):
        idx = idx.astype(np.int64)
    return np.ascontiguousarray(idx)


def scatter_add(n, idx, val, out=None):
    n = int(n)
    idx = _as_index(idx)
    val = as_f32(val)
    if idx.size != val.size:
        raise ValueError(f"idx ({idx.size}) and val ({val.size}) differ in length")
    if idx.size and _index_range(idx) >= n:
        raise IndexError(f"scatter_add: an index is >= n={n}")
    if out is None:
        # calloc'd zeros: pages no payload entry touches are never written (nor faulted in here)
        traffic.count("decode", written=4 * n)
        out = np.zeros(n, np.float32)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (n,)
              and out.flags.c_contiguous):
        raise TypeError(f"out must be a contiguous float32 numpy array of shape ({n},)")
    nblocks = max(1, min(numba.get_num_threads(), n // _CH)) if idx.size >= _PAR_SCATTER else 1
    with _threads_for(idx.size * 16):
        return _scatter_add(out, idx, val, nblocks)


def sample_positions(n: int, s: int, seed: int = 0) -> np.ndarray:
    """The ``s`` stratified positions (int64) the samples of an ``n``-element vector are read at:
    :func:`topk_abs`'s prefilter (``seed`` 0) and :func:`sample_threshold` (its ``seed``) read
    exactly these."""
    a, b = C.hash_params(seed, C.SALT_SAMPLE)
    with _threads_for(s):
        return _sample_positions(int(n), int(s), C.sample_step(n, s), a, b)


def keys_of(values) -> np.ndarray:
    """The magnitude keys (int64) of float32 ``values`` (:mod:`._common`)."""
    return _keys_of(as_f32(values))


def kth_key(keys, k: int) -> int:
    """The k-th largest (1-based) of int64 ``keys``."""
    return int(_kth_key(np.ascontiguousarray(keys, np.int64), int(k)))


def prefilter_plan(n: int, k: int):
    """Where :func:`topk_abs` samples an ``n``-element vector for its prefilter and which rank of
    the samples' keys bounds the k-th largest from below: ``(positions, rank)``, or None where
    it takes the radix path instead (small inputs, ``k`` above ``n / 64``)."""
    s = _prefilter_samples(n)
    kp = C.prefilter_rank(k, n, s) if n else 0
    if k <= 0 or n <= _CH or 64 * k > n or 4 * kp > s:
        return None
    return sample_positions(n, s), kp


def add_select(g, r, acc, klo: int, base: int = 0, stream: bool | None = None):
    """``acc[:] = g + r`` (float32, the error feedback) and, in the same pass, ``(idx, val, finite)``:
    the indices (``+ base``) and values of ``acc``'s elements with ``key >= klo`` (``|acc| >= t``
    for ``klo = threshold_key(t)``; NaN always) and whether every sum is finite.  ``g``, ``r``,
    ``acc``: contiguous float32 vectors of one size.

    ``stream``: write the sums with non-temporal stores (default: from :data:`STREAM_MIN`
    elements on; the memory decides by its whole vector, of which ``acc`` may be one tensor's
    slice).  Measured on one core of the development VM (Intel Xeon), the pass alone and the pass
    followed by a read of ``acc``: 4.2M elements 1.81 / 2.85 ms streamed against 1.79 / 2.41 ms
    with plain stores; 8.4M 3.96 / 6.86 against 5.26 / 6.87; 17.1M 9.05 / 13.31 against
    11.86 / 15.40; 25.2M 13.28 / 19.53 against 18.29 / 23.77."""
    traffic.count("compensate", read=g.nbytes + r.nbytes, written=acc.nbytes)
    stream = g.size >= STREAM_MIN if stream is None else bool(stream)
    with _threads_for(g.size):
        idx, val, top = _add_select_ge(g, r, acc, np.int64(klo), np.int64(base), *_staging(g.size),
                                       np.int64(acc.ctypes.data), stream)
    return idx, val, int(top) < (_INFK << 1)


def topk_ties_low(x, k: int):
    """``(indices, values)`` of the ``k`` (``0 < k < n``) entries of largest magnitude of the
    float32 vector ``x``, indices ascending; NaN counts as +-Inf and ties at the k-th magnitude
    go to the lowest indices -- the selection of :func:`tfsparse.compressors.topk_with_values` for
    dense ``k`` (above ``n / 16``), without a sort."""
    x = as_f32(x)
    keys = _magnitude_keys(x)
    k = int(k)
    return _take_keyed(x, keys, k, _kth_key(keys, k), _NO_INDEX, True)


def topk_of_candidates(idx, val, k: int):
    """The exact top-k ``(idx, val)`` of a vector given candidates holding every element whose key
    is at least the candidates' own k-th largest -- all elements at or above some key, when there
    are at least ``k`` of them; the ties at the k-th key go to the lowest indices (as
    :func:`topk_abs`).  None when there are fewer than ``k`` candidates."""
    if idx.size < k or k <= 0:
        return None
    return _top_of_candidates(idx, val, k)


def _hash_args(idx, val, t, capacity, seed) -> tuple:
    """The hashing kernels' arguments for a table of ``capacity`` slots over candidates."""
    capacity = C.check_capacity(capacity)
    a, b = C.hash_params(seed, C.SALT_HASH)
    idx = _as_index(idx)
    return idx, as_f32(val), C.threshold_key(t), a, b, _positions(idx, capacity)


def hash_candidates(idx, val, t, capacity, seed=0):
    """:func:`hash_select` of a vector from candidates (ascending indices) that hold every
    element with ``|x| >= t``: the same table, without reading the vector."""
    return _hash_candidates(*_hash_args(idx, val, t, capacity, seed))


def hash_survivors(idx, val, t, capacity, seed=0):
    """The occupied slots of :func:`hash_candidates`' table as ``(indices, values)`` in **index
    order** (ascending), without a sort: the candidates are walked once more and each that kept
    its slot is taken -- the same entries as the table's, ordered by index."""
    return _hash_survivors(*_hash_args(idx, val, t, capacity, seed))


def densify_into(out, idx, val, starts, add=True) -> bool:
    """``out[:]`` = the dense float32 vector of sparse pieces in one sequential pass (no zero fill
    before, no scattered writes): piece ``p`` is ``idx[starts[p]:starts[p + 1]]`` (strictly
    ascending) with its values; an index in several pieces gets their values summed in piece
    order from +0.0 (``add=True``: bit-identical to ``scatter_add`` into zeros) -- or, ``add=False``
    with one piece, the value itself (``out[idx] = val`` over zeros).  Returns False, with ``out``
    untouched, when some piece is not strictly ascending in ``[0, out.size)`` (the caller then
    scatters)."""
    idx = _as_index(idx)
    val = as_f32(val)
    starts = np.ascontiguousarray(starts, np.int64)
    n = out.size
    if idx.size != val.size or starts[-1] != idx.size:
        raise ValueError(f"densify_into: {idx.size} indices, {val.size} values, pieces ending at {starts[-1]}")
    if not _ascending_pieces(idx, starts, n):
        return False
    traffic.count("decode", written=out.nbytes)
    with _threads_for(n):
        nblocks = max(1, min(numba.get_num_threads(), n // _CH))
        _densify(out, idx, val, starts, bool(add), nblocks)
    return True


def quantize_int8(x):
    x = as_f32(x)
    with _threads_for(x.size):
        amax = C.key_to_float(_max_key(x.view(np.uint32))) if x.size else np.float32(0.0)
        scale = np.float32(amax / np.float32(127.0))
        q = np.zeros(x.size, np.int8)
        if np.isfinite(amax) and amax > 0:
            _quantize(x, np.float32(np.float32(127.0) / amax), q)
    return q, scale


def dequantize_int8(q, scale):
    q = np.ascontiguousarray(q, dtype=np.int8).reshape(-1)
    with _threads_for(q.size):
        return _dequantize(q, np.float32(scale), np.empty(q.size, np.float32))


def truncate_fp16(x):
    x = as_f32(x)
    with _threads_for(x.size):
        return _truncate_fp16(x.view(np.uint32), np.empty(x.size, np.uint16)).view(np.float16)


# -- wire codecs (host side: the payload is on the host when it goes to MPI) ---------------

HALF_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
BF16_TABLE = (np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)).view(np.float32)


def _loss_buffer(x, loss):
    """Where an encoder writes ``x - decoded``: ``loss`` (contiguous float32 of ``x``'s size, ``x``
    itself allowed: each element is read before its loss is written), or a new vector."""
    if loss is None:
        return np.empty(x.size, np.float32)
    if not (isinstance(loss, np.ndarray) and loss.dtype == np.float32 and loss.size == x.size
            and loss.flags.c_contiguous):
        raise TypeError(f"loss must be a contiguous float32 numpy array of {x.size} elements")
    return loss.reshape(-1)


def _codes_buffer(x, out, dtype):
    """Where an encoder writes its codes: ``out`` (contiguous, ``x``'s size, viewed as ``dtype``),
    or a new vector."""
    if out is None:
        return np.empty(x.size, dtype)
    if not (isinstance(out, np.ndarray) and out.nbytes == x.size * np.dtype(dtype).itemsize
            and out.flags.c_contiguous):
        raise TypeError(f"out must be a contiguous numpy array of {x.size} {np.dtype(dtype).name} codes")
    return out.reshape(-1).view(dtype)


def half_encode(x, loss=None, out=None):
    """float32 -> IEEE binary16 codes (uint16), round to nearest even; ``(codes, loss,
    overflowed)``: ``loss = x - decoded`` (0 where x is NaN/Inf; ``x`` where it overflowed) and how
    many finite values became Inf.  ``loss``: where to write it (``x`` itself allowed); ``out``:
    where to write the codes."""
    x = as_f32(x)
    out, loss = _codes_buffer(x, out, np.uint16), _loss_buffer(x, loss)
    traffic.count("encode", read=x.nbytes, written=out.nbytes + loss.nbytes)
    with _threads_for(x.size):
        over = _half_rne(x.view(np.uint32), x, HALF_TABLE, out, loss)
    return out, loss, int(over)


def bfloat16_encode(x, loss=None, out=None):
    """float32 -> bfloat16 codes (uint16) by truncation (the high 16 bits; NaN stays NaN);
    ``(codes, loss)`` with ``loss = x - decoded`` (0 where x is NaN/Inf), written into ``loss``
    when given (``x`` itself allowed); the codes into ``out`` when given."""
    x = as_f32(x)
    out, loss = _codes_buffer(x, out, np.uint16), _loss_buffer(x, loss)
    traffic.count("encode", read=x.nbytes, written=out.nbytes + loss.nbytes)
    with _threads_for(x.size):
        _bf16_truncate(x.view(np.uint32), x, BF16_TABLE, out, loss)
    return out, loss


def decode16_into(codes, table, out, accumulate=False):
    """``out (+)= table[codes]`` for uint16 ``codes`` (``HALF_TABLE`` or ``BF16_TABLE``)."""
    traffic.count("decode", read=codes.nbytes + (4 * codes.size if accumulate else 0), written=4 * codes.size)
    with _threads_for(codes.size):
        if table is HALF_TABLE:
            return _half_into(codes, table, out, bool(accumulate))
        if table is BF16_TABLE:
            return _bf16_into(codes, out, bool(accumulate))
        return _lookup_into(codes, table, out, bool(accumulate))


def quantize_int8_chunks(x, chunk, loss=None, out=None):
    """Per-chunk :func:`quantize_int8`: ``(q int8[n], scales float32[ceil(n / chunk)], loss)``
    with ``loss = x - q * scale`` (0 in chunks holding NaN/Inf), written into ``loss`` when given
    (``x`` itself allowed); ``q`` into ``out`` when given."""
    x = as_f32(x)
    chunk = C.check_chunk(chunk)
    q, loss = _codes_buffer(x, out, np.int8), _loss_buffer(x, loss)
    scales = np.empty(C.num_chunks(x.size, chunk), np.float32)
    traffic.count("encode", read=x.nbytes, written=q.nbytes + loss.nbytes)  # a chunk's 2nd read hits the cache
    with _threads_for(x.size):
        _quantize_chunks(x, chunk, q, scales, loss, loss.ctypes.data == x.ctypes.data)
    return q, scales, loss


def _fused_operands(name, g, r, acc):
    """``g`` and ``r`` as float32 vectors, checked to match ``acc``: a contiguous, aligned float32
    vector of their size (an error-feedback kernel's operands)."""
    g, r = as_f32(g), as_f32(r)
    n = g.size
    if r.size != n or not (isinstance(acc, np.ndarray) and acc.dtype == np.float32 and acc.size == n
                           and acc.flags.c_contiguous and acc.flags.aligned):
        raise TypeError(f"{name}: g, r and acc must be float32 vectors of {n} elements "
                        f"(acc contiguous and aligned)")
    return g, r


def _count_fused(g, codes):
    """The traffic of error feedback fused with an encoding: ``g`` and ``r`` read, ``acc`` written
    once (the loss), the codes written (the sums are encoded in the cache)."""
    traffic.count("compensate", read=2 * g.nbytes, written=g.nbytes)
    traffic.count("encode", written=codes.nbytes)


def add_quantize_int8_chunks(g, r, acc, chunk, out, stream=False):
    """``acc = g + r`` (error feedback) and :func:`quantize_int8_chunks` of it in place, in one
    pass: the codes into ``out`` (int8 or bytes, ``g``'s size), what quantizing lost into
    ``acc``; returns the chunks' scales (a chunk's scale is NaN or Inf where it holds a value
    that is not finite).  ``stream``: ``acc`` is written by non-temporal stores (a vector that
    leaves the cache anyway).  The same bits as ``np.add`` then :func:`quantize_int8_chunks`."""
    g, r = _fused_operands("add_quantize_int8_chunks", g, r, acc)
    chunk = C.check_chunk(chunk)
    n = g.size
    q = _codes_buffer(g, out, np.int8)
    scales = np.empty(C.num_chunks(n, chunk), np.float32)
    _count_fused(g, q)
    with _threads_for(n):
        _add_quantize_chunks(g, r, acc, chunk, q, scales, np.int64(acc.ctypes.data), bool(stream))
    return scales


def add_encode16(g, r, acc, out, half, stream=False):
    """``acc = g + r`` (error feedback) and its 16-bit encoding in one pass -- float16 (``half``,
    as :func:`half_encode`) or bfloat16 (as :func:`bfloat16_encode`): the codes into ``out``
    (uint16 or bytes, ``g``'s size), what encoding lost into ``acc``.  Returns ``(overflowed,
    finite)``: how many finite sums float16 turned into Inf (then ``acc`` holds no usable loss
    there: encode ``g + r`` again, scaled) and whether every sum is finite (if not, codes and
    ``acc`` are undefined).  ``stream``: ``acc`` is written by non-temporal stores.  Otherwise the
    same bits as ``np.add`` then the encoding with the loss over the sums."""
    g, r = _fused_operands("add_encode16", g, r, acc)
    n = g.size
    codes = _codes_buffer(g, out, np.uint16)
    _count_fused(g, codes)
    with _threads_for(n):
        over, bad = _add_encode16(g, r, acc, codes, np.int64(acc.ctypes.data), bool(stream), bool(half))
    return int(over), bad == 0


def dequantize_int8_chunks_into(q, scales, chunk, out, accumulate=False):
    """``out (+)= q * scale`` of each chunk."""
    traffic.count("decode", read=q.size + (4 * q.size if accumulate else 0), written=4 * q.size)
    with _threads_for(q.size):
        return _dequantize_chunks_into(q, scales, int(chunk), out, bool(accumulate))


def chunk_l1_norms(x, chunk=32768):
    x = as_f32(x)
    chunk = C.check_chunk(chunk)
    traffic.count("select", read=x.nbytes)
    with _threads_for(x.size):
        return _chunk_l1(x, chunk, np.empty(C.num_chunks(x.size, chunk), np.float32))


def warmup() -> None:
    """Compiles (or loads from the Numba cache) every CPU kernel on a tiny input."""
    x = np.linspace(-1.0, 1.0, 3 * _CH + 17, dtype=np.float32)
    topk_abs(x, 5)
    topk_abs(x, x.size // 2)
    kth_largest_abs(x, 5)
    sample_threshold(x, 5)
    select_threshold(x, 0.5)
    hash_select(x, 0.5, 64)
    i, v = select_threshold(x, 0.9)
    scatter_add(x.size, i, v)
    scatter_add(x.size, i.astype(np.int32), v)
    densify_into(np.empty(x.size, np.float32), np.concatenate([i, i]), np.concatenate([v, v]), [0, i.size, 2 * i.size])
    densify_into(np.empty(x.size, np.float32), i.astype(np.int32), v, [0, i.size], add=False)
    dequantize_int8(*quantize_int8(x))
    codes, _, _ = half_encode(x)
    decode16_into(codes, HALF_TABLE, np.empty(x.size, np.float32))
    decode16_into(bfloat16_encode(x)[0], BF16_TABLE, np.zeros(x.size, np.float32), accumulate=True)
    q, scales, _ = quantize_int8_chunks(x, 4096)
    for stream in (False, True):
        add_quantize_int8_chunks(x, x, np.empty_like(x), 4096, np.empty(x.size, np.int8), stream)
    add_encode16(x, x, np.empty_like(x), np.empty(x.size, np.uint16), True)
    dequantize_int8_chunks_into(q, scales, 4096, np.zeros(x.size, np.float32), accumulate=True)
    truncate_fp16(x)
    chunk_l1_norms(x, 1024)
    sample_positions(x.size, 64)
    kth_key(keys_of(x[:64]), 3)
    ci, cv, _ = add_select(x, x, np.empty_like(x), C.threshold_key(0.5), 7)
    topk_of_candidates(ci, cv, 3)
    hash_candidates(ci, cv, 0.5, 64)
    hash_survivors(ci, cv, 0.5, 64)
    union, summed = merge_sum(ci, cv, ci[::2], cv[::2])  # gTop-k's merge, Ok-Topk's reduction
    topk_ties_low(summed, 3)
    intersect_sorted(ci, union)
    blocks = -(-x.size // (1 << 16))
    blocked_indices_decode(blocked_indices_encode(ci - 7, x.size, blocks)[:4 * blocks].view(np.uint32),
                           ((ci - 7) & 0xFFFF).astype(np.uint16))
