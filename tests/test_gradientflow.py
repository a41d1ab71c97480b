"""GradientFlow's pieces on in-process worlds (P = 2, 3, 4), against numpy references computed
from all ranks' inputs: CSC (both chunk-selection schedules), momentum correction, the dense
warm-up, and the validation of their options.  Real mpirun: tests/test_gradientflow_mpi.py."""
from __future__ import annotations

import math

import numpy as np
import pytest

from exchange_ref import chunk_norms, csc_next_chunks, csc_round, momentum_reference, reference_run, top_chunks
from test_exchange_pipeline import flat, grads_of
from tfsparse.aggregators import get_aggregator
from tfsparse.collectives import InProcessWorld
from tfsparse.exchange import GradientExchange
from tfsparse.schedules import WarmUp

N = 2050  # grads_of's layout
CS = 32
STEPS = 4
#: cases run on real MPI ranks too (tests/workers/exchange_matrix.py, tests/test_exchange_mpi.py):
#: name -> (algorithm, density, exchange options)
MPI_CASES = {
    "csc-previous": ("csc", 0.05, {"chunk_size": CS, "chunk_selection": "previous"}),
    "csc-momentum": ("csc", 0.05, {"chunk_size": CS, "memory": "momentum"}),
    "topk-momentum": ("topk", 0.05, {"memory": "momentum"}),
    "dense-momentum": ("dense", 1.0, {"memory": "momentum"}),
}


def mpi_case_reference(name, P):
    """Per step ``(result, residuals)`` of an MPI_CASES case, from every rank's gradients."""
    algorithm, density, options = MPI_CASES[name]
    options = {k: v for k, v in options.items() if k != "memory"}
    grads = all_grads(P, STEPS)
    if MPI_CASES[name][2].get("memory") == "momentum":
        return [(res, v) for res, v, _ in momentum_reference(algorithm, grads, density, 0.9, options)]
    return reference_run(algorithm, "float32", [(0, N)], grads, density, options=options)


def run_exchange(P, steps, make, grads=None, after=None):
    """``steps`` rounds of ``make(comm)``'s exchange on P thread-ranks; per rank, per step:
    the result, the residual, the bytes and ``after(ex)``."""

    def fn(comm):
        ex = make(comm)
        out = []
        for s in range(steps):
            before = ex.total.bytes_sent
            g = grads_of(comm.rank, s) if grads is None else grads[s][comm.rank]
            res = flat(ex.exchange_numpy(g))
            out.append({"out": res, "residual": ex.residual, "bytes": ex.total.bytes_sent - before,
                        "extra": after(ex) if after else None})
        ex.close()
        return out

    return InProcessWorld(P, timeout=60).run(fn)


def all_grads(P, steps):
    return [[flat(grads_of(r, s)) for r in range(P)] for s in range(steps)]


def assert_steps_equal(got, want, P, residual=True):
    for s, (result, residuals) in enumerate(want):
        for r in range(P):
            np.testing.assert_array_equal(got[r][s]["out"], got[0][s]["out"])  # bit-identical on every rank
            np.testing.assert_allclose(got[r][s]["out"], result, rtol=2e-5, atol=2e-5)
            np.testing.assert_array_equal(np.flatnonzero(got[r][s]["out"]), np.flatnonzero(result))
            if residual:
                np.testing.assert_allclose(got[r][s]["residual"], residuals[r], rtol=2e-5, atol=2e-5)


# -- CSC -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("wire", ["float32", "float16"])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_csc_previous_selection_equals_reference(P, wire):
    options = {"chunk_size": CS, "chunk_selection": "previous"}
    got = run_exchange(P, 5, lambda c: GradientExchange("csc", 0.05, wire_dtype=wire, communicator=c, **options))
    want = reference_run("csc", wire, [(0, N)], all_grads(P, 5), 0.05, options=options)
    assert_steps_equal(got, want, P)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_csc_sends_whole_chunks_and_counts_its_bytes(P):
    density = 0.1
    k = math.ceil(density * N)
    m, C = math.ceil(k / CS), math.ceil(N / CS)
    for selection in ("current", "previous"):
        got = run_exchange(P, 3, lambda c: GradientExchange("csc", density, communicator=c, chunk_size=CS,
                                                           chunk_selection=selection))
        grads = all_grads(P, 3)
        residuals = [np.zeros(N, np.float32) for _ in range(P)]
        chosen = None
        for s in range(3):
            accs = [g + res for g, res in zip(grads[s], residuals)]
            result, residuals, info = csc_round(accs, CS, m, "float32", chosen if selection == "previous" else None)
            elems = info["elems"]
            assert elems.size == m * CS or (C - 1) in info["chunks"]  # whole chunks (the last one short)
            np.testing.assert_array_equal(np.flatnonzero(got[0][s]["out"]), np.sort(elems))
            # the norms' allreduce (C float32) and the dense allreduce of the chunks' elements
            norms = (1 if s == 0 or selection == "current" else 0) + (1 if selection == "previous" else 0)
            want = norms * (2 * 4 * C * (P - 1) // P) + 2 * 4 * elems.size * (P - 1) // P
            assert all(got[r][s]["bytes"] == want for r in range(P)), (selection, s)
            if selection == "previous":
                chosen = csc_next_chunks(accs, result, elems, CS, m)


def test_csc_chunk_choice_is_the_summed_norms_top():
    """The chunk set comes from the norms summed over ranks, not any rank's own."""
    P, cs, n = 3, 4, 24
    accs = [np.zeros(n, np.float32) for _ in range(P)]
    accs[0][0:4] = 10.0      # chunk 0: large on one rank only (sum 40)
    for r in range(P):
        accs[r][8:12] = 5.0  # chunk 2: moderate on every rank (sum 60)
    accs[1][20:24] = -9.0    # chunk 5: large on one rank (sum 36)

    def fn(comm):
        agg = get_aggregator("csc", chunk_size=cs)
        res = agg.allreduce(comm, accs[comm.rank], 8)  # m = 2 chunks
        return res.to_dense(n), res.contributed

    outs = InProcessWorld(P, timeout=30).run(fn)
    np.testing.assert_array_equal(top_chunks(chunk_norms(accs, cs), 2), [0, 2])
    for dense, contributed in outs:
        np.testing.assert_array_equal(contributed, np.r_[0:4, 8:12])
        want = np.zeros(n)
        want[0:4], want[8:12] = 10.0, 15.0
        np.testing.assert_array_equal(dense, want)


def test_csc_density_one_chunk_and_state():
    agg = get_aggregator("csc", chunk_size=CS)
    assert agg.chunks_for(N, 1) == 1 and agg.chunks_for(N, N) == math.ceil(N / CS)
    assert agg.get_state() == {}
    prev = get_aggregator("csc", chunk_size=CS, chunk_selection="previous")
    assert list(prev.get_state()) == ["chunks"]
    with pytest.raises(ValueError, match="state keys"):
        agg.set_state({"chunks": np.arange(3)})


@pytest.mark.parametrize("bad", [0, -5, 1.5, "32", True])
def test_csc_rejects_a_bad_chunk_size(bad):
    with pytest.raises(ValueError, match=r"chunk_size=.* is not valid; accepted: an integer >= 1"):
        GradientExchange("csc", 0.1, chunk_size=bad)


def test_csc_rejects_a_bad_selection():
    with pytest.raises(ValueError, match=r"chunk_selection='next'.*'current', 'previous'"):
        GradientExchange("csc", 0.1, chunk_selection="next")


# -- momentum correction -------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MPI_CASES))
def test_mpi_cases_in_process(name):
    P = 3
    algorithm, density, options = MPI_CASES[name]
    got = run_exchange(P, STEPS, lambda c: GradientExchange(algorithm, density, communicator=c, **options))
    assert_steps_equal(got, mpi_case_reference(name, P), P)


@pytest.mark.parametrize("algorithm", ["topk", "gtopk"])
def test_momentum_rows_keeps_the_velocity_of_row_sparse_tensors(algorithm):
    """memory="momentum_rows" (what memory="auto" runs under an SGD with momentum): DGC's masking
    everywhere but in the tensors whose gradients arrive row-sparse (an Embedding's
    tf.IndexedSlices; here the first and the fourth), whose velocity is kept -- against the
    reference, results and residuals and velocities, on 3 thread-ranks; memory="momentum" on the
    same layout masks everywhere."""
    from test_exchange_pipeline import SHAPES
    from tfsparse.plan import Layout, TensorSpec

    P, rows = 3, (0, 3)
    layout = Layout(TensorSpec(f"gradient_{i}", s, "float32", i in rows) for i, s in enumerate(SHAPES))
    kept = np.zeros(layout.n, bool)
    for i in rows:
        kept[layout.offsets[i]:layout.offsets[i + 1]] = True
    grads = all_grads(P, STEPS)
    for memory, mask in (("momentum_rows", kept), ("momentum", None)):
        def make(comm):
            ex = GradientExchange(algorithm, 0.05, communicator=comm, memory=memory)
            ex.build(layout)
            return ex

        got = run_exchange(P, STEPS, make, after=lambda ex: np.array(ex.bucket_states[0].memory.velocity))
        want = momentum_reference("topk", grads, 0.05, 0.9, kept=mask) if algorithm == "topk" else None
        for s in range(STEPS):
            for r in range(P):
                np.testing.assert_array_equal(got[r][s]["out"], got[0][s]["out"])  # the same bits on every rank
                if want is not None:
                    result, residuals, velocities = want[s]
                    np.testing.assert_allclose(got[r][s]["out"], result, rtol=2e-5, atol=2e-5)
                    np.testing.assert_allclose(got[r][s]["residual"], residuals[r], rtol=2e-5, atol=2e-5)
                    np.testing.assert_allclose(got[r][s]["extra"], velocities[r], rtol=2e-5, atol=2e-5)
        for r in range(P):  # the row-sparse tensors' velocity: u = m·u + g, never cleared
            u = np.zeros(layout.n, np.float32)
            for s in range(STEPS):
                u = (np.float32(0.9) * u + grads[s][r]).astype(np.float32)
            same = got[r][STEPS - 1]["extra"][kept] == u[kept]
            assert same.all() if memory == "momentum_rows" else not same.all()


@pytest.mark.parametrize("algorithm,options", [("topk", {}), ("csc", {"chunk_size": CS}), ("dense", {}),
                                               ("dragonn", {}), ("dragonn", {"capacity_factor": 1, "seed": 3}),
                                               ("dgc", {"min_samples": 10**9, "exact_below": 0})])
@pytest.mark.parametrize("P", [2, 3])
def test_momentum_correction_equals_reference(P, algorithm, options):
    """Momentum correction composes with every sparsifier (DGC §3.2; DRAGONN runs it, §5)."""
    steps = 4
    got = run_exchange(P, steps, lambda c: GradientExchange(algorithm, 0.05, memory="momentum", momentum=0.9,
                                                           communicator=c, **options),
                       after=lambda ex: ex.get_state()["velocity"])
    want = momentum_reference(algorithm, all_grads(P, steps), 0.05, 0.9, options)
    assert_steps_equal(got, [(res, v) for res, v, _ in want], P)
    for s, (_, _, u) in enumerate(want):
        for r in range(P):
            np.testing.assert_allclose(got[r][s]["extra"], u[r], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("algorithm,wire", [("dense", "int8"), ("dense", "bfloat16"), ("topk", "float32")])
@pytest.mark.parametrize("P", [2, 3])
def test_memory_none_drops_what_is_not_delivered(P, algorithm, wire):
    """``memory="none"``: no residual; every step is the round of that step's gradients alone
    (Pipe-SGD's compression as published; gradient dropping for topk)."""
    from exchange_ref import dense_round, selection_round
    import refs

    steps = 3
    got = run_exchange(P, steps, lambda c: GradientExchange(algorithm, 0.05, wire_dtype=wire, memory="none",
                                                           communicator=c))
    for s, accs in enumerate(all_grads(P, steps)):
        if algorithm == "dense":
            want = dense_round(accs, wire)[0]
        else:
            want = selection_round(accs, [refs.exact_topk(a, math.ceil(0.05 * a.size)) for a in accs], wire)[0]
        for r in range(P):
            assert got[r][s]["residual"] is None
            np.testing.assert_array_equal(got[r][s]["out"], got[0][s]["out"])
            np.testing.assert_allclose(got[r][s]["out"], want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="momentum=0.9 needs memory='momentum'"):
        GradientExchange("dense", 1.0, memory="none", momentum=0.9)


def test_dense_with_momentum_memory_is_momentum_sgd():
    """At density 1 the exchanged sum is the momentum velocity: w -= lr·u equals Keras' SGD
    with momentum on the summed gradient."""
    P, steps = 2, 5
    got = run_exchange(P, steps, lambda c: GradientExchange("dense", 1.0, memory="momentum", communicator=c))
    grads = all_grads(P, steps)
    u = np.zeros(N)
    for s in range(steps):
        u = 0.9 * u + sum(g.astype(np.float64) for g in grads[s])
        np.testing.assert_allclose(got[0][s]["out"], u, rtol=1e-5, atol=1e-5)


def test_momentum_options_are_validated():
    with pytest.raises(ValueError, match=r"momentum=0\.9 needs memory='momentum'"):
        GradientExchange("topk", 0.01, momentum=0.9)
    with pytest.raises(ValueError, match=r"memory='velocity' is not supported; accepted: 'auto', 'momentum', 'momentum_rows', 'none', 'residual'"):
        GradientExchange("topk", 0.01, memory="velocity")
    for bad in (1.0, -0.1, "0.9", True):
        with pytest.raises(ValueError, match=r"momentum=.* is not valid; accepted: a number in \[0, 1\)"):
            GradientExchange("topk", 0.01, memory="momentum", momentum=bad)


def test_momentum_twice_is_refused():
    import keras

    from tfsparse.keras.ownership import check_optimizer

    ex = GradientExchange("topk", 0.01, memory="momentum")
    for opt, attr in ((keras.optimizers.SGD(0.1, momentum=0.9), "momentum"), (keras.optimizers.Adam(), "beta_1")):
        with pytest.raises(ValueError, match=rf"applied twice.*{attr}="):
            check_optimizer(ex, opt)
    check_optimizer(ex, keras.optimizers.SGD(0.1))
    check_optimizer(GradientExchange("topk", 0.01), keras.optimizers.SGD(0.1, momentum=0.9))


# -- dense warm-up -------------------------------------------------------------------------------

def test_warmup_ramps():
    lin = WarmUp(4, target=0.01)
    assert [lin(s) for s in range(6)] == pytest.approx([1.0, 0.7525, 0.505, 0.2575, 0.01, 0.01])
    exp = WarmUp(8, ramp="exponential", target=0.01)
    assert [exp(s) for s in range(9)] == [1.0, 1.0, 0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01]
    assert WarmUp(epochs=1.5).with_steps_per_epoch(10).steps == 15
    assert WarmUp(0, target=0.1)(0) == 0.1


@pytest.mark.parametrize("kwargs,match", [
    ({}, "steps= or epochs="), ({"steps": 3, "epochs": 1}, "steps= or epochs="),
    ({"steps": -1}, "steps=-1"), ({"steps": 2.5}, "steps=2.5"), ({"steps": 3, "ramp": "cosine"}, "ramp='cosine'"),
    ({"steps": 3, "target": 0.0}, "target=0.0")])
def test_warmup_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarmUp(**kwargs)
    with pytest.raises(ValueError, match="steps per epoch"):
        WarmUp(epochs=2).with_steps_per_epoch(None)


@pytest.mark.parametrize("algorithm", ["topk", "gtopk", "oktopk", "csc"])
def test_warmup_starts_with_a_true_dense_allreduce(algorithm):
    P, steps = 3, 4
    options = {"chunk_size": CS} if algorithm == "csc" else {}

    def make(comm):
        ex = GradientExchange(algorithm, 0.05, communicator=comm, **options)
        ex.schedule = WarmUp(2, target=0.05)
        return ex

    got = run_exchange(P, steps, make, after=lambda ex: ex.density)
    grads = all_grads(P, steps)
    # step 0: the dense allreduce (its volume, the exact sum, nothing left behind)
    np.testing.assert_allclose(got[0][0]["out"], np.sum(grads[0], axis=0), rtol=1e-5, atol=1e-5)
    assert all(got[r][0]["bytes"] == 2 * 4 * N * (P - 1) // P for r in range(P))
    assert all(not got[r][0]["residual"].any() for r in range(P))
    assert [got[0][s]["extra"] for s in range(steps)] == pytest.approx([1.0, 1 - 0.95 / 2, 0.05, 0.05])
    # later steps: the sparse algorithm (at the target density, less than dense's volume)
    for s in range(1, steps):
        assert got[0][s]["residual"].any()
        if s >= 2:
            assert got[0][s]["bytes"] < 2 * 4 * N * (P - 1) // P


def test_warmup_continues_from_a_restored_round():
    ex = GradientExchange("topk", 0.05, communicator=None)
    ex.schedule = WarmUp(10, target=0.05)
    ex.set_state({"round": np.array([7])})
    ex.exchange_numpy(grads_of(0, 0))
    assert ex.density == pytest.approx(1 - 0.95 * 7 / 10)
    assert ex.rounds_started == 8


# -- explicit state ------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm,options", [("csc", {"chunk_size": CS, "chunk_selection": "previous"}),
                                               ("topk", {})])
def test_resumed_state_continues_bit_identically(algorithm, options):
    P, steps, cut = 2, 5, 3

    def fn(comm):
        def make():
            return GradientExchange(algorithm, 0.05, memory="momentum", communicator=comm, **options)

        ex = make()
        whole = [flat(ex.exchange_numpy(grads_of(comm.rank, s))) for s in range(steps)]
        first = make()
        for s in range(cut):
            first.exchange_numpy(grads_of(comm.rank, s))
        state = first.get_state()
        second = make()
        second.set_state(state)
        resumed = [flat(second.exchange_numpy(grads_of(comm.rank, s))) for s in range(cut, steps)]
        return whole, resumed, state

    for whole, resumed, state in InProcessWorld(P, timeout=60).run(fn):
        assert state["velocity"].any()
        if algorithm == "csc":
            assert state["bucket0.chunks"].size == 4
        for a, b in zip(whole[cut:], resumed):
            np.testing.assert_array_equal(a, b)
