"""Definitions shared by the CPU, CUDA and reference implementations of :mod:`tfsparse.ops`.

Magnitude keys
--------------
Every selection kernel orders elements by a 31-bit unsigned *magnitude key*::

    key(x) = bits(x) & 0x7FFFFFFF        (drops the sign: key(-x) == key(x))
    key(x) = NAN_KEY  if x is NaN        (every NaN payload maps to one key)

For non-NaN float32 the unsigned order of ``bits & 0x7FFFFFFF`` is the order of
``|x|`` (``-0.0`` and ``0.0`` tie at key 0, ``+-Inf`` is ``INF_KEY``), and
``NAN_KEY = INF_KEY + 1`` puts NaN above every number.  Hence the repo-wide NaN
policy of :func:`tfsparse.compressors.topk_indices` ("NaN compares larger than
any number, so non-finite gradients are always sent"): NaN first, then +-Inf,
then finite values by magnitude.  Integer keys make selection a pure integer
compare, which is what radix/histogram selection needs (oktopk-li2022 §3.1.3:
selection against a threshold "only requires n comparisons").

Thresholds
----------
A threshold ``t`` selects ``key(x) >= threshold_key(t)``, i.e. ``|x| >= t`` for a
non-NaN ``t > 0``, *or x is NaN*.  ``t <= 0`` selects everything; ``t = +Inf``
selects +-Inf and NaN; ``t = NaN`` selects NaN only.

Hashing (DRAGONN Alg. 1, dragonn-wang2022 §3.2 and App. A.2)
-----------------------------------------------------------
``slot(i) = (((a*i + b) mod 2**64) >> 32) * m >> 32`` -- Dietzfelbinger's
multiply-add-shift family (2-independent for 32-bit keys, a Carter-Wegman style
universal family as App. A.2 assumes) followed by Lemire's multiply-shift range
reduction to ``[0, m)``.  ``(a, b)`` come from ``seed`` through splitmix64, so
every backend (and the numpy reference) computes the same slots.
"""
from __future__ import annotations

import math

import numpy as np

ABS_MASK = 0x7FFFFFFF
INF_KEY = 0x7F800000
NAN_KEY = INF_KEY + 1
KEY_BITS = 31
MAX_CAPACITY = 2**32 - 1  # slot computation is a 32x32 -> 64-bit product
MAX_N = 2**32 - 1          # element indices are hashed as 32-bit keys

_M64 = (1 << 64) - 1
# salts so that hash_select and the sampling positions use unrelated hash functions
SALT_HASH = 0
SALT_SAMPLE = 0x5A17


def splitmix64(z: int) -> int:
    """One splitmix64 step (Steele, Lea & Flood 2014): a 64-bit mixer used to derive hash keys."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def hash_params(seed: int, salt: int = SALT_HASH) -> tuple[np.uint64, np.uint64]:
    """``(a, b)`` of the multiply-add-shift hash for ``seed`` (``a`` odd)."""
    s = (int(seed) * 2 + (int(salt) << 33)) & _M64
    return np.uint64(splitmix64(s) | 1), np.uint64(splitmix64((s + 1) & _M64))


def threshold_key(t) -> int:
    """Key such that ``key(x) >= threshold_key(t)`` is the selection rule for threshold ``t``."""
    t = np.float32(t)
    if np.isnan(t):
        return NAN_KEY
    if t <= 0:
        return 0
    return int(np.array([t], dtype=np.float32).view(np.uint32)[0])


def key_to_float(key: int) -> np.float32:
    """The (non-negative) float32 magnitude of a key; NaN for ``NAN_KEY``."""
    key = int(key)
    if key > INF_KEY:
        return np.float32(np.nan)
    return np.array([key], dtype=np.uint32).view(np.float32)[0]


def check_k(k, n: int) -> int:
    k = int(k)
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must be in [0, {n}] (the input has {n} elements)")
    return k


def check_n(n: int) -> int:
    if n > MAX_N:
        raise ValueError(f"tfsparse.ops handles arrays of at most {MAX_N} elements, got {n}")
    return n


def check_capacity(capacity) -> int:
    capacity = int(capacity)
    if not 0 <= capacity <= MAX_CAPACITY:
        raise ValueError(f"capacity={capacity} must be in [0, {MAX_CAPACITY}]")
    return capacity


def check_chunk(chunk) -> int:
    chunk = int(chunk)
    if chunk <= 0:
        raise ValueError(f"chunk={chunk} must be positive")
    return chunk


def num_chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


def sample_count(n: int, ratio: float) -> int:
    """Number of DGC samples: ``ceil(ratio * n)`` clamped to ``[1, n]`` (0 for an empty input)."""
    if not ratio > 0:
        raise ValueError(f"ratio={ratio} must be positive")
    if n == 0:
        return 0
    return int(min(n, max(1, math.ceil(float(ratio) * n))))


def sample_step(n: int, s: int) -> np.uint64:
    """32.32 fixed-point stratum length ``n / s``: stratum ``j`` is
    ``[(j * step) >> 32, ((j + 1) * step) >> 32)`` (the last one ends at ``n``); every
    stratum is non-empty for ``s <= n`` and ``j * step < 2**64`` for ``n < 2**32``."""
    return np.uint64((int(n) << 32) // int(s))


def sample_rank(k: int, n: int, s: int) -> int:
    """Rank, among ``s`` samples of ``n`` elements, of the estimate of the k-th largest: ``ceil(k*s/n)``."""
    return int(min(s, max(1, -(-k * s // n))))


def prefilter_rank(k: int, n: int, s: int) -> int:
    """Sample rank for the exact top-k prefilter: the expected count ``k*s/n`` plus a
    4-sigma (Poisson) margin and 8, so that fewer than ``k`` candidates is rare."""
    mean = k * s / n
    return int(math.ceil(mean + 4.0 * math.sqrt(mean) + 8.0))
