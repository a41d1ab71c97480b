"""``horovod.tensorflow.keras.callbacks`` for Keras 3, with Horovod's meaning.

>>> callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),   # rank 0's state after batch 0
...              hvd.callbacks.MetricAverageCallback(),               # epoch logs: the ranks' mean
...              hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1 * hvd.size(), warmup_epochs=5),
...              hvd.callbacks.LearningRateScheduleCallback(0.1 * hvd.size(), multiplier=0.1, start_epoch=30)]

What differs from Horovod: ``device=`` is accepted and has no effect.  Momentum correction (the
learning-rate callbacks' ``momentum_correction=True``) multiplies an SGD optimizer's velocity by
``new_lr / old_lr`` when the rate changes -- the same update as Horovod's scaling of the momentum
for that one batch for plain momentum (with ``nesterov=True`` the look-ahead term keeps the
unscaled momentum); Keras 3 compiles ``SGD``'s momentum into the step as a constant, so the
velocity, a variable, is what can change; optimizers without SGD's momentum are left alone, as
Horovod leaves optimizers without a ``momentum``.
"""
from __future__ import annotations

import numbers

import keras
import numpy as np

from ....collectives.agreement import check_agreement
from ....keras.ownership import keep_own, own_variables
from ....keras.replicas import name_of
from ....keras.sync import broadcast_variables, run_on_model
from .. import _check_root, _comm, rank, size

_PROVIDED = ("BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
             "LearningRateWarmupCallback")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """After the first batch, every rank takes ``root_rank``'s model and optimizer variables.

    The model's weights and non-trainable state (not the random-seed states) and the optimizer's
    variables -- those the first step created included -- except ``local_variables``.

    Args:
      root_rank: the rank whose variables everyone takes, from 0 to ``size() - 1``.
      device: accepted and ignored (Horovod's device for the broadcast).
      local_variables: a variable or a list of them that stay each rank's own (also
        :meth:`register_local_var`): not broadcast here, not averaged with the moving statistics
        (a BatchNormalization's moving mean or variance, :func:`tfsparse.keras.callbacks.average_moving_statistics`),
        and left out of the replica checks
        (:func:`tfsparse.keras.replicas.check_replicas`, the end of every ``fit``); trainable ones
        still start from rank 0's values (``DistributedOptimizer`` broadcasts the trainable
        variables at its first step).

    Raises:
      ValueError: ``root_rank`` not a rank of the job.
    """

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = _check_root(root_rank)
        self.device = device
        self.broadcast_done = False
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, keras.Variable) or hasattr(local_variables, "assign"):
            local_variables = [local_variables]
        # id -> variable: held, so that no other variable can take a dead one's id (Keras 3
        # variables have no .ref())
        self._local = {id(v): v for v in local_variables}

    def register_local_var(self, var) -> None:
        """``var`` stays this rank's own: not broadcast, not averaged with the moving statistics,
        left out of the replica checks (a train step made before is made anew:
        :func:`~tfsparse.keras.ownership.keep_own`).  Register it before ``fit``, on every rank
        alike: the callback checks at ``fit``'s start that the ranks agree.

        Args:
          var: a variable of the model or of its optimizer.
        """
        self._local[id(var)] = var
        if self.model is not None:
            keep_own(self.model, [var])

    def on_train_begin(self, logs=None):
        """The local variables are left out of the replica checks and of the moving statistics'
        averaging from the start (``SparseStrategy``'s step is traced with the first batch, before
        the broadcast).  Collective: the variables the model keeps local -- these and any kept
        before -- must be the same on every rank (by their place in the model or its optimizer:
        layer names are numbered per process), or every rank raises ``ConfigurationMismatch``
        before the first step and keeps none of them: the moving statistics averaged over the
        ranks must be the same variables on each."""
        kept = {**{id(v): v for v in own_variables(self.model)}, **self._local}
        places = sorted((_place(self.model, v) for v in kept.values()), key=repr)
        run_on_model(self.model, lambda comm: check_agreement(
            comm, "BroadcastGlobalVariablesCallback's local_variables", places,
            "pass the same local_variables (and register_local_var calls) on every rank"))
        keep_own(self.model, self._local.values())

    def on_batch_end(self, batch, logs=None):
        """After the first batch only: every rank takes ``root_rank``'s model and optimizer variables, except
        the random-seed states and the variables registered as local."""
        if self.broadcast_done:
            return
        comm = _comm()
        # Keras 3's random-seed states stay each rank's own (Dropout masks differ between ranks,
        # as each process's random stream did under Horovod with tf.keras)
        variables = [v for v in self.model.variables
                     if id(v) not in self._local and "seed_generator" not in getattr(v, "path", v.name)]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            variables += [v for v in optimizer.variables if id(v) not in self._local]
        broadcast_variables(variables, self.root_rank, comm)
        self.broadcast_done = True


def _place(model, variable) -> list:
    """Where ``variable`` sits, alike on every rank that built the same model: its index among the
    model's (or its optimizer's) variables, with its shape and dtype; else its path."""
    shape, dtype = [int(d) for d in variable.shape], str(variable.dtype)
    optimizer = getattr(model, "optimizer", None)
    for owner, variables in (("model", model.variables), ("optimizer", getattr(optimizer, "variables", ()))):
        for i, v in enumerate(variables):
            if v is variable:
                return [owner, i, shape, dtype]
    return ["elsewhere", name_of(variable), shape, dtype]


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, every number in the logs becomes its mean over the ranks.

    Loss, metrics and ``val_`` ones, in place, for the callbacks after this one and the ``History``
    (put it before the callbacks that read the logs, as under Horovod).

    Args:
      device: accepted and ignored (Horovod's device for the allreduce).
    """

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        """Checks that every rank's epoch logs have the same numeric keys (collective), then replaces each such
        value by its mean over the ranks."""
        if not logs:
            return
        comm = _comm()
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.number)) and not isinstance(v, bool))
        check_agreement(comm, "the epoch logs MetricAverageCallback averages", keys,
                        "Every rank must compile the same metrics and run the same callbacks before this one.")
        if comm.size == 1 or not keys:
            return
        mean = comm.allreduce(np.array([float(logs[k]) for k in keys], np.float64)) / comm.size
        for k, v in zip(keys, mean):
            logs[k] = float(v)


def _learning_rate(optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` up to ``end_epoch``.

    ``end_epoch`` is not included. The rate is set at each epoch's first batch (``staircase``), or
    at every batch with a fractional epoch (``epoch + batch / steps_per_epoch``). The epoch logs
    get ``lr``.

    Args:
      initial_lr: a number > 0, or None: the optimizer's rate when training begins.
      multiplier: a function of the epoch, or a number ``m`` for ``m ** (epoch - start_epoch)``.
      start_epoch: the first epoch it sets the rate in.
      end_epoch: the epoch it stops at (None: never).
      staircase: set the rate once per epoch (True) or at every batch (False).
      momentum_correction: when the rate changes, multiply an SGD optimizer's velocity by the new
        rate over the old one (Horovod's momentum correction, see the module).
      steps_per_epoch: the batches per epoch, for ``staircase=False`` (None: taken from ``fit``).

    Raises:
      ValueError: ``initial_lr`` or ``multiplier`` not valid; at the start of training, without
        ``staircase``, when the epochs' length is unknown.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is not None and not (isinstance(initial_lr, numbers.Real) and initial_lr > 0):
            raise ValueError(f"initial_lr={initial_lr!r} is not valid; accepted: a number > 0, or None (the "
                             f"optimizer's learning rate when training begins)")
        if not callable(multiplier) and not isinstance(multiplier, numbers.Real):
            raise ValueError(f"multiplier={multiplier!r} is not valid; accepted: a number or a function of the epoch")
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None

    def on_train_begin(self, logs=None):
        """Takes the optimizer's learning rate as ``initial_lr`` when none was given; without ``staircase``, takes
        ``steps_per_epoch`` from ``fit`` when none was given (ValueError when the epochs' length is unknown)."""
        if self.initial_lr is None:
            self.initial_lr = _learning_rate(self.model.optimizer)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"steps_per_epoch=None: {type(self).__name__} could not find the number of steps "
                                 f"per epoch (a dataset of unknown length); accepted: steps_per_epoch=<steps>")

    def on_epoch_begin(self, epoch, logs=None):
        """Records the epoch, for the adjustments at its batches."""
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        """From ``start_epoch`` up to ``end_epoch``: sets the learning rate, at the epoch's first batch
        (``staircase``) or at every batch from the fractional epoch; with ``momentum_correction``, an SGD's
        velocity is scaled by the new rate over the old one."""
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(epoch)
        elif not self.staircase:
            self._adjust(epoch + float(batch) / self.steps_per_epoch)

    def _adjust(self, epoch) -> None:
        optimizer = self.model.optimizer
        old = _learning_rate(optimizer)
        new = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if self.momentum_correction and old > 0 and isinstance(inner, keras.optimizers.SGD) and inner.momentum \
                and getattr(inner, "momentums", None):
            ratio = _learning_rate(optimizer) / old
            for velocity in inner.momentums:
                velocity.assign(velocity * ratio)

    def on_epoch_end(self, epoch, logs=None):
        """Adds the learning rate to the epoch's logs as ``lr``."""
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warm-up, as Horovod's: the learning rate rises to ``initial_lr`` over ``warmup_epochs``.

    At every batch from ``initial_lr / size()`` to ``initial_lr``
    (``initial_lr / size() * (e * (size() - 1) / warmup_epochs + 1)`` at fractional epoch ``e``,
    counted from the batch's end).

    Args:
      initial_lr: the rate at the warm-up's end (usually the single-rank rate times ``size()``);
        None: the optimizer's rate when training begins.
      warmup_epochs: the epochs the warm-up lasts.
      momentum_correction: scale an SGD optimizer's velocity with each change of the rate.
      steps_per_epoch: the batches per epoch (None: taken from ``fit``).
      verbose: rank 0 says when the warm-up ends (> 0).
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        """Adds ``lr`` to the epoch's logs; after the warm-up's last epoch, with ``verbose``, rank 0 prints that
        the warm-up has ended."""
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_learning_rate(self.model.optimizer):g}.")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"tfsparse.horovod.tensorflow.keras.callbacks does not provide "
                         f"horovod.tensorflow.keras.callbacks.{name}; provided: {', '.join(_PROVIDED)}")
