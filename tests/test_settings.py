"""Settings: defined once, validated once, serialised by config(); plan= is the one grouping
argument (bucket_bytes= / selection= are deprecated aliases that warn)."""
import warnings

import numpy as np
import pytest

from tfsparse.collectives import InProcessWorld
from tfsparse.exchange import GradientExchange
from tfsparse.pipelined import Pipelined
from tfsparse.plan import BucketPlan, FusedPlan, PerTensorPlan
from tfsparse.selection import CostModel, CostModelPlan
from tfsparse.settings import Settings

MODEL = CostModel(alpha=2e-4, beta=12.5e6, comp_fixed=1e-4, comp_per_element=2e-9)


@pytest.mark.parametrize("plan,expected,config", [
    (None, FusedPlan(), None),
    ("fused", FusedPlan(), None),
    (4096, BucketPlan(4096), 4096),
    (0, BucketPlan(0), 0),
    ("per_tensor", PerTensorPlan(), "per_tensor"),
    (BucketPlan(64), BucketPlan(64), 64),
])
def test_plan_takes_a_name_a_byte_threshold_or_a_plan(plan, expected, config):
    s = Settings.of(plan=plan)
    assert s.plan == expected and s.config()["plan"] == config
    assert Settings.of(**s.config()) == s  # the config makes the same settings again


@pytest.mark.parametrize("plan", ["cost_model", MODEL, MODEL.as_dict()])
def test_plan_takes_the_cost_model(plan):
    s = Settings.of(algorithm="dragonn", plan=plan)
    assert isinstance(s.plan, CostModelPlan)
    assert Settings.of(**s.config()).plan == s.plan


@pytest.mark.parametrize("alias,value,plan", [("bucket_bytes", 2000, BucketPlan(2000)),
                                              ("selection", "cost_model", CostModelPlan())])
def test_the_old_spellings_warn_and_mean_the_same(alias, value, plan):
    with pytest.warns(DeprecationWarning, match=rf"{alias}= is deprecated; use plan="):
        s = Settings.of(algorithm="dragonn", **{alias: value})
    assert s.plan == plan


def test_plan_buckets_with_bucket_bytes_is_one_plan():
    with pytest.warns(DeprecationWarning):
        assert Settings.of(plan="buckets", bucket_bytes=512).plan == BucketPlan(512)


@pytest.mark.parametrize("kwargs,words", [
    (dict(plan=1024, bucket_bytes=2048), ["plan=1024", "bucket_bytes=2048", "give one plan="]),
    (dict(algorithm="dragonn", selection="cost_model", bucket_bytes=64), ["selection='cost_model'", "bucket_bytes=64"]),
    (dict(plan=1.5), ["plan=1.5 is not supported", "a number of bytes", "'cost_model'"]),
    (dict(plan=-3), ["bucket_bytes=-3", "integer >= 0"]),
    (dict(algorithm="gtopk", plan="cost_model"), ["algorithm='gtopk'"]),
    (dict(pipeline=3), ["pipeline=3 is not supported", "1 (synchronous) or 2"]),
    (dict(clip_norm=0), ["clip_norm=0"]),
    (dict(memory="residual", momentum=0.5), ["momentum=0.5 needs memory='momentum'"]),
    (dict(momentum=0.5), ["momentum=0.5 needs memory='momentum'", "with memory='auto'"]),
    (dict(memory="ef"), ["memory='ef' is not supported", "'auto', 'momentum', 'momentum_rows', 'none', 'residual'"]),
    (dict(algorithm="oktopk", tau_prime=0), ["tau_prime=0"]),
    # a misspelt keyword: named with the nearest valid one, the settings and the algorithm's options
    (dict(algorithm="topk", desnity=0.1), ["desnity=0.1 is neither a setting nor an option of 'topk'",
                                           "did you mean desnity -> density?", "accepted settings: algorithm,",
                                           "options of 'topk': compressor"]),
    (dict(algorithm="oktopk", tua=3, wire="int8"), ["tua=3, wire='int8' are neither", "tua -> tau",
                                                    "wire -> wire_dtype", "options of 'oktopk': tau, tau_prime"]),
    (dict(algorithm="gtopk", balance_factor=2), ["balance_factor=2 is neither", "options of 'gtopk': none"]),
])
def test_bad_settings_name_the_argument(kwargs, words):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError) as err:
            Settings.of(**kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_one_settings_object_for_the_engine_and_its_keywords():
    s = Settings.of(algorithm="oktopk", density=0.05, wire_dtype="int8", plan=4096, tau=16)
    a = GradientExchange(settings=s)
    b = GradientExchange("oktopk", 0.05, wire_dtype="int8", plan=4096, tau=16)
    assert a.settings is s and b.settings == s and a.config() == b.config()
    assert s.config() == {"algorithm": "oktopk", "density": 0.05, "wire_dtype": "int8", "plan": 4096,
                          "memory": "auto", "momentum": None, "pipeline": 1, "clip_norm": None, "hierarchical": False,
                          "algorithm_options": {"tau": 16}}
    assert s.replace(density=0.1).density == 0.1 and s.density == 0.05
    assert Settings.of(s, density=0.2).options == {"tau": 16}


def test_auto_memory_is_decided_by_the_optimizers_momentum():
    """``memory="auto"`` (the default): momentum correction with the optimizer's factor for a
    sparse algorithm when there is momentum to take over, else error feedback; a pinned memory
    stays."""
    auto = Settings.of(algorithm="gtopk")
    assert auto.memory == "auto" and auto.momentum is None and auto.keeps_residual
    assert auto.resolved(0.8).memory == "momentum_rows" and auto.resolved(0.8).momentum == 0.8
    assert auto.resolved(None).memory == "residual" and auto.resolved(0.0).memory == "residual"
    assert auto.resolved(0.8).replace(algorithm="dense").memory == "momentum_rows"  # replace keeps what was decided
    assert Settings.of(algorithm="dense").resolved(0.8).memory == "residual"  # lossless: the optimizer's momentum
    assert not Settings.of(algorithm="dense").keeps_residual and Settings.of(algorithm="dense", wire_dtype="int8").keeps_residual
    pinned = Settings.of(memory="residual")
    assert pinned.resolved(0.8) is pinned


def test_momentum_defaults_with_momentum_correction_only():
    assert Settings.of(memory="momentum").momentum == 0.9
    assert Settings.of(memory="residual").momentum is None
    assert Settings.of(memory="momentum", momentum=0.8).replace(memory="residual").momentum is None


def test_pipelined_state_set_before_the_build_keeps_the_pending_result():
    """A state with ``pending`` restored into a fresh Pipelined exchange before its first step:
    the first step applies exactly the saved pending result (held, then taken)."""
    def fn(comm):
        grads = [np.full(6, comm.rank + 1.0, np.float32)]
        live = Pipelined(GradientExchange("dense", 1.0, pipeline=2, communicator=comm))
        live.step(grads)
        state = live.get_state()
        fresh = Pipelined(GradientExchange("dense", 1.0, pipeline=2, communicator=comm))
        fresh.set_state(state)
        assert fresh.get_state().keys() == state.keys()  # before the build: kept whole
        applied = fresh.step(grads)[0]
        live.close()
        fresh.close()
        return state["pending"], applied

    for pending, applied in InProcessWorld(3).run(fn):
        np.testing.assert_array_equal(pending, np.full(6, 6.0, np.float32))
        np.testing.assert_array_equal(applied, pending)


def test_the_options_are_a_read_only_value():
    """Settings.options: equal to a dict of its items, refused writes, copies and pickles that
    stay equal, and replace() for a changed copy."""
    import copy
    import pickle

    s = Settings(algorithm="oktopk", density=0.01, options={"tau": 8})
    assert s.options == {"tau": 8} and {"tau": 8} == s.options and dict(s.options) == {"tau": 8}
    with pytest.raises(TypeError):
        s.options["tau"] = 4
    with pytest.raises(AttributeError, match="read-only; make changed settings with Settings.replace"):
        s.options._items = {}
    for twin in (copy.copy(s), copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        assert twin.options == s.options and twin.config() == s.config()
    changed = s.replace(options={**s.options, "tau": 4})
    assert changed.options == {"tau": 4} and s.options == {"tau": 8} and repr(s.options) == "{'tau': 8}"
