"""A job across emulated hosts (tfsparse-run --emulate-hosts): where each rank runs, what reached
it from the launching shell, a short SparseStrategy fit with an Embedding (gTop-k), flat and
two-level (hierarchical=True), whose weights every rank reports, and the two-level exchange's
numpy cases (tests/workers/two_level.py); for tests/test_hosts_mpi.py."""
import os

import numpy as np
import keras

import tfsparse
import tfsparse.horovod.tensorflow as hvd
from mpi_harness import save_result
from two_level import run_cases

hvd.init()
r, P = hvd.rank(), hvd.size()
topology = [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]

rng = np.random.default_rng(r)
tokens = rng.integers(0, 30, (96, 5)).astype(np.int32)
labels = (tokens[:, 0] % 3).astype(np.int32)


def fit(**kwargs):
    with tfsparse.SparseStrategy("gtopk", 0.1, **kwargs).scope():
        keras.utils.set_random_seed(r)  # every rank other weights: the strategy makes them rank 0's
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(30, 8),
                                  keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = model.fit(tokens, labels, batch_size=16, epochs=3, verbose=0).history["loss"]
    return losses, np.concatenate([np.asarray(v.numpy(), np.float64).reshape(-1) for v in model.variables])


losses, weights = fit()
two_losses, two_weights = fit(hierarchical=True)
save_result(r, topology=topology, probe=os.environ.get("TFSPARSE_PROBE"),
            losses=losses, weights=weights, two_level_losses=two_losses, two_level_weights=two_weights,
            **run_cases(tfsparse.init()))
