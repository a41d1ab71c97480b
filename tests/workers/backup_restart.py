"""Worker launched by ``tfsparse-run -np 2|3 --max-restarts 1``: trains 4 epochs with
tfsparse.keras.callbacks.BackupAndRestore in DIR/backup.  With ``kill``, rank 1 kills itself
(SIGKILL) in the middle of epoch 2 on the first launch only (DIR/killed, a marker file, says it
happened); the relaunched job resumes from the backup of epoch 2.

argv: DIR kill|nokill.  Writes DIR/weights<rank>.npy and appends one line per launch to
DIR/launches.txt (rank 0): where that launch started.
"""
import os
import signal
import sys
from pathlib import Path

import numpy as np
import keras

import tfsparse
from tfsparse.keras.callbacks import BackupAndRestore

out, kill = Path(sys.argv[1]), sys.argv[2] == "kill"
comm = tfsparse.init()
rank = comm.rank
rng = np.random.default_rng(rank)
x, y = rng.random((96, 12), dtype=np.float32), rng.integers(0, 5, 96)  # 6 steps per epoch
marker = out / "killed"


class KillOnce(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if kill and rank == 1 and self.epoch == 2 and batch == 3 and not marker.exists():
            marker.write_text("rank 1 killed itself in epoch 2\n")
            print("rank 1: kills itself in epoch 2", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class Started(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        if rank == 0:
            with open(out / "launches.txt", "a") as f:
                f.write(f"started at epoch {backup.restored['epoch'] if backup.restored else 0}\n")


keras.utils.set_random_seed(7)
with tfsparse.SparseStrategy("oktopk", 0.1, tau=7, tau_prime=5):
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(24, activation="tanh"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(5)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
backup = BackupAndRestore(out / "backup")
history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
                    callbacks=[backup, Started(), KillOnce()])
np.save(out / f"weights{rank}.npy", np.concatenate([w.ravel() for w in model.get_weights()]))
print(f"rank {rank}: fit returned after {len(history.history['loss'])} epochs", flush=True)
