"""tfsparse: communication-efficient data-parallel training for TensorFlow 2 / Keras 3.

>>> import tfsparse
>>> tfsparse.init()
>>> strategy = tfsparse.SparseStrategy(algorithm="topk", density=0.01)

TensorFlow is only imported when a TF-facing name (SparseStrategy, keras) is used;
``tfsparse.collectives`` works on numpy alone.

tfsparse's Keras classes register with Keras' serialization when :mod:`tfsparse.keras` is
imported -- by ``import tfsparse.keras``, by any use of ``tfsparse.keras`` or of
``tfsparse.SparseStrategy`` -- so ``keras.models.load_model`` of a file with a
``tfsparse.keras.DistributedOptimizer`` needs one of them first (Keras itself never imports a
module named in a model file outside its own packages); ``import tfsparse`` alone imports neither
Keras nor TensorFlow.
"""
from importlib import import_module

from ._version import __version__
from .collectives.agreement import ConfigurationMismatch
from .runtime import StepCountMismatch, init, is_initialized, local_rank, rank, size


_LAZY = {
    "SparseStrategy": ("tfsparse.strategies", "SparseStrategy"),
    "GradientExchange": ("tfsparse.exchange", "GradientExchange"),
    "Pipelined": ("tfsparse.pipelined", "Pipelined"),
    "Settings": ("tfsparse.settings", "Settings"),
    "keras": ("tfsparse.keras", None),
    "strategies": ("tfsparse.strategies", None),
    "collectives": ("tfsparse.collectives", None),
    "data": ("tfsparse.data", None),
    "ops": ("tfsparse.ops", None),
    "schedules": ("tfsparse.schedules", None),
    "WarmUp": ("tfsparse.schedules", "WarmUp"),
}


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'tfsparse' has no attribute {name!r}")


__all__ = ["init", "is_initialized", "rank", "size", "local_rank", "ConfigurationMismatch", "StepCountMismatch", "SparseStrategy", "GradientExchange",
           "Pipelined", "Settings", "keras", "collectives", "data", "schedules", "WarmUp", "__version__"]
