"""The two-level exchange (``hierarchical=True``) on in-process ranks grouped into hosts: each
host's sum (its ranks' gradients added up a binomial tree, a fixed order) goes through the algorithm as one worker
would, so the result equals the flat reference over the hosts' sums (tests/exchange_ref.py), on
every rank bit-identical; error feedback lives on each host's leader.  Real hosts over ssh:
tests/test_hosts_mpi.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from exchange_ref import reference_run, tree_sum
from test_exchange_pipeline import DENSITY, OPTIONS, STEPS, flat, grads_of
from test_exchange_pipeline import run as run_exchange
from tfsparse import hierarchy
from tfsparse.collectives import InProcessWorld
from tfsparse.exchange import GradientExchange
from tfsparse.settings import Settings

LAYOUTS = {"2x2": [0, 0, 1, 1], "3x2": [0, 0, 1, 1, 2, 2], "uneven": [0, 0, 0, 1, 2, 2],
           "5+1": [0, 0, 0, 0, 0, 1]}


def host_sums(hosts, step):
    """Each host's sum of its ranks' flat gradients in float32, up the binomial tree (the leader's)."""
    return [tree_sum([flat(grads_of(r, step)) for r, x in enumerate(hosts) if x == h]) for h in dict.fromkeys(hosts)]


def run(monkeypatch, hosts, algorithm, wire="float32", plan="fused", **kwargs):
    """The flat suite's in-process run (tests/test_exchange_pipeline.py) in two levels, the ranks
    on ``hosts`` (a host id per rank)."""
    monkeypatch.setattr(hierarchy, "host_ids", lambda comm: list(hosts))
    return run_exchange(len(hosts), algorithm, wire, plan, hierarchical=True, **kwargs)


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


@pytest.mark.parametrize("algorithm, form", [("topk", hierarchy.PIECES), ("gtopk", hierarchy.INDICES),
                                             ("oktopk", hierarchy.INDICES), ("dense", hierarchy.DENSE)])
def test_a_sparse_result_crosses_the_host_as_it_came_off_the_network(monkeypatch, algorithm, form):
    """Inside a host the leader shares a sparse result's indices and values (top-k's allgathered
    pieces, the tree's and Ok-Topk's summed indices) -- not the dense vector -- and each rank
    decodes it as the leader did: the same bits (the test above), the shared bytes a fraction of
    the gradient's."""
    notices = []
    receive = hierarchy.TwoLevel._notice
    monkeypatch.setattr(hierarchy.TwoLevel, "_notice", lambda self: notices.append(receive(self)) or notices[-1])
    hosts = LAYOUTS["2x2"]
    got = run(monkeypatch, hosts, algorithm)
    assert notices and {int(n[0]) for n in notices} == {form}
    n = got[0][0][0]["out"].size
    if form != hierarchy.DENSE:
        assert max(int(x[1]) for x in notices) < n // 2  # (Ok-Topk's first rounds: its initial thresholds)
    for s in range(STEPS):
        for r in range(len(hosts)):
            np.testing.assert_array_equal(got[r][0][s]["out"], got[0][0][s]["out"])


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
    # which transports say they form groups: MPI's and the in-process one, not Horovod's
    from tfsparse.collectives.horovod import HorovodCommunicator
    from tfsparse.collectives.mpi import MPICommunicator
    from tfsparse.collectives.inprocess import InProcessCommunicator

    assert MPICommunicator.forms_groups and InProcessCommunicator.forms_groups
    assert not HorovodCommunicator.forms_groups


@pytest.mark.parametrize("hosts, two_level", [([0, 0, 1, 1], True), ([0, 0, 1, 1], False), ([0, 1, 2, 3], False),
                                              ([0, 0, 0, 0], False)])
def test_auto_switches_to_two_levels_when_it_chooses_them(monkeypatch, capsys, hosts, two_level):
    """algorithm="auto": the measured rounds run flat; at the decision (here gTop-k forced, in two
    levels or not as the case says) every rank switches to the same setting -- forming the hosts'
    groups then -- and gets the same sums throughout; its line says which and how to pin it."""
    import dataclasses

    from tfsparse import auto, exchange_build

    for module in (hierarchy, exchange_build, auto):
        monkeypatch.setattr(module, "host_ids", lambda comm: list(hosts))
    real, index = auto.decide, next(i for i, c in enumerate(auto.CANDIDATES) if c.algorithm == "gtopk")
    offered = []

    def decide(*args, **kwargs):
        d = real(*args, **kwargs)
        offered.append((kwargs.get("two_level"), args[-1].hosts))
        return dataclasses.replace(d, index=index, two_level=two_level and len(set(hosts)) > 1, trial_rounds=0)
    monkeypatch.setattr(auto, "decide", decide)

    def fn(comm):
        rng = np.random.default_rng(comm.rank)
        ex = GradientExchange("auto", communicator=comm)
        out = []
        for _ in range(auto.MEASURE_ROUNDS + 2):
            out.append(flat(ex.exchange_numpy([rng.standard_normal(300).astype(np.float32)])))
            if len(out) == auto.MEASURE_ROUNDS:
                measured_flat = ex._two is None
        state = ex.get_state()
        ex.close()
        return out, ex.settings.hierarchical, ex.settings.algorithm, measured_flat, int(state["auto_two_level"][0])

    results = InProcessWorld(4).run(fn)
    expect = two_level and len(set(hosts)) > 1
    assert {r[1:] for r in results} == {(expect, "gtopk", True, int(expect))}
    layout = (len(set(hosts)), max(hosts.count(h) for h in hosts))
    assert offered == [(True, layout)] * 4
    for out, *_ in results:
        for a, ref in zip(out, results[0][0]):
            np.testing.assert_array_equal(a, ref)
    line = [x for x in capsys.readouterr().out.splitlines() if "algorithm='auto' chose" in x]
    assert len(line) == 1
    assert ("4 ranks on 2 hosts (two-level)" in line[0] and line[0].endswith("hierarchical=True")) == expect


def test_auto_prices_each_candidate_flat_and_in_two_levels():
    """Two levels where they are predicted shorter: a host's ranks share its link in the flat
    exchange, the hosts' leaders have it whole in two levels, which cost the sums and broadcasts
    inside the hosts."""
    from tfsparse import auto
    from tfsparse.collectives import AlphaBeta

    link, n = AlphaBeta.from_strings("1gbit", "50us"), 17_000_000
    local = np.zeros(len(auto.CANDIDATES))
    dense = auto.choose(n, 4, link, 0.17, local, sparse=False, hosts=(2, 2), two_level_s=0.06)
    assert dense.two_level and dense.candidate.algorithm == "dense"  # 34 MB across once, not 51 MB
    costly = auto.choose(n, 4, link, 0.17, local, sparse=False, hosts=(2, 2), two_level_s=5.0)
    assert not costly.two_level
    big = auto.choose(n, 1024, link, 0.17, local, hosts=(128, 8), two_level_s=0.2)
    assert big.two_level and big.predictions[big.index].comm_s < 0.5 * auto.choose(
        n, 1024, link, 0.17, local, hosts=(128, 8), two_level_s=100.0).predictions[0].comm_s
    one_host = auto.choose(n, 4, link, 0.17, local, hosts=(1, 4), two_level_s=0.0)
    assert not one_host.two_level
    # on one host no rank's traffic crosses a host's link: the measured link is each rank's whole
    # (at 1 Gbit/s, dense float16 measured 583-596 ms a step, predicted 590 ms; 2030 ms when the
    # four ranks were priced as sharing the link)
    assert [p.comm_s for p in one_host.predictions] == [p.comm_s for p in auto.choose(n, 4, link, 0.17, local).predictions]
    f16 = auto.CANDIDATES[auto.MEASURING]
    assert auto.predict(f16, n, 4, link, 0.17, 0.0, (2, 2)).comm_s > one_host.predictions[auto.MEASURING].comm_s
    assert auto.two_level_costs(n, 1) == 0.0 and auto.two_level_costs(n, 3) > auto.two_level_costs(n, 2) > 0


def test_in_two_levels_the_local_work_is_the_leaders_alone():
    """Ranks that share cores do their selection at once and it is priced that many times longer
    (auto.oversubscription); in two levels only each host's leader selects while the others wait
    quietly, so the two-level candidates are priced without the factor, the flat ones with it."""
    from tfsparse import auto
    from tfsparse.collectives import AlphaBeta

    link, n, busy = AlphaBeta.from_strings("1gbit", "50us"), 17_000_000, 2.0
    alone = np.full(len(auto.CANDIDATES), 0.04)
    d = auto.choose(n, 4, link, 0.1, alone * busy, hosts=(2, 2), two_level_s=0.01, busy=busy)
    flat = auto.choose(n, 4, link, 0.1, alone * busy, hosts=(2, 2), two_level_s=1e3, busy=busy)
    assert d.two_level and not flat.two_level
    assert {round(p.local_s, 6) for p in d.predictions} == {0.04}
    assert {round(p.local_s, 6) for p in flat.predictions} == {0.08}
    assert "local work x2" not in dataclasses.replace(d, busy=busy).describe(4, hosts=2)
    assert "local work x2" in dataclasses.replace(flat, busy=busy).describe(4, hosts=2)


def test_the_model_prices_a_sparse_share_by_its_pairs():
    """The timing model's broadcast inside a host: the float32 vector for a dense algorithm, at
    most hosts x k (value, index) pairs for a sparse one."""
    from tfsparse.collectives import AlphaBeta
    from tfsparse.timing import simulate_two_level

    ab, n = AlphaBeta.from_strings("1gbit", "50us"), 17_000_000
    dense = simulate_two_level("dense", 2, 2, n, 1.0, ab)["phases_s"]
    sparse = simulate_two_level("gtopk", 2, 2, n, 0.01, ab)["phases_s"]
    assert sparse["host sum"] == dense["host sum"]
    assert 0 < sparse["host broadcast"] < 0.1 * dense["host broadcast"]


def test_a_restored_two_level_choice_continues_bit_for_bit(monkeypatch):
    """auto's two-level choice is part of the state: an exchange restored from it (before its
    first round) forms the hosts' groups without measuring again and continues exactly as the
    saved one does; the measured rounds' memory became the host's, on its leader."""
    import dataclasses

    from tfsparse import auto, exchange, exchange_build

    hosts = [0, 0, 1, 1]
    for module in (hierarchy, exchange_build, auto):
        monkeypatch.setattr(module, "host_ids", lambda comm: list(hosts))
    real, index = auto.decide, next(i for i, c in enumerate(auto.CANDIDATES) if c.algorithm == "topk")
    monkeypatch.setattr(auto, "decide", lambda *a, **k: dataclasses.replace(real(*a, **k), index=index, two_level=True,
                                                                                         trial_rounds=0))

    def fn(comm):
        rng = np.random.default_rng(comm.rank)
        m = auto.MEASURE_ROUNDS + 1  # the measured rounds and the chosen one's first
        grads = [[rng.standard_normal(300).astype(np.float32)] for _ in range(m + 1)]
        ex = GradientExchange("auto", communicator=comm, memory="residual")
        for g in grads[:m]:
            ex.exchange_numpy(g)
        state, residual = ex.get_state(), ex.residual
        after = flat(ex.exchange_numpy(grads[m]))
        ex.close()
        again = GradientExchange("auto", communicator=comm, memory="residual")
        again.set_state(state)
        restored = flat(again.exchange_numpy(grads[m]))
        grouped = again.two_level is not None and again.settings.algorithm == "topk"
        again.close()
        return after, restored, grouped, residual

    results = InProcessWorld(4).run(fn)
    for after, restored, grouped, residual in results:
        assert grouped
        np.testing.assert_array_equal(restored, after)
        np.testing.assert_array_equal(after, results[0][0])
    assert not results[1][3].any() and not results[3][3].any() and results[0][3].any()  # leaders 0 and 2
