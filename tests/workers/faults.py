"""Worker: one rank fails or leaves during fit.  argv: case backend.  Rank 1 misbehaves at the
end of batch 2 of epoch 1; the others must exit non-zero within 60 s, never hang."""
import os
import signal
import sys
import time

import numpy as np
import keras

import tfsparse

case, backend = sys.argv[1], sys.argv[2]
tfsparse.init(backend=backend)
rank = tfsparse.rank()
rng = np.random.default_rng(rank)
x, y = rng.random((256, 8), dtype=np.float32), rng.integers(0, 4, 256)


class Misbehave(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if rank != 1 or batch != 2 or self.epoch != 1:
            return
        print(f"rank 1: {case} at {time.time():.3f}", flush=True)
        if case == "raise":
            raise RuntimeError("a callback failed on rank 1")
        if case == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if case == "leave":
            self.model.stop_training = True

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


route = os.environ.get("ROUTE", "strategy")
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
if route == "strategy":
    with tfsparse.SparseStrategy("topk", 0.5):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.1), loss)
else:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), "topk", 0.5), loss)
t0 = time.time()
model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[Misbehave()])
print(f"rank {rank}: fit returned after {time.time() - t0:.1f} s", flush=True)
