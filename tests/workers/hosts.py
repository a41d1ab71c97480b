"""A job across emulated hosts (tfsparse-run --emulate-hosts): where each rank runs, what reached
it from the launching shell, and a short SparseStrategy fit with an Embedding (gTop-k), whose
weights every rank reports; for tests/test_hosts_mpi.py."""
import os
import socket

import numpy as np
import keras

import tfsparse
import tfsparse.horovod.tensorflow as hvd
from mpi_harness import save_result

hvd.init()
r, P = hvd.rank(), hvd.size()
topology = [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]

rng = np.random.default_rng(r)
tokens = rng.integers(0, 30, (96, 5)).astype(np.int32)
labels = (tokens[:, 0] % 3).astype(np.int32)
strategy = tfsparse.SparseStrategy("gtopk", 0.1)
with strategy.scope():
    keras.utils.set_random_seed(r)  # every rank other weights: the strategy makes them rank 0's
    model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(30, 8), keras.layers.Flatten(),
                              keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
losses = model.fit(tokens, labels, batch_size=16, epochs=3, verbose=0).history["loss"]
weights = np.concatenate([np.asarray(v.numpy(), np.float64).reshape(-1) for v in model.variables])
save_result(r, host=socket.gethostname(), topology=topology, probe=os.environ.get("TFSPARSE_PROBE"),
            losses=losses, weights=weights)
