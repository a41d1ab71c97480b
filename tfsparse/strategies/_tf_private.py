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
