"""Worker: every rank passes ``rank_zero_only(TensorBoard(...))``, ``rank_zero_only(CSVLogger(...))``
and a recording callback, each with a log directory of its own rank; only rank 0's directory may
get files, and on other ranks the wrapped callbacks must not be called at all.

argv: base directory, route (strategy | optimizer)
"""
import os
import sys

import numpy as np
import keras

import tfsparse
from mpi_harness import save_result


class Recorder(keras.callbacks.Callback):
    """Records which of its methods Keras reached through the wrapper."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def set_model(self, model):
        self.calls.append("set_model")
        super().set_model(model)

    def set_params(self, params):
        self.calls.append("set_params")
        super().set_params(params)

    def on_train_begin(self, logs=None):
        self.calls.append("on_train_begin")

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append("on_epoch_end")


base, route = sys.argv[1], sys.argv[2]
comm = tfsparse.init(backend="mpi")
rank = comm.rank
mine = os.path.join(base, f"rank{rank}")
rng = np.random.default_rng(rank)
x, y = rng.random((96, 8), dtype=np.float32), rng.integers(0, 4, 96)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])


if route == "strategy":
    with tfsparse.SparseStrategy("topk", 0.25).scope():
        model = build()
        model.compile(keras.optimizers.SGD(0.05), loss, metrics=["accuracy"])
else:
    model = build()
    model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.05), "topk", 0.25), loss,
                  metrics=["accuracy"])

zero = tfsparse.keras.callbacks.rank_zero_only
recorder = Recorder()
wrapped = [zero(keras.callbacks.TensorBoard(log_dir=os.path.join(mine, "tb"), histogram_freq=1)),
           zero(keras.callbacks.CSVLogger(os.path.join(mine, "log.csv"))), zero(recorder)]
model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, validation_data=(x[:32], y[:32]),
          callbacks=wrapped)
comm.barrier()
files = sorted(os.path.relpath(os.path.join(d, f), mine) for d, _, fs in os.walk(mine) for f in fs)
save_result(rank, exists=os.path.exists(mine), files=files, calls=recorder.calls,
            wrapper_has_model=all(w.model is model for w in wrapped),
            inner_has_model=recorder.model is model if recorder.calls else None,
            wrapper_epochs=[w.params.get("epochs") for w in wrapped])
