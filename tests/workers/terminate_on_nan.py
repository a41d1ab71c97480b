"""Worker: the wrapper route, TerminateOnNaN listed before MetricAverage; rank 1's third batch
holds a NaN input, so only rank 1's loss is NaN.  Every rank must stop after that same batch."""
import numpy as np
import keras

import tfsparse
from mpi_harness import save_result

tfsparse.init(backend="mpi")
rank = tfsparse.rank()
rng = np.random.default_rng(rank)
x, y = rng.random((96, 8), dtype=np.float32), rng.integers(0, 4, 96)
if rank == 1:
    x[40] = np.nan  # batch 2 (batch size 16)


class Count(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])
model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.05), "topk", 0.5),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
count = Count()
model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False,
          callbacks=[count, keras.callbacks.TerminateOnNaN(), tfsparse.keras.callbacks.MetricAverage()])
save_result(rank, batches=count.batches, weights=np.concatenate([w.ravel() for w in model.get_weights()]))
