"""Keras integration: :class:`DistributedOptimizer` and :mod:`tfsparse.keras.callbacks`."""
from . import callbacks
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "callbacks"]
