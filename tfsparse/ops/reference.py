"""Plain numpy reference implementations of :mod:`tfsparse.ops` (used by the tests only).

They define the exact semantics the Numba CPU and CUDA kernels must reproduce:
magnitude keys and the NaN policy (:mod:`tfsparse.ops._common`), tie-breaking by
lowest index, hash slots, sample positions, rounding.  Written for clarity, not speed.
"""
from __future__ import annotations

import numpy as np

from . import _common as C


def _flat(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def mag_keys(x) -> np.ndarray:
    """uint32 magnitude keys, NaN canonicalised to ``NAN_KEY`` (see :mod:`._common`)."""
    x = _flat(x)
    keys = x.view(np.uint32) & np.uint32(C.ABS_MASK)
    return np.where(np.isnan(x), np.uint32(C.NAN_KEY), keys).astype(np.uint32)


def _order_desc(keys: np.ndarray) -> np.ndarray:
    """Positions sorted by key descending, ties by index ascending."""
    return np.lexsort((np.arange(keys.size), -keys.astype(np.int64)))


def topk_abs(x, k):
    """The ``k`` largest keys, ties to the lowest index (a full sort): ``(idx, val)``, ``idx`` ascending."""
    x = _flat(x)
    k = C.check_k(k, x.size)
    sel = np.sort(_order_desc(mag_keys(x))[:k]).astype(np.int64)
    return sel, x[sel]


def kth_largest_abs(x, k):
    """The k-th largest key as float32, by a full sort (NaN for ``k == 0``)."""
    x = _flat(x)
    k = C.check_k(k, x.size)
    if k == 0:
        return np.float32(np.nan)
    keys = np.sort(mag_keys(x))[::-1]
    return C.key_to_float(keys[k - 1])


def sample_positions(n: int, s: int, seed: int) -> np.ndarray:
    """Stratified uniform sample: one position drawn (by hash) from each of ``s`` strata of
    (almost) equal length ``n / s`` (see :func:`tfsparse.ops._common.sample_step`)."""
    a, b = C.hash_params(seed, C.SALT_SAMPLE)
    step = C.sample_step(n, s)
    j = np.arange(s, dtype=np.uint64)
    lo = (j * step) >> np.uint64(32)
    hi = ((j + np.uint64(1)) * step) >> np.uint64(32)
    if s:
        hi[-1] = n
    h = (a * j + b) >> np.uint64(32)
    return (lo + ((h * (hi - lo)) >> np.uint64(32))).astype(np.int64)


def sample_threshold(x, k, ratio=0.01, seed=0):
    """The ``ceil(k * s / n)``-th largest key among the ``s`` samples at :func:`sample_positions`,
    as float32 (NaN for ``k == 0``)."""
    x = _flat(x)
    n = x.size
    k = C.check_k(k, n)
    s = C.sample_count(n, ratio)
    if k == 0:
        return np.float32(np.nan)
    keys = mag_keys(x[sample_positions(n, s, seed)])
    ks = C.sample_rank(k, n, s)
    return C.key_to_float(np.sort(keys)[::-1][ks - 1])


def select_threshold(x, t):
    """Every element whose key is at least ``threshold_key(t)``: ``(idx, val)``, ``idx``
    ascending."""
    x = _flat(x)
    sel = np.nonzero(mag_keys(x) >= np.uint32(C.threshold_key(t)))[0].astype(np.int64)
    return sel, x[sel]


def hash_slots(i: np.ndarray, capacity: int, seed: int) -> np.ndarray:
    """The slot of each index of ``i`` in a table of ``capacity`` slots: the multiply-shift hash drawn
    by ``seed`` (``h = (a * i + b) >> 32``), scaled to the table (``(h * capacity) >> 32``)."""
    a, b = C.hash_params(seed, C.SALT_HASH)
    h = (a * i.astype(np.uint64) + b) >> np.uint64(32)
    return ((h * np.uint64(capacity)) >> np.uint64(32)).astype(np.int64)


def hash_select(x, t, capacity, seed=0):
    """DRAGONN Alg. 1 run sequentially: the last (= largest) index hashed to a slot wins."""
    x = _flat(x)
    capacity = C.check_capacity(capacity)
    table = np.full(capacity, -1, dtype=np.int64)
    sel = select_threshold(x, t)[0]
    if capacity and sel.size:
        np.maximum.at(table, hash_slots(sel, capacity, seed), sel)
    val = np.where(table >= 0, x[np.maximum(table, 0)] if x.size else np.float32(0), np.float32(0))
    return table, val.astype(np.float32)


def scatter_add(n, idx, val, out=None):
    """``np.add.at`` of the payload into ``out`` (in place) or new zeros, negative indices skipped; an
    index ``>= n`` raises IndexError."""
    idx = np.asarray(idx).reshape(-1)
    val = np.asarray(val, dtype=np.float32).reshape(-1)
    dense = np.zeros(int(n), dtype=np.float32) if out is None else out
    keep = idx >= 0
    if np.any(idx[keep] >= n):
        raise IndexError("index out of range")
    np.add.at(dense, idx[keep].astype(np.int64), val[keep])
    return dense


def quantize_int8(x):
    """``(q, scale)``: ``scale = max|x| / 127``, ``q = clip(rint(x * (127 / max|x|)), -127, 127)``;
    ``q`` all zero when ``max|x|`` is 0 or not finite."""
    x = _flat(x)
    amax = C.key_to_float(mag_keys(x).max()) if x.size else np.float32(0)
    scale = np.float32(amax / np.float32(127))
    if not np.isfinite(amax) or amax == 0:
        return np.zeros(x.size, np.int8), scale
    inv = np.float32(np.float32(127) / amax)
    q = np.clip(np.rint(x * inv), -127, 127).astype(np.int8)
    return q, scale


def dequantize_int8(q, scale):
    """``float32(q) * float32(scale)``."""
    return np.asarray(q).reshape(-1).astype(np.float32) * np.float32(scale)


def truncate_fp16(x):
    """IEEE binary16 with round-toward-zero (mantissa truncation), see :func:`tfsparse.ops.truncate_fp16`."""
    x = _flat(x)
    with np.errstate(over="ignore", invalid="ignore"):
        h = x.astype(np.float16)  # round-to-nearest-even
        away = np.abs(h.astype(np.float32)) > np.abs(x)  # rounded away from zero (incl. overflow to inf)
    h[away] = np.nextafter(h[away], np.float16(0))
    return h


def chunk_l1_norms(x, chunk=32768):
    """Each chunk's sum of ``|x|`` in float64 (the last chunk padded with zeros), as float32."""
    x = _flat(x)
    chunk = C.check_chunk(chunk)
    m = C.num_chunks(x.size, chunk)
    pad = np.zeros(m * chunk, dtype=np.float64)
    pad[: x.size] = np.abs(x.astype(np.float64))
    return pad.reshape(m, chunk).sum(axis=1).astype(np.float32)
