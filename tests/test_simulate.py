"""The α-β model (tfsparse.collectives.alphabeta) and the message-schedule simulator
(tfsparse.timing: each aggregator's declared schedule, priced by tfsparse.collectives.simulate),
fast and in-process.

The fidelity tests run the **real** aggregators on :class:`InProcessWorld` (P = 2, 3, 4, 5, 8)
with random N(0, 1) gradients and compare every rank's ``bytes_sent`` with the simulator's
schedule: exactly, rank by rank, for the deterministic algorithms (dense, topk, gtopk, csc, and
DGC when it samples every element); within a tolerance for the data-dependent ones (Ok-Topk's
expected counts, the threshold selections of DGC and Gaussian-k)."""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfsparse import aggregators as A
from tfsparse.collectives import AlphaBeta, InProcessWorld, measure_alpha_beta
from tfsparse.collectives.alphabeta import fit_alpha_beta, parse_rate, parse_time
from tfsparse.collectives.simulate import Builder
from tfsparse.timing import ALGORITHMS, period, schedule, simulate
from tfsparse.wire import BlockedIndices

REPO = Path(__file__).resolve().parents[1]
N, DENSITY, K = 20000, 0.01, 200
WORLDS = (2, 3, 4, 5, 8)
AB = AlphaBeta.from_strings("1gbit", "50us")

_runs: dict = {}


def real_bytes(name, P, steps, options=None, seed=0) -> np.ndarray:
    """Bytes each rank's ``bytes_sent`` grew by in each of ``steps`` allreduces: [rank, step]."""
    key = (name, P, steps, tuple(sorted((options or {}).items())), seed)
    if key not in _runs:
        def fn(comm):
            agg = A.get_aggregator(name, **(options or {}))
            out = []
            for s in range(steps):
                acc = np.random.default_rng([seed, comm.rank, s]).standard_normal(N).astype(np.float32)
                before = comm.bytes_sent
                agg.allreduce(comm, acc, K)
                out.append(comm.bytes_sent - before)
            return out

        _runs[key] = np.array(InProcessWorld(P, timeout=30).run(fn), dtype=np.int64)
    return _runs[key]


def test_every_registered_aggregator_has_a_schedule():
    assert set(A.available_aggregators()) == set(ALGORITHMS)
    for name in ALGORITHMS:  # declared next to the aggregator's own code
        assert type(A.get_aggregator(name)).schedule is not A.Aggregator.schedule, name
    assert schedule("topk", 4, N, DENSITY).k == K  # k = ceil(density * n), as the exchange


@pytest.mark.parametrize("name", ALGORITHMS)
def test_simulator_takes_the_aggregators_options(name):
    """The options are the aggregator's own: its defaults, and its checks' errors."""
    cls = type(A.get_aggregator(name))
    defaults = {p.name: p.default for p in inspect.signature(cls).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty}
    stated, plain = simulate(name, 5, N, DENSITY, AB, **defaults), simulate(name, 5, N, DENSITY, AB)
    assert (stated.seconds, stated.bytes) == (plain.seconds, plain.bytes)
    with pytest.raises(ValueError) as aggregator:
        A.get_aggregator(name, bogus=1)
    with pytest.raises(ValueError) as simulator:
        simulate(name, 5, N, DENSITY, AB, bogus=1)
    assert str(simulator.value) == str(aggregator.value) and "bogus" in str(simulator.value)


# -- fidelity: the simulator's bytes are the Communicator's ---------------------------------------

EXACT = [("dense", {}), ("topk", {}), ("gtopk", {}), ("csc", {"chunk_size": 1000}),
         ("csc", {"chunk_size": 1000, "chunk_selection": "previous"}),
         ("dgc", {"min_samples": N, "seed": 3, "adapt_iters": 0, "truncate": None}),  # all sampled: k-1 entries
         ("dgc", {"exact_below": N})]  # the exact top-k: k entries


@pytest.mark.parametrize("P", WORLDS)
@pytest.mark.parametrize("name,options", EXACT, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()) or "-")
def test_deterministic_algorithms_match_bytes_sent_exactly(name, options, P):
    got = real_bytes(name, P, 3, options)
    sim_options = {k: v for k, v in options.items() if k != "seed"}
    for step in range(3):
        s = schedule(name, P, N, DENSITY, step=step + 1, **sim_options)
        np.testing.assert_array_equal(got[:, step], s.sent, err_msg=f"{name} P={P} step {step + 1}")
        assert s.bytes == got[:, step].max()
        assert simulate(name, P, N, DENSITY, AB, step=step + 1, **sim_options).bytes == got[:, step].max()


@pytest.mark.parametrize("P", WORLDS)
def test_oktopk_expected_schedule_matches_bytes_sent(P):
    """Ok-Topk's counts depend on the data; the schedule holds their expectations under
    uniformly spread selections.  Two periods of tau=4, tau_prime=2: odd steps re-evaluate the
    thresholds (and steps 1, 5 repartition), even steps reuse them."""
    opts = {"tau": 4, "tau_prime": 2}
    got = real_bytes("oktopk", P, 8, opts)
    sched = [schedule("oktopk", P, N, DENSITY, step=t, **opts) for t in range(1, 9)]
    for t, s in enumerate(sched, start=1):
        tol = 0.10 if t % 2 else 0.30  # a reuse step's counts follow the reused thresholds
        assert got[:, t - 1].max() == pytest.approx(s.bytes, rel=tol), f"step {t}"
    # the expectation is unbiased: over ranks and steps within a few per cent
    expected = np.mean([s.sent.mean() for s in sched])
    assert got.mean() == pytest.approx(expected, rel=0.04)
    # the period mean of the busiest rank's bytes
    assert got.max(axis=0).mean() == pytest.approx(simulate("oktopk", P, N, DENSITY, AB, **opts).bytes, rel=0.08)


@pytest.mark.parametrize("P", WORLDS)
def test_threshold_selections_match_bytes_sent(P):
    got = real_bytes("gaussiank", P, 4)
    assert np.abs(got.max(axis=0) / schedule("gaussiank", P, N, DENSITY).bytes - 1).max() < 0.2
    got = real_bytes("dgc", P, 6, {"seed": 11})  # the sampled threshold: only its mean is predictable
    assert got.mean() == pytest.approx(schedule("dgc", P, N, DENSITY).sent.mean(), rel=0.2)
    got = real_bytes("dragonn", P, 6)  # occupied hash slots of a sampled threshold's selection
    assert got.mean() == pytest.approx(schedule("dragonn", P, N, DENSITY).sent.mean(), rel=0.2)


def test_one_rank_communicates_nothing():
    for name in ALGORITHMS:
        r = simulate(name, 1, N, DENSITY, AB)
        assert (r.seconds, r.bytes, r.rounds) == (0.0, 0, ())
        assert simulate(name, 1, N, DENSITY, AB, gamma=1e-9).seconds == 0.0
    for name in ("dense", "topk", "gtopk", "oktopk"):
        assert real_bytes(name, 1, 2).sum() == 0


# -- the papers' cost formulas -----------------------------------------------------------------

@pytest.mark.parametrize("P", [2, 4, 16, 64, 1024])
def test_volumes_are_the_papers(P):
    n, d = 25_200_000, 0.001
    k = math.ceil(d * n)
    # a message of k (index, value) entries: k float32 values, k indices blocked (BlockedIndices:
    # 2 bytes each plus one 4-byte count per 64K elements) -- the papers' 2k elements in 6k + 1540 bytes
    msg = BlockedIndices(n).nbytes(k) + 4 * k
    assert msg == 6 * k + 4 * 385
    # gtopk-ssgd-shi2019 Eq. 5 (dense, 4-byte values) and Eq. 6 (TopKAllReduce, 2k(P-1) elements)
    assert schedule("dense", P, n, d).bytes == 2 * 4 * n * (P - 1) // P
    assert schedule("topk", P, n, d).bytes == msg * (P - 1)
    # Eq. 7: rank 0 sends 2k log2 P elements in the broadcast (plus the 8-byte lengths)
    g = schedule("gtopk", P, n, d)
    assert g.sent[0] == int(math.log2(P)) * (msg + 8) == g.bytes
    # oktopk-li2022 Eq. 3: a reuse step sends at most 6k(P-1)/P elements (+ the 8-byte counts)
    ok = schedule("oktopk", P, n, d, step=2)
    assert ok.bytes <= 6 * k * (P - 1) / P * 4 + 16 * (P - 1) + 1


def test_gtopk_rounds_and_seconds():
    P, n, d = 32, 25_200_000, 0.001
    k = math.ceil(d * n)
    r = simulate("gtopk", P, n, d, AB)
    msg = BlockedIndices(n).nbytes(k) + 4 * k  # k entries, the indices blocked
    tree = [x for x in r.rounds if x.phase == "reduction tree"]
    assert len(tree) == 5 and all((x.messages, x.bytes, x.elements) == (1, msg, 2 * k) for x in tree)
    assert sum(x.messages for x in r.rounds) == 3 * 5  # tree + length broadcast + result broadcast
    want = 10 * (AB.alpha + msg / AB.beta) + 5 * (AB.alpha + 8 / AB.beta)
    assert r.seconds == pytest.approx(want, rel=1e-12)
    # a non-power-of-two P adds the fold round: ceil(log2 P) tree rounds
    assert len([x for x in simulate("gtopk", 5, n, d, AB).rounds if x.phase == "reduction tree"]) == 3


def test_collectives_pick_the_faster_algorithm():
    n = 25_200_000
    dense = simulate("dense", 1024, n, 0.001, AB)
    assert {x.method for x in dense.rounds} == {"recursive halving", "recursive doubling"}
    assert len(dense.rounds) == 20
    # P = 3: folding a whole vector in costs more than the ring's 4 rounds of n/3
    assert {x.method for x in simulate("dense", 3, n, 0.001, AB).rounds} == {"ring reduce-scatter", "ring allgather"}
    # small blocks at large P: Bruck's log P rounds; big allgathers: either has the same bytes
    ok = simulate("oktopk", 1024, n, 0.001, AB, step=2)
    assert {x.method for x in ok.rounds if x.phase == "balance: buffer sizes"} == {"bruck"}
    assert {x.method for x in ok.rounds if x.phase == "split and reduce: message lengths"} == {"bruck"}


@pytest.mark.parametrize("P", [2, 3, 5, 6, 7, 12])
def test_bruck_allgather_rounds_against_brute_force(P):
    rng = np.random.default_rng(P)
    blocks = rng.integers(0, 1000, size=P)
    b = Builder(P)
    b.allgather("x", blocks)
    bruck = dict(b.phases[0].variants)["bruck"]
    held = [[r] for r in range(P)]  # rank r holds blocks r, r-1, ... (mod P), sends them to r + d
    want = []
    d = 1
    while d < P:
        c = min(d, P - d)
        sends = [held[r][:c] for r in range(P)]
        load = [max(blocks[sends[r]].sum(), blocks[sends[(r - d) % P]].sum()) for r in range(P)]
        want.append(max(load))
        held = [held[r] + sends[(r - d) % P] for r in range(P)]
        d *= 2
    assert all(sorted(h) == list(range(P)) for h in held)
    assert [x.bytes for x in bruck] == want
    # the bytes counted are the ring's (every block but the successor's), on every rank
    np.testing.assert_array_equal(b.sent, [blocks.sum() - blocks[(r + 1) % P] for r in range(P)])


def test_expected_shapes_in_p():
    n, d = 25_200_000, 0.001

    def ratio(name, ab, **kw):
        return simulate(name, 1024, n, d, ab, **kw).seconds / simulate(name, 32, n, d, ab, **kw).seconds

    assert ratio("dense", AB) < 1.1                                        # flat
    assert ratio("topk", AB) == pytest.approx(1023 / 31, rel=0.05)         # linear
    assert ratio("gtopk", AB) == pytest.approx(10 / 5, rel=0.1)            # logarithmic
    # Ok-Topk's O(k) volume (Eq. 3): a reuse step's bandwidth term is flat in P; the latency of
    # its P-1 rotation rounds (Eq. 1) and the re-evaluation allgather of the reduced values add to it
    assert ratio("oktopk", AlphaBeta(0.0, AB.beta), step=2) < 1.1
    assert ratio("oktopk", AB) > 2


def test_period_mean_and_gamma():
    n, d = 25_200_000, 0.001
    steps = period("oktopk")
    assert [t for t, _ in steps] == [1, 2, 33]
    assert sum(w for _, w in steps) == pytest.approx(1.0)
    assert dict(steps)[2] == pytest.approx(62 / 64)
    mean = simulate("oktopk", 64, n, d, AB)
    assert mean.seconds == pytest.approx(sum(w * simulate("oktopk", 64, n, d, AB, step=t).seconds
                                             for t, w in steps), rel=1e-12)
    assert period("oktopk", tau=4, tau_prime=2) == ((1, 0.25), (2, 0.5), (3, 0.25))
    # gamma prices the elements: topk sums the P*k gathered pairs
    gamma = 1e-9
    extra = simulate("topk", 8, n, d, AB, gamma).seconds - simulate("topk", 8, n, d, AB).seconds
    assert extra == pytest.approx(gamma * 8 * math.ceil(d * n), rel=1e-9)
    r = simulate("topk", 8, n, d, AB)
    assert r.seconds == pytest.approx(sum(x.seconds(AB) for x in r.rounds))
    assert sum(r.breakdown().values()) == pytest.approx(r.seconds)
    assert json.loads(json.dumps(r.as_dict()))["bytes"] == r.bytes


def test_cores_slow_local_work_that_more_ranks_than_cores_do_at_once():
    n, d, gamma = 25_200_000, 0.001, 1e-8
    k = math.ceil(d * n)

    def local(name, P, cores, **kw):
        return (simulate(name, P, n, d, AB, gamma, cores=cores, **kw).seconds
                - simulate(name, P, n, d, AB, cores=cores, **kw).seconds)

    # topk: every rank sums the P*k gathered pairs at once: P ranks on 2 cores take P/2 times as long
    for P in (2, 3, 4, 8):
        assert local("topk", P, None) == pytest.approx(gamma * P * k, rel=1e-9)
        assert local("topk", P, 2) == pytest.approx(gamma * P * k * max(1.0, P / 2), rel=1e-9)
        assert local("topk", P, 64) == pytest.approx(local("topk", P, None), rel=1e-12)
    # gtopk's tree rounds keep only their receivers busy: P = 4 has 2, then 1 -- two cores suffice,
    # at P = 8 the first round's 4 receivers share them
    assert local("gtopk", 4, 2) == pytest.approx(local("gtopk", 4, None), rel=1e-12)
    assert local("gtopk", 8, 2) == pytest.approx(gamma * 2 * k * (2 + 1 + 1), rel=1e-9)
    # the ring reduce-scatter: every rank adds a block at once
    assert local("dense", 4, 1) == pytest.approx(4 * local("dense", 4, None), rel=1e-9)
    r = simulate("oktopk", 4, n, d, AB, gamma, cores=2, step=2)
    assert r.cores == 2 and r.as_dict()["cores"] == 2
    assert sum(r.breakdown().values()) == pytest.approx(r.seconds)
    # the α-β terms do not depend on it
    assert simulate("oktopk", 4, n, d, AB, cores=1).seconds == simulate("oktopk", 4, n, d, AB).seconds


def test_token_bucket_lets_the_burst_through_after_idle_moments():
    n, d = 25_200_000, 0.001
    k = math.ceil(d * n)
    msg = BlockedIndices(n).nbytes(k) + 4 * k           # one (index, value) message: 152,740 B
    plain = AlphaBeta(0.0, 125e6)
    deep = AlphaBeta(0.0, 125e6, burst=10 * msg)
    # a bucket deeper than the whole step: every byte passes at once, only local work is left
    assert simulate("topk", 4, n, d, deep).seconds == 0.0
    assert simulate("topk", 4, n, d, deep, 1e-9).seconds == pytest.approx(1e-9 * 4 * k, rel=1e-9)
    # back-to-back ring rounds: the bucket helps the first round only
    b = 128 * 1024
    ring = AlphaBeta(0.0, 125e6, burst=b)
    r = simulate("topk", 4, n, d, ring)
    assert [x.free for x in r.rounds if x.messages] == [b, 0.0, 0.0]
    assert r.seconds == pytest.approx((3 * msg - b) / 125e6, rel=1e-12)
    assert r.seconds == pytest.approx(sum(x.seconds(ring) for x in r.rounds), rel=1e-12)
    # local work between rounds refills it at the link rate: gTop-k's merges after each tree round
    gamma = 1e-8                                         # a 2k merge: 504 us, 63 KB of tokens
    t = simulate("gtopk", 4, n, d, ring, gamma)
    tree = [x.free for x in t.rounds if x.phase == "reduction tree"]
    assert tree == [b, pytest.approx(min(b, gamma * 2 * k * 125e6))]
    # each round's latency refills it too (1 ms at 1 Gbit/s: 125 KB); a plain link has none, and
    # the bytes counted do not depend on it
    slow = AlphaBeta(1e-3, 125e6, burst=b)
    assert [x.free for x in simulate("dense", 3, n, d, slow).rounds] == [b] + [pytest.approx(125e3)] * 3
    assert all(x.free == 0.0 for x in simulate("oktopk", 4, n, d, plain, step=2).rounds)
    assert simulate("gtopk", 4, n, d, ring).bytes == simulate("gtopk", 4, n, d, plain).bytes
    assert str(ring) == "1gbit, 0 latency, 131072 B burst"
    assert AlphaBeta.from_strings("1gbit", "0", burst=b) == ring
    with pytest.raises(ValueError, match=r"burst=-1.*accepted"):
        AlphaBeta(0.0, 1e9, burst=-1)


@pytest.mark.parametrize("call,match", [
    (lambda: simulate("sparse", 4, N, DENSITY, AB), r"algorithm='sparse'.*accepted: .*'dense'"),
    (lambda: simulate("topk", 4, N, DENSITY, AB, cores=0), r"cores=0.*accepted.*None"),
    (lambda: simulate("topk", 4, N, DENSITY, AB, cores=1.5), r"cores=1.5.*accepted"),
    (lambda: simulate("topk", 0, N, DENSITY, AB), r"workers=0.*accepted"),
    (lambda: simulate("topk", 4, 2.5, DENSITY, AB), r"n=2.5.*accepted"),
    (lambda: simulate("topk", 4, N, 0.0, AB), r"density=0.0.*accepted.*\(0, 1\]"),
    (lambda: simulate("topk", 4, N, 1.5, AB), r"density=1.5"),
    (lambda: simulate("topk", 4, N, DENSITY, "1gbit"), r"ab='1gbit'.*AlphaBeta"),
    (lambda: simulate("topk", 4, N, DENSITY, AB, -1.0), r"gamma=-1.0.*accepted"),
    (lambda: simulate("topk", 4, N, DENSITY, AB, step=0), r"step=0.*accepted"),
    (lambda: simulate("oktopk", 4, N, DENSITY, AB, tau=0), r"tau=0.*accepted"),
    (lambda: simulate("oktopk", 4, N, DENSITY, AB, taux=3), r"taux=3.*accepted: tau, tau_prime"),
    (lambda: simulate("csc", 4, N, DENSITY, AB, chunk_selection="next"), r"chunk_selection='next'.*'current', 'previous'"),
])
def test_bad_arguments_name_argument_and_accepted_values(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- AlphaBeta and its measurement ------------------------------------------------------------

def test_alpha_beta_strings_and_time():
    ab = AlphaBeta.from_strings("1gbit", "50us")
    assert (ab.alpha, ab.beta) == (pytest.approx(50e-6), 125e6)
    assert AlphaBeta.from_strings("10gbit", "1ms") == AlphaBeta(1e-3, 1.25e9)
    assert AlphaBeta.from_strings("100mbit", "0").beta == 12.5e6
    assert parse_rate("2.5Gbit") == 2.5e9 / 8 and parse_time("250ns") == pytest.approx(250e-9)
    assert ab.time(0) == ab.alpha
    assert ab.time(125e6) == pytest.approx(1.0 + 50e-6)
    np.testing.assert_allclose(ab.time(np.array([0, 1250])), [50e-6, 60e-6])
    assert str(ab) == "1gbit, 50us latency"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ab.alpha = 0.0
    for bad, match in [(("1gbyte", "50us"), r"bandwidth='1gbyte'.*accepted.*gbit"),
                       (("0gbit", "50us"), r"bandwidth='0gbit'"),
                       (("1gbit", "50 fortnights"), r"latency='50 fortnights'.*accepted.*us"),
                       (("1gbit", "5"), r"latency='5'")]:
        with pytest.raises(ValueError, match=match):
            AlphaBeta.from_strings(*bad)
    with pytest.raises(ValueError, match=r"beta=0.*accepted"):
        AlphaBeta(1e-6, 0)
    with pytest.raises(ValueError, match=r"alpha=-1.*accepted"):
        AlphaBeta(-1, 1e9)
    with pytest.raises(ValueError, match="nbytes"):
        ab.time(-1)


def test_fit_alpha_beta():
    sizes = np.array([8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20, 16 << 20])
    true = AlphaBeta(20e-6, 1.25e8)
    got = fit_alpha_beta(sizes, true.time(sizes))
    assert got.alpha == pytest.approx(true.alpha, rel=1e-6) and got.beta == pytest.approx(true.beta, rel=1e-9)
    # a token bucket's burst: messages up to 256 KiB pass at 10x the rate; the bandwidth is
    # still the sustained one (fitted over the megabyte messages)
    burst = np.where(sizes <= 262144, true.alpha + sizes / 1.25e9, true.time(sizes))
    got = fit_alpha_beta(sizes, burst)
    assert got.beta == pytest.approx(true.beta, rel=1e-6) and got.alpha == pytest.approx(true.alpha, rel=0.05)
    # two sizes only: the slope between them; alpha never negative
    fallback = fit_alpha_beta([8, 1 << 20], [1e-9, 1e-3 + 1e-9 + 1e-6])
    assert fallback.alpha >= 0 and fallback.beta == pytest.approx((1 << 20) / 1e-3, rel=0.01)
    with pytest.raises(ValueError, match="do not grow"):
        fit_alpha_beta([8, 1 << 20], [1e-3, 1e-3])


@pytest.mark.parametrize("P", [2, 3])
def test_measure_alpha_beta_in_process(P):
    def fn(comm):
        ab = measure_alpha_beta(comm, sizes=(8, 4096, 1 << 20), repeats=3, warmup=1)
        return ab, comm.bytes_sent

    out = InProcessWorld(P, timeout=30).run(fn)
    assert all(ab == out[0][0] for ab, _ in out)  # the same on every rank
    assert out[0][0].alpha > 0 and out[0][0].beta > 0
    assert all(nbytes == 0 for _, nbytes in out)  # the ping-pong travels on a duplicate


def test_measure_alpha_beta_rejects_before_communicating():
    comm = InProcessWorld(1).comms[0]
    with pytest.raises(ValueError, match=r"at least 2 ranks \(comm.size=1\).*from_strings"):
        measure_alpha_beta(comm)
    # argument errors come first (a world of 2 whose ranks would otherwise wait for each other)
    comm2 = InProcessWorld(2, timeout=1).comms[0]
    for kwargs, match in [({"sizes": (8,)}, r"sizes=\(8,\).*accepted"), ({"sizes": (8, -1)}, "sizes="),
                          ({"repeats": 0}, r"repeats=0.*accepted"), ({"warmup": -1}, r"warmup=-1.*accepted")]:
        with pytest.raises(ValueError, match=match):
            measure_alpha_beta(comm2, **kwargs)
    with pytest.raises(ValueError, match=r"comm=.*Communicator"):
        measure_alpha_beta("world")


# -- the CLI ----------------------------------------------------------------------------------

TOOL = [sys.executable, str(REPO / "tools" / "simulate_network.py")]


@pytest.mark.parametrize("algorithm", ["gtopk", "oktopk"])
def test_cli_json(algorithm):
    done = subprocess.run(TOOL + ["--algorithm", algorithm, "--workers", "32", "--n", "25200000", "--density",
                                  "0.001", "--bandwidth", "1gbit", "--latency", "50us", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)  # exactly one JSON object
    want = simulate(algorithm, 32, 25_200_000, 0.001, AlphaBeta.from_strings("1gbit", "50us"))
    assert out["seconds"] == pytest.approx(want.seconds) and out["bytes"] == want.bytes
    assert (out["algorithm"], out["workers"], out["n"], out["density"], out["bandwidth"], out["latency"]) == \
        (algorithm, 32, 25_200_000, 0.001, "1gbit", "50us")
    text = subprocess.run(TOOL + ["--algorithm", algorithm, "--workers", "32"], capture_output=True, text=True,
                          timeout=60).stdout
    assert f"{algorithm}: P=32" in text and "ms per step" in text
    shared = json.loads(subprocess.run(TOOL + ["--algorithm", algorithm, "--workers", "4", "--gamma", "1e-7",
                                               "--cores", "2", "--burst", "131072", "--json"],
                                       capture_output=True, text=True, timeout=60).stdout)
    link = AlphaBeta.from_strings("1gbit", "50us", burst=131072)
    assert shared["cores"] == 2 and shared["burst_bytes"] == 131072 and shared["seconds"] == pytest.approx(
        simulate(algorithm, 4, 25_200_000, 0.001, link, 1e-7, cores=2).seconds)


@pytest.mark.parametrize("args,match", [
    (["--algorithm", "nope", "--workers", "4"], "invalid choice: 'nope'"),
    (["--algorithm", "topk", "--workers", "4", "--bandwidth", "fast"], "--bandwidth: bandwidth='fast'"),
    (["--algorithm", "topk", "--workers", "4", "--latency", "soon"], "--latency: latency='soon'"),
    (["--algorithm", "topk", "--workers", "-2"], "--workers: '-2' is not valid; accepted"),
    (["--algorithm", "topk", "--workers", "4", "--density", "2"], r"--density: '2' is not valid; accepted"),
    (["--algorithm", "topk", "--workers", "4", "--cores", "0"], "--cores: '0' is not valid; accepted"),
    (["--algorithm", "topk", "--workers", "4", "--burst", "-1"], "--burst: '-1' is not valid; accepted"),
    (["--workers", "4"], "--algorithm required"),
    (["--sweep", "--algorithm", "topk"], "--sweep"),
])
def test_cli_bad_arguments(args, match):
    done = subprocess.run(TOOL + args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and match in done.stderr, done.stderr


def test_cli_sweep(tmp_path):
    out = tmp_path / "sweep"
    done = subprocess.run(TOOL + ["--sweep", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert result["workers"][0] == 2 and result["workers"][-1] == 1024 and result["n"] == 25_200_000
    assert result["bandwidths"] == ["1gbit", "10gbit"]
    for bw in result["bandwidths"]:
        for name in ("dense", "topk", "gtopk", "oktopk"):
            c = result["curves"][bw][name]
            assert len(c["seconds"]) == len(result["workers"])
            i = result["workers"].index(256)
            want = simulate(name, 256, 25_200_000, 0.001, AlphaBeta.from_strings(bw, "50us"))
            assert c["seconds"][i] == pytest.approx(want.seconds) and c["bytes"][i] == want.bytes
    assert {p["algorithm"] for p in result["papers"]} == {"gtopk", "oktopk"}


def test_validation_tool_reprices_stored_measurements(tmp_path):
    """tools/validate_network_model.py --reanalyze: the model of stored runs, γ fitted at the
    smallest P so that the model gives its measured time, and used at the others."""
    n, d = 4_000_000, 0.01
    link = AlphaBeta(2e-5, 1.2e7, burst=128 * 1024)          # 100mbit's bucket (NetSpec.burst)
    labels = {"topk": ("topk", {}), "oktopk (re-evaluation steps)": ("oktopk", {"tau_prime": 1})}

    def cell(P, factor):
        return {"rate": "100mbit", "P": P, "alpha_s": link.alpha, "beta_bytes_per_s": link.beta,
                "rows": [{"algorithm": label, "measured_s": factor * simulate(name, P, n, d, link, 2e-8,
                                                                              step=2, **opts).seconds,
                          "measured_runs_s": [0.0]} for label, (name, opts) in labels.items()]}
    stored = tmp_path / "stored.json"
    stored.write_text(json.dumps({"n": n, "density": d, "steps": 8, "repeats": 1, "ring_pinned": True,
                                  "date": "2026-11-24", "machine": "the measuring one",
                                  "cells": [cell(2, 1.0), cell(3, 1.1)]}))
    done = subprocess.run([sys.executable, str(REPO / "tools" / "validate_network_model.py"), "--reanalyze",
                           str(stored)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(stored.read_text())
    assert out["model_burst"] and out["model_cores"] is None
    assert (out["date"], out["machine"]) == ("2026-11-24", "the measuring one")   # the measurements' own
    for fitted, predicted in zip(out["cells"][0]["rows"], out["cells"][1]["rows"]):
        assert fitted["calibration"] and fitted["gamma_s_per_element"] == pytest.approx(2e-8, rel=1e-6)
        assert predicted["ratio_gamma"] == pytest.approx(1.1, rel=1e-6)
        assert predicted["ratio"] > predicted["ratio_gamma"]            # the α-β terms alone: less time
    assert "outside 25 %" not in done.stdout and "(γ fitted here)" in done.stdout
