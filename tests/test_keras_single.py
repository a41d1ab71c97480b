"""Keras integration in one process (in-process communicator of size 1): API, validation, graph mode."""
import gc
import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import tfsparse  # noqa: E402
from fakes import NoTalk  # noqa: E402
from tfsparse.collectives import InProcessWorld  # noqa: E402
from tfsparse.keras import DistributedOptimizer  # noqa: E402


def solo():
    return InProcessWorld(1).comms[0]


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.random((n, 8), dtype=np.float32), rng.integers(0, 3, n)


def small_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("kwargs,match", [
    (dict(algorithm="bogus"), "algorithm='bogus' is not supported"),
    (dict(algorithm="topk", density=2), r"density=2 is not valid; accepted: a number in \(0, 1\]"),
])
def test_strategy_rejects_bad_input_before_communicating(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfsparse.SparseStrategy(communicator=solo(), **kwargs)
    with pytest.raises(ValueError, match=match):
        DistributedOptimizer(keras.optimizers.SGD(), communicator=solo(), **kwargs)


def test_optimizer_rejects_non_optimizer_and_non_float_variables():
    with pytest.raises(ValueError, match="inner_optimizer must be a keras.optimizers.Optimizer"):
        DistributedOptimizer("sgd", communicator=solo())
    opt = DistributedOptimizer(keras.optimizers.SGD(), communicator=solo())
    var = keras.Variable(np.zeros(3, "int32"), trainable=True, name="counts")
    with pytest.raises(ValueError, match="'counts' has dtype=int32"):
        opt.build([var])


def test_strategy_trains_in_graph_mode_without_retracing():
    strategy = tfsparse.SparseStrategy("topk", 0.2, communicator=solo())
    assert strategy.num_replicas_in_sync == 1
    traces = []
    engine = strategy.exchange.engine
    original = engine.build  # called by the TF glue once per trace of the exchange
    engine.__class__ = type("Spy", (type(engine),), {"build": lambda self, *a, **k: traces.append(1) or original(*a, **k)})
    with strategy:  # `with strategy:` works like strategy.scope()
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1), LOSS)
    x, y = data()
    hist = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert not model.run_eagerly
    traced = len(traces)
    assert 1 <= traced <= 2  # Keras' step function is traced up front, not per step
    assert strategy.exchange.total.steps == 12
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert len(traces) == traced and strategy.exchange.total.steps == 20


def test_jit_compile_gives_a_clear_error():
    strategy = tfsparse.SparseStrategy("topk", 0.2, communicator=solo())
    with strategy.scope():
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1), LOSS, jit_compile=True)
    x, y = data()
    with pytest.raises(ValueError, match="jit_compile=True is not supported"):
        model.fit(x, y, epochs=1, verbose=0)


def test_optimizer_config_roundtrip_and_delegation():
    inner = keras.optimizers.SGD(0.25, momentum=0.5)
    opt = DistributedOptimizer(inner, algorithm="dense", density=1.0, communicator=solo())
    cfg = opt.get_config()
    assert cfg["algorithm"] == "dense" and cfg["density"] == 1.0
    clone = DistributedOptimizer.from_config(cfg)
    assert isinstance(clone.inner_optimizer, keras.optimizers.SGD)
    assert clone.inner_optimizer.momentum == 0.5
    assert float(clone.learning_rate) == pytest.approx(0.25)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(again, DistributedOptimizer) and again.algorithm == "dense"
    opt.learning_rate = 0.125
    assert float(inner.learning_rate) == pytest.approx(0.125)


@pytest.mark.parametrize("selection", ["cost_model", {"alpha": 2e-4, "beta": 12.5e6, "comp_fixed": 1e-4,
                                                       "comp_per_element": 2e-9}])
def test_optimizer_config_keeps_selection_and_clip_norm(selection):
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1), algorithm="dragonn", density=0.01, plan=selection,
                               clip_norm=2.5, communicator=solo())
    cfg = opt.get_config()
    assert cfg["plan"] == selection and cfg["clip_norm"] == 2.5
    clone = DistributedOptimizer.from_config(cfg)
    assert clone.exchange.plan == opt.exchange.plan and clone.exchange.clip_norm == 2.5


def test_optimizer_route_single_process_matches_plain_keras_for_dense():
    x, y = data()
    keras.utils.set_random_seed(3)
    a = small_model()
    b = small_model()
    b.set_weights(a.get_weights())
    a.compile(DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), "dense", 1.0, communicator=solo()), LOSS)
    b.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    a.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    b.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=1e-6, atol=1e-7)


def test_communication_stats_callback_adds_logs():
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1), "topk", 0.25, communicator=solo())
    model = small_model()
    model.compile(opt, LOSS)
    x, y = data()
    hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                     callbacks=[tfsparse.keras.callbacks.CommunicationStats()])
    n = 8 * 3 + 3
    assert hist.history["density"] == [pytest.approx(np.ceil(0.25 * n) / n)] * 2
    assert hist.history["comm_bytes"] == [0.0, 0.0]  # one rank sends nothing
    for key in ("encode_ms", "comm_ms", "decode_ms", "wait_ms"):  # where the time of a step's exchange went
        assert len(hist.history[key]) == 2 and all(v >= 0 for v in hist.history[key])
    assert hist.history["encode_ms"][0] > 0


def test_launcher_builds_mpirun_command():
    from tfsparse.run import build_command

    import shutil

    cmd, env = build_command(4, ["python", "train.py"])
    assert cmd[1:3] == ["-np", "4"] and "--oversubscribe" in cmd and cmd[-1] == "train.py"
    # the program is resolved on the caller's PATH (mpirun would put its own bin/ first)
    assert cmd[-2] == shutil.which("python")
    assert "--bind-to" in cmd
    with pytest.raises(ValueError, match="-np 0"):
        build_command(0, ["python"])
    with pytest.raises(ValueError, match="no command"):
        build_command(2, [])


# -- one exchange per model, the same options everywhere ---------------------------------------

@pytest.mark.parametrize("kwargs,words", [
    (dict(wire_dtype="half"), ["wire_dtype='half' is not supported", "'float16'", "'bfloat16'", "'int8'"]),
    (dict(bucket_bytes=-1), ["bucket_bytes=-1", "integer >= 0"]),
    (dict(plan="layers"), ["plan='layers' is not supported", "'fused'", "'buckets'", "'per_tensor'"]),
    (dict(plan="per_tensor", bucket_bytes=64), ["bucket_bytes=64 only applies to plan='buckets'"]),
    (dict(algorithm="oktopk", tau_prime=0), ["tau_prime=0", ">= 1"]),
    (dict(algorithm="gtopk", tau=3), ["tau=3", "gtopk"]),
])
def test_same_options_everywhere_validated_before_communication(kwargs, words):
    for make in (lambda: tfsparse.SparseStrategy(communicator=NoTalk(3), **kwargs),
                 lambda: DistributedOptimizer(keras.optimizers.SGD(), communicator=NoTalk(3), **kwargs)):
        with pytest.raises(ValueError) as e:
            make()
        for w in words:
            assert w in str(e.value), str(e.value)


def test_distributed_optimizer_shares_or_brings_the_one_exchange():
    strategy = tfsparse.SparseStrategy("topk", 0.2, wire_dtype="float16", plan=0, communicator=solo())
    with strategy.scope():
        shared = DistributedOptimizer(keras.optimizers.SGD(0.1))
        assert shared.exchange is strategy.exchange and strategy.extended.saved_by_optimizer
        original = strategy.exchange
        own = DistributedOptimizer(keras.optimizers.SGD(0.1), "dense", 1.0, wire_dtype="bfloat16",
                                   communicator=solo())
    assert shared.algorithm == "topk" and shared.exchange.wire_dtype == "float16"
    # settings of its own: decided when the wrapper is built -- the strategy adopts its exchange
    assert own.exchange is not original and own.exchange.wire_dtype == "bfloat16"
    assert strategy.exchange is own.exchange
    x, y = data()
    with strategy.scope():
        model = small_model()
        model.compile(own, LOSS)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert own.exchange.total.steps == 4 and original.total.steps == 0  # the model's one exchange
    assert [s.name for s in own.exchange.layout.specs] == [v.path for v in model.trainable_variables]


def test_layout_plan_and_names_captured_at_trace_time():
    strategy = tfsparse.SparseStrategy("topk", 0.2, plan=64, communicator=solo())
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1), LOSS)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    ex = strategy.exchange
    assert [s.name for s in ex.layout.specs] == [v.path for v in model.trainable_variables]
    assert [s.shape for s in ex.layout.specs] == [(8, 6), (6,), (6, 3), (3,)]
    # lazy allreduce, last layer first: (6,3)+(3,) = 84 B >= 64; (6,) alone is 24 B; then (8,6)
    assert [(b.first, b.last) for b in ex.buckets] == [(2, 4), (0, 2)]
    assert ex.total.steps == 4 and ex.residual.shape == (8 * 6 + 6 + 6 * 3 + 3,)


def test_momentum_correction_refuses_an_optimizer_with_momentum():
    """memory='momentum' applies the momentum in the exchange: an optimizer with momentum of
    its own is refused (ValueError): at construction for the wrapper, when the step is traced
    (before any exchange) for the strategy, which meets the optimizer only then."""
    with pytest.raises(ValueError, match=r"applied twice.*SGD\(momentum=0\.0\)"):
        DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), "topk", 0.2, memory="momentum",
                             communicator=NoTalk(3))
    strategy = tfsparse.SparseStrategy("topk", 0.2, memory="momentum", communicator=solo())
    with strategy.scope():
        model = small_model()
        model.compile(optimizer=keras.optimizers.Adam(), loss=LOSS)
    x, y = data()
    with pytest.raises(ValueError, match=r"applied twice.*beta_1="):
        model.fit(x, y, epochs=1, verbose=0)
    assert strategy.exchange.rounds_started == 0


def _fit_default_memory(route, optimizer, model_seed=0, **settings):
    """Two epochs of the two-layer model through ``route`` with ``optimizer`` (a factory, called
    inside the scope); returns (weights, optimizer, exchange)."""
    x, y = data()
    keras.utils.set_random_seed(model_seed)
    if route == "strategy":
        strategy = tfsparse.SparseStrategy(communicator=solo(), **settings)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])
            opt = optimizer()
            model.compile(opt, LOSS)
    else:
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])
        opt = optimizer()
        model.compile(DistributedOptimizer(opt, communicator=solo(), **settings), LOSS)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return [w.copy() for w in model.get_weights()], opt, tfsparse.keras.ownership.exchange_of(model)


@pytest.mark.parametrize("route, policy", [("strategy", "float32"), ("optimizer", "float32"),
                                           ("strategy", "mixed_float16")])
def test_the_default_memory_keeps_the_velocity_of_an_embedding(route, policy):
    """``memory="auto"`` under ``SGD(lr, momentum=m)`` is ``"momentum_rows"``: the Embedding's
    gradient (a ``tf.IndexedSlices``, also unscaled under mixed precision's loss scaling) is marked
    row-sparse in the layout, its elements are the span the memory keeps the velocity of, and the
    training differs from DGC's masking everywhere (``memory="momentum"``, ``SGD(lr)``), which
    masks it too."""
    x = np.random.default_rng(0).integers(0, 40, (64, 6)).astype("int32")
    y = (x[:, 0] % 3).astype("int32")

    def fit(optimizer, **settings):
        keras.utils.set_random_seed(0)
        layers = [keras.Input((6,), dtype="int32"), keras.layers.Embedding(40, 4),
                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)]
        if route == "strategy":
            strategy = tfsparse.SparseStrategy("topk", 0.2, communicator=solo(), **settings)
            with strategy.scope():
                model = keras.Sequential(layers)
                model.compile(optimizer(), LOSS)
        else:
            model = keras.Sequential(layers)
            model.compile(DistributedOptimizer(optimizer(), "topk", 0.2, communicator=solo(), **settings), LOSS)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return model.get_weights(), tfsparse.keras.ownership.exchange_of(model)

    keras.mixed_precision.set_global_policy(policy)
    try:
        auto, ex = fit(lambda: keras.optimizers.SGD(0.1, momentum=0.9))
        masked, _ = fit(lambda: keras.optimizers.SGD(0.1), memory="momentum", momentum=0.9)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert ex.settings.memory == "momentum_rows"
    assert [spec.rows for spec in ex.layout.specs] == [True, False, False]  # embeddings, kernel, bias
    (bucket,) = ex.bucket_states
    assert bucket.memory.rows == ((0, 160),)  # the 40x4 embedding's elements
    assert not np.array_equal(auto[0], masked[0])


@pytest.mark.parametrize("route", ["strategy", "optimizer"])
@pytest.mark.parametrize("algorithm", ["topk", "gtopk", "oktopk", "dgc"])
def test_the_default_memory_takes_over_the_momentum_of_sgd(route, algorithm):
    """``memory="auto"`` (the default) with ``SGD(lr, momentum=m)`` and a sparse algorithm is
    momentum correction with factor m, the optimizer applying its update without momentum: bit
    for bit what ``memory="momentum", momentum=m`` with ``SGD(lr)`` gives.  The user's optimizer
    keeps its settings (``momentum``, its config); its momentum variables stay zero."""
    auto, sgd, ex = _fit_default_memory(route, lambda: keras.optimizers.SGD(0.1, momentum=0.8),
                                        algorithm=algorithm, density=0.2)
    pinned, _, pinned_ex = _fit_default_memory(route, lambda: keras.optimizers.SGD(0.1), algorithm=algorithm,
                                               density=0.2, memory="momentum", momentum=0.8)
    for a, b in zip(auto, pinned):
        np.testing.assert_array_equal(a, b)
    assert ex.settings.memory == "momentum_rows" and ex.settings.momentum == pytest.approx(0.8) and ex.takes_momentum
    assert ex.config()["memory"] == "auto" and ex.config()["momentum"] is None  # what was given: saved as such
    assert ex.get_state()["velocity"].any()
    np.testing.assert_array_equal(ex.get_state()["velocity"], pinned_ex.get_state()["velocity"])
    assert sgd.momentum == 0.8 and sgd.get_config()["momentum"] == 0.8
    assert sgd.momentums and not any(np.any(m.numpy()) for m in sgd.momentums)


@pytest.mark.parametrize("route", ["strategy", "optimizer"])
@pytest.mark.parametrize("optimizer, algorithm", [
    (lambda: keras.optimizers.Adam(0.01), "topk"),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.8, nesterov=True), "gtopk"),
    (lambda: keras.optimizers.RMSprop(0.01, momentum=0.5), "topk"),
    (lambda: keras.optimizers.SGD(0.1), "topk"),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.8), "dense")])
def test_the_default_memory_is_error_feedback_otherwise(route, optimizer, algorithm):
    """Any other optimizer (Adam, Nesterov, RMSprop's momentum, no momentum), or a dense
    exchange, keeps its own momentum: ``memory="auto"`` is ``"residual"``, bit for bit."""
    auto, opt, ex = _fit_default_memory(route, optimizer, algorithm=algorithm, density=0.2)
    pinned, _, _ = _fit_default_memory(route, optimizer, algorithm=algorithm, density=0.2, memory="residual")
    for a, b in zip(auto, pinned):
        np.testing.assert_array_equal(a, b)
    assert ex.settings.memory == "residual" and not ex.takes_momentum
    assert not getattr(opt, "_tfsparse_momentum_in_exchange", False)


def test_an_exchange_used_without_an_optimizer_keeps_error_feedback():
    """``memory="auto"`` on an exchange that never meets an optimizer (the numpy API) is error
    feedback."""
    ex = tfsparse.exchange.GradientExchange("topk", 0.25, communicator=solo())
    ex.exchange_numpy([np.arange(8, dtype=np.float32)])
    assert ex.settings.memory == "residual" and ex.requested.memory == "auto" and ex.residual.any()


def test_auto_measures_then_runs_its_choice_and_a_refit_inherits_it(capsys):
    """``algorithm="auto"`` in one process: ten measured rounds (dense over float16), then the
    choice -- dense float32 for one rank, which has no link -- printed once; SGD's momentum is the
    exchange's (velocity kept).  A second fit with another trainable set runs the same choice
    without measuring again."""
    from tfsparse import auto

    x, y = data(256)
    strategy = tfsparse.SparseStrategy("auto", communicator=solo())
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    ex = strategy.exchange
    assert ex.auto_choice == auto.CANDIDATES[0] and ex.auto_decision.link is None
    assert ex.settings.algorithm == "dense" and ex.settings.memory == "momentum_rows" and ex.config()["algorithm"] == "auto"
    assert ex.get_state()["auto"].tolist() == [0] and ex.get_state()["velocity"].any()
    assert capsys.readouterr().out.count("algorithm='auto' chose dense over float32 for 1 ranks") == 1
    model.layers[0].trainable = False
    with strategy.scope():
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert strategy.exchange is not ex and strategy.exchange.auto_choice == auto.CANDIDATES[0]
    assert strategy.exchange.auto_decision is None and "chose" not in capsys.readouterr().out


def test_communication_stats_record_what_auto_runs_each_epoch(tmp_path):
    """CommunicationStats: ``wire_bits`` in the epoch logs (numbers: the progress bar and
    TensorBoard take them), the algorithm and wire of each epoch's end in the History fit returns,
    and both as TensorBoard text under ``log_dir/train`` -- here auto's measured rounds (dense over
    float16) fill epochs 0 and 1, and its choice for one rank (dense over float32) runs from round 10."""
    x, y = data(16)
    strategy = tfsparse.SparseStrategy("auto", communicator=solo())
    with strategy.scope():
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    stats = tfsparse.keras.callbacks.CommunicationStats(log_dir=tmp_path)
    hist = model.fit(x, y, batch_size=4, epochs=3, verbose=2, callbacks=[stats, keras.callbacks.TensorBoard(tmp_path)])
    assert hist.history["comm_algorithm"] == ["dense"] * 3
    assert hist.history["wire"] == ["float16", "float16", "float32"]
    assert hist.history["wire_bits"] == [16.0, 16.0, 32.0]
    assert len(hist.history["loss"]) == 3
    events = list((tmp_path / "train").glob("events.out.tfevents.*"))
    assert len(events) >= 2 and all(e.stat().st_size > 0 for e in events)  # Keras' scalars and our text
    hist = model.fit(x, y, batch_size=4, epochs=0, verbose=0, callbacks=[stats])  # no epoch: nothing added
    assert "comm_algorithm" not in hist.history


def test_momentum_correction_and_warmup_in_fit():
    strategy = tfsparse.SparseStrategy("csc", 0.3, chunk_size=4, memory="momentum", momentum=0.8,
                                       communicator=solo())
    with strategy.scope():
        model = small_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    x, y = data()
    schedule = tfsparse.keras.callbacks.DensitySchedule(tfsparse.WarmUp(epochs=1))
    hist = model.fit(x, y, epochs=2, batch_size=16, verbose=0,
                     callbacks=[schedule, tfsparse.keras.callbacks.CommunicationStats()])
    ex = strategy.exchange
    assert ex.schedule.steps == 4 and ex.schedule.target == 0.3 and ex.rounds_started == 8
    # 27 weights in 7 chunks of 4 (the last one short): at 0.3, k = 9 -> 3 chunks, 11 or 12 values
    assert hist.history["density"][0] > 0.6 and 11 / 27 <= hist.history["density"][1] <= 12 / 27
    assert ex.get_state()["velocity"].any()
    assert hist.history["loss"][-1] < hist.history["loss"][0]


def test_optimizer_config_carries_every_option():
    opt = DistributedOptimizer(keras.optimizers.SGD(0.25), "oktopk", 0.05, wire_dtype="int8", plan=4096,
                               tau=16, communicator=solo())
    cfg = opt.get_config()
    assert {k: cfg[k] for k in ("algorithm", "density", "wire_dtype", "plan")} == \
        {"algorithm": "oktopk", "density": 0.05, "wire_dtype": "int8", "plan": 4096}
    assert cfg["algorithm_options"] == {"tau": 16}
    assert cfg["memory"] == "auto" and cfg["momentum"] is None  # as given; decided when the optimizer is known
    mc = DistributedOptimizer(keras.optimizers.SGD(0.25), "csc", 0.1, memory="momentum", momentum=0.8, chunk_size=64,
                              communicator=solo())
    again = keras.optimizers.deserialize(keras.optimizers.serialize(mc))
    assert again.exchange.config() == mc.exchange.config()
    assert again.exchange.config()["momentum"] == 0.8 and again.exchange.memory == "momentum"
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert again.exchange.config() == opt.exchange.config()


def test_load_model_after_import_tfsparse_keras(tmp_path):
    """A model file with a DistributedOptimizer loads in a fresh process that only did
    ``import keras, tfsparse.keras`` (tfsparse's Keras classes register themselves at import of
    tfsparse.keras, the documented way)."""
    import json
    import subprocess
    import sys

    model = small_model()
    model.compile(DistributedOptimizer(keras.optimizers.SGD(0.1), "topk", 0.25, communicator=solo()), LOSS)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = tmp_path / "distributed.keras"
    model.save(path)
    np.save(tmp_path / "weights.npy", np.concatenate([w.ravel() for w in model.get_weights()]))
    code = ("import json, sys, numpy as np\n"
            "import keras, tfsparse.keras\n"
            f"m = keras.models.load_model({str(path)!r})\n"
            "w = np.concatenate([v.ravel() for v in m.get_weights()])\n"
            "print(json.dumps({'cls': type(m.optimizer).__module__ + '.' + type(m.optimizer).__name__,\n"
            "  'algorithm': m.optimizer.algorithm, 'density': m.optimizer.get_config()['density'],\n"
            "  'inner': type(m.optimizer.inner_optimizer).__name__, 'weights': w.tolist()}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["cls"] == "tfsparse.keras.optimizer.DistributedOptimizer"
    assert (got["algorithm"], got["density"], got["inner"]) == ("topk", 0.25, "SGD")
    np.testing.assert_array_equal(np.float32(got["weights"]), np.load(tmp_path / "weights.npy"))


def test_mixed_precision_keeps_the_wrapper_and_the_callbacks_find_its_exchange():
    """Under mixed_float16 Keras does not wrap DistributedOptimizer again (it is a
    LossScaleOptimizer): it scales the loss itself, and CommunicationStats / DensitySchedule
    find the exchange -- also through any wrapper exposing inner_optimizer."""
    previous = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        opt = DistributedOptimizer(keras.optimizers.SGD(0.1), "topk", 0.25, communicator=solo())
        model = small_model()
        model.compile(opt, LOSS)
        assert model.optimizer is opt and opt.loss_scale
        x, y = data()
        hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
            tfsparse.keras.callbacks.DensitySchedule(lambda epoch: 0.5 if epoch == 0 else 0.25),
            tfsparse.keras.callbacks.CommunicationStats()])
        assert len(hist.history["density"]) == 2 and hist.history["density"][0] > hist.history["density"][1]
        assert float(opt.dynamic_scale.numpy()) == 2.0 ** 15  # no overflow here: the scale was kept
        outer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        outer.inner_optimizer.exchange = opt.exchange  # any wrapper chain exposing inner_optimizer
        holder = type("M", (), {"optimizer": outer})()
        assert tfsparse.keras.ownership.exchange_of(holder) is opt.exchange
    finally:
        keras.mixed_precision.set_global_policy(previous)


def test_strategy_turns_off_tf_data_autotuning_unless_the_user_chose():
    """The autotuner's thread made epoch boundaries stall for seconds (tfsparse.data.without_autotune):
    every dataset the strategy distributes -- the one ``fit`` builds from arrays included -- has it
    off, and a dataset whose options set ``autotune.enabled`` keeps the user's choice."""
    strategy = tfsparse.SparseStrategy("topk", 0.5)
    plain = tf.data.Dataset.range(4)
    assert strategy.experimental_distribute_dataset(plain).options().autotune.enabled is False
    chosen = tf.data.Options()
    chosen.autotune.enabled = True
    assert strategy.experimental_distribute_dataset(plain.with_options(chosen)).options().autotune.enabled is True

    seen = []
    extended = strategy.extended
    original = extended._experimental_distribute_dataset
    extended._experimental_distribute_dataset = lambda ds, opts: seen.append(original(ds, opts)) or seen[-1]
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    model.fit(np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32), batch_size=4, epochs=1, verbose=0)
    assert seen and all(ds.options().autotune.enabled is False for ds in seen)


@pytest.mark.parametrize("algorithm", ["topk", "dense"])
def test_the_exchanged_gradient_is_the_decoded_vector_itself(algorithm):
    """Decoding straight into the tensor the optimizer applies: TensorFlow takes the bucket's
    aligned result vector as the output of the finishing op without copying it, and each tensor
    is a slice of it (the address an op downstream sees is inside the vector) -- where the slice
    starts and ends on 64 bytes, as TensorFlow requires for sharing memory."""
    from tfsparse.exchange import GradientExchange
    from tfsparse.pipelined import Pipelined
    from tfsparse.tf_glue import exchange_tensors

    ex = Pipelined(GradientExchange(algorithm, 0.01, communicator=InProcessWorld(1).comms[0]))
    seen = []

    def record(x):
        seen.append((x.__array_interface__["data"][0], x.nbytes))
        return np.int64(0)

    grads = [tf.random.normal([300, 400], seed=1), tf.random.normal([1024], seed=2)]

    @tf.function
    def step():
        out = exchange_tensors(ex, grads)
        return [tf.numpy_function(record, [o], tf.int64, stateful=True) for o in out]

    for _ in range(3):
        step()
        vectors = ex.engine.bucket_states[0].outputs._pool._buffers
        starts = [v.__array_interface__["data"][0] for v in vectors]
        for address, nbytes in seen[-2:]:
            assert any(s <= address and address + nbytes <= s + v.nbytes for s, v in zip(starts, vectors))
    assert len(vectors) <= 3  # reused, not one per step


@pytest.mark.parametrize("algorithm,density", [("gtopk", 0.01), ("topk", 0.01), ("oktopk", 0.01), ("dragonn", 0.01),
                                               ("topk", 0.3)])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_an_optimizer_that_writes_the_result_vector_changes_no_later_result(algorithm, density, optimizer):
    """TensorFlow may write a result vector it was handed: an element-wise op whose input nothing
    else holds reuses that input's memory for its output -- Adam's ``gradient - m`` does, into the
    vector itself (a regression: results decoded by refilling only the last result's indices
    kept Adam's values elsewhere, and the ranks' weights drifted apart).  Every step's exchanged
    gradient, and so the weights Adam or SGD make of it, are the bits of the numpy exchange and
    an eager optimizer fed its results."""
    from tfsparse.exchange import GradientExchange
    from tfsparse.tf_glue import exchange_tensors

    make = {"adam": lambda: keras.optimizers.Adam(1e-3), "sgd": lambda: keras.optimizers.SGD(0.1)}[optimizer]
    ex_tf = GradientExchange(algorithm, density, communicator=InProcessWorld(1).comms[0])
    ex_np = GradientExchange(algorithm, density, communicator=InProcessWorld(1).comms[0])
    shapes = [(300, 400), (1024,)]
    src = [tf.Variable(np.zeros(s, np.float32)) for s in shapes]
    weights = [keras.Variable(np.zeros(s, np.float32)) for s in shapes]
    ref = [keras.Variable(np.zeros(s, np.float32)) for s in shapes]
    opt, ref_opt = make(), make()
    opt.build(weights)
    ref_opt.build(ref)

    @tf.function
    def step():
        opt.apply_gradients(zip(exchange_tensors(ex_tf, [g.read_value() for g in src]), weights))

    rng = np.random.default_rng(3)
    for i in range(6):
        values = [rng.standard_normal(s).astype(np.float32) * (1 + i) for s in shapes]
        values[0][:, :7] = -0.0
        for g, v in zip(src, values):
            g.assign(v)
        step()
        ref_opt.apply_gradients(zip([tf.constant(r) for r in ex_np.exchange_numpy(values)], ref))
        for a, b in zip(weights, ref):
            np.testing.assert_array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))
    np.testing.assert_array_equal(ex_tf.residual, ex_np.residual)


def test_rank_zero_only_refuses_keras_backup_and_restore(tmp_path):
    import keras

    import tfsparse.keras

    with pytest.raises(ValueError, match=r"tfsparse.keras.callbacks.BackupAndRestore\(backup_dir\) on every rank"):
        tfsparse.keras.callbacks.rank_zero_only(keras.callbacks.BackupAndRestore(str(tmp_path)))


def test_model_checkpoint_refuses_the_legacy_h5_format_that_would_lose_the_exchange_state(tmp_path):
    import tfsparse.keras

    for name in ("m.h5", "m.hdf5"):
        with pytest.raises(ValueError, match=r"filepath='.*m\.h5?d?f?5?': .*legacy HDF5 format.*holds no exchange state"
                                             r".*accepted: a path ending in '\.keras', or in '\.weights\.h5' with "
                                             r"save_weights_only=True"):
            tfsparse.keras.callbacks.ModelCheckpoint(str(tmp_path / name))
    tfsparse.keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"))
    tfsparse.keras.callbacks.ModelCheckpoint(tmp_path / "m.weights.h5", save_weights_only=True)


@pytest.mark.parametrize("route", ["strategy", "optimizer"])
def test_a_model_and_its_exchange_are_freed_after_fit(route):
    """TensorFlow keeps, for the life of the process, the Python function of every
    ``tf.numpy_function`` traced (the glue holds the exchange weakly) and the closure of every
    custom gradient traced -- TF wraps the replica context's ``all_reduce``, through which Keras'
    optimizer reduces under a strategy, in one (the strategy's context wraps none where no tape
    records).  So a model, its strategy and its exchange -- every residual -- that nothing else
    holds are freed."""

    import weakref

    if route == "strategy":
        owner = tfsparse.SparseStrategy("topk", 0.2, communicator=solo())
        with owner.scope():
            model = small_model()
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    else:
        model = small_model()
        owner = DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), "topk", 0.2, communicator=solo())
        model.compile(owner, LOSS)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    gone = [weakref.ref(owner), weakref.ref(owner.exchange.engine), weakref.ref(model)]
    del owner, model
    gc.collect()
    assert [r() for r in gone] == [None, None, None]


def test_all_reduce_under_a_tape_keeps_its_gradient():
    """Under a recording tape (a synchronized BatchNormalization's moments) the replica context's
    ``all_reduce`` is TF's own, gradient and all: d(sum over ranks of 3x)/dx = P * 3."""
    strategy = tfsparse.SparseStrategy("dense", communicator=solo())
    x = tf.constant([1.0, -2.0])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.distribute.get_replica_context().all_reduce("sum", 3.0 * x)
        return y, tape.gradient(y, x)

    y, grad = strategy.run(step)
    np.testing.assert_array_equal(y.numpy(), [3.0, -6.0])
    np.testing.assert_array_equal(grad.numpy(), [3.0, 3.0])


def test_held_weakly_calls_through_a_weak_reference():
    from tfsparse.runtime import held_weakly

    class Owner:
        def twice(self, x):
            return 2 * x

    owner = Owner()
    call = held_weakly(owner.twice)
    assert call(4) == 8
    del owner
    gc.collect()
    with pytest.raises(RuntimeError, match="Owner.twice runs for an object that has been freed"):
        call(4)


def test_a_changed_trainable_set_gets_an_exchange_of_its_own_that_takes_the_shared_memory():
    """Freeze a layer and compile again: the next fit's gradients are another set, with an
    exchange of its own (the strategy's settings) that starts from the residual the first set
    left for the tensors both hold; unfreezing (with another optimizer) gives a third."""
    strategy = tfsparse.SparseStrategy("topk", 0.05, communicator=solo())
    x, y = data()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1), LOSS)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    first = strategy.exchange
    left = first.engine.get_state()["residual"]
    model.layers[0].trainable = False
    with strategy.scope():
        model.compile(keras.optimizers.Adam(1e-3), LOSS)
    carried = []
    from tfsparse.exchange import GradientExchange
    real = GradientExchange.carry_memory
    GradientExchange.carry_memory = lambda self, other: carried.append(real(self, other)) or carried[-1]
    try:
        model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0)
    finally:
        GradientExchange.carry_memory = real
    second = strategy.exchange
    assert second is not first and second.config() == first.config()
    assert [s.name for s in second.layout.specs] == [v.path for v in model.trainable_variables]
    assert carried == [[v.path for v in model.trainable_variables]]
    assert np.any(left[8 * 16 + 16:] != 0)  # the second layer's residual was there to carry
    model.layers[0].trainable = True
    with strategy.scope():
        model.compile(keras.optimizers.SGD(0.01), LOSS)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert strategy.exchange not in (first, second)


def test_an_optimizer_born_in_a_dead_ones_memory_gets_an_exchange_of_its_own(monkeypatch):
    """Compiled again with a new optimizer, the same trainable set is another set of gradients,
    with a new exchange that takes over the memory -- also when the new optimizer has the id()
    of one that died, as CPython often gives it (Adam after SGD): that once handed the dead
    optimizer's exchange to one rank while another made a new one, and the two hung.  Here
    every object has one id (the module's ``id`` replaced), so no set may be found by it."""
    from tfsparse.strategies import sparse_strategy

    monkeypatch.setattr(sparse_strategy, "id", lambda obj: 1, raising=False)
    strategy = tfsparse.SparseStrategy("topk", 0.05, communicator=solo())
    x, y = data()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(3)])
    used, carried = [], []
    real = sparse_strategy.GradientExchange.carry_memory
    monkeypatch.setattr(sparse_strategy.GradientExchange, "carry_memory",
                        lambda self, other: carried.append(real(self, other)) or carried[-1])
    for make in [lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.Adam(1e-3)] * 2:
        gc.collect()
        with strategy.scope():
            model.compile(make(), LOSS)
        model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0)
        assert all(strategy.exchange is not e for e in used), "a new optimizer ran an exchange of an earlier one"
        used.append(strategy.exchange)
    assert carried == [[v.path for v in model.trainable_variables]] * 3
    assert len(strategy.extended._sets) < len(used)  # the sets of the dead optimizers are dropped (at a trace)


def test_the_test_batches_of_evaluate_and_of_fits_validation_are_known_to_a_callback():
    """What MetricAverage compares across ranks (tfsparse._tf_private.keras_test_batches): the
    batches of the evaluation running -- evaluate's own, fit's validation's (not fit's training
    steps), the data's count where ``steps=`` asks for more -- and one test-batch callback per
    ``steps_per_execution`` group, the last group short."""
    from tfsparse._tf_private import keras_test_batches

    class Seen(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches, self.calls = [], []

        def on_test_begin(self, logs=None):
            self.batches.append(keras_test_batches())
            self.calls.append(0)

        def on_test_batch_end(self, batch, logs=None):
            self.calls[-1] += 1

    x, y = data(80)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1), LOSS, steps_per_execution=2)
    seen = Seen()
    model.fit(x, y, batch_size=16, epochs=1, validation_data=(x[:72], y[:72]), validation_batch_size=8,
              callbacks=[seen], verbose=0)  # 5 training steps, 9 validation batches
    model.evaluate(x[:56], y[:56], batch_size=8, callbacks=[seen], verbose=0)  # 7
    model.evaluate(tf.data.Dataset.from_tensor_slices((x[:24], y[:24])).batch(8), steps=10, callbacks=[seen],
                   verbose=0)  # 3 batches of data, 10 asked for
    assert seen.batches == [9, 7, 3]
    assert seen.calls == [5, 4, 2]  # ceil(batches / 2)
    assert keras_test_batches() is None  # no evaluate running


def test_the_batches_fit_runs_are_known_to_a_callback():
    """What StepCountCheck compares across ranks (tfsparse._tf_private.keras_fit_batches): the
    training batches per epoch -- the data's count where ``steps_per_epoch`` asks for more (Keras'
    loop stops there), ``steps_per_epoch`` where it asks for fewer."""
    from tfsparse._tf_private import keras_fit_batches

    class Seen(keras.callbacks.Callback):
        batches = []

        def on_train_begin(self, logs=None):
            self.batches.append((keras_fit_batches(), self.params["steps"]))

    x, y = data(64)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    for steps in (None, 6, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras: "Your input ran out of data" at steps_per_epoch=6
            model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=steps, callbacks=[Seen()], verbose=0)
    assert Seen.batches == [(4, 4), (4, 6), (3, 3)]
    assert keras_fit_batches() is None  # no fit running
