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

import warnings

import keras
import tensorflow as tf

from .._tf_private import keras_model_running, loss_scale_apply, loss_scale_skip_step, optimizer_variables
from ..checkpoint import Checkpointer, is_entry
from ..exchange import GradientExchange
from ..pipelined import Pipelined
from ..settings import ALIASES, NAMES, Settings
from ..tf_glue import check_float_variables, exchange_tensors, loss_scaled
from .sync import average_moving_statistics, broadcast_variables
from .ownership import fit_optimizer
from .replicas import check_replicas

_BASE_DEFAULTS = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None,
                  "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
                  "loss_scale_factor": None, "gradient_accumulation_steps": None}



def _sparse_strategy():
    """The tf.distribute strategy in scope when it is a SparseStrategy (it has an exchange), else None."""
    strategy = tf.distribute.get_strategy()
    return strategy if getattr(strategy, "exchange", None) is not None else None


@keras.saving.register_keras_serializable(package="tfsparse")
class DistributedOptimizer(keras.optimizers.LossScaleOptimizer):
    """Wraps ``inner_optimizer``; gradients go through memory -> compressor -> aggregator first.

    Args:
      inner_optimizer: the ``keras.optimizers.Optimizer`` that applies the update.
      algorithm: the aggregator or ``"auto"`` (default ``"auto"``, :mod:`tfsparse.auto`; or the
        strategy's inside a SparseStrategy scope).
      density: the fraction of elements each rank sends (default 0.01, or the strategy's).
      settings: a :class:`tfsparse.settings.Settings`; or, instead, its keyword arguments
        (``wire_dtype``, ``plan``, ``memory``, ``momentum``, ``pipeline``, ``clip_norm``;
        ``algorithm_options`` or any other keyword: the algorithm's options) -- each is described
        once, in :mod:`tfsparse.settings`.  ``memory="momentum"`` (or ``"momentum_rows"``) needs an ``inner_optimizer``
        without momentum (``SGD(lr)``; ValueError otherwise).  With ``pipeline=2``, at the end of
        ``fit`` (``finalize_variable_values``) the round in flight is finished and held for the
        next step.
      communicator: transport (default: ``tfsparse.init()``'s world).
      name: the optimizer's name (default ``"Distributed"`` + the inner optimizer's class name).
      **kwargs: the settings' keyword arguments and the algorithm's options, instead of
        ``settings`` (above).
      loss_scale: dynamic loss scaling (Keras' ``LossScaleOptimizer`` rules, applied to the
        exchanged gradient): ``None`` (default) -- on when the global dtype policy is
        ``mixed_float16`` as the wrapper is created (what Keras' ``compile`` would add); ``True``
        or ``False``.
      initial_scale: as in ``keras.optimizers.LossScaleOptimizer``.
      dynamic_growth_steps: as in ``keras.optimizers.LossScaleOptimizer``.

    Built inside a SparseStrategy scope without settings of its own, the wrapper takes the
    strategy's exchange; with settings of its own, the strategy adopts the wrapper's.  Either way
    the wrapper owns it and saves its state (:mod:`tfsparse.keras.ownership`).  Every argument is
    validated here, before any communication.
    """

    def __init__(self, inner_optimizer, algorithm: str | None = None, density: float | None = None, *,
                 settings: Settings | None = None, communicator=None, name: str | None = None,
                 loss_scale: bool | None = None, initial_scale: float = 2.0 ** 15, dynamic_growth_steps: int = 2000,
                 **kwargs):
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
        # what a config saved with every key (None: the default) or a plain call gives of its own
        given = {k: v for k, v in kwargs.items()
                 if not ((k in NAMES or k in ALIASES) and v is None) and not (k == "algorithm_options" and not v)}
        strategy = _sparse_strategy()
        if strategy is not None and not given and algorithm is None and density is None and settings is None \
                and communicator is None:
            exchange, checkpointer = strategy.exchange, strategy.checkpointer  # no settings of its own
        else:
            engine = GradientExchange(algorithm, density, settings=settings, communicator=communicator, **given)
            exchange = Pipelined(engine)
            checkpointer = Checkpointer(exchange)
        fit_optimizer(exchange, inner_optimizer)
        if strategy is not None:
            strategy.adopt_exchange(exchange, checkpointer)  # this wrapper owns it and saves its state
        if loss_scale is None:
            loss_scale = keras.config.dtype_policy().name == "mixed_float16"
        factor = inner_optimizer.loss_scale_factor
        super().__init__(inner_optimizer, initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps,
                         name=name or f"Distributed{type(inner_optimizer).__name__}")
        if not loss_scale:
            inner_optimizer.loss_scale_factor = factor  # LossScaleOptimizer turned it off: no scaling here
        self.loss_scale = bool(loss_scale)
        self.exchange = exchange
        self.checkpointer = checkpointer
        self._started_from_root = False

    @property
    def algorithm(self) -> str:
        """The algorithm the exchange runs (with ``"auto"``: ``"auto"`` before the first gradients,
        ``"dense"`` while it measures, then its choice)."""
        return self.exchange.algorithm

    @property
    def density(self) -> float:
        """The fraction of gradient elements each rank sends: the exchange's density now."""
        return self.exchange.density

    @property
    def residual(self):
        """This rank's residual (numpy, over all gradients), or None before the first step."""
        return self.exchange.residual

    def build(self, var_list):
        """Builds the wrapper as ``LossScaleOptimizer`` does (the loss scale, its step counter, then the inner
        optimizer), after refusing variables that are not floating point (ValueError).

        Args:
          var_list: the variables the optimizer trains.
        """
        check_float_variables(var_list)
        super().build(var_list)  # LossScaleOptimizer's: the scale and its counter, then the inner optimizer

    def apply(self, grads, trainable_variables=None):
        """Exchanges ``grads`` over the ranks and has the inner optimizer apply them: their mean (the exchanged sum
        divided by the world size) on this route; under a ``SparseStrategy``, the strategy's all-reduce
        exchanges them and Keras averages.  With ``loss_scale`` on, the step is applied, or skipped with the
        scale halved, by whether the exchanged gradients are finite: the same decision on every rank.  A
        missing (None) gradient -- a variable the loss does not reach -- is left out of the exchange and the
        variable is not updated, with Keras' warning (as Keras and Horovod do): which gradients are missing
        is the traced model's, the same on every rank.

        Args:
          grads: the gradients, one per variable.
          trainable_variables: the variables they belong to (default: those the optimizer was built for).
        """
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        grads = list(grads)
        if not grads:
            return  # as Keras: nothing to apply
        variables = list(trainable_variables if trainable_variables is not None else optimizer_variables(self))
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        if len(pairs) != len(variables):
            missing = [getattr(v, "path", v.name) for g, v in zip(grads, variables) if g is None]
            warnings.warn(f"Gradients do not exist for variables {missing} when minimizing the loss: they are "
                          f"not exchanged and not updated", stacklevel=2)
            grads, trainable_variables = [g for g, _ in pairs], [v for _, v in pairs]
        if _sparse_strategy() is not None:
            # under SparseStrategy its all-reduce runs this optimizer's exchange (adopted by the
            # strategy when this wrapper was built), and Keras scales the loss by 1/P; with loss
            # scaling, Keras' own LossScaleOptimizer logic, whose finite test the strategy runs on
            # the exchanged sum
            if self.loss_scale:
                loss_scale_apply(self, grads, trainable_variables)
            else:
                self.inner_optimizer.apply(grads, trainable_variables)
            return
        self._start_from_root(variables)
        names = [getattr(v, "path", v.name) for _, v in pairs]
        p = self._divisor()
        if not self.loss_scale:
            summed = exchange_tensors(self.exchange, [g for g, _ in pairs], names=names)
            self.inner_optimizer.apply([s / tf.cast(p, s.dtype) for s in summed], trainable_variables)
            return
        summed = loss_scaled(self.exchange, [g for g, _ in pairs], self.dynamic_scale, names)

        def finite():
            self.inner_optimizer.apply([s / tf.cast(p, s.dtype) for s in summed], trainable_variables)
            grow = keras.ops.equal(self.step_counter, self.dynamic_growth_steps - 1)
            keras.ops.cond(grow, self._double_scale, self._count_finite_step)

        keras.ops.cond(self.check_finite(summed), finite, lambda: loss_scale_skip_step(self))

    def _divisor(self) -> float:
        """What the exchanged sum is divided by before the inner optimizer applies it, on this
        route (no strategy): the world size, for the ranks' mean (``tfsparse.horovod``'s
        ``op=Sum`` and ``gradient_predivide_factor`` change it)."""
        return float(self.exchange.comm.size)

    def _double_scale(self):  # LossScaleOptimizer's growth rule: after dynamic_growth_steps finite steps
        self.step_counter.assign(0)
        self.dynamic_scale.assign(keras.ops.multiply(self.dynamic_scale, 2.0))

    def _count_finite_step(self):
        self.step_counter.assign_add(1)

    def scale_loss(self, loss):
        """``loss`` multiplied by the dynamic loss scale with ``loss_scale`` on (the initial scale before the
        wrapper is built), else as the inner optimizer scales it.

        Args:
          loss: the loss value.

        Returns:
          The scaled loss.
        """
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
        """Not supported: raises ValueError (the exchange is a stateful collective)."""
        raise ValueError("DistributedOptimizer exchanges gradients with a stateful collective and "
                         "cannot be used with stateless_apply")

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate (setting it sets the inner one's)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        """Sets the inner optimizer's learning rate (ignored while the wrapper is being constructed, before it
        has one)."""
        if hasattr(self, "inner_optimizer"):
            self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        """The inner optimizer's step counter."""
        return self.inner_optimizer.iterations

    def finalize_variable_values(self, var_list):
        """Keras calls this at the end of ``fit``: a pipelined round still in flight is finished
        (its result is held for the next step, and saved with checkpoints).  On this route (no
        ``SparseStrategy``) the model's BatchNormalization moving statistics, which each rank
        computed from its own batches, are then replaced by their mean over the ranks (as
        ``MetricAverage`` does at each epoch's end), and the replicas are compared
        (:func:`~tfsparse.keras.replicas.check_replicas`): every rank raises ``ReplicasDiverged``,
        naming the first variable whose bits differ, rather than ending apart in silence.  Not
        after a ``fit`` that a callback stopped (``model.stop_training``): its ranks may have
        stopped at different steps, and a rank that left early must not wait in a collective
        that the others, still training, never join (``ReplicaCheck`` after ``MetricAverage``,
        which agrees on stopping, checks such runs)."""
        self.exchange.flush()
        self.inner_optimizer.finalize_variable_values(var_list)
        model = keras_model_running()
        if model is not None and _sparse_strategy() is None and getattr(model, "optimizer", None) is self \
                and self.exchange.comm.size > 1 and not getattr(model, "stop_training", False):
            average_moving_statistics(model, self.exchange.comm)
            check_replicas(model, communicator=self.exchange.comm, what="at the end of fit")

    # -- checkpoints: every rank's exchange state ---------------------------
    def save_own_variables(self, store):
        """Keras' saving: ``LossScaleOptimizer``'s variables, then the exchange's state
        (:meth:`tfsparse.checkpoint.Checkpointer.entries`: every rank's when it was gathered since the last
        round, as ``ModelCheckpoint`` does, else this rank's own).

        Args:
          store: Keras' weights store, written into.
        """
        super().save_own_variables(store)
        for key, value in self.checkpointer.entries().items():
            store[key] = value

    def load_own_variables(self, store):
        """Keras' loading: the optimizer's variables from ``store``, then this rank's exchange state from the
        checkpoint entries in it (:meth:`tfsparse.checkpoint.Checkpointer.restore`).

        Args:
          store: Keras' weights store, read from.
        """
        keys = list(store.keys())
        super().load_own_variables({k: store[k] for k in keys if not is_entry(k)})
        self.checkpointer.restore({k: store[k] for k in keys if is_entry(k)})

    def get_config(self):
        """The settings' serialisation (:meth:`tfsparse.settings.Settings.config`, with the current
        density) and the wrapper's own arguments."""
        return {"name": self.name,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                **self.exchange.config(), "loss_scale": self.loss_scale, "initial_scale": self.initial_scale,
                "dynamic_growth_steps": self.dynamic_growth_steps}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The wrapper that :meth:`get_config`'s ``config`` describes.

        Args:
          config: a dictionary from :meth:`get_config`.
          custom_objects: Keras' custom objects, for deserializing the inner optimizer.

        Returns:
          A new ``DistributedOptimizer`` made with the config's arguments.
        """
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
