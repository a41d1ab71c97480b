"""Worker: trains small digits models with several configs; saves weights, history, eval per config.

argv: backend configs...   where each config is route:algorithm[:density] with route in
{strategy, optimizer, optimizer_in_strategy}.  Rank 0 also trains a single-process reference
(plain Keras, global batch) for dense configs and saves its weights.
"""
import hashlib
import sys

import numpy as np
import keras
from sklearn.datasets import load_digits

import tfsparse
from mpi_harness import save_result

backend = sys.argv[1]
configs = sys.argv[2:]
tfsparse.init(backend=backend)
rank, size = tfsparse.rank(), tfsparse.size()

x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
perm = np.random.default_rng(0).permutation(len(x))
x, y = x[perm], y[perm]
x_train, y_train, x_test, y_test = x[:1440], y[:1440], x[1440:], y[1440:]
BATCH, EPOCHS, LR = 16, 4, 0.05
# rank r takes rows r, r+P, r+2P... so that step s of all ranks is the global batch s of a single process
x_loc, y_loc = x_train[rank::size], y_train[rank::size]


def build():
    keras.utils.set_random_seed(1234 + rank)  # different on purpose: the broadcast must fix it
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10)])


class WeightDigests(keras.callbacks.Callback):
    """A digest of all weights after every training step (to compare ranks bit for bit)."""

    def on_train_begin(self, logs=None):
        self.digests = []

    def on_train_batch_end(self, batch, logs=None):
        h = hashlib.sha1()
        for w in self.model.get_weights():
            h.update(np.ascontiguousarray(w).tobytes())
        self.digests.append(h.hexdigest()[:16])


def compile_(model, opt):
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


out = {}
for cfg in configs:
    route, algo, *rest = cfg.split(":")
    density = float(rest[0]) if rest else 0.05
    digests = WeightDigests()
    cbs = [tfsparse.keras.callbacks.CommunicationStats(), digests]
    if route == "strategy":
        strategy = tfsparse.SparseStrategy(algorithm=algo, density=density)
        with strategy.scope():
            model = build()
            compile_(model, keras.optimizers.SGD(LR, momentum=0.9))
    elif route == "optimizer":
        model = build()
        compile_(model, tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9),
                                                            algorithm=algo, density=density))
        cbs += [tfsparse.keras.callbacks.BroadcastInitialState(), tfsparse.keras.callbacks.MetricAverage()]
    elif route == "optimizer_in_strategy":
        with tfsparse.SparseStrategy(algorithm="dense", density=1.0):
            model = build()
            compile_(model, tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9),
                                                                algorithm=algo, density=density))
    else:
        raise SystemExit(f"unknown route {route}")
    hist = model.fit(x_loc, y_loc, batch_size=BATCH, epochs=EPOCHS, shuffle=False, callbacks=cbs,
                     verbose=2 if rank == 0 else 0)
    ev = model.evaluate(x_test[rank::size], y_test[rank::size], verbose=0, return_dict=True)
    if route == "optimizer":  # no strategy: average evaluate's logs by hand (MetricAverage does it in fit)
        comm = tfsparse.runtime.communicator()
        keys = sorted(ev)
        vals = comm.allreduce(np.array([ev[k] for k in keys])) / size
        ev = dict(zip(keys, map(float, vals)))
    w = np.concatenate([np.asarray(v).ravel() for v in model.get_weights()])
    out[f"{cfg}/weights"] = w
    labels = {k: hist.history.pop(k) for k in tfsparse.keras.callbacks.CommunicationStats.LABELS}
    meta = {"history": {k: [float(a) for a in v] for k, v in hist.history.items()}, "eval": ev, "labels": labels,
            "n_params": int(w.size), "digests": digests.digests, "backend": tfsparse.runtime.backend()}
    out[f"{cfg}/json"] = meta
    if rank == 0 and algo == "dense":
        ref = build()  # rank 0's seed: the same initial weights every rank got by broadcast
        compile_(ref, keras.optimizers.SGD(LR, momentum=0.9))
        ref.fit(x_train, y_train, batch_size=BATCH * size, epochs=EPOCHS, shuffle=False, verbose=0)
        out[f"{cfg}/reference"] = np.concatenate([np.asarray(v).ravel() for v in ref.get_weights()])

arrays = {k: v for k, v in out.items() if isinstance(v, np.ndarray)}
plain = {k: v for k, v in out.items() if k.endswith("/json")}
save_result(rank, **arrays, **plain)
