"""The only module that touches TensorFlow's private distribute API.

SparseStrategy subclasses ``OneDeviceStrategy``/``OneDeviceExtended`` (one device
per process) and overrides a handful of hooks.  Those are private TF APIs, so
they are imported here alone, behind a version check.
"""
from __future__ import annotations

import tensorflow as tf

TESTED = ((2, 16), (2, 21))  # inclusive range of TF minor versions this module was tested with


def _check_version():
    major, minor = (int(p) for p in tf.__version__.split(".")[:2])
    if not TESTED[0] <= (major, minor) <= TESTED[1]:
        import warnings

        warnings.warn(f"tfsparse.SparseStrategy uses private tf.distribute hooks tested with TF "
                      f"{TESTED[0][0]}.{TESTED[0][1]}-{TESTED[1][0]}.{TESTED[1][1]}; found {tf.__version__}. "
                      f"If training misbehaves, use tfsparse.keras.DistributedOptimizer instead.",
                      RuntimeWarning, stacklevel=3)


_check_version()

from tensorflow.python.distribute import one_device_strategy as _one_device  # noqa: E402

OneDeviceStrategy = _one_device.OneDeviceStrategy
OneDeviceExtended = _one_device.OneDeviceExtended

from tensorflow.python.ops import control_flow_util as _control_flow_util  # noqa: E402


def in_xla_context() -> bool:
    """True while tracing a function that XLA will compile (``jit_compile=True``)."""
    return bool(_control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def reject_xla(what: str) -> None:
    if in_xla_context():
        raise ValueError(
            f"jit_compile=True is not supported with tfsparse: {what} runs MPI from Python "
            f"(tf.numpy_function), which XLA cannot compile. Use model.compile(..., jit_compile=False) "
            f"(the default under a distribution strategy and on CPU).")


def keras_epoch_steps(max_depth: int = 8):
    """Number of batches Keras will run for the dataset being distributed right now, or None.

    Keras' ``TFEpochIterator.__init__`` calls ``experimental_distribute_dataset``; its
    ``num_batches`` (``steps_per_epoch`` or the data adapter's count) is what every
    rank must agree on.  tf.data often reports unknown cardinality for Keras' array
    datasets, so the iterator is found on the call stack (read-only).
    """
    import sys

    try:
        from keras.src.trainers.epoch_iterator import EpochIterator
    except ImportError:
        return None
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, EpochIterator):
            steps = candidate.num_batches
            return int(steps) if steps is not None and steps >= 0 else None
        frame = frame.f_back
    return None
