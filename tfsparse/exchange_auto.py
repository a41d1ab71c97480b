"""``algorithm="auto"`` on the round engine: :class:`AutoSwitching`, the part of
:class:`~tfsparse.exchange.GradientExchange` that runs the measured rounds, decides at the same
round on every rank (:func:`tfsparse.auto.decide`), runs a compressed choice (sparse, or dense
over int8 or int4) on trial, and its contender after it (:func:`tfsparse.auto.confirm`), and switches the buckets between rounds (:meth:`AutoSwitching._replan`).
What is measured and how the candidates are priced is :mod:`tfsparse.auto`; this module is when,
and what the switch does to the buckets and their memory.

It is a base class of :class:`~tfsparse.exchange.GradientExchange` and uses the exchange's
attributes: ``_auto`` (an :class:`AutoState`, None for a pinned algorithm), ``settings`` and
``_use`` (the settings run), ``layout``, ``bucket_states`` and ``_make_buckets``, ``comm``,
``_xcomm``, ``_runner`` (the communication thread), ``_two`` (the two-level groups), ``space``,
``_next_round``/``_round`` and ``check_idle``.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from . import auto
from .hierarchy import TwoLevel
from .memory import keeps_velocity
from .settings import Settings


class AutoState:
    """``algorithm="auto"``: the settings before the choice (memory decided), this rank's step
    periods and exchange rounds so far, the measurements between rounds (``probe``, and the
    futures of its pieces on the communication thread), and the choice (``index`` into
    :data:`tfsparse.auto.CANDIDATES`; -1 while measuring)."""

    def __init__(self):
        self.base: Settings | None = None
        self.probe: auto.Probe | None = None
        self.probing: list = []
        self.periods: list[float] = []
        self.rounds: list[float] = []
        self.last_start: float | None = None
        self.last_round_s: float | None = None
        self.index = -1
        self.trial_from = -1  # on trial (a compressed choice): the periods recorded before it; -1: none
        self.trial_rounds = 0
        self.reference = 0.0  # the trial's reference: dense over float16's measured step, seconds
        self.contenders: tuple[int, ...] = ()  # the candidates on trial in turn (Decision.contenders)
        self.measured: tuple[tuple[int, float], ...] = ()  # those tried so far: (index, measured step)
        self.verdict = None  # the trial's end (tfsparse.auto.Verdict)
        self.inherited = -1  # a choice taken from another exchange (inherit_choice)
        self.inherited_trial = (0, 0.0)  # its trial's rounds and reference, where it was on trial
        self.two_level = False  # the choice runs in two levels (auto's own choice)
        self.prepared = -1  # the last round prepare_round saw
        self.decision = None
        self.samples: dict[int, list] = {}  # rank 0: the measured rounds' energy samples so far, by round
        self.shares: list[float] = []  # rank 0: each measured round's top 1 % share of the energy
        self.concentration = auto.UNMEASURED  # the decision's (tfsparse.auto.Decision.concentration)


class AutoSwitching:
    """``algorithm="auto"``'s part of :class:`~tfsparse.exchange.GradientExchange` (see the module)."""

    _auto: AutoState | None

    def inherit_choice(self, other: "GradientExchange") -> None:
        """``algorithm="auto"``: this exchange (not yet built) runs the choice ``other`` made, without measuring.

        For a new set of gradients of the same model (layers frozen or unfrozen, compiled again) on
        the same ranks and link.  A choice on trial there runs its trial anew here.

        Args:
          other: the exchange of the previous trainable set.
        """
        if self._auto is not None and getattr(other, "_auto", None) is not None and other._auto.index >= 0:
            self._auto.inherited = other._auto.index
            self._auto.two_level = other._auto.two_level
            self._auto.concentration = other._auto.concentration
            if other._auto.trial_from >= 0:  # on trial there: the trial anew here
                self._auto.inherited_trial = (other._auto.trial_rounds, other._auto.reference)
                self._auto.contenders, self._auto.measured = other._auto.contenders, other._auto.measured

    def _candidate_settings(self, index: int) -> Settings:
        """The settings before auto's choice with candidate ``index`` of
        :data:`tfsparse.auto.CANDIDATES` in place of ``"auto"``."""
        c = auto.CANDIDATES[index]
        return self._auto.base.replace(algorithm=c.algorithm, density=c.density, wire_dtype=c.wire_dtype)

    @property
    def auto_decision(self):
        """``algorithm="auto"``: the :class:`tfsparse.auto.Decision` (None while measuring, and
        after a restored decision); None for a pinned algorithm."""
        return None if self._auto is None else self._auto.decision

    @property
    def auto_verdict(self):
        """``algorithm="auto"``: the end of a compressed choice's trials (:class:`tfsparse.auto.Verdict`:
        the contender kept or switched back to, or dense over float16), None before it and where
        there was none."""
        return None if self._auto is None else self._auto.verdict

    @property
    def auto_choice(self):
        """``algorithm="auto"``: the chosen :class:`tfsparse.auto.Candidate`, None while measuring
        (and for a pinned algorithm)."""
        return None if self._auto is None or self._auto.index < 0 else auto.CANDIDATES[self._auto.index]

    def _replan(self, index: int, two_level: bool = False) -> None:
        """Runs candidate ``index`` of :data:`tfsparse.auto.CANDIDATES` from the next round: new
        buckets with its stages over the same plan (the traced graph, one op per bucket, stays
        valid), taking over the memory (residual, velocity) of the ones they replace -- the memory
        itself where the new stages use the same kind, else its values.  Every rank at the same
        round, with no round in flight."""
        self.check_idle("the switch to the setting auto chose")
        self._auto.index = index
        settings = self._candidate_settings(index)
        # auto's own two levels (a restored or inherited choice too): the groups now, collectively --
        # where they can be formed (several ranks, a transport that forms groups, host memory);
        # a flat choice drops auto's groups (not the ones hierarchical=True asked for)
        two_level = two_level and self.comm.size > 1 and self._xcomm.forms_groups and not self.space.on_device
        if two_level and self._two is None:
            self._two = two = self._runner.run(TwoLevel.of, self._xcomm)
            # the memory of the flat measured rounds (residual, velocity: sums of what each rank
            # kept) becomes the host's, on its leader: the sum of its ranks'; the others keep none
            for b in self.bucket_states:
                held = {k: np.ascontiguousarray(v, np.float32) for k, v in b.memory.get_state().items()}
                summed = {k: self._runner.run(two.up.allreduce, v) for k, v in held.items()}
                b.memory.set_state(summed if two.leader else {k: np.zeros_like(v) for k, v in held.items()})
        elif not two_level and self._auto.two_level:
            self._two = None
        self._auto.two_level = two_level
        if self._two is not None:
            settings = settings.replace(hierarchical=True)
        self._use(settings)
        old = self.bucket_states
        self.bucket_states = self._make_buckets(self.layout, replacing=old)
        for new, before in zip(self.bucket_states, old):
            new.rounds = before.rounds
            if new.memory is not before.memory:
                kept = new.memory.get_state()
                new.memory.set_state({k: v for k, v in before.memory.get_state().items() if k in kept})

    def prepare_round(self) -> None:
        """Before a round's buckets are taken (:meth:`start`, ``Pipelined.step``, or the start of
        bucket 0): for ``algorithm="auto"``, records the step that ended and, after
        :data:`tfsparse.auto.MEASURE_ROUNDS` measured rounds, decides -- collective, every rank at
        the same round -- and switches the buckets (:meth:`_replan`); a compressed choice then runs
        :data:`tfsparse.auto.TRIAL_ROUNDS` rounds on trial, and its contender as many after it
        (:attr:`tfsparse.auto.Decision.contenders`), after which their measured steps choose the
        one that runs on, or dense over float16 (:meth:`_end_trial`).  Once per round; nothing for
        a pinned algorithm."""
        a = self._auto
        if a is None or (a.index >= 0 and a.trial_from < 0) or self.layout is None or a.prepared == self._next_round:
            return
        a.prepared = self._next_round
        t0 = time.perf_counter()
        if a.last_start is not None and a.last_round_s is not None:
            a.periods.append(t0 - a.last_start)
            a.rounds.append(a.last_round_s)
        a.last_start = t0
        if a.index >= 0:
            if len(a.periods) >= a.trial_from + a.trial_rounds:
                self._end_trial()
            return
        if len(a.periods) < auto.MEASURE_ROUNDS:
            return
        n, sparse = int(self.layout.n), keeps_velocity(self.settings.memory)
        for piece in a.probing:  # done (the decision queues behind them): their errors are raised here
            piece.result()
        pinned = None if self._two is None else self._two.hosts  # hierarchical=True: the hosts run the algorithm
        two_level = pinned is None and self._xcomm.forms_groups and not self.space.on_device
        shares = float(np.median(a.shares)) if a.shares else auto.UNMEASURED  # (rank 0's; decide broadcasts it)
        decision = self._runner.run(lambda comm: auto.decide(comm, n, a.periods, a.rounds, sparse, a.probe,
                                                             workers=pinned, two_level=two_level,
                                                             concentration=shares), self._xcomm)
        if pinned is not None:
            decision = dataclasses.replace(decision, two_level=True)
        a.decision, a.concentration = decision, decision.concentration
        if self.comm.rank == 0:
            hosts = a.probe.hosts[0] if a.probe is not None and a.probe.hosts[0] > 1 else None
            print(decision.describe(self.comm.size, hosts=hosts), flush=True)
        self._replan(decision.index, decision.two_level)
        a.contenders = decision.contenders or (decision.index,)  # the chosen one first
        self._start_trial(decision.trial_rounds, decision.reference_s)

    def _start_trial(self, rounds: int, reference_s: float) -> None:
        """Runs the choice on trial for ``rounds`` rounds from now, against dense over float16's
        measured step ``reference_s`` (:func:`tfsparse.auto.confirm`); nothing for 0 rounds."""
        if rounds > 0:
            a = self._auto
            a.trial_from, a.trial_rounds, a.reference = len(a.periods), int(rounds), float(reference_s)

    def _end_trial(self) -> None:
        """A trial's end, every rank at the same round: the next contender on trial
        (:attr:`tfsparse.auto.Decision.contenders`), or after the last, the one whose measured step
        times its epochs is the smallest -- of those tried and dense over float16 (flat, unless the
        user asked for two levels) -- runs on from this round, taking over the memory."""
        a = self._auto
        timed = a.periods[a.trial_from + 1:]  # the first round on trial has the switch in it
        tried, reference, earlier = a.index, a.reference, a.measured
        verdict = self._runner.run(lambda comm: auto.confirm(comm, tried, reference, timed, earlier,
                                                             concentration=a.concentration), self._xcomm)
        a.measured = verdict.measured
        rest = [i for i in a.contenders if i not in dict(a.measured)]
        if rest:
            if self.comm.rank == 0:
                print(verdict.describe_next(rest[0]), flush=True)
            self._replan(rest[0], a.two_level)
            self._start_trial(a.trial_rounds, reference)
            return
        a.trial_from, a.verdict = -1, verdict
        dense = verdict.index == auto.MEASURING
        two_level = bool(a.base.hierarchical) if dense else a.two_level
        if self.comm.rank == 0:
            print(verdict.describe(two_level), flush=True)
        if verdict.index != tried:
            self._replan(verdict.index, two_level)

    def _observe_sum(self, b, index: int, dense) -> None:
        """``algorithm="auto"``, rank 0, in the measured rounds a probe's piece runs in (not the
        three undisturbed ones that give the compute step and dense over float16's step): bucket
        ``b``'s summed gradient of round ``index`` (the same on every rank), sampled
        (:func:`tfsparse.auto.energy_sample`); once every bucket of the round is in, the share of
        the energy in its largest 1 % (:func:`tfsparse.auto.top_share`) -- the gradient's
        concentration, which prices the sparse candidates' epochs."""
        a = self._auto
        if (a.index >= 0 or self.comm.rank != 0 or self.space.on_device or not isinstance(dense, np.ndarray)
                or len(a.periods) > len(auto.PROBES)):
            return
        part = auto.energy_sample(dense, b.spec.start, self.layout.n)
        with self._stats_lock:  # (the glue may finish buckets on several threads)
            parts = a.samples.setdefault(index, [])
            parts.append(part)
            if len(parts) < len(self.bucket_states):
                return
            del a.samples[index]
        share = auto.top_share(np.concatenate(parts))
        if share >= 0.0:
            a.shares.append(share)

    def _probe_between_rounds(self) -> None:
        """``algorithm="auto"`` while measuring, after a round's last bucket: the next piece of
        its measurements (:class:`tfsparse.auto.Probe`) handed to the communication thread, where it
        runs while the ranks compute the next gradients (every rank at the same point of its
        communication: after this round's buckets, before the next round's)."""
        a = self._auto
        p = a.probe
        if a.index >= 0 or p is None or p.submitted >= len(auto.PROBES) or self._next_round != self._round:
            return
        index, p.submitted = p.submitted, p.submitted + 1
        a.probing.append(self._runner.submit(p.run, self._xcomm, index))

    def _auto_state(self) -> dict:
        """``algorithm="auto"``'s part of :meth:`get_state`: the index into
        :data:`tfsparse.auto.CANDIDATES` (-1: undecided; their order is part of the format), whether
        it runs in two levels, and its trial (the rounds it has, 0: none; the reference step)."""
        a = self._auto
        contenders = np.full(auto.CONTENDERS, -1, np.int64)  # on trial: the contenders and their measured steps
        steps = np.full(auto.CONTENDERS, -1.0)  # -1: not measured yet
        if a.trial_from >= 0:
            measured = dict(a.measured)
            for j, i in enumerate(a.contenders[:auto.CONTENDERS]):
                contenders[j], steps[j] = i, measured.get(i, -1.0)
        return {"auto": np.array([a.index], np.int64), "auto_two_level": np.array([int(a.two_level)], np.int64),
                "auto_concentration": np.array([a.concentration], np.float64),
                "auto_trial": np.array([a.trial_rounds if a.trial_from >= 0 else 0, a.reference], np.float64),
                "auto_contenders": contenders, "auto_measured": steps}

    def _start_measuring(self, n: int) -> None:
        """At the build, for ``n`` gradient elements: the measured rounds' settings (dense over
        float16) and the probe; nothing for a pinned algorithm."""
        if self._auto is not None:  # measured rounds first (a restored decision replaces them)
            self._auto.base = self.settings
            self._auto.probe = auto.Probe(n)
            self._use(self._candidate_settings(auto.MEASURING))

    def _take_inherited(self) -> None:
        """At the build, once the buckets exist: the choice :meth:`inherit_choice` took, and its trial."""
        if self._auto is not None and self._auto.inherited >= 0:
            self._replan(self._auto.inherited, self._auto.two_level)
            self._start_trial(*self._auto.inherited_trial)

    def _restore_auto(self, state: dict) -> None:
        """:meth:`set_state`'s part for auto (:meth:`_auto_state`'s keys): the saved decision runs
        without measuring again; one saved on trial runs its trial anew, against the saved reference."""
        if self._auto is None or "auto" not in state:
            return
        chosen = int(state["auto"].reshape(-1)[0])
        if not -1 <= chosen < len(auto.CANDIDATES):
            raise ValueError(f"the saved state's auto choice {chosen} is not one of tfsparse.auto.CANDIDATES "
                             f"(0 to {len(auto.CANDIDATES) - 1}, or -1: undecided): saved by another version?")
        two = bool(int(np.asarray(state.get("auto_two_level", np.zeros(1))).reshape(-1)[0]))
        if chosen >= 0:  # decided when saved (one saved while measuring, -1, leaves this one's as it is)
            if chosen != self._auto.index or two != self._auto.two_level:
                self._replan(chosen, two)
            # saved on trial: the trial anew (of the contender on trial then; those tried before it keep
            # their measured steps; a state saved before contenders were kept has none after it)
            trial = np.asarray(state.get("auto_trial", np.zeros(2)), np.float64).reshape(-1)
            contenders = np.asarray(state.get("auto_contenders", [chosen]), np.int64).reshape(-1)
            steps = np.asarray(state.get("auto_measured", [-1.0]), np.float64).reshape(-1)
            a = self._auto
            saved = state.get("auto_concentration", [auto.UNMEASURED])
            a.concentration = float(np.asarray(saved, np.float64).reshape(-1)[0])
            a.trial_from, a.contenders, a.measured = -1, (), ()
            if int(trial[0]) > 0:
                a.contenders = tuple(int(i) for i in contenders if 0 <= i < len(auto.CANDIDATES)) or (chosen,)
                a.measured = tuple((int(i), float(s)) for i, s in zip(contenders, steps)
                                   if i >= 0 and i != chosen and s >= 0.0)
            self._start_trial(int(trial[0]), float(trial[1]))
