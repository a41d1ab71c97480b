"""Pipe-SGD through Keras: a linear model trained with plain SGD, so that the test can replay
the exact update sequence in numpy from every rank's data.

Usage: pipeline.py CASE
  staleness-strategy / staleness-optimizer: pipeline=2, 2 epochs of 3 steps (SparseStrategy, or
    DistributedOptimizer without a strategy); staleness-horovod: SparseStrategy on the Horovod
    backend;
  dsync: SparseStrategy, pipeline=2 with DSyncWarmUp(epochs=1);
  fail: pipeline=2, rank 1 raises in a callback while its round is in flight.
Saves per rank: the data, the initial and final weights, the exchange's held round, whether a
round was left in flight, and the bytes of each epoch.
"""
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import keras  # noqa: E402

import tfsparse  # noqa: E402
from tfsparse.keras.callbacks import CommunicationStats, DSyncWarmUp  # noqa: E402
from tfsparse.keras.ownership import exchange_of  # noqa: E402
from mpi_harness import save_result  # noqa: E402

STEPS, BATCH, EPOCHS, LR = 3, 4, 2, 0.1
case = sys.argv[1]
comm = tfsparse.init(backend="horovod" if case.endswith("horovod") else "mpi")
rng = np.random.default_rng(100 + comm.rank)
x = rng.standard_normal((STEPS * BATCH, 5)).astype("float32")
y = rng.standard_normal((STEPS * BATCH, 2)).astype("float32")


def build():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])


class Fail(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if comm.rank == 1 and batch == 1:
            raise RuntimeError("injected failure on rank 1 while its round is in flight")


class EpochBytes(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.bytes = []

    def on_epoch_end(self, epoch, logs=None):
        self.bytes.append(float(logs["comm_bytes"]))


record = EpochBytes()
callbacks = [CommunicationStats(), record]
if case == "fail":
    callbacks.append(Fail())
if case == "dsync":
    callbacks.insert(0, DSyncWarmUp(epochs=1))
if case == "staleness-optimizer":
    model = build()
    opt = tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(LR), algorithm="dense", density=1.0, pipeline=2)
    model.compile(optimizer=opt, loss="mse")
else:
    wire = "int8" if case == "dsync" else "float32"
    strategy = tfsparse.SparseStrategy("dense", 1.0, wire_dtype=wire, pipeline=2)
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
w0 = [v.numpy().copy() for v in model.trainable_weights]
model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, callbacks=callbacks, verbose=0)
exchange = exchange_of(model)
in_flight = any(b.futures for b in exchange.bucket_states)
state = exchange.get_state()


def nice(tid):
    return os.getpriority(os.PRIO_PROCESS, tid)


# the communication thread runs ahead of the training's threads (quiet waits, their nice raised)
quiet = exchange.engine._xcomm.quiet_pause
# a synchronous exchange built afterwards: its communication thread level with the training's
sync = tfsparse.GradientExchange("dense", 1.0)
total = sync.exchange_numpy(np.full(3, comm.rank + 1.0, np.float32))
runner = getattr(sync._runner, "_thread", None)
save_result(comm.rank, x=x, y=y, w0=w0[0], b0=w0[1], w=model.trainable_weights[0].numpy(),
            b=model.trainable_weights[1].numpy(), pending=state["pending"], in_flight=np.array(in_flight),
            epoch_bytes=np.array(record.bytes), quiet=np.array(-1.0 if quiet is None else quiet),
            nice_comm=np.array(nice(exchange.engine._runner._thread.native_id)),
            nice_main=np.array(nice(threading.get_native_id())), sync_total=total,
            nice_sync=np.array(nice(runner.native_id) if runner is not None else nice(threading.get_native_id())))
