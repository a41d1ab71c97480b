"""Worker: the wrapper route with EarlyStopping and a log recorder listed *before*
MetricAverage; ranks have data of different difficulty, so their own losses differ."""
import numpy as np
import keras

import tfsparse
from mpi_harness import save_result

tfsparse.init(backend="mpi")
rank = tfsparse.rank()
rng = np.random.default_rng(rank)
x = rng.random((96, 8), dtype=np.float32) * (1 + 3 * rank)
y = rng.integers(0, 4, 96)


class Recorder(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append([logs["loss"], logs["accuracy"], logs["val_loss"]])


model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.05), "topk", 0.5),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
recorder = Recorder()
stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=0.02, patience=0)
model.fit(x, y, batch_size=16, epochs=30, verbose=0, validation_data=(x[:32], y[:32]),
          callbacks=[recorder, stop, tfsparse.keras.callbacks.MetricAverage()])
save_result(rank, seen=np.array(recorder.seen), epochs=len(recorder.seen))
