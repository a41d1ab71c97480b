"""Worker: a non-finite gradient on one rank (fp16 overflow under LossScaleOptimizer, or NaN
input without loss scaling).  argv: case algorithm.  Rank 1's batch 2 of 4 is poisoned."""
import sys
import warnings

import numpy as np
import keras

import tfsparse
from mpi_harness import save_result

case, algorithm = sys.argv[1], sys.argv[2]
tfsparse.init(backend="mpi")
rank = tfsparse.rank()
if case == "fp16_overflow":
    keras.mixed_precision.set_global_policy("mixed_float16")
rng = np.random.default_rng(rank)
x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 4, 64)
if rank == 1:
    x[20] = 1e30 if case == "fp16_overflow" else np.nan  # inside batch 2 of 4 (batch size 16)
strategy = tfsparse.SparseStrategy(algorithm, 0.5)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
opt = model.optimizer
save_result(rank, weights=np.concatenate([w.ravel() for w in model.get_weights()]),
            scale=float(opt.dynamic_scale.numpy()) if hasattr(opt, "dynamic_scale") else 0.0,
            skipped=strategy.exchange.total.skipped_buckets, residual_finite=bool(np.isfinite(strategy.residual).all()),
            warned=sum("is skipped on every rank" in str(w.message) for w in caught))
