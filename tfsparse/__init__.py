"""tfsparse: communication-efficient data-parallel training for TensorFlow 2 / Keras 3.

>>> import tfsparse
>>> tfsparse.init()
>>> strategy = tfsparse.SparseStrategy(algorithm="topk", density=0.01)

TensorFlow is only imported when a TF-facing name (SparseStrategy, keras) is used;
``tfsparse.collectives`` works on numpy alone.

``keras.models.load_model`` of a file with a ``tfsparse.keras.DistributedOptimizer`` works after a
plain ``import tfsparse``: tfsparse's Keras classes register with Keras' serialization as soon as
Keras is imported -- at once when it already is, otherwise through a one-shot import hook on the
top-level ``keras`` module (:mod:`tfsparse._keras_registration`) -- so that ``import tfsparse``
itself still imports neither Keras nor TensorFlow, and Keras is not patched.
"""
from importlib import import_module

from .runtime import init, is_initialized, local_rank, rank, size

__version__ = "0.1.0"

_LAZY = {
    "SparseStrategy": ("tfsparse.strategies", "SparseStrategy"),
    "GradientExchange": ("tfsparse.exchange", "GradientExchange"),
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


__all__ = ["init", "is_initialized", "rank", "size", "local_rank", "SparseStrategy", "GradientExchange",
           "keras", "collectives", "data", "schedules", "WarmUp", "__version__"]


# keras.models.load_model finds tfsparse's Keras classes after a plain `import tfsparse`: they are
# registered as soon as Keras is imported (at once if it already is), without importing it here
from ._keras_registration import install as _register_with_keras  # noqa: E402

_register_with_keras()
