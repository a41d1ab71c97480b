"""Worker: rank 0 is killed (SIGKILL) in the middle of writing epoch 2's checkpoint.
argv: out_dir save_weights_only(0/1).  The checkpoint of epoch 1 must stay loadable at the path.

The kill comes from inside Keras' own save: the first save completes and its file's bytes are
recorded (``epoch1.bytes``); the second one writes its file, cuts it to 3,119 bytes (what a
killed writer leaves) and kills the process before the save returns."""
import os
import signal
import sys
from pathlib import Path

import numpy as np
import keras

import tfsparse

out, weights_only = Path(sys.argv[1]), sys.argv[2] == "1"
tfsparse.init()
rank = tfsparse.rank()
path = out / ("ckpt.weights.h5" if weights_only else "ckpt.keras")
saves = []
original = keras.Model.save_weights if weights_only else keras.Model.save


def save_then_die(self, filepath, *args, **kwargs):
    original(self, filepath, *args, **kwargs)
    saves.append(filepath)
    if len(saves) == 2:
        with open(filepath, "r+b") as f:
            f.truncate(3119)
        print(f"rank {rank}: killed while saving to {Path(filepath).name}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class Record(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if rank == 0 and epoch == 0:
            (out / "epoch1.bytes").write_bytes(path.read_bytes())


if weights_only:
    keras.Model.save_weights = save_then_die
else:
    keras.Model.save = save_then_die
rng = np.random.default_rng(rank)
x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 4, 64)
with tfsparse.SparseStrategy("topk", 0.5):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=16, epochs=3, verbose=0,
          callbacks=[tfsparse.keras.callbacks.ModelCheckpoint(str(path), save_weights_only=weights_only), Record()])
print(f"rank {rank}: fit returned", flush=True)
