"""The exchange pipeline on in-process worlds (threads): every algorithm x wire dtype x plan
against the reference computed from all ranks' inputs (tests/exchange_ref.py), exact byte
accounting per wire, the communication thread's ordering and overlap, explicit state
(bit-identical resume), and argument validation before any communication."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from exchange_ref import reference_run
from fakes import NoTalk
from tfsparse.aggregators import get_aggregator
from tfsparse.aggregators.base import NOTHING
from tfsparse.collectives import CommThread, Communicator, InProcessWorld
from tfsparse.checkpoint import Checkpointer
from tfsparse.exchange import GradientExchange

ALGOS = ("dense", "topk", "gtopk", "oktopk", "dgc", "gaussiank", "csc", "dragonn")
WIRES = ("float32", "float16", "bfloat16", "int8")
PLANS = {"fused": {}, "buckets": {"plan": 2000}, "per_tensor": {"plan": "per_tensor"}}
# Ok-Topk with the paper's plain threshold reuse (§3.1.3), which exchange_ref models; the
# authors' per-step adjustment (the default) is tested rule by rule in test_aggregators.py
PLAIN_REUSE = {"local_raise": 1.0, "local_adjust": 1.0, "global_adjust": 1.0}
OPTIONS = {"dgc": {"seed": 5}, "oktopk": {"tau": 2, "tau_prime": 2, **PLAIN_REUSE}, "csc": {"chunk_size": 32}}
SHAPES = [(40, 30), (30,), (30, 20), (20,), (25, 8)]
STEPS, DENSITY = 3, 0.05


def grads_of(rank: int, step: int) -> list[np.ndarray]:
    """Gradient-like tensors: heavy-tailed noise plus a signal shared by the ranks."""
    out = []
    for i, shape in enumerate(SHAPES):
        rng = np.random.default_rng([rank, step, i])
        shared = np.random.default_rng([999, i]).standard_normal(shape)
        out.append((rng.laplace(size=shape) + 0.5 * shared * (1 + step)).astype(np.float32))
    return out


def flat(arrays):
    return np.concatenate([np.asarray(a).ravel() for a in arrays])


def run(P, algorithm, wire, plan, **kwargs):
    """Each of ``P`` in-process ranks' results of :data:`STEPS` exchanges (``kwargs`` go to the
    exchange), and the buckets."""
    def fn(comm):
        ex = GradientExchange(algorithm, DENSITY, wire_dtype=wire, communicator=comm, **PLANS[plan],
                              **OPTIONS.get(algorithm, {}), **kwargs)
        steps = []
        for s in range(STEPS):
            before = ex.total.bytes_sent
            out = ex.exchange_numpy(grads_of(comm.rank, s))
            steps.append({"out": flat(out), "residual": ex.residual, "bytes": ex.total.bytes_sent - before,
                          "infos": [dict(getattr(a, "last_info", {})) for a in ex.aggregators]})
        ex.close()
        return steps, [(b.start, b.stop) for b in ex.buckets]

    return InProcessWorld(P, timeout=60).run(fn)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_exchange_equals_reference(P, algorithm, wire, plan):
    got = run(P, algorithm, wire, plan)
    buckets = got[0][1]
    assert len(buckets) == {"fused": 1, "buckets": 2, "per_tensor": len(SHAPES)}[plan]
    grads = [[flat(grads_of(r, s)) for r in range(P)] for s in range(STEPS)]
    infos = [got[0][0][s]["infos"] for s in range(STEPS)]
    want = reference_run(algorithm, wire, buckets, grads, DENSITY, infos, OPTIONS.get(algorithm))
    for s in range(STEPS):
        result, residuals = want[s]
        for r in range(P):
            step = got[r][0][s]
            np.testing.assert_array_equal(step["out"], got[0][0][s]["out"])  # bit-identical on every rank
            np.testing.assert_allclose(step["out"], result, rtol=2e-5, atol=2e-5)
            np.testing.assert_array_equal(np.flatnonzero(step["out"]), np.flatnonzero(result))
            if residuals is None:
                assert step["residual"] is None
            else:
                np.testing.assert_allclose(step["residual"], residuals[r], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("P", [2, 4])
def test_dense_bytes_follow_the_wire_exactly(P):
    """Ring volume 2n(P-1)/P values per rank: float16/bfloat16 send exactly half the bytes of
    float32; int8 a quarter plus one float32 scale per 4096-value chunk of every message; int4
    half of that, a float32 scale per 512 values."""
    n = 4096 * 6  # divisible by P: the formula is exact
    got = {}
    for wire in (*WIRES, "int4"):
        def fn(comm, wire=wire):
            ex = GradientExchange("dense", 1.0, wire_dtype=wire, communicator=comm)
            ex.exchange_numpy(np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32))
            ex.close()
            return ex.total.bytes_sent

        got[wire] = InProcessWorld(P).run(fn)
    assert got["float32"] == [2 * 4 * n * (P - 1) // P] * P
    assert got["float16"] == got["bfloat16"] == [b // 2 for b in got["float32"]]
    block = n // P
    assert got["int8"] == [2 * (P - 1) * (block + 4 * -(-block // 4096))] * P
    assert got["int4"] == [2 * (P - 1) * (block // 2 + 4 * -(-block // 512))] * P


@pytest.mark.parametrize("wire,value_bytes", [("float32", 4), ("float16", 2), ("bfloat16", 2), ("int8", 1)])
def test_sparse_bytes_follow_the_wire_exactly(wire, value_bytes):
    """topk: each rank's k (index, value) pairs reach the P-1 others (ring allgather): the
    indices blocked (n < 64K: one 4-byte count, 2 bytes each) plus the wire's values (int8: plus
    one scale per message)."""
    P, n, k = 3, 1000, 20

    def fn(comm):
        ex = GradientExchange("topk", k / n, wire_dtype=wire, communicator=comm)
        ex.exchange_numpy(np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32))
        ex.close()
        return ex.total.bytes_sent

    scale = 4 if wire == "int8" else 0
    assert InProcessWorld(P).run(fn) == [(P - 1) * (4 + k * (2 + value_bytes) + scale)] * P


@pytest.mark.filterwarnings("ignore:tfsparse. the gradient of round 1 is not finite:RuntimeWarning")
def test_int8_round_with_a_non_finite_sum_is_dropped_and_the_residual_kept():
    """Dense int8, where the error feedback and the encoding of the other ranks' blocks are one
    pass: a NaN in rank 1's gradient (in a block it sends, and in its own) drops the round on
    every rank; the residuals stay those of the round before, and the next round is the same as
    it is without the dropped one in between."""
    P = 3
    shapes = [(5000,), (9000,), (7,)]

    def grads(rank, step):
        return [np.random.default_rng([rank, step, i]).standard_normal(s).astype(np.float32)
                for i, s in enumerate(shapes)]

    def fn(comm, poison):
        ex = GradientExchange("dense", 1.0, wire_dtype="int8", communicator=comm)
        ex.exchange_numpy(grads(comm.rank, 0))
        kept = ex.residual.copy()
        if poison:
            bad = grads(comm.rank, 1)
            if comm.rank == 1:
                bad[0][10] = np.nan  # in the block rank 0 owns
                bad[1][6000] = np.inf  # in rank 1's own block
            ex.exchange_numpy(bad)
            assert ex.total.skipped_buckets == 1
            np.testing.assert_array_equal(ex.residual, kept)
        out = ex.exchange_numpy(grads(comm.rank, 2))
        ex.close()
        return flat(out), ex.residual

    clean = InProcessWorld(P).run(lambda comm: fn(comm, False))
    dropped = InProcessWorld(P).run(lambda comm: fn(comm, True))
    for (out, res), (out0, res0) in zip(dropped, clean):
        np.testing.assert_array_equal(out, out0)
        np.testing.assert_array_equal(res, res0)


def test_float16_overflow_is_scaled_and_kept():
    """A gradient beyond float16's range travels scaled (never Inf); what the wire lost stays
    in the residual, so applied + residual == sent."""
    big = np.array([3e6, -7e5, 1.0, 1e-9], np.float32)

    def fn(comm):
        ex = GradientExchange("dense", 1.0, wire_dtype="float16", communicator=comm)
        out = ex.exchange_numpy(big * (comm.rank + 1))
        ex.close()
        return out, ex.residual

    res = InProcessWorld(2).run(fn)
    out = res[0][0]
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, big * 3, rtol=2e-3, atol=1e-6)  # 1e-9 underflows: kept below
    total = out.astype(np.float64) + res[0][1] + res[1][1]
    np.testing.assert_allclose(total, big.astype(np.float64) * 3, rtol=1e-6)


# -- explicit state ------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("wire", ["float32", "int8"])
def test_state_resume_is_bit_identical(algorithm, wire):
    """get_state after 3 rounds (Ok-Topk: between re-evaluations, tau'=4), set_state on a new
    exchange: the next rounds equal an uninterrupted run's bit for bit."""
    P = 3
    opts = {"dgc": {"seed": None}, "oktopk": {"tau": 3, "tau_prime": 4}}.get(algorithm, {})

    def fn(comm):
        live = GradientExchange(algorithm, 0.05, wire_dtype=wire, plan=2000, communicator=comm, **opts)
        for s in range(3):
            live.exchange_numpy(grads_of(comm.rank, s))
        state = live.get_state()
        resumed = GradientExchange(algorithm, 0.05, wire_dtype=wire, plan=2000, communicator=comm, **opts)
        resumed.set_state(state)  # before the first round: applied when the layout is known
        a = [flat(live.exchange_numpy(grads_of(comm.rank, s))) for s in range(3, 7)]
        b = [flat(resumed.exchange_numpy(grads_of(comm.rank, s))) for s in range(3, 7)]
        live.close()
        resumed.close()
        return a, b, live.get_state(), resumed.get_state(), state

    for a, b, sa, sb, state in InProcessWorld(P).run(fn):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        assert sorted(sa) == sorted(sb)
        for key in sa:
            np.testing.assert_array_equal(sa[key], sb[key])
        assert int(state["round"][0]) == 3 and state["sizes"].tolist() == [1200, 30, 600, 20, 200]
        if algorithm == "oktopk":
            assert int(state["bucket0.t"][0]) == 3 and np.isfinite(state["bucket0.thresholds"]).all()
        if algorithm == "dgc":
            assert state["bucket0.rng"].dtype == np.uint64


def test_state_rejects_another_layout_or_plan():
    ex = GradientExchange("topk", 0.1, communicator=InProcessWorld(1).comms[0])
    ex.exchange_numpy([np.ones(5, np.float32), np.ones(3, np.float32)])
    with pytest.raises(ValueError, match=r"sizes \[4\].*this model's are \[5, 3\]"):
        ex.set_state({"sizes": np.array([4]), "residual": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="was built for gradients"):
        ex.exchange_numpy([np.ones(4, np.float32)])
    per_tensor = GradientExchange("topk", 0.1, plan=0, communicator=InProcessWorld(1).comms[0])
    per_tensor.exchange_numpy([np.ones(5, np.float32), np.ones(3, np.float32)])
    with pytest.raises(ValueError, match=r"belongs to buckets \[\[0, 8\]\].*makes \[\[5, 8\], \[0, 5\]\]"):
        per_tensor.set_state(ex.get_state())


def test_no_state_while_a_round_is_in_flight():
    def fn(comm):
        ex = GradientExchange("oktopk", 0.1, communicator=comm)
        ex.exchange_numpy(grads_of(comm.rank, 0))
        rnd = ex.start(grads_of(comm.rank, 1))
        for call in (ex.get_state, lambda: ex.set_state({}), Checkpointer(ex).gather):
            with pytest.raises(RuntimeError, match="while a round is in flight"):
                call()
        rnd.wait()
        state = ex.get_state()
        ex.close()
        return int(state["round"][0]), int(state["bucket0.t"][0])

    assert InProcessWorld(2).run(fn) == [(2, 2), (2, 2)]


def test_a_gather_older_than_the_last_round_is_not_saved():
    def fn(comm):
        ex = GradientExchange("topk", 0.1, communicator=comm)
        checkpointer = Checkpointer(ex)
        ex.exchange_numpy(grads_of(comm.rank, 0))
        checkpointer.gather()
        ex.exchange_numpy(grads_of(comm.rank, 1))  # e.g. ModelCheckpoint(save_best_only) did not save
        entries = checkpointer.entries()
        ex.close()
        return entries, ex.residual

    entries, residual = InProcessWorld(2).run(fn)[0]
    assert entries["tfsparse.ranks"].tolist() == [0]  # not the stale rows: this rank's current state
    np.testing.assert_array_equal(entries["tfsparse.residual"][0], residual)


def test_restoring_a_file_without_every_ranks_state_warns():
    def fn(comm):
        ex = GradientExchange("topk", 0.1, communicator=comm)
        ex.exchange_numpy(grads_of(comm.rank, 0))
        entries = Checkpointer(ex).entries()  # no gather: this rank's row only (a plain model.save)
        fresh = GradientExchange("topk", 0.1, communicator=comm)
        if comm.rank == 0:
            with pytest.warns(RuntimeWarning, match=r"ranks \[0\], this job has 2 ranks"):
                Checkpointer(fresh).restore(entries)
        ex.close()
        return ex.residual, fresh.residual

    (own, restored), _ = InProcessWorld(2).run(fn)
    np.testing.assert_allclose(restored, own / 2, rtol=1e-6)  # spread evenly


def test_restoring_on_another_number_of_ranks_shares_out_the_velocities_as_the_residuals():
    """Momentum correction's velocity is each rank's pending update as the residual is: from a file of
    one rank's state, each of two ranks takes half of it (every rank took rank 0's whole velocity)."""
    def fn(comm):
        ex = GradientExchange("topk", 0.1, communicator=comm, memory="momentum", momentum=0.9)
        for step in range(2):
            ex.exchange_numpy(grads_of(comm.rank, step))
        entries = Checkpointer(ex).entries()  # no gather: this rank's row only
        fresh = GradientExchange("topk", 0.1, communicator=comm, memory="momentum", momentum=0.9)
        if comm.rank == 0:  # (the warnings module is not thread-safe: one rank of the in-process world)
            with pytest.warns(RuntimeWarning, match=r"residuals \(and velocities\) are spread evenly"):
                Checkpointer(fresh).restore(entries)
        fresh.exchange_numpy([np.zeros_like(g) for g in grads_of(comm.rank, 0)])  # built: the pending state applied
        saved, ex_state = fresh.get_state(), ex.get_state()
        ex.close()
        fresh.close()
        return ex_state, saved

    own, restored = InProcessWorld(2).run(fn)[0]  # rank 0's state before the save, and after the restore
    kept = restored["velocity"] != 0
    assert np.any(own["velocity"] != 0) and kept.sum() > 0.5 * kept.size
    # after one round of zero gradients: the velocity 0.9 x (own / 2), zero where it was sent
    np.testing.assert_allclose(restored["velocity"][kept], (0.9 * own["velocity"] / 2)[kept], rtol=1e-5)


def test_gather_and_checkpoint_entries():
    P = 3

    def fn(comm):
        ex = GradientExchange("oktopk", 0.1, communicator=comm)
        ex.exchange_numpy(grads_of(comm.rank, 0))
        checkpointer = Checkpointer(ex)
        stacked = checkpointer.gather()
        entries = checkpointer.entries()
        fresh = GradientExchange("oktopk", 0.1, communicator=comm)
        assert Checkpointer(fresh).restore({k: v for k, v in entries.items()}) if comm.rank == 0 else True
        ex.close()
        return stacked, entries, ex.get_state(), fresh.get_state()

    out = InProcessWorld(P).run(fn)
    stacked, entries, own, restored = out[0]
    assert stacked["residual"].shape == (P, 2050)
    assert entries["tfsparse.ranks"].tolist() == [0, 1, 2]  # rank 0 kept every rank's rows
    for key in own:
        np.testing.assert_array_equal(restored[key], own[key])
    assert out[1][1]["tfsparse.ranks"].tolist() == [1]  # the others: their own row only
    for r in range(P):
        np.testing.assert_array_equal(stacked["residual"][r], out[r][2]["residual"])


# -- the communication thread ----------------------------------------------------------------

def test_comm_thread_runs_in_submission_order_and_reports_errors():
    th = CommThread()
    seen = []
    futs = [th.submit(lambda i=i: (time.sleep(0.01 * (5 - i)), seen.append(i))) for i in range(5)]
    for f in futs:
        f.result(timeout=5)
    assert seen == [0, 1, 2, 3, 4]
    bad = th.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result(timeout=5)
    assert th.run(lambda: threading.current_thread().name) == "tfsparse-comm"
    th.close()


def test_buckets_start_in_bucket_order():
    """Collectives must run in the same order on every rank, so buckets are started in bucket
    order (TensorFlow runs the per-bucket start ops in program order); out of order is refused."""
    ex = GradientExchange("topk", 0.1, plan=0, communicator=InProcessWorld(1).comms[0])
    grads = grads_of(0, 0)
    ex.exchange_numpy(grads)  # builds
    second = ex.bucket_states[1]
    with pytest.raises(RuntimeError, match="bucket 1 was started before bucket 0 of the same round"):
        ex.begin(second, grads[second.spec.first:second.spec.last])


def test_encoding_overlaps_the_wire():
    """While bucket i is on the wire, bucket i+1 is encoded: the encode of bucket i+1 starts
    before the collective of bucket i ends (a slow fake transport and a slow encoder)."""
    events = []

    class Slow(Communicator):  # every allreduce takes 50 ms
        def __init__(self, rank=0, size=2):
            super().__init__(rank, size)

        def _allreduce(self, x, op):
            events.append(("comm", "begin", time.perf_counter()))
            time.sleep(0.05)
            events.append(("comm", "end", time.perf_counter()))
            return x * 2

        def _duplicate(self):
            return Slow(self.rank, self.size)

        def _allgather(self, x):  # the configuration agreement and the finite flags: two equal ranks
            return [x.copy(), x.copy()]

        _bcast = _alltoall = _barrier = _send = _isend = _recv = _irecv = None

    class SlowEncode(type(get_aggregator("dense"))):
        def encode(self, comm, acc, k=None, wire=None, offer=NOTHING):
            events.append(("encode", "begin", time.perf_counter()))
            time.sleep(0.05)
            return super().encode(comm, acc, k, wire, offer)

    ex = GradientExchange("dense", 1.0, plan=0, communicator=Slow())
    grads = [np.ones(10, np.float32) for _ in range(6)]
    ex.exchange_numpy(grads)
    for b in ex.bucket_states:
        b.aggregator = SlowEncode()
    events.clear()
    out = ex.exchange_numpy(grads)
    ex.close()
    assert all(np.array_equal(o, g * 2) for o, g in zip(out, grads))
    encodes = [t for what, edge, t in events if what == "encode"]
    comm_ends = [t for what, edge, t in events if what == "comm" and edge == "end"]
    assert len(encodes) == len(comm_ends) == 6
    # bucket i+1's encoding began while bucket i was still on the wire
    assert sum(encodes[i + 1] < comm_ends[i] for i in range(5)) >= 4, events


def test_a_round_can_finish_later():
    def fn(comm):
        ex = GradientExchange("topk", 0.1, communicator=comm)
        rnd = ex.start(grads_of(comm.rank, 0))
        busy = sum(i * i for i in range(20000))  # the next step's compute would run here
        with pytest.raises(RuntimeError, match="started again before its round 0 finished"):
            ex.start(grads_of(comm.rank, 1))
        out = rnd.wait()
        ex.close()
        return flat(out), busy

    res = InProcessWorld(2).run(fn)
    np.testing.assert_array_equal(res[0][0], res[1][0])


# -- validation, before any communication ------------------------------------------------------

@pytest.mark.parametrize("kwargs,words", [
    ({"algorithm": "top-k"}, ["algorithm='top-k' is not supported", "'topk'", "'gtopk'"]),
    ({"density": 0}, ["density=0", "(0, 1]"]),
    ({"wire_dtype": "fp16"}, ["wire_dtype='fp16' is not supported", "'float16'", "'bfloat16'", "'int8'"]),
    ({"wire_dtype": 16}, ["wire_dtype=16 is not supported"]),
    ({"bucket_bytes": -5}, ["bucket_bytes=-5", "integer >= 0"]),
    ({"bucket_bytes": "4MB"}, ["bucket_bytes='4MB'"]),
    ({"plan": "layerwise"}, ["plan='layerwise' is not supported", "'per_tensor'"]),
    ({"algorithm": "oktopk", "tau": 0}, ["tau=0", ">= 1"]),
    ({"algorithm": "oktopk", "taus": 3}, ["taus=3", "accepted", "tau_prime"]),
    ({"algorithm": "dense", "tau": 3}, ["invalid options for algorithm='dense'"]),
])
def test_bad_arguments_fail_before_communication(kwargs, words):
    with pytest.raises(ValueError) as e:
        GradientExchange(**{"algorithm": "topk", "density": 0.1, **kwargs}, communicator=NoTalk())
    for w in words:
        assert w in str(e.value), str(e.value)


def test_without_thread_support_the_collectives_run_inline():
    """A transport that cannot be called from two threads (MPI without MPI_THREAD_MULTIPLE)
    gets no communication thread: the same results, without the overlap."""
    def fn(comm, threads):
        comm.thread_safe = threads
        ex = GradientExchange("gtopk", 0.1, plan=2000, communicator=comm)
        out = [flat(ex.exchange_numpy(grads_of(comm.rank, s))) for s in range(2)]
        kind = type(ex._runner).__name__
        ex.close()
        return out, kind

    with_thread = InProcessWorld(3).run(fn, True)
    inline = InProcessWorld(3).run(fn, False)
    assert {k for _, k in with_thread} == {"CommThread"} and {k for _, k in inline} == {"_Inline"}
    for (a, _), (b, _) in zip(with_thread, inline):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_set_state_of_nothing_starts_afresh():
    agg = get_aggregator("dgc", seed=3)
    first = agg.compressor._rng.random()
    agg.set_state({})
    assert agg.compressor._rng.random() == first
    ok = get_aggregator("oktopk")
    ok.set_state({})
    assert int(ok.get_state()["t"][0]) == 0
