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
        assert stats.bytes_sent == ((4 + 2 * (k + 1) + 4 * k) * (P - 1) * steps)  # k = 15 entries, blocked indices


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


# -- the fused passes and the result vectors ----------------------------------------------------

FUSED_SETTINGS = [("topk", {}), ("gtopk", {}), ("oktopk", {"tau_prime": 2}), ("dragonn", {}),
                  ("topk", {"plan": "per_tensor"}), ("gtopk", {"wire_dtype": "float16"}),
                  ("dense", {"wire_dtype": "float16"}), ("dense", {"wire_dtype": "int8"}),
                  ("dense", {"wire_dtype": "bfloat16", "reduce_scatter": "ring"}),
                  ("dense", {"wire_dtype": "int8", "memory": "momentum"}), ("dense", {"wire_dtype": "int4"}),
                  ("dense", {"wire_dtype": "int4", "reduce_scatter": "ring", "memory": "momentum"}),
                  # momentum correction: the velocity's pass, then error feedback's fused passes over it
                  ("dense", {"wire_dtype": "float16", "memory": "momentum"}), ("topk", {"memory": "momentum"}),
                  ("gtopk", {"memory": "momentum"}), ("oktopk", {"tau_prime": 2, "memory": "momentum"}),
                  ("dragonn", {"memory": "momentum"})]


def _rounds(P, algorithm, options, monkeypatch=None, steps=4):
    """Every rank's results and final state over ``steps`` rounds (3 tensors, > 64K elements: the
    sampled prefilter runs), with ties, signed zeros and one round with NaN on rank 1."""
    sizes = [(300, 257), (37,), (130_001,)]
    world = InProcessWorld(P)

    def fn(comm):
        ex = GradientExchange(algorithm, 0.01, communicator=comm, **options)
        rng = np.random.default_rng(comm.rank)
        outs = []
        for s in range(steps):
            grads = [rng.standard_normal(shape).astype(np.float32) * (s + 1) for shape in sizes]
            grads[2][::3] = np.round(grads[2][::3])
            grads[2][::7] = -0.0
            if s == 2 and comm.rank == 1:
                grads[0][4, 4] = np.nan
            outs.append([o.copy() for o in ex.exchange_numpy(grads)])
        return outs, ex.get_state()

    return world.run(fn)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)) if a.dtype.kind == "f" else np.array_equal(a, b)


def _same_rounds(got, want):
    """Every rank's results and final state of :func:`_rounds`, bit for bit."""
    for (outs_g, state_g), (outs_w, state_w) in zip(got, want):
        for step_g, step_w in zip(outs_g, outs_w):
            for a, b in zip(step_g, step_w):
                _same(a, b)
        assert state_g.keys() == state_w.keys()
        for key in state_g:
            _same(state_g[key], state_w[key])


@pytest.mark.parametrize("algorithm,options", FUSED_SETTINGS)
def test_fused_passes_give_the_unfused_bits(algorithm, options, monkeypatch):
    """Error feedback fused with the finite check and the selection (the compressor's prefilter),
    and the dense 16/8-bit residual built in place: every result and state bit for bit what the
    separate passes give (P = 3)."""
    from tfsparse.aggregators.dense import DenseAllreduce
    from tfsparse.memory import ResidualMemory

    fused = _rounds(3, algorithm, options)
    monkeypatch.setattr(ResidualMemory, "fuses", lambda self, arrays: False)
    monkeypatch.setattr(DenseAllreduce, "in_place_residual", False)
    plain = _rounds(3, algorithm, options)
    _same_rounds(fused, plain)


def test_result_vectors_are_reused_only_once_released():
    """The exchange decodes into aligned vectors it reuses, but never one a caller still holds."""
    from tfsparse.buffers import ALIGN

    ex = GradientExchange("topk", 0.01, communicator=InProcessWorld(1).comms[0])
    g = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    first = ex.exchange_numpy([g])[0]
    kept = first.copy()
    second = ex.exchange_numpy([2 * g])[0]
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)  # held by the caller: not written again
    assert first.__array_interface__["data"][0] % ALIGN == 0
    address = first.__array_interface__["data"][0]
    del first, second
    third = ex.exchange_numpy([3 * g])[0]
    assert third.__array_interface__["data"][0] == address  # released: reused


def test_one_flat_array_gets_its_bucket_vector_itself():
    """A flat input in one bucket gets the decoded vector itself (no copy), the bits of the list
    API's result; a caller who writes it and lets it go gets a whole new decode next time."""
    one = GradientExchange("topk", 0.01, communicator=InProcessWorld(1).comms[0])
    ref = GradientExchange("topk", 0.01, communicator=InProcessWorld(1).comms[0])
    rng = np.random.default_rng(4)
    for step in range(3):
        g = rng.standard_normal(50_000).astype(np.float32)
        out = one.exchange_numpy(g)
        _same(out, ref.exchange_numpy([g])[0])
        pooled = one.bucket_states[0].outputs._pool._buffers
        assert any(np.shares_memory(out, v) for v in pooled)
        out[:] = 7.0  # the caller's to write
        del out


@pytest.mark.parametrize("algorithm,options", [("topk", {}), ("gtopk", {}), ("dense", {"wire_dtype": "int8"})])
def test_streamed_error_feedback_gives_the_same_bits(algorithm, options, monkeypatch):
    """Error feedback's pass with non-temporal stores (what buckets from ``STREAM_MIN`` elements on
    get) gives every result and state bit for bit what plain stores give (P = 3)."""
    from tfsparse.ops import cpu

    plain = _rounds(3, algorithm, options)
    monkeypatch.setattr(cpu, "STREAM_MIN", 1)
    streamed = _rounds(3, algorithm, options)
    _same_rounds(streamed, plain)


@pytest.mark.parametrize("memory", ["residual", "momentum"])
def test_carry_memory_takes_the_shared_tensors_memory_and_keeps_its_own(memory):
    """A model whose trainable set changed gets a new exchange: carry_memory gives it the old
    exchange's residual (and velocity) of every tensor both layouts hold -- same name and shape
    -- and leaves the rest as it was; a tensor of the same name but another shape is not carried."""
    from tfsparse.plan import Layout, TensorSpec

    comm = InProcessWorld(1).comms[0]
    kwargs = {"memory": memory, "momentum": 0.9} if memory == "momentum" else {}
    old = GradientExchange("topk", 0.05, communicator=comm, **kwargs)
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in [(30, 10), (40,), (8,)])
    old.build(Layout([TensorSpec("a", (30, 10)), TensorSpec("b", (40,)), TensorSpec("c", (8,))]))
    old.exchange_numpy([a, b, c])
    new = GradientExchange("topk", 0.05, communicator=InProcessWorld(1).comms[0], **kwargs)
    new.build(Layout([TensorSpec("b", (40,)), TensorSpec("z", (5,)), TensorSpec("c", (4, 2))]))
    before = new.get_state()
    assert new.carry_memory(old) == ["b"]
    got, theirs = new.get_state(), old.get_state()
    for key in [k for k in ("residual", "velocity") if k in theirs]:
        np.testing.assert_array_equal(got[key][:40], theirs[key][300:340])
        np.testing.assert_array_equal(got[key][40:], before[key][40:])
        assert np.any(got[key][:40] != 0)
