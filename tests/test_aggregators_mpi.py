"""The seeds' sparse allreduces on real mpirun jobs (P = 2, 3, 4, 5, 8; one launch per P runs
every case, see tests/workers/aggregators_worker.py), checked against independent numpy
references computed from all ranks' inputs."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import refs
from mpi_harness import mpirun
from tfsparse.collectives.communicator import binomial_children
from tfsparse.wire import index_codec

pytestmark = pytest.mark.mpi

ALGOS = ("dense", "topk", "gtopk", "oktopk", "dgc", "gaussiank", "dragonn")
N, K, STEPS = 3000, 60, 3
SGD_N, SGD_DENSITY, SGD_STEPS = 500, 0.04, 50


@pytest.fixture(scope="module", params=[2, 3, 4, 5, 8])
def job(request):
    P = request.param
    results, _text = mpirun(P, "aggregators_worker.py", timeout=240)
    assert all(r["P"] == P for r in results)
    return P, results


def step(results, key, s, P):
    """Per-rank (acc, dense, indices, contributed, meta) of one step."""
    out = []
    for r in range(P):
        d = results[r]
        meta = json.loads(d[f"{key}__s{s}_meta"])
        out.append((d[f"{key}__s{s}_acc"], d[f"{key}__s{s}_dense"], d[f"{key}__s{s}_indices"],
                    d[f"{key}__s{s}_contributed"], meta))
    return out


def msg(m):
    """Bytes of a message of ``m`` (index, value) entries: float32 values, the indices as they travel
    (blocked: ``N`` < 64K elements, one 4-byte count and 2 bytes per index, padded to 4)."""
    return index_codec(N, K).nbytes(m) + 4 * m


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.flatnonzero(got), np.flatnonzero(want))


def test_no_tensorflow_in_numpy_workers(job):
    P, results = job
    assert not any(r["tensorflow_imported"] for r in results)


@pytest.mark.parametrize("name", ALGOS)
def test_result_equals_reference_and_volume(job, name):
    P, results = job
    for s in range(STEPS):
        rows = step(results, name, s, P)
        accs = [row[0] for row in rows]
        got = rows[0][1]
        for row in rows[1:]:  # identical on every rank, bit for bit
            np.testing.assert_array_equal(row[1], got)
        nbytes = [row[4]["bytes"] for row in rows]
        infos = [row[4]["info"] for row in rows]
        if name == "dense":
            np.testing.assert_allclose(got, refs.dense_ref(accs), rtol=1e-5, atol=1e-5)
            assert all(b == 2 * 4 * N * (P - 1) // P for b in nbytes)
            continue
        if name == "topk":
            close(got, refs.topk_allgather_ref(accs, K))
            assert msg(K) == 4 + 2 * K + 4 * K
            assert all(b == msg(K) * (P - 1) for b in nbytes)
        elif name == "gtopk":
            want, _ = refs.gtopk_tree_ref(accs, K)
            close(got, want)
            m = rows[0][2].size
            assert m <= K
            depth = math.ceil(math.log2(P))
            assert infos[0]["rounds"] == depth
            assert infos[0]["received_bytes"] <= msg(K) * depth
            assert nbytes[0] + infos[0]["received_bytes"] <= 2 * msg(K) * depth + 8 * depth  # 4k log2 P elements
            for r in range(1, P):
                assert nbytes[r] == msg(K) + (msg(m) + 8) * binomial_children(r, P)
            for r in range(P):
                np.testing.assert_array_equal(rows[r][3], np.intersect1d(refs.exact_topk(accs[r], K), rows[r][2]))
        elif name == "oktopk":
            if s == 0:  # thresholds fresh: exactly Topk(Σ Topk(G_i))
                assert infos[0]["fresh_thresholds"]
                want, sels = refs.oktopk_ref(accs, K)
                assert rows[0][2].size == K
            else:  # thresholds reused (tau' = 32), as adjusted (the rules: test_aggregators.py)
                assert not infos[0]["fresh_thresholds"]
                assert len({i["global_threshold"] for i in infos}) == 1
                want, sels = refs.oktopk_ref(accs, K, [i["local_threshold"] for i in infos],
                                             infos[0]["global_threshold"])
                k_eff = max([i["local_count"] for i in infos] + [infos[0]["global_count"]])
                assert max(nbytes) <= 6 * k_eff * (P - 1) / P * 4 + 16 * (P - 1)  # Eq. 3
            close(got, want)
            for r in range(P):
                np.testing.assert_array_equal(rows[r][3], np.intersect1d(sels[r], rows[r][2]))
        elif name == "gaussiank":
            sels = [refs.gaussiank_selection(a, K) for a in accs]
            close(got, refs.sum_selected(accs, sels))
        elif name == "dgc":
            rngs = [np.random.default_rng(5) for _ in range(P)]  # the worker's seed=5, one draw per step
            for s2 in range(s + 1):
                sels = [refs.dgc_selection(step(results, name, s2, P)[r][0], K, rngs[r]) for r in range(P)]
            close(got, refs.sum_selected(accs, sels))
        elif name == "dragonn":  # step s hashes with the seed 0·2**32 + s on every rank; one decode, dense result
            sels = [refs.dragonn_selection(a, K, s) for a in accs]
            close(got, refs.sum_selected(accs, sels))
            assert all(row[2].size == 0 for row in rows)
        if name in ("dgc", "gaussiank", "dragonn"):
            sent = [row[4]["sent"] for row in rows]
            for r in range(P):
                np.testing.assert_array_equal(np.sort(rows[r][3]), sels[r])
                assert nbytes[r] == sum(msg(sent[q]) for q in range(P) if q != (r + 1) % P)  # allgather of 2k' per rank


def test_oktopk_data_balancing(job):
    P, results = job
    rows = step(results, "oktopk_bal", 1, P)
    info = rows[0][4]["info"]
    assert info["balanced"] and not info["repartitioned"] and info["fresh_thresholds"]
    for row in rows[1:]:
        np.testing.assert_array_equal(row[1], rows[0][1])
    want, _ = refs.oktopk_ref([row[0] for row in rows], K)
    close(rows[0][1], want)


@pytest.mark.parametrize("name", ALGOS)
def test_residual_bookkeeping(job, name):
    """50 SGD steps: applied + residuals == raw gradients; gtopk: + Alg. 4's known loss."""
    P, results = job
    raw = sum(results[r][f"{name}__sgd_raw"] for r in range(P))
    applied = results[0][f"{name}__sgd_applied"]
    for r in range(1, P):
        np.testing.assert_array_equal(results[r][f"{name}__sgd_applied"], applied)
        np.testing.assert_array_equal(results[r][f"{name}__sgd_w"], results[0][f"{name}__sgd_w"])
    residual = sum(results[r][f"{name}__sgd_residual"] for r in range(P))
    if name == "gtopk":
        k = math.ceil(SGD_DENSITY * SGD_N)
        lost = np.zeros(SGD_N)
        for s in range(SGD_STEPS):
            _, lost_s = refs.gtopk_tree_ref([results[r]["gtopk__sgd_accs"][s] for r in range(P)], k)
            lost += sum(lost_s)
        np.testing.assert_allclose(applied + residual + lost, raw, rtol=1e-4, atol=1e-3)
    else:
        np.testing.assert_allclose(applied + residual, raw, rtol=1e-4, atol=1e-3)
