"""CUDA kernels (``numba.cuda``) behind :mod:`tfsparse.ops`, for device-resident gradients.

Inputs are device arrays: anything with ``__cuda_array_interface__`` (Numba, CuPy,
PyTorch), CUDA DLPack producers (TensorFlow GPU tensors), or the CUDA simulator's
arrays; they are viewed in place, never copied to the host.  Results are Numba device
arrays (CuPy/PyTorch take them through ``__cuda_array_interface__``); scalar results
(thresholds, the quantization scale) come back as host ``np.float32`` -- a 4-byte copy.
The dense gradient never crosses PCIe, only the sparse payload does, and only when the
caller copies it (gtopk-ssgd-shi2019 §III-F: "transferring the non-values through PCIe
could be much faster than transferring the whole gradients").

Kernels (semantics identical to :mod:`tfsparse.ops.reference`, tested under
``NUMBA_ENABLE_CUDASIM=1`` and compiled to PTX for sm_90 in CI, see :func:`compile_ptx_all`):

* order-preserving compaction -- ``count`` (per-block counts of "key > T" and
  "key == T"), ``scan`` (block offsets, one block), ``write`` (each block rescans
  its tile and writes its hits in index order).  The first ``r`` ties in index order
  are taken, so the same three kernels serve ``select_threshold`` (T = t-1, r = 0) and
  exact top-k (T = k-th key, r = ties needed).  Two reads of the gradient: the parallel
  prefix-sum structure whose cost DRAGONN measures (dragonn-wang2022 §3.1, App. C).
* radix select -- ``hist`` + ``find`` three times (12, 10, 9 bits of the 31-bit
  key); the state (prefix, remaining rank) stays on the device between launches.
* DRAGONN hashing (dragonn-wang2022 §3.2, Alg. 1) -- ``hash``: one read, one compare
  per element, ``atomicMax`` into the slot (deterministic: largest index wins), no
  prefix sum; ``gather`` fetches the values of the ``capacity`` slots; ``winners`` flags the
  elements that hold a slot, and the compaction packs them in index order
  (:func:`hash_survivors`, DRAGONN's payload on the device: no table copied to the host, no sort).
* sparse decode (§4.3) -- ``scatter`` with float atomics into one dense output.
* ``max_key``/``quantize``/``dequantize`` (pipe-sgd-li2018 §3.2), ``trunc16``
  (16-bit truncation), ``chunk_l1`` (gradientflow-sun2019 §3, CSC).

The kernels themselves are in ``_cuda_kernels``; this module holds the host wrappers.  The tile
kernels are built per block shape (:class:`Kernels`, default 256 threads x 8 elements);
:func:`set_block_shape` swaps the shape (the simulator tests use small blocks).

Memory: each call allocates its outputs with ``cuda.device_array``; the small scratch arrays
(radix state and histogram, compaction counts, flags) are kept per thread and per GPU and
reset by kernels, never copied from the host: a small ``cuda.to_device`` costs several kernel
launches (measured: docs/gpus.md).  Install a pooling allocator
(Numba EMM plugin, e.g. RMM's) when calling these per layer and per step.
"""
from __future__ import annotations

import threading

import numpy as np
from numba import cuda

from . import _common as C
from . import _dlpack
from ._cuda_kernels import (_DIGITS, _NB_MAX, DEFAULT_ITEMS, DEFAULT_MAX_BLOCKS, DEFAULT_TPB,  # noqa: F401
                            SIGNATURES, SUPPORTED, Kernels, check_versions)  # the last four: re-exported

_K = Kernels()


def set_block_shape(tpb: int = DEFAULT_TPB, items: int = DEFAULT_ITEMS, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
    """Selects the launch shape (tuning; the tests use few small blocks under the CUDA
    simulator, which runs one Python thread per CUDA thread)."""
    global _K
    _K = Kernels(tpb, items, max_blocks)


def compile_ptx_all(cc=(9, 0)) -> dict:
    """PTX (``{"kernel/signature#": ptx}``) of every kernel of the active block shape."""
    return _K.compile_ptx(cc)


# ============================================================================= host wrappers

def _device_types() -> tuple:
    from numba.cuda.cudadrv import devicearray

    return tuple(t for t in (getattr(devicearray, "DeviceNDArray", None), getattr(devicearray, "FakeCUDAArray", None))
                 if t is not None)


_DEVICE_TYPES = _device_types()
#: True under NUMBA_ENABLE_CUDASIM=1 (device arrays are host memory there)
SIMULATOR = any(t.__name__ == "FakeCUDAArray" for t in _DEVICE_TYPES)
_DLPACK_CUDA = _dlpack.CUDA_DEVICE_TYPES


def as_device(x, dtype=np.float32):
    """A 1-D contiguous device view of ``x`` (host arrays are copied to the device)."""
    if isinstance(x, _DEVICE_TYPES):
        d = x
    elif hasattr(x, "__cuda_array_interface__"):
        d = cuda.as_cuda_array(x)
    elif (hasattr(x, "__dlpack__") and not hasattr(x, "__array_interface__")
          and _dlpack.device_type(x) in _DLPACK_CUDA):
        d = _dlpack.view(x)  # e.g. a TensorFlow GPU tensor: zero-copy
    else:
        return cuda.to_device(np.ascontiguousarray(x, dtype=dtype).reshape(-1))
    if np.dtype(d.dtype) != np.dtype(dtype):
        raise TypeError(f"expected a {np.dtype(dtype).name} device array, got {d.dtype}")
    if d.ndim != 1:
        d = d.reshape(-1)
    if not d.is_c_contiguous():
        raise ValueError("device arrays must be C-contiguous")
    return d


def _as_x(x):
    d = as_device(x)
    C.check_n(d.size)
    return d, d.view(np.uint32)


class _Scratch(threading.local):
    """Small device arrays of one thread, per GPU, reused from call to call (kernels reset them):
    a thread's launches run in order on its stream, and two threads never share one."""

    def __init__(self):
        self.arrays = {}

    def get(self, name: str, n: int, dtype=np.int64, init=None):
        """A device array of ``n`` elements, ``dtype``: what the last user left in it, or what
        ``init(array)`` sets when it is new."""
        key = (getattr(cuda.get_current_device(), "id", 0), name)
        a = self.arrays.get(key)
        if a is None or a.size < n:
            a = self.arrays[key] = cuda.device_array(max(n, 1), dtype)
            if init is not None:
                init(a)
        return a if a.size == n else a[:n]


_SCRATCH = _Scratch()


def _zeroed(name: str):
    """A one-element int64 scratch counter, set to 0."""
    a = _SCRATCH.get(name, 1)
    _K["fill_i64"][1, 32](a, 0)
    return a


def sync() -> None:
    """Waits for all work on the current device (all streams of the context: TF's and Numba's)."""
    cuda.synchronize()


def _params(thr: int, r: int, name: str = "params"):
    a = _SCRATCH.get(name, 2)
    _K["set2_i64"][1, 32](a, thr, r)
    return a


def _compact(xu, xd, params, size=None):
    """Runs count/scan/write; ``size`` (known for top-k) avoids reading the total back."""
    nt_ = _K.ntiles(xu.size)
    nb = _K.tiles(xu.size)
    cnt = _SCRATCH.get("cnt", nt_)
    offs = _SCRATCH.get("offs", nt_)
    total = _SCRATCH.get("total", 1)
    _K["count"][nb, _K.tpb](xu, params, cnt)
    _K["scan"][1, _K.tpb](cnt, params, offs, total)
    if size is None:
        size = int(total.copy_to_host()[0])
    out_idx = cuda.device_array(size, np.int64)
    out_val = cuda.device_array(size, np.float32)
    if size:
        _K["write"][nb, _K.tpb](xu, xd, params, offs, out_idx, out_val)
    return out_idx, out_val


def _radix_state(xu, k: int):
    """Device state ``[T, r]``: T = k-th largest key, r = how many ties at T the top-k takes."""
    state = _params(0, k, "state")
    # zeroed when new; "find" leaves it zeroed for the next level and the next call
    hist = _SCRATCH.get("hist", _NB_MAX, init=lambda a: _K["fill_i64"][_K.grid(a.size), _K.tpb](a, 0))
    nb = min(_K.tiles(xu.size), _K.hist_blocks)
    for bits, shift in _DIGITS:
        _K["hist"][nb, _K.tpb](xu, state, shift, bits, hist)
        _K["find"][1, _K.tpb](hist, bits, state)
    return state


def _empty_payload():
    return cuda.device_array(0, np.int64), cuda.device_array(0, np.float32)


def topk_abs(x, k):
    """Exact top-``k`` by magnitude on the device (:func:`tfsparse.ops.topk_abs`): the radix select's
    k-th key, then the order-preserving compaction; ``(idx, val)`` device arrays, ``idx`` ascending."""
    xd, xu = _as_x(x)
    n = xd.size
    k = C.check_k(k, n)
    if k == 0:
        return _empty_payload()
    if k == n:
        idx = cuda.device_array(n, np.int64)
        _K["iota"][_K.grid(n), _K.tpb](idx)
        val = cuda.device_array(n, np.float32)
        val.copy_to_device(xd)
        return idx, val
    return _compact(xu, xd, _radix_state(xu, k), size=k)


def kth_largest_abs(x, k):
    """The exact k-th largest ``|x|`` (:func:`tfsparse.ops.kth_largest_abs`) by the radix select,
    read back as a host ``np.float32`` (NaN for ``k == 0``)."""
    xd, xu = _as_x(x)
    k = C.check_k(k, xd.size)
    if k == 0:
        return np.float32(np.nan)
    return C.key_to_float(_radix_state(xu, k).copy_to_host()[0])


def sample_threshold(x, k, ratio=0.01, seed=0):
    """DGC's sampled threshold (:func:`tfsparse.ops.sample_threshold`): the stratified samples'
    keys gathered on the device and their ``ceil(k * s / n)``-th largest found by the radix
    select, read back as a host ``np.float32`` (NaN for ``k == 0``)."""
    xd, xu = _as_x(x)
    n = xd.size
    k = C.check_k(k, n)
    s = C.sample_count(n, ratio)
    if k == 0:
        return np.float32(np.nan)
    ha, hb = C.hash_params(seed, C.SALT_SAMPLE)
    samples = _SCRATCH.get("samples", s, np.uint32)
    _K["sample"][_K.grid(s), _K.tpb](xu, s, C.sample_step(n, s), ha, hb, samples)
    return C.key_to_float(_radix_state(samples, C.sample_rank(k, n, s)).copy_to_host()[0])


def _ge_params(tkey: int, n: int):
    # "key >= tkey" as "key > tkey - 1"; tkey == 0 selects everything: key > 0 plus all ties at 0
    return _params(tkey - 1, 0) if tkey > 0 else _params(0, n)


def select_threshold(x, t):
    """Every element with ``|x| >= t`` (:func:`tfsparse.ops.select_threshold`) by the
    order-preserving compaction; ``(idx, val)`` device arrays, ``idx`` ascending."""
    xd, xu = _as_x(x)
    if xd.size == 0:
        return _empty_payload()
    return _compact(xu, xd, _ge_params(C.threshold_key(t), xd.size))


def _hash_table(xu, tkey: int, m: int, seed):
    """DRAGONN's table of ``m`` slots over the keys ``xu`` (-1: empty) and its hash parameters."""
    table = cuda.device_array(m, np.int64)
    _K["fill_i64"][_K.grid(m), _K.tpb](table, -1)
    ha, hb = C.hash_params(seed, C.SALT_HASH)
    if xu.size:
        _K["hash"][_K.grid(xu.size), _K.tpb](xu, tkey, ha, hb, m, table)
    return table, ha, hb


def hash_select(x, t, capacity, seed=0):
    """DRAGONN's table of ``capacity`` slots (:func:`tfsparse.ops.hash_select`) on the device: the
    ``hash`` kernel's ``atomicMax`` per slot, then each slot's value gathered (0.0 for an empty
    slot); ``(table, val)`` device arrays in slot order."""
    xd, xu = _as_x(x)
    m = C.check_capacity(capacity)
    if m == 0:
        return _empty_payload()
    table, _, _ = _hash_table(xu, C.threshold_key(t), m, seed)
    val = cuda.device_array(m, np.float32)
    _K["gather"][_K.grid(m), _K.tpb](table, xd, val)
    return table, val


def hash_survivors(x, t, capacity, seed=0):
    """What :func:`hash_select`'s table holds, in index order: ``(idx, val)``, ``idx`` int64
    ascending, ``val = x[idx]`` -- the table's occupied slots sorted, without a sort: each
    element is flagged when it holds its slot, and the order-preserving compaction packs the
    flagged ones (DRAGONN's payload, built on the device; only it crosses PCIe)."""
    xd, xu = _as_x(x)
    m = C.check_capacity(capacity)
    n = xd.size
    if m == 0 or n == 0:
        return _empty_payload()
    tkey = C.threshold_key(t)
    table, ha, hb = _hash_table(xu, tkey, m, seed)
    flags = cuda.device_array(n, np.uint32)
    _K["winners"][_K.grid(n), _K.tpb](xu, tkey, ha, hb, m, table, flags)
    return _compact(flags, xd, _params(0, 0))  # flag keys 0 / 1: every key above 0


def scatter_add(n, idx, val, out=None):
    """``dense[idx[j]] += val[j]`` on the device (:func:`tfsparse.ops.scatter_add`) by float atomic
    adds, into ``out`` or a new zeroed vector; negative indices are skipped, and an index ``>= n``
    raises IndexError once the launch is done (the entries in range are added by then)."""
    n = int(n)
    idx_dtype = np.int32 if getattr(idx, "dtype", None) == np.int32 else np.int64
    di = as_device(idx, idx_dtype)
    dv = as_device(val, np.float32)
    if di.size != dv.size:
        raise ValueError(f"idx ({di.size}) and val ({dv.size}) differ in length")
    if out is None:
        out = cuda.device_array(n, np.float32)
        if n:
            _K["fill_f32"][_K.grid(n), _K.tpb](out, np.float32(0.0))
    else:
        out = as_device(out, np.float32)
        if out.size != n:
            raise ValueError(f"out has {out.size} elements, expected {n}")
    if di.size:
        bad = _zeroed("bad")
        _K["scatter"][_K.grid(di.size), _K.tpb](di, dv, out, bad)
        if int(bad.copy_to_host()[0]):
            raise IndexError(f"scatter_add: an index is >= n={n}")
    return out


def quantize_int8(x):
    """Pipe-SGD's int8 quantization (:func:`tfsparse.ops.quantize_int8`) on the device:
    ``(q, scale)``, ``q`` an int8 device array, ``scale`` a host ``np.float32``."""
    xd, xu = _as_x(x)
    n = xd.size
    q = cuda.device_array(n, np.int8)
    amax_u = _zeroed("amax").view(np.uint32)[:1]
    if n:
        _K["max_key"][_K.grid(n), _K.tpb](xu, amax_u)
    amax_f = amax_u.view(np.float32)
    if n:
        _K["quantize"][_K.grid(n), _K.tpb](xd, amax_f, q)
    amax = C.key_to_float(amax_u.copy_to_host()[0])  # the canonical NaN key is a signalling NaN
    return q, np.float32(amax / np.float32(127.0))


def dequantize_int8(q, scale):
    """``float32(q) * scale`` into a new float32 device vector
    (:func:`tfsparse.ops.dequantize_int8`)."""
    dq = as_device(q, np.int8)
    out = cuda.device_array(dq.size, np.float32)
    if dq.size:
        _K["dequantize"][_K.grid(dq.size), _K.tpb](dq, np.float32(scale), out)
    return out


def truncate_fp16(x):
    """IEEE binary16 by mantissa truncation (:func:`tfsparse.ops.truncate_fp16`), a new float16
    device array."""
    xd, xu = _as_x(x)
    out = cuda.device_array(xd.size, np.uint16)
    if xd.size:
        _K["trunc16"][_K.grid(xd.size), _K.tpb](xu, out)
    return out.view(np.float16)


def chunk_l1_norms(x, chunk=32768):
    """The L1 norm of each ``chunk``-element chunk of ``x`` (:func:`tfsparse.ops.chunk_l1_norms`):
    a block per chunk, summed in float64, returned as a float32 device vector."""
    xd, _ = _as_x(x)
    chunk = C.check_chunk(chunk)
    m = C.num_chunks(xd.size, chunk)
    out = cuda.device_array(m, np.float32)
    if m:
        _K["chunk_l1"][min(m, _K.max_blocks), _K.tpb](xd, chunk, out)
    return out


# ----------------------------------------------------------------------------- exchange buffers (host side)

def _f32_dev(x):
    return as_device(x, np.float32)


def add(a, b, out) -> None:
    """``out = a + b`` (float32 device vectors of one length; ``out`` may be ``a`` or ``b``)."""
    out = _f32_dev(out)
    if out.size:
        _K["add"][_K.grid(out.size), _K.tpb](_f32_dev(a), _f32_dev(b), out)


def momentum_step(u, m, g, r, out) -> None:
    """``u = m*u + g; out = u + r`` in place (float32, numpy's rounding)."""
    out = _f32_dev(out)
    if out.size:
        _K["momentum"][_K.grid(out.size), _K.tpb](_f32_dev(u), np.float32(m), _f32_dev(g), _f32_dev(r), out)


def scale(x, s, out) -> None:
    """``out = x * float32(s)``."""
    out = _f32_dev(out)
    if out.size:
        _K["scale"][_K.grid(out.size), _K.tpb](_f32_dev(x), np.float32(s), out)


def all_finite(x) -> bool:
    """Whether no element of the float32 device vector ``x`` is NaN/Inf (one int64 read back)."""
    xd, xu = _as_x(x)
    if not xd.size:
        return True
    flag = _zeroed("flag")
    _K["nonfinite"][_K.grid(xd.size), _K.tpb](xu, flag)
    return int(flag.copy_to_host()[0]) == 0


def zero_nonfinite(x) -> None:
    """NaN/Inf elements of ``x`` set to 0 in place (``np.nan_to_num(x, nan=0, posinf=0, neginf=0)``)."""
    xd, xu = _as_x(x)
    if xd.size:
        _K["zero_nonfinite"][_K.grid(xd.size), _K.tpb](xu)


def zero_at(out, idx) -> None:
    """``out[idx] = 0`` (host or device int64 indices, each ``< out.size``)."""
    di = as_device(idx, np.int64)
    if di.size:
        _K["zero_at"][_K.grid(di.size), _K.tpb](di, _f32_dev(out))


def set_at(out, idx, val) -> None:
    """``out[idx] = val`` (indices unique; host or device arrays)."""
    di = as_device(idx, np.int64)
    if di.size:
        _K["set_at"][_K.grid(di.size), _K.tpb](di, _f32_dev(val), _f32_dev(out))


def sum_squares(x) -> float:
    """``sum(float64(x)**2)`` (atomic float64 partial sums: the order, hence the last bits, vary)."""
    xd = _f32_dev(x)
    out = cuda.to_device(np.zeros(1, np.float64))
    if xd.size:
        _K["sum_squares"][_K.grid(xd.size), _K.tpb](xd, out)
    return float(out.copy_to_host()[0])


def fill(out, value) -> None:
    """``out[:] = float32(value)`` in place (a float32 device vector)."""
    out = _f32_dev(out)
    if out.size:
        _K["fill_f32"][_K.grid(out.size), _K.tpb](out, np.float32(value))
