"""Data helpers: equal-sized per-rank shards, so every rank runs the same number of steps; tf.data
pipelines without the autotuner's epoch-end stalls."""
from __future__ import annotations

import numpy as np

from . import runtime


def shard(*arrays, rank: int | None = None, size: int | None = None, shuffle_seed: int | None = None):
    """Returns this rank's shard of each array (same rows for all), dropping the remainder so
    that every rank gets exactly ``len // size`` rows.

    >>> x_local, y_local = tfsparse.data.shard(x, y)
    """
    if not arrays:
        raise ValueError("shard() needs at least one array")
    n = len(arrays[0])
    for a in arrays[1:]:
        if len(a) != n:
            raise ValueError(f"all arrays must have the same length; got {[len(a) for a in arrays]}")
    rank = runtime.rank() if rank is None else rank
    size = runtime.size() if size is None else size
    per = n // size
    if per == 0:
        raise ValueError(f"{n} rows cannot be split over {size} ranks")
    order = np.arange(n) if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(n)
    rows = order[rank * per:(rank + 1) * per]
    out = tuple(np.asarray(a)[rows] for a in arrays)
    return out if len(out) > 1 else out[0]


def without_autotune(dataset):
    """``dataset`` (a ``tf.data.Dataset``) with tf.data's autotuning off, unless its options
    already set ``autotune.enabled`` (the user's choice stands).  ``SparseStrategy`` applies it
    to every dataset Keras gives it; with ``DistributedOptimizer`` under Keras' default strategy,
    pass ``model.fit`` a dataset made with it.

    Why: the autotuner runs a model thread per iterator whose optimisation period doubles from
    10 ms up to a minute (10 ms * 2^n: 5.12 s, 10.24 s, ...), and destroying the iterator -- Keras
    does it at every epoch end, ``fit``'s end and before validation -- joins that thread.  With
    several ranks sharing the cores, the rank whose destructor waits for that thread was measured
    waiting out the period (4.4-10.2 s stalls at about half of the epoch boundaries, every other
    rank blocked in its next step's exchange; ``tools/bench_time_to_accuracy.py``).  Plain Keras
    has them too under ``mpirun -np 4`` on 2 cores, but a lone process stops there and nobody
    else waits.  Without the autotuner the stalls are gone (longest gap between steps 0.13 s) and
    the in-memory pipelines Keras builds lose nothing measurable: ``prefetch(AUTOTUNE)`` and
    ``num_parallel_calls=AUTOTUNE`` fall back to fixed sizes."""
    import tensorflow as tf

    if dataset.options().autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)
