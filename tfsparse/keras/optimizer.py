"""DistributedOptimizer: a Keras optimizer wrapper (like ``keras.optimizers.LossScaleOptimizer``)
that exchanges gradients across ranks before the wrapped optimizer applies them.

>>> opt = tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
...                                           algorithm="topk", density=0.01)
>>> model.compile(optimizer=opt, loss=...)
>>> model.fit(x, y, callbacks=[tfsparse.keras.callbacks.BroadcastInitialState()])

The residual (error feedback) is an optimizer variable, so ``model.save`` /
``ModelCheckpoint`` store it and loading restores it.  Without a strategy the
summed gradient is divided by the world size (Horovod-style averaging); inside a
:class:`~tfsparse.SparseStrategy` scope Keras already scales the loss by 1/P, and
the strategy's own all-reduce is bypassed.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras.src.saving import serialization_lib

from ..exchange import GradientExchange, check_float_variables, validate_config

_ALL_RESIDUALS = "tfsparse_residuals_all_ranks"
_BASE_DEFAULTS = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None,
                  "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
                  "loss_scale_factor": None, "gradient_accumulation_steps": None}


@keras.saving.register_keras_serializable(package="tfsparse")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wraps ``inner_optimizer``; gradients go through memory -> compressor -> aggregator first.

    Args:
      inner_optimizer: the ``keras.optimizers.Optimizer`` that applies the update.
      algorithm: aggregator name (``"dense"``, ``"topk"``, ...).
      density: fraction of gradient elements each rank sends, in (0, 1].
      communicator: transport (default: ``tfsparse.init()``'s world).
      algorithm_options: dict of options for the aggregator.
    """

    def __init__(self, inner_optimizer, algorithm: str = "topk", density: float = 0.01, *,
                 communicator=None, algorithm_options: dict | None = None, name: str | None = None,
                 **kwargs):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(f"inner_optimizer must be a keras.optimizers.Optimizer instance, got "
                             f"{type(inner_optimizer).__name__}; e.g. DistributedOptimizer(keras.optimizers.SGD(0.1))")
        validate_config(algorithm, density)
        for arg, default in _BASE_DEFAULTS.items():
            if arg in kwargs and kwargs.pop(arg) != default:
                raise ValueError(f"DistributedOptimizer does not take `{arg}`; set it on the inner optimizer")
        if kwargs:
            raise ValueError(f"DistributedOptimizer got unexpected arguments: {sorted(kwargs)}")
        super().__init__(learning_rate=0.0, name=name or f"Distributed{type(inner_optimizer).__name__}")
        self.inner_optimizer = inner_optimizer
        self.algorithm_options = dict(algorithm_options or {})
        self.exchange = GradientExchange(algorithm, density, communicator=communicator,
                                         **self.algorithm_options)
        self.residual = None
        self._gathered_residuals = None

    @property
    def algorithm(self) -> str:
        return self.exchange.algorithm

    @property
    def density(self) -> float:
        return self.exchange.density

    def build(self, var_list):
        check_float_variables(var_list)
        n = sum(int(np.prod(v.shape, dtype=np.int64)) for v in var_list)
        if self.exchange.uses_memory:
            self.residual = self.add_variable(shape=(n,), initializer="zeros", dtype="float32",
                                              aggregation="none", name="residual")
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

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
        from ..strategies.sparse_strategy import SparseStrategy

        strategy = tf.distribute.get_strategy()
        in_sparse = isinstance(strategy, SparseStrategy)
        summed = self.exchange([g for g, _ in pairs], self.residual)
        if not in_sparse:
            p = float(self.exchange.comm.size)
            summed = [s / tf.cast(p, s.dtype) for s in summed]
        if in_sparse:
            with strategy.extended.passthrough():
                self.inner_optimizer.apply(summed, trainable_variables)
        else:
            self.inner_optimizer.apply(summed, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError("DistributedOptimizer exchanges gradients with a stateful collective and "
                         "cannot be used with stateless_apply")

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

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
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- checkpoints: every rank's residual -------------------------------
    def gather_residuals(self):
        """Collective (all ranks): gathers every rank's residual to this object, so that a
        checkpoint written by rank 0 holds all of them.  Called by
        ``tfsparse.keras.callbacks.ModelCheckpoint`` before it saves."""
        if self.residual is None:
            return None
        comm = self.exchange.comm
        parts = comm.allgather(np.asarray(self.residual.numpy(), dtype=np.float32))
        self._gathered_residuals = np.stack(parts)
        return self._gathered_residuals

    def save_own_variables(self, store):
        super().save_own_variables(store)
        if self._gathered_residuals is not None:
            store[_ALL_RESIDUALS] = self._gathered_residuals

    def load_own_variables(self, store):
        keys = list(store.keys())
        plain = {k: store[k] for k in keys if k != _ALL_RESIDUALS}
        super().load_own_variables(plain)
        if _ALL_RESIDUALS in keys and self.residual is not None:
            every = np.asarray(store[_ALL_RESIDUALS], dtype=np.float32)
            comm = self.exchange.comm
            if every.shape[0] == comm.size:
                self.residual.assign(every[comm.rank])
            else:
                # a different world size: keep the total pending update, spread evenly
                self.residual.assign(every.sum(axis=0) / comm.size)

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": serialization_lib.serialize_keras_object(self.inner_optimizer),
            "algorithm": self.exchange.algorithm,
            "density": self.exchange.density,
            "algorithm_options": dict(self.algorithm_options),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = serialization_lib.deserialize_keras_object(config.pop("inner_optimizer"),
                                                           custom_objects=custom_objects)
        return cls(inner, **config)
