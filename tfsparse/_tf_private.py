"""The only module that touches TensorFlow's and Keras' private APIs.

SparseStrategy subclasses ``OneDeviceStrategy``/``OneDeviceExtended`` (one device
per process) and overrides a handful of hooks, its replica context's ``all_reduce`` among them (no
custom gradient registered for ever where none can be asked for); it is a Keras ``KerasSaveable`` so that
Keras model files hold the exchange's state; the exchange refuses XLA; and when Keras
distributes a dataset, the strategy reads how many steps its epoch iterator will run (and whether
they were given), and for which model method, and may build what an ``evaluate``'s model has not
built yet from the data's first batch, as Keras would (:func:`keras_build_before_evaluate`); ``tfsparse.keras.callbacks.BackupAndRestore`` tells Keras' ``fit`` the epoch
to resume from, as Keras' own callback does; the strategy knows Keras' steps and its loss-scale
optimizer's finiteness check by their method names (:func:`keras_replica_call`) and TensorFlow's
error for mixed strategies by its text (:func:`mixes_strategies`); ``DistributedOptimizer``, a
``LossScaleOptimizer``, runs that optimizer's own apply and skip-step branch
(:func:`loss_scale_apply`, :func:`loss_scale_skip_step`) and reads an optimizer's built variables
(:func:`optimizer_variables`).  Those are private APIs, so they
are used here alone, behind a version check (and the hooks the strategy overrides,
:data:`EXTENDED_HOOKS`, are checked to exist); ``tests/test_layering.py`` fails on a
``tensorflow.python`` or ``keras.src`` import anywhere else.
"""
from __future__ import annotations

import tensorflow as tf

TESTED = ((2, 16), (2, 21))  # inclusive range of TF minor versions this module was tested with


def _check_version():
    major, minor = (int(p) for p in tf.__version__.split(".")[:2])
    if not TESTED[0] <= (major, minor) <= TESTED[1]:
        import warnings

        warnings.warn(f"tfsparse.SparseStrategy uses private tf.distribute hooks tested with TF "
                      f"{TESTED[0][0]}.{TESTED[0][1]}-{TESTED[1][0]}.{TESTED[1][1]}; found {tf.__version__}. "
                      f"If training misbehaves, use tfsparse.keras.DistributedOptimizer instead.",
                      RuntimeWarning, stacklevel=3)


_check_version()

from tensorflow.python.distribute import one_device_strategy as _one_device  # noqa: E402

OneDeviceStrategy = _one_device.OneDeviceStrategy
OneDeviceExtended = _one_device.OneDeviceExtended

#: the private hooks of ``OneDeviceExtended`` that ``SparseExtended`` overrides
#: (tfsparse/strategies/sparse_strategy.py, which calls :func:`check_extended_hooks` as it is
#: imported: a strategy whose override would never be called is refused, while the optimizer
#: route, which needs none of them, keeps working)
EXTENDED_HOOKS = ("_create_variable", "_experimental_distribute_dataset", "_batch_reduce_to", "_reduce_to",
                  "_call_for_each_replica", "_num_replicas_in_sync", "_in_multi_worker_mode")


def check_extended_hooks() -> None:
    """ImportError naming the :data:`EXTENDED_HOOKS` this TensorFlow lacks, if any."""
    missing = [h for h in EXTENDED_HOOKS if not hasattr(OneDeviceExtended, h)]
    if missing:
        raise ImportError(f"tfsparse.SparseStrategy needs TensorFlow's OneDeviceExtended.{', '.join(missing)}, "
                          f"which TensorFlow {tf.__version__} does not have (tested with TensorFlow "
                          f"{TESTED[0][0]}.{TESTED[0][1]}-{TESTED[1][0]}.{TESTED[1][1]}); "
                          f"tfsparse.keras.DistributedOptimizer does not need them")

from tensorflow.python.distribute import distribute_lib as _distribute_lib  # noqa: E402
from tensorflow.python.eager import record as _record  # noqa: E402


class _ReplicaContext(_one_device._OneDeviceReplicaContext):
    """``OneDeviceStrategy``'s replica context, whose ``all_reduce`` wraps the reduction in no
    custom gradient while no tape records.

    TF wraps every ``all_reduce`` in ``tf.custom_gradient``; inside a ``tf.function`` that
    registers a closure holding this context -- hence the strategy and its exchange (residuals,
    buffers: hundreds of MB on a 25M-parameter model) -- in TF's global gradient registry, for the
    life of the process (tensorflow/tensorflow#27492, #97697).  Keras' optimizer reduces the
    gradients after the tape has ended, where no gradient of the reduction can be asked for, so
    there it is the bare reduction (the same ``merge_call`` and ``batch_reduce_to``, the same
    values) and a strategy that nothing else holds is freed.  Under a recording tape (a
    synchronized BatchNormalization's moments) TF's own path runs, gradient and all."""

    def all_reduce(self, reduce_op, value, options=None):
        if _record.could_possibly_record():
            return super().all_reduce(reduce_op, value, options)
        flat = tf.nest.flatten(value)
        if isinstance(reduce_op, str):
            reduce_op = tf.distribute.ReduceOp(reduce_op.upper())

        def batch_all_reduce(strategy, *values):
            return strategy.extended.batch_reduce_to(
                reduce_op, [(v, _distribute_lib._batch_reduce_destination(v)) for v in values], options)

        return tf.nest.pack_sequence_as(value, self.merge_call(batch_all_reduce, args=flat))


def call_for_each_replica(extended, fn, args, kwargs):
    """``OneDeviceExtended._call_for_each_replica`` with :class:`_ReplicaContext`."""
    with tf.device(extended._device), _ReplicaContext(extended._container_strategy()):
        return fn(*args, **(kwargs or {}))

from tensorflow.python.ops import control_flow_util as _control_flow_util  # noqa: E402


def in_xla_context() -> bool:
    """True while tracing a function that XLA will compile (``jit_compile=True``)."""
    return bool(_control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def reject_xla(what: str) -> None:
    if in_xla_context():
        raise ValueError(
            f"jit_compile=True is not supported with tfsparse: {what} runs MPI from Python "
            f"(tf.numpy_function), which XLA cannot compile. Use model.compile(..., jit_compile=False) "
            f"(Keras' jit_compile='auto' turns XLA on where TensorFlow sees a GPU and no distribution "
            f"strategy is in use, as with DistributedOptimizer alone; under SparseStrategy, and on CPU, it is off).")


def _caller_frames(max_depth: int):
    """The caller's callers, innermost first, at most ``max_depth`` of them (read-only) -- for a
    function that iterates this in its own ``for`` loop: the frames above it."""
    import sys

    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


try:  # Keras' base class of everything its saving library walks (private in Keras 3)
    from keras.src.saving.keras_saveable import KerasSaveable  # noqa: E402
except ImportError:  # pragma: no cover - a Keras without it: strategy state is not saved
    KerasSaveable = object


def keras_epoch_steps(max_depth: int = 8):
    """Number of batches Keras will run for the dataset being distributed right now, or None.

    Keras' ``TFEpochIterator.__init__`` calls ``experimental_distribute_dataset``; its
    ``num_batches`` (``steps_per_epoch`` or the data adapter's count) is what every
    rank must agree on -- or the data adapter's count where ``steps_per_epoch`` asks for more,
    as Keras' loop then stops there.  tf.data often reports unknown cardinality for Keras' array
    datasets, so the iterator is found on the call stack (read-only).
    """
    return _batches_run(_epoch_iterator_distributing(max_depth))


def _batches_run(iterator):
    """The batches a Keras ``EpochIterator`` (or None) runs in a pass: its ``num_batches``, or
    the data's own count where ``steps_per_epoch`` asks for more (Keras' loop stops there); None
    where unknown."""
    steps, data = getattr(iterator, "num_batches", None), getattr(iterator, "_num_batches", None)
    if steps is not None and data is not None and data >= 0:
        steps = min(steps, data)
    return int(steps) if steps is not None and steps >= 0 else None


def keras_steps_given(max_depth: int = 8) -> bool:
    """Whether the dataset being distributed right now is iterated for a given number of steps
    (``steps_per_epoch``, ``validation_steps``, ``steps``, or Keras' ``max_steps_per_epoch``)
    rather than whole in each pass (``fit``'s training iterator then goes on where the last epoch
    stopped)."""
    return getattr(_epoch_iterator_distributing(max_depth), "steps_per_epoch", None) is not None


def _epoch_iterator_distributing(max_depth: int):
    """The Keras ``EpochIterator`` distributing a dataset now (on the call stack), or None."""
    try:
        from keras.src.trainers.epoch_iterator import EpochIterator
    except ImportError:
        return None
    for frame in _caller_frames(max_depth + 1):
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, EpochIterator):
            return candidate
    return None


def keras_build_before_evaluate(dataset, max_depth: int = 24) -> None:
    """Where an ``evaluate`` is on the call stack: builds what its model has not built yet (its
    layers, compiled loss and metrics, optimizer) from ``dataset``'s first batch, as Keras'
    ``evaluate`` does next from the first batch of the distributed dataset (``Trainer._symbolic_build``)
    -- for a strategy about to hand Keras batches it could not read there (marked ones).  It
    creates the variables it builds, a collective in a SparseStrategy's scope: every rank calls it
    at the same point.

    Args:
      dataset: the ``tf.data.Dataset`` being distributed, of Keras' ``(x, y[, sample_weight])``
        batches (one is read).
      max_depth: how many callers up to look for ``evaluate``.
    """
    name, model, _ = _keras_frame(max_depth)
    if name != "evaluate" or getattr(model, "_distribute_strategy", None) is None:
        return  # (Keras builds a model made outside any strategy's scope at its step's trace)
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=next(iter(dataset)))


def keras_model_running(max_depth: int = 16):
    """The Keras model whose ``fit``, ``evaluate`` or ``predict`` is on the call stack right now,
    or None (read-only stack inspection, as :func:`keras_distributing`): Keras tells an optimizer's
    ``finalize_variable_values`` the trainable variables, not the model they belong to."""
    return _keras_frame(max_depth)[1]


def keras_optimizer_applying(max_depth: int = 48):
    """The Keras optimizer whose update is being traced right now -- the innermost one on the call
    stack (read-only), unwrapped to the optimizer a ``LossScaleOptimizer`` (or tfsparse's
    ``DistributedOptimizer``) wraps -- or None.  Keras reduces an optimizer's gradients through
    the replica context's ``all_reduce`` with the gradients alone; which optimizer, and so which
    set of variables, they belong to is known only from its caller."""
    import keras

    for frame in _caller_frames(max_depth):
        optimizer = frame.f_locals.get("self")
        if isinstance(optimizer, keras.optimizers.Optimizer):
            while isinstance(getattr(optimizer, "inner_optimizer", None), keras.optimizers.Optimizer):
                optimizer = optimizer.inner_optimizer
            return optimizer
    return None


def optimizer_variables(optimizer) -> list:
    """The variables ``optimizer`` was built for (Keras keeps them privately), or []."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def loss_scale_apply(optimizer, grads, variables) -> None:
    """Keras' ``LossScaleOptimizer`` applying ``grads`` its own way (``optimizer``: one, or a
    subclass): its finiteness test, then the inner optimizer's step and the scale's update, or
    the scale halved (Keras keeps this in a private method, ``_tf_apply``)."""
    optimizer._tf_apply(grads, variables)


def loss_scale_skip_step(optimizer) -> None:
    """Keras' ``LossScaleOptimizer``'s branch for gradients that are not finite: the step skipped,
    the scale halved (private: ``_stateful_handle_non_finite_grads``)."""
    optimizer._stateful_handle_non_finite_grads()


def keras_distributing(max_depth: int = 16):
    """What the dataset being distributed right now is for: ``"fit"`` (``fit``'s training data),
    ``"validation"`` (``fit``'s ``validation_data``), ``"evaluate"``, ``"predict"``, or None --
    the innermost of those Keras model methods on the call stack (Keras does not tell a strategy
    what a dataset is for).
    Keras' ``fit`` distributes its training data before its first epoch, into its local
    ``epoch_iterator``, and its validation data at the first validation, from the same frame
    (read-only: that local already set tells the two apart)."""
    name, _, frame = _keras_frame(max_depth)
    if name == "fit" and "epoch_iterator" in frame.f_locals:
        return "validation"
    return name


def keras_test_batches(max_depth: int = 16):
    """The number of batches of the ``evaluate`` running now (``fit``'s validation included), or
    None (unknown length, or no ``evaluate`` on the call stack): its local ``epoch_iterator``'s
    ``num_batches`` (read-only stack inspection; Keras tells a callback only ``fit``'s steps) --
    or the data's own count where ``steps=`` asks for more, as Keras' loop then stops there.  A
    ``steps=`` is trusted where the data's length is unknown, as Keras trusts it."""
    return _loop_batches("evaluate", max_depth)


def keras_fit_batches(max_depth: int = 16):
    """The number of batches per epoch of the ``fit`` running now, or None (unknown length, or no
    ``fit`` on the call stack): as :func:`keras_test_batches`, from ``fit``'s local
    ``epoch_iterator`` (what ``on_train_begin`` sees as ``params["steps"]``, less where
    ``steps_per_epoch`` asks for more batches than the data holds: Keras' loop stops there)."""
    return _loop_batches("fit", max_depth)


def _loop_batches(loop: str, max_depth: int):
    """The batches of the innermost Keras model method on the call stack where it is ``loop``."""
    name, _, frame = _keras_frame(max_depth + 1)
    return _batches_run(frame.f_locals.get("epoch_iterator") if name == loop else None)


def _keras_frame(max_depth: int):
    import keras

    for frame in _caller_frames(max_depth + 1):
        model = frame.f_locals.get("self")
        if frame.f_code.co_name in ("fit", "evaluate", "predict") and isinstance(model, keras.Model):
            return frame.f_code.co_name, model, frame
    return None, None, None


def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes Keras' running ``fit`` continue from ``epoch`` (None: as asked): Keras' own
    ``BackupAndRestore`` sets the model's private ``_initial_epoch``, which ``fit`` reads after
    ``on_train_begin``."""
    model._initial_epoch = epoch


def mixes_strategies(exc) -> bool:
    """Whether ``exc`` is TensorFlow's error for variables of one strategy used under another
    (it has no class of its own: TensorFlow raises a ``RuntimeError`` whose text says so)."""
    return isinstance(exc, RuntimeError) and "Mixing different tf.distribute.Strategy" in str(exc)


def keras_replica_call(fn) -> tuple[str | None, object]:
    """What Keras runs through the strategy's ``call_for_each_replica``, known by the method's
    name (Keras 3 passes bound methods; autograph may wrap them): ``("train_step", model)``,
    ``("test_step", model)``, ``("check_finite", loss_scale_optimizer)`` -- Keras'
    ``LossScaleOptimizer`` asks the strategy whether every gradient is finite -- or
    ``(None, None)`` for anything else.  A step that is no bound method comes with owner None."""
    owner = fn
    while owner is not None and getattr(owner, "__self__", None) is None:
        owner = getattr(owner, "__wrapped__", None)
    owner = None if owner is None else owner.__self__
    name = getattr(fn, "__name__", "")
    if name == "check_finite":
        return (name, owner) if hasattr(owner, "dynamic_scale") else (None, None)
    return (name, owner) if name in ("train_step", "test_step") else (None, None)
