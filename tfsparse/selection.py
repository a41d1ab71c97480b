"""Efficiency-aware tensor selection: DRAGONN's cost-benefit analysis (dragonn-wang2022 §4.2, Eq. 1).

"We must ensure that the compression time is smaller than the communication time savings":
a tensor of ``d`` gradients is compressed only if

    T_comp(d) < T_full(d) - T_spr(d)                                          (Eq. 1)

with, for ``K`` workers, a latency ``α``, a bandwidth ``B`` and ``A`` bytes per gradient value,

    T_full(d) = 2(K-1)(α + dA/(KB))          ring allreduce of the dense tensor
    T_spr(d)  =  (K-1)(α + γdA/B)            allgather of the compressed tensor

where ``γdA`` "is the tensor size after compression" -- here the ``k = ceil(density·d)``
entries of index and value bytes each rank sends (``tfsparse.wire``), so the index bytes
count too.  (The paper simplifies the difference to ``(K-1)(α + (1/K - γ)dA/B)``; the two
formulas above give ``(K-1)(α + (2/K - γ)dA/B)``, which is what is computed here.)  Both are
the price of the aggregators' own declared schedules (the one timing model,
:meth:`tfsparse.aggregators.Aggregator.schedule`), every collective taken as the paper's ring:
``T_full`` is the dense aggregator's schedule of the ``d`` values (ring blocks of ``⌈d/K⌉``, so
``d/K`` rounded up where ``K`` does not divide ``d``), ``T_spr`` the chosen algorithm's allgather
of ``k`` entries (:meth:`~tfsparse.aggregators.topk.AllgatherAggregator.gather_schedule`).
Dense tensors are not exchanged one by one here: every run of consecutive dense tensors is
fused into one allreduce (as Horovod, which the authors run on, fuses them), so a dense
tensor adds only its bytes to a message that is sent anyway -- its ``T_full`` has no ``α``
term (``fuse_dense=True``, the default), while a compressed tensor pays its own allgather's
``(K-1)α``.  That is what makes small tensors go dense, as §4.2 argues they should ("the
communication latency can dominate the communication time for small messages").  With
``fuse_dense=False`` every tensor is its own bucket and ``T_full`` is the paper's formula as
written, ``α`` included.

``T_comp(d)`` is the encoding plus the decoding time, "profiled ... as a function of the
number of gradients": the algorithm's own ``encode`` and the decode of ``K`` such payloads
are timed at two sizes on rank 0 at start-up and fitted as ``T_comp(d) = c0 + c1·d`` (the
fixed part is the per-call overhead that makes small tensors -- biases, norms -- go dense).
``α`` and ``B`` come from :func:`tfsparse.collectives.measure_alpha_beta` (ping-pong between
ranks 0 and 1), and rank 0 broadcasts its ``c0, c1``, so every rank decides on identical
numbers: the decisions are identical everywhere.

The plan (:class:`CostModelPlan`) then gives every compressed tensor a bucket of its own (the
algorithm is tensor-wise), and fuses each run of consecutive dense tensors into one dense
bucket (one allreduce instead of one per bias, as the Horovod the authors run on fuses them).
Rank 0 prints the decisions once; :attr:`CostModelPlan.decisions` keeps them.

The analysis prices an allgather, so it applies to the algorithms that exchange by allgather:
``topk``, ``dgc``, ``gaussiank`` and ``dragonn`` ("This batching mechanism is also applicable
to other GS algorithms, such as DGC, TopK", §4.3).

>>> strategy = tfsparse.SparseStrategy("dragonn", density=0.01, selection="cost_model")
>>> # or with stated numbers (no measurement):
>>> CostModel(alpha=50e-6, beta=125e6, comp_fixed=1e-4, comp_per_element=2e-9)
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields

import numpy as np

from . import _checks
from .aggregators import Aggregator, get_aggregator
from .collectives.alphabeta import AlphaBeta, format_rate, format_time, measure_alpha_beta
from .collectives.simulate import Builder
from .plan import BucketSpec, Layout, Plan, _bucket
from .schedules import k_from_density

#: algorithms whose exchange is an allgather of the compressed tensors (what Eq. 1 prices)
ALLGATHER_ALGORITHMS = ("dgc", "dragonn", "gaussiank", "topk")
#: tensor sizes T_comp is timed at (elements)
PROFILE_SIZES = (1 << 12, 1 << 20)
#: message sizes of the start-up ping-pong (bytes): up to 4 MiB keeps it well under a second at 1 Gbit/s
PING_SIZES = (8, 512, 32768, 1 << 20, 4 << 20)


@dataclass(frozen=True)
class CostModel:
    """The numbers Eq. 1 is evaluated with.

    Attributes:
      alpha: one-way latency α of a message, seconds.
      beta: bandwidth B, bytes per second.
      comp_fixed, comp_per_element: ``T_comp(d) = comp_fixed + comp_per_element · d`` seconds
        (encode + decode of the K payloads).
    """

    alpha: float
    beta: float
    comp_fixed: float
    comp_per_element: float

    def __post_init__(self):
        for name, strict in (("alpha", False), ("beta", True), ("comp_fixed", False), ("comp_per_element", False)):
            object.__setattr__(self, name, _checks.real(name, getattr(self, name), 0.0, lo_open=strict))

    def t_comp(self, d: int) -> float:
        """``T_comp(d) = comp_fixed + comp_per_element · d``.

        Args:
          d: the tensor's elements.

        Returns:
          The seconds to encode a ``d``-element tensor and decode the K payloads.
        """
        return self.comp_fixed + self.comp_per_element * d

    def t_full(self, d: int, workers: int, value_bytes: int, latency: bool = True,
               dense: Aggregator | None = None) -> float:
        """The dense aggregator's schedule of ``d`` values on the ring: ``2(K-1)(α + ⌈d/K⌉A/B)``.

        Args:
          d: the tensor's elements.
          workers: K, the ranks.
          value_bytes: A, the bytes of a value on the wire.
          latency: False: without the ``α`` term (the tensor rides in a fused allreduce sent anyway).
          dense: the dense aggregator whose schedule is priced; None: a new ``"dense"``.

        Returns:
          Seconds.
        """
        b = Builder(workers, value_bytes)
        (dense or get_aggregator("dense")).schedule(b, d, d, 1)
        return self._ring_seconds(b, latency)

    def t_spr(self, d: int, workers: int, k: int, value_bytes: int, sparse: Aggregator | None = None) -> float:
        """The allgather of ``k`` (index, value) entries: ``(K-1)(α + γdA/B)``.

        Args:
          d: the tensor's elements.
          workers: K, the ranks.
          k: the entries each rank sends.
          value_bytes: A, the bytes of a value on the wire.
          sparse: the allgather aggregator whose schedule is priced; None: a new ``"topk"``.

        Returns:
          Seconds.
        """
        b = Builder(workers, value_bytes)
        (sparse or get_aggregator("topk")).gather_schedule(b, d, k)
        return self._ring_seconds(b)

    def _ring_seconds(self, b: Builder, latency: bool = True) -> float:
        """What ``b`` declared, priced with every collective on the ring (γ = 0: ``T_comp`` is the
        local work)."""
        return b.seconds(AlphaBeta(self.alpha if latency else 0.0, self.beta), prefer="ring")

    def as_dict(self) -> dict:
        """The four numbers (``selection=`` takes this dict back).

        Returns:
          ``{"alpha": ..., "beta": ..., "comp_fixed": ..., "comp_per_element": ...}``.
        """
        return asdict(self)

    def describe(self) -> str:
        """The model in one line (α, B and ``T_comp``), as :meth:`CostModelPlan.report` prints it.

        Returns:
          A string.
        """
        return (f"alpha={format_time(self.alpha)}, B={format_rate(self.beta)}, T_comp(d) = "
                f"{format_time(self.comp_fixed)} + {self.comp_per_element * 1e9:.3g} ns*d")


@dataclass(frozen=True)
class Decision:
    """One tensor's outcome of Eq. 1 (seconds)."""

    name: str
    size: int
    k: int
    compress: bool
    t_comp: float
    t_full: float
    t_spr: float

    @property
    def saving(self) -> float:
        """``t_full - t_spr``: the communication seconds compressing saves (Eq. 1's right-hand side)."""
        return self.t_full - self.t_spr

    def why(self) -> str:
        """Eq. 1 with this tensor's numbers, as text.

        Returns:
          ``T_comp < T_full - T_spr`` where it is compressed, ``>=`` where not, with the times.
        """
        rel = "<" if self.compress else ">="
        return (f"T_comp {format_time(self.t_comp)} {rel} T_full - T_spr = {format_time(self.t_full)} - "
                f"{format_time(self.t_spr)}")


def decide(model: CostModel, layout: Layout, workers: int, density: float, value_bytes: int = 4,
           fuse_dense: bool = True, algorithm: str = "topk", options: dict | None = None) -> list[Decision]:
    """Eq. 1 for every tensor of ``layout``: compress iff ``T_comp(d) < T_full(d) - T_spr(d)``.

    ``k = ceil(density·d)`` (a tensor with ``k = d`` never is).  Pure arithmetic: the same inputs
    give the same decisions on every rank.

    Args:
      model: the :class:`CostModel`.
      layout: the gradients' :class:`~tfsparse.plan.Layout`.
      workers: K, the ranks.
      density: the fraction each compressed tensor sends.
      value_bytes: the bytes of a value on the wire.
      fuse_dense: ``T_full`` without ``α`` (see the module docstring).
      algorithm: the allgather algorithm whose schedule ``T_spr`` prices.
      options: its options; None: its defaults.

    Returns:
      A list of :class:`Decision`, in layout order.

    Raises:
      ValueError: ``algorithm`` is not an allgather algorithm.
    """
    if algorithm not in ALLGATHER_ALGORITHMS:
        raise ValueError(_algorithm_error(algorithm))
    dense, sparse = get_aggregator("dense"), get_aggregator(algorithm, **(options or {}))
    out = []
    for spec in layout.specs:
        d = spec.size
        k = k_from_density(d, density)
        t_comp, t_full, t_spr = model.t_comp(d), model.t_full(d, workers, value_bytes, not fuse_dense, dense), \
            model.t_spr(d, workers, k, value_bytes, sparse)
        out.append(Decision(spec.name, d, k, bool(k < d and t_comp < t_full - t_spr), t_comp, t_full, t_spr))
    return out


def best_time(fn, repeats: int = 5) -> float:
    """The minimum wall time of ``repeats`` calls of ``fn`` after one untimed call.

    Args:
      fn: a callable of no arguments.
      repeats: the timed calls.

    Returns:
      Seconds.
    """
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def profile_compression(comm, algorithm: str, options: dict, density: float, wire, workers: int,
                        sizes=PROFILE_SIZES) -> tuple[float, float]:
    """``(c0, c1)`` of ``T_comp(d) = c0 + c1·d``, measured on this rank at two sizes.

    The time to encode a ``d``-element gradient with ``algorithm`` (a fresh instance, so no real
    bucket's state moves) and to decode ``workers`` such payloads (the aggregator's ``combine``).

    Args:
      comm: the communicator the encoding is given (nothing is sent).
      algorithm: the aggregator's name.
      options: its options.
      density: the fraction encoded.
      wire: the :class:`~tfsparse.wire.Wire`.
      workers: the payloads decoded.
      sizes: the two tensor sizes timed.

    Returns:
      ``(c0, c1)``, seconds and seconds per element (both at least 0).
    """
    rng = np.random.default_rng(0)
    times = []
    for d in sizes:
        x = rng.standard_normal(d).astype(np.float32)
        k = k_from_density(d, density)
        agg = get_aggregator(algorithm, **options)
        payload = agg.encode(comm, x, k, wire)
        t_enc = best_time(lambda: agg.encode(comm, x, k, wire))
        msgs = [payload.message] * workers
        t_dec = best_time(lambda: agg.combine(msgs, payload).to_dense(d))
        times.append(t_enc + t_dec)
    (d0, d1), (t0, t1) = sizes, times
    per = max(0.0, (t1 - t0) / (d1 - d0))
    return max(0.0, t0 - per * d0), per


def measure_cost_model(comm, algorithm: str, options: dict, density: float, wire) -> CostModel:
    """Collective: α and B by ping-pong (ranks 0 and 1), ``T_comp`` profiled on rank 0 and broadcast.

    Every rank returns the same model.  One rank: nothing to communicate, a model under which
    nothing is worth compressing (``T_full = T_spr = 0``).

    Args:
      comm: the communicator (every rank calls it).
      algorithm: the aggregator's name.
      options: its options.
      density: the fraction encoded.
      wire: the :class:`~tfsparse.wire.Wire`.

    Returns:
      A :class:`CostModel`.
    """
    if comm.size < 2:
        return CostModel(alpha=0.0, beta=1.0, comp_fixed=0.0, comp_per_element=0.0)
    ab: AlphaBeta = measure_alpha_beta(comm, sizes=PING_SIZES, repeats=5, warmup=1)
    comp = np.zeros(2, np.float64)
    if comm.rank == 0:
        comp[:] = profile_compression(comm, algorithm, options, density, wire, comm.size)
    comp = comm.bcast(comp if comm.rank == 0 else None, root=0, shape=(2,), dtype=np.float64)
    return CostModel(alpha=ab.alpha, beta=ab.beta, comp_fixed=float(comp[0]), comp_per_element=float(comp[1]))


class CostModelPlan(Plan):
    """Per-tensor choice by Eq. 1 (dragonn-wang2022 §4.2): compressed tensors get a bucket each
    with the exchange's algorithm, runs of dense tensors one fused ``"dense"`` bucket each, last
    tensor first (the order back-propagation produces them).

    Args:
      model: a :class:`CostModel`, or None to measure one when the exchange is built
        (:func:`measure_cost_model`, collective).
      fuse_dense: True (default): consecutive dense tensors share one allreduce and their
        ``T_full`` has no latency term; False: one bucket per tensor and the paper's formulas
        as written.
      verbose: rank 0 prints the decisions once (default True).

    A plan is a value: :meth:`prepare` (called by the exchange at its first step, on every rank)
    returns a copy that holds the :attr:`cost_model` in use (measured when none was given) and
    the :attr:`decisions` for the exchange's gradients, world size, density and wire; its
    :meth:`buckets` follow them.
    """

    name = "cost_model"
    prepares = True

    def __init__(self, model: CostModel | None = None, fuse_dense: bool = True, verbose: bool = True):
        if model is not None and not isinstance(model, CostModel):
            raise ValueError(f"model={model!r} is not valid; accepted: None (measured at start-up) or a "
                             f"tfsparse.selection.CostModel")
        if not isinstance(fuse_dense, bool):
            raise ValueError(f"fuse_dense={fuse_dense!r} is not valid; accepted: True, False")
        self.model = model
        self.fuse_dense = fuse_dense
        self.verbose = bool(verbose)
        #: after :meth:`prepare`: the model the decisions were made with, and Eq. 1's outcome per
        #: tensor (in layout order); None before
        self.cost_model: CostModel | None = None
        self.decisions: tuple[Decision, ...] | None = None

    def config(self):
        """The plan's name, the model and ``fuse_dense``.

        Returns:
          A dict; the model is ``"measured"`` where none was given, else its repr.
        """
        return {"plan": self.name, "cost_model": "measured" if self.model is None else repr(self.model),
                "fuse_dense": self.fuse_dense}

    def prepare(self, comm, exchange, layout: Layout) -> "CostModelPlan":
        """This plan with Eq. 1 decided for every tensor of ``layout`` (a copy).

        Collective when the model is measured (:func:`measure_cost_model`); rank 0 prints the
        decisions once when ``verbose``.

        Args:
          comm: the exchange's communicator.
          exchange: the :class:`~tfsparse.exchange.GradientExchange` (its algorithm, options,
            density and wire are priced).
          layout: the gradients' :class:`~tfsparse.plan.Layout`.

        Returns:
          A prepared :class:`CostModelPlan`.

        Raises:
          ValueError: the exchange's algorithm is not an allgather algorithm.
        """
        if exchange.algorithm not in ALLGATHER_ALGORITHMS:
            raise ValueError(_algorithm_error(exchange.algorithm))
        model = self.model
        if model is None:
            model = measure_cost_model(comm, exchange.algorithm, exchange.options, exchange.density, exchange.wire)
        prepared = copy.copy(self)  # a subclass stays itself
        prepared.cost_model = model
        prepared.decisions = tuple(decide(model, layout, comm.size, exchange.density, exchange.wire.value_bytes,
                                          self.fuse_dense, exchange.algorithm, exchange.options))
        if self.verbose and comm.rank == 0:
            print(prepared.report(model, comm.size, exchange.density), flush=True)
        return prepared

    def buckets(self, layout: Layout) -> list[BucketSpec]:
        """The buckets, last tensor first.

        A bucket of its own for every compressed tensor (the exchange's algorithm), one ``"dense"``
        bucket per run of consecutive dense tensors (per dense tensor without ``fuse_dense``).

        Args:
          layout: the gradients' :class:`~tfsparse.plan.Layout`.

        Returns:
          A list of :class:`~tfsparse.plan.BucketSpec`.

        Raises:
          RuntimeError: :meth:`prepare` did not decide for ``layout``'s tensors.
        """
        if self.decisions is None or len(self.decisions) != len(layout):
            raise RuntimeError("CostModelPlan.buckets() for gradients it was not prepared for: the exchange "
                               "prepares the plan (prepare()) with its layout")
        out = []
        i = len(layout) - 1
        while i >= 0:
            if self.decisions[i].compress:
                out.append(_bucket(layout, len(out), i, i + 1))
                i -= 1
                continue
            first = i
            while self.fuse_dense and first - 1 >= 0 and not self.decisions[first - 1].compress:
                first -= 1
            out.append(_bucket(layout, len(out), first, i + 1, algorithm="dense"))
            i = first - 1
        return out

    def report(self, model: CostModel, workers: int, density: float, limit: int = 12) -> str:
        """The decisions as text: which tensors are compressed, which go dense, and why.

        Args:
          model: the :class:`CostModel` used.
          workers: the ranks.
          density: the fraction each compressed tensor sends.
          limit: how many tensors (the largest) get a line each.

        Returns:
          One string, a line per decision shown.
        """
        ds = self.decisions or []
        comp = [d for d in ds if d.compress]
        lines = [f"tfsparse cost model (dragonn-wang2022 Eq. 1; P={workers}, density={density}, {model.describe()}): "
                 f"{len(comp)} of {len(ds)} tensors compressed ({sum(d.size for d in comp):,} of "
                 f"{sum(d.size for d in ds):,} elements)"]
        for d in sorted(ds, key=lambda d: -d.size)[:limit]:
            lines.append(f"  {'compress' if d.compress else 'dense   '} {d.name} [{d.size:,}]: {d.why()}")
        if len(ds) > limit:
            lines.append(f"  ... {len(ds) - limit} smaller tensors: "
                         f"{sum(not d.compress for d in ds[limit:])} dense")
        return "\n".join(lines)

    def __repr__(self):
        return f"CostModelPlan(model={self.model!r}, fuse_dense={self.fuse_dense})"


def _algorithm_error(algorithm) -> str:
    return (f"selection='cost_model' prices an allgather of the compressed tensors (dragonn-wang2022 Eq. 1), which "
            f"algorithm={algorithm!r} does not use; accepted algorithms: "
            f"{', '.join(repr(a) for a in ALLGATHER_ALGORITHMS)}")


def make_selection(selection, algorithm: str):
    """``selection=`` as a plan.

    Args:
      selection: None (every tensor takes the algorithm), ``"cost_model"`` (Eq. 1 with a model
        measured at start-up) or a :class:`CostModel` (stated numbers; also as a dict of its
        fields).
      algorithm: the exchange's algorithm (an allgather algorithm for the cost model).

    Returns:
      A :class:`CostModelPlan`, or None.

    Raises:
      ValueError: any other value, naming the argument and the accepted values; a cost model
        for an algorithm that is not an allgather algorithm.
    """
    if selection is None:
        return None
    if isinstance(selection, Mapping):  # a CostModel's fields (what get_config saves)
        fields = tuple(f.name for f in dataclass_fields(CostModel))
        if sorted(selection) != sorted(fields):
            raise ValueError(f"selection={dict(selection)!r} is not valid; a mapping must hold exactly the "
                             f"CostModel fields {', '.join(fields)}")
        selection = CostModel(**selection)
    if selection == "cost_model" or isinstance(selection, CostModel):
        if algorithm not in ALLGATHER_ALGORITHMS:
            raise ValueError(_algorithm_error(algorithm))
        return CostModelPlan(None if isinstance(selection, str) else selection)
    hint = (" (CSC's chunk schedule is chunk_selection='current' or 'previous')"
            if selection in ("current", "previous") else "")
    raise ValueError(f"selection={selection!r} is not supported{hint}; accepted: None (every tensor compressed), "
                     f"'cost_model' (dragonn-wang2022 Eq. 1, measured at start-up) or a "
                     f"tfsparse.selection.CostModel")
