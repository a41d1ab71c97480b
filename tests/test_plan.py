"""Layouts and plans (tfsparse.plan): fused, GradientFlow's lazy-allreduce buckets, per tensor."""
import numpy as np
import pytest

from tfsparse.plan import (BucketPlan, FusedPlan, Layout, PerTensorPlan, TensorSpec, available_plans,
                           make_plan)

SHAPES = [(64, 32), (32,), (32, 10), (10,), (5, 5, 4)]


def layout():
    return Layout(TensorSpec(f"t{i}", s) for i, s in enumerate(SHAPES))


def test_layout_offsets_and_equality():
    lay = layout()
    assert lay.sizes.tolist() == [2048, 32, 320, 10, 100] and lay.n == 2510
    assert lay.offsets.tolist() == [0, 2048, 2080, 2400, 2410, 2510]
    same = Layout.of([np.zeros(s, np.float32) for s in SHAPES], names=[f"t{i}" for i in range(5)])
    assert same == lay and same.same_shapes(lay)
    assert Layout.of([np.zeros(s) for s in SHAPES]).same_shapes(lay)
    assert not Layout.of([np.zeros(s) for s in SHAPES[:4]]).same_shapes(lay)
    with pytest.raises(ValueError, match="at least one tensor"):
        Layout([])


def covers(buckets, lay):
    """Buckets are contiguous runs of whole tensors covering the layout, last tensors first."""
    order = sorted(buckets, key=lambda b: b.first)
    assert order[0].first == 0 and order[-1].last == len(lay)
    for a, b in zip(order, order[1:]):
        assert a.last == b.first
    for b in buckets:
        assert b.start == lay.offsets[b.first] and b.stop == lay.offsets[b.last] and b.size == b.stop - b.start
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert [b.first for b in buckets] == sorted((b.first for b in buckets), reverse=True)


def test_fused():
    (b,) = FusedPlan().buckets(layout())
    assert (b.first, b.last, b.start, b.stop) == (0, 5, 0, 2510)


@pytest.mark.parametrize("theta,want", [
    (0, [(4, 5), (3, 4), (2, 3), (1, 2), (0, 1)]),     # Horovod's threshold 0: no fusion
    (400, [(4, 5), (2, 4), (0, 2)]),                    # 400 B, 1320 B, then the rest
    (1500, [(2, 5), (0, 2)]),                           # 1720 B >= 1500, then 8320 B
    (10**9, [(0, 5)]),                                  # nothing reaches θ: one bucket
])
def test_lazy_allreduce_buckets(theta, want):
    """GradientFlow §3.1: tensors in back-propagation order (last first) are packed until the
    bucket holds at least θ bytes of float32 gradient."""
    lay = layout()
    buckets = BucketPlan(theta).buckets(lay)
    covers(buckets, lay)
    assert [(b.first, b.last) for b in buckets] == want
    for b in buckets[:-1]:  # every bucket but the last (first tensors) reaches θ
        assert 4 * b.size >= theta


def test_per_tensor_with_assignments():
    lay = layout()
    buckets = PerTensorPlan().buckets(lay)
    covers(buckets, lay)
    assert [b.first for b in buckets] == [4, 3, 2, 1, 0] and all(b.algorithm is None for b in buckets)
    plan = PerTensorPlan(lambda spec: {"algorithm": "dense"} if spec.size < 100 else
                         {"density": 0.5, "wire_dtype": "float16", "options": {"tau": 4}})
    got = {lay.specs[b.first].name: b for b in plan.buckets(lay)}
    assert got["t1"].algorithm == "dense" and got["t3"].algorithm == "dense"
    assert got["t0"].density == 0.5 and got["t0"].wire_dtype == "float16" and got["t0"].options == {"tau": 4}
    by_name = PerTensorPlan({"t0": {"algorithm": "gtopk"}}).buckets(lay)
    assert [b.algorithm for b in by_name] == [None, None, None, None, "gtopk"]
    with pytest.raises(ValueError, match="per-tensor overrides .*'k'.*accepted: algorithm, density"):
        PerTensorPlan(lambda spec: {"k": 3}).buckets(lay)
    with pytest.raises(ValueError, match="per-tensor overrides .*'k'"):  # a dict is checked at once
        PerTensorPlan({"t0": {"k": 3}})
    with pytest.raises(ValueError, match=r"assigns \['t9'\], which are not among the gradients"):
        PerTensorPlan({"t9": {"algorithm": "dense"}}).buckets(lay)


def test_make_plan_and_validation():
    assert available_plans() == ("fused", "buckets", "per_tensor")
    assert isinstance(make_plan(), FusedPlan) and isinstance(make_plan("fused"), FusedPlan)
    assert make_plan(bucket_bytes=1024) == BucketPlan(1024) == make_plan("buckets", 1024)
    assert isinstance(make_plan("per_tensor"), PerTensorPlan)
    plan = PerTensorPlan()
    assert make_plan(plan) is plan
    for kwargs, words in [
        ({"plan": "lazy"}, ["plan='lazy' is not supported", "'fused'", "'buckets'", "'per_tensor'"]),
        ({"bucket_bytes": -1}, ["bucket_bytes=-1", "integer >= 0"]),
        ({"bucket_bytes": 2.5}, ["bucket_bytes=2.5"]),
        ({"bucket_bytes": True}, ["bucket_bytes=True"]),
        ({"plan": "buckets"}, ["plan='buckets' needs bucket_bytes="]),
        ({"plan": "per_tensor", "bucket_bytes": 10}, ["bucket_bytes=10 only applies to plan='buckets'"]),
        ({"plan": FusedPlan(), "bucket_bytes": 10}, ["bucket_bytes=10 conflicts with plan=FusedPlan()"]),
    ]:
        with pytest.raises(ValueError) as e:
            make_plan(**kwargs)
        for w in words:
            assert w in str(e.value), str(e.value)


def test_a_plan_that_prepares_returns_the_plan_to_use():
    """A plan is a value: a Plan with ``prepares`` whose prepare() returns None (the old contract:
    fill itself in) is refused with a TypeError saying what prepare must return."""
    from tfsparse.collectives import InProcessWorld
    from tfsparse.exchange import GradientExchange

    class FillsItselfIn(FusedPlan):
        prepares = True

        def prepare(self, comm, exchange, layout):
            self.ready = True

    def fn(comm):
        ex = GradientExchange("topk", 0.5, plan=FillsItselfIn(), communicator=comm)
        with pytest.raises(TypeError, match=r"FillsItselfIn.prepare\(comm, exchange, layout\) returned None; a plan's "
                                            r"prepare returns the plan to use"):
            ex.exchange_numpy(np.ones(8, np.float32))
        return True

    assert InProcessWorld(1, timeout=60).run(fn) == [True]
