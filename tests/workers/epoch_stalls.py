"""Worker: several epochs of ``model.fit`` under SparseStrategy with CPU-bound steps on every
rank (the cores shared by the ranks), recording every gap between one step's end and the next
step's begin -- across epoch boundaries too, validation excluded.  ``argv[1] == "autotune"``
hands ``fit`` a dataset with tf.data's autotuner explicitly on (the strategy keeps a user's
choice): the control that shows what the gaps were before the strategy turned it off."""
import sys
import time

import numpy as np
import keras
import tensorflow as tf

import tfsparse
from mpi_harness import save_result

tfsparse.init(backend="mpi")
rank = tfsparse.rank()
rng = np.random.default_rng(rank)
x = rng.random((12 * 32, 64), dtype=np.float32)
y = rng.integers(0, 10, len(x))
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
if sys.argv[1:] == ["autotune"]:
    options = tf.data.Options()
    options.autotune.enabled = True
    data = data.with_options(options)


class Gaps(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.gaps, self.last, self.testing = [], None, 0.0

    def on_train_batch_begin(self, batch, logs=None):
        if self.last is not None:
            self.gaps.append(time.perf_counter() - self.last - self.testing)
        self.testing = 0.0

    def on_train_batch_end(self, batch, logs=None):
        self.last = time.perf_counter()

    def on_test_begin(self, logs=None):
        self._t = time.perf_counter()

    def on_test_end(self, logs=None):
        self.testing += time.perf_counter() - self._t


strategy = tfsparse.SparseStrategy("topk", 0.01)
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(4096, activation="relu"),
                              keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
gaps = Gaps()
model.fit(data, epochs=6, verbose=0, validation_data=(x[:64], y[:64]), callbacks=[gaps])
save_result(rank, gaps=np.array(gaps.gaps))
