"""SparseStrategy: a ``tf.distribute.Strategy`` with one replica per process whose
gradient all-reduce is a sparse allreduce.

Keras 3 reduces gradients through ``tf.distribute.get_replica_context().all_reduce``,
which reaches ``StrategyExtended._batch_reduce_to`` with all of a step's gradients in
one call.  :class:`SparseExtended` overrides

* ``_num_replicas_in_sync`` — the world size, so Keras scales the loss by 1/P and
  the SUM of the exchange is the mean gradient;
* ``_batch_reduce_to`` — the :class:`~tfsparse.exchange.GradientExchange` (the model's one
  exchange: that of the ``DistributedOptimizer`` applying the gradients, else the
  strategy's own);
* ``_create_variable`` — every variable created in the scope starts from rank 0's
  value (a broadcast: variable creation in the scope is a collective);
* ``_experimental_distribute_dataset`` — returns the dataset unchanged (each rank
  feeds its own shard) and records its length for the step-count agreement (and, for
  ``fit`` with ``pipeline=2``, tells the exchange where epochs end, so that an epoch's last
  pipelined round is finished before the epoch's callbacks, validation and checkpoints run);
* ``_call_for_each_replica`` — after every train/test step, averages the metric
  states across ranks, so every rank logs the same loss and metrics.  The averaging runs on
  the model's exchange's communication thread, after the step's gradient buckets and over the
  same communicator, fused with the first step's step-count agreement into one allreduce.

The strategy is also a Keras saveable: a model built in its scope saves the exchange's state
(every rank's residual, the aggregators' state) in its ``.keras`` file, and loading the file
in the scope restores it -- unless a ``DistributedOptimizer`` owns the exchange, which then
saves it itself.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import runtime
from .._tf_private import (KerasSaveable, OneDeviceExtended, OneDeviceStrategy, keras_epoch_steps,
                           keras_optimizer_apply, keras_running, reject_xla)
from ..collectives.agreement import check_agreement
from ..exchange import GradientExchange, check_float_variables
from ..runtime import StepCountMismatch, check_step_counts  # noqa: F401  (StepCountMismatch: public here too)

_SYNCED_STEPS = ("train_step", "test_step")


class SparseExtended(OneDeviceExtended):
    def __init__(self, container, device, exchange: GradientExchange):
        super().__init__(container, device)
        self.exchange = exchange
        self._active = exchange  # the exchange the last traced step ran (the model's one)
        self._metric_vars: list = []
        self._pending_steps = None
        self._reduced = None  # a LossScaleOptimizer step's exchanged gradients (see _agreed_finite)

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
        self._pending_steps = steps
        if keras_running() == "fit":
            for exchange in {self.exchange, self._active}:
                exchange.sync_points = (exchange.rounds_started, steps) if steps else None
        return dataset

    # -- gradient exchange ------------------------------------------------
    def _model_exchange(self, values, optimizers=()):
        """``(exchange, names)``: the model's one exchange -- that of a DistributedOptimizer
        among the optimizers applying ``values`` (looking through wrappers), else the
        strategy's -- checked against those optimizers."""
        check_float_variables(values)
        found, names = keras_optimizer_apply(len(values))
        chain = []
        for opt in [*optimizers, *found]:
            while opt is not None and opt not in chain:
                chain.append(opt)
                opt = getattr(opt, "inner_optimizer", None)
        exchange = next((o.exchange for o in chain if isinstance(getattr(o, "exchange", None), GradientExchange)),
                        self.exchange)
        for optimizer in chain:
            exchange.check_optimizer(optimizer)
        if exchange is not self.exchange and exchange.sync_points is None:
            exchange.sync_points = self.exchange.sync_points
        self._active = exchange
        return exchange, names

    def _agreed_finite(self, loss_scaler, grads):
        """Keras' ``LossScaleOptimizer.check_finite`` under this strategy: it would test each
        rank's own gradients, and a rank that overflowed would skip the step (and its
        all-reduce) alone while the others wait for it.  Here the exchange runs first, on the
        unscaled gradients of every rank, whatever they hold: a bucket that is not finite on
        some rank is skipped on every rank and returns NaN (:meth:`GradientExchange._skip_bucket`),
        so the test below -- on the exchanged sum, identical on every rank -- agrees everywhere:
        all ranks apply the step, or all skip it and halve their loss scale.  The summed
        gradients are kept for the all-reduce that the finite branch then asks for."""
        values = [g for g in grads if g is not None]
        exchange, names = self._model_exchange(values, [loss_scaler])
        self._reduced = exchange.loss_scaled(values, loss_scaler.dynamic_scale, names)
        return loss_scaler.check_finite(self._reduced)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        values = [v for v, _ in value_destination_pairs]
        if self._reduced is not None and len(self._reduced) == len(values):
            # the unscaled gradients that _agreed_finite already exchanged in this step
            reduced, self._reduced = self._reduced, None
        else:
            exchange, names = self._model_exchange(values)
            reduced = exchange(values, names=names)
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
        owner, name = _bound_to(fn), getattr(fn, "__name__", "")
        if name == "check_finite" and hasattr(owner, "dynamic_scale"):
            return self._agreed_finite(owner, *args, **(kwargs or {}))
        outputs = super()._call_for_each_replica(fn, args, kwargs)
        if name in _SYNCED_STEPS and self.exchange.comm.size > 1:
            model = owner if name == "train_step" else None
            outputs = self._sync_step(outputs, moving_statistics(model) if model is not None else [])
        return outputs

    def _sync_step(self, outputs, moving=()):
        """Averages, after the step, the metric states, the step's scalar outputs and
        ``moving`` -- the model's non-trainable float weights that training updates (BatchNorm's
        moving mean and variance) -- across ranks, in one allreduce."""
        reject_xla("the per-step metric averaging")
        flat = tf.nest.flatten(outputs)
        out_pos = [i for i, o in enumerate(flat)
                   if isinstance(o, tf.Tensor) and o.dtype.is_floating and o.shape.rank == 0]
        mvars = list(self._metric_vars) + [v for v in moving if all(v is not m for m in self._metric_vars)]
        pieces = [tf.reshape(tf.cast(tf.convert_to_tensor(v), tf.float64), [-1]) for v in mvars]
        pieces += [tf.reshape(tf.cast(flat[i], tf.float64), [-1]) for i in out_pos]
        if not pieces:
            return outputs
        sizes = [int(p.shape.num_elements()) for p in pieces]
        with tf.control_dependencies([flat[i] for i in out_pos]):
            packed = tf.concat(pieces, axis=0)
        synced = tf.numpy_function(self._sync_np, [packed], tf.float64, stateful=True,
                                   name="tfsparse_metric_sync")
        synced.set_shape(packed.shape)
        parts = tf.split(synced, sizes)
        assigns = [v.assign(tf.reshape(tf.cast(p, v.dtype), v.shape)) for v, p in zip(mvars, parts)]
        with tf.control_dependencies(assigns):
            for j, i in enumerate(out_pos):
                flat[i] = tf.identity(tf.cast(tf.reshape(parts[len(mvars) + j], []), flat[i].dtype))
        return tf.nest.pack_sequence_as(outputs, flat)

    def _sync_np(self, packed):
        steps, self._pending_steps = self._pending_steps, None

        def average(comm):
            if steps is None:
                return comm.allreduce(packed) / comm.size
            # the step-count agreement rides along: equal counts <=> P * sum(s^2) == (sum s)^2
            total = comm.allreduce(np.concatenate([packed, [steps, float(steps) ** 2]]))
            if comm.size * total[-1] != total[-2] ** 2:
                check_step_counts(comm, steps)
            return total[:-2] / comm.size

        return self._active.run_collective(average)


def _bound_to(fn):
    """The object a (possibly wrapped, e.g. by autograph) bound method belongs to, or None."""
    while fn is not None:
        owner = getattr(fn, "__self__", None)
        if owner is not None:
            return owner
        fn = getattr(fn, "__wrapped__", None)
    return None


def moving_statistics(model) -> list:
    """The non-trainable float weights of the model's trainable leaf layers -- what a train step
    updates besides the trainable weights (BatchNormalization's moving mean and variance); each
    rank computes them from its own batches, so they are averaged with the step's metrics.  A
    frozen layer (``trainable=False``) is left out: its weights do not change."""
    out, seen, stack = [], set(), [model]
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        children = list(getattr(layer, "layers", None) or [])
        if children:
            stack.extend(reversed(children))
        elif getattr(layer, "trainable", False):
            out += [w for w in layer.non_trainable_weights if tf.as_dtype(w.dtype).is_floating]
    return out


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

    >>> strategy = tfsparse.SparseStrategy(algorithm="topk", density=0.01)
    >>> with strategy.scope():
    ...     model = build_model(); model.compile(optimizer="sgd", loss=...)
    >>> model.fit(x_shard, y_shard, epochs=5)

    Args:
      algorithm: aggregator name; ``tfsparse.aggregators.available_aggregators()``.
      density: fraction of gradient elements each rank sends per step, in (0, 1].
      wire_dtype: ``"float32"`` (default), ``"float16"``, ``"bfloat16"`` or ``"int8"``
        (:mod:`tfsparse.wire`).
      bucket_bytes: ``None`` (one fused bucket, default), θ bytes (GradientFlow's lazy
        allreduce) or 0 (one bucket per tensor); see :mod:`tfsparse.plan`.
      plan: ``"fused"``, ``"buckets"``, ``"per_tensor"`` or a :class:`tfsparse.plan.Plan`.
      memory: ``"residual"`` (error feedback, default) or ``"momentum"`` (momentum correction
        with momentum factor masking, DGC §3.2 / GradientFlow Alg. 1): the exchange keeps the
        velocity and the model's optimizer must run without momentum (``SGD(lr)``); an
        optimizer with ``momentum``/``beta_1`` > 0 raises ValueError when training starts.
      momentum: the momentum factor of ``memory="momentum"`` (default 0.9).
      pipeline: ``1`` (synchronous, default) or ``2``: Pipe-SGD (pipe-sgd-li2018 §3.1, Alg. 1)
        -- the exchange of step t's gradient runs while step t+1 computes, and step t+1
        applies it (one step stale); the first step applies a zero gradient.  Pair it with
        ``algorithm="dense", wire_dtype="int8"`` (or ``"bfloat16"``) for the paper's
        compressed pipelined training, and with ``tfsparse.keras.callbacks.DSyncWarmUp`` for
        its synchronous warm-up.  A gradient one step late narrows the stable learning rates:
        heavy-ball momentum β is stable for ``lr·h < 1 − β`` on a curvature h instead of
        ``lr·h < 2(1 + β)`` (plain SGD, the paper's update: ``lr·h < 1`` instead of 2), so a
        learning rate tuned for synchronous momentum SGD may need lowering (README, Pipe-SGD).
      selection: ``None`` (every tensor compressed, default) or ``"cost_model"``: DRAGONN's
        efficiency-aware tensor selection (dragonn-wang2022 §4.2, Eq. 1) -- α, β and the
        compression cost are measured at the first step and only the tensors whose compression
        saves time are compressed; the others (biases, norms) go dense.  See
        :mod:`tfsparse.selection`.
      clip_norm: DGC's local gradient clipping: each rank clips its gradient to the global L2
        norm ``clip_norm / sqrt(P)`` before error feedback (default None: off).
      device: the device of this process' replica (default: ``/gpu:<local_rank>``
        when GPUs are visible, else ``/cpu:0``).  On a GPU, with ``numba.cuda`` usable, the
        exchange stays there: the gradients are viewed in place, only the payload crosses to
        the host (:meth:`tfsparse.exchange.GradientExchange.__call__`).
      communicator: a Communicator (default: ``tfsparse.init()``'s world).
      **algorithm_options: algorithm options (see each aggregator).

    Every argument is validated before any communication.  Use as ``with strategy.scope():``
    or directly ``with strategy:``.
    """

    def __init__(self, algorithm: str = "topk", density: float = 0.01, *, wire_dtype: str = "float32",
                 bucket_bytes: int | None = None, plan=None, memory: str = "residual", momentum: float | None = None,
                 pipeline: int = 1, selection=None, clip_norm: float | None = None, device: str | None = None,
                 communicator=None, **algorithm_options):
        exchange = GradientExchange(algorithm, density, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes,
                                    plan=plan, memory=memory, momentum=momentum, pipeline=pipeline,
                                    selection=selection, clip_norm=clip_norm, communicator=communicator,
                                    **algorithm_options)
        if communicator is None:
            runtime.init()  # after validation: nothing communicates before the arguments are checked
        if device is None:
            gpus = tf.config.list_logical_devices("GPU")
            device = f"/gpu:{runtime.local_rank() % len(gpus)}" if gpus else "/cpu:0"
        super(OneDeviceStrategy, self).__init__(SparseExtended(self, device, exchange))
        self._scope_stack: list = []

    @property
    def exchange(self) -> GradientExchange:
        """The strategy's gradient exchange: the one every model trained in its scope uses,
        unless the model's optimizer is a ``DistributedOptimizer`` with settings of its own."""
        return self.extended.exchange

    @property
    def residual(self):
        """This rank's residual (numpy, over the whole layout), or None before the first step
        or when no residual is kept.  It is part of Keras model files (see the class doc)."""
        return self.exchange.residual

    @property
    def algorithm(self) -> str:
        return self.exchange.algorithm

    @property
    def density(self) -> float:
        return self.exchange.density

    # -- Keras saving: the exchange's state in the model file ---------------
    def _obj_type(self):
        return "Layer"  # Keras' saving walks this object's own attributes as it does a layer's

    def save_own_variables(self, store):
        if self.exchange.owner is None:
            for key, value in self.exchange.checkpoint_entries().items():
                store[key] = value

    def load_own_variables(self, store):
        if self.exchange.owner is None:
            self.exchange.restore_checkpoint(store)

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
        if isinstance(exc, RuntimeError) and "Mixing different tf.distribute.Strategy" in str(exc):
            self._inner.__exit__(None, None, None)
            raise RuntimeError(
                "the optimizer was created outside the SparseStrategy scope, so its variables belong to "
                "another strategy. Create the optimizer inside `with strategy.scope():` (e.g. pass "
                "optimizer=keras.optimizers.SGD(...) to model.compile inside the scope).") from exc
        return self._inner.__exit__(exc_type, exc, tb)
