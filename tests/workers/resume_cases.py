"""What the resume workers (resume.py: ModelCheckpoint; backup.py: BackupAndRestore) share: each
rank's data, the model, and a fresh compiled model of a case {"algo", "route", "wire",
"bucket_bytes", "options"} -- through a new SparseStrategy or a DistributedOptimizer."""
import numpy as np
import keras

import tfsparse
from tfsparse.keras.callbacks import BroadcastInitialState

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(rank: int):
    """This rank's 96 rows: 6 steps per epoch of 16."""
    rng = np.random.default_rng(rank)
    return rng.random((96, 12), dtype=np.float32), rng.integers(0, 5, 96)


def build():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(24, activation="tanh"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(5)])


def settings(case):
    return dict(algorithm=case["algo"], density=0.1, wire_dtype=case.get("wire", "float32"),
                plan=case.get("bucket_bytes"), **case.get("options", {}))


def fresh(case):
    """A compiled model of this case's route (strategy: its own new strategy) and the callbacks
    that route needs."""
    if case["route"] == "strategy":
        with tfsparse.SparseStrategy(**settings(case)).scope():
            model = build()
            model.compile(keras.optimizers.SGD(0.05, momentum=0.9), LOSS)
        return model, []
    model = build()
    model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), **settings(case)),
                  LOSS)
    return model, [BroadcastInitialState()]
