"""Worker: rank 0 writes a ModelCheckpoint (via rank_zero_only); the file holds the residual;
every rank restores it and continues training exactly like the live model.

argv: directory
"""
import os
import sys

import numpy as np
import keras

import tfsparse
from mpi_harness import save_result

ckdir = sys.argv[1]
comm = tfsparse.init(backend="mpi")
rank = comm.rank
rng = np.random.default_rng(rank)
x, y = rng.random((96, 8), dtype=np.float32), rng.integers(0, 4, 96)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compiled(model):
    model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), "topk", 0.1),
                  loss)
    return model


keras.utils.set_random_seed(rank)
model = compiled(keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                   keras.layers.Dense(4)]))
path = os.path.join(ckdir, "ckpt.keras")
ckpt = tfsparse.keras.callbacks.ModelCheckpoint(path)
model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
          callbacks=[tfsparse.keras.callbacks.BroadcastInitialState(), ckpt,
                     tfsparse.keras.callbacks.rank_zero_only(keras.callbacks.CSVLogger(os.path.join(ckdir, "log.csv")))])
comm.barrier()  # rank 0 has written the file
restored = keras.models.load_model(path)
live_res = model.optimizer.residual
rest_res = restored.optimizer.residual
# continue both for one epoch: identical only if the residual and momentum were restored
model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
restored.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
flat = lambda m: np.concatenate([w.ravel() for w in m.get_weights()])
save_result(rank, live_res=live_res, rest_res=rest_res, live_w=flat(model), rest_w=flat(restored),
            files=sorted(os.listdir(ckdir)), config=restored.optimizer.get_config()["algorithm"])
