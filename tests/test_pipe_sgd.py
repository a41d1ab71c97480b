"""Pipe-SGD (pipe-sgd-li2018) at the exchange level, on in-process worlds: ``pipeline=2``
returns the previous round's result (zeros first) for every algorithm and wire -- the synchronous
sequence shifted by one step, bit for bit --, holds the last round as explicit state (saved,
restored, applied by the next step), switches to and from D-Sync rounds (synchronous, float32)
without losing a gradient, and keeps the caller's collectives off the round in flight."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from fakes import NoTalk
from test_exchange_pipeline import ALGOS, OPTIONS, WIRES, flat, grads_of
from tfsparse.collectives import InProcessWorld
from tfsparse.collectives.thread import PRECEDENCE_NICE
from tfsparse.exchange import GradientExchange
from tfsparse.exchange_build import QUIET_PAUSE
from tfsparse.pipelined import Pipelined

STEPS = 4


def exchanges(comm, pipeline, algorithm="dense", wire="float32", **kw):
    return Pipelined(GradientExchange(algorithm, 0.05, wire_dtype=wire, plan=2000, pipeline=pipeline,
                                      communicator=comm, **OPTIONS.get(algorithm, {}), **kw))


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("wire", ["bfloat16", "int8", "float16"])
def test_ring_reduce_scatter_recompresses_every_hop(P, wire):
    """``reduce_scatter="ring"`` (the paper's Fig. 3b): the partial sums are decoded, summed and
    re-encoded at each of the P-1 hops; result and residuals equal a hop-by-hop numpy reference,
    the bytes the direct reduce-scatter's, and applied + residuals the gradients."""
    from exchange_ref import dense_ring_round
    from tfsparse.aggregators import get_aggregator
    from tfsparse.wire import get_wire

    n = 10_001

    def fn(comm):
        acc = np.random.default_rng([comm.rank, 7]).standard_normal(n).astype(np.float32)
        out = {}
        for rs in ("ring", "direct"):
            before = comm.bytes_sent
            res = get_aggregator("dense", reduce_scatter=rs).allreduce(comm, acc, n, get_wire(wire))
            kept = np.zeros(n, np.float32)
            res.loss.apply_to(kept)
            out[rs] = (res.values, kept, comm.bytes_sent - before)
        return acc, out

    got = InProcessWorld(P, timeout=30).run(fn)
    want, residuals, _ = dense_ring_round([g[0] for g in got], wire)
    for r, (acc, out) in enumerate(got):
        values, kept, nbytes = out["ring"]
        np.testing.assert_array_equal(values, want.astype(np.float32))
        np.testing.assert_allclose(kept, residuals[r], rtol=0, atol=1e-6)
        assert nbytes == out["direct"][2]
    raw = sum(g[0].astype(np.float64) for g in got)
    np.testing.assert_allclose(want + sum(res.astype(np.float64) for res in residuals), raw, atol=1e-4)


def test_ring_reduce_scatter_is_validated():
    from tfsparse.aggregators import get_aggregator

    with pytest.raises(ValueError, match="reduce_scatter='tree'.*'direct', 'ring'"):
        get_aggregator("dense", reduce_scatter="tree")


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("algorithm", ALGOS)
def test_pipelined_steps_are_the_synchronous_ones_one_step_late(algorithm, wire):
    """Alg. 1 with K = 2: step t applies round t-1's aggregate (zeros at t = 0); error feedback
    sees the same residuals as the synchronous run, so the aggregates are bit-identical."""
    def fn(comm):
        sync, pipe = exchanges(comm, 1, algorithm, wire), exchanges(comm, 2, algorithm, wire)
        a = [flat(sync.step(grads_of(comm.rank, s))) for s in range(STEPS)]
        b = [flat(pipe.step(grads_of(comm.rank, s))) for s in range(STEPS)]
        in_flight = pipe.pending and pipe.in_flight
        state = pipe.get_state()  # finishes the round owed to the next step
        for ex in (sync, pipe):
            ex.close()
        return a, b, in_flight, state, sync.get_state()

    for a, b, in_flight, state, sync_state in InProcessWorld(3).run(fn):
        assert in_flight
        np.testing.assert_array_equal(b[0], np.zeros_like(a[0]))
        for s in range(1, STEPS):
            np.testing.assert_array_equal(b[s], a[s - 1])
        np.testing.assert_array_equal(state["pending"], a[-1])  # held, not lost
        if "residual" in sync_state:
            np.testing.assert_array_equal(state["residual"], sync_state["residual"])
        assert int(state["round"][0]) == STEPS


@pytest.mark.parametrize("wire", ["int8", "bfloat16"])
@pytest.mark.parametrize("memory", ["residual", "none"])
def test_the_next_round_starts_once_the_residual_is_whole(monkeypatch, wire, memory):
    """A pipelined dense round over a lossy wire settles its memory as soon as the residual is
    whole (after the reduce-scatter and the encoding of this rank's block of the sum), so the
    next step's round starts -- its error feedback and encoding -- while the allgather of the
    round before is still running; the steps stay the synchronous ones, one step late, and the
    residual the same, bit for bit."""
    from tfsparse.aggregators.dense import DenseAllreduce

    exchange = DenseAllreduce.exchange
    ended = {}

    def slow_allgather(self, comm, payload, out=None, settled=None):
        def settle():
            settled()
            time.sleep(0.3)  # the rest of the round (the allgather) takes its time

        result = exchange(self, comm, payload, out=out, settled=settle if settled is not None else None)
        ended.setdefault(comm.rank, []).append(time.perf_counter())
        return result

    monkeypatch.setattr(DenseAllreduce, "exchange", slow_allgather)

    def fn(comm):
        kw = {"memory": memory}
        sync = Pipelined(GradientExchange("dense", 1.0, wire_dtype=wire, pipeline=1, communicator=comm, **kw))
        pipe = Pipelined(GradientExchange("dense", 1.0, wire_dtype=wire, pipeline=2, communicator=comm, **kw))
        a = [flat(sync.step(grads_of(comm.rank, s))) for s in range(STEPS)]
        ended.pop(comm.rank, None)
        begin, begun = pipe.engine.begin, []

        def timed_begin(*args, **kwargs):
            index = begin(*args, **kwargs)
            begun.append(time.perf_counter())  # round ``index`` encoded and queued
            return index

        pipe.engine.begin = timed_begin
        b = [flat(pipe.step(grads_of(comm.rank, s))) for s in range(STEPS)]
        state, sync_state = pipe.get_state(), sync.get_state()
        for ex in (sync, pipe):
            ex.close()
        return a, b, begun, ended[comm.rank], state, sync_state

    for a, b, begun, done, state, sync_state in InProcessWorld(3, timeout=60).run(fn):
        for s in range(1, STEPS):
            np.testing.assert_array_equal(b[s], a[s - 1])
        np.testing.assert_array_equal(state["pending"], a[-1])
        if memory == "residual":
            np.testing.assert_array_equal(state["residual"], sync_state["residual"])
        # round s + 1 was encoded and queued while round s's allgather still ran
        assert len(begun) == len(done) == STEPS
        assert all(begun[s + 1] < done[s] for s in range(STEPS - 1)), (begun, done)


def test_the_pending_round_is_saved_and_applied_after_a_resume():
    def fn(comm):
        live = exchanges(comm, 2, "topk")
        for s in range(3):
            live.step(grads_of(comm.rank, s))
        state = live.get_state()
        resumed = exchanges(comm, 2, "topk")
        resumed.set_state(state)
        a = [flat(live.step(grads_of(comm.rank, s))) for s in range(3, 6)]
        b = [flat(resumed.step(grads_of(comm.rank, s))) for s in range(3, 6)]
        for ex in (live, resumed):
            ex.close()
        return a, b, state

    for a, b, state in InProcessWorld(2).run(fn):
        np.testing.assert_array_equal(a[0], state["pending"])
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_dsync_rounds_then_pipelined_and_back_lose_nothing():
    """D-Sync warm-up rounds are synchronous and float32 (4 bytes a value, whatever the wire);
    the first pipelined step applies zeros; switching back to synchronous adds the owed round
    to the current one, so the sum of everything applied is the sum of every round."""
    n = 4096 * 3

    def fn(comm):
        ex = Pipelined(GradientExchange("dense", 1.0, wire_dtype="int8", pipeline=2, communicator=comm))
        rng = np.random.default_rng(comm.rank)
        grads = [rng.standard_normal(n).astype(np.float32) for _ in range(6)]
        applied, sent = [], []
        for s, dsync in enumerate([True, True, False, False, True, True]):
            ex.use_dsync(dsync)
            before = ex.total.bytes_sent
            applied.append(ex.step(grads[s]))
            sent.append(ex.total.bytes_sent - before)
        ex.close()
        return grads, applied, sent, ex.residual

    res = InProcessWorld(3).run(fn)
    total = sum(sum(g.astype(np.float64) for g in r[0]) for r in res)
    grads, applied, sent, _ = res[0]
    exact = [sum(r[0][s].astype(np.float64) for r in res) for s in range(6)]
    np.testing.assert_allclose(applied[0], exact[0], rtol=1e-5, atol=1e-6)  # synchronous: its own round
    np.testing.assert_array_equal(applied[2], np.zeros(n, np.float32))  # the first pipelined step
    np.testing.assert_allclose(applied[3], exact[2], rtol=0.05, atol=0.05)  # round 2, over int8
    np.testing.assert_allclose(applied[4], exact[3] + exact[4], rtol=0.05, atol=0.05)  # owed + own
    # bytes are counted when a round finishes: float32 ring volume, then int8's (a quarter plus
    # one scale per 4096-value chunk), rounds 3 and 4 both in step 4
    f32, i8 = 2 * 4 * n * 2 // 3, 2 * 2 * (n // 3 + 4)
    assert sent == [f32, f32, 0, i8, i8 + f32, f32]
    # nothing lost: everything applied plus what the residuals keep is everything sent
    kept = sum(r[3].astype(np.float64) for r in res)
    np.testing.assert_allclose(sum(a.astype(np.float64) for a in applied) + kept, total, rtol=1e-5, atol=1e-4)


def test_epoch_ends_leave_nothing_in_flight():
    """With epochs marked (``mark_epochs``, by SparseStrategy for fit), an epoch's last pipelined round is
    finished in its own step and held; the next step applies it as usual."""
    def fn(comm):
        ex = exchanges(comm, 2)
        ex.mark_epochs(3)
        flights = []
        for s in range(6):
            ex.step(grads_of(comm.rank, s))
            flights.append(any(b.futures for b in ex.bucket_states))
        ex.close()
        return flights

    assert InProcessWorld(2).run(fn) == [[True, True, False, True, True, False]] * 2


def test_caller_collectives_do_not_wait_for_the_round_in_flight():
    """Pipelined, run_collective (the per-step metric averaging) runs at once over a
    communicator of its own, while the communication thread is still busy with the round."""
    gate = threading.Event()

    def fn(comm):
        ex = exchanges(comm, 2)
        ex.step(grads_of(comm.rank, 0))
        ex.engine._runner.submit(gate.wait)  # the communication thread is busy until the gate opens
        got = ex.run_collective(lambda c: c.allreduce(np.array([comm.rank + 1.0])))
        if comm.rank == 0:
            gate.set()
        ex.close()
        return float(got[0])

    assert InProcessWorld(2, timeout=30).run(fn) == [3.0, 3.0]


@pytest.mark.parametrize("value", [0, 3, 1.5, True, "2"])
def test_bad_pipeline_fails_before_communication(value):
    with pytest.raises(ValueError, match=rf"pipeline={value!r} is not supported; accepted: 1 .* or 2"):
        GradientExchange("dense", 1.0, pipeline=value, communicator=NoTalk())


# -- through Keras, real mpirun -------------------------------------------------------------

def _mean_gradient(w, b, ranks, step, batch=4):
    """The MSE gradient of the linear model, averaged over every rank's batch ``step``."""
    gw, gb = np.zeros_like(w), np.zeros_like(b)
    for r in ranks:
        xb = r["x"][step * batch:(step + 1) * batch].astype(np.float64)
        err = xb @ w + b - r["y"][step * batch:(step + 1) * batch]
        gw += 2 * xb.T @ err / err.size
        gb += 2 * err.sum(0) / err.size
    return gw / len(ranks), gb / len(ranks)


def _replay(ranks, modes, lr=0.1, steps=3):
    """The update sequence of Alg. 1: ``modes[t]`` is "sync" (apply g[t]) or "pipe" (apply
    g[t-1], zeros when the previous step was synchronous or there is none)."""
    w, b = ranks[0]["w0"].astype(np.float64), ranks[0]["b0"].astype(np.float64)
    owed = None
    for t, mode in enumerate(modes):
        g = _mean_gradient(w, b, ranks, t % steps)
        if mode == "sync":
            apply, owed = g, None
        else:
            apply, owed = owed or (np.zeros_like(w), np.zeros_like(b)), g
        w, b = w - lr * apply[0], b - lr * apply[1]
    return w, b, owed


@pytest.mark.parametrize("P,route", [(2, "strategy"), (3, "strategy"), (3, "optimizer"),
                                     pytest.param(3, "horovod", marks=pytest.mark.horovod)])
def test_keras_updates_follow_the_pipelined_sequence(P, route):
    """Step t+1 applies step t's averaged gradient, across the epoch boundary too; after fit
    nothing is in flight, the last round is held by the exchange, and the weights are
    identical on every rank (the Horovod backend too: there the metric averaging queues
    behind the round, Horovod refusing two collectives in flight at once).  A synchronous
    exchange built in the same process afterwards sums right, its communication thread level
    with the training's threads (not ahead of them, as the pipelined one's is)."""
    from mpi_harness import mpirun

    if route == "horovod":
        from tfsparse.collectives import horovod_available

        if not horovod_available():
            pytest.skip("Horovod is not installed with MPI (bash tools/install.sh --horovod builds it)")

    ranks, _ = mpirun(P, "pipeline.py", f"staleness-{route}", timeout=240)
    w, b, owed = _replay(ranks, ["pipe"] * 6)
    for r in ranks:
        np.testing.assert_array_equal(r["w"], ranks[0]["w"])
        np.testing.assert_allclose(r["w"], w, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(r["b"], b, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(r["pending"], np.concatenate([owed[0].ravel(), owed[1]]) * (P if route == "optimizer" else 1),
                                   rtol=1e-4, atol=1e-5)
        assert not r["in_flight"]
        if route == "horovod":  # Horovod's own thread runs the collectives: nothing changes
            assert r["quiet"] == -1.0 and r["nice_comm"] == r["nice_main"]
        else:  # over MPI the communication thread waits quietly and runs ahead of the others
            assert r["quiet"] == QUIET_PAUSE and r["nice_main"] - r["nice_comm"] == PRECEDENCE_NICE
        # a synchronous exchange built after it: its thread level with the training's, not ahead
        assert r["nice_sync"] == r["nice_main"]
        np.testing.assert_array_equal(r["sync_total"], np.full(3, P * (P + 1) / 2, np.float32))


def test_keras_dsync_warmup_then_pipelined_int8():
    """DSyncWarmUp(epochs=1): epoch 1 synchronous over float32, epoch 2 pipelined over int8
    (its first step applies zeros); the bytes per step follow the wire of each epoch."""
    from mpi_harness import mpirun

    ranks, _ = mpirun(3, "pipeline.py", "dsync", timeout=240)
    w, b, _ = _replay(ranks, ["sync"] * 3 + ["pipe"] * 3)
    for r in ranks:
        np.testing.assert_array_equal(r["w"], ranks[0]["w"])
        np.testing.assert_allclose(r["w"], w, rtol=0.02, atol=0.02)  # epoch 2 over int8
        np.testing.assert_allclose(r["b"], b, rtol=0.02, atol=0.02)
    assert all(r["quiet"] == QUIET_PAUSE and r["nice_comm"] < r["nice_main"] for r in ranks)
    f32, i8 = ranks[0]["epoch_bytes"]
    assert f32 == 2 * 4 * 12 * 2 // 3  # 12 parameters, float32 ring volume per step
    assert i8 == 2 * 2 * (4 + 4)  # int8: 4 values and one float32 scale per message


def test_a_rank_failing_during_a_pending_exchange_stops_every_rank():
    from mpi_harness import mpirun

    _, text = mpirun(3, "pipeline.py", "fail", timeout=120, expect_fail=True)
    assert "injected failure on rank 1" in text
    assert "rank 1 stopped with an uncaught RuntimeError; aborting all 3 ranks" in text


@pytest.mark.parametrize("depth", [2, np.int64(2), np.int32(1)])
def test_a_depth_given_as_any_integer_is_taken(depth):
    ex = Pipelined(GradientExchange("dense", 1.0, communicator=NoTalk()), depth=depth)
    assert ex.depth == int(depth) and type(ex.depth) is int


@pytest.mark.parametrize("depth", [3, True, 2.0, "2"])
def test_a_bad_depth_is_refused_naming_it(depth):
    with pytest.raises(ValueError, match=rf"depth={depth!r} is not supported; accepted: 1 \(synchronous\) or 2"):
        Pipelined(GradientExchange("dense", 1.0, communicator=NoTalk()), depth=depth)
