"""DRAGONN's efficiency-aware tensor selection (dragonn-wang2022 §4.2, Eq. 1; tfsparse.selection)
and DGC's local gradient clipping, against numpy references; in-process worlds (the MPI
``model.fit`` runs are in tests/test_algorithms_fit.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import refs
from fakes import NoTalk
from tfsparse.collectives import InProcessWorld
from tfsparse.exchange import GradientExchange
from tfsparse.plan import Layout, TensorSpec
from tfsparse.aggregators import get_aggregator
from tfsparse.selection import CostModel, CostModelPlan, decide
from tfsparse.wire import index_codec

# a slow link (100 Mbit/s, 200 us) and a compressor costing 100 us + 2 ns per element
SLOW = CostModel(alpha=200e-6, beta=12.5e6, comp_fixed=100e-6, comp_per_element=2e-9)
SHAPES = [(784, 512), (512,), (512, 10), (10,), (300, 300), (7,)]


def layout(shapes=SHAPES):
    return Layout(TensorSpec(f"t{i}", s) for i, s in enumerate(shapes))


def eq1_reference(d, K, density, m: CostModel, value_bytes=4, fuse_dense=True):
    """Eq. 1 with the paper's formulas: T_full = 2(K-1)(α + dA/(KB)) (no α for a fused dense
    tensor), T_spr = (K-1)(α + k(index+value)/B) -- topk's indices as they travel (blocked where
    that is smaller: tfsparse.wire.index_codec), T_comp = c0 + c1·d."""
    k = min(d, max(1, math.ceil(density * d)))
    t_full = 2 * (K - 1) * ((0 if fuse_dense else m.alpha) + d * value_bytes / (K * m.beta))
    t_spr = (K - 1) * (m.alpha + (index_codec(d, k).nbytes(k) + k * value_bytes) / m.beta)
    t_comp = m.comp_fixed + m.comp_per_element * d
    return k < d and t_comp < t_full - t_spr


@pytest.mark.parametrize("fuse_dense", [True, False])
@pytest.mark.parametrize("K", [2, 3, 4, 16])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.3])
def test_decisions_are_eq1(K, density, fuse_dense):
    got = decide(SLOW, layout(), K, density, 4, fuse_dense)
    for spec, d in zip(layout().specs, got):
        assert d.name == spec.name and d.size == spec.size
        assert d.compress == eq1_reference(spec.size, K, density, SLOW, fuse_dense=fuse_dense)
        assert d.t_full - d.t_spr == pytest.approx(d.saving)
    # half-precision values: A = 2 bytes on both sides of Eq. 1
    half = decide(SLOW, layout(), K, density, 2, fuse_dense)
    assert [d.compress for d in half] == [eq1_reference(s.size, K, density, SLOW, 2, fuse_dense=fuse_dense)
                                          for s in layout().specs]


def test_cost_model_prices_the_aggregators_schedules():
    """T_full is the dense aggregator's declared schedule, T_spr the allgather's of k entries,
    each collective on the ring (tfsparse.timing's schedules): the paper's formulas where K
    divides d, the ring's blocks of ceil(d/K) where it does not."""
    from tfsparse.collectives import AlphaBeta
    from tfsparse.timing import schedule

    K, d, k = 4, 401408, 4015
    ring = AlphaBeta(SLOW.alpha, SLOW.beta)
    assert SLOW.t_full(d, K, 4) == schedule("dense", K, d, 1.0).seconds(ring, prefer="ring")
    assert SLOW.t_full(d, K, 4) == pytest.approx(2 * (K - 1) * (SLOW.alpha + d * 4 / (K * SLOW.beta)), rel=1e-12)
    assert SLOW.t_spr(d, K, k, 4) == schedule("topk", K, d, 0.01).seconds(ring, prefer="ring")
    blocked = 4 * 7 + 2 * (k + 1)  # k = 4015 indices in 7 blocks of 64K elements, blocked
    assert SLOW.t_spr(d, K, k, 2) == pytest.approx((K - 1) * (SLOW.alpha + (blocked + 2 * k) / SLOW.beta), rel=1e-12)
    assert SLOW.t_spr(d, K, k, 2, get_aggregator("dragonn")) == SLOW.t_spr(d, K, k, 2)  # in index order too
    assert SLOW.t_full(10, 3, 4, latency=False) == pytest.approx(4 * 4 * 4 / SLOW.beta, rel=1e-12)
    assert SLOW.t_full(d, 1, 4) == SLOW.t_spr(d, 1, k, 4) == 0.0


def test_small_tensors_go_dense_large_ones_compress():
    got = {d.name: d.compress for d in decide(SLOW, layout(), 4, 0.01)}
    assert got == {"t0": True, "t1": False, "t2": True, "t3": False, "t4": True, "t5": False}
    # a fast link: nothing is worth its compression time
    fast = CostModel(alpha=5e-6, beta=12.5e9, comp_fixed=100e-6, comp_per_element=2e-9)
    assert not any(d.compress for d in decide(fast, layout(), 4, 0.01))
    # one rank: nothing to save
    assert not any(d.compress for d in decide(SLOW, layout(), 1, 0.01))


def plan_buckets(model, shapes, fuse_dense=True, P=4, density=0.01):
    plan = CostModelPlan(model, fuse_dense=fuse_dense, verbose=False)
    prepared = plan.prepare(NoTalk(P), type("Ex", (), {"algorithm": "dragonn", "options": {}, "density": density,
                                                       "wire": type("W", (), {"value_bytes": 4})()})(),
                            layout(shapes))
    assert plan.decisions is None and prepared == plan  # a value: the given plan is left as it was
    return prepared, prepared.buckets(layout(shapes))


def test_plan_fuses_dense_runs_and_isolates_compressed_tensors():
    plan, buckets = plan_buckets(SLOW, SHAPES)
    # last tensor first: t5 dense | t4 | t3 dense | t2 | t1 dense | t0
    assert [(b.first, b.last, b.algorithm) for b in buckets] == [
        (5, 6, "dense"), (4, 5, None), (3, 4, "dense"), (2, 3, None), (1, 2, "dense"), (0, 1, None)]
    # consecutive dense tensors share one bucket
    _, buckets = plan_buckets(SLOW, [(784, 512), (512,), (10,), (7,)])
    assert [(b.first, b.last, b.algorithm) for b in buckets] == [(1, 4, "dense"), (0, 1, None)]
    # the paper's formulas as written: one bucket per tensor
    _, buckets = plan_buckets(SLOW, [(784, 512), (512,), (10,), (7,)], fuse_dense=False)
    assert [(b.first, b.last) for b in buckets] == [(3, 4), (2, 3), (1, 2), (0, 1)]
    assert "t0 [401,408]" in plan.report(SLOW, 4, 0.01) and "compress" in plan.report(SLOW, 4, 0.01)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_exchange_with_stated_cost_model_equals_reference(P):
    """Compressed tensors: DRAGONN per tensor (its own bucket, its own step counter); dense ones:
    the exact sum; every rank bit-identical."""
    steps, density = 3, 0.01
    shapes = SHAPES

    def fn(comm):
        ex = GradientExchange("dragonn", density, selection=SLOW, communicator=comm)
        ex.plan.verbose = False
        out = []
        for s in range(steps):
            rng = np.random.default_rng([comm.rank, s])
            grads = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
            out.append((grads, ex.exchange_numpy(grads), ex.residual))
        return out, [(b.first, b.algorithm) for b in ex.buckets]

    res = InProcessWorld(P, timeout=60).run(fn)
    decisions = {d.name: d.compress for d in decide(SLOW, layout(), P, density)}
    residual = [[np.zeros(math.prod(sh), np.float32) for sh in shapes] for _ in range(P)]
    for s in range(steps):
        for i, sh in enumerate(shapes):
            accs = [res[r][0][s][0][i].reshape(-1) + residual[r][i] for r in range(P)]
            got = res[0][0][s][1][i].reshape(-1)
            for r in range(1, P):
                np.testing.assert_array_equal(res[r][0][s][1][i], res[0][0][s][1][i])
            if decisions[f"t{i}"]:
                k = math.ceil(density * accs[0].size)
                sels = [refs.dragonn_selection(a, k, s) for a in accs]
                np.testing.assert_allclose(got, refs.sum_selected(accs, sels), rtol=2e-5, atol=2e-5)
                for r in range(P):
                    residual[r][i] = accs[r].copy()
                    residual[r][i][sels[r]] = 0.0
            else:
                np.testing.assert_allclose(got, np.sum(accs, axis=0), rtol=2e-5, atol=2e-5)
                for r in range(P):
                    residual[r][i][:] = 0.0
        for r in range(P):
            np.testing.assert_allclose(res[r][0][s][2], np.concatenate(residual[r]), rtol=1e-5, atol=1e-6)


def test_measured_cost_model_is_identical_on_every_rank(capsys):
    P = 3

    def fn(comm):
        ex = GradientExchange("dgc", 0.01, selection="cost_model", communicator=comm)
        grads = [np.ones(sh, np.float32) * (comm.rank + 1) for sh in SHAPES]
        ex.exchange_numpy(grads)
        return ex.plan.decisions, ex.plan.cost_model, [(b.first, b.last, b.algorithm) for b in ex.buckets]

    res = InProcessWorld(P, timeout=120).run(fn)
    for r in res[1:]:
        assert r == res[0]
    model = res[0][1]
    assert model.beta > 0 and model.comp_per_element > 0
    printed = capsys.readouterr().out
    assert printed.count("tfsparse cost model (dragonn-wang2022 Eq. 1; P=3") == 1  # once, by rank 0


@pytest.mark.parametrize("kwargs,words", [
    ({"selection": "auto"}, ["selection='auto'", "'cost_model'", "CostModel"]),
    ({"algorithm": "gtopk", "selection": "cost_model"}, ["algorithm='gtopk'", "'dgc', 'dragonn', 'gaussiank', 'topk'"]),
    ({"selection": "cost_model", "bucket_bytes": 1024}, ["selection='cost_model'", "bucket_bytes=1024"]),
    ({"selection": "cost_model", "plan": "per_tensor"}, ["plan='per_tensor'"]),
    ({"clip_norm": 0.0}, ["clip_norm=0.0", "(0, inf)", "None"]),
    ({"clip_norm": True}, ["clip_norm=True"]),
])
def test_bad_selection_and_clip_options(kwargs, words):
    kwargs = {"algorithm": "dragonn", **kwargs}
    with pytest.raises(ValueError) as e:
        GradientExchange(kwargs.pop("algorithm"), 0.01, communicator=NoTalk(), **kwargs)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("field,value", [("alpha", -1.0), ("beta", 0.0), ("comp_fixed", float("nan")),
                                         ("comp_per_element", "1")])
def test_bad_cost_model(field, value):
    good = dict(alpha=1e-4, beta=1e8, comp_fixed=1e-4, comp_per_element=1e-9)
    with pytest.raises(ValueError, match=f"{field}="):
        CostModel(**{**good, field: value})


# -- DGC's local gradient clipping (Lin et al. 2018 §3.3) -------------------------------------

@pytest.mark.parametrize("P", [2, 3])
def test_local_clipping_scales_each_rank_to_clip_over_sqrt_p(P):
    clip = 2.0

    def fn(comm):
        ex = GradientExchange("dense", 1.0, clip_norm=clip, communicator=comm)
        g = [np.full(100, 1.0 + comm.rank, np.float32), np.full(3, -0.5, np.float32)]
        small = [x * 1e-3 for x in g]
        return g, ex.exchange_numpy(g), small, ex.exchange_numpy(small)

    res = InProcessWorld(P, timeout=30).run(fn)
    limit = clip / math.sqrt(P)
    want = sum(np.concatenate(g) * min(1.0, limit / np.linalg.norm(np.concatenate(g))) for g, *_ in res)
    np.testing.assert_allclose(np.concatenate(res[0][1]), want, rtol=1e-6)
    small = sum(np.concatenate(s) for *_, s, _ in res)  # under the limit: unchanged
    np.testing.assert_allclose(np.concatenate(res[0][3]), small, rtol=1e-6)
    np.testing.assert_array_equal(res[0][0][0], np.full(100, 1.0, np.float32))  # the input is not modified


def test_selection_as_a_dict_and_the_optimizer_config_round_trip():
    ex = GradientExchange("dragonn", 0.01, selection=SLOW.as_dict(), communicator=NoTalk())
    assert ex.plan.model == SLOW
    with pytest.raises(ValueError, match="exactly the CostModel fields"):
        GradientExchange("dragonn", 0.01, selection={"alpha": 1.0}, communicator=NoTalk())
