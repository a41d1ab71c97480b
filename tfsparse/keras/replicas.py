"""Identical replicas, checked: a digest of every weight and optimizer variable, compared across
the ranks, so that ranks that drift apart are never silent.

A variable's digest is two 64-bit sums of its raw bits taken as 32-bit words -- the plain sum
and the sum weighted by each word's position (mod 65521, plus one) -- modulo 2**64: the same
bits give the same digest whatever the order of summation, a single flipped bit always changes
it, and two words swapped change the weighted sum.  Comparing the digests costs one small
allgather; reading the variables is one pass over them.

* :func:`check_replicas` -- on demand, on every rank (a collective), e.g. before saving;
* :class:`tfsparse.keras.callbacks.ReplicaCheck` -- at each epoch's end, on any route;
* under ``SparseStrategy``, ``fit`` checks by itself at the end of every epoch whose length is
  known (folded into the step's metric averaging); a ``DistributedOptimizer`` checks at the end
  of every ``fit``.

Either way every rank raises the same :class:`ReplicasDiverged`, naming the first variable whose
bits differ and the ranks that differ from rank 0.
"""
from __future__ import annotations

import numpy as np

from .. import runtime
from ..ops import cpu
from .ownership import own_ids


class ReplicasDiverged(RuntimeError):
    """Some variable holds different bits on different ranks (the replicas trained apart)."""


def digest(value) -> np.ndarray:
    """``[sum, weighted sum]`` (uint64, mod 2**64) of the raw bits of ``value`` as 32-bit words.

    Args:
      value: an array (any dtype; its bytes are padded with zeros to a multiple of 4).

    Returns:
      A uint64 array of two elements.
    """
    raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, np.uint8)])
    return cpu.word_sums(raw.view(np.uint32))


def digests(values) -> np.ndarray:
    """The :func:`digest` of each of ``values``, one row each, as int64.

    The same bits, as every transport sends them (Horovod's allgather takes no uint64).

    Args:
      values: arrays.

    Returns:
      An int64 array of shape ``[len(values), 2]``.
    """
    return np.array([digest(v) for v in values], np.uint64).reshape(len(values), 2).view(np.int64)


def compare(names, gathered, what: str = "") -> None:
    """Raises :class:`ReplicasDiverged` when the ranks' digests differ.

    The message names the first variable (of ``names``) that differs, and the ranks whose bits
    differ from rank 0's.

    Args:
      names: the variables' names, in the order of the digests.
      gathered: every rank's :func:`digests` array (flat or not), in rank order.
      what: when the check ran, for the message (e.g. ``"after epoch 3"``).

    Raises:
      ReplicasDiverged: some variable's digests differ between ranks.
    """
    rows = [np.asarray(d).reshape(len(names), -1) for d in gathered]  # an allgather sends them flat
    for i, name in enumerate(names):
        ranks = [r for r, d in enumerate(rows) if not np.array_equal(d[i], rows[0][i])]
        if ranks:
            others = sum(1 for j in range(len(names)) if any(not np.array_equal(d[j], rows[0][j]) for d in rows))
            raise ReplicasDiverged(
                f"the replicas differ{' ' + what if what else ''}: variable {name!r} holds other bits on "
                f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} than on rank 0 "
                f"({others} of {len(names)} variables differ). Every rank must apply the same update: "
                f"please report it with the model, optimizer and settings")


def variables_of(model, optimizers=()) -> list:
    """Every weight of ``model`` (trainable or not) and every variable of its optimizers, each once,
    except those each rank keeps as its own (:func:`~tfsparse.keras.ownership.keep_own`).

    Args:
      model: a Keras model (its ``optimizer`` is included where it has one).
      optimizers: more optimizers whose variables to include.

    Returns:
      A list of variables: the model's weights first.
    """
    found, seen = [], own_ids(model)
    opts = [getattr(model, "optimizer", None), *optimizers]
    for v in list(model.weights) + [v for o in opts if o is not None for v in o.variables]:
        if id(v) not in seen:
            seen.add(id(v))
            found.append(v)
    return found


def name_of(variable) -> str:
    """The name a replica check gives ``variable``: its ``path`` (Keras 3), else its ``name``.

    Args:
      variable: a Keras or TensorFlow variable.

    Returns:
      The name as a string (``"?"`` when the variable has neither).
    """
    return str(getattr(variable, "path", None) or getattr(variable, "name", "?"))


def check_replicas(model, optimizers=(), communicator=None, what: str = "") -> int:
    """Collective (every rank calls it at the same point): compares a digest of every weight of
    ``model`` and every variable of its optimizer (and of ``optimizers``) across the ranks, and
    raises :class:`ReplicasDiverged` on every rank when some variable's bits differ anywhere.
    Runs over the model's exchange (after its rounds in flight) when it has one, else over
    ``communicator``.

    Args:
      model: a built Keras model.
      optimizers: further optimizers whose variables are compared too (the model's own
        optimizer always is).
      communicator: over which ranks, where the model has no exchange (default: the world).
      what: a few words naming the moment, put in the error's message (e.g. ``"after epoch 3"``).

    Returns:
      How many variables it compared.

    Raises:
      ReplicasDiverged: on every rank, naming the first variable whose bits differ, the ranks
        where they differ from rank 0's, and how many variables differ.
    """
    import keras

    from .sync import run_on_model

    variables = variables_of(model, optimizers)
    comm = communicator or runtime.communicator()
    if comm.size == 1:
        return len(variables)
    mine = digests([keras.ops.convert_to_numpy(v) for v in variables])
    gathered = run_on_model(model, lambda c: c.allgather(mine), comm)
    compare([name_of(v) for v in variables], gathered, what)
    return len(variables)
