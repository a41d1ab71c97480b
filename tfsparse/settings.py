"""Settings: every option of a gradient exchange, defined once.

:class:`Settings` is the one validated, serialisable description of an exchange that
:class:`tfsparse.SparseStrategy`, :class:`tfsparse.keras.DistributedOptimizer` and the round
engine (:class:`tfsparse.exchange.GradientExchange`) all take.  Each of them also accepts the
same keyword arguments (``algorithm=``, ``density=``, ...), which become a :class:`Settings`
through :meth:`Settings.of`; ``settings=`` passes one directly.

=================  ===============================================================================
``algorithm``      ``"auto"`` (default: chosen from measurements of the job, :mod:`tfsparse.auto`)
                   or a registered aggregator name (``tfsparse.aggregators.available_aggregators()``);
                   settings that give a ``density`` or a ``wire_dtype`` without an algorithm
                   pin ``"topk"`` (``wire_dtype="int4"`` alone: ``"dense"``)
``density``        fraction of elements each rank sends, in (0, 1]
``wire_dtype``     ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"int8"`` or ``"int4"`` (dense only; :mod:`tfsparse.wire`)
``plan``           how gradients are grouped into buckets and priced: ``None``/``"fused"`` (one
                   bucket), a byte threshold θ (GradientFlow's lazy allreduce; ``0``: one bucket
                   per tensor), ``"per_tensor"``, ``"cost_model"`` or a
                   :class:`~tfsparse.selection.CostModel` (DRAGONN's per-tensor choice, Eq. 1), or
                   a :class:`tfsparse.plan.Plan`
``memory``         ``"auto"`` (default; see below), ``"residual"`` (error feedback), ``"momentum"``
                   (momentum correction, DGC's masking), ``"momentum_rows"`` (the same but for
                   row-sparse gradients, an Embedding's, whose velocity is kept) or ``"none"`` (:mod:`tfsparse.memory`); ``momentum``: its factor
``pipeline``       Pipe-SGD's iteration dependency K: 1 (synchronous) or 2 (each step applies the
                   previous step's aggregate, :class:`tfsparse.pipelined.Pipelined`; see below)
``clip_norm``      DGC's local gradient clipping (None: off)
``hierarchical``   the two-level exchange (default False): the ranks of a host sum their gradients
                   over shared memory (exact, in a fixed order), one rank per host runs the algorithm
                   across hosts, and it shares the result inside its host (see below)
``options``        the algorithm's own options (``tau=`` for Ok-Topk, ...)
=================  ===============================================================================

``pipeline=2`` (pipe-sgd-li2018 §3.1, Alg. 1): the exchange of step t's gradient runs while
step t+1 computes, and step t+1 applies it; the first step applies a zero gradient.  Pair it
with ``algorithm="dense", wire_dtype="int8"`` (or ``"bfloat16"``) for the paper's compressed
pipelined training, and with ``tfsparse.keras.callbacks.DSyncWarmUp`` for its synchronous
warm-up.  A gradient one step late narrows the stable learning rates: heavy-ball momentum β is
stable for ``lr·h < 1 − β`` on a curvature h instead of ``lr·h < 2(1 + β)`` (plain SGD, the
paper's update: ``lr·h < 1`` instead of 2), so a learning rate tuned for synchronous momentum
SGD may need lowering (README, Pipe-SGD).

``memory="auto"`` (the default) is decided when the optimizer that applies the exchanged
gradients is known (:meth:`Settings.resolved`): a sparse algorithm under an optimizer whose
momentum the exchange can take over (``keras.optimizers.SGD`` with ``momentum`` > 0, without
Nesterov) gets momentum correction with the optimizer's own factor, with DGC's momentum factor
masking except in row-sparse gradients (``"momentum_rows"``, :mod:`tfsparse.memory`) -- the exchange applies the
momentum (DGC §3.2) and the optimizer its update without it, so ``SGD(0.05, momentum=0.9)``
keeps its meaning; every other case gets ``"residual"`` (error feedback; nothing is kept for a
lossless exchange).  Plain error feedback under an optimizer's momentum plateaus below dense
(``docs/choosing.md``).

``hierarchical=True`` (the two-level exchange, as BytePS compresses once per machine): the ranks
of each host add their gradients up a binomial tree to the host's first rank, its leader (a
fixed order: the same bits every run); the leaders run the settings' algorithm among themselves
on that sum -- error feedback (residual, or momentum correction's velocity) is kept per host, on
its leader, as if each host were one worker whose gradient is its ranks' sum; the density is the
fraction each host sends -- and each leader shares the summed result with its host's ranks (a
sparse one as its indices and values, decoded by each rank as the leader did), so every rank
applies the same bits.  Only the leaders' traffic crosses the network (counted in the
exchange's bytes; the shared-memory traffic is not).  With one rank per host it is the flat
exchange.  ``algorithm="auto"`` prices each candidate flat and in two levels from its
measurements and runs two levels where they are predicted shorter (``docs/cluster.md``).

The old spellings of the grouping, ``bucket_bytes=θ`` and ``selection=...``, are deprecated
aliases of ``plan=θ`` and ``plan=...``: they still work and warn (``DeprecationWarning``).

:meth:`Settings.config` is the serialisation (plain values; ``Settings.of(**config)`` makes the
same settings again) -- what ``DistributedOptimizer.get_config`` stores and what every rank
compares at the first exchange.  Everything is validated when the settings are made, before any
communication: a ``ValueError`` names the argument, the value and what is accepted.
"""
from __future__ import annotations

import difflib
import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from . import _checks
from .aggregators import aggregator_options, available_aggregators, get_aggregator
from .memory import available_memories, check_memory, keeps_velocity
from .plan import BucketPlan, Plan, available_plans, make_plan
from .schedules import check_density
from .selection import CostModel, CostModelPlan, make_selection
from .wire import check_wire_for, get_wire

#: ``algorithm="auto"`` (the default: :mod:`tfsparse.auto`) and ``memory="auto"``
#: (:meth:`Settings.resolved`, once the optimizer is known)
AUTO = "auto"
#: the algorithm of settings that give a ``density`` or a ``wire_dtype`` but no algorithm
PINNED_DEFAULT = "topk"
PIPELINES = (1, 2)  # pipe-sgd-li2018 §3.1: K = 2 is optimal under limited resources, K > 2 only adds staleness
#: the deprecated spellings of ``plan=``
ALIASES = ("bucket_bytes", "selection")


def check_clip_norm(clip_norm) -> float | None:
    """Checks ``clip_norm=``.

    Args:
      clip_norm: None (no clipping) or a positive finite number.

    Returns:
      None, or ``clip_norm`` as a float.

    Raises:
      ValueError: any other value.
    """
    if clip_norm is None:
        return None
    return _checks.real("clip_norm", clip_norm, 0.0, lo_open=True, hint=(
        " or None (no clipping); DGC's local gradient clipping: each rank clips its gradient to clip_norm / sqrt(P)"))


def check_pipeline(pipeline) -> int:
    """Checks ``pipeline=``, Pipe-SGD's iteration dependency K.

    Args:
      pipeline: 1 (synchronous) or 2.

    Returns:
      ``pipeline``.

    Raises:
      ValueError: any other value (pipe-sgd-li2018 §3.1: K > 2 only adds staleness).
    """
    return _checks.choice("pipeline", pipeline, PIPELINES, accepted=(
        "1 (synchronous) or 2 (Pipe-SGD, the update of step t+1 applies step t's aggregated gradient; "
        "pipe-sgd-li2018 §3.1 shows K > 2 only adds staleness)"))


class Options(Mapping):
    """An algorithm's options, by name: a read-only mapping.

    A :class:`Settings` is a value; :meth:`Settings.replace` makes a changed copy.  Equal to a
    dict of the same items; copied, deep-copied and pickled as one.

    Args:
      items: the options (a mapping), or None: none.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping | None = None):
        object.__setattr__(self, "_items", dict(items or {}))

    def __getitem__(self, name):
        return self._items[name]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __setattr__(self, name, value):
        raise AttributeError("Options are read-only; make changed settings with Settings.replace(options=...)")

    def __reduce__(self):
        return Options, (dict(self._items),)

    def __repr__(self):
        return repr(self._items)


def check_option_names(algorithm: str, options: Mapping) -> None:
    """Checks that every key of ``options`` is an option of ``algorithm``.

    A keyword that is neither a setting nor an option ends up here.

    Args:
      algorithm: a registered aggregator's name.
      options: the keywords given besides the settings.

    Raises:
      ValueError: naming each unknown keyword, the nearest valid keyword, the settings and the
        algorithm's options.
    """
    accepted = aggregator_options(algorithm)
    unknown = sorted(k for k in options if k not in accepted)
    if not unknown:
        return
    valid = sorted(NAMES | {"settings", "algorithm_options"}) + list(accepted)
    hints = [f"{k} -> {m[0]}" for k in unknown for m in [difflib.get_close_matches(k, valid, 1, 0.55)] if m]
    names = ", ".join(f"{k}={options[k]!r}" for k in unknown)
    raise ValueError(f"invalid options for algorithm={algorithm!r}: {names} {'is' if len(unknown) == 1 else 'are'} "
                     f"neither a setting nor an option of {algorithm!r}"
                     + (f" (did you mean {'; '.join(hints)}?)" if hints else "")
                     + f"; accepted settings: {', '.join(sorted(NAMES))}, settings= (a tfsparse.settings.Settings); "
                     f"options of {algorithm!r}: {', '.join(accepted) or 'none'}")


def check_algorithm(algorithm) -> str:
    """``algorithm`` checked to be ``"auto"`` or the name of a registered aggregator.

    Args:
      algorithm: the value of ``algorithm=``.

    Returns:
      ``algorithm``, as given.

    Raises:
      ValueError: when it is neither, naming the accepted values.
    """
    return _checks.choice("algorithm", algorithm, (AUTO, *available_aggregators()))


def _check_auto(settings) -> None:
    """``algorithm="auto"`` chooses algorithm, density and wire among synchronous settings, each
    with its own default options, and the fused or bucketed plans (ValueError otherwise)."""
    pinned = [f"{name}={getattr(settings, name)!r}" for name in ("density", "wire_dtype")
              if getattr(settings, name) != _DEFAULTS[name]]
    if pinned:
        example = "dense" if get_wire(settings.wire_dtype).dense_only else "topk"
        raise ValueError(f"{', '.join(pinned)} with algorithm='auto': auto chooses the algorithm, the density and "
                         f"the wire; give algorithm= too to pin them (e.g. algorithm={example!r}, {pinned[0]})")
    if settings.options:
        raise ValueError(f"algorithm='auto' takes no algorithm options (got {settings.options!r}): auto chooses the "
                         f"algorithm; give algorithm= to use one with options")
    if settings.pipeline != 1:
        raise ValueError(f"pipeline={settings.pipeline!r} with algorithm='auto': auto chooses among synchronous "
                         f"settings; pin the algorithm for Pipe-SGD (e.g. algorithm='dense', wire_dtype='int8', "
                         f"pipeline=2)")
    if settings.plan.prepares:
        raise ValueError(f"plan={plan_config(settings.plan)!r} with algorithm='auto': DRAGONN's cost model decides "
                         f"per tensor for one algorithm; pin the algorithm (e.g. algorithm='dragonn') or use "
                         f"plan=None or a byte threshold")


_ACCEPTED = ("None or 'fused' (one bucket), a number of bytes (GradientFlow's lazy allreduce threshold; 0: one "
             "bucket per tensor), 'buckets' (with that number), 'per_tensor', 'cost_model' or a "
             "tfsparse.selection.CostModel (DRAGONN's per-tensor choice), or a tfsparse.plan.Plan instance")


def make_grouping(plan, algorithm: str) -> Plan:
    """``plan=`` as a :class:`~tfsparse.plan.Plan`.

    Args:
      plan: a plan name, a byte threshold (an integer: :class:`~tfsparse.plan.BucketPlan`),
        DRAGONN's cost model (``"cost_model"``, a :class:`~tfsparse.selection.CostModel` or a
        mapping of its fields), a Plan, or None (one bucket).
      algorithm: the algorithm the cost model decides for.

    Returns:
      A :class:`~tfsparse.plan.Plan`.

    Raises:
      ValueError: any other value, naming the accepted ones.
    """
    if isinstance(plan, Plan):
        return plan
    if plan == "cost_model" or isinstance(plan, (CostModel, Mapping)):
        return make_selection(plan, algorithm)
    if isinstance(plan, numbers.Integral) and not isinstance(plan, bool):
        return BucketPlan(int(plan))
    if plan is None or (isinstance(plan, str) and plan in available_plans()):
        return make_plan(plan)
    raise ValueError(f"plan={plan!r} is not supported; accepted: {_ACCEPTED}")


def plan_config(plan: Plan):
    """The serialisable form of a plan (what :func:`make_grouping` takes back).

    Args:
      plan: a :class:`~tfsparse.plan.Plan`.

    Returns:
      None for the fused plan, the byte threshold of a bucket plan, the cost model's
      ``"cost_model"`` or fields, else the plan's name (a per-tensor plan's ``assign`` function is
      code, not configuration).
    """
    if isinstance(plan, CostModelPlan):
        return "cost_model" if plan.model is None else plan.model.as_dict()
    if isinstance(plan, BucketPlan):
        return plan.bucket_bytes
    return None if plan.name == "fused" else plan.name


def _merge_aliases(plan, bucket_bytes, selection, algorithm):
    """``plan`` with the deprecated ``bucket_bytes=`` / ``selection=`` folded in (each warns; a bad
    value is reported under the name it was given)."""
    given = [(name, value) for name, value in (("bucket_bytes", bucket_bytes), ("selection", selection))
             if value is not None]
    for name, value in given:
        warnings.warn(f"{name}= is deprecated; use plan={value!r} (one argument for how gradients are grouped)",
                      DeprecationWarning, stacklevel=4)
    if not given:
        return plan
    if len(given) == 1 and given[0][0] == "bucket_bytes" and (plan is None or isinstance(plan, str)):
        return make_plan(plan, bucket_bytes)  # plan="buckets", bucket_bytes=θ: one plan
    if len(given) > 1 or plan is not None:
        names = ", ".join(f"{n}={v!r}" for n, v in [("plan", plan)] * (plan is not None) + given)
        raise ValueError(f"{names}: these all set how gradients are grouped; give one plan= ({_ACCEPTED})")
    return make_selection(selection, check_algorithm(algorithm))


@dataclass(eq=False, frozen=True)
class Settings:
    """The validated settings of one exchange (the module docstring explains each): an immutable
    value (:meth:`replace` makes a changed copy).  Make them with :meth:`of`; :meth:`config` is
    their serialisation.

    Attributes:
      algorithm: ``"auto"`` or a registered aggregator's name.
      density: the fraction of elements each rank (each host, in two levels) sends, in (0, 1].
      wire_dtype: the values' encoding on the wire: ``"float32"``, ``"float16"``,
        ``"bfloat16"``, ``"int8"`` or ``"int4"`` (``algorithm="dense"`` only).
      plan: how the gradients are grouped into buckets (a :class:`tfsparse.plan.Plan`; None:
        one bucket).
      memory: the error feedback: ``"auto"``, ``"residual"``, ``"momentum"``,
        ``"momentum_rows"`` or ``"none"``.
      momentum: momentum correction's factor (None: the optimizer's, or no momentum correction).
      pipeline: Pipe-SGD's iteration dependency K, 1 or 2.
      clip_norm: DGC's local gradient clipping norm (None: off).
      hierarchical: the two-level exchange (the ranks of a host sum first).
      options: the algorithm's own options, by name (kept as a read-only :class:`Options`).

    Raises:
      ValueError: when made, for a value outside its accepted values (naming the argument, the
        value and what is accepted), before any communication.
    """

    algorithm: str = AUTO
    density: float = 0.01
    wire_dtype: str = "float32"
    plan: Plan | None = None
    memory: str = "auto"
    momentum: float | None = None
    pipeline: int = 1
    clip_norm: float | None = None
    hierarchical: bool = False
    options: Mapping = field(default_factory=Options)

    def __post_init__(self):
        # each field as validated and normalised (the dataclass is frozen: set once, here)
        def put(name, value):
            object.__setattr__(self, name, value)

        put("algorithm", check_algorithm(self.algorithm))
        put("density", check_density(self.density))
        put("wire_dtype", get_wire(self.wire_dtype).name)
        put("options", Options(self.options))
        if self.algorithm != AUTO:
            check_option_names(self.algorithm, self.options)
            get_aggregator(self.algorithm, **self.options)  # validates the options
        put("plan", make_grouping(self.plan, self.algorithm))
        check_wire_for(self.algorithm, self.wire_dtype)
        _checks.choice("memory", self.memory, (AUTO, *available_memories()))
        if self.memory == AUTO:
            if self.momentum is not None:
                raise ValueError(f"momentum={self.momentum!r} needs memory='momentum' (momentum correction); with "
                                 f"memory='auto' the momentum is the optimizer's")
        else:
            put("momentum", check_memory(self.memory, self.momentum).get("momentum"))
        put("pipeline", check_pipeline(self.pipeline))
        put("clip_norm", check_clip_norm(self.clip_norm))
        if not isinstance(self.hierarchical, bool):
            raise ValueError(f"hierarchical={self.hierarchical!r} is not supported; accepted: True (a two-level "
                             f"exchange: inside each host, then across hosts) or False (every rank alike)")
        if self.algorithm == AUTO:
            _check_auto(self)

    @classmethod
    def of(cls, settings: "Settings | None" = None, *, bucket_bytes=None, selection=None,
           algorithm_options: Mapping | None = None, **kwargs) -> "Settings":
        """Settings from keyword arguments, or ``settings`` itself when given alone.

        A ``density`` or ``wire_dtype`` without an algorithm (and without ``settings``) pins
        :data:`PINNED_DEFAULT` -- ``"dense"`` for a wire only the dense exchange sends (``int4``)
        given without a density.

        Args:
          settings: a :class:`Settings` to start from (the keywords change a copy); None: the defaults.
          bucket_bytes: deprecated alias of ``plan=`` (a byte threshold); warns.
          selection: deprecated alias of ``plan=`` (DRAGONN's cost model); warns.
          algorithm_options: the algorithm's options as a mapping.
          **kwargs: the settings (the module docstring's); any other keyword is an algorithm option.

        Returns:
          A :class:`Settings`.

        Raises:
          ValueError: a value outside its accepted values, or an unknown keyword.
        """
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in NAMES}
        options = {**(algorithm_options or {}), **kwargs}
        if given.get("algorithm") is None and settings is None and \
                any(given.get(k) is not None for k in ("density", "wire_dtype")):
            # a density or a wire of one's own: not auto's choice
            dense_wire = given.get("wire_dtype") is not None and get_wire(given["wire_dtype"]).dense_only
            given["algorithm"] = "dense" if dense_wire and given.get("density") is None else PINNED_DEFAULT
        if settings is not None:
            if not isinstance(settings, Settings):
                raise ValueError(f"settings={settings!r} is not valid; accepted: a tfsparse.settings.Settings")
            if given or options or bucket_bytes is not None or selection is not None:
                return settings.replace(**given, options={**settings.options, **options}, bucket_bytes=bucket_bytes,
                                        selection=selection)
            return settings
        given["plan"] = _merge_aliases(given.get("plan"), bucket_bytes, selection, given.get("algorithm", "topk"))
        return cls(**given, options=options)

    def replace(self, *, bucket_bytes=None, selection=None, **changes) -> "Settings":
        """A copy with ``changes``, validated.

        Changing the memory to one without a velocity drops the momentum factor.

        Args:
          bucket_bytes: deprecated alias of ``plan=``.
          selection: deprecated alias of ``plan=``.
          **changes: settings by name.

        Returns:
          A new :class:`Settings`.

        Raises:
          ValueError: a value outside its accepted values.
        """
        current = {f.name: getattr(self, f.name) for f in fields(self)}
        if "memory" in changes and "momentum" not in changes and not keeps_velocity(changes["memory"]):
            current["momentum"] = None
        if bucket_bytes is not None or selection is not None:
            changes["plan"] = _merge_aliases(changes.get("plan"), bucket_bytes, selection,
                                             changes.get("algorithm", self.algorithm))
        return Settings(**{**current, **changes})

    def resolved(self, momentum: float | None = None) -> "Settings":
        """These settings with ``memory="auto"`` decided (itself when the memory was given).

        Args:
          momentum: the momentum of the optimizer that applies the exchanged gradients, where the
            exchange can take it over; None: it cannot, or there is none.

        Returns:
          ``"momentum_rows"`` with factor ``momentum`` for a sparse algorithm (or auto) where
          ``momentum`` is given, else ``"residual"``; as a new :class:`Settings`.
        """
        if self.memory != AUTO:
            return self
        if momentum and self.sparse_capable:
            return self.replace(memory="momentum_rows", momentum=float(momentum))
        return self.replace(memory="residual")

    @property
    def sparse_capable(self) -> bool:
        """Whether the exchange may drop what it does not send: a sparse algorithm, or ``"auto"``
        (which may choose one)."""
        return self.algorithm == AUTO or get_aggregator(self.algorithm, **self.options).uses_memory

    @property
    def memory_options(self) -> dict:
        """The memory's options: ``{"momentum": momentum}`` where :attr:`momentum` is set (momentum
        correction), else ``{}`` -- what :func:`tfsparse.memory.get_memory` builds the memory with."""
        return {} if self.momentum is None else {"momentum": self.momentum}

    @property
    def keeps_residual(self) -> bool:
        """Whether the exchange keeps a residual: error feedback for a sparse algorithm or a lossy
        wire, or momentum correction (whose velocity is kept even for a lossless exchange)."""
        if self.memory == "none":
            return False
        return self.sparse_capable or get_wire(self.wire_dtype).lossy or keeps_velocity(self.memory)

    def config(self) -> dict:
        """Every setting as plain values: ``Settings.of(**settings.config())`` gives the same settings.

        Returns:
          A dict of plain values.
        """
        return {"algorithm": self.algorithm, "density": self.density, "wire_dtype": self.wire_dtype,
                "plan": plan_config(self.plan), "memory": self.memory, "momentum": self.momentum,
                "pipeline": self.pipeline, "clip_norm": self.clip_norm, "hierarchical": self.hierarchical,
                "algorithm_options": dict(self.options)}

    def local_clip_norm(self, workers: int) -> float | None:
        """The norm each rank clips its gradient to (DGC §3.3: "scale the threshold by N^{-1/2}").

        Args:
          workers: P, the ranks.

        Returns:
          ``clip_norm / sqrt(P)`` (so that the sum over P ranks is clipped to ``clip_norm``), or None
          without clipping.
        """
        return None if self.clip_norm is None else self.clip_norm / math.sqrt(workers)

    def __eq__(self, other):
        return isinstance(other, Settings) and other.config() == self.config() and other.plan == self.plan

    def __repr__(self):
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in self.config().items()) + ")"


#: the defaults of the settings auto chooses
_DEFAULTS = {f.name: f.default for f in fields(Settings) if f.name in ("density", "wire_dtype")}
#: the keyword arguments that are settings (the others given with them are algorithm options)
NAMES = frozenset(f.name for f in fields(Settings)) - {"options"}
