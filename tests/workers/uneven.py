"""Worker: ranks whose data runs out at different steps.  argv: case.

* ``end``: a tf.data pipeline of unknown length (``filter``): rank 0 has 10 batches per epoch,
  the last rank 9 (the others 10); under the default uneven_data="end" every rank runs 9 steps in
  each of 3 epochs and the weights stay identical; then ``evaluate`` on the same data.
* ``error``: the same data with uneven_data="error": fit raises StepCountMismatch.
* ``empty``: the last rank's filter keeps nothing: a ValueError naming it.
* ``known``: arrays of known, different lengths: ``except tfsparse.StepCountMismatch`` catches it;
  ``known_uncaught``: the same, not caught.
* ``other_algorithm``: the last rank uses gtopk, the others topk: ``except
  tfsparse.ConfigurationMismatch`` catches it on every rank.
"""
import sys

import numpy as np
import keras
import tensorflow as tf

import tfsparse
from mpi_harness import save_result

case = sys.argv[1]
tfsparse.init()
rank, size = tfsparse.rank(), tfsparse.size()
last = rank == size - 1
rng = np.random.default_rng(rank)
x, y = rng.random((160, 8), dtype=np.float32), rng.integers(0, 4, 160)


def dataset(keep):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).enumerate().filter(lambda i, xy: i < keep)
    return ds.map(lambda i, xy: xy).batch(16)


class Count(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1


with tfsparse.SparseStrategy("topk", 0.5, uneven_data="error" if case == "error" else "end"):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
count = Count()
if case == "other_algorithm":  # the last rank configured differently: caught as itself everywhere
    with tfsparse.SparseStrategy("gtopk" if last else "topk", 0.5):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        caught = None
    except tfsparse.ConfigurationMismatch as e:
        caught = str(e)
    save_result(rank, caught=caught)
    sys.exit(0)
if case == "known_uncaught":  # the error reaches the top of every rank
    n = 64 if rank == 0 else 96
    model.fit(x[:n], y[:n], batch_size=16, epochs=1, verbose=0)
if case == "known":
    n = 64 if rank == 0 else 96
    try:
        model.fit(x[:n], y[:n], batch_size=16, epochs=1, verbose=0)
        caught = None
    except tfsparse.StepCountMismatch as e:
        caught = str(e)
    save_result(rank, caught=caught)
    sys.exit(0)
keep = {"end": 144 if last else 160, "error": 144 if last else 160, "empty": 0 if last else 160}[case]
model.fit(dataset(keep), epochs=3, verbose=0, callbacks=[count])
ev = model.evaluate(dataset(keep), verbose=0, return_dict=True)
save_result(rank, steps=count.steps, weights=np.concatenate([w.ravel() for w in model.get_weights()]), eval=ev)
print(f"rank {rank}: done", flush=True)
