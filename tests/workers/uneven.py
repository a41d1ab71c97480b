"""Worker: ranks whose data runs out at different steps.  argv: case.

* ``end``: a tf.data pipeline of unknown length (``filter``): rank 0 has 10 batches per epoch,
  the last rank 9 (the others 10); under the default uneven_data="end" every rank runs 9 steps in
  each of 3 epochs and the weights stay identical; then ``evaluate`` on the same data; then the
  model, its strategy and exchange are freed once deleted.  Its ``fit`` validates every epoch on
  arrays of known, uneven length (10 batches, 9 on the last rank), and a callback evaluates other
  such arrays (4 batches, 3; with MetricAverage, which does nothing there) at every epoch's end;
  before the fit, an evaluate of such arrays builds the model: each is compared with the whole
  set's metrics.  After it, ``evaluate(steps=10)`` where the last rank has 9 batches raises
  StepCountMismatch on every rank.
* ``error``: the same data with uneven_data="error": fit raises StepCountMismatch.
* ``join``: the same data with uneven_data="join": 10 steps per epoch on every rank, the last
  rank's 10th batch zero-weighted; and a reference fit on known-length arrays with that batch
  written out with sample weights 0.
* ``empty``: the last rank's filter keeps nothing: a ValueError naming it.
* ``known``: arrays of known, different lengths: ``except tfsparse.StepCountMismatch`` catches it;
  ``known_uncaught``: the same, not caught.
* ``other_algorithm``: the last rank uses gtopk, the others topk: ``except
  tfsparse.ConfigurationMismatch`` catches it on every rank.
"""
import gc
import sys
import weakref

import numpy as np
import keras
import tensorflow as tf

import tfsparse
from mpi_harness import save_result

case = sys.argv[1]
comm = tfsparse.init()
rank, size = tfsparse.rank(), tfsparse.size()
last = rank == size - 1
rng = np.random.default_rng(rank)
x, y = rng.random((160, 8), dtype=np.float32), rng.integers(0, 4, 160)


def dataset(keep):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).enumerate().filter(lambda i, xy: i < keep)
    return ds.map(lambda i, xy: xy).batch(16)


class Count(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1


with tfsparse.SparseStrategy("topk", 0.5, uneven_data="error" if case == "error" else "end"):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
count = Count()
if case == "other_algorithm":  # the last rank configured differently: caught as itself everywhere
    with tfsparse.SparseStrategy("gtopk" if last else "topk", 0.5):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        caught = None
    except tfsparse.ConfigurationMismatch as e:
        caught = str(e)
    save_result(rank, caught=caught)
    sys.exit(0)
if case == "known_uncaught":  # the error reaches the top of every rank
    n = 64 if rank == 0 else 96
    model.fit(x[:n], y[:n], batch_size=16, epochs=1, verbose=0)
if case == "known":
    n = 64 if rank == 0 else 96
    try:
        model.fit(x[:n], y[:n], batch_size=16, epochs=1, verbose=0)
        caught = None
    except tfsparse.StepCountMismatch as e:
        caught = str(e)
    save_result(rank, caught=caught)
    sys.exit(0)
if case == "join":  # the last rank's 10th batch: its first batch again, weighted 0
    keep = 144 if last else 160

    def seeded(uneven_data):
        with tfsparse.SparseStrategy("topk", 0.5, uneven_data=uneven_data):
            keras.utils.set_random_seed(7)
            m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
            m.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return m

    model = seeded("join")
    model.fit(dataset(keep), epochs=2, verbose=0, callbacks=[count])
    reference = seeded("end")  # known length: the same batches, the zero-weighted one written out
    pad = 160 - keep
    weights = np.concatenate([np.ones(keep, np.float32), np.zeros(pad, np.float32)])
    reference.fit(np.concatenate([x[:keep], x[:pad]]), np.concatenate([y[:keep], y[:pad]]), sample_weight=weights,
                  batch_size=16, epochs=2, shuffle=False, verbose=0)
    save_result(rank, steps=count.steps, weights=np.concatenate([w.ravel() for w in model.get_weights()]),
                reference=np.concatenate([w.ravel() for w in reference.get_weights()]))
    sys.exit(0)


class Nested(keras.callbacks.Callback):
    """An ``evaluate`` inside ``fit``, at every epoch's end, of its own uneven data."""

    def on_epoch_end(self, epoch, logs=None):
        self.logs = self.model.evaluate(x[:40 if last else 56], y[:40 if last else 56], batch_size=16, verbose=0,
                                        return_dict=True, callbacks=[tfsparse.keras.callbacks.MetricAverage()])


def whole(rows):
    """The metrics of every rank's first ``rows`` rows together (each rank evaluating all of them)."""
    both = [comm.allgather(a[:rows].astype(np.float64).ravel()) for a in (x, y)]  # flat, as a communicator gathers
    return model.evaluate(np.concatenate(both[0]).reshape(-1, 8).astype(np.float32),
                          np.concatenate(both[1]).astype(np.int64), batch_size=16, verbose=0, return_dict=True)


keep = {"end": 144 if last else 160, "error": 144 if last else 160, "empty": 0 if last else 160}[case]
before = None
if case == "end":  # an unbuilt model (Keras builds it from the first batch it is given) on uneven arrays
    before = model.evaluate(x[:40 if last else 56], y[:40 if last else 56], batch_size=16, verbose=0,
                            return_dict=True)
    before = [[before[m], whole(40 if last else 56)[m]] for m in ("loss", "accuracy")]
nested = Nested()
hist = model.fit(dataset(keep), epochs=3, verbose=0, callbacks=[count, nested],
                 validation_data=(x[:keep], y[:keep]) if case == "end" else None, validation_batch_size=16)
ev = model.evaluate(dataset(keep), verbose=0, return_dict=True)
whole_val, whole_nested = whole(keep), whole(40 if last else 56)
uneven = [[hist.history["val_" + m][-1], whole_val[m]] for m in ("loss", "accuracy")] + \
    [[nested.logs[m], whole_nested[m]] for m in ("loss", "accuracy")] + before
try:  # steps beyond the last rank's 9 batches: Keras would run 9 there and 10 elsewhere
    model.evaluate(x[:keep], y[:keep], batch_size=16, steps=10, verbose=0)
    beyond = None
except tfsparse.StepCountMismatch as e:
    beyond = str(e)
weights, steps = np.concatenate([w.ravel() for w in model.get_weights()]), count.steps
# the model, its strategy and exchange, once nothing holds them, are freed: TensorFlow keeps the
# Python functions of the traced steps' and the datasets' tf.numpy_function ops (the metric
# averaging, the per-batch data vote), which hold them weakly
strategy = model.distribute_strategy
held = [weakref.ref(o) for o in (model, strategy, strategy.extended.exchange)]
del model, strategy, count, nested, hist  # a callback (and History) holds its model
gc.collect()
save_result(rank, steps=steps, weights=weights, eval=ev, uneven=uneven, beyond=beyond,
            freed=[r() is None for r in held])
print(f"rank {rank}: done", flush=True)
