"""Worker: a non-finite gradient on one rank (fp16 overflow under loss scaling, or NaN input
without).  argv: case algorithm [route: strategy | optimizer | strategy_optimizer] [row].  Rank 1's
row ``row`` (default 20: batch 2 of 4; 0: the first batch, the exchange's first round) is poisoned."""
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
route = sys.argv[3] if len(sys.argv) > 3 else "strategy"
row = int(sys.argv[4]) if len(sys.argv) > 4 else 20  # 20: inside batch 2 of 4 (batch size 16)
if rank == 1:
    x[row] = 1e30 if case == "fp16_overflow" else np.nan


def build():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = tfsparse.keras.DistributedOptimizer(sgd, algorithm, 0.5) if route != "strategy" else sgd
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


if route == "optimizer":  # the wrapper alone, no strategy
    model = build()
    exchange = model.optimizer.exchange
else:  # the strategy with a plain optimizer, or with the wrapper inside its scope
    strategy = tfsparse.SparseStrategy(algorithm, 0.5)
    with strategy.scope():
        model = build()
    exchange = tfsparse.keras.ownership.exchange_of(model)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
opt = model.optimizer
save_result(rank, weights=np.concatenate([w.ravel() for w in model.get_weights()]),
            scale=float(opt.dynamic_scale.numpy()) if hasattr(opt, "dynamic_scale") else 0.0,
            skipped=exchange.total.skipped_buckets, residual_finite=bool(np.isfinite(exchange.residual).all()),
            optimizer=type(opt).__name__,
            warned=sum("is skipped on every rank" in str(w.message) for w in caught))
