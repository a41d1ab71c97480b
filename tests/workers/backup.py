"""Worker: tfsparse.keras.callbacks.BackupAndRestore on every rank.

argv: directory mode JSON

* mode ``resume`` (JSON: a list of cases {"algo", "route", "wire", "options"}): for each case an
  uninterrupted fit of E epochs (with the callback: it backs up and deletes its backup at the
  end), and the same training interrupted after epoch K (a callback raises on every rank right
  after the backup of epoch K is written), then a fresh model (a new strategy, a new optimizer)
  in a new fit with a new callback on the same directory: it resumes at epoch K.  Saves both final
  weights, what was restored and what the directories hold.
* mode ``mismatch`` (JSON: one case): backups of epochs 1 and 2, then fits whose ranks see
  different backups -- rank 1 an empty directory, the last rank a stale copy of epoch 1's
  backup -- each must raise the same error on every rank; then every rank on the right
  directory resumes.
"""
import json
import os
import shutil
import sys

import h5py
import numpy as np
import keras

import tfsparse
from mpi_harness import save_result
from resume_cases import data, fresh, key
from tfsparse.keras.callbacks import BackupAndRestore

root, mode, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
comm = tfsparse.init(backend="mpi")
rank, size = comm.rank, comm.size
x, y = data(rank)
E, K = 4, 2


class Crash(Exception):
    pass


class CrashAfter(keras.callbacks.Callback):
    """Raises at the end of epoch ``epochs`` (1-based), after the callbacks before it ran."""

    def __init__(self, epochs):
        super().__init__()
        self.epochs = epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.epochs:
            raise Crash(f"interrupted after epoch {self.epochs}")


def fit(model, callbacks):
    return model.fit(x, y, batch_size=16, epochs=E, shuffle=False, verbose=0, callbacks=list(callbacks))


def interrupted(model, callbacks, after):
    try:
        fit(model, callbacks + [CrashAfter(after)])
    except Crash:
        pass
    else:
        raise AssertionError("the interrupting callback did not stop fit")
    comm.barrier()  # rank 0 has written the backup


def progress(directory):
    path = os.path.join(directory, BackupAndRestore.LATEST)
    if not os.path.exists(path):
        return None
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs[BackupAndRestore.ATTRIBUTE])


flat = lambda m: np.concatenate([w.ravel() for w in m.get_weights()])  # noqa: E731
arrays, info = {}, {}
if mode == "resume":
    for i, case in enumerate(spec):
        k = key(case)
        live_dir, backup_dir = os.path.join(root, f"live{i}"), os.path.join(root, f"backup{i}")
        live, cbs = fresh(case)
        fit(live, cbs + [BackupAndRestore(live_dir)])
        comm.barrier()
        first, cbs = fresh(case)
        interrupted(first, cbs + [BackupAndRestore(backup_dir)], K)
        saved = progress(backup_dir)
        comm.barrier()
        resumed, cbs = fresh(case)
        callback = BackupAndRestore(backup_dir)
        history = fit(resumed, cbs + [callback])
        comm.barrier()  # rank 0 has deleted the backup
        arrays[f"{k}/live"], arrays[f"{k}/resumed"] = flat(live), flat(resumed)
        info[k] = {"saved": saved, "restored": callback.restored, "epochs_run": len(history.history["loss"]),
                   "iterations": int(resumed.optimizer.iterations.numpy()),
                   "live_dir_left": os.path.exists(live_dir), "backup_dir_left": os.path.exists(backup_dir)}
elif mode == "mismatch":
    case = spec
    good, empty, stale = (os.path.join(root, name) for name in ("good", "empty", "stale"))
    model, cbs = fresh(case)
    interrupted(model, cbs + [BackupAndRestore(good, delete_checkpoint=False)], 1)
    if rank == 0:
        shutil.copytree(good, stale)  # epoch 1's backup
    comm.barrier()
    model, cbs = fresh(case)
    interrupted(model, cbs + [BackupAndRestore(good)], 2)
    saved = [progress(good), progress(stale)]
    errors = {}
    for name, mine in (("empty", empty if rank == 1 else good), ("stale", stale if rank == size - 1 else good)):
        model, cbs = fresh(case)
        try:
            fit(model, cbs + [BackupAndRestore(mine)])
            errors[name] = None
        except Exception as e:  # noqa: BLE001  (the test checks its type and text)
            errors[name] = {"type": type(e).__name__, "text": str(e)}
    model, cbs = fresh(case)
    callback = BackupAndRestore(good)
    history = fit(model, cbs + [callback])
    info = {"errors": errors, "restored": callback.restored, "epochs_run": len(history.history["loss"]),
            "saved": saved, "good_left": os.path.exists(good)}
save_result(rank, **arrays, info=info)
