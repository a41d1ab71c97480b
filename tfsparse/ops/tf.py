"""The TensorFlow side of :mod:`tfsparse.ops`: where a gradient exchange inside a TF graph runs.

Two execution paths (:data:`PATHS`):

* ``"cpu"`` -- the exchange's ops are ``tf.numpy_function`` ops on the host (TF hands over host
  buffers without a copy).
* ``"cuda"`` -- ``tf.py_function`` ops placed on the gradients' GPU: their input tensors stay
  there and are viewed through DLPack by the ``numba.cuda`` kernels
  (:func:`tfsparse.ops.cuda.as_device`, :func:`device_views`); results are copied
  device-to-device into tensors TensorFlow allocates (:func:`to_tensor`).  TF's and Numba's
  streams share the primary context, so the path synchronises the device before and after
  the kernels.  The dense gradient never leaves the GPU (gtopk-ssgd-shi2019 §III-F).

The default is ``"cuda"`` when TensorFlow sees a GPU and ``numba.cuda`` is usable, else
``"cpu"``; :func:`set_path` overrides it.  The gradient exchange's TF glue
(:meth:`tfsparse.exchange.GradientExchange.__call__`) follows that choice, through
:func:`exchange_device`, :func:`device_ordinal`, :func:`device_views` and :func:`to_tensor`.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import _checks
from . import _dispatch

_PATH: list = [None]  # chosen lazily (first exchange built), or by set_path


#: the execution paths (see the module docstring)
PATHS = ("cpu", "cuda")


def cuda_usable() -> bool:
    """Whether the ``"cuda"`` path can run here: the machine has a GPU TensorFlow can use and
    ``numba.cuda`` imports and finds one (a driver that fails to load counts as none).  It asks
    for the physical devices, which does not initialize TensorFlow's runtime (a script may still
    set memory growth or the visible devices after it).

    Returns:
      True when the CUDA kernels can run on a GPU here.
    """
    if not tf.config.list_physical_devices("GPU"):
        return False
    try:
        from numba import cuda
    except ImportError:
        return False
    try:
        return bool(cuda.is_available())
    except Exception:  # a driver that fails to load: no GPU for the kernels
        return False


def _default_path() -> str:
    return "cuda" if tf.config.list_logical_devices("GPU") and cuda_usable() else "cpu"


def set_path(path: str | None) -> None:
    """Forces the execution path (``"cpu"`` or ``"cuda"``); ``None`` restores the default.

    Args:
      path: ``"cpu"``, ``"cuda"`` or None.

    Raises:
      ValueError: any other value.
    """
    _checks.choice("path", path, PATHS + (None,))
    _PATH[0] = path


def get_path() -> str:
    """The execution path in use, ``"cpu"`` or ``"cuda"``: the one :func:`set_path` forced, else
    the default (``"cuda"`` when TensorFlow sees a GPU and ``numba.cuda`` is usable), chosen at the
    first call and kept.

    Returns:
      ``"cpu"`` or ``"cuda"``.
    """
    if _PATH[0] is None:
        _PATH[0] = _default_path()
    return _PATH[0]


def exchange_device(tensors) -> str | None:
    """Where a gradient exchange of ``tensors`` runs (:meth:`tfsparse.exchange.GradientExchange.__call__`):
    a TF device name for the ``"cuda"`` path -- the tensors' device when they are placed on a GPU,
    the first GPU TensorFlow sees when they are not placed (TF's own placement) -- or None for
    the host path (tensors placed on a CPU, or the ``"cpu"`` path).  Under Numba's CUDA
    simulator a forced ``"cuda"`` path runs on the CPU device, for the tests.

    Args:
      tensors: the gradients (TF tensors).

    Returns:
      A TF device name, or None.
    """
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
    (the simulator).

    Args:
      device: a TF device name.

    Returns:
      The CUDA ordinal, an int.
    """
    from ._dlpack import CUDA_DEVICE_TYPES

    with tf.init_scope(), tf.device(device):
        kind, ordinal = tf.zeros([1]).__dlpack_device__()
    return int(ordinal) if int(kind) in CUDA_DEVICE_TYPES else 0


def device_views(tensors) -> list:
    """Zero-copy float32 device views of TF tensors (DLPack, :func:`tfsparse.ops.cuda.as_device`),
    after the device finished the work that made them (TF's stream is not Numba's); host
    tensors are copied to the device (the simulator).

    Args:
      tensors: TF tensors (float32).

    Returns:
      A list of device arrays, one per tensor.
    """
    mod = _dispatch.backend("cuda")
    mod.sync()
    return [mod.as_device(t, np.float32) for t in tensors]


def to_tensor(value, dtype: tf.DType, device: str):
    """A device result as a TF tensor on ``device`` (device-to-device copy).

    Args:
      value: a device array (or a numpy array, made a constant as it is).
      dtype: the tensor's TF dtype.
      device: the TF device to place it on.

    Returns:
      A TF tensor.
    """
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


__all__ = ["exchange_device", "device_ordinal", "device_views", "to_tensor", "set_path", "get_path", "PATHS"]
