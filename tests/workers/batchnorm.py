"""Worker: a BatchNormalization model trained on different data per rank.  argv: route
(strategy | optimizer).  Every variable -- the moving statistics included -- must end equal."""
import sys

import numpy as np
import keras

import tfsparse
from mpi_harness import save_result

route = sys.argv[1]
tfsparse.init(backend="mpi")
rank = tfsparse.rank()
rng = np.random.default_rng(rank)
x = (rng.random((96, 8), dtype=np.float32) + rank).astype(np.float32)  # other statistics per rank
y = rng.integers(0, 4, 96)


def build():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                             keras.layers.Activation("relu"), keras.layers.Dense(4)])


loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
if route == "strategy":
    with tfsparse.SparseStrategy("topk", 0.5):
        model = build()
        model.compile(keras.optimizers.SGD(0.05), loss)
    callbacks = []
else:
    model = build()
    model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.05), "topk", 0.5), loss)
    callbacks = [tfsparse.keras.callbacks.MetricAverage()]
model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks)
bn = model.layers[1]
probe = np.linspace(-1, 2, 40, dtype=np.float32).reshape(5, 8)
save_result(rank, weights=np.concatenate([np.ravel(w) for w in model.get_weights()]),
            moving_mean=np.asarray(bn.moving_mean), predict=model.predict(probe, verbose=0))
