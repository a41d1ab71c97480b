"""Worker: for each case, an uninterrupted model.fit of E1 + E2 epochs, and the same training
interrupted after E1 epochs -- tfsparse.keras.callbacks.ModelCheckpoint written by rank 0,
keras.models.load_model on every rank (inside a new SparseStrategy scope for the strategy
route), E2 more epochs.  Saves both final weights and the restored exchange state.

argv: directory JSON   (a list of cases {"algo", "route", "wire", "bucket_bytes", "options",
      "drop_state"}; drop_state restores the residuals alone, a control)
"""
import json
import os
import sys

import numpy as np
import keras

import tfsparse
from mpi_harness import save_result
from resume_cases import data, fresh, settings
from tfsparse.keras.callbacks import BroadcastInitialState, ModelCheckpoint
from tfsparse.keras.ownership import exchange_of, owner_of

ckdir, cases = sys.argv[1], json.loads(sys.argv[2])
if any(case["algo"] == "auto" for case in cases):
    # algorithm="auto" measures as usual but chooses gtopk: the live run and the interrupted one
    # then make the same choice whatever the timings, and the switch to a sparse algorithm and its
    # state are what is saved and restored
    from tfsparse import auto

    _decide = auto.decide

    def forced_decide(*args, **kwargs):
        d = _decide(*args, **kwargs)
        return auto.Decision(next(i for i, c in enumerate(auto.CANDIDATES) if c.algorithm == "gtopk"),
                             d.compute_s, d.link, d.predictions)
    auto.decide = forced_decide
comm = tfsparse.init(backend="mpi")
rank = comm.rank
x, y = data(rank)
E1, E2 = 2, 2


def fit(model, epochs, callbacks=()):
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))


def load(case, path):
    if case["route"] == "strategy":
        with tfsparse.SparseStrategy(**settings(case)).scope():
            return keras.models.load_model(path)
    return keras.models.load_model(path)


flat = lambda m: np.concatenate([w.ravel() for w in m.get_weights()])  # noqa: E731
out = {}
for i, case in enumerate(cases):
    key = f"{case['route']}:{case['algo']}:{case.get('wire', 'float32')}:{case.get('bucket_bytes')}" + \
        (":drop_state" if case.get("drop_state") else "")
    live, cbs = fresh(case)
    fit(live, E1 + E2, cbs)
    first, cbs = fresh(case)
    path = os.path.join(ckdir, f"case{i}.keras")
    fit(first, E1, cbs + [ModelCheckpoint(path)])
    saved = exchange_of(first).get_state()
    comm.barrier()  # rank 0 has written the file
    restored = load(case, path)
    ex = exchange_of(restored)
    state = ex.get_state()  # pending until the first step builds the exchange
    if case.get("drop_state"):  # a control: restore the residuals but not the aggregators' state
        ex.set_state({k: v for k, v in state.items() if not k.startswith("bucket")})
    # the wrapper route resumes with BroadcastInitialState in its callbacks, as the README pairs
    # them: it must not overwrite what every rank restored
    fit(restored, E2, [BroadcastInitialState()] if case["route"] == "optimizer" else [])
    out[f"{key}/live"] = flat(live)
    out[f"{key}/resumed"] = flat(restored)
    out[f"{key}/json"] = {"same_state": sorted(saved) == sorted(state) and
                          all(np.array_equal(saved[k], state[k]) for k in saved),
                          "state_keys": sorted(saved), "algorithm": ex.algorithm, "wire": ex.wire_dtype,
                          "measured_again": None if ex.engine._auto is None else ex.auto_decision is not None,
                          "owner": "optimizer" if owner_of(restored) is not restored.distribute_strategy else None}
save_result(rank, **{k: v for k, v in out.items() if isinstance(v, np.ndarray)},
            cases={k: v for k, v in out.items() if k.endswith("/json")}, files=sorted(os.listdir(ckdir)))
