"""Fault tolerance for a relaunched job: :class:`BackupAndRestore` (re-exported by
:mod:`tfsparse.keras.callbacks`), and the count of batches between saves that it and
:class:`~tfsparse.keras.callbacks.ModelCheckpoint` share (:class:`_BatchCount`)."""
from __future__ import annotations

import contextlib
import json
import os
import uuid

import numpy as np
import keras

from .. import _checks, files, runtime
from .._tf_private import set_initial_epoch
from ..collectives.agreement import ConfigurationMismatch
from .ownership import checkpointer_of
from .sync import average_moving_statistics_off_strategy, run_on_model


_ATTRIBUTE = "tfsparse.backup"  # the HDF5 attribute of a backup file that holds the progress (JSON)


def _progress(path) -> dict:
    """The training progress a backup file holds: the file complete
    (:func:`tfsparse.files.check_saved_file`) and its progress attribute readable.

    Raises:
      OSError, ValueError or KeyError: a missing, truncated or unreadable file, or no progress in it.
    """
    files.check_saved_file(path)
    import h5py

    with h5py.File(path, "r") as f:
        return json.loads(f.attrs[_ATTRIBUTE])


def _usable(path) -> bool:
    """Whether ``path`` is a backup a restart could resume from (:func:`_progress` reads it)."""
    try:
        _progress(path)
    except (OSError, ValueError, KeyError):
        return False
    return True


class _BatchCount:
    """Keras' count of the batches since the last save (``ModelCheckpoint._should_save_on_batch``):
    by the batch indices Keras passes, not by the calls -- with ``steps_per_execution`` > 1 a call
    ends several batches -- so that every rank decides to save at the batch rank 0's Keras
    callback does.  ``every``: ``save_freq``."""

    def __init__(self, every: int):
        self.every = every
        self.last: int | None = None  # the batch index of the last call
        self.since = 0  # batches since the last save

    def due(self, batch: int) -> bool:
        """Counts the call that ends batch index ``batch``; returns whether ``every`` batches have
        ended since the last save (and then restarts the count)."""
        self.since += batch + 1 if self.last is None or batch <= self.last else batch - self.last
        self.last = batch
        if self.since < self.every:
            return False
        self.since = 0
        return True


class BackupAndRestore(keras.callbacks.Callback):
    """``keras.callbacks.BackupAndRestore`` for multi-process training: fault tolerance for a job
    that is relaunched after a failure (``tfsparse-run --max-restarts N``).

    At the end of each epoch (or every ``save_freq`` batches) rank 0 writes **one** backup of the
    training state: the weights, the optimizer's state and **every rank's** exchange state
    (gathered as :class:`~tfsparse.keras.callbacks.ModelCheckpoint` does: residuals, Ok-Topk's thresholds, DGC's random
    generator, the round counter), with the training progress (the epoch and batch reached) in
    the same file -- written beside its destination and renamed into place when complete
    (:mod:`tfsparse.files`), so a crash at any moment leaves the previous backup whole, and never a
    new model beside old progress.  When ``fit`` starts and a backup exists, every rank loads it
    (each rank takes its own exchange-state row, the optimizer its state) and training goes on
    from the epoch after the backup's, as with Keras' callback (``fit`` then runs only the epochs
    left, and its history holds only those).  Resumed from an epoch's backup, training ends
    bit-identical to an uninterrupted run.  A ``fit`` that completes deletes the backup (unless
    ``delete_checkpoint=False``).

    Must be passed on **every** rank, with the same ``backup_dir`` on every rank: a shared file
    system, or every rank on one node (only rank 0 writes; every rank reads).  Before loading, the
    ranks agree on the backup they resume from: when they would start from different epochs (a
    rank whose directory differs, misses the backup or holds another one) every rank raises the
    same :class:`~tfsparse.ConfigurationMismatch` naming each rank's directory and backup, instead of
    training apart or waiting forever.

    >>> callbacks = [tfsparse.keras.callbacks.BackupAndRestore("/shared/run1/backup")]
    >>> model.fit(x, y, epochs=20, shuffle=False, callbacks=callbacks)  # relaunched: resumes after the last save

    Args:
      backup_dir: the directory of the backup (created when needed); it holds
        ``latest.weights.h5`` (and ``previous.weights.h5`` with ``double_checkpoint``); use it for
        nothing else.
      save_freq: ``"epoch"`` (a backup at the end of each epoch) or an integer N >= 1 (a backup
        every N batches).  As with Keras' callback, a backup taken within an epoch resumes at
        that epoch's first batch, from the backup's weights: the batches of that epoch before the
        backup are trained again, so only backups at an epoch's end (every epoch's, or a
        batch backup on its last batch) resume bit-identically.
      delete_checkpoint: delete the backup when ``fit`` completes (default True); rank 0 deletes
        it, and no rank's ``fit`` returns before it is gone.
      double_checkpoint: keep the previous backup too (``previous.weights.h5``), restored when the
        latest one is missing or unreadable (default False).

    The model must be built before ``fit`` (a ``keras.Input`` layer, or a call on a batch) --
    Keras' condition; a model trained in a :class:`~tfsparse.SparseStrategy` is restored in that
    strategy's scope.  The arguments and the data must be the same in the relaunched job, and for
    a bit-identical result each epoch must see its batches in the same order however many epochs
    ran before it in the process: ``fit(..., shuffle=False)`` on arrays (Keras' shuffle draws a new
    order each epoch from the process's random state), or a ``tf.data`` pipeline without
    ``shuffle`` or with ``reshuffle_each_iteration=False``.  The other callbacks' own state
    (``EarlyStopping``'s patience, ``ReduceLROnPlateau``'s) is not backed up, as with Keras' callback.
    """

    LATEST = "latest.weights.h5"
    PREVIOUS = "previous.weights.h5"
    ATTRIBUTE = _ATTRIBUTE
    """The HDF5 attribute of the backup file that holds the training progress (JSON)."""

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint: bool = True,
                 double_checkpoint: bool = False):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not str(os.fspath(backup_dir)):
            raise ValueError(f"backup_dir={backup_dir!r} is not valid; accepted: a non-empty path of a directory "
                             f"(the same on every rank: a shared file system, or every rank on one node)")
        if save_freq != "epoch":
            _checks.integer("save_freq", save_freq, 1, hint=" or 'epoch' (a backup every save_freq batches, "
                                                           "or at each epoch's end)")
        for name, value in (("delete_checkpoint", delete_checkpoint), ("double_checkpoint", double_checkpoint)):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name}={value!r} is not valid; accepted: True or False")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self.double_checkpoint = bool(double_checkpoint)
        self._epoch = 0  # epochs completed
        self._batch = 0  # batches completed in the current epoch
        self._count = _BatchCount(save_freq) if save_freq != "epoch" else None
        self._run_id = ""
        self.restored: dict | None = None
        """The progress of the backup the last ``fit`` resumed from (``epoch``, ``batch``, ...), or None."""

    # -- paths and progress ---------------------------------------------------
    def _path(self, name: str) -> str:
        return os.path.join(self.backup_dir, name)

    def _read(self) -> dict:
        """This rank's view of the backup: ``{"dir": ..., "backup": {file, epoch, batch, id, ranks}}``,
        ``"backup": None`` when there is none, or ``"error"`` when it cannot be read."""
        view: dict = {"dir": os.path.abspath(self.backup_dir), "backup": None}
        names = [self.LATEST] + ([self.PREVIOUS] if self.double_checkpoint else [])
        errors = []
        for name in names:
            path = self._path(name)
            if not os.path.exists(path):
                continue
            try:
                progress = _progress(path)
            except (OSError, ValueError, KeyError) as e:
                errors.append(f"{path}: {e}")
                continue
            view["backup"] = {"file": name, **progress}
            return view
        if errors:
            view["error"] = "; ".join(errors)
        return view

    @staticmethod
    def _describe(view: dict) -> str:
        if "error" in view:
            return f"an unreadable backup in {view['dir']} ({view['error']})"
        b = view["backup"]
        if b is None:
            return f"no backup in {view['dir']}"
        return (f"epoch {b['epoch']}, batch {b['batch']} ({b['file']} in {view['dir']}, backup {b['id']}, "
                f"saved by {b['ranks']} ranks)")

    def _agree(self, view: dict) -> None:
        """Collective: every rank's view of the backup gathered; every rank raises the same
        ConfigurationMismatch when they differ, or the same error when the backup is unreadable."""
        text = np.frombuffer(json.dumps(view, sort_keys=True).encode(), np.uint8)
        if runtime.communicator().size > 1:
            parts = run_on_model(self.model, lambda c: c.allgather(text))
            views = [json.loads(bytes(np.asarray(p, np.uint8)).decode()) for p in parts]
        else:
            views = [view]
        if any(v != views[0] for v in views[1:]):
            lines = "\n".join(f"  rank {r}: {self._describe(v)}" for r, v in enumerate(views))
            raise ConfigurationMismatch(
                f"BackupAndRestore: the ranks would resume from different backups (start at different epochs):\n"
                f"{lines}\nGive every rank the same backup_dir, on a file system every rank sees (a shared file "
                f"system, or every rank on one node); remove a stale backup to start afresh.")
        if "error" in view:
            raise OSError(f"BackupAndRestore: the backup cannot be read on any rank: {view['error']}; remove "
                          f"{view['dir']} to start afresh" + ("" if self.double_checkpoint else
                                                               " (double_checkpoint=True keeps the previous one)"))

    # -- restore ------------------------------------------------------------
    def on_train_begin(self, logs=None):
        """Reads the backup and agrees with every rank on it (collective: the ranks raise together when they
        would resume from different backups); when there is one, loads it (the weights, the optimizer's state,
        this rank's exchange state) and makes ``fit`` start at the epoch the backup reached."""
        from .saving import load_weights

        self._epoch = self._batch = 0
        if self._count is not None:
            self._count = _BatchCount(self.save_freq)
        self.restored = None
        view = self._read()
        self._agree(view)
        backup = view["backup"]
        if backup is None:
            self._run_id = uuid.uuid4().hex[:12]
            return
        if not self.model.built:
            raise ValueError("BackupAndRestore needs a built model before fit (give it a keras.Input, or call it "
                             f"on a batch): model {self.model.name} is not built")
        strategy = getattr(self.model, "distribute_strategy", None)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            optimizer = getattr(self.model, "optimizer", None)
            if optimizer is not None and not optimizer.built:
                optimizer.build(self.model.trainable_variables)  # its variables exist before the load
            load_weights(self.model, self._path(backup["file"]))
        set_initial_epoch(self.model, int(backup["epoch"]))  # Keras' fit starts there (as Keras' callback)
        self._epoch = int(backup["epoch"])
        self._run_id = backup["id"]
        self.restored = backup

    # -- save ---------------------------------------------------------------
    def on_train_batch_end(self, batch, logs=None):
        """Counts the batches the call ended (several with ``steps_per_execution`` > 1); with an
        integer ``save_freq``, writes a backup (collective) once ``save_freq`` batches have ended
        since the last one."""
        self._batch = batch + 1
        if self._count is None:
            return
        if self._count.due(batch):
            self._save()

    def on_epoch_end(self, epoch, logs=None):
        """Records the epoch as completed; with ``save_freq="epoch"``, writes a backup (collective)."""
        self._epoch, self._batch = epoch + 1, 0
        if self.save_freq == "epoch":
            self._save()

    def _save(self) -> None:
        """Collective (the exchange states are gathered; on the ``DistributedOptimizer`` route the
        moving statistics averaged, so that the ranks resume from the state they all hold); rank 0
        writes the backup."""
        average_moving_statistics_off_strategy(self.model)
        checkpointer = checkpointer_of(self.model)
        if checkpointer is not None:
            checkpointer.gather()
        if runtime.rank() != 0:
            return
        import h5py

        epoch, batch = self._epoch, self._batch
        steps = (self.params or {}).get("steps")
        if steps and batch >= steps:  # the epoch's last batch: the backup of a whole epoch
            epoch, batch = epoch + 1, 0
        progress = {"epoch": epoch, "batch": batch, "id": self._run_id, "ranks": runtime.communicator().size}
        latest = self._path(self.LATEST)
        with files.replacing(latest) as tmp:
            self.model.save_weights(str(tmp))
            with h5py.File(tmp, "a") as f:
                f.attrs[self.ATTRIBUTE] = json.dumps(progress)
            if self.double_checkpoint and _usable(latest):  # a damaged one (the run resumed from the previous
                os.replace(latest, self._path(self.PREVIOUS))  # one) does not replace it; a crash now: previous

    # -- the end of a successful fit ------------------------------------------
    def on_train_end(self, logs=None):
        """Clears the initial epoch the restore set; with ``delete_checkpoint``, once every rank has finished
        ``fit``, rank 0 deletes the backup, and no rank returns before it is gone."""
        set_initial_epoch(self.model, None)  # a later fit on this model starts where it is asked to
        if not self.delete_checkpoint:
            return
        if runtime.communicator().size > 1:  # every rank finished fit before the backup goes
            done = np.ones(1, np.float64)
            run_on_model(self.model, lambda c: c.allreduce(done))
        if runtime.rank() == 0:
            for name in (self.LATEST, self.PREVIOUS):
                for path in (self._path(name), files.partial_path(self._path(name))):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
            with contextlib.suppress(OSError):  # kept when it holds anything else
                os.rmdir(self.backup_dir)
        if runtime.communicator().size > 1:  # and no rank's fit returns before it is gone
            run_on_model(self.model, lambda c: c.allreduce(np.ones(1, np.float64)))
