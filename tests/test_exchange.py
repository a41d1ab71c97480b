"""GradientExchange, memory and compressors on the in-process world; input validation."""
import numpy as np
import pytest

from tfsparse.aggregators import get_aggregator
from tfsparse.collectives import InProcessWorld
from tfsparse.compressors import TopK, topk_indices
from tfsparse.exchange import GradientExchange
from tfsparse.settings import Settings


def reference_topk_step(accs, k):
    """Independent reference of TopKAllReduce + residuals: full sort instead of a partition."""
    total = np.zeros_like(accs[0], dtype=np.float64)
    residuals = []
    for acc in accs:
        order = np.argsort(-np.abs(acc), kind="stable")[:k]
        total[order] += acc[order]
        res = acc.copy()
        res[order] = 0
        residuals.append(res)
    return total, residuals


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_topk_exchange_matches_reference_over_steps(P):
    n, density, steps = 500, 0.03, 6
    world = InProcessWorld(P)
    grads = {(r, s): np.random.default_rng(100 * r + s).standard_normal(n).astype(np.float32)
             for r in range(P) for s in range(steps)}

    def fn(comm):
        ex = GradientExchange("topk", density, communicator=comm)
        outs = [ex.exchange_numpy(grads[(comm.rank, s)]) for s in range(steps)]
        return outs, ex.residual, ex.total

    out = world.run(fn)
    k = int(np.ceil(density * n))
    residuals = [np.zeros(n, np.float32) for _ in range(P)]
    for s in range(steps):
        accs = [grads[(r, s)] + residuals[r] for r in range(P)]
        total, residuals = reference_topk_step(accs, k)
        for r in range(P):
            np.testing.assert_allclose(out[r][0][s], total, rtol=1e-6, atol=1e-6)
            assert np.array_equal(out[r][0][s], out[0][0][s])
    for r in range(P):
        np.testing.assert_array_equal(out[r][1], residuals[r])
        stats = out[r][2]
        assert stats.steps == steps and stats.sent_elements == k * steps
        assert stats.bytes_sent == (8 * k * (P - 1) * steps)


@pytest.mark.parametrize("P", [2, 3])
def test_nothing_lost_with_error_feedback(P):
    """Σ applied updates + Σ final residuals == Σ raw gradients (topk), to float rounding."""
    n, steps = 300, 20
    world = InProcessWorld(P)

    def fn(comm):
        ex = GradientExchange("topk", 0.02, communicator=comm)
        applied = np.zeros(n, np.float64)
        raw = np.zeros(n, np.float64)
        for s in range(steps):
            g = np.random.default_rng(7 * comm.rank + 1000 * s).standard_normal(n).astype(np.float32)
            raw += g
            applied += ex.exchange_numpy(g)
        return applied, ex.residual, raw

    out = world.run(fn)
    applied = out[0][0]
    total_raw = sum(o[2] for o in out)
    total_res = sum(o[1].astype(np.float64) for o in out)
    np.testing.assert_allclose(applied + total_res, total_raw, atol=1e-4)


def test_dense_exchange_is_exact_sum():
    world = InProcessWorld(3)
    data = [np.random.default_rng(r).standard_normal(77).astype(np.float32) for r in range(3)]

    def fn(c):
        ex = GradientExchange("dense", 1.0, communicator=c)
        return ex.exchange_numpy(data[c.rank]), ex.residual

    for dense, res in world.run(fn):
        assert res is None
        np.testing.assert_allclose(dense, np.sum(data, axis=0), rtol=1e-6)


def test_topk_indices_edge_cases():
    x = np.array([0.5, -3.0, 2.0, np.nan, 1.0], dtype=np.float32)
    assert topk_indices(x, 0).size == 0
    assert topk_indices(x, 5).tolist() == [0, 1, 2, 3, 4]
    assert 3 in topk_indices(x, 1).tolist()  # NaN is always sent
    assert sorted(topk_indices(x, 3).tolist()) == [1, 2, 3]
    idx, val = TopK().compress(np.array([1.0, -5.0, 2.0], np.float32), 2)
    assert idx.tolist() == [1, 2] and val.tolist() == [-5.0, 2.0]


@pytest.mark.parametrize("algorithm,density,match", [
    ("nope", 0.1, "algorithm='nope' is not supported; accepted: .*'dense'.*'topk'"),
    ("topk", 0.0, r"density=0.0 is not valid; accepted: a number in \(0, 1\]"),
    ("topk", 1.5, r"density=1.5 is not valid; accepted: a number in \(0, 1\]"),
    ("topk", "0.1", r"density='0.1' is not valid; accepted: a number"),
    ("topk", True, r"density=True is not valid; accepted: a number"),
])
def test_bad_config_is_rejected(algorithm, density, match):
    with pytest.raises(ValueError, match=match):
        Settings(algorithm, density)


def test_get_aggregator_rejects_bad_options():
    with pytest.raises(ValueError, match="invalid options for algorithm='dense'"):
        get_aggregator("dense", tau=3)


def test_k_out_of_range():
    comm = InProcessWorld(1).comms[0]
    with pytest.raises(ValueError, match="k=11"):
        get_aggregator("topk").allreduce(comm, np.ones(10, np.float32), 11)
