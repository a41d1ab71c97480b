"""Keras callbacks for multi-process training.

* :class:`BroadcastInitialState` — start every rank from rank 0's weights and optimizer state.
* :class:`CommunicationStats` — bytes, density, wire and phase times of the exchange in each epoch's
  logs; the algorithm and wire of each epoch in the History.
* :class:`MetricAverage` — average epoch logs across ranks (for the DistributedOptimizer
  route; under SparseStrategy metrics are already averaged every step).
* :class:`StepCountCheck` — fail fast when ranks have different numbers of batches.
* :class:`ReplicaCheck` — every rank's weights and optimizer variables compared bit for bit at
  each epoch's end (:mod:`tfsparse.keras.replicas`).
* :class:`ModelCheckpoint` — rank 0 writes; the file holds every rank's exchange state.
* :class:`DSyncWarmUp` — Pipe-SGD's warm-up: the first epochs synchronous and float32.
* :class:`BackupAndRestore` — fault tolerance: one backup of every rank's state, restored when a
  relaunched job (``tfsparse-run --max-restarts``) starts ``fit`` again; it lives in
  :mod:`tfsparse.keras.backup` and is re-exported here.
* :func:`rank_zero_only` — run a callback (ModelCheckpoint, TensorBoard, ...) on rank 0 only.
* :func:`average_moving_statistics` — BatchNorm's moving statistics averaged over the ranks (the
  call for custom training loops), and :func:`broadcast_variables`; both live in
  :mod:`tfsparse.keras.sync` and are re-exported here.
"""
from __future__ import annotations

import os

import numpy as np
import keras

from .. import _checks, files, runtime
from .._tf_private import keras_fit_batches, keras_test_batches
from ..wire import get_wire
from .backup import _BatchCount
from .ownership import checkpointer_of, exchange_of, require_exchange, sparse_strategy_of
from .replicas import check_replicas
from .sync import (_assign, _float64, average_moving_statistics, average_moving_statistics_off_strategy,  # noqa: F401
                   broadcast_variables, run_on_model)


class BroadcastInitialState(keras.callbacks.Callback):
    """Broadcasts model weights and optimizer state from ``root_rank`` at the start of training.

    Runs once (the first ``fit``), before the first update, like Horovod's
    ``BroadcastGlobalVariablesCallback``.  Under SparseStrategy it is a no-op safety
    net: the strategy already broadcasts every variable at creation.

    Args:
      root_rank: the rank whose values every rank takes (default 0).
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self.done = False

    def on_train_begin(self, logs=None):
        """At the first ``fit`` only: every rank takes ``root_rank``'s model variables and optimizer variables
        (ValueError when ``root_rank`` is not a rank of the world)."""
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
    sent), ``wire_bits`` (bits per value on the wire at the epoch's end: 32, 16, 8 or 4), and where
    the time went -- ``encode_ms`` (error feedback, selection, encoding, on
    the training thread), ``comm_ms`` (the collectives, on the communication thread),
    ``decode_ms`` (dense result and residual update, on the training thread once a bucket is
    off the wire, while the communication thread moves the next one) and
    ``wait_ms`` (the training thread blocked on the communication thread: the part of the
    exchange that overlap -- buckets, ``pipeline=2`` -- did not hide).

    The setting in use at each epoch's end -- what ``algorithm="auto"`` chose, once it has --
    lands in the ``History`` that ``fit`` returns when training ends: ``comm_algorithm`` (``"dense"``,
    ``"gtopk"``, ...) and ``wire`` (``"float32"``, ``"float16"``, ...), one string per epoch (the
    epoch logs themselves take numbers only: the progress bar and TensorBoard average and plot
    them; a script that makes every History value a float skips these two keys,
    :attr:`LABELS`).  ``log_dir``: also written there as TensorBoard text summaries (``epoch_comm_algorithm``,
    ``epoch_wire`` under ``log_dir/train``, where Keras' ``TensorBoard(log_dir)`` writes its scalars),
    by rank 0; the numbers reach TensorBoard as any epoch log does.

    Put it before History/TensorBoard users in the callback list so they see the keys.

    Args:
      log_dir: where rank 0 also writes the setting in use as TensorBoard text summaries
        (None, the default: nowhere).
    """

    PHASES = ("encode", "comm", "decode", "wait")
    KEYS = ("comm_bytes", "density", "wire_bits", *(f"{phase}_ms" for phase in PHASES))
    #: the strings added to the History when training ends
    LABELS = ("comm_algorithm", "wire")

    def __init__(self, log_dir: str | None = None):
        super().__init__()
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self._labels: dict[int, tuple[str, str]] = {}
        self._writer = None

    def on_train_begin(self, logs=None):
        """Forgets the settings recorded by an earlier ``fit``."""
        self._labels = {}

    def on_epoch_begin(self, epoch, logs=None):
        """Resets the exchange's statistics, so that the epoch's logs count this epoch's steps only."""
        ex = exchange_of(self.model)
        if ex is not None:
            ex.stats.reset()

    def on_epoch_end(self, epoch, logs=None):
        """Adds :attr:`KEYS` to the epoch's logs from the exchange's statistics and records the epoch's algorithm
        and wire (rank 0 also writes them under ``log_dir`` when one was given)."""
        ex = exchange_of(self.model)
        if ex is None or logs is None:
            return
        st = ex.stats
        steps = max(st.steps, 1)
        logs["comm_bytes"] = float(st.bytes_per_step)
        logs["density"] = float(st.density)
        logs["wire_bits"] = float(8 * get_wire(ex.settings.wire_dtype).value_bytes)
        for phase in self.PHASES:
            logs[f"{phase}_ms"] = 1e3 * getattr(st, f"{phase}_seconds") / steps
        self._labels[epoch] = (ex.settings.algorithm, ex.settings.wire_dtype)
        if self.log_dir is not None and runtime.communicator().rank == 0:
            self._write_text(epoch, *self._labels[epoch])

    def _write_text(self, epoch: int, algorithm: str, wire: str) -> None:
        import tensorflow as tf

        if self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "train"))
        with self._writer.as_default():
            tf.summary.text("epoch_comm_algorithm", algorithm, step=epoch)
            tf.summary.text("epoch_wire", wire, step=epoch)
        self._writer.flush()

    def on_train_end(self, logs=None):
        """Puts each epoch's algorithm and wire into the ``History`` (the keys :attr:`LABELS`), when that
        History's epochs are the ones this callback recorded."""
        history = getattr(self.model, "history", None)
        epochs = list(getattr(history, "epoch", None) or [])
        # the History of this fit (it sets model.history at each epoch's end): its epochs are ours
        if not isinstance(history, keras.callbacks.History) or not epochs or sorted(self._labels) != epochs:
            return
        for i, key in enumerate(self.LABELS):
            history.history[key] = [self._labels[e][i] for e in epochs]


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
    SparseStrategy.  Ranks with different numbers of test batches (validation shards one row
    apart) log the whole set's results too (:meth:`on_test_begin`).  It takes no arguments.
    """

    PER_RANK = CommunicationStats.KEYS
    _test_calls = 0  # this evaluation's test-batch callbacks still to come on this rank (-1: unknown)
    _extra_calls = 0  # the averagings it owes the ranks with more test batches, after its last
    _strategy_averages = False  # this evaluation's model is SparseStrategy's, whose test steps average

    def _allreduce(self, values: np.ndarray, stop: bool | None = None) -> np.ndarray:
        """Mean over ranks of ``values``; any rank's ``stop`` stops every rank's training
        (``None``: nothing to agree on)."""
        flat = np.concatenate([np.asarray(values, np.float64).reshape(-1), [1.0 if stop else 0.0]])
        total = run_on_model(self.model, lambda c: c.allreduce(flat))
        if stop is not None and total[-1] > 0:
            self.model.stop_training = True
        return total[:-1] / runtime.communicator().size

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
        """Replaces the metric states by their mean over the ranks (the batch's logs take the averaged results)
        and agrees on ``stop_training``: any rank's stop stops every rank."""
        self._average_metric_states(logs, bool(getattr(self.model, "stop_training", False)))

    def on_test_begin(self, logs=None):
        """Compares the ranks' numbers of test batches (one small allgather): where they differ
        -- validation data sharded with ``tfsparse.data.shard(..., drop_remainder=False)`` -- a
        rank whose batches end first averages its metric states with each of the others'
        remaining batches after its last (:meth:`on_test_batch_end`), so that every rank logs the
        whole set's results (a mean of states that each rank's batches add to: every batch's
        contribution over P).  Needs every rank's count known (a dataset of known length, or
        ``steps=``, which is trusted); where one is not, nothing is compared, and the ranks must
        have as many batches.  Under SparseStrategy, whose test steps average the states (and even
        out such counts) themselves, the evaluation's callbacks do nothing.

        Raises:
          StepCountMismatch: on every rank, where some rank has no test batch and another has (or
            may have: its count unknown).
        """
        self._test_calls = self._extra_calls = 0
        self._strategy_averages = sparse_strategy_of(self.model) is not None
        if runtime.communicator().size == 1 or self._strategy_averages:
            return
        steps = keras_test_batches()
        per_call = max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))
        self._test_calls = -1 if steps is None else -(-steps // per_call)  # callbacks Keras makes
        calls = [int(c[0]) for c in run_on_model(self.model, lambda c: c.allgather(np.array([self._test_calls])))]
        if 0 in calls and any(calls):  # Keras resets the states after this: an empty shard cannot take part
            runtime.raise_on_uneven_counts(calls)
        if min(calls) >= 0:
            self._extra_calls = max(calls) - self._test_calls

    def on_test_batch_end(self, batch, logs=None):
        """Replaces the metric states by their mean over the ranks; the batch's logs take the
        averaged results (after this rank's last batch, also those of the others' remaining ones)."""
        if self._strategy_averages:
            return
        self._average_metric_states(logs, None)
        self._test_calls -= 1
        if self._test_calls == 0:
            self._average_extra(logs)

    def _average_extra(self, logs) -> None:
        """The averagings this rank owes the ranks that have more test batches (:meth:`on_test_begin`)."""
        for _ in range(self._extra_calls):
            self._average_metric_states(logs, None)
        self._extra_calls = 0

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
        """Averages the model's moving statistics and the epoch's numeric logs (except :attr:`PER_RANK`) over
        the ranks, and agrees on ``stop_training``."""
        average_moving_statistics(self.model)
        self._average(logs, bool(getattr(self.model, "stop_training", False)))


    def _mean_into(self, variables, stop=None):
        """Each of ``variables`` replaced by its mean over ranks (one allreduce, which also
        agrees on ``stop``, see :meth:`_allreduce`)."""
        values = _float64(variables)
        _assign(variables, values,
                self._allreduce(np.concatenate([x.reshape(-1) for x in values]) if values else np.empty(0), stop))

    def on_test_end(self, logs=None):
        """Averages ``evaluate``'s numeric logs (except :attr:`PER_RANK`) over the ranks."""
        if not self._strategy_averages:
            self._average(logs)


class StepCountCheck(keras.callbacks.Callback):
    """Compares the number of steps per epoch across ranks before training; raises
    :class:`~tfsparse.StepCountMismatch` on every rank if they differ (instead of hanging in a
    collective).  It takes no arguments."""

    def on_train_begin(self, logs=None):
        """Compares this rank's steps per epoch (-1: unknown) with every rank's; raises
        :class:`~tfsparse.StepCountMismatch` on every rank when they differ.  A ``steps_per_epoch``
        beyond the batches of this rank's data counts as those batches: Keras' loop stops there."""
        steps = keras_fit_batches()
        if steps is None:  # not under Keras' fit (a loop calling the hooks itself), or unknown length
            steps = self.params.get("steps")
        runtime.check_step_counts(runtime.communicator(), -1 if steps is None else int(steps))


class ReplicaCheck(keras.callbacks.Callback):
    """At the end of every ``every``-th epoch, compares a digest of every weight and optimizer
    variable across the ranks and raises :class:`~tfsparse.keras.replicas.ReplicasDiverged` on
    every rank, naming the first variable whose bits differ (:func:`~tfsparse.keras.replicas.check_replicas`).
    ``SparseStrategy`` does this by itself for epochs of known length; this callback covers the
    ``DistributedOptimizer`` route between its end-of-``fit`` checks, and epochs of unknown length.
    List it after ``MetricAverage``, which averages BatchNormalization's moving statistics first.

    Args:
      every: compare after every ``every``-th epoch (an integer >= 1; default 1)."""

    def __init__(self, every: int = 1):
        super().__init__()
        self.every = _checks.integer("every", every, 1, hint=" (epochs between checks)")

    def on_epoch_end(self, epoch, logs=None):
        """After every ``every``-th epoch: :func:`~tfsparse.keras.replicas.check_replicas` (collective)."""
        if (epoch + 1) % self.every == 0:
            check_replicas(self.model, what=f"at the end of epoch {epoch + 1}")


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
    at that path loadable.  On the ``DistributedOptimizer`` route the moving statistics
    (BatchNormalization's) are averaged over the ranks at each save point, wherever
    ``MetricAverage`` stands, so the file holds their mean.

    Args:
      filepath: where to save, as Keras' (``{epoch}`` and the logs' keys may be formatted in):
        ``.keras``, or ``.weights.h5`` with ``save_weights_only=True`` (a whole model in Keras'
        legacy ``.h5`` format would lose the exchange state: ``ValueError``).
      save_freq: ``"epoch"`` or an integer N (every N batches), as Keras'.
      **kwargs: Keras' other arguments (``monitor``, ``save_best_only``, ``save_weights_only``,
        ``mode``, ``verbose``, ``initial_value_threshold``).
    """

    def __init__(self, filepath, save_freq="epoch", **kwargs):
        path = os.fspath(filepath)
        if not kwargs.get("save_weights_only", False) and path.endswith((".h5", ".hdf5")):
            raise ValueError(f"filepath={path!r}: Keras writes a whole model to a .h5 file in its legacy HDF5 format, "
                             f"which holds no exchange state (the residuals, auto's choice) -- a resumed run would "
                             f"lose it; accepted: a path ending in '.keras', or in '.weights.h5' with "
                             f"save_weights_only=True")
        super().__init__(keras.callbacks.ModelCheckpoint(filepath, save_freq=save_freq, **kwargs), runtime.rank())
        self.save_freq = save_freq
        self._count = _BatchCount(save_freq) if isinstance(save_freq, int) else None

    def set_model(self, model):
        """Sets the model; rank 0's Keras ``ModelCheckpoint`` gets it behind a wrapper whose ``save`` and
        ``save_weights`` write each file whole (a temporary file, renamed into place)."""
        super().set_model(model)
        if self._active:
            self.callback.set_model(_AtomicSaves(model))

    def _gather(self):
        average_moving_statistics_off_strategy(self.model)  # the file holds the ranks' mean (collective)
        checkpointer = checkpointer_of(self.model)
        if checkpointer is not None:
            checkpointer.gather()

    def on_train_batch_end(self, batch, logs=None):
        """With an integer ``save_freq``: gathers every rank's exchange state (collective) where
        ``save_freq`` batches have ended since the last save (counted as Keras counts them), before
        rank 0's Keras callback decides whether to save."""
        if self._count is not None and self._count.due(batch):
            self._gather()
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        """With ``save_freq="epoch"``: gathers every rank's exchange state (collective) before rank 0's Keras
        callback decides whether to save."""
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

    Switches the exchange's D-Sync (:meth:`~tfsparse.pipelined.Pipelined.use_dsync`) at each
    epoch's beginning (every rank at the same epoch; a resumed run with ``initial_epoch``
    continues the schedule).  The first pipelined step after the
    warm-up applies a zero gradient, as the first step of a pipelined run does.

    Args:
      epochs: how many epochs train as D-Sync (an integer >= 0; default 4, the paper's).
    """

    def __init__(self, epochs: int = 4):
        super().__init__()
        self.epochs = _checks.integer("epochs", epochs, 0, hint=(
            " (the number of synchronous float32 epochs before the pipelined, compressed ones)"))

    def on_epoch_begin(self, epoch, logs=None):
        """Switches the exchange's D-Sync for the epoch: on during the first ``epochs`` epochs, off after."""
        require_exchange(self.model, "DSyncWarmUp").use_dsync(epoch < self.epochs)


def rank_zero_only(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """Wraps ``callback`` so it only acts on rank 0 (Keras callbacks have no notion of chief):
    on other ranks nothing reaches it, not even ``set_model``, so a TensorBoard or CSVLogger
    there creates no file.  The wrapper's ``model`` is the model on every rank.

    >>> callbacks=[tfsparse.keras.callbacks.rank_zero_only(keras.callbacks.ModelCheckpoint("ckpt.keras"))]

    Keras' ``BackupAndRestore`` is refused (``ValueError``): on rank 0 alone it would resume that
    rank at a later epoch than the others, which then wait for it forever; use
    :class:`BackupAndRestore` on every rank.

    Args:
      callback: a Keras callback.

    Returns:
      A callback to list on every rank in its place.
    """
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        raise ValueError(f"rank_zero_only({type(callback).__name__}(...)) would resume rank 0 alone at the backup's "
                         f"epoch while the other ranks start afresh and wait for it; pass "
                         f"tfsparse.keras.callbacks.BackupAndRestore(backup_dir) on every rank instead")
    return _RankZeroOnly(callback, runtime.rank())
from .backup import BackupAndRestore  # noqa: E402,F401  (re-exported: tfsparse.keras.callbacks.BackupAndRestore)
from .density_schedule import DensitySchedule  # noqa: E402,F401
