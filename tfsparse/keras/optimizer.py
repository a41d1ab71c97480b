"""DistributedOptimizer: a Keras optimizer wrapper (a ``keras.optimizers.LossScaleOptimizer``)
that exchanges gradients across ranks before the wrapped optimizer applies them.

>>> opt = tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
...                                           algorithm="topk", density=0.01)
>>> model.compile(optimizer=opt, loss=...)
>>> model.fit(x, y, callbacks=[tfsparse.keras.callbacks.BroadcastInitialState()])

One exchange per model: the wrapper owns a :class:`~tfsparse.exchange.GradientExchange`
(error feedback, buckets, wire, communication thread) and saves its state -- every rank's
residual and the aggregators' state -- with the optimizer, so ``model.save`` /
``ModelCheckpoint`` store it and loading restores it.  Without a strategy the summed gradient
is divided by the world size (Horovod-style averaging).  Inside a
:class:`~tfsparse.SparseStrategy` scope the wrapper and the strategy share one exchange: the
strategy's, or -- when the wrapper is given settings of its own -- the wrapper's, which the
strategy then runs; Keras scales the loss by 1/P there.

**Mixed precision.**  Keras' ``compile`` wraps any optimizer that is not a
``LossScaleOptimizer`` in one under ``mixed_float16``, and that wrapper tests each rank's own
gradients: a rank that overflowed would skip the step, and its exchange, alone, and the others
would wait forever.  So the wrapper *is* a ``LossScaleOptimizer`` (Keras does not wrap it
again) and, with ``loss_scale`` on, scales the loss itself and decides on the **exchanged**
gradient: every rank's unscaled gradient goes through the exchange, whatever it holds (a bucket
that is not finite on some rank is skipped on every rank and comes back NaN, see
:class:`~tfsparse.exchange.GradientExchange`), so all ranks apply the step, or all skip it and
halve the loss scale, together.
"""
from __future__ import annotations

import keras
import tensorflow as tf
from keras.src.saving import serialization_lib

from ..exchange import GradientExchange, check_float_variables
from .callbacks import broadcast_variables

_BASE_DEFAULTS = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None,
                  "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
                  "loss_scale_factor": None, "gradient_accumulation_steps": None}
_DEFAULTS = {"algorithm": "topk", "density": 0.01, "wire_dtype": "float32", "bucket_bytes": None, "plan": None,
             "memory": "residual", "pipeline": 1, "selection": None, "clip_norm": None}



def _strategy_exchange():
    """The exchange of the tf.distribute strategy in scope, when it has one (SparseStrategy)."""
    return getattr(tf.distribute.get_strategy(), "exchange", None)


@keras.saving.register_keras_serializable(package="tfsparse")
class DistributedOptimizer(keras.optimizers.LossScaleOptimizer):
    """Wraps ``inner_optimizer``; gradients go through memory -> compressor -> aggregator first.

    Args:
      inner_optimizer: the ``keras.optimizers.Optimizer`` that applies the update.
      algorithm: aggregator name (``"dense"``, ``"topk"``, ...); default ``"topk"``, or the
        strategy's inside a SparseStrategy scope.
      density: fraction of gradient elements each rank sends, in (0, 1]; default 0.01 (or
        the strategy's).
      wire_dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"int8"`` (:mod:`tfsparse.wire`).
      bucket_bytes: ``None`` (one fused bucket), θ bytes, or 0 (:mod:`tfsparse.plan`).
      plan: ``"fused"``, ``"buckets"``, ``"per_tensor"`` or a :class:`tfsparse.plan.Plan`.
      memory: ``"residual"`` (error feedback, default) or ``"momentum"`` (momentum correction,
        DGC §3.2 / GradientFlow Alg. 1: the exchange accumulates the velocity, so
        ``inner_optimizer`` must have no momentum -- ``SGD(lr)``; ValueError otherwise).
      momentum: the momentum factor of ``memory="momentum"`` (default 0.9).
      pipeline: ``1`` (synchronous, default) or ``2`` (Pipe-SGD, pipe-sgd-li2018 §3.1: each
        step applies the previous step's aggregated gradient while its own is on the wire;
        the first step applies zeros; momentum β is then stable only for ``lr·h < 1 − β``
        on a curvature h, see ``SparseStrategy``).  At the end of ``fit``
        (``finalize_variable_values``) the round in flight is finished and held for the next
        step.
      selection: ``None`` or ``"cost_model"`` (DRAGONN's per-tensor choice by Eq. 1,
        :mod:`tfsparse.selection`).
      clip_norm: DGC's local gradient clipping to ``clip_norm / sqrt(P)`` (default None: off).
      communicator: transport (default: ``tfsparse.init()``'s world).
      loss_scale: dynamic loss scaling (Keras' ``LossScaleOptimizer`` rules, applied to the
        exchanged gradient): ``None`` (default) -- on when the global dtype policy is
        ``mixed_float16`` as the wrapper is created (what Keras' ``compile`` would add); ``True``
        or ``False``.
      initial_scale, dynamic_growth_steps: as in ``keras.optimizers.LossScaleOptimizer``.
      **algorithm_options: options of the algorithm (``tau=...`` for ``oktopk``, ...).

    Every argument is validated here, before any communication.
    """

    def __init__(self, inner_optimizer, algorithm: str | None = None, density: float | None = None, *,
                 wire_dtype: str | None = None, bucket_bytes: int | None = None, plan=None, memory: str | None = None,
                 momentum: float | None = None, pipeline: int | None = None, selection=None,
                 clip_norm: float | None = None, communicator=None, name: str | None = None,
                 loss_scale: bool | None = None, initial_scale: float = 2.0 ** 15, dynamic_growth_steps: int = 2000,
                 algorithm_options: dict | None = None, **kwargs):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(f"inner_optimizer must be a keras.optimizers.Optimizer instance, got "
                             f"{type(inner_optimizer).__name__}; e.g. DistributedOptimizer(keras.optimizers.SGD(0.1))")
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(f"inner_optimizer is a {type(inner_optimizer).__name__}: DistributedOptimizer does the "
                             f"loss scaling itself (loss_scale=True), on the exchanged gradient; pass the optimizer "
                             f"that LossScaleOptimizer wraps")
        if not isinstance(loss_scale, (bool, type(None))):
            raise ValueError(f"loss_scale={loss_scale!r} is not supported; accepted: None (on under the "
                             f"mixed_float16 policy), True, False")
        for arg, default in _BASE_DEFAULTS.items():
            if arg in kwargs and kwargs.pop(arg) != default:
                raise ValueError(f"DistributedOptimizer does not take `{arg}`; set it on the inner optimizer")
        options = {**(algorithm_options or {}), **kwargs}
        given = {k: v for k, v in (("algorithm", algorithm), ("density", density), ("wire_dtype", wire_dtype),
                                   ("bucket_bytes", bucket_bytes), ("plan", plan), ("memory", memory),
                                   ("momentum", momentum), ("pipeline", pipeline), ("selection", selection),
                                   ("clip_norm", clip_norm)) if v is not None}
        shared = _strategy_exchange()
        if shared is not None and not given and not options and communicator is None:
            exchange = shared  # inside a SparseStrategy, no settings of its own: the strategy's exchange
        else:
            exchange = GradientExchange(**{**_DEFAULTS, **given}, communicator=communicator, **options)
        exchange.check_optimizer(inner_optimizer)
        exchange.owner = "optimizer"  # saved with the optimizer, not with the strategy
        if loss_scale is None:
            loss_scale = keras.config.dtype_policy().name == "mixed_float16"
        factor = inner_optimizer.loss_scale_factor
        super().__init__(inner_optimizer, initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps,
                         name=name or f"Distributed{type(inner_optimizer).__name__}")
        if not loss_scale:
            inner_optimizer.loss_scale_factor = factor  # LossScaleOptimizer turned it off: no scaling here
        self.loss_scale = bool(loss_scale)
        self.exchange = exchange
        self._started_from_root = False

    @property
    def algorithm(self) -> str:
        return self.exchange.algorithm

    @property
    def density(self) -> float:
        return self.exchange.density

    @property
    def residual(self):
        """This rank's residual (numpy, over all gradients), or None before the first step."""
        return self.exchange.residual

    def build(self, var_list):
        check_float_variables(var_list)
        super().build(var_list)  # LossScaleOptimizer's: the scale and its counter, then the inner optimizer

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = trainable_variables if trainable_variables is not None else self._trainable_variables
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if len(pairs) != len(list(variables)):
            missing = [getattr(v, "path", v.name) for g, v in zip(grads, variables) if g is None]
            raise ValueError(f"gradients are missing for {missing}: every rank must send the same "
                             f"gradients each step; mark unused variables trainable=False")
        if _strategy_exchange() is not None:
            # under SparseStrategy its all-reduce runs this optimizer's exchange (found on the
            # call stack), and Keras scales the loss by 1/P; with loss scaling, Keras' own
            # LossScaleOptimizer logic, whose finite test the strategy runs on the exchanged sum
            if self.loss_scale:
                self._tf_apply(grads, trainable_variables)
            else:
                self.inner_optimizer.apply(grads, trainable_variables)
            return
        self._start_from_root(variables)
        names = [getattr(v, "path", v.name) for _, v in pairs]
        p = float(self.exchange.comm.size)
        if not self.loss_scale:
            summed = self.exchange([g for g, _ in pairs], names=names)
            self.inner_optimizer.apply([s / tf.cast(p, s.dtype) for s in summed], trainable_variables)
            return
        summed = self.exchange.loss_scaled([g for g, _ in pairs], self.dynamic_scale, names)

        def finite():
            self.inner_optimizer.apply([s / tf.cast(p, s.dtype) for s in summed], trainable_variables)
            grow = keras.ops.equal(self.step_counter, self.dynamic_growth_steps - 1)
            keras.ops.cond(grow, self._double_scale, self._count_finite_step)

        keras.ops.cond(self.check_finite(summed), finite, self._stateful_handle_non_finite_grads)

    def _double_scale(self):  # LossScaleOptimizer's growth rule: after dynamic_growth_steps finite steps
        self.step_counter.assign(0)
        self.dynamic_scale.assign(keras.ops.multiply(self.dynamic_scale, 2.0))

    def _count_finite_step(self):
        self.step_counter.assign_add(1)

    def scale_loss(self, loss):
        return super().scale_loss(loss) if self.loss_scale else self.inner_optimizer.scale_loss(loss)

    def _start_from_root(self, variables) -> None:
        """Every rank starts from rank 0's weights and optimizer state, whether or not the user
        added ``BroadcastInitialState`` (ranks with different seeds would otherwise train apart,
        silently): at the first trace of the train step -- reached by every rank at its first
        step, before that step runs -- the trainable variables are broadcast from rank 0
        (eagerly, out of the graph being traced).  The optimizer's own variables start equal
        (zeros, the same learning rate) unless restored, and a restored checkpoint is the same
        file on every rank; ``BroadcastInitialState`` also covers non-trainable variables and
        restored optimizer state."""
        comm = self.exchange.comm
        if self._started_from_root or comm.size == 1:
            return
        self._started_from_root = True
        with tf.init_scope():
            broadcast_variables(list(variables), 0, comm)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError("DistributedOptimizer exchanges gradients with a stateful collective and "
                         "cannot be used with stateless_apply")

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        if hasattr(self, "inner_optimizer"):
            self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def finalize_variable_values(self, var_list):
        # Keras calls this at the end of fit: a pipelined round still in flight is finished
        # (its result is held for the next step, and saved with checkpoints)
        self.exchange.flush()
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- checkpoints: every rank's exchange state ---------------------------
    def save_own_variables(self, store):
        super().save_own_variables(store)
        for key, value in self.exchange.checkpoint_entries().items():
            store[key] = value

    def load_own_variables(self, store):
        keys = list(store.keys())
        plain = {k: store[k] for k in keys if not self._is_exchange_key(k)}
        super().load_own_variables(plain)
        self.exchange.restore_checkpoint({k: store[k] for k in keys if self._is_exchange_key(k)})

    @staticmethod
    def _is_exchange_key(key) -> bool:
        from ..exchange import CHECKPOINT_PREFIX

        return str(key).startswith(CHECKPOINT_PREFIX)

    def get_config(self):
        ex = self.exchange
        plan = ex.plan.config()
        return {
            "name": self.name,
            "inner_optimizer": serialization_lib.serialize_keras_object(self.inner_optimizer),
            "algorithm": ex.algorithm,
            "density": ex.density,
            "wire_dtype": ex.wire.name,
            "bucket_bytes": plan.get("bucket_bytes"),
            # a PerTensorPlan's assign function is code: not part of the config; the cost model's
            # plan is re-made from ``selection`` ("cost_model": measured again; a CostModel's numbers)
            "plan": None if ex.selection is not None else plan["plan"],
            "selection": ex.selection.as_dict() if hasattr(ex.selection, "as_dict") else ex.selection,
            "clip_norm": ex.clip_norm,
            "memory": ex.memory,
            "momentum": ex.momentum,
            "pipeline": ex.pipeline,
            "loss_scale": self.loss_scale,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "algorithm_options": dict(ex.options),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = serialization_lib.deserialize_keras_object(config.pop("inner_optimizer"),
                                                           custom_objects=custom_objects)
        return cls(inner, **config)
