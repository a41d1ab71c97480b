"""Data helpers: equal-sized per-rank shards, so every rank runs the same number of steps; tf.data
pipelines without the autotuner's epoch-end stalls; and, for data of unknown length, a per-step
agreement that keeps the ranks in step when their data runs out at different steps."""
from __future__ import annotations

import numpy as np

from . import _checks, runtime


def shard(*arrays, rank: int | None = None, size: int | None = None, shuffle_seed: int | None = None,
          drop_remainder: bool = True):
    """This rank's shard of each array (the same rows of each): ``len // size`` rows on every rank.

    The remainder is dropped, so that every rank runs the same number of steps -- unless
    ``drop_remainder=False``, which keeps every row (for validation and evaluation data: the ranks
    average their metric states, ``SparseStrategy`` after every step and ``MetricAverage`` on the
    optimizer route, so the logged accuracy -- any metric that is a ratio of its states -- is the
    whole set's, each rank computing a ``size``-th of it; a metric that counts or sums logs its
    mean over the ranks).

    >>> x_local, y_local = tfsparse.data.shard(x, y)
    >>> x_val_local, y_val_local = tfsparse.data.shard(x_val, y_val, drop_remainder=False)

    Args:
      *arrays: arrays (anything with a length that numpy can index) of the same length.
      rank: the shard to take (default: this process's rank).
      size: the number of shards (default: the number of ranks).
      shuffle_seed: None: shards of consecutive rows; a seed: of rows in a random order, the same
        order on every rank that passes the same seed.
      drop_remainder: True: ``len % size`` rows are in no shard; False: the first ``len % size``
        ranks take one row more (their number of batches may then be one more than the others':
        :class:`~tfsparse.keras.callbacks.MetricAverage` evens that out for validation and
        evaluation data on the optimizer route, ``SparseStrategy`` by itself -- for training data
        it raises :class:`tfsparse.StepCountMismatch`).

    Returns:
      The shard of the one array, or a tuple of the shards of several.

    Raises:
      ValueError: no arrays, arrays of different lengths, fewer rows than ranks, or a
        ``drop_remainder`` that is not a bool.
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
    drop_remainder = _checks.choice("drop_remainder", drop_remainder, (True, False))
    order = np.arange(n) if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(n)
    extra = 0 if drop_remainder else n % size  # the first ``extra`` ranks take one more row
    start = rank * per + min(rank, extra)
    rows = order[start:start + per + (rank < extra)]
    out = tuple(np.asarray(a)[rows] for a in arrays)
    return out if len(out) > 1 else out[0]


def without_autotune(dataset):
    """``dataset`` with tf.data's autotuning off, unless its options already set ``autotune.enabled``.

    The user's choice stands. ``SparseStrategy`` applies it to every dataset Keras gives it; with
    ``DistributedOptimizer`` under Keras' default strategy, pass ``model.fit`` a dataset made with it.

    Why: the autotuner runs a model thread per iterator whose optimisation period doubles
    up to a minute, and destroying the iterator -- Keras
    does it at every epoch end, ``fit``'s end and before validation -- joins that thread.  With
    several ranks sharing the cores, the rank whose destructor waits for that thread was measured
    waiting out the period, every other rank blocked in its next step's exchange (docs/keras.md,
    "tf.data's autotuner is off under SparseStrategy").  Plain Keras
    has them too under ``mpirun -np 4`` on 2 cores, but a lone process stops there and nobody
    else waits.  Without the autotuner the stalls are gone and
    the in-memory pipelines Keras builds lose nothing measurable: ``prefetch(AUTOTUNE)`` and
    ``num_parallel_calls=AUTOTUNE`` fall back to fixed sizes.

    Args:
      dataset: a ``tf.data.Dataset``.

    Returns:
      The dataset with ``autotune.enabled = False`` in its options (``dataset`` itself where they
      set it).
    """
    import tensorflow as tf

    if dataset.options().autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


#: what a multi-rank ``fit``/``evaluate`` does when the ranks' datasets of unknown length run
#: out at different steps (:func:`agree_on_data`)
UNEVEN_POLICIES = ("end", "join", "error")


def check_uneven_policy(uneven_data) -> str:
    """``uneven_data`` checked to be one of :data:`UNEVEN_POLICIES`.

    Args:
      uneven_data: ``"end"``, ``"join"`` or ``"error"`` (see :func:`agree_on_data`).

    Returns:
      ``uneven_data`` itself.

    Raises:
      ValueError: for any other value, naming the accepted ones.
    """
    _checks.choice("uneven_data", uneven_data, UNEVEN_POLICIES, accepted=(
        "'end' (when one rank's data runs out, every rank ends the epoch at that step), 'join' (ranks that ran "
        "out contribute zero-weighted batches until every rank is done, as Horovod's join) or 'error' (raise "
        "StepCountMismatch)"))
    return uneven_data


class DataAgreement:
    """The per-step vote behind :func:`agree_on_data`: every rank says whether it has a batch for the next step.

    Under ``"end"`` and ``"error"`` the step runs when all have one, under ``"join"`` while any
    has one.

    Args:
      collective: runs ``fn(comm)`` over the ranks, for a function ``fn`` (the exchange's
        :meth:`~tfsparse.exchange.GradientExchange.run_collective`).
      policy: ``"end"`` (default), ``"join"`` or ``"error"``.
      what: ``"fit"`` (default), ``"validation"`` (fit's) or ``"evaluate"``, for the messages.

    Raises:
      ValueError: another ``policy``.
    """

    def __init__(self, collective, policy: str = "end", what: str = "fit"):
        self.collective = collective
        self.policy = check_uneven_policy(policy)
        self.what = what

    def __call__(self, step, has_data) -> bool:
        """Collective: whether the ranks take batch ``step`` (counted from the iterator's start)."""
        flag = np.array([1.0 if bool(has_data) else 0.0])
        have = [bool(f[0]) for f in self.collective(lambda comm: comm.allgather(flag))]
        if all(have):
            return True
        step = int(step)
        if not any(have):
            if step == 0:
                raise ValueError(f"no rank has any data for {self.what}: the dataset is empty on every rank")
            return False
        out = [r for r, h in enumerate(have) if not h]
        ranks = f"rank{'s' if len(out) > 1 else ''} {', '.join(map(str, out))}"
        if step == 0:
            raise runtime.StepCountMismatch(
                f"{ranks} ha{'ve' if len(out) > 1 else 's'} no data for {self.what} (an empty shard) while the other "
                f"ranks have some: give every rank data (tfsparse.data.shard)")
        if self.policy == "error":
            raise runtime.StepCountMismatch(
                f"{ranks} ran out of data after {step} batches while the other ranks still have some "
                f"(uneven_data='error'); give every rank the same number of batches, or use uneven_data='end' to "
                f"end the epoch on every rank at the shortest rank")
        return self.policy == "join"


def _unflagged(_step, flagged_element):
    return flagged_element[1]


def _weighted(element, weight: float):
    """A Keras ``(x, y[, sample_weight])`` element as ``(x, y, sample_weight * weight)`` (ones
    where it had none)."""
    import tensorflow as tf

    x, y, w = (tuple(element) + (None,))[:3]
    if w is None:
        w = tf.ones(tf.shape(tf.nest.flatten(y)[0])[:1], tf.float32)
    return x, y, w * tf.cast(weight, w.dtype)


MORE_TEST_STEPS = "tfsparse_more_test_steps"


def mark_last_batch(dataset, steps: int, more: int):
    """``dataset``'s ``steps`` batches, each paired with the number of test steps the other ranks
    still run after it: 0, but ``more`` after the last.

    For validation and evaluation data of known length where this rank has ``more`` batches
    fewer than the rank with the most: its last test step then takes part in ``more`` further
    averagings of the metric states, with its own unchanged (:class:`~tfsparse.SparseStrategy`
    reads the pairing with :func:`unmark`), so the ranks stay in step and the averaged metrics
    are the whole set's.  The pairing is part of the dataset, so it holds for every pass over it
    (``fit``'s validation each epoch) and for each dataset apart (an ``evaluate`` called inside
    ``fit``).

    Args:
      dataset: a ``tf.data.Dataset`` that Keras iterates whole, ``steps`` batches, in each pass.
      steps: its number of batches (at least 1).
      more: the number of test steps the ranks with the most batches run after its last.

    Returns:
      A ``tf.data.Dataset`` of ``(element, {MORE_TEST_STEPS: n})`` pairs.
    """
    import tensorflow as tf

    def count(n, times):
        return tf.data.Dataset.from_tensors({MORE_TEST_STEPS: tf.constant(n, tf.int64)}).repeat(times)

    return tf.data.Dataset.zip((dataset, count(0, steps - 1).concatenate(count(more, 1))))


def unmark(data):
    """An element of :func:`mark_last_batch`'s dataset taken apart.

    Args:
      data: what a test step is given: such an element, or any other.

    Returns:
      ``(element, n)``: the element as it was and the test steps the other ranks run after it; for
      any other ``data``, ``(data, None)``.
    """
    if type(data) is tuple and len(data) == 2 and isinstance(data[1], dict) and set(data[1]) == {MORE_TEST_STEPS}:
        return data[0], data[1][MORE_TEST_STEPS]
    return data, None


def agree_on_data(dataset, agreement: DataAgreement):
    """``dataset`` whose batches the ranks take together.

    Each batch is paired with ``True``, the data is followed by endless ``False`` fillers, and a ``take_while``
    asks ``agreement`` (one collective of a flag per rank and batch, with the batch's index since
    the iterator began) whether to go on.

    * ``"end"``: when some rank runs out, the iterator ends on every rank at that batch -- Keras
      ends the epoch there on every rank, so the ranks stay in step and no rank waits in a
      collective for one that has already moved on; the batches the other ranks had left are not
      used in that epoch.
    * ``"join"`` (Horovod's ``hvd.join``): the iterator goes on while any rank has data; a rank
      that ran out takes its epoch's first batch again with every sample weight 0 -- its gradient,
      and its part of the ``weighted_metrics``, are zero -- so the ranks with data train on all of
      it (the logged loss counts the batch's rows with a loss of 0, as Keras weights its loss
      tracker by batch size, and ``metrics=``, which ignore sample weights, count it at full
      weight).
      Elements must be Keras' ``(x, y)`` or ``(x, y, sample_weight)`` tuples; every batch gets a
      sample weight (ones where there was none, which changes no result).  Training steps on the
      repeated batch still update BatchNormalization's moving statistics of that rank.
    * ``"error"``: :class:`~tfsparse.runtime.StepCountMismatch` where some rank runs out.

    Elements must be (nests of) dense tensors.

    Args:
      dataset: a ``tf.data.Dataset`` of unknown length (Keras' ``(x, y[, sample_weight])`` elements
        under ``"join"``).
      agreement: the per-step vote (:class:`DataAgreement`), whose policy is ``"end"``, ``"join"``
        or ``"error"``.

    Returns:
      The ``tf.data.Dataset`` the ranks iterate in step.

    Raises:
      ValueError: elements that are not (nests of) dense tensors; under ``"join"``, elements that are
        not ``(x, y)`` or ``(x, y, sample_weight)`` tuples.
    """
    import tensorflow as tf

    spec = dataset.element_spec
    if not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(spec)):
        raise ValueError(f"a dataset of unknown length with non-dense elements ({spec}) cannot be agreed on per step; "
                         f"give every rank the same number of batches and set steps_per_epoch")
    if agreement.policy == "join":
        if type(spec) is not tuple or len(spec) not in (2, 3):
            raise ValueError(f"uneven_data='join' needs (x, y) or (x, y, sample_weight) elements (the batches of a "
                             f"rank that ran out are weighted 0); got elements {spec}")

        def flagged(*element):
            return tf.constant(True), _weighted(element, 1.0)

        def zero_weighted(*element):
            return tf.constant(False), _weighted(element, 0.0)

        tail = dataset.take(1).map(zero_weighted).repeat()
    else:
        filler = tf.nest.map_structure(lambda s: tf.zeros([0 if d is None else d for d in s.shape], s.dtype), spec)
        tail = tf.data.Dataset.from_tensors((tf.constant(False), filler)).repeat()
        if type(spec) is tuple:  # tf.data passes a tuple's items as arguments (other nests as one)
            def flagged(*element):
                return tf.constant(True), tuple(element)
        else:
            def flagged(element):
                return tf.constant(True), element

    def vote(step, flagged_element):
        go = tf.numpy_function(agreement, [step, flagged_element[0]], tf.bool, stateful=True,
                               name="tfsparse_data_agreement")
        go.set_shape([])
        return go

    both = dataset.map(flagged).concatenate(tail).enumerate()  # the step index restarts with each iterator
    return both.take_while(vote).map(_unflagged)
