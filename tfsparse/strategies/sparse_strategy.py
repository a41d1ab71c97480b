"""SparseStrategy: a ``tf.distribute.Strategy`` with one replica per process whose
gradient all-reduce is a sparse allreduce.

Keras 3 reduces gradients through ``tf.distribute.get_replica_context().all_reduce``,
which reaches ``StrategyExtended._batch_reduce_to`` with all of a step's gradients in
one call.  :class:`SparseExtended` overrides

* ``_num_replicas_in_sync`` — the world size, so Keras scales the loss by 1/P and
  the SUM of the exchange is the mean gradient;
* ``_batch_reduce_to`` — the exchange (:mod:`tfsparse.tf_glue` over a
  :class:`~tfsparse.pipelined.Pipelined` :class:`~tfsparse.exchange.GradientExchange`): the
  strategy's own, or the one it adopted from a ``DistributedOptimizer`` with settings of its
  own built in its scope (:mod:`tfsparse.keras.ownership`);
* ``_create_variable`` — every variable created in the scope starts from rank 0's
  value (a broadcast: variable creation in the scope is a collective);
* ``_experimental_distribute_dataset`` — returns the dataset (each rank feeds its own shard)
  with tf.data's autotuner off (:func:`without_autotune`: its thread made epoch boundaries
  stall for seconds) and records its length for the step-count agreement (and, for
  ``fit`` with ``pipeline=2``, tells the exchange where epochs end, so that an epoch's last
  pipelined round is finished before the epoch's callbacks, validation and checkpoints run);
* ``_call_for_each_replica`` — after every train/test step, averages the metric
  states across ranks, so every rank logs the same loss and metrics.  The averaging runs on
  the model's exchange's communication thread, after the step's gradient buckets and over the
  same communicator, fused with the first step's step-count agreement into one allreduce.

The strategy is also a Keras saveable: a model built in its scope saves the exchange's state
(every rank's residual, the aggregators' state; :mod:`tfsparse.checkpoint`) in its ``.keras``
file, and loading the file in the scope restores it -- unless a ``DistributedOptimizer`` owns
the exchange, which then saves it itself.
"""
from __future__ import annotations

import functools
import weakref

import numpy as np
import tensorflow as tf

from .. import runtime
from .._tf_private import (KerasSaveable, OneDeviceExtended, OneDeviceStrategy, call_for_each_replica,
                           check_extended_hooks, keras_build_before_evaluate, keras_distributing, keras_epoch_steps,
                           keras_optimizer_applying, keras_replica_call, keras_steps_given, mixes_strategies,
                           optimizer_variables, reject_xla)
from ..checkpoint import Checkpointer
from ..collectives.agreement import check_agreement
from ..data import DataAgreement, agree_on_data, check_uneven_policy, mark_last_batch, unmark, without_autotune
from ..exchange import GradientExchange
from ..pipelined import Pipelined
from ..settings import Settings
from ..keras.ownership import check_optimizer, fit_optimizer
from ..keras.replicas import compare, digests, name_of, variables_of
from ..keras.sync import moving_statistics
from ..tf_glue import check_float_variables, exchange_tensors, loss_scaled
from ..runtime import StepCountMismatch, check_step_counts, raise_on_uneven_counts  # noqa: F401  (StepCountMismatch: public here too)

check_extended_hooks()  # the OneDeviceExtended hooks SparseExtended overrides exist in this TensorFlow


class SparseExtended(OneDeviceExtended):
    """The ``OneDeviceExtended`` of :class:`SparseStrategy` (overrides: the module docstring).

    Args:
      container: the :class:`SparseStrategy` it extends.
      device: the device of its one replica.
      exchange: the exchange (a :class:`~tfsparse.pipelined.Pipelined`) its gradient all-reduce runs.
      uneven_data: as :class:`SparseStrategy`'s.
    """

    def __init__(self, container, device, exchange: Pipelined, uneven_data: str = "end"):
        super().__init__(container, device)
        self.exchange = exchange
        self.uneven_data = uneven_data
        self.checkpointer = Checkpointer(exchange)
        self.saved_by_optimizer = False  # a DistributedOptimizer owns the exchange (and saves its state)
        self._names = None  # the variable paths of the model whose train step was traced last
        self._metric_vars: list = []
        self._pending_steps = None
        self._reduced = None  # a LossScaleOptimizer step's exchanged gradients (see _agreed_finite)
        # the replica check at each epoch's end in fit: the epoch's length (0: unknown) and the
        # train steps run since the epoch began (tf.Variables, made at the first fit), and the
        # names of the variables the traced step compares
        self._epoch = None
        self._check_names: list = []
        # every set of gradients reduced so far whose optimizer lives: (the optimizer, held weakly;
        # the gradients' names and shapes; their exchange), see _exchange_for
        self._sets: list = []

    # -- world ------------------------------------------------------------
    @property
    def _num_replicas_in_sync(self):
        return self.exchange.comm.size

    def _in_multi_worker_mode(self):
        return False

    # -- variables --------------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        comm = self.exchange.comm
        if comm.size > 1:
            kwargs = _broadcast_initial_value(comm, kwargs)
        var = super()._create_variable(next_creator, **kwargs)
        if kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ:
            self._metric_vars.append(var)
        return var

    # -- data -------------------------------------------------------------
    def _experimental_distribute_dataset(self, dataset, options):
        steps = keras_epoch_steps()
        if steps is None and tf.executing_eagerly():
            card = int(dataset.cardinality().numpy())
            steps = card if card >= 0 else None
        running = keras_distributing()
        if running == "fit":  # not its validation data: the epochs are the training data's batches
            self.exchange.mark_epochs(steps)
            self._start_epochs(steps)
        self._pending_steps = None
        if self.exchange.comm.size > 1 and running in ("fit", "validation", "evaluate") and tf.executing_eagerly():
            dataset = self._agree_on_steps(dataset, steps, running)
        else:
            self._pending_steps = steps  # compared at the first step, fused with its metric averaging
        return without_autotune(dataset)

    def _start_epochs(self, steps) -> None:
        """A ``fit`` begins with epochs of ``steps`` train steps (None: unknown): the traced
        step compares the replicas after every ``steps``-th step (:meth:`_epoch_end_digests`)."""
        if not tf.executing_eagerly():
            return
        if self._epoch is None:
            with tf.init_scope():
                self._epoch = (tf.Variable(0, dtype=tf.int64, trainable=False, name="tfsparse_epoch_steps"),
                               tf.Variable(0, dtype=tf.int64, trainable=False, name="tfsparse_epoch_step"))
        self._epoch[0].assign(int(steps or 0))
        self._epoch[1].assign(0)

    def _agree_on_steps(self, dataset, steps, running: str):
        """Before ``fit``/``evaluate`` iterates: the ranks compare the exchange's settings and
        their numbers of batches (two small allgathers, here on the caller's thread, so that a
        ``ConfigurationMismatch`` or :class:`StepCountMismatch` reaches the caller as itself).
        Known on every rank: :func:`_evened_out`; unknown on some rank: every rank's dataset votes
        before each batch (:func:`tfsparse.data.agree_on_data`, under the ``uneven_data`` policy)."""
        self.exchange.agree_on_settings()  # a ConfigurationMismatch reaches the caller as itself
        mine = np.array([-1 if steps is None else steps, keras_steps_given()], np.int64)
        gathered = [(int(c[0]), bool(c[1])) for c in self.exchange.run_collective(lambda c: c.allgather(mine))]
        if min(count for count, _ in gathered) >= 0:
            return _evened_out(dataset, steps, gathered, running)
        return agree_on_data(dataset, DataAgreement(runtime.held_weakly(self._run_collective), self.uneven_data, running))

    def _run_collective(self, fn):
        """``fn(comm)`` on the exchange's communication thread (the exchange this strategy has now)."""
        return self.exchange.run_collective(fn)

    # -- gradient exchange ------------------------------------------------
    def adopt(self, exchange: Pipelined, checkpointer: Checkpointer) -> None:
        """A ``DistributedOptimizer`` built in this strategy's scope owns the exchange from now on:
        its own (settings of its own: the strategy runs it) or the strategy's; it saves the state."""
        self.exchange, self.checkpointer = exchange, checkpointer
        self.saved_by_optimizer = True

    def _trace_train_step(self, model) -> None:
        """At the trace of ``model``'s train step: its optimizers are checked against the exchange
        (``memory="momentum"`` or ``"momentum_rows"`` with an optimizer's own momentum raises) and its trainable
        variables name the gradients."""
        optimizer = getattr(model, "optimizer", None)
        check_optimizer(self.exchange, optimizer)
        if getattr(optimizer, "gradient_accumulation_steps", None):
            # Keras exchanges the accumulated gradient inside a tf.cond, once per applied update;
            # TensorFlow orders that cond after nothing else of the step, so the metric averaging
            # takes a communicator and thread of its own instead of queueing behind the buckets
            self.exchange.engine.request_side_channel()
        self._names = [str(v.path) for v in model.trainable_variables]

    def _names_for(self, values, optimizer=None):
        """The gradients' names: the paths of the variables ``optimizer`` was built for, else of
        the traced model's trainable variables, where there are as many; else None."""
        for variables in (optimizer_variables(optimizer), self._names or []):
            if len(variables) == len(values):
                return [v if isinstance(v, str) else name_of(v) for v in variables]
        return None

    def _exchange_for(self, values):
        """At the trace of a reduction of the gradients ``values``: ``(exchange, names,
        carry_from)`` -- the set's exchange, the gradients' names (None: unknown) and, for a set
        new to a built exchange, the exchange whose memory it takes over once built (:func:`_carry`).

        Each set of gradients has an exchange of its own, kept while its optimizer lives: a set is
        the optimizer that applies them (the innermost on the call stack: a GAN's two optimizers
        are two sets) with their names and shapes (a model whose trainable set changed -- layers
        frozen or unfrozen, compiled again -- is another set).  The first set takes the
        strategy's exchange (or the one a ``DistributedOptimizer`` gave it); a later set gets a
        new exchange with the same settings, which takes over the memory of every tensor it
        shares with the set trained before it (:meth:`GradientExchange.carry_memory`), and
        becomes the strategy's :attr:`exchange` (what callbacks, checkpoints and the metric
        averaging use) whenever its set is traced."""
        optimizer = keras_optimizer_applying()
        names = self._names_for(values, optimizer)
        current = self.exchange
        key = (tuple(names or ()), tuple(tuple(v.shape.as_list()) for v in values))
        self._sets, exchange = _find_set(self._sets, optimizer, key, current)
        carry_from = None
        if exchange is None:
            if current.layout is None and all(e is not current for _, _, e in self._sets):
                exchange = current
            else:
                exchange = Pipelined(GradientExchange(settings=current.requested, communicator=current.comm))
                exchange.density, exchange.schedule = current.density, current.schedule
                exchange.engine.inherit_choice(current.engine)
                if current.engine.side_channel and exchange.depth == 1:
                    exchange.engine.request_side_channel()
                carry_from = current if names is not None and current.layout is not None else None
            self._sets.append((_weakly(optimizer), key, exchange))
        fit_optimizer(exchange, optimizer)
        if exchange is not current:
            steps = (current.sync_points or (None, None))[1]
            exchange.mark_epochs(steps)
            self.exchange = exchange
            if not self.saved_by_optimizer:
                self.checkpointer = Checkpointer(exchange)
        return exchange, names, carry_from

    def _agreed_finite(self, loss_scaler, grads):
        """Keras' ``LossScaleOptimizer.check_finite`` under this strategy: it would test each
        rank's own gradients, and a rank that overflowed would skip the step (and its
        all-reduce) alone while the others wait for it.  Here the exchange runs first, on the
        unscaled gradients of every rank, whatever they hold: a bucket that is not finite on
        some rank is skipped on every rank and returns NaN (``GradientExchange.on_nonfinite("nan")``),
        so the test below -- on the exchanged sum, identical on every rank -- agrees everywhere:
        all ranks apply the step, or all skip it and halve their loss scale.  The summed
        gradients are kept for the all-reduce that the finite branch then asks for."""
        values = [g for g in grads if g is not None]
        check_float_variables(values)
        exchange, names, carry_from = self._exchange_for(values)
        check_optimizer(exchange, loss_scaler)
        self._reduced = loss_scaled(exchange, values, loss_scaler.dynamic_scale, names)
        _carry(exchange, carry_from)
        return loss_scaler.check_finite(self._reduced)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        values = [v for v, _ in value_destination_pairs]
        if self._reduced is not None and len(self._reduced) == len(values):
            # the unscaled gradients that _agreed_finite already exchanged in this step
            reduced, self._reduced = self._reduced, None
        else:
            check_float_variables(values)
            exchange, names, carry_from = self._exchange_for(values)
            reduced = exchange_tensors(exchange, values, names=names)
            _carry(exchange, carry_from)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            p = float(self.exchange.comm.size)
            reduced = [r / tf.cast(p, r.dtype) for r in reduced]
        return reduced

    def _reduce_to(self, reduce_op, value, destinations, options):
        # strategy.reduce(...) of a non-gradient value: dense, deterministic allreduce.
        value = tf.convert_to_tensor(value)
        if self.exchange.comm.size == 1:
            return value
        comm = self.exchange.comm

        def _np(x):
            out = comm.allreduce(np.asarray(x, dtype=np.float64))
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                out = out / comm.size
            return out

        out = tf.numpy_function(_np, [tf.cast(value, tf.float64)], tf.float64, stateful=True)
        out.set_shape(value.shape)
        return tf.cast(out, value.dtype)

    # -- per-step metric agreement ----------------------------------------
    def _call_for_each_replica(self, fn, args, kwargs):
        name, owner = keras_replica_call(fn)
        if name == "check_finite":
            return self._agreed_finite(owner, *args, **(kwargs or {}))
        if name == "train_step" and owner is not None:
            self._trace_train_step(owner)
        data, more = unmark(args[0]) if name == "test_step" and args else (None, None)
        outputs = call_for_each_replica(self, fn, args if more is None else (data, *args[1:]), kwargs)
        if name in ("train_step", "test_step") and self.exchange.comm.size > 1:
            model = owner if name == "train_step" else None
            outputs = self._sync_step(outputs, moving_statistics(model) if model is not None else [], model, more)
        return outputs

    def _sync_step(self, outputs, moving=(), model=None, more=None):
        """Averages, after the step, the metric states, the step's scalar outputs and
        ``moving`` -- the model's non-trainable float weights that training updates (BatchNorm's
        moving mean and variance) -- across ranks, in one allreduce; after an epoch's last step
        of ``model``'s training, also compares its replicas (:meth:`_epoch_end_digests`).  A test
        step with ``more`` (a tensor) takes part in that many more averagings (:func:`_then_more`)."""
        reject_xla("the per-step metric averaging")
        flat = tf.nest.flatten(outputs)
        out_pos = [i for i, o in enumerate(flat)
                   if isinstance(o, tf.Tensor) and o.dtype.is_floating and o.shape.rank == 0]
        mvars = list(self._metric_vars) + [v for v in moving if all(v is not m for m in self._metric_vars)]
        pieces = [tf.reshape(tf.cast(tf.convert_to_tensor(v), tf.float64), [-1]) for v in mvars]
        pieces += [tf.reshape(tf.cast(flat[i], tf.float64), [-1]) for i in out_pos]
        end, digest = self._epoch_end_digests(model, mvars)
        if not pieces and end is None and more is None:
            return outputs
        sizes = [int(p.shape.num_elements()) for p in pieces]
        with tf.control_dependencies([flat[i] for i in out_pos]):
            packed = tf.concat(pieces, axis=0) if pieces else tf.zeros([0], tf.float64)
        sync = runtime.held_weakly(self._sync_np)
        extra = [] if end is None else [end, digest]
        if more is not None:
            sync, extra = functools.partial(_then_more, sync), [more]
        synced = tf.numpy_function(sync, [packed, *extra], tf.float64, stateful=True, name="tfsparse_metric_sync")
        synced.set_shape(packed.shape)
        if not pieces:
            return outputs
        parts = tf.split(synced, sizes)
        assigns = [v.assign(tf.reshape(tf.cast(p, v.dtype), v.shape)) for v, p in zip(mvars, parts)]
        with tf.control_dependencies(assigns):
            for j, i in enumerate(out_pos):
                flat[i] = tf.identity(tf.cast(tf.reshape(parts[len(mvars) + j], []), flat[i].dtype))
        return tf.nest.pack_sequence_as(outputs, flat)

    def _epoch_end_digests(self, model, averaged=()):
        """At the trace of ``model``'s train step (None: no train step): ``(end, digest)``, a
        boolean tensor that is true after the last step of an epoch of known length and, then,
        the :func:`~tfsparse.keras.replicas.digests` of every weight and optimizer variable
        (read after the step's updates: TensorFlow orders a variable's reads after its writes)
        but ``averaged`` (what the step's allreduce replaces by its mean: BatchNormalization's
        moving statistics), zeros otherwise; ``(None, None)`` without a model or outside ``fit``."""
        if model is None or self._epoch is None:
            return None, None
        variables = [v for v in variables_of(model) if all(v is not a for a in averaged)]
        self._check_names = [name_of(v) for v in variables]
        steps, step = self._epoch
        n = step.assign_add(1)
        end = tf.logical_and(steps > 0, tf.equal(n % tf.maximum(steps, 1), 0))

        def digest():
            out = tf.numpy_function(lambda *values: digests(values),
                                    [tf.convert_to_tensor(v) for v in variables], tf.int64, stateful=True,
                                    name="tfsparse_replica_digest")
            out.set_shape([len(variables), 2])
            return out

        return end, tf.cond(end, digest, lambda: tf.zeros([len(variables), 2], tf.int64))

    def _sync_np(self, packed, end=False, digest=None):
        steps, self._pending_steps = self._pending_steps, None
        names = self._check_names

        def average(comm):
            gathered = comm.allgather(digest) if end else None
            if steps is None:
                return comm.allreduce(packed) / comm.size, gathered
            # the step-count agreement rides along: equal counts <=> P * sum(s^2) == (sum s)^2
            total = comm.allreduce(np.concatenate([packed, [steps, float(steps) ** 2]]))
            if comm.size * total[-1] != total[-2] ** 2:
                check_step_counts(comm, steps)
            return total[:-2] / comm.size, gathered

        averaged, gathered = self.exchange.run_collective(average)
        if gathered is not None:
            compare(names, gathered, "at the end of an epoch")
        return averaged


def _evened_out(dataset, steps: int, gathered, running: str):
    """``dataset``, of ``steps`` batches, after every rank's count and whether Keras runs a given
    number of steps of it (``gathered``) are known: as it is where the counts are equal; for
    validation or evaluation data that Keras iterates whole on every rank, and no rank empty, as
    it is on the ranks with the most batches, else marked so that its last test step takes part
    in the others' remaining averagings (:func:`~tfsparse.data.mark_last_batch`,
    :func:`_then_more`) -- an ``evaluate``'s model first built, on every rank, from the unmarked
    batches (:func:`~tfsparse._tf_private.keras_build_before_evaluate`: Keras builds an unbuilt
    one from the first batch it is given, which it would misread); otherwise the ranks'
    :class:`StepCountMismatch`.

    Raises:
      StepCountMismatch: training data, data with ``steps`` given, or an empty shard, of counts
        that differ (on every rank: all decide from ``gathered``).
    """
    counts = [count for count, _ in gathered]
    if running == "fit" or min(counts) == 0 or any(given for _, given in gathered):
        raise_on_uneven_counts(counts)
        return dataset
    if len(set(counts)) > 1:
        keras_build_before_evaluate(dataset)
    return dataset if steps == max(counts) else mark_last_batch(dataset, steps, max(counts) - steps)


def _then_more(sync, packed, more):
    """A rank's last test step where the others have ``more`` batches left: its averaging of the
    metric states (``sync(packed)``), then ``more`` averagings of the average it got -- its states
    unchanged by batches it has not got, while the others add theirs -- so that every rank ends
    with the same states: the whole set's sums over P, whose ratios are the whole set's metrics.
    The averaging must be the test steps' only collective (no other in a custom ``test_step`` or
    a test-batch callback): the ranks with more batches spread theirs over their later steps."""
    averaged = sync(packed)
    for _ in range(int(more)):
        averaged = sync(averaged)
    return averaged


def _find_set(sets, optimizer, key, current):
    """``(sets, exchange)``: ``sets`` (:meth:`SparseExtended._exchange_for`'s ``(optimizer held
    weakly, key, exchange)``) without those of optimizers that died, but the one of ``current``
    (whether the strategy's exchange was taken must not depend on when each rank collects), and
    the exchange of ``optimizer`` -- the object itself, not its id(), which CPython gives a new
    object in a dead one's memory (Adam compiled after SGD often gets the SGD's: a rank once took
    the dead optimizer's exchange where another made a new one) -- and ``key``; None if none."""
    sets = [s for s in sets if s[0] is None or s[0]() is not None or s[2] is current]
    for held, k, exchange in sets:
        if k == key and (held is None if optimizer is None else held is not None and held() is optimizer):
            return sets, exchange
    return sets, None


def _weakly(obj):
    """A reference to ``obj`` that does not keep it alive: ``weakref.ref(obj)``; None for None;
    where ``obj`` takes no weak reference, a callable returning it (which keeps it alive, so
    that its id is never another object's)."""
    if obj is None:
        return None
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _carry(exchange, previous) -> None:
    """A new exchange (built by the trace of its first reduction) takes over ``previous``'s memory
    of the tensors they share (nothing when ``previous`` is None)."""
    if previous is not None:
        with tf.init_scope():
            previous.flush()
            exchange.engine.carry_memory(previous.engine)


def _broadcast_initial_value(comm, kwargs):
    init = kwargs.get("initial_value")
    if init is None:
        return kwargs
    with tf.init_scope():
        value = init() if callable(init) else init
        value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
        if not tf.executing_eagerly():
            return kwargs
        arr = value.numpy()
    name = str(kwargs.get("name"))
    # shapes and dtypes, not names: Keras numbers layers per process (a rank that built another
    # model first names the same layer differently)
    check_agreement(comm, f"the variable {name!r} created in the SparseStrategy scope",
                    {"shape": list(arr.shape), "dtype": str(arr.dtype)},
                    "Every rank must build the same model (layer sizes, dtypes) in the same order.")
    arr = comm.bcast(arr if comm.rank == 0 else np.empty_like(arr), root=0)
    kwargs = dict(kwargs)
    kwargs["initial_value"] = tf.constant(arr, dtype=value.dtype)
    return kwargs


class SparseStrategy(OneDeviceStrategy, KerasSaveable):
    """Data-parallel strategy with sparse gradient exchange, one process per replica.

    >>> strategy = tfsparse.SparseStrategy()       # algorithm="auto": measured, then chosen
    >>> strategy = tfsparse.SparseStrategy(algorithm="topk", density=0.01)
    >>> with strategy.scope():
    ...     model = build_model(); model.compile(optimizer="sgd", loss=...)
    >>> model.fit(x_shard, y_shard, epochs=5)

    Args:
      algorithm: the aggregator, or ``"auto"`` (the default): measured at the start and chosen
        among dense over float32/bfloat16/float16 and the sparse algorithms at density 0.01
        (:mod:`tfsparse.auto`; rank 0 prints the choice and how to pin it).
      density: the fraction of elements each rank sends (default 0.01; given without an
        algorithm, it pins ``"topk"``).
      settings: a :class:`tfsparse.settings.Settings`; or, instead, its keyword arguments
        (``wire_dtype``, ``plan``, ``memory``, ``momentum``, ``pipeline``, ``clip_norm``, and
        the algorithm's options) -- each is described once, in :mod:`tfsparse.settings`.  With
        ``memory="momentum"`` (or ``"momentum_rows"``) the model's optimizer must run without momentum (``SGD(lr)``): an
        optimizer with ``momentum``/``beta_1`` > 0 raises ValueError when training starts.  With
        ``pipeline=2`` pair ``tfsparse.keras.callbacks.DSyncWarmUp`` for Pipe-SGD's warm-up.
      device: the device of this process' replica (default: ``/gpu:<local_rank>``
        when GPUs are visible, else ``/cpu:0``).  On a GPU, with ``numba.cuda`` usable, the
        exchange stays there: the gradients are viewed in place, only the payload crosses to
        the host (:mod:`tfsparse.tf_glue`).
      communicator: a Communicator (default: ``tfsparse.init()``'s world).
      **kwargs: the settings' keyword arguments and the algorithm's options, instead of
        ``settings`` (above).
      uneven_data: what ``fit``/``evaluate`` do when the ranks' datasets have unknown length (a
        ``filter``, a generator) and run out at different steps -- the ranks vote before every
        batch (one small collective per step, :func:`tfsparse.data.agree_on_data`): ``"end"``
        (default) ends the epoch on every rank at the step where the first rank runs out (the
        other ranks' remaining batches are not used in that epoch, as with
        ``drop_remainder``); ``"join"`` (Horovod's ``hvd.join``) goes on until every rank is done,
        a rank that ran out taking zero-weighted batches (its gradient is zero); ``"error"``
        raises :class:`StepCountMismatch` there.  A rank with no data at all raises a
        :class:`StepCountMismatch` naming it.  Datasets of known length are compared before the
        first step: training data of different numbers of batches raises
        :class:`StepCountMismatch` on every rank (pass the same ``steps_per_epoch`` everywhere, or
        shard evenly); validation and evaluation data that Keras iterates whole are evened out
        (a rank with fewer batches averages its unchanged metric states with the others'
        remaining batches; the averaging must be the test steps' only collective); with
        ``validation_steps``/``steps`` given, different counts raise too.

    Every argument is validated before any communication.  Use as ``with strategy.scope():``
    or directly ``with strategy:``.
    """

    def __init__(self, algorithm: str | None = None, density: float | None = None, *, settings: Settings | None = None,
                 device: str | None = None, communicator=None, uneven_data: str = "end", **kwargs):
        uneven_data = check_uneven_policy(uneven_data)
        engine = GradientExchange(algorithm, density, settings=settings, communicator=communicator, **kwargs)
        exchange = Pipelined(engine)
        if communicator is None:
            runtime.init()  # after validation: nothing communicates before the arguments are checked
        if device is None:
            gpus = tf.config.list_logical_devices("GPU")
            device = f"/gpu:{runtime.local_rank() % len(gpus)}" if gpus else "/cpu:0"
        super(OneDeviceStrategy, self).__init__(SparseExtended(self, device, exchange, uneven_data))
        self._scope_stack: list = []

    @property
    def exchange(self) -> Pipelined:
        """The gradient exchange every model trained in the scope uses (a :class:`Pipelined`
        round engine): the strategy's own, or the one it adopted from a ``DistributedOptimizer``
        with settings of its own (:mod:`tfsparse.keras.ownership`)."""
        return self.extended.exchange

    @property
    def checkpointer(self) -> Checkpointer:
        """What saves and restores :attr:`exchange`'s state (every rank's residual, the aggregators' state)."""
        return self.extended.checkpointer

    def adopt_exchange(self, exchange: Pipelined, checkpointer: Checkpointer) -> None:
        """Called by a ``DistributedOptimizer`` built in the scope: see :meth:`SparseExtended.adopt`.

        Args:
          exchange: the exchange the optimizer runs from now on.
          checkpointer: what saves and restores its state.
        """
        self.extended.adopt(exchange, checkpointer)

    @property
    def residual(self):
        """This rank's residual (numpy, over the whole layout), or None before the first step
        or when no residual is kept.  It is part of Keras model files (see the class doc)."""
        return self.exchange.residual

    @property
    def algorithm(self) -> str:
        """The algorithm the exchange runs (with ``"auto"``: ``"auto"`` before the first gradients,
        ``"dense"`` while it measures, then its choice)."""
        return self.exchange.algorithm

    @property
    def density(self) -> float:
        """The fraction of gradient elements each rank sends: the exchange's density now."""
        return self.exchange.density

    # -- Keras saving: the exchange's state in the model file ---------------
    def _obj_type(self):
        return "Layer"  # Keras' saving walks this object's own attributes as it does a layer's

    def save_own_variables(self, store):
        """Keras' saving: the exchange's state into ``store`` (every rank's when it was gathered since the last
        round, else this rank's own) -- unless a ``DistributedOptimizer`` owns the exchange and saves it.

        Args:
          store: Keras' weights store, written into.
        """
        if not self.extended.saved_by_optimizer:
            for key, value in self.checkpointer.entries().items():
                store[key] = value

    def load_own_variables(self, store):
        """Keras' loading: this rank's exchange state from ``store`` -- unless a ``DistributedOptimizer`` owns
        the exchange and restores it.

        Args:
          store: Keras' weights store, read from.
        """
        if not self.extended.saved_by_optimizer:
            self.checkpointer.restore(store)

    def scope(self):
        """Like ``tf.distribute.Strategy.scope()``, with a clear error for an optimizer
        created outside the scope."""
        return _Scope(super().scope())

    def __enter__(self):
        scope = self.scope()
        self._scope_stack.append(scope)
        return scope.__enter__()

    def __exit__(self, *exc):
        return self._scope_stack.pop().__exit__(*exc)


class _Scope:
    def __init__(self, inner):
        self._inner = inner

    def __enter__(self):
        return self._inner.__enter__()

    def __exit__(self, exc_type, exc, tb):
        if mixes_strategies(exc):
            self._inner.__exit__(None, None, None)
            raise RuntimeError(
                "the optimizer was created outside the SparseStrategy scope, so its variables belong to "
                "another strategy. Create the optimizer inside `with strategy.scope():` (e.g. pass "
                "optimizer=keras.optimizers.SGD(...) to model.compile inside the scope).") from exc
        return self._inner.__exit__(exc_type, exc, tb)
