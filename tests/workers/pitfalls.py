"""Worker for failure modes that must not hang: argv[1] selects the case."""
import sys

import numpy as np
import keras

import tfsparse
from mpi_harness import save_result

case = sys.argv[1]
tfsparse.init(backend="mpi")
rank = tfsparse.rank()


def small_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])


loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
rng = np.random.default_rng(rank)

if case == "uneven_steps":
    # rank 0 has 64 rows, the others 96: different numbers of batches per epoch
    n = 64 if rank == 0 else 96
    x, y = rng.random((n, 8), dtype=np.float32), rng.integers(0, 4, n)
    with tfsparse.SparseStrategy("topk", 0.5):
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1), loss)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
elif case in ("uneven_steps_optimizer", "uneven_steps_optimizer_beyond"):
    n = 64 if rank == 0 else 96
    x, y = rng.random((n, 8), dtype=np.float32), rng.integers(0, 4, n)
    model = small_model()
    model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), "topk", 0.5), loss)
    # _beyond: steps_per_epoch=6 on every rank, where rank 0's data holds 4 batches (Keras' loop stops there)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, steps_per_epoch=6 if case.endswith("beyond") else None,
              callbacks=[tfsparse.keras.callbacks.StepCountCheck()])
elif case == "progress_and_predict":
    # default verbosity: only rank 0 prints; predict on rank 0 alone must not block
    x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 4, 64)
    with tfsparse.SparseStrategy("topk", 0.5):
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1), loss, metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=1)
    if rank == 0:
        pred = model.predict(x[:5], verbose=0)
        assert pred.shape == (5, 4)
    ev = model.evaluate(x, y, verbose=0, return_dict=True)
    save_result(rank, eval=ev)
elif case == "optimizer_outside_scope":
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 4, 64)
    with tfsparse.SparseStrategy("topk", 0.5):
        model = small_model()
        model.compile(opt, loss)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    save_result(rank, weights=np.concatenate([w.ravel() for w in model.get_weights()]))
elif case == "other_algorithm":
    # rank 2 is configured with another algorithm: every rank must stop with the same error
    x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 4, 64)
    with tfsparse.SparseStrategy("gtopk" if rank == 2 else "topk", 0.5):
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1), loss)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
elif case == "other_density_optimizer":
    x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 4, 64)
    model = small_model()
    model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), "topk", 0.05 if rank == 1 else 0.5),
                  loss)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
elif case == "other_layer_size":
    x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 4, 64)
    with tfsparse.SparseStrategy("topk", 0.5):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(5 if rank == 1 else 4)])
        model.compile(keras.optimizers.SGD(0.1), loss)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
elif case == "forgot_broadcast":
    # DistributedOptimizer, different seeds per rank, no BroadcastInitialState: rank 0's start
    keras.utils.set_random_seed(100 + rank)
    x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 4, 64)
    model = small_model()
    initial = np.concatenate([w.ravel() for w in model.get_weights()])
    model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), "topk", 0.5), loss)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    save_result(rank, initial=initial, weights=np.concatenate([w.ravel() for w in model.get_weights()]))
elif case == "quiet":
    import warnings

    warnings.warn(f"a warning raised on every rank (this is rank {rank})")
    x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 4, 64)
    with tfsparse.SparseStrategy("topk", 0.5):
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1), loss, metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=2, verbose=1)
else:
    raise SystemExit(f"unknown case {case}")
