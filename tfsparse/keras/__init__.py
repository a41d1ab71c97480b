"""Keras integration: :class:`DistributedOptimizer` and :mod:`tfsparse.keras.callbacks`,
:func:`load_model` / :func:`load_weights` (a truncated file named as such)."""
from .. import runtime
from . import callbacks, ownership, replicas
from .optimizer import DistributedOptimizer
from .replicas import ReplicasDiverged, check_replicas
from .saving import load_model, load_weights

__all__ = ["DistributedOptimizer", "callbacks", "ownership", "replicas", "ReplicasDiverged", "check_replicas",
           "load_model", "load_weights"]

runtime.quiet_keras()  # a worker rank initialised before Keras was imported
