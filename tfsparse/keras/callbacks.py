"""Keras callbacks for multi-process training.

* :class:`BroadcastInitialState` — start every rank from rank 0's weights and optimizer state.
* :class:`CommunicationStats` — bytes, density and phase times of the exchange in each epoch's logs.
* :class:`MetricAverage` — average epoch logs across ranks (for the DistributedOptimizer
  route; under SparseStrategy metrics are already averaged every step).
* :class:`StepCountCheck` — fail fast when ranks have different numbers of batches.
* :class:`ModelCheckpoint` — rank 0 writes; the file holds every rank's exchange state.
* :class:`DSyncWarmUp` — Pipe-SGD's warm-up: the first epochs synchronous and float32.
* :func:`rank_zero_only` — run a callback (ModelCheckpoint, TensorBoard, ...) on rank 0 only.
"""
from __future__ import annotations

import numpy as np
import keras

from .. import _checks, files, runtime
from ..collectives.agreement import check_agreement
from .ownership import checkpointer_of, exchange_of, require_exchange


def broadcast_variables(variables, root_rank: int = 0, communicator=None) -> None:
    """Overwrites ``variables`` on every rank with ``root_rank``'s values (one broadcast per dtype)."""
    comm = communicator or runtime.communicator()
    variables = list(variables)
    if comm.size == 1 or not variables:
        return
    by_dtype: dict = {}
    for v in variables:
        by_dtype.setdefault(np.dtype(keras.backend.standardize_dtype(v.dtype)), []).append(v)
    check_agreement(comm, "the variables to broadcast",
                    [[list(v.shape), np.dtype(dt).name] for dt, vs in by_dtype.items() for v in vs],
                    "Every rank must build the same model (layer sizes, dtypes) and optimizer.")
    for dtype, vs in sorted(by_dtype.items(), key=lambda kv: kv[0].str):
        flat = np.concatenate([np.asarray(keras.ops.convert_to_numpy(v), dtype=dtype).reshape(-1) for v in vs])
        flat = comm.bcast(flat, root=root_rank)
        off = 0
        for v in vs:
            n = int(np.prod(v.shape, dtype=np.int64))
            v.assign(flat[off:off + n].reshape(v.shape))
            off += n


class BroadcastInitialState(keras.callbacks.Callback):
    """Broadcasts model weights and optimizer state from ``root_rank`` at the start of training.

    Runs once (the first ``fit``), before the first update, like Horovod's
    ``BroadcastGlobalVariablesCallback``.  Under SparseStrategy it is a no-op safety
    net: the strategy already broadcasts every variable at creation.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self.done = False

    def on_train_begin(self, logs=None):
        if self.done:
            return
        comm = runtime.communicator()
        if not 0 <= self.root_rank < comm.size:
            raise ValueError(f"root_rank={self.root_rank} must be in [0, {comm.size})")
        variables = list(self.model.variables)
        opt = getattr(self.model, "optimizer", None)
        if opt is not None:
            variables += list(opt.variables)
        broadcast_variables(variables, self.root_rank, comm)
        self.done = True


class CommunicationStats(keras.callbacks.Callback):
    """Adds to each epoch's logs, per step of the gradient exchange on this rank:
    ``comm_bytes`` (mean bytes sent), ``density`` (achieved fraction of gradient elements
    sent), and where the time went -- ``encode_ms`` (error feedback, selection, encoding, on
    the training thread), ``comm_ms`` (the collectives, on the communication thread),
    ``decode_ms`` (dense result and residual update, on the communication thread) and
    ``wait_ms`` (the training thread blocked on the communication thread: the part of the
    exchange that overlap -- buckets, ``pipeline=2`` -- did not hide).

    Put it before History/TensorBoard users in the callback list so they see the keys.
    """

    PHASES = ("encode", "comm", "decode", "wait")
    KEYS = ("comm_bytes", "density", *(f"{phase}_ms" for phase in PHASES))

    def on_epoch_begin(self, epoch, logs=None):
        ex = exchange_of(self.model)
        if ex is not None:
            ex.stats.reset()

    def on_epoch_end(self, epoch, logs=None):
        ex = exchange_of(self.model)
        if ex is None or logs is None:
            return
        st = ex.stats
        steps = max(st.steps, 1)
        logs["comm_bytes"] = float(st.bytes_per_step)
        logs["density"] = float(st.density)
        for phase in self.PHASES:
            logs[f"{phase}_ms"] = 1e3 * getattr(st, f"{phase}_seconds") / steps


class MetricAverage(keras.callbacks.Callback):
    """Averages the metric states across ranks after every train and test batch -- so the
    epoch logs Keras computes from them are the same on every rank *before* any callback sees
    them, wherever MetricAverage stands in the list (EarlyStopping or ReduceLROnPlateau listed
    first decide alike on every rank) -- and also the numeric epoch logs, evaluate's logs, and at
    each epoch's end the model's moving statistics (BatchNormalization's moving mean and
    variance: the non-trainable float weights of its trainable layers), so that every rank
    predicts alike and saved files hold the average.  Under SparseStrategy all of this happens
    after every step without a callback.  The averaging runs after the exchange's round, over its
    communicator (one small allreduce per batch).

    The same allreduce agrees on ``model.stop_training``: when a callback listed *before*
    MetricAverage stops training on one rank (``TerminateOnNaN`` seeing that rank's NaN loss, a
    custom rule), every rank stops after the same batch (or epoch) instead of leaving the others
    waiting.  So list it last; the batch logs that later callbacks see are then the averaged ones.

    What CommunicationStats adds (bytes, density, phase times) stays per rank, as under
    SparseStrategy.
    """

    PER_RANK = CommunicationStats.KEYS

    def _allreduce(self, values: np.ndarray, stop: bool | None = None) -> np.ndarray:
        """Mean over ranks of ``values``; any rank's ``stop`` stops every rank's training
        (``None``: nothing to agree on)."""
        comm = runtime.communicator()
        flat = np.concatenate([np.asarray(values, np.float64).reshape(-1), [1.0 if stop else 0.0]])
        exchange = exchange_of(self.model)
        total = exchange.run_collective(lambda c: c.allreduce(flat)) if exchange is not None else comm.allreduce(flat)
        if stop is not None and total[-1] > 0:
            self.model.stop_training = True
        return total[:-1] / comm.size

    def _average(self, logs, stop=None):
        logs = logs if logs is not None else {}
        keys = sorted(k for k, v in logs.items()
                      if (np.isscalar(v) or np.ndim(v) == 0) and k not in self.PER_RANK)
        if runtime.communicator().size == 1 or (not keys and stop is None):
            return
        vals = self._allreduce(np.array([float(logs[k]) for k in keys], dtype=np.float64), stop)
        for k, v in zip(keys, vals):
            logs[k] = float(v)

    def on_train_batch_end(self, batch, logs=None):
        self._average_metric_states(logs, bool(getattr(self.model, "stop_training", False)))

    def on_test_batch_end(self, batch, logs=None):
        self._average_metric_states(logs, None)

    def _average_metric_states(self, logs, stop):
        """The metrics' state variables (totals, counts, ...) replaced by their mean over ranks:
        every metric's result is then the all-rank value (a ratio of sums: the mean's scale
        cancels), and so are the epoch logs Keras derives from them; ``logs`` (this batch's)
        takes the averaged results; ``stop``: this rank's ``stop_training`` (None: not agreed)."""
        if runtime.communicator().size == 1:
            return
        variables = [v for v in getattr(self.model, "metrics_variables", [])
                     if np.dtype(keras.backend.standardize_dtype(v.dtype)).kind == "f"]
        self._mean_into(variables, stop)
        if logs is not None and variables:
            for key, value in self.model.get_metrics_result().items():
                if key in logs and np.ndim(value) == 0:
                    logs[key] = float(value)

    def on_epoch_end(self, epoch, logs=None):
        self._average_moving_statistics()
        self._average(logs, bool(getattr(self.model, "stop_training", False)))

    def _average_moving_statistics(self):
        from ..strategies.sparse_strategy import moving_statistics

        weights = moving_statistics(self.model)
        if weights and runtime.communicator().size > 1:
            self._mean_into(weights)

    def _mean_into(self, variables, stop=None):
        """Each of ``variables`` replaced by its mean over ranks (one allreduce, which also
        agrees on ``stop``, see :meth:`_allreduce`)."""
        values = [np.asarray(keras.ops.convert_to_numpy(v), np.float64) for v in variables]
        mean = self._allreduce(np.concatenate([x.reshape(-1) for x in values]) if values else np.empty(0), stop)
        off = 0
        for v, x in zip(variables, values):
            v.assign(mean[off:off + x.size].reshape(x.shape).astype(keras.backend.standardize_dtype(v.dtype)))
            off += x.size

    def on_test_end(self, logs=None):
        self._average(logs)


class StepCountCheck(keras.callbacks.Callback):
    """Compares the number of steps per epoch across ranks before training; raises on
    every rank if they differ (instead of hanging in a collective)."""

    def on_train_begin(self, logs=None):
        steps = self.params.get("steps")
        runtime.check_step_counts(runtime.communicator(), -1 if steps is None else int(steps))


_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
          "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
          "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
          "on_predict_batch_begin", "on_predict_batch_end")


class _RankZeroOnly(keras.callbacks.Callback):
    """Forwards every hook to ``callback`` on rank 0; on other ranks ``callback`` is never
    called, ``set_model`` and ``set_params`` included (TensorBoard creates its log directory and
    writes the model summary in ``set_model``).  The wrapper's own ``model`` and ``params`` are
    set on every rank."""

    def __init__(self, callback, rank: int):
        super().__init__()
        self.callback = callback
        self._active = rank == 0

    def set_model(self, model):
        super().set_model(model)
        if self._active:
            self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        if self._active:
            self.callback.set_params(params)

    def _forward(self, hook, *args, **kwargs):
        if self._active:
            getattr(self.callback, hook)(*args, **kwargs)


def _forwarder(hook):
    def method(self, *args, **kwargs):
        self._forward(hook, *args, **kwargs)

    method.__name__ = hook
    return method


for _hook in _HOOKS:
    setattr(_RankZeroOnly, _hook, _forwarder(_hook))


class _AtomicSaves:
    """The model as Keras' ModelCheckpoint sees it: ``save`` and ``save_weights`` write a
    temporary file beside the destination and rename it into place when complete
    (:func:`tfsparse.files.replacing`), so a rank killed during a save leaves the previous
    checkpoint loadable; every other attribute is the model's."""

    def __init__(self, model):
        self._wrapped = model

    def save(self, filepath, *args, **kwargs):
        with files.replacing(filepath) as tmp:
            self._wrapped.save(str(tmp), *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        with files.replacing(filepath) as tmp:
            self._wrapped.save_weights(str(tmp), *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._wrapped, name)


class ModelCheckpoint(_RankZeroOnly):
    """``keras.callbacks.ModelCheckpoint`` for multi-process training: rank 0 writes, and the
    file holds **every rank's** exchange state -- residual (error feedback is per rank) and
    the aggregators' state (Ok-Topk's thresholds and boundaries, DGC's random generator, the
    round counter) -- so training resumes exactly where it stopped.

    Must be passed on every rank (it gathers the states collectively before each save
    point); takes the same arguments as ``keras.callbacks.ModelCheckpoint``.  On load,
    each rank restores its own state (with a different world size, each rank gets the
    mean of the saved residuals, preserving the total pending update, and rank 0's
    aggregator state).  Both routes: the state is saved with a ``DistributedOptimizer``, or
    with the ``SparseStrategy`` the model was built in (load the file inside its scope).

    Each file is written whole or not at all: to a temporary file beside it, renamed into place
    when complete (:mod:`tfsparse.files`), so a crash during a save leaves the previous checkpoint
    at that path loadable.
    """

    def __init__(self, filepath, save_freq="epoch", **kwargs):
        super().__init__(keras.callbacks.ModelCheckpoint(filepath, save_freq=save_freq, **kwargs), runtime.rank())
        self.save_freq = save_freq
        self._batches = 0

    def set_model(self, model):
        super().set_model(model)
        if self._active:
            self.callback.set_model(_AtomicSaves(model))

    def _gather(self):
        checkpointer = checkpointer_of(self.model)
        if checkpointer is not None:
            checkpointer.gather()

    def on_train_batch_end(self, batch, logs=None):
        if isinstance(self.save_freq, int):
            self._batches += 1
            if self._batches % self.save_freq == 0:
                self._gather()
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._gather()
        super().on_epoch_end(epoch, logs)


class DSyncWarmUp(keras.callbacks.Callback):
    """Pipe-SGD's warm-up (pipe-sgd-li2018 §4): the first ``epochs`` epochs train as D-Sync --
    synchronous (``pipeline=1``) over a float32 wire -- and later epochs in the exchange's own
    pipelined, compressed mode.  "We don't turn on the pipelined training until the 5-th epoch,
    before which we still stick to D-Sync training" (the paper's default: ``epochs=4``).

    >>> strategy = tfsparse.SparseStrategy("dense", 1.0, wire_dtype="int8", pipeline=2)
    >>> model.fit(..., callbacks=[tfsparse.keras.callbacks.DSyncWarmUp(epochs=4)])

    Sets ``exchange.dsync`` at each epoch's beginning (every rank at the same epoch; a resumed
    run with ``initial_epoch`` continues the schedule).  The first pipelined step after the
    warm-up applies a zero gradient, as the first step of a pipelined run does.
    """

    def __init__(self, epochs: int = 4):
        super().__init__()
        self.epochs = _checks.integer("epochs", epochs, 0, hint=(
            " (the number of synchronous float32 epochs before the pipelined, compressed ones)"))

    def on_epoch_begin(self, epoch, logs=None):
        require_exchange(self.model, "DSyncWarmUp").dsync = epoch < self.epochs


def rank_zero_only(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """Wraps ``callback`` so it only acts on rank 0 (Keras callbacks have no notion of chief):
    on other ranks nothing reaches it, not even ``set_model``, so a TensorBoard or CSVLogger
    there creates no file.  The wrapper's ``model`` is the model on every rank.

    >>> callbacks=[tfsparse.keras.callbacks.rank_zero_only(keras.callbacks.ModelCheckpoint("ckpt.keras"))]
    """
    return _RankZeroOnly(callback, runtime.rank())
from .density_schedule import DensitySchedule  # noqa: E402,F401
