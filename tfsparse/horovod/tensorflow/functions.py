"""Horovod's collectives on Python objects (``hvd.broadcast_object``, ``hvd.allgather_object``).

A script sends what is not a tensor this way: the epoch to resume from, a config, a dict of
metrics.  Each object is serialised with cloudpickle where it is installed (as Horovod does:
lambdas and local classes travel), else with the standard ``pickle``, and sent as bytes over the
job's communicator.  Eagerly only: the object is a Python value, not a tensor of a graph.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

try:  # Horovod's serialiser, where installed
    import cloudpickle as _pickle
except ImportError:  # pragma: no cover - the standard library's, for what it can serialise
    import pickle as _pickle


def _eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise ValueError(f"{what} sends a Python object: call it eagerly, outside a tf.function")


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=None):
    """``root_rank``'s ``obj`` on every rank (Horovod's ``hvd.broadcast_object``).

    Collective: every rank calls it; the other ranks' ``obj`` is ignored.

    Args:
      obj: on ``root_rank``, an object that can be pickled.
      root_rank: the rank whose object everyone gets, from 0 to ``size() - 1``.
      session: accepted and ignored (TensorFlow 1's session).
      name: accepted and ignored (Horovod's op name).
      process_set: only ``hvd.global_process_set`` (or None).

    Returns:
      ``root_rank``'s object (on ``root_rank``, ``obj`` itself).

    Raises:
      ValueError: ``root_rank`` not a rank of the job; inside a ``tf.function``; before ``init``.
    """
    from . import _check_process_set, _check_root, _comm

    _check_process_set(process_set)
    root = _check_root(root_rank)
    _eager("broadcast_object")
    comm = _comm()
    mine = np.frombuffer(_pickle.dumps(obj), np.uint8).copy() if comm.rank == root else None
    size = comm.bcast(np.array([0 if mine is None else mine.size], np.int64), root=root)
    data = comm.bcast(mine, root=root, shape=(int(size[0]),), dtype=np.uint8)
    return obj if comm.rank == root else _pickle.loads(data.tobytes())


def allgather_object(obj, session=None, name=None, process_set=None):
    """Every rank's ``obj``, in rank order (Horovod's ``hvd.allgather_object``).

    Collective: every rank calls it.

    Args:
      obj: an object that can be pickled.
      session: accepted and ignored (TensorFlow 1's session).
      name: accepted and ignored (Horovod's op name).
      process_set: only ``hvd.global_process_set`` (or None).

    Returns:
      A list of ``size()`` objects, rank 0's first (this rank's is a copy, as the others').

    Raises:
      ValueError: inside a ``tf.function``; before ``init``.
    """
    from . import _check_process_set, _comm

    _check_process_set(process_set)
    _eager("allgather_object")
    comm = _comm()
    parts = comm.allgather(np.frombuffer(_pickle.dumps(obj), np.uint8).copy())
    return [_pickle.loads(np.asarray(p, np.uint8).tobytes()) for p in parts]


NAMES = ("broadcast_object", "allgather_object")
"""The names this module provides, as ``horovod.tensorflow`` does."""
