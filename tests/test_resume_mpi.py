"""Checkpoint and resume on real mpirun (P = 3): for every algorithm, through SparseStrategy
with a plain optimizer and through DistributedOptimizer, training interrupted by a
tfsparse.keras.callbacks.ModelCheckpoint file and resumed with keras.models.load_model ends
bit-identical to an uninterrupted run -- Ok-Topk stopped between two threshold
re-evaluations, DGC's sampler mid-stream, lossy wires and buckets included."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mpi_harness import mpirun

pytestmark = pytest.mark.mpi

ALGOS = ("dense", "topk", "gtopk", "oktopk", "dgc", "gaussiank")
OKTOPK = {"tau": 7, "tau_prime": 5}  # 6 steps per epoch: the checkpoint after step 12 is mid-period
# DGC samples (797 gradients > 16): the generator's state matters; seeded so that the live run
# and the interrupted one draw the same numbers from the start.  Without the exact top-k of small
# tensors and the truncation to the k largest (both make the selection independent of the sample)
DGC = {"sample_ratio": 0.1, "min_samples": 16, "seed": 11, "exact_below": 0, "truncate": None}
OPTIONS = {"oktopk": OKTOPK, "dgc": DGC}
CASES = [{"algo": a, "route": route, "options": OPTIONS.get(a, {}), **({"wire": "float16"} if a == "dense" else {})}
         for a in ALGOS for route in ("strategy", "optimizer")]
CASES += [{"algo": "topk", "route": "optimizer", "wire": "int8", "bucket_bytes": 256},
          {"algo": "oktopk", "route": "strategy", "wire": "bfloat16", "bucket_bytes": 0, "options": OKTOPK},
          {"algo": "oktopk", "route": "strategy", "options": OKTOPK, "drop_state": True},
          {"algo": "dgc", "route": "optimizer", "options": DGC, "drop_state": True},
          # algorithm="auto": 10 measured rounds, then gtopk (forced by the worker), before the checkpoint (after 12)
          {"algo": "auto", "route": "strategy"}, {"algo": "auto", "route": "optimizer"}]


def key(case):
    return (f"{case['route']}:{case['algo']}:{case.get('wire', 'float32')}:{case.get('bucket_bytes')}" +
            (":drop_state" if case.get("drop_state") else ""))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    results, _ = mpirun(3, "resume.py", tmp_path_factory.mktemp("ckpt"), json.dumps(CASES), timeout=480)
    return results


@pytest.mark.parametrize("case", [c for c in CASES if not c.get("drop_state")], ids=key)
def test_resume_is_bit_identical(resumed, case):
    k = key(case)
    for r, res in enumerate(resumed):
        assert res["files"] == sorted(f"case{i}.keras" for i in range(len(CASES)))  # rank 0 wrote them
        meta = res["cases"][f"{k}/json"]
        assert meta["same_state"], f"{k}: rank {r} restored another exchange state"
        if case["algo"] == "auto":  # the (forced) decision is restored, not measured again
            assert "auto" in meta["state_keys"] and meta["algorithm"] == "gtopk" and meta["measured_again"] is False
        else:
            assert meta["algorithm"] == case["algo"] and meta["wire"] == case.get("wire", "float32")
        assert meta["owner"] == ("optimizer" if case["route"] == "optimizer" else None)
        assert "residual" in meta["state_keys"] or (case["algo"] in ("dense", "auto") and case.get("wire") is None)
        np.testing.assert_array_equal(res[f"{k}/resumed"], res[f"{k}/live"], err_msg=f"{k} on rank {r}")
        np.testing.assert_array_equal(res[f"{k}/live"], resumed[0][f"{k}/live"])
    if case["algo"] == "oktopk":
        assert {"bucket0.t", "bucket0.thresholds", "bucket0.boundaries"} <= set(meta["state_keys"])
    if case["algo"] == "dgc":
        assert "bucket0.rng" in meta["state_keys"]


@pytest.mark.parametrize("case", [c for c in CASES if c.get("drop_state")], ids=key)
def test_the_aggregator_state_is_what_makes_it_exact(resumed, case):
    """Control: restoring the residuals without the thresholds / the sampler state diverges."""
    res = resumed[0]
    assert not np.array_equal(res[f"{key(case)}/resumed"], res[f"{key(case)}/live"])
