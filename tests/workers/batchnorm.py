"""Worker: a BatchNormalization model trained on different data per rank.  argv: route
(strategy | optimizer).  Every variable -- the moving statistics included -- must end equal; then
the same with the moving mean kept local (Horovod's ``local_variables``): it must end each rank's
own, the rest equal (also when kept from a second fit on); kept local on rank 0 only: every rank refuses before the
first step; and a ModelCheckpoint listed before MetricAverage saves the ranks' mean of the moving statistics."""
import os
import sys

import numpy as np
import keras

import tfsparse
import tfsparse.horovod.tensorflow.keras as hvd
from mpi_harness import error_of, save_result

route = sys.argv[1]
tfsparse.init(backend="mpi")
hvd.init()  # for the Horovod callback of the second model
rank = tfsparse.rank()
rng = np.random.default_rng(rank)
x = (rng.random((96, 8), dtype=np.float32) + rank).astype(np.float32)  # other statistics per rank
y = rng.integers(0, 4, 96)


def build():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                             keras.layers.Activation("relu"), keras.layers.Dense(4)])


loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train(local=False, rank0_only=False):
    """The route's model and a function that fits it for two epochs; ``local``: its moving mean
    kept each rank's own (``rank0_only``: kept so on rank 0 alone, which every rank must refuse)."""
    if route == "strategy":
        with tfsparse.SparseStrategy("topk", 0.5):
            model = build()
            model.compile(keras.optimizers.SGD(0.05), loss)
        callbacks = []
    else:
        model = build()
        model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.05), "topk", 0.5), loss)
        callbacks = [tfsparse.keras.callbacks.MetricAverage()]
    if local:
        kept = [model.layers[1].moving_mean] if rank == 0 or not rank0_only else []
        callbacks.append(hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=kept))
    return model, lambda *more: model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks + list(more))


def rest(model):
    """Every weight of ``model`` but the moving mean, flat."""
    return np.concatenate([np.ravel(np.asarray(v)) for v in model.weights if v is not model.layers[1].moving_mean])


model, fit = train()
fit()
bn = model.layers[1]
probe = np.linspace(-1, 2, 40, dtype=np.float32).reshape(5, 8)
result = dict(weights=np.concatenate([np.ravel(w) for w in model.get_weights()]),
              moving_mean=np.asarray(bn.moving_mean), predict=model.predict(probe, verbose=0))
model, fit = train(local=True)
fit()
bn = model.layers[1]
late, fit_late = train()  # kept local from its second fit on (SparseStrategy's step traced in the first)
fit_late()
fit_late(hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[late.layers[1].moving_mean]))
# a checkpoint listed before MetricAverage (the documented order: MetricAverage last) holds the ranks'
# mean of the moving statistics, not rank 0's own: what every rank holds after fit's averaging
saved, _ = train()
path = os.path.join(os.environ["TFSPARSE_TEST_OUT"], "bn.weights.h5")
saved.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
    tfsparse.keras.callbacks.ModelCheckpoint(path, save_weights_only=True),
    *([tfsparse.keras.callbacks.MetricAverage()] if route == "optimizer" else [])])
result["saved_is_held"] = None
if rank == 0:
    import h5py

    found = []  # BatchNormalization's variables: gamma, beta, moving mean (2), moving variance
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.append(np.asarray(obj)) if isinstance(obj, h5py.Dataset)
                     and "batch_normalization" in name and name.endswith("vars/2") else None)
    result["saved_is_held"] = len(found) == 1 and np.array_equal(found[0], np.asarray(saved.layers[1].moving_mean))
save_result(rank, **result, local_mean=np.asarray(bn.moving_mean), local_rest=rest(model),
            late_mean=np.asarray(late.layers[1].moving_mean), late_rest=rest(late),
            mismatch=error_of(train(True, rank0_only=True)[1]))
