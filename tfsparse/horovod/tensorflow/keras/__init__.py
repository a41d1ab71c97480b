"""``horovod.tensorflow.keras`` for Keras 3: Horovod's ``DistributedOptimizer`` and callbacks on
tfsparse's exchange.

>>> import tfsparse.horovod.tensorflow.keras as hvd    # was: import horovod.tensorflow.keras as hvd
>>> hvd.init()
>>> opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
>>> model.compile(optimizer=opt, loss=..., metrics=["accuracy"])   # no experimental_run_tf_function
>>> model.fit(dataset, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
...                               hvd.callbacks.MetricAverageCallback(),
...                               hvd.callbacks.LearningRateWarmupCallback(0.001 * hvd.size(), warmup_epochs=3)])

:func:`DistributedOptimizer` is lossless by default, as Horovod's is: every gradient is summed
densely in float32 (``compression=hvd.Compression.fp16``: sent as float16, summed in float32) and
divided by the ranks (``op=hvd.Average``; ``op=hvd.Sum`` keeps the sum).  tfsparse's algorithms
are one keyword away: ``algorithm="gtopk", density=0.01``, ``algorithm="auto"``, or any other
setting of :class:`tfsparse.keras.DistributedOptimizer`, which it is.

What differs from Horovod: ``device_dense``, ``device_sparse`` and ``sparse_as_dense`` are
accepted and have no effect (an Embedding's gradient always travels dense); Horovod's fusion
groups (``num_groups``, ``groups``) are not (tfsparse's buckets fuse the gradients); there are no
process sets; the optimizer
is not a subclass of the wrapped optimizer's class but a ``keras.optimizers.LossScaleOptimizer``
wrapping it (``opt.inner_optimizer``), so ``model.save`` stores the wrapper and
``keras.models.load_model`` restores it; at the end of ``fit`` the BatchNormalization moving
statistics are averaged over the ranks and the replicas compared
(:class:`tfsparse.keras.DistributedOptimizer`).  On a GPU, compile with ``jit_compile=False``:
Keras 3 turns XLA on there by default when no distribution strategy is in use (tf.keras did not),
and XLA cannot compile the exchange, which runs from Python (a ``ValueError`` at the first step
says so).  Names not provided raise an ``AttributeError`` naming them.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from .... import _checks
from ...._tf_private import optimizer_variables
from ....keras.optimizer import DistributedOptimizer as _SparseOptimizer
from ....keras.optimizer import _sparse_strategy
from ....tf_glue import on_values
from .. import (Average, Compression, Sum, _check_process_set, _resolve_op, cross_rank, cross_size,
                global_process_set, init, is_initialized, local_rank, local_size, rank, shutdown, size)
from ..basics import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous,  # noqa: F401
                      mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from ..basics import NAMES as _BASICS
from .. import allgather as _allgather
from .. import allreduce as _allreduce
from .. import broadcast as _broadcast
from . import callbacks

_KERAS_OPS = {Average: "hvd.Average", Sum: "hvd.Sum"}


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Horovod's Keras ``allreduce``: ``value`` reduced over the ranks.

    Args:
      value: anything ``tf.constant`` takes (a number, a list, a numpy array), the same shape on
        every rank.
      name: accepted and ignored (Horovod's op name).
      average: deprecated, as in Horovod (``op`` instead).
      prescale_factor: multiplies each rank's value before the reduction.
      postscale_factor: multiplies the result after it.
      op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min`` or ``hvd.Max``.
      compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16``.

    Returns:
      A tensor: :func:`tfsparse.horovod.tensorflow.allreduce` of ``value``.
    """
    return _allreduce(tf.constant(value), average=average, compression=compression, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allgather(value, name=None):
    """Horovod's Keras ``allgather``: every rank's ``value`` concatenated on the first dimension.

    Args:
      value: anything ``tf.constant`` takes, of rank >= 1; the first dimension may differ between
        ranks, the others may not.
      name: accepted and ignored (Horovod's op name).

    Returns:
      A tensor: the ranks' values in rank order (:func:`tfsparse.horovod.tensorflow.allgather`).
    """
    return _allgather(tf.constant(value))


def broadcast(value, root_rank, name=None):
    """Horovod's Keras ``broadcast``: ``root_rank``'s ``value`` on every rank.

    Args:
      value: anything ``tf.constant`` takes, the same shape and dtype on every rank.
      root_rank: the rank whose value everyone gets.
      name: accepted and ignored (Horovod's op name).

    Returns:
      A tensor: ``root_rank``'s value (:func:`tfsparse.horovod.tensorflow.broadcast`).
    """
    return _broadcast(tf.constant(value), root_rank)


@keras.saving.register_keras_serializable(package="tfsparse.horovod")
class HorovodOptimizer(_SparseOptimizer):
    """What :func:`DistributedOptimizer` returns: :class:`tfsparse.keras.DistributedOptimizer` with Horovod's reduction.

    Horovod's reduction (``op``, ``gradient_predivide_factor``) and local accumulation
    (``backward_passes_per_step``, ``average_aggregated_gradients``). With
    ``backward_passes_per_step=N > 1`` each rank adds its gradients into accumulators for ``N``
    steps; the ``N``-th exchanges the accumulated sum (divided by ``N`` when
    ``average_aggregated_gradients``) and applies it; the steps between exchange nothing and only
    advance ``iterations``, as Horovod's do.

    Args:
      inner_optimizer: the Keras 3 optimizer that applies the reduced gradients.
      op: ``hvd.Average`` (default) or ``hvd.Sum``; inside a ``SparseStrategy`` scope only the default.
      gradient_predivide_factor: a number > 0 (Average only): each rank's gradient divided by it
        before the sum, the sum multiplied by it over the ranks after.
      backward_passes_per_step: an integer >= 1: the steps whose gradients each exchange sums; not
        with loss scaling.
      average_aggregated_gradients: divide the accumulated sum by ``backward_passes_per_step``.
      **kwargs: any keyword of :class:`tfsparse.keras.DistributedOptimizer`.

    Raises:
      ValueError: an argument outside the accepted values, naming it, before any step.
    """

    def __init__(self, inner_optimizer, *, op=Average, gradient_predivide_factor=1.0, backward_passes_per_step=1,
                 average_aggregated_gradients=False, **kwargs):
        op = _resolve_op(op, None)
        _checks.choice("op", op, tuple(_KERAS_OPS), accepted="hvd.Average, hvd.Sum (DistributedOptimizer, as in Horovod)")
        factor = float(gradient_predivide_factor)
        if not factor > 0:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} is not valid; accepted: a "
                             f"number > 0")
        if factor != 1.0 and op != Average:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} needs op=hvd.Average "
                             f"(as in Horovod)")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} is not valid; accepted: an "
                             f"integer >= 1")
        if _sparse_strategy() is not None and (op != Average or factor != 1.0 or backward_passes_per_step > 1):
            raise ValueError(f"op={_KERAS_OPS[op]}, gradient_predivide_factor={factor}, backward_passes_per_step="
                             f"{backward_passes_per_step} inside a SparseStrategy scope: the strategy averages every "
                             f"step; accepted there: the defaults (hvd.Average, 1.0, 1)")
        if backward_passes_per_step > 1 and (kwargs.get("loss_scale") or (
                kwargs.get("loss_scale") is None and keras.config.dtype_policy().name == "mixed_float16")):
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} with loss scaling (the "
                             f"mixed_float16 policy or loss_scale=True) is not supported; accepted: "
                             f"backward_passes_per_step=1, or loss_scale=False")
        super().__init__(inner_optimizer, **kwargs)
        self.op = op
        self.gradient_predivide_factor = factor
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = bool(average_aggregated_gradients)

    def build(self, var_list):
        """Builds the wrapper (:meth:`tfsparse.keras.DistributedOptimizer.build`) and, with
        ``backward_passes_per_step > 1``, this rank's gradient accumulators: kept apart from the optimizer's
        variables, so that no broadcast overwrites them, no replica check compares them and no file saves them.

        Args:
          var_list: the variables the optimizer trains.
        """
        super().build(var_list)
        if self.backward_passes_per_step > 1:
            # each rank's own partial sums: outside the optimizer's variables (as Horovod keeps them),
            # so that no broadcast overwrites them and no replica check compares them; not saved
            self._local = _RankLocal(var_list)

    def _divisor(self) -> float:
        if self.op == Sum:
            return 1.0
        return super()._divisor() / self.gradient_predivide_factor

    def apply(self, grads, trainable_variables=None):
        """Applies ``grads``, each divided by ``gradient_predivide_factor`` first: exchanged and applied at once
        (:meth:`tfsparse.keras.DistributedOptimizer.apply`) -- or, with ``backward_passes_per_step=N > 1``,
        added to this rank's accumulators, whose sum every ``N``-th call exchanges (divided by ``N`` with
        ``average_aggregated_gradients``), applies and zeroes; the calls in between only advance
        ``iterations``.  A missing (None) gradient -- a variable the loss does not reach -- is left out, as
        Horovod leaves it: not accumulated, not exchanged, not updated (with Keras' warning).

        Args:
          grads: the gradients, one per variable.
          trainable_variables: the variables they belong to (default: those the optimizer was built for).
        """
        grads = list(grads)
        if self.gradient_predivide_factor != 1.0:
            grads = [_scaled(g, 1.0 / self.gradient_predivide_factor) for g in grads]
        if self.backward_passes_per_step == 1:
            return super().apply(grads, trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = trainable_variables if trainable_variables is not None else optimizer_variables(self)
        self._start_from_root(list(variables))
        local = self._local
        present = [g is not None for g in grads]  # the traced model's: the same in every pass and on every rank
        for total, g in zip(local.sums, grads):
            if g is not None:
                total.assign_add(tf.convert_to_tensor(g))
        local.passes.assign_add(1)
        n = self.backward_passes_per_step

        def exchange_and_apply():
            summed = [tf.identity(t) if p else None for t, p in zip(local.sums, present)]
            if self.average_aggregated_gradients:
                summed = [None if s is None else s / tf.cast(n, s.dtype) for s in summed]
            _SparseOptimizer.apply(self, summed, trainable_variables)
            for total in local.sums:
                total.assign(tf.zeros_like(total))
            local.passes.assign(0)

        def count_pass():
            self.inner_optimizer.iterations.assign_add(1)

        keras.ops.cond(keras.ops.equal(local.passes, n), exchange_and_apply, count_pass)

    def get_config(self):
        """The wrapper's configuration (:meth:`tfsparse.keras.DistributedOptimizer.get_config`) with Horovod's
        arguments: ``op``, ``gradient_predivide_factor``, ``backward_passes_per_step`` and
        ``average_aggregated_gradients``."""
        return {**super().get_config(), "op": self.op, "gradient_predivide_factor": self.gradient_predivide_factor,
                "backward_passes_per_step": self.backward_passes_per_step,
                "average_aggregated_gradients": self.average_aggregated_gradients}


class _RankLocal:
    """A rank's gradient sums over the backward passes of one exchange, and the count of those
    passes: plain ``tf.Variable`` objects held where Keras' trackers do not look."""

    def __init__(self, var_list):
        with tf.init_scope():
            self.sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in var_list]
            self.passes = tf.Variable(0, dtype=tf.int64, trainable=False)


def _scaled(g, factor: float):
    return on_values(g, lambda v: v * tf.cast(factor, v.dtype))


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True, **tfsparse_settings):
    """Horovod's ``DistributedOptimizer(optimizer, ...)``: ``optimizer`` applies the gradients reduced over the ranks.

    Their mean (``op=hvd.Average``) or sum (``hvd.Sum``), accumulated over
    ``backward_passes_per_step`` steps first (see :class:`HorovodOptimizer`). Lossless by default
    (``algorithm="dense"``, float32, as Horovod's); ``algorithm="gtopk", density=0.01`` or
    ``algorithm="auto"`` choose one of tfsparse's exchanges instead.

    Args:
      optimizer: a Keras 3 optimizer (``keras.optimizers.Optimizer``).
      name: the wrapper's name.
      device_dense: accepted and ignored (the exchange runs where the gradients are).
      device_sparse: accepted and ignored.
      compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16`` (a float16 wire,
        the same as ``wire_dtype="float16"``).
      sparse_as_dense: accepted and ignored (an Embedding's gradient always travels dense).
      gradient_predivide_factor: Average only: each rank's gradient divided by it before the sum,
        the sum multiplied by it over the ranks after.
      op: ``hvd.Average`` (default) or ``hvd.Sum``.
      backward_passes_per_step: an integer >= 1: the steps whose gradients each exchange sums.
      average_aggregated_gradients: divide the accumulated sum by ``backward_passes_per_step``.
      num_groups: Horovod's fusion groups; only the default (0): tfsparse's buckets fuse the gradients.
      groups: only the default (None).
      process_set: only ``hvd.global_process_set``.
      scale_local_gradients: only ``True``.
      **tfsparse_settings: any keyword of :class:`tfsparse.keras.DistributedOptimizer`
        (``algorithm``, ``density``, ``wire_dtype``, ``loss_scale``, ...).

    Returns:
      A :class:`HorovodOptimizer` wrapping ``optimizer``; pass it to ``model.compile``.

    Raises:
      ValueError: an argument outside the accepted values, naming it, before any step.
    """
    _check_process_set(process_set)
    if compression is not Compression.none and compression is not Compression.fp16:
        raise ValueError(f"compression={compression!r} is not supported; accepted: hvd.Compression.none, "
                         f"hvd.Compression.fp16")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"optimizer={optimizer!r} is not supported; accepted: a keras.optimizers.Optimizer "
                         f"(Keras 3), e.g. keras.optimizers.SGD(0.01)")
    if num_groups not in (0, None) or groups is not None:
        raise ValueError(f"num_groups={num_groups!r}, groups={groups!r}: tfsparse's buckets fuse the gradients; "
                         f"accepted: num_groups=0, groups=None")
    if not scale_local_gradients:
        raise ValueError("scale_local_gradients=False is not supported: a Keras optimizer has no local variables "
                         "here; accepted: True")
    if compression is Compression.fp16:
        if tfsparse_settings.get("wire_dtype", "float16") != "float16":
            raise ValueError(f"compression=hvd.Compression.fp16 and wire_dtype={tfsparse_settings['wire_dtype']!r}: "
                             f"give one of them")
        tfsparse_settings["wire_dtype"] = "float16"
    if tfsparse_settings.get("algorithm") is None and tfsparse_settings.get("density") is None \
            and tfsparse_settings.get("settings") is None and _sparse_strategy() is None:
        tfsparse_settings["algorithm"] = "dense"  # Horovod's allreduce: lossless (a strategy's own, inside one)
    return HorovodOptimizer(optimizer, name=name, op=op, gradient_predivide_factor=gradient_predivide_factor,
                            backward_passes_per_step=backward_passes_per_step,
                            average_aggregated_gradients=average_aggregated_gradients, **tfsparse_settings)


_PROVIDED = ("init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
             "cross_size", "allreduce", "allgather", "broadcast", "DistributedOptimizer", "Compression", "Average",
             "Sum", "callbacks", "global_process_set", *_BASICS)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"tfsparse.horovod.tensorflow.keras does not provide horovod.tensorflow.keras.{name}; "
                         f"provided: {', '.join(_PROVIDED)}")
