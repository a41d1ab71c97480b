"""Keeping the ranks' Keras state in step: the collective helpers the callbacks, the optimizer
wrapper, the strategy and custom training loops share.

* :func:`broadcast_variables` -- every rank takes ``root_rank``'s values;
* :func:`average_moving_statistics` -- BatchNormalization's moving statistics averaged over the
  ranks (:func:`moving_statistics` finds them);
* :func:`run_on_model` -- a collective over the model's exchange when it has one.

``tfsparse.keras.callbacks`` re-exports the two public functions under their documented names.
"""
from __future__ import annotations

import numpy as np
import keras
import tensorflow as tf

from .. import runtime
from ..collectives.agreement import check_agreement
from .ownership import exchange_of, own_ids, sparse_strategy_of


def broadcast_variables(variables, root_rank: int = 0, communicator=None) -> None:
    """Overwrites ``variables`` on every rank with ``root_rank``'s values (one broadcast per dtype).

    Collective: every rank calls it with the same variables (shapes and dtypes are compared
    first).

    Args:
      variables: Keras or TensorFlow variables (a model's ``variables``, an optimizer's).
      root_rank: the rank whose values everyone takes.
      communicator: the ranks to broadcast over (default: the world).

    Raises:
      tfsparse.ConfigurationMismatch: the ranks' variables differ in shape or dtype.
    """
    comm = communicator or runtime.communicator()
    variables = list(variables)
    if comm.size == 1 or not variables:
        return
    by_dtype: dict = {}
    for v in variables:
        by_dtype.setdefault(np.dtype(keras.backend.standardize_dtype(v.dtype)), []).append(v)
    check_agreement(comm, "the variables to broadcast",
                    [[list(v.shape), np.dtype(dt).name] for dt, vs in by_dtype.items() for v in vs],
                    "Every rank must build the same model (layer sizes, dtypes) and optimizer.")
    for dtype, vs in sorted(by_dtype.items(), key=lambda kv: kv[0].str):
        flat = np.concatenate([np.asarray(keras.ops.convert_to_numpy(v), dtype=dtype).reshape(-1) for v in vs])
        flat = comm.bcast(flat, root=root_rank)
        off = 0
        for v in vs:
            n = int(np.prod(v.shape, dtype=np.int64))
            v.assign(flat[off:off + n].reshape(v.shape))
            off += n


def average_moving_statistics(model, communicator=None) -> int:
    """Replaces the model's moving statistics by their mean over the ranks.

    The moving statistics are the non-trainable float weights of its trainable layers that
    training updates: BatchNormalization's moving mean and variance (one allreduce, in float64).
    Each rank computes them from its own batches, so they drift apart while the trainable
    weights stay identical.  ``fit`` averages them for you (under ``SparseStrategy`` after every
    step; with ``MetricAverage`` at each epoch's end); in a custom training loop call this once
    per epoch (or before saving or evaluating) on every rank:

    >>> for epoch in range(epochs):
    ...     for x, y in dataset:
    ...         train_step(x, y)          # with tfsparse.keras.DistributedOptimizer
    ...     tfsparse.keras.callbacks.average_moving_statistics(model)

    Args:
      model: a Keras model.
      communicator: the ranks to average over where the model has no exchange (default: the
        world); with one, the collective runs over it, after its rounds in flight.

    Returns:
      How many moving-statistics variables the model has (averaged where there are several ranks;
      0: none, and nothing is communicated).
    """
    weights = moving_statistics(model)
    comm = communicator or runtime.communicator()
    if comm.size > 1 and weights:
        values = _float64(weights)
        flat = np.concatenate([x.reshape(-1) for x in values])
        _assign(weights, values, run_on_model(model, lambda c: c.allreduce(flat), comm) / comm.size)
    return len(weights)


def average_moving_statistics_off_strategy(model) -> None:
    """:func:`average_moving_statistics` where ``model`` trains outside a ``SparseStrategy`` (whose
    step averages them already): before a checkpoint or backup is written, so that the file holds
    the ranks' mean and every rank goes on from it.  Averaging values the ranks hold alike changes
    no bit (their float64 sum divided by the ranks is each value).  Collective.

    Args:
      model: a Keras model.
    """
    if sparse_strategy_of(model) is None:
        average_moving_statistics(model)


def run_on_model(model, fn, communicator=None):
    """``fn(comm)`` over the model's exchange when the model has one, else over ``communicator``.

    Over the exchange it runs on the exchange's communication thread, after its rounds in flight.

    Args:
      model: a Keras model (trained under ``SparseStrategy`` or ``DistributedOptimizer``, or not).
      fn: a collective: a function of a communicator.
      communicator: where the model has no exchange (default: the world).

    Returns:
      What ``fn`` returns.
    """
    exchange = exchange_of(model)
    return exchange.run_collective(fn) if exchange is not None else fn(communicator or runtime.communicator())


def _float64(variables) -> list:
    return [np.asarray(keras.ops.convert_to_numpy(v), np.float64) for v in variables]


def _assign(variables, values, flat) -> None:
    """Each of ``variables`` (shaped as ``values``, their float64 copies) takes its part of the
    concatenated ``flat``, cast to its own dtype."""
    off = 0
    for v, x in zip(variables, values):
        v.assign(flat[off:off + x.size].reshape(x.shape).astype(keras.backend.standardize_dtype(v.dtype)))
        off += x.size


def moving_statistics(model) -> list:
    """The non-trainable float weights of the model's trainable leaf layers.

    What a train step updates besides the trainable weights (BatchNormalization's moving mean
    and variance); each rank computes them from its own batches, so they are averaged with the
    step's metrics.  A frozen layer (``trainable=False``) is left out: its weights do not change.
    So is a variable each rank keeps as its own (:func:`~tfsparse.keras.ownership.keep_own`:
    Horovod's ``BroadcastGlobalVariablesCallback(local_variables=...)``): it is not averaged.

    Args:
      model: a Keras model (nested models and layers are searched).

    Returns:
      A list of the variables, in the order of the layers.
    """
    out, seen, stack, own = [], set(), [model], own_ids(model)
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        children = list(getattr(layer, "layers", None) or [])
        if children:
            stack.extend(reversed(children))
        elif getattr(layer, "trainable", False):
            out += [w for w in layer.non_trainable_weights if tf.as_dtype(w.dtype).is_floating and id(w) not in own]
    return out
