"""Keras integration: :class:`DistributedOptimizer` and :mod:`tfsparse.keras.callbacks`."""
from . import callbacks, ownership
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "callbacks", "ownership"]
