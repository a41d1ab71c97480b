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

The kernels live by family -- ``_cpu_select`` (threshold, top-k, hashing and error feedback's
fused selection), ``_cpu_quant`` (int8, float16, bfloat16), ``_cpu_sparse`` (sorted index sets,
scatter and densify), ``_cpu_digest`` (the replica check's sums) over ``_cpu_bits`` (block tests
and LLVM intrinsics); this module is their public face: argument checks, thread limits, staging
buffers and traffic accounting.

Inputs below :data:`PARALLEL_MIN` elements run on the calling thread only.  Every kernel
releases the GIL (``nogil``), so the exchange's communication thread keeps running Python
(packing, MPI calls) while a bucket is being selected.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numba
import numpy as np

from .. import _checks, traffic
from . import _common as C
from ._cpu_bits import _CH, _INFK, _STG, as_f32
from ._cpu_digest import _word_sums
from ._cpu_quant import (_add_encode16, _add_quantize4_chunks, _add_quantize_chunks, _bf16_into, _bf16_truncate,
                         _chunk_l1, _dequantize, _dequantize4_chunks_into, _dequantize_chunks_into, _half_into,
                         _half_rne, _lookup_into, _max_key, _quantize, _quantize4_chunks, _quantize_chunks,
                         _truncate_fp16)
from ._cpu_select import (_NO_INDEX, _add_select_ge, _hash_candidates, _hash_select, _hash_survivors, _keys_of,
                          _kth_key, _lower_key, _magnitude_keys, _positions, _radix_select, _sample_keys,
                          _sample_positions, _select_ge, _select_top, _take_keyed, _top_of_candidates)
from ._cpu_sparse import (_ascending_pieces, _densify, _index_range, _scatter_add, blocked_indices_decode,
                          blocked_indices_encode, intersect_sorted, merge_sum)

_RADIX_PASSES = 3          # the radix select's histogram passes (11 + 10 + 10 key bits)
_PAR_SCATTER = 1 << 14   # payload entries from which scatter_add splits the output over threads

#: Inputs with fewer elements run on the calling thread only ("parallel where it pays"):
#: below this a scan takes well under a millisecond on one core, less than the parallel
#: launch costs -- and far less than waiting for a second core on a busy machine.
PARALLEL_MIN = 1 << 22

#: Error feedback's pass (:func:`add_select`) writes its sums with non-temporal stores from this
#: many elements on (32 MiB of float32), where ``acc`` would not stay in the cache for the stage
#: that reads it next anyway; below, plain stores leave it there (the crossover: the ``stream``
#: rows of docs/engine_choices.json, ``python tools/bench_choices.py --choices stream``).
STREAM_MIN = 1 << 23


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
    """Exact top-``k`` by magnitude (:func:`tfsparse.ops.topk_abs`): the candidates at or above a
    sampled lower key in one streaming pass and the top ``k`` among them, or -- small inputs, dense
    ``k``, an unlucky sample -- the radix select's k-th key and one count + write pass."""
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
    """The exact k-th largest ``|x|`` as float32 (:func:`tfsparse.ops.kth_largest_abs`): found
    among the sampled candidates where they hold it, else by the radix select."""
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
    """DGC's sampled estimate of the k-th largest ``|x|`` (:func:`tfsparse.ops.sample_threshold`):
    the keys at the stratified sample positions and their ``ceil(k * s / n)``-th largest."""
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
    """Every element with ``|x| >= t`` (:func:`tfsparse.ops.select_threshold`) in one streaming
    pass; ``(idx, val)``, ``idx`` ascending."""
    x = as_f32(x)
    traffic.count("select", read=x.nbytes)
    with _threads_for(x.size):
        return _select_ge(x.view(np.uint32), x, C.threshold_key(t), *_staging(x.size))


def hash_select(x, t, capacity, seed=0):
    """DRAGONN's table of ``capacity`` slots (:func:`tfsparse.ops.hash_select`) in one pass over
    ``x``; ``(idx, val)`` in slot order, -1 and 0.0 in the empty slots."""
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
    """``dense[idx[j]] += val[j]`` (:func:`tfsparse.ops.scatter_add`), each element summed in payload
    order, into ``out`` (a contiguous float32 array of shape ``(n,)``, TypeError otherwise) or new
    zeros; negative indices are skipped, and an index ``>= n`` raises IndexError before anything
    is written."""
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
    slice): from that size on, streamed stores are the faster for the pass followed by a read of
    ``acc`` (timed by tools/bench_choices.py)."""
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
    """Pipe-SGD's int8 quantization (:func:`tfsparse.ops.quantize_int8`): ``(q, scale)``, ``q`` all
    zero when ``max|x|`` is 0 or not finite."""
    x = as_f32(x)
    with _threads_for(x.size):
        amax = C.key_to_float(_max_key(x.view(np.uint32))) if x.size else np.float32(0.0)
        scale = np.float32(amax / np.float32(127.0))
        q = np.zeros(x.size, np.int8)
        if np.isfinite(amax) and amax > 0:
            _quantize(x, np.float32(np.float32(127.0) / amax), q)
    return q, scale


def dequantize_int8(q, scale):
    """``float32(q) * scale`` as a new float32 vector (:func:`tfsparse.ops.dequantize_int8`)."""
    q = np.ascontiguousarray(q, dtype=np.int8).reshape(-1)
    with _threads_for(q.size):
        return _dequantize(q, np.float32(scale), np.empty(q.size, np.float32))


def truncate_fp16(x):
    """IEEE binary16 by mantissa truncation (:func:`tfsparse.ops.truncate_fp16`), a new float16
    vector."""
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


def _check_chunk4(chunk):
    """An int4 chunk: :func:`tfsparse.ops._common.check_chunk`'s, and even (two codes a byte)."""
    chunk = C.check_chunk(chunk)
    if chunk % 2:
        raise ValueError(f"chunk={chunk!r} must be even for int4 (two codes a byte)")
    return chunk


def quantize_int4_chunks(x, chunk, loss=None, out=None):
    """Per-chunk 4-bit quantization: ``(q uint8[ceil(n / 2)], scales float32[ceil(n / chunk)],
    loss)`` -- ``code = clip(rint(x * 7 / max|x|), -7, 7)`` per chunk of ``chunk`` (even)
    values, stored ``code + 8``, value ``2j`` in byte ``j``'s low nibble and ``2j + 1`` in its
    high one; ``scale = max|x| / 7``; ``loss = x - code * scale`` (0 in chunks holding NaN/Inf,
    whose scale is not finite), written into ``loss`` when given (``x`` itself allowed); the
    codes into ``out`` (``ceil(n / 2)`` bytes) when given."""
    x = as_f32(x)
    chunk = _check_chunk4(chunk)
    q = _codes_buffer(x[:(x.size + 1) // 2], out, np.uint8)
    loss = _loss_buffer(x, loss)
    scales = np.empty(C.num_chunks(x.size, chunk), np.float32)
    traffic.count("encode", read=x.nbytes, written=q.nbytes + loss.nbytes)
    with _threads_for(x.size):
        _quantize4_chunks(x, chunk, q, scales, loss)
    return q, scales, loss


def add_quantize_int4_chunks(g, r, acc, chunk, out, stream=False):
    """``acc = g + r`` (error feedback) and :func:`quantize_int4_chunks` of it in place, in one
    pass, as :func:`add_quantize_int8_chunks` does for int8: the codes into ``out`` (``ceil(n /
    2)`` bytes), what quantizing lost into ``acc``; returns the chunks' scales.  The same bits as
    ``np.add`` then :func:`quantize_int4_chunks`."""
    g, r = _fused_operands("add_quantize_int4_chunks", g, r, acc)
    chunk = _check_chunk4(chunk)
    n = g.size
    q = _codes_buffer(g[:(n + 1) // 2], out, np.uint8)
    scales = np.empty(C.num_chunks(n, chunk), np.float32)
    _count_fused(g, q)
    with _threads_for(n):
        _add_quantize4_chunks(g, r, acc, chunk, q, scales, np.int64(acc.ctypes.data), bool(stream))
    return scales


def dequantize_int4_chunks_into(q, scales, chunk, n, out, accumulate=False):
    """``out (+)= (code - 8) * scale`` of the ``n`` values :func:`quantize_int4_chunks` packed in ``q``
    (``ceil(n / 2)`` bytes or more, a scale per chunk of ``chunk`` values) into the float32 vector
    ``out`` of ``n`` elements."""
    n, chunk = int(n), C.check_chunk(chunk)
    q, scales = np.asarray(q).reshape(-1), np.asarray(scales).reshape(-1)
    if (q.dtype != np.uint8 or q.size < (n + 1) // 2 or scales.dtype != np.float32
            or scales.size != C.num_chunks(n, chunk) or not isinstance(out, np.ndarray)
            or out.dtype != np.float32 or out.size != n or not out.flags.c_contiguous):
        raise TypeError(f"dequantize_int4_chunks_into: {n} values need {(n + 1) // 2} uint8 codes, "
                        f"{C.num_chunks(n, chunk)} float32 scales and a contiguous float32 out of {n} elements")
    out = out.reshape(-1)
    traffic.count("decode", read=(n + 1) // 2 + (4 * n if accumulate else 0), written=4 * n)
    with _threads_for(n):
        return _dequantize4_chunks_into(q, scales, int(chunk), int(n), out, bool(accumulate))


def chunk_l1_norms(x, chunk=32768):
    """The L1 norm of each ``chunk``-element chunk of ``x`` (:func:`tfsparse.ops.chunk_l1_norms`),
    float32; the read is counted as ``select`` traffic."""
    x = as_f32(x)
    chunk = C.check_chunk(chunk)
    traffic.count("select", read=x.nbytes)
    with _threads_for(x.size):
        return _chunk_l1(x, chunk, np.empty(C.num_chunks(x.size, chunk), np.float32))


def word_sums(words) -> np.ndarray:
    """``[sum, weighted sum]`` (uint64, modulo 2**64) of a 1-D array of uint32 ``words``, the
    weight of word ``i`` being ``i % WEIGHT_MOD + 1`` (:data:`~tfsparse.ops._cpu_digest.WEIGHT_MOD`
    = 65521) -- the replica digest of :mod:`tfsparse.keras.replicas`, in one pass."""
    words = np.ascontiguousarray(words)
    if words.dtype != np.uint32 or words.ndim != 1:
        raise ValueError(f"words={words.dtype}[{words.shape}] is not valid; accepted: a 1-D uint32 array")
    out = np.empty(2, np.uint64)
    _word_sums(words, out)
    return out


def warmup() -> None:
    """Compiles (or loads from the Numba cache) every CPU kernel on a tiny input."""
    x = np.linspace(-1.0, 1.0, 3 * _CH + 17, dtype=np.float32)
    words = x.view(np.uint32)
    word_sums(words)
    frozen = words[:5].copy()
    frozen.flags.writeable = False  # a read-only array is another type to Numba
    word_sums(frozen)
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
    q4, scales4, _ = quantize_int4_chunks(x, 512)
    for stream in (False, True):
        add_quantize_int4_chunks(x, x, np.empty_like(x), 512, np.empty((x.size + 1) // 2, np.uint8), stream)
    dequantize_int4_chunks_into(q4, scales4, 512, x.size, np.zeros(x.size, np.float32), accumulate=True)
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
