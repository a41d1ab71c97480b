"""Worker: a custom training loop (tf.GradientTape + DistributedOptimizer) on a model with
BatchNormalization, different data statistics per rank; at each epoch's end
``tfsparse.keras.callbacks.average_moving_statistics(model)``.  Saves the moving statistics
before and after each call."""
import numpy as np
import keras
import tensorflow as tf

import tfsparse
from mpi_harness import save_result

tfsparse.init()
rank = tfsparse.rank()
rng = np.random.default_rng(rank)
x = (rng.random((96, 8), dtype=np.float32) + rank).astype(np.float32)
y = rng.integers(0, 4, 96)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                          keras.layers.Activation("relu"), keras.layers.Dense(4)])
optimizer = tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.05), "topk", 0.5)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
tfsparse.keras.callbacks.broadcast_variables(model.variables)


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


bn = model.layers[1]
before, after = [], []
for epoch in range(2):
    for i in range(6):
        train_step(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
    before.append(np.concatenate([np.asarray(bn.moving_mean), np.asarray(bn.moving_variance)]))
    assert tfsparse.keras.callbacks.average_moving_statistics(model) == 2
    after.append(np.concatenate([np.asarray(bn.moving_mean), np.asarray(bn.moving_variance)]))
save_result(rank, before=np.stack(before), after=np.stack(after),
            trainable=np.concatenate([np.ravel(w) for w in model.trainable_weights]))
