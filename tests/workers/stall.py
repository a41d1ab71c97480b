"""Worker: rank 1 stops for ``seconds`` in a callback (epoch 0, after batch 2) while the others
wait for it in the next step's exchange.  argv: seconds stall_warning ("none": off) [how: "sleep"
(default: time.sleep, which lets go of Python's GIL) or "gil" (libc's sleep called through
ctypes.PyDLL, which holds it)].  The stall timeout comes from TFSPARSE_STALL_TIMEOUT, the stacks
from TFSPARSE_STALL_STACKS, when the test sets them."""
import ctypes
import sys
import time

import numpy as np
import keras

import tfsparse

seconds, warning = float(sys.argv[1]), sys.argv[2]
how = sys.argv[3] if len(sys.argv) > 3 else "sleep"
tfsparse.init(stall_warning=None if warning == "none" else float(warning))
rank = tfsparse.rank()


class Stop(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if rank == 1 and batch == 2 and self.epoch == 0:
            print(f"rank 1: stops for {seconds:g} s at {time.time():.3f}", flush=True)
            if how == "gil":
                ctypes.PyDLL(None).sleep(int(seconds))  # a PyDLL call keeps the GIL
            else:
                time.sleep(seconds)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


rng = np.random.default_rng(rank)
x, y = rng.random((128, 8), dtype=np.float32), rng.integers(0, 4, 128)
with tfsparse.SparseStrategy("topk", 0.5):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[Stop()])
print(f"rank {rank}: fit returned", flush=True)
