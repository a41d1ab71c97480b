"""A job across emulated hosts (tfsparse-run --emulate-hosts): where each rank runs, what reached
it from the launching shell, short SparseStrategy fits with an Embedding -- gTop-k flat and
two-level (hierarchical=True), gTop-k two-level over a bucket per tensor pipelined
(pipeline=2), algorithm="auto" switching to two levels at its decision -- whose weights every
rank reports, and the two-level exchange's numpy cases (tests/workers/two_level.py); for
tests/test_hosts_mpi.py."""
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


def fit(*args, **kwargs):
    strategy = tfsparse.SparseStrategy(*(args or ("gtopk", 0.1)), **kwargs)
    with strategy.scope():
        keras.utils.set_random_seed(r)  # every rank other weights: the strategy makes them rank 0's
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(30, 8),
                                  keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = model.fit(tokens, labels, batch_size=16, epochs=3, verbose=0).history["loss"]
    fit.two_level = strategy.exchange.engine.two_level is not None
    return losses, np.concatenate([np.asarray(v.numpy(), np.float64).reshape(-1) for v in model.variables])


def forced_two_level_auto():
    """algorithm="auto" with its decision forced to dense over float16 in two levels: the switch
    from the flat measured rounds to the hosts' groups mid-fit."""
    import dataclasses

    from tfsparse import auto

    real = auto.decide
    index = next(i for i, c in enumerate(auto.CANDIDATES) if c.algorithm == "dense" and c.wire_dtype == "float16")
    auto.decide = lambda *a, **k: dataclasses.replace(real(*a, **k), index=index, two_level=True, trial_rounds=0)
    try:
        return fit("auto")
    finally:
        auto.decide = real


losses, weights = fit()
cases = {}
for name, args, kwargs in [("two_level", (), {"hierarchical": True}),
                           ("two_level_pipelined", ("gtopk", 0.1), {"plan": 0, "pipeline": 2, "hierarchical": True})]:
    cases[f"{name}_losses"], cases[f"{name}_weights"] = fit(*args, **kwargs)
cases["auto_losses"], cases["auto_weights"] = forced_two_level_auto()
cases["auto_two_level"] = fit.two_level
save_result(r, topology=topology, probe=os.environ.get("TFSPARSE_PROBE"), losses=losses, weights=weights,
            **cases, **run_cases(tfsparse.init()))
