"""Gradient layout and exchange plans: which gradients travel together, in which order, how.

The exchange captures a :class:`Layout` when it first sees the gradients (at trace time in
TensorFlow): each gradient's name, shape and dtype, in the optimizer's variable order, and the
offsets of a fused float32 vector holding them all.  A **plan** maps the layout to
:class:`BucketSpec` s -- contiguous runs of tensors, each exchanged with its own aggregator
instance (its own state), its own ``k = ceil(density * bucket size)`` and its own slice of
the residual.  Buckets are exchanged one after another, in bucket order, on the exchange's
communication thread.

==================  =====================================================================
plan                buckets
==================  =====================================================================
``"fused"``         one bucket holding every gradient (the default; one sparse allreduce
                    per step over the whole model, as the seeds' papers do)
``"buckets"``       GradientFlow's lazy allreduce (gradientflow-sun2019 §3.1): walking the
(``bucket_bytes``)  tensors in the order back-propagation produces them (last layer first,
                    "from tensor-m to tensor-1"), consecutive tensors are packed until the
                    bucket holds at least θ = ``bucket_bytes`` bytes of float32 gradient
                    ("until the total size of waited tensors is greater than a given
                    threshold θ"); ``bucket_bytes=0`` makes every tensor its own bucket, as
                    Horovod's ``HOROVOD_FUSION_THRESHOLD=0`` turns fusion off
``"per_tensor"``    one bucket per tensor (last layer first), each with the exchange's
                    settings or what ``PerTensorPlan(assign)`` chooses for it -- the plan a
                    cost model fills in (DRAGONN's per-tensor choice, dragonn-wang2022 §3.3)
==================  =====================================================================

Bucket 0 holds the last tensors of the layout, so in a training step the first gradients
back-propagation finishes are the first to travel.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _checks
from ._registry import Registry

_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class TensorSpec:
    """One gradient: its name (the variable's path when known), shape and dtype; ``rows``: whether
    it arrives row-sparse (a ``tf.IndexedSlices``: an Embedding's, most of its rows zero in a step)."""

    name: str
    shape: tuple
    dtype: str = "float32"
    rows: bool = False

    @property
    def size(self) -> int:
        """Elements of the gradient: the product of ``shape``."""
        return int(np.prod(self.shape, dtype=np.int64))


def _dtype_of(a) -> np.dtype:
    """``a``'s dtype without copying it (device arrays have one, too)."""
    dtype = getattr(a, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(a).dtype


class Layout:
    """The gradients of one model, in order, and their offsets in the fused float32 vector.

    Args:
      specs: the :class:`TensorSpec` s, in order (at least one).

    Raises:
      ValueError: ``specs`` is empty.
    """

    def __init__(self, specs):
        self.specs = tuple(specs)
        if not self.specs:
            raise ValueError("a gradient layout needs at least one tensor")
        self.sizes = np.array([s.size for s in self.specs], dtype=np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(self.sizes))).astype(np.int64)
        self.n = int(self.offsets[-1])

    @classmethod
    def of(cls, arrays, names=None) -> "Layout":
        """The layout of a list of arrays.

        Args:
          arrays: the gradients (numpy, TensorFlow or device arrays: only shapes and dtypes are read).
          names: their names; None: ``gradient_0``, ``gradient_1``, ...

        Returns:
          A :class:`Layout`.
        """
        names = names if names is not None else [f"gradient_{i}" for i in range(len(arrays))]
        return cls(TensorSpec(str(nm), tuple(int(d) for d in np.shape(a)), _dtype_of(a).name)
                   for nm, a in zip(names, arrays))

    def __len__(self):
        return len(self.specs)

    def __eq__(self, other):
        return isinstance(other, Layout) and [(s.name, s.shape) for s in self.specs] == \
            [(s.name, s.shape) for s in other.specs]

    def __hash__(self):
        return hash(tuple((s.name, s.shape) for s in self.specs))

    def same_shapes(self, other: "Layout") -> bool:
        """Whether ``other`` holds tensors of the same shapes in the same order (names aside).

        Args:
          other: another :class:`Layout`.

        Returns:
          A bool.
        """
        return [s.shape for s in self.specs] == [s.shape for s in other.specs]

    def describe(self, limit: int = 6) -> str:
        """The first tensors as ``name[shape]``, comma-separated, and the count of all where there are more.

        Args:
          limit: how many tensors to name.

        Returns:
          A string.
        """
        items = [f"{s.name}{list(s.shape)}" for s in self.specs[:limit]]
        more = f", ... ({len(self.specs)} tensors)" if len(self.specs) > limit else ""
        return ", ".join(items) + more

    def __repr__(self):
        return f"Layout({self.describe()}; n={self.n})"


@dataclass(frozen=True)
class BucketSpec:
    """Tensors ``[first, last)`` of a layout, elements ``[start, stop)`` of its fused vector: a
    plan's entry (its run-time counterpart, with memory, aggregator and rounds in flight, is
    :class:`tfsparse.bucket.Bucket`, whose ``spec`` this is).

    ``algorithm``, ``density``, ``wire_dtype`` and ``options`` override the exchange's
    settings for this bucket (``None``: the exchange's)."""

    index: int
    first: int
    last: int
    start: int
    stop: int
    algorithm: str | None = None
    density: float | None = None
    wire_dtype: str | None = None
    options: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Elements of the bucket: ``stop - start``."""
        return self.stop - self.start


def _bucket(layout: Layout, index: int, first: int, last: int, **overrides) -> BucketSpec:
    return BucketSpec(index, first, last, int(layout.offsets[first]), int(layout.offsets[last]), **overrides)


#: the plans a name selects (``plan="fused"``), in the order registered
PLANS = Registry("plan", "plan", ordered=True)


class Plan:
    """Maps a :class:`Layout` to buckets.  Subclasses implement :meth:`buckets`."""

    name = "base"
    #: whether :meth:`prepare` must run (on every rank, collectively) before :meth:`buckets`
    prepares = False

    def prepare(self, comm, exchange, layout: Layout) -> "Plan":
        """The plan to use for ``layout``.

        Itself here; a plan is a value, so one that decides anything returns a copy that holds it.
        Called by the exchange on every rank at its first step, before :meth:`buckets`, when
        :attr:`prepares` is set (e.g. the cost model of :mod:`tfsparse.selection` measures the
        network there and decides per tensor).

        Args:
          comm: the exchange's communicator (collective: every rank calls it).
          exchange: the :class:`~tfsparse.exchange.GradientExchange` asking.
          layout: the gradients' :class:`Layout`.

        Returns:
          A :class:`Plan`.
        """
        return self

    def buckets(self, layout: Layout) -> list[BucketSpec]:
        """The buckets of ``layout``, in the order they are exchanged (bucket ``i`` has ``index`` ``i``).

        Args:
          layout: the gradients' :class:`Layout`.

        Returns:
          A list of :class:`BucketSpec`.
        """
        raise TypeError(f"{type(self).__name__} does not define buckets()")

    def config(self) -> dict:
        """What identifies this plan (compared across ranks, saved in configs).

        Returns:
          A dict: ``{"plan": name}`` and the plan's parameters.
        """
        return {"plan": self.name}

    def __eq__(self, other):
        return type(other) is type(self) and other.config() == self.config()

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted(self.config().items()))))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "plan")
        return f"{type(self).__name__}({args})"


@PLANS.register
class FusedPlan(Plan):
    """Every gradient in one bucket (today's behaviour of most systems, and the default)."""

    name = "fused"

    def buckets(self, layout):
        """One bucket: every tensor of ``layout``, elements ``[0, n)``.

        Args:
          layout: the gradients' :class:`Layout`.

        Returns:
          A list of one :class:`BucketSpec`.
        """
        return [_bucket(layout, 0, 0, len(layout))]


@PLANS.register
class BucketPlan(Plan):
    """GradientFlow's lazy allreduce (gradientflow-sun2019 §3.1) with threshold θ = ``bucket_bytes``.

    Walks the tensors last to first and closes a bucket as soon as it holds at least
    ``bucket_bytes`` bytes (4 per element); ``bucket_bytes=0`` gives one bucket per tensor.

    Args:
      bucket_bytes: θ, an integer >= 0.

    Raises:
      ValueError: ``bucket_bytes`` is None or not an integer >= 0.
    """

    name = "buckets"

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        if self.bucket_bytes is None:
            raise ValueError("plan='buckets' needs bucket_bytes= (a number of bytes >= 0), e.g. 4 << 20")

    def config(self):
        """The plan's name and its θ.

        Returns:
          ``{"plan": "buckets", "bucket_bytes": θ}``.
        """
        return {"plan": self.name, "bucket_bytes": self.bucket_bytes}

    def buckets(self, layout):
        """Walks the tensors last to first and closes a bucket once it holds at least ``bucket_bytes`` bytes of float32 gradient.

        The first tensor closes the last bucket, whatever its size.

        Args:
          layout: the gradients' :class:`Layout`.

        Returns:
          A list of :class:`BucketSpec`, the last tensors' bucket first.
        """
        out = []
        last = len(layout)
        acc = 0
        for i in range(len(layout) - 1, -1, -1):
            acc += int(layout.sizes[i]) * _FLOAT32_BYTES
            if acc >= self.bucket_bytes or i == 0:
                out.append(_bucket(layout, len(out), i, last))
                last, acc = i, 0
        return out


@PLANS.register
class PerTensorPlan(Plan):
    """One bucket per tensor, last tensor first.

    Args:
      assign: ``None`` (every tensor with the exchange's settings), a dict
        ``{tensor name: overrides}`` or a callable ``assign(spec) -> overrides or None``, where
        ``overrides`` is a dict with any of ``algorithm``, ``density``, ``wire_dtype`` and
        ``options`` (the algorithm's options).  This is where a cost model (DRAGONN's α-β
        choice per tensor) fills in the plan.
    """

    name = "per_tensor"
    _KEYS = ("algorithm", "density", "wire_dtype", "options")

    def __init__(self, assign=None):
        if assign is not None and not callable(assign) and not isinstance(assign, dict):
            raise ValueError(f"assign={assign!r} must be None, a dict {{tensor name: overrides}} or a callable "
                             f"spec -> overrides")
        self.assign = assign
        if isinstance(assign, dict):  # what can be checked before the layout is known
            for name, overrides in assign.items():
                self._check(str(name), overrides)

    def _check(self, name: str, overrides) -> dict:
        got = dict(overrides or {})
        unknown = sorted(set(got) - set(self._KEYS))
        if unknown:
            raise ValueError(f"per-tensor overrides {unknown} for tensor {name!r} are not supported; "
                             f"accepted: {', '.join(self._KEYS)}")
        got["options"] = dict(got.get("options") or {})
        return got

    def config(self):
        """The plan's name and ``assign``'s repr.

        Returns:
          ``{"plan": "per_tensor", "assign": repr or None}``.
        """
        return {"plan": self.name, "assign": None if self.assign is None else repr(self.assign)}

    def _overrides(self, spec: TensorSpec) -> dict:
        if self.assign is None:
            return {}
        got = self.assign.get(spec.name) if isinstance(self.assign, dict) else self.assign(spec)
        return self._check(spec.name, got)

    def buckets(self, layout):
        """One bucket per tensor, last tensor first, each with what ``assign`` gives for it.

        Args:
          layout: the gradients' :class:`Layout`.

        Returns:
          A list of :class:`BucketSpec`, one per tensor.

        Raises:
          ValueError: a dict ``assign`` names a tensor that ``layout`` lacks, or a callable
            ``assign`` returns overrides other than ``algorithm``, ``density``, ``wire_dtype`` and
            ``options``.
        """
        if isinstance(self.assign, dict):
            names = {s.name for s in layout.specs}
            missing = sorted(set(self.assign) - names)
            if missing:
                raise ValueError(f"PerTensorPlan assigns {missing}, which are not among the gradients: "
                                 f"{layout.describe(limit=12)}")
        return [_bucket(layout, b, i, i + 1, **self._overrides(layout.specs[i]))
                for b, i in enumerate(range(len(layout) - 1, -1, -1))]


def available_plans() -> tuple[str, ...]:
    """The names ``plan=`` accepts (:func:`make_plan`), in the order the plans were registered.

    Returns:
      A tuple of names: ``("fused", "buckets", "per_tensor")`` unless more plans are registered.
    """
    return PLANS.names()


def check_bucket_bytes(bucket_bytes):
    """``bucket_bytes`` checked: None (no bucket plan) or GradientFlow's threshold θ in bytes.

    Args:
      bucket_bytes: None, or an integer >= 0 (0: one bucket per tensor).

    Returns:
      None, or ``bucket_bytes`` as an int.

    Raises:
      ValueError: when it is neither None nor an integer >= 0.
    """
    if bucket_bytes is None:
        return None
    return _checks.integer("bucket_bytes", bucket_bytes, 0, hint=(
        " (GradientFlow's lazy-allreduce threshold θ in bytes; 0: one bucket per tensor) or None (one fused "
        "bucket), e.g. bucket_bytes=4 << 20"))


def make_plan(plan=None, bucket_bytes=None) -> Plan:
    """The plan for ``plan`` and ``bucket_bytes``.

    Args:
      plan: None (fused, or buckets where ``bucket_bytes`` is given), a name
        (:func:`available_plans`) or a :class:`Plan`.
      bucket_bytes: None, or GradientFlow's threshold θ in bytes (only with ``plan="buckets"``
        or None).

    Returns:
      A :class:`Plan`.

    Raises:
      ValueError: an unknown name, a bad ``bucket_bytes`` or one that conflicts with ``plan``; the
        message names the argument, the value and the accepted values.
    """
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    if isinstance(plan, Plan):
        if bucket_bytes is not None and plan != BucketPlan(bucket_bytes):
            raise ValueError(f"bucket_bytes={bucket_bytes!r} conflicts with plan={plan!r}; give one of them")
        return plan
    if plan is None:
        return FusedPlan() if bucket_bytes is None else BucketPlan(bucket_bytes)
    cls = PLANS.get(plan, accepted=f"{', '.join(repr(p) for p in PLANS.names())} or a tfsparse.plan.Plan instance")
    if plan == "buckets":
        return BucketPlan(bucket_bytes)
    if bucket_bytes is not None:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} only applies to plan='buckets' (got plan={plan!r})")
    return cls()
