"""``algorithm="auto"``: the decision on synthetic inputs with known answers (link, compute,
layout -> choice), the settings it accepts, and the switch on the numpy API (the Keras routes:
tests/test_keras_single.py, tests/test_replicas_mpi.py, tests/test_resume_mpi.py)."""
import numpy as np
import pytest

from tfsparse import auto
from tfsparse.collectives import AlphaBeta
from tfsparse.settings import Settings

N = 17_000_000  # the digits MLP's gradient
NO_LOCAL = np.zeros(len(auto.CANDIDATES))


def local(f16=0.03, sparse=0.06):
    """Local work: the 16-bit wires' coding and the sparse selection (dense float32: none)."""
    return np.array([0.0 if c.algorithm == "dense" and c.wire_dtype == "float32" else
                     f16 if c.algorithm == "dense" else sparse for c in auto.CANDIDATES])


def chosen(link, compute=0.17, n=N, workers=4, costs=None):
    return auto.choose(n, workers, link, compute, local() if costs is None else costs).candidate


def test_a_slow_link_chooses_a_sparse_algorithm():
    for rate in ("100mbit", "1gbit"):
        c = chosen(AlphaBeta.from_strings(rate, "50us"))
        assert c.algorithm != "dense" and c.density == 0.01, rate


def test_a_fast_link_chooses_dense():
    assert chosen(AlphaBeta.from_strings("100gbit", "1us")) == auto.CANDIDATES[0]  # float32: no coding
    # 10 Gbit/s: float32's 68 MB cost more than the 16-bit wires' coding
    c = chosen(AlphaBeta.from_strings("10gbit", "20us"), costs=local(f16=0.01))
    assert c.algorithm == "dense" and c.wire_dtype in ("float16", "bfloat16")


def test_one_rank_or_a_small_model_chooses_dense_float32():
    assert chosen(None, workers=1) == auto.CANDIDATES[0]
    assert chosen(AlphaBeta.from_strings("1gbit", "50us"), n=5_000) == auto.CANDIDATES[0]


def test_long_compute_steps_make_the_epochs_count():
    """The same link: with a compute step far longer than the exchange, the sparse candidates'
    extra epochs cost more than dense's longer exchange saves."""
    link = AlphaBeta.from_strings("1gbit", "50us")
    assert chosen(link, compute=0.1).algorithm != "dense"
    assert chosen(link, compute=20.0).algorithm == "dense"


def test_the_choice_is_the_smallest_predicted_time_to_accuracy():
    link = AlphaBeta.from_strings("1gbit", "50us")
    d = auto.choose(N, 4, link, 0.2, local())
    scores = [p.score for p in d.predictions]
    assert scores[d.index] <= min(scores) * (1 + auto.TOLERANCE) and d.predictions[d.index].candidate == d.candidate
    assert all(s > min(scores) * (1 + auto.TOLERANCE) for s in scores[:d.index])
    for p in d.predictions:
        assert p.step_s == pytest.approx(0.2 + p.comm_s + p.local_s)
        assert p.score == pytest.approx(p.step_s * p.candidate.epochs)
    f16 = next(p for p in d.predictions if p.candidate.wire_dtype == "float16")
    f32 = d.predictions[0]
    assert f16.comm_s < 0.6 * f32.comm_s  # half the bytes on the wire
    text = d.describe(4)
    assert text.startswith("tfsparse: algorithm='auto' chose ") and "Pin it with algorithm=" in text
    assert "1gbit" in text and "dense over float16:" in text


def test_ties_go_to_the_earlier_candidate():
    assert auto.choose(1000, 1, None, 0.01, NO_LOCAL).index == 0
    # float16 predicted 2 % sooner than float32 (within the tolerance): float32
    costs = np.zeros(len(auto.CANDIDATES))
    link = AlphaBeta.from_strings("10gbit", "20us")
    f32, f16 = (auto.predict(auto.CANDIDATES[i], 1_000_000, 4, link, 0.1, 0.0) for i in (0, 2))
    costs[1] = costs[2] = f32.step_s / 1.02 - f16.step_s
    assert auto.choose(1_000_000, 4, link, 0.1, costs).index == 0
    costs[1] = costs[2] = f32.step_s / 1.10 - f16.step_s  # 10 % sooner: bfloat16 (the first of the two)
    assert auto.choose(1_000_000, 4, link, 0.1, costs).index == 1


def test_local_costs_are_measured_for_the_lossy_wires_and_the_selection():
    costs = auto.local_costs(200_000, 3)
    for c, t in zip(auto.CANDIDATES, costs):
        assert (t == 0.0) == (c.algorithm == "dense" and c.wire_dtype == "float32"), (c, t)


@pytest.mark.parametrize("kwargs,words", [
    (dict(algorithm="auto", pipeline=2), ["pipeline=2 with algorithm='auto'", "pin the algorithm"]),
    (dict(algorithm="auto", tau=3), ["algorithm='auto' takes no algorithm options", "tau"]),
    (dict(algorithm="autop"), ["algorithm='autop' is not supported", "'auto', "]),
])
def test_auto_refuses_what_it_cannot_choose(kwargs, words):
    with pytest.raises(ValueError) as err:
        Settings.of(**kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_auto_settings_keep_a_residual_and_take_momentum():
    s = Settings.of(algorithm="auto")
    assert s.keeps_residual and s.sparse_capable
    assert s.resolved(0.9).memory == "momentum" and s.resolved(None).memory == "residual"
    assert Settings.of(**s.config()) == s


def _forced(monkeypatch, algorithm):
    """``auto.decide`` measuring as usual (its collectives run) but choosing ``algorithm``."""
    real = auto.decide
    index = next(i for i, c in enumerate(auto.CANDIDATES) if c.algorithm == algorithm)

    def decide(*args, **kwargs):
        d = real(*args, **kwargs)
        return auto.Decision(index, d.compute_s, d.link, d.predictions)
    monkeypatch.setattr(auto, "decide", decide)


@pytest.mark.parametrize("api", ["step", "start"])
@pytest.mark.parametrize("choice", ["measured", "gtopk"])
def test_the_numpy_api_switches_at_the_decision(monkeypatch, api, choice):
    """``Pipelined.step`` and ``GradientExchange.start`` over two buckets: seven rounds dense over
    float16, then (at round 7, every rank) the choice, whose buckets replace the measured ones
    mid-run; every rank gets the same sums throughout and ends with the same settings."""
    from tfsparse.collectives import InProcessWorld
    from tfsparse.exchange import GradientExchange
    from tfsparse.pipelined import Pipelined

    if choice != "measured":
        _forced(monkeypatch, choice)

    def fn(comm):
        rng = np.random.default_rng(comm.rank)
        engine = GradientExchange("auto", plan=0, communicator=comm)  # a bucket per tensor
        ex = Pipelined(engine)
        out, densities = [], []
        for step in range(10):
            grads = [rng.standard_normal(300).astype(np.float32), rng.standard_normal(200).astype(np.float32)]
            summed = ex.step(grads) if api == "step" else engine.start(grads).wait()
            out.append(np.concatenate(summed))
            densities.append(engine.density)
            if step == auto.MEASURE_ROUNDS - 1:  # the measurements were taken between the rounds
                probe = engine._auto.probe
                measured = (probe.done, sorted(probe.times), [len(t) for t in probe.times.values()])
        state = engine.get_state()
        engine.close()
        return out, densities, engine.settings.config(), len(engine.bucket_states), state["auto"].tolist(), measured

    results = InProcessWorld(3).run(fn)
    out0, densities, settings, buckets, chosen, measured = results[0]
    assert densities[:7] == [1.0] * 7 and settings["algorithm"] != "auto" and buckets == 2
    assert measured == (len(auto.PROBES), [8, 1 << 20, 4 << 20], [3, 3, 4])  # rank 0's round trips
    assert [r[-1][0] for r in results] == [len(auto.PROBES)] * 3
    if choice != "measured":
        assert settings["algorithm"] == "gtopk" and densities[7:] == [0.01] * 3
    for out, d, s, b, c, _ in results:
        assert s == settings and c == chosen and b == buckets and d == densities
        for a, ref in zip(out, out0):
            np.testing.assert_array_equal(a, ref)


@pytest.mark.parametrize("memory, choice, kept", [("momentum", "gtopk", True), ("residual", "topk", True),
                                                  ("residual", "dense", False)])
def test_the_switch_keeps_the_memory_it_can(monkeypatch, memory, choice, kept):
    """The choice's buckets take over the measured ones' memory object -- residual, velocity and
    vectors, nothing copied or allocated -- where they use the same kind; dense float32 keeps
    none (it loses nothing), and the residual is dropped.  The result vectors are reused."""
    from tfsparse.exchange import GradientExchange

    _forced(monkeypatch, choice)
    engine = GradientExchange("auto", plan=0, memory=memory, **({"momentum": 0.9} if memory == "momentum" else {}))
    rng = np.random.default_rng(0)
    grads = lambda: [rng.standard_normal(300).astype(np.float32), rng.standard_normal(200).astype(np.float32)]
    for _ in range(auto.MEASURE_ROUNDS):
        engine.start(grads()).wait()
    before = list(engine.bucket_states)
    saved = engine.get_state()
    engine.prepare_round()
    assert engine.settings.algorithm == choice and engine.auto_choice.algorithm == choice
    for new, old in zip(engine.bucket_states, before):
        assert new is not old and new.outputs is old.outputs and (new.memory is old.memory) == kept
    after = engine.get_state()
    for key in ("residual", "velocity"):
        if key in saved and kept:
            np.testing.assert_array_equal(after[key], saved[key])
    assert kept or "residual" not in after
    engine.start(grads()).wait()
    engine.close()


def test_a_pinned_density_or_wire_is_not_auto():
    """A density or a wire given without an algorithm pins top-k (as before auto); given with
    ``algorithm="auto"`` it is refused: auto chooses them.  Auto's config round-trips."""
    assert Settings.of().algorithm == "auto"
    assert Settings.of(density=0.05).algorithm == "topk" and Settings.of(wire_dtype="float16").algorithm == "topk"
    for kwargs in (dict(density=0.05), dict(wire_dtype="int8")):
        with pytest.raises(ValueError, match="with algorithm='auto': auto chooses the algorithm, the density"):
            Settings.of(algorithm="auto", **kwargs)
        with pytest.raises(ValueError, match="with algorithm='auto'"):
            Settings.of(Settings.of(), **kwargs)
    from tfsparse.exchange import GradientExchange
    assert Settings.of(**GradientExchange("auto").config()) == Settings.of()


def test_without_momentum_correction_auto_stays_dense():
    """Under an optimizer whose momentum the exchange cannot take (Adam: error feedback), the
    sparse candidates' epochs are not known: auto chooses among the dense ones."""
    link = AlphaBeta.from_strings("100mbit", "50us")
    assert auto.choose(N, 4, link, 0.17, local()).candidate.algorithm != "dense"
    c = auto.choose(N, 4, link, 0.17, local(), sparse=False).candidate
    assert c.algorithm == "dense" and c.wire_dtype in ("float16", "bfloat16")


def test_a_noisy_median_falls_back_to_the_fastest_round_trips():
    """One slow 1 MiB round trip among few (a busy 2-core node) can hide the growth with the size
    in the medians; the fastest times still show the link, so auto measures it instead of giving up."""
    probe = auto.Probe(N)
    mib = 1 << 20
    # the first round trip of each size is untimed; 1 MiB's median 40 ms > 4 MiB's 35 ms
    probe.times = {8: [1.0, 50e-6, 60e-6], mib: [1.0, 9e-3, 40e-3, 41e-3], 4 * mib: [1.0, 34e-3, 35e-3, 36e-3]}
    ab = probe.fit()
    assert ab.beta == pytest.approx(3 * mib / (34e-3 - 9e-3))  # the minima's slope
    probe.times = {8: [1.0, 1e-3], mib: [1.0, 1e-3], 4 * mib: [1.0, 1e-3]}  # flat either way
    with pytest.raises(ValueError, match="do not grow"):
        probe.fit()


def test_a_decision_without_a_link_says_what_it_runs():
    kept = auto.Decision(auto.MEASURING, 0.1, None, ())
    assert "algorithm='auto' kept " in kept.describe(2) and "could not be measured" in kept.describe(2)
    other = next(i for i, c in enumerate(auto.CANDIDATES) if c.algorithm == "gtopk")
    assert "algorithm='auto' chose " in auto.Decision(other, 0.1, None, ()).describe(2)
