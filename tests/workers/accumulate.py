"""Worker: Keras' gradient accumulation (``SGD(gradient_accumulation_steps=2)``) under
SparseStrategy over a dense float32 exchange: one exchange per applied update, every rank the
same weights, and those of one process trained on all ranks' batches side by side (the mean
gradient of the concatenated batch is the mean of the ranks' mean gradients)."""
import numpy as np
import keras

import tfsparse
from mpi_harness import save_result

tfsparse.init()
rank, size = tfsparse.rank(), tfsparse.size()
data = [np.random.default_rng(r) for r in range(size)]
xs = [g.random((64, 8), dtype=np.float32) for g in data]
ys = [g.integers(0, 4, 64) for g in data]
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    model.compile(keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), loss)
    return model


strategy = tfsparse.SparseStrategy("dense", 1.0)
with strategy:
    model = build()
initial = model.get_weights()
model.fit(xs[rank], ys[rank], batch_size=16, epochs=2, shuffle=False, verbose=0)
reference = build()
reference.set_weights(initial)
# batch i of the reference: batch i of every rank, side by side
order = np.concatenate([np.arange(r * 64, (r + 1) * 64).reshape(4, 16) for r in range(size)], axis=1).reshape(-1)
reference.fit(np.concatenate(xs)[order], np.concatenate(ys)[order], batch_size=16 * size, epochs=2, shuffle=False,
              verbose=0)
save_result(rank, weights=np.concatenate([w.ravel() for w in model.get_weights()]),
            reference=np.concatenate([w.ravel() for w in reference.get_weights()]),
            iterations=int(model.optimizer.iterations.numpy()), rounds=int(strategy.exchange.rounds_done))
