"""model.fit on digits for several aggregation algorithms, sequentially, in one mpirun job.

Usage: fit_worker.py SPEC_JSON
  SPEC_JSON: a list of runs ``{"algo": NAME, "route": "strategy"|"optimizer", "epochs": E,
  "density": D, "schedule": bool, "wire": W, "bucket_bytes": B, "memory": M, "warmup_epochs": E,
  "options": {...}}`` (``options`` may hold ``selection``, ``clip_norm``); ``schedule`` adds DensitySchedule() (gTop-k's warm-up), ``warmup_epochs``
  DensitySchedule(WarmUp(epochs=E)) (the dense warm-up), ``memory="momentum"`` momentum
  correction (the optimizer then has no momentum of its own), ``wire``/``bucket_bytes``/
  ``options`` the exchange's options; ``validate``: fit validates the test rows in shards a batch
  apart.
Saves, per run ``<algo>/<route>[+schedule]``: test accuracy (each rank evaluating every test row,
and each its shard of them; on the optimizer route, and in runs with ``validate``, also shards of
unequal batch counts, with the loss), whether all ranks' weights are
identical, mean bytes per step, the achieved density and the density set at each epoch.
"""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfsparse  # noqa: E402
from tfsparse.keras.callbacks import (BroadcastInitialState, CommunicationStats, DensitySchedule,  # noqa: E402
                                      MetricAverage)
from tfsparse.keras.ownership import exchange_of  # noqa: E402
from tfsparse.memory import keeps_velocity  # noqa: E402
from mpi_harness import save_result  # noqa: E402

runs = json.loads(sys.argv[1])
comm = tfsparse.init(backend="mpi")
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
perm = np.random.default_rng(0).permutation(len(x))  # a random train/test split (the file's tail is harder)
x, y = x[perm], y[perm]
xs, ys = tfsparse.data.shard(x[:1500], y[:1500], shuffle_seed=0)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build():
    keras.utils.set_random_seed(1234)  # the same initial weights for every algorithm
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


class RecordDensity(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append(float(exchange_of(self.model).density))


out = {}
for run in runs:
    algo, route, epochs, density = run["algo"], run["route"], int(run["epochs"]), float(run["density"])
    options = {"wire_dtype": run.get("wire", "float32"), "plan": run.get("bucket_bytes"),
               "memory": run.get("memory", "residual"), **run.get("options", {})}
    momentum = 0.0 if keeps_velocity(options["memory"]) else 0.9  # momentum correction: not twice
    t0 = time.time()
    record = RecordDensity()
    cbs = ([DensitySchedule()] if run.get("schedule") else []) + [record, CommunicationStats()]
    if run.get("warmup_epochs"):
        cbs.insert(0, DensitySchedule(tfsparse.schedules.WarmUp(epochs=run["warmup_epochs"])))
    if route == "strategy":
        strategy = tfsparse.SparseStrategy(algorithm=algo, density=density, **options)
        with strategy.scope():
            model = build()
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=momentum), loss=loss, metrics=["accuracy"])
    else:
        model = build()
        opt = tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=momentum), algorithm=algo,
                                                  density=density, **options)
        model.compile(optimizer=opt, loss=loss, metrics=["accuracy"])
        cbs = [BroadcastInitialState()] + cbs + [MetricAverage()]
    n = len(x) - 1500 - ((len(x) - 1500) % comm.size == 0)  # test rows in shards a batch apart (below)
    val = tfsparse.data.shard(x[1500:1500 + n], y[1500:1500 + n], drop_remainder=False) if run.get("validate") else None
    hist = model.fit(xs, ys, epochs=epochs, batch_size=32, callbacks=cbs, verbose=0, validation_data=val,
                     validation_batch_size=n // comm.size)
    ev = model.evaluate(x[1500:], y[1500:], verbose=0, return_dict=True)
    # each rank a shard of the test rows, every row kept: the metric states averaged over the ranks
    # (the strategy after every step; MetricAverage on the optimizer route)
    ev_shard = model.evaluate(*tfsparse.data.shard(x[1500:], y[1500:], drop_remainder=False), verbose=0,
                              return_dict=True, callbacks=[MetricAverage()] if route == "optimizer" else [])
    uneven = None
    if route == "optimizer" or val is not None:  # shards a batch apart (one batch of n // P rows, or
        # two): the ranks whose batches ended take part in the others' remaining averagings (MetricAverage
        # on the optimizer route, the strategy's test step)
        ev_n = ev if n == len(x) - 1500 else model.evaluate(x[1500:1500 + n], y[1500:1500 + n], verbose=0,
                                                            return_dict=True)
        ev_uneven = model.evaluate(*tfsparse.data.shard(x[1500:1500 + n], y[1500:1500 + n], drop_remainder=False),
                                   batch_size=n // comm.size, verbose=0, return_dict=True,
                                   callbacks=[MetricAverage()] if route == "optimizer" else [])
        uneven = [[float(ev_n[m]), float(ev_uneven[m])] for m in ("accuracy", "loss")]
        if val is not None:  # fit's validation of the same shards after its last epoch: the same
            uneven += [[float(ev_n[m]), float(hist.history["val_" + m][-1])] for m in ("accuracy", "loss")]
    w = np.concatenate([np.asarray(v.numpy()).ravel() for v in model.weights])
    allw = comm.allgather(w.astype(np.float64))
    key = f"{algo}/{route}" + ("+schedule" if run.get("schedule") else "") + \
        (f"+{run['wire']}" if run.get("wire") else "") + (f"+b{run['bucket_bytes']}" if "bucket_bytes" in run else "") + \
        ("+mc" if run.get("memory") == "momentum" else "") + ("+warmup" if run.get("warmup_epochs") else "") + \
        ("+cm" if run.get("options", {}).get("selection") else "") + \
        ("+clip" if run.get("options", {}).get("clip_norm") else "")
    out[key] = {"accuracy": float(ev["accuracy"]), "sharded_accuracy": float(ev_shard["accuracy"]), "uneven": uneven,
                "identical": all(np.array_equal(allw[0], a) for a in allw),
                "comm_bytes": float(np.mean(hist.history["comm_bytes"])),
                "density": float(np.mean(hist.history["density"])), "densities_set": record.seen,
                "densities": [float(d) for d in hist.history["density"]],
                "seconds": time.time() - t0,
                "buckets": [[b.first, b.last, b.algorithm or algo] for b in exchange_of(model).buckets]}
    if comm.rank == 0:
        print(key, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out[key].items()
                    if k != "densities_set"}, flush=True)
save_result(comm.rank, runs=out)
