"""Public entry points of :mod:`tfsparse.ops`: pick the backend from the input's kind.

Backends are looked up in a table, keyed by where the data lives:

* ``"cpu"``  -- numpy arrays and anything ``np.asarray`` accepts -> :mod:`tfsparse.ops.cpu`
* ``"cuda"`` -- objects exposing ``__cuda_array_interface__`` (Numba device arrays, CuPy,
  PyTorch CUDA tensors), DLPack producers whose ``__dlpack_device__`` is a CUDA device
  (TensorFlow GPU tensors), and the CUDA simulator's device arrays -> :mod:`tfsparse.ops.cuda`

A backend module is imported on first use, so numpy-only users never import numba.cuda.
"""
from __future__ import annotations

from importlib import import_module

_BACKENDS = {"cpu": "tfsparse.ops.cpu", "cuda": "tfsparse.ops.cuda"}
_LOADED: dict = {}
# DLPack device types (dlpack.h DLDeviceType) whose memory the CUDA kernels can address
_DLPACK_CUDA = {2: "kDLCUDA", 3: "kDLCUDAHost", 13: "kDLCUDAManaged"}
# numba's CUDA simulator array type: no __cuda_array_interface__, recognised by name
_SIM_TYPES = {"FakeCUDAArray"}


def device_kind(x) -> str:
    """``"cuda"`` for device-resident arrays (see the module docstring), else ``"cpu"``."""
    if hasattr(x, "__cuda_array_interface__") or type(x).__name__ in _SIM_TYPES:
        return "cuda"
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None and not hasattr(x, "__array_interface__"):
        try:
            return "cuda" if int(dev()[0]) in _DLPACK_CUDA else "cpu"
        except (TypeError, ValueError, BufferError):
            return "cpu"
    return "cpu"


def backend(kind: str):
    """The implementation module for ``kind`` (``"cpu"`` or ``"cuda"``)."""
    mod = _LOADED.get(kind)
    if mod is None:
        mod = _LOADED[kind] = import_module(_BACKENDS[kind])
    return mod


def _impl(x):
    return backend(device_kind(x))


def topk_abs(x, k):
    """Exact top-``k`` of ``x`` by magnitude: ``(idx, val)``, ``idx`` int64 ascending, ``val = x[idx]``.

    Exact selection without a sort (oktopk-li2022 §3.1.3 computes exact thresholds by
    sorting; gtopk-ssgd-shi2019 §IV-E names top-k selection the GPU bottleneck).  CPU:
    a stratified sample gives a key below the k-th largest, one streaming pass gathers
    the candidates, and the k-th key is found among them; for dense k, small inputs or
    an unlucky sample, a radix select (histograms of 11+10+10 key bits) finds the exact
    k-th key and one count + write pass emits the result.  CUDA: a three-digit radix
    select (12+10+9 bits) and an order-preserving compaction (gtopk-ssgd-shi2019 §III-F:
    selection on the GPU, only the sparse result crosses PCIe).

    NaN/Inf: NaN ranks above +-Inf, which ranks above every finite value, so non-finite
    gradients are always sent (the policy of :func:`tfsparse.compressors.topk_indices`).
    Ties at the k-th magnitude (and -0.0 vs 0.0, or NaNs with different payloads) are
    broken by lowest index, so the result is deterministic and exactly ``k`` long.
    ``0 <= k <= x.size`` (ValueError otherwise).
    """
    return _impl(x).topk_abs(x, k)


def kth_largest_abs(x, k):
    """The exact k-th largest ``|x|`` as float32 (``k`` is 1-based).

    NaN if the k-th element in the NaN > Inf > finite order is NaN, and for ``k == 0``
    (nothing is above NaN in that order); ``select_threshold(x, kth_largest_abs(x, k))``
    therefore returns at least ``k`` elements for every ``k > 0``.
    """
    return _impl(x).kth_largest_abs(x, k)


def sample_threshold(x, k, ratio=0.01, seed=0):
    """DGC's sampled estimate of the k-th largest ``|x|`` (dragonn-wang2022 §2.3, Alg. 3).

    ``s = ceil(ratio * n)`` positions are drawn by hash from ``s`` equal strata (one
    each: uniform marginals, lower variance than i.i.d. draws); the estimate is the
    ``ceil(k * s / n)``-th largest sampled magnitude.  Deterministic for a given
    ``seed``; NaN/Inf follow the key order (a sampled NaN can make the estimate NaN,
    which then selects the NaNs only).  ``k == 0`` gives NaN.
    """
    return _impl(x).sample_threshold(x, k, ratio=ratio, seed=seed)


def select_threshold(x, t):
    """All elements with ``|x| >= t``, packed: ``(idx, val)`` with ``idx`` int64 ascending.

    NaN elements are selected for every ``t`` (NaN compares larger than any number);
    ``t <= 0`` selects everything, ``t = +Inf`` selects +-Inf and NaN, ``t = NaN``
    selects NaN only.  DGC's threshold step (dragonn-wang2022 Alg. 3), in one pass.
    """
    return _impl(x).select_threshold(x, t)


def hash_select(x, t, capacity, seed=0):
    """DRAGONN's hashing-based index extraction (dragonn-wang2022 §3.2, Alg. 1).

    Every ``i`` with ``|x[i]| >= t`` (same NaN/Inf rule as :func:`select_threshold`) is
    written to slot ``h(i)`` of a table of ``capacity`` slots, ``h`` drawn from a
    universal family by ``seed`` (see :mod:`tfsparse.ops._common`).  Returns the table
    ``(idx, val)``, both of length ``capacity``, in slot order (*not* sorted -- Alg. 1's
    indices are "in random orders"): ``idx`` int64 with ``-1`` for empty slots, ``val``
    ``x[idx]`` and 0.0 for empty slots (as the paper sets them).

    Collisions: several indices hashed to one slot leave exactly one of them there,
    the largest -- what the paper's sequential loop leaves ("the previous index is
    overwritten by the latter ones"); the parallel kernels get the same result with an
    atomic max, so the output is deterministic.  Overflow: when more than ``capacity``
    elements pass the threshold at most ``capacity`` survive; the dropped ones are
    simply not sent (they stay in the caller's error-feedback residual, App. A.2
    bounds the resulting error).  :func:`scatter_add` skips the ``-1`` slots, so a table
    can be decoded as it is.
    """
    return _impl(x).hash_select(x, t, capacity, seed=seed)


def scatter_add(n, idx, val, out=None):
    """Sparse decoding (dragonn-wang2022 §4.3): ``dense[idx[j]] += val[j]`` for all ``j``.

    ``idx``/``val`` are the concatenation of any number of payloads (int32 or int64
    indices, any order, duplicates summed); the cost is one pass over the output plus
    one over the payloads, flat in the number of payloads, instead of one dense decode
    and add per payload.  Negative indices are skipped (empty :func:`hash_select`
    slots); an index ``>= n`` raises IndexError.  With ``out`` (float32, shape ``[n]``,
    same device) the payloads are added into it in place; otherwise into zeros.
    CPU sums each element in payload order (bit-identical to ``np.add.at``); CUDA uses
    atomic adds (order, hence rounding, not deterministic).  NaN/Inf values propagate.
    Backend chosen by ``out`` when given, else by ``val``; a host payload with a device
    ``out`` is copied to the device (only the sparse payload crosses PCIe).
    """
    where = out if out is not None else val
    return _impl(where).scatter_add(n, idx, val, out=out)


def quantize_int8(x):
    """Pipe-SGD scalar quantization (pipe-sgd-li2018 §3.2): ``(q int8[n], scale float32)``.

    ``scale = max|x| / 127`` ("a quantization range determined by the maximal element"),
    ``q = clip(rint(x * (127 / max|x|)), -127, 127)`` (round half to even).  All-zero or
    empty input gives ``scale = 0`` and ``q = 0``.  NaN/Inf: int8 cannot carry them, so a
    non-finite element makes ``scale`` non-finite (NaN if any NaN, else Inf) and ``q``
    all zero: the dequantized tensor is all NaN, and the receiver sees the bad gradient
    instead of a silently clipped one.
    """
    return _impl(x).quantize_int8(x)


def dequantize_int8(q, scale):
    """``float32(q) * scale`` (inverse of :func:`quantize_int8`, error <= scale/2 per element)."""
    return _impl(q).dequantize_int8(q, scale)


def truncate_fp16(x):
    """Pipe-SGD 16-bit truncation (pipe-sgd-li2018 §3.2: "drops the less significant
    mantissa bits"): IEEE binary16 rounded toward zero (the 13 low mantissa bits are cut).

    Magnitudes above 65504 saturate to +-65504 (round-toward-zero never overflows to
    Inf), magnitudes below 2**-24 become +-0 and the sign is kept.  +-Inf stays +-Inf,
    NaN stays NaN (quiet).  Returns float16; ``.astype(np.float32)`` expands it.
    """
    return _impl(x).truncate_fp16(x)


def chunk_l1_norms(x, chunk=32768):
    """L1 norm of each ``chunk``-element chunk of ``x`` (last chunk may be short), float32.

    GradientFlow's coarse-grained sparse communication (gradientflow-sun2019 §3,
    "Coarse-Grained Sparse Communication", Fig. 18) ranks 32K-gradient chunks by L1
    norm.  Accumulated in float64 (CPU: float32 partial sums of 256 elements).  NaN/Inf
    propagate into their chunk's norm (NaN chunks then rank first under the NaN policy).
    """
    return _impl(x).chunk_l1_norms(x, chunk)


__all__ = ["topk_abs", "kth_largest_abs", "sample_threshold", "select_threshold", "hash_select",
           "scatter_add", "quantize_int8", "dequantize_int8", "truncate_fp16", "chunk_l1_norms",
           "device_kind", "backend"]
