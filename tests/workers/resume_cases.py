"""What the resume workers (resume.py: ModelCheckpoint; backup.py: BackupAndRestore) share: each
rank's data, the model, and a fresh compiled model of a case {"algo", "route", "wire",
"bucket_bytes", "options", and optionally "memory", "momentum", "pipeline"} -- through a new
SparseStrategy or a DistributedOptimizer.  A case with ``memory="momentum"`` (momentum correction)
gets an SGD without momentum of its own."""
import numpy as np
import keras

import tfsparse
from tfsparse.keras.callbacks import BroadcastInitialState
from tfsparse.memory import keeps_velocity

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
    extra = {name: case[name] for name in ("memory", "momentum", "pipeline") if name in case}
    if case["algo"] == "auto":  # it chooses density and wire
        return dict(algorithm="auto", plan=case.get("bucket_bytes"), **extra)
    return dict(algorithm=case["algo"], density=0.1, wire_dtype=case.get("wire", "float32"),
                plan=case.get("bucket_bytes"), **extra, **case.get("options", {}))


def key(case):
    """The case's name in the results (backup.py and its test)."""
    return (f"{case['route']}:{case['algo']}:{case.get('wire', 'float32')}" +
            "".join(f":{name}={case[name]}" for name in ("memory", "pipeline") if name in case))


def sgd(case):
    return keras.optimizers.SGD(0.05, momentum=0.0 if keeps_velocity(case.get("memory", "auto")) else 0.9)


def fresh(case):
    """A compiled model of this case's route (strategy: its own new strategy) and the callbacks
    that route needs."""
    if case["route"] == "strategy":
        with tfsparse.SparseStrategy(**settings(case)).scope():
            model = build()
            model.compile(sgd(case), LOSS)
        return model, []
    model = build()
    model.compile(tfsparse.keras.DistributedOptimizer(sgd(case), **settings(case)),
                  LOSS)
    return model, [BroadcastInitialState()]
