"""TensorFlow wrappers of :mod:`tfsparse.ops`: graph ops with static dtypes and shapes.

Each function takes tensors, returns tensors, and works eagerly, inside ``tf.function``
and inside Keras' compiled train step (``jit_compile=False``: like the rest of tfsparse
the kernels run from Python, which XLA cannot compile -- tracing under XLA raises a
ValueError that says so).  Output shapes are static wherever the op allows it::

    topk_abs(x, k)                    -> idx int64[k], val float32[k]
    kth_largest_abs(x, k)             -> float32[]
    sample_threshold(x, k, ratio, seed) -> float32[]
    select_threshold(x, t)            -> idx int64[None], val float32[None]
    hash_select(x, t, capacity, seed) -> idx int64[capacity], val float32[capacity]
    scatter_add(n, idx, val)          -> float32[n]
    quantize_int8(x)                  -> int8[n], float32[]
    dequantize_int8(q, scale)         -> float32[n]
    truncate_fp16(x)                  -> float16[n]
    chunk_l1_norms(x, chunk)          -> float32[ceil(n / chunk)]

``x`` may have any static shape (it is flattened).  ``k``, ``capacity``, ``chunk``,
``n``, ``ratio`` and ``seed`` are Python numbers (they fix the output shapes); ``t``
and ``scale`` may be tensors.

Two execution paths, chosen by a table (:data:`PATHS`):

* ``"cpu"`` -- ``tf.numpy_function`` around the Numba CPU kernels (TF hands over host
  buffers without a copy).
* ``"cuda"`` -- ``tf.py_function``: on a GPU the op is placed on the device, its input
  tensors stay there and are viewed through DLPack by the ``numba.cuda`` kernels
  (:func:`tfsparse.ops.cuda.as_device`); results are copied device-to-device into
  tensors TensorFlow allocates.  TF's and Numba's streams share the primary context,
  so the path synchronises the device before and after the kernels.  The dense
  gradient never leaves the GPU (gtopk-ssgd-shi2019 §III-F).

The default is ``"cuda"`` when TensorFlow sees a GPU and ``numba.cuda`` is usable, else
``"cpu"``; :func:`set_path` overrides it.  The gradient exchange's TF glue
(:meth:`tfsparse.exchange.GradientExchange.__call__`) follows the same choice, through
:func:`exchange_device`, :func:`device_ordinal`, :func:`device_views` and :func:`to_tensor`.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import _common as C
from . import _dispatch

_PATH: list = [None]  # chosen lazily (first op built), or by set_path


def _flat(x) -> tf.Tensor:
    x = tf.convert_to_tensor(x)
    if x.dtype != tf.float32:
        x = tf.cast(x, tf.float32)
    if not x.shape.is_fully_defined():
        raise ValueError(f"tfsparse.ops.tf needs a static shape, got {x.shape}")
    return tf.reshape(x, [-1])


def _size(x: tf.Tensor) -> int:
    return int(x.shape.num_elements())


def _check_graph():
    if not tf.executing_eagerly():
        from .._tf_private import reject_xla

        reject_xla("tfsparse.ops")


# ----------------------------------------------------------------------------- execution paths

def _numpy_path(name, inputs, tout, lead, static):
    fn = getattr(_dispatch.backend("cpu"), name)

    def run(*arrays):
        out = fn(*lead, *arrays, **static)
        return tuple(np.asarray(o) for o in out) if isinstance(out, tuple) else np.asarray(out)

    return tf.numpy_function(run, inputs, tout, stateful=False, name=f"tfsparse_{name}")


def to_tensor(value, dtype: tf.DType, device: str):
    """A device result as a TF tensor on ``device`` (device-to-device copy)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return tf.constant(value, dtype=dtype)
    mod = _dispatch.backend("cuda")
    if mod.SIMULATOR:  # the CUDA simulator's "device" arrays are host memory
        return tf.constant(value.copy_to_host(), dtype=dtype)
    with tf.device(device):
        out = tf.raw_ops.Empty(shape=tf.constant(value.shape, tf.int32), dtype=dtype, init=False)
    mod.sync()
    mod.as_device(out, dtype.as_numpy_dtype).copy_to_device(value)
    mod.sync()
    return out


def _cuda_path(name, inputs, tout, lead, static):
    mod = _dispatch.backend("cuda")
    fn = getattr(mod, name)
    touts = tout if isinstance(tout, (list, tuple)) else [tout]

    def run(*tensors):
        mod.sync()
        arrays = [mod.as_device(t, t.dtype.as_numpy_dtype) if t.shape.rank else t.numpy() for t in tensors]
        out = fn(*lead, *arrays, **static)
        outs = out if isinstance(out, tuple) else (out,)
        return [to_tensor(o, d, tensors[0].device) for o, d in zip(outs, touts)]

    res = tf.py_function(run, inputs, touts, name=f"tfsparse_{name}")
    return res if isinstance(tout, (list, tuple)) else res[0]


#: path name -> function(op name, input tensors, output dtype(s), leading static args, static kwargs) -> tensor(s)
PATHS = {"cpu": _numpy_path, "cuda": _cuda_path}


def _default_path() -> str:
    if not tf.config.list_logical_devices("GPU"):
        return "cpu"
    try:
        from numba import cuda
    except ImportError:
        return "cpu"
    return "cuda" if cuda.is_available() else "cpu"


def set_path(path: str | None) -> None:
    """Forces the execution path (``"cpu"`` or ``"cuda"``); ``None`` restores the default."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {sorted(PATHS)} or None, got {path!r}")
    _PATH[0] = path


def get_path() -> str:
    if _PATH[0] is None:
        _PATH[0] = _default_path()
    return _PATH[0]


def exchange_device(tensors) -> str | None:
    """Where a gradient exchange of ``tensors`` runs (:meth:`tfsparse.exchange.GradientExchange.__call__`):
    a TF device name for the ``"cuda"`` path -- the tensors' device when they are placed on a GPU,
    the first GPU TensorFlow sees when they are not placed (TF's own placement) -- or None for
    the host path (tensors placed on a CPU, or the ``"cpu"`` path).  Under Numba's CUDA
    simulator a forced ``"cuda"`` path runs on the CPU device, for the tests."""
    if get_path() != "cuda":
        return None
    named = next((t.device for t in tensors if getattr(t, "device", "")), "")
    if named:
        kind = tf.DeviceSpec.from_string(named).device_type
        return named if kind in (None, "GPU") or _dispatch.backend("cuda").SIMULATOR else None
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else "/device:CPU:0"


def device_ordinal(device: str) -> int:
    """The CUDA ordinal of TF device ``device`` -- the GPU its tensors' DLPack export names,
    which need not be the TF index (``tf.config.set_visible_devices``); 0 for a host device
    (the simulator)."""
    from ._dlpack import CUDA_DEVICE_TYPES

    with tf.init_scope(), tf.device(device):
        kind, ordinal = tf.zeros([1]).__dlpack_device__()
    return int(ordinal) if int(kind) in CUDA_DEVICE_TYPES else 0


def device_views(tensors) -> list:
    """Zero-copy float32 device views of TF tensors (DLPack, :func:`tfsparse.ops.cuda.as_device`),
    after the device finished the work that made them (TF's stream is not Numba's); host
    tensors are copied to the device (the simulator)."""
    mod = _dispatch.backend("cuda")
    mod.sync()
    return [mod.as_device(t, np.float32) for t in tensors]


def _op(name, inputs, tout, *lead, **static):
    _check_graph()
    return PATHS[get_path()](name, inputs, tout, lead, static)


# ----------------------------------------------------------------------------- ops

# the wrappers only build ops: autograph must not convert them (or the kernels' imports)
_graph_builder = tf.autograph.experimental.do_not_convert


@_graph_builder
def topk_abs(x, k):
    """Exact top-k by magnitude (:func:`tfsparse.ops.topk_abs`): int64[k] ascending, float32[k]."""
    x = _flat(x)
    k = C.check_k(k, _size(x))
    idx, val = _op("topk_abs", [x], [tf.int64, tf.float32], k=k)
    idx.set_shape([k])
    val.set_shape([k])
    return idx, val


@_graph_builder
def kth_largest_abs(x, k):
    """Exact k-th largest ``|x|`` (:func:`tfsparse.ops.kth_largest_abs`), float32 scalar."""
    x = _flat(x)
    k = C.check_k(k, _size(x))
    t = _op("kth_largest_abs", [x], tf.float32, k=k)
    t.set_shape([])
    return t


@_graph_builder
def sample_threshold(x, k, ratio=0.01, seed=0):
    """DGC sampled threshold (:func:`tfsparse.ops.sample_threshold`), float32 scalar."""
    x = _flat(x)
    k = C.check_k(k, _size(x))
    t = _op("sample_threshold", [x], tf.float32, k=k, ratio=float(ratio), seed=int(seed))
    t.set_shape([])
    return t


def _scalar_f32(t):
    return tf.reshape(tf.cast(tf.convert_to_tensor(t), tf.float32), [])


@_graph_builder
def select_threshold(x, t):
    """All ``|x| >= t`` packed (:func:`tfsparse.ops.select_threshold`): int64[None], float32[None]."""
    x = _flat(x)
    idx, val = _op("select_threshold", [x, _scalar_f32(t)], [tf.int64, tf.float32])
    idx.set_shape([None])
    val.set_shape([None])
    return idx, val


@_graph_builder
def hash_select(x, t, capacity, seed=0):
    """DRAGONN Alg. 1 (:func:`tfsparse.ops.hash_select`): int64[capacity] (-1 = empty), float32[capacity]."""
    x = _flat(x)
    capacity = C.check_capacity(capacity)
    idx, val = _op("hash_select", [x, _scalar_f32(t)], [tf.int64, tf.float32], capacity=capacity, seed=int(seed))
    idx.set_shape([capacity])
    val.set_shape([capacity])
    return idx, val


@_graph_builder
def scatter_add(n, idx, val):
    """Sparse decoding of concatenated payloads (:func:`tfsparse.ops.scatter_add`): float32[n]."""
    n = int(n)
    idx = tf.reshape(tf.convert_to_tensor(idx), [-1])
    if idx.dtype not in (tf.int32, tf.int64):
        idx = tf.cast(idx, tf.int64)
    val = tf.reshape(tf.cast(tf.convert_to_tensor(val), tf.float32), [-1])
    dense = _op("scatter_add", [idx, val], tf.float32, n)
    dense.set_shape([n])
    return dense


@_graph_builder
def quantize_int8(x):
    """Pipe-SGD 8-bit quantization (:func:`tfsparse.ops.quantize_int8`): int8[n], float32 scale."""
    x = _flat(x)
    q, scale = _op("quantize_int8", [x], [tf.int8, tf.float32])
    q.set_shape([_size(x)])
    scale.set_shape([])
    return q, scale


@_graph_builder
def dequantize_int8(q, scale):
    """``float32(q) * scale``: float32[n]."""
    q = tf.reshape(tf.convert_to_tensor(q, tf.int8), [-1])
    out = _op("dequantize_int8", [q, _scalar_f32(scale)], tf.float32)
    out.set_shape([_size(q)])
    return out


@_graph_builder
def truncate_fp16(x):
    """Pipe-SGD 16-bit truncation (:func:`tfsparse.ops.truncate_fp16`): float16[n]."""
    x = _flat(x)
    h = _op("truncate_fp16", [x], tf.float16)
    h.set_shape([_size(x)])
    return h


@_graph_builder
def chunk_l1_norms(x, chunk=32768):
    """GradientFlow CSC chunk norms (:func:`tfsparse.ops.chunk_l1_norms`): float32[ceil(n/chunk)]."""
    x = _flat(x)
    chunk = C.check_chunk(chunk)
    norms = _op("chunk_l1_norms", [x], tf.float32, chunk=chunk)
    norms.set_shape([C.num_chunks(_size(x), chunk)])
    return norms


__all__ = ["topk_abs", "kth_largest_abs", "sample_threshold", "select_threshold", "hash_select", "scatter_add",
           "quantize_int8", "dequantize_int8", "truncate_fp16", "chunk_l1_norms", "set_path", "get_path", "PATHS"]
