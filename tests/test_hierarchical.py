"""The two-level exchange (``hierarchical=True``) on in-process ranks grouped into hosts: each
host's sum (its ranks' gradients added in rank order) goes through the algorithm as one worker
would, so the result equals the flat reference over the hosts' sums (tests/exchange_ref.py), on
every rank bit-identical; error feedback lives on each host's leader.  Real hosts over ssh:
tests/test_hosts_mpi.py."""
from __future__ import annotations

import numpy as np
import pytest

from exchange_ref import reference_run
from test_exchange_pipeline import DENSITY, OPTIONS, PLANS, STEPS, flat, grads_of
from tfsparse import hierarchy
from tfsparse.collectives import InProcessWorld
from tfsparse.exchange import GradientExchange
from tfsparse.settings import Settings

LAYOUTS = {"2x2": [0, 0, 1, 1], "3x2": [0, 0, 1, 1, 2, 2], "uneven": [0, 0, 0, 1, 2, 2]}


def host_sums(hosts, step):
    """Each host's sum of its ranks' flat gradients, in rank order, in float32 (the leader's)."""
    out = []
    for h in dict.fromkeys(hosts):
        ranks = [r for r, x in enumerate(hosts) if x == h]
        total = flat(grads_of(ranks[0], step)).astype(np.float32)
        for r in ranks[1:]:
            total += flat(grads_of(r, step))
        out.append(total)
    return out


def run(monkeypatch, hosts, algorithm, wire="float32", plan="fused", **kwargs):
    monkeypatch.setattr(hierarchy, "host_ids", lambda comm: list(hosts))

    def fn(comm):
        ex = GradientExchange(algorithm, DENSITY, wire_dtype=wire, communicator=comm, hierarchical=True,
                              **PLANS[plan], **OPTIONS.get(algorithm, {}), **kwargs)
        steps = []
        for s in range(STEPS):
            before = ex.total.bytes_sent
            out = ex.exchange_numpy(grads_of(comm.rank, s))
            steps.append({"out": flat(out), "residual": ex.residual, "bytes": ex.total.bytes_sent - before,
                          "infos": [dict(getattr(a, "last_info", {})) for a in ex.aggregators]})
        ex.close()
        return steps, [(b.start, b.stop) for b in ex.buckets]

    return InProcessWorld(len(hosts), timeout=60).run(fn)


@pytest.mark.parametrize("plan", ["fused", "buckets"])
@pytest.mark.parametrize("wire", ["float32", "float16"])
@pytest.mark.parametrize("algorithm", ["dense", "topk", "gtopk", "oktopk"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_level_equals_the_flat_reference_over_the_hosts_sums(monkeypatch, layout, algorithm, wire, plan):
    hosts = LAYOUTS[layout]
    got = run(monkeypatch, hosts, algorithm, wire, plan)
    leaders = [hosts.index(h) for h in dict.fromkeys(hosts)]
    buckets = got[0][1]
    grads = [host_sums(hosts, s) for s in range(STEPS)]
    infos = [got[0][0][s]["infos"] for s in range(STEPS)]
    want = reference_run(algorithm, wire, buckets, grads, DENSITY, infos, OPTIONS.get(algorithm))
    for s in range(STEPS):
        result, residuals = want[s]
        for r in range(len(hosts)):
            step = got[r][0][s]
            np.testing.assert_array_equal(step["out"], got[0][0][s]["out"])  # bit-identical on every rank
            np.testing.assert_allclose(step["out"], result, rtol=2e-5, atol=2e-5)
            np.testing.assert_array_equal(np.flatnonzero(step["out"]), np.flatnonzero(result))
            if r in leaders and residuals is not None:  # error feedback per host, on its leader
                np.testing.assert_allclose(step["residual"], residuals[leaders.index(r)], rtol=2e-5, atol=2e-5)
            elif step["residual"] is not None:
                assert not step["residual"].any()  # the others keep none
            if r not in leaders:
                assert step["bytes"] == 0  # only the leaders' traffic crosses hosts


def test_one_rank_per_host_is_the_flat_exchange(monkeypatch):
    flat_run = run(monkeypatch, [0, 1, 2], "gtopk")
    monkeypatch.setattr(hierarchy, "host_ids", lambda comm: [0, 1, 2])

    def fn(comm):
        ex = GradientExchange("gtopk", DENSITY, communicator=comm)
        return [flat(ex.exchange_numpy(grads_of(comm.rank, s))) for s in range(STEPS)]

    plain = InProcessWorld(3).run(fn)
    for r in range(3):
        for s in range(STEPS):
            np.testing.assert_array_equal(flat_run[r][0][s]["out"], plain[r][s])


def test_momentum_correction_runs_on_the_hosts_sums(monkeypatch):
    """memory='momentum': the velocity of each host's sum, on its leader (DGC §3.2 per host)."""
    from exchange_ref import momentum_reference

    hosts = LAYOUTS["2x2"]
    got = run(monkeypatch, hosts, "topk", memory="momentum", momentum=0.9)
    want = momentum_reference("topk", [host_sums(hosts, s) for s in range(STEPS)], DENSITY)
    for s in range(STEPS):
        for r in range(4):
            np.testing.assert_allclose(got[r][0][s]["out"], want[s][0], rtol=2e-5, atol=2e-5)
            np.testing.assert_array_equal(got[r][0][s]["out"], got[0][0][s]["out"])


def test_hierarchical_is_a_setting():
    s = Settings.of(algorithm="gtopk", hierarchical=True)
    assert s.config()["hierarchical"] is True and Settings.of(**s.config()) == s
    assert Settings.of(algorithm="gtopk").hierarchical is False
    with pytest.raises(ValueError, match=r"hierarchical='yes'.*True.*False"):
        Settings.of(algorithm="gtopk", hierarchical="yes")


def test_split_groups_ranks_in_order():
    def fn(comm):
        part = comm.split(comm.rank % 2 if comm.rank < 4 else None)
        if part is None:
            return None
        return part.rank, part.size, [int(v[0]) for v in part.allgather(np.array([comm.rank]))]

    got = InProcessWorld(5).run(fn)
    assert got == [(0, 2, [0, 2]), (0, 2, [1, 3]), (1, 2, [0, 2]), (1, 2, [1, 3]), None]


@pytest.mark.parametrize("hosts, two_level", [([0, 0, 1, 1], True), ([0, 1, 2, 3], False), ([0, 0, 0, 0], False)])
def test_auto_goes_two_level_with_several_hosts_of_several_ranks(monkeypatch, capsys, hosts, two_level):
    """algorithm="auto": two-level where some host holds several ranks and there are several
    hosts; it measures and chooses as the hosts' leaders will run (the algorithm among the hosts:
    here gTop-k forced at the decision), every rank with the same sums throughout; its line says
    so and how to pin it."""
    from tfsparse import auto, exchange

    monkeypatch.setattr(hierarchy, "host_ids", lambda comm: list(hosts))
    monkeypatch.setattr(exchange, "host_ids", lambda comm: list(hosts))
    real, index = auto.decide, next(i for i, c in enumerate(auto.CANDIDATES) if c.algorithm == "gtopk")
    workers = []

    def decide(*args, **kwargs):
        workers.append(kwargs.get("workers"))
        d = real(*args, **kwargs)
        return auto.Decision(index, d.compute_s, d.link, d.predictions)
    monkeypatch.setattr(auto, "decide", decide)

    def fn(comm):
        rng = np.random.default_rng(comm.rank)
        ex = GradientExchange("auto", communicator=comm)
        out = [flat(ex.exchange_numpy([rng.standard_normal(300).astype(np.float32)])) for _ in range(9)]
        ex.close()
        return out, ex.settings.hierarchical, ex.settings.algorithm

    results = InProcessWorld(4).run(fn)
    assert {(h, a) for _, h, a in results} == {(two_level, "gtopk")}
    assert workers == [2 if two_level else 4] * 4
    for out, _, _ in results:
        for a, ref in zip(out, results[0][0]):
            np.testing.assert_array_equal(a, ref)
    line = [x for x in capsys.readouterr().out.splitlines() if "algorithm='auto' chose" in x]
    assert len(line) == 1
    assert ("4 ranks on 2 hosts (two-level)" in line[0] and line[0].endswith("hierarchical=True")) == two_level
