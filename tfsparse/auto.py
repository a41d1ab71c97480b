"""``algorithm="auto"``: the exchange measures its job and chooses algorithm, density and wire.

The first :data:`MEASURE_ROUNDS` rounds of an ``"auto"`` exchange run dense over float16 -- a
dense warm-up, which sparse training wants anyway (gradientflow-sun2019 §3.2, DGC §3.3) -- while
every rank records how long its steps take and how long each round of the exchange takes.
Between those rounds, on the communication thread while the ranks compute their next gradients
(:class:`Probe`, one piece of :data:`PROBES` after each of the first six rounds), it measures:

* **the link** -- round trips between rank 0 and the first rank on another host (rank 1 on one
  host) of 8 B, 1 MiB and 4 MiB (one of 4 MiB per piece), from which rank 0 fits α and β
  (:func:`~tfsparse.collectives.alphabeta.fit_alpha_beta`) -- its bandwidth then set to what the
  measured rounds' dense float16 exchanges took, the slowest rank's median (:func:`calibrated`:
  tens of megabytes through the collective itself, where a few MiB of round trips on a fast link
  drown in scheduling noise; not under ``hierarchical=True``, whose measured rounds ran in two
  levels);
* **the local work** of each candidate on this layout -- rank 0 times the selection of the
  sparse candidates (top-k of the whole gradient) and the dense wires' encoding and decoding,
  alone on a core; where a host has more ranks than cores (:func:`oversubscription`), the ranks
  do that work at the same time on the cores they share, and it is priced that many times longer.

At the start of the next round, on every rank at once (:func:`decide`, collective), with **the
compute step** -- each rank's median of (time between two rounds' starts) less (the earlier
round's exchange) over the measured rounds after the probe's last piece, the slowest rank's --
rank 0 prices every candidate of :data:`CANDIDATES` with
the library's timing model (:func:`tfsparse.timing.simulate`, the aggregators' own schedules under
α-β): predicted step = compute + communication + local work, and predicted **time to accuracy** =
predicted step × the candidate's :attr:`Candidate.epochs` (how many epochs it needs to reach what
dense float32 reaches, relative to dense; :data:`CANDIDATES` documents the measurements behind
each), fewer for a sparse one where the gradient is concentrated (:func:`epochs_of`: rank 0 samples
the first measured rounds' sums, :meth:`~tfsparse.exchange.GradientExchange.finish`).  The smallest wins -- within :data:`TOLERANCE` of it, the earlier candidate, dense first --
and every rank computes it from the same numbers (the slowest rank's compute and exchange, rank
0's link and local timings, broadcast), so every rank runs the same choice.  Dense over float16 is always a
candidate, so on a fast link auto picks dense.

The timing model is a model: on a busy node, or a link as fast as the ranks' own memory, its
step can be off by 2x either way.  So a compressed choice (:attr:`Candidate.compressed`: a
sparse algorithm, or dense over int8 or int4) runs on trial first, and after it the next best predicted
compressed candidate where the model's error could swap the two (:data:`CONTENDERS`,
:data:`SPREAD`): for :data:`TRIAL_ROUNDS` rounds each, every rank times its steps, and then
(:func:`confirm`, collective) each one's measured step (the slowest rank's median) times its
epochs is set against the other's and against dense over float16's own measured step (the slowest
rank's median over the measured rounds after the measurements' last piece): the smallest runs
on, and a compressed one only where it is more than :data:`TOLERANCE` sooner than dense over
float16, which otherwise runs from the next round, taking over the memory.  Rank 0 prints a line
after each trial: the contender it tries next, or what it kept or switched to, with the measured
steps.

The decision is part of the exchange's state (``auto`` in :meth:`GradientExchange.get_state`),
saved in checkpoints: a run resumed after the decision runs the same choice without measuring
again (one resumed during a trial runs that contender's trial anew, against the saved dense
step and the contenders' saved steps).  Rank 0
prints one line at the decision: the choice, the prediction it rests on, and the
arguments that pin it.
"""
from __future__ import annotations

import dataclasses
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np

from .collectives.alphabeta import AlphaBeta, fit_alpha_beta, round_trips
from .collectives.hosts import host_ids
from .schedules import k_from_density
from .timing import shared_link, simulate
from .wire import get_wire

#: rounds run dense over float16 (and measured) before the choice: one, six with a piece of the
#: measurements (:data:`PROBES`) each, then three undisturbed ones -- the step a compressed choice's
#: trial is compared with, and the rounds the compute step is taken from
MEASURE_ROUNDS = 10
#: rounds a compressed choice runs on trial before its own measured step confirms it (the first of
#: them, with the switch in it, not counted): the timing model's prediction of a step is only a
#: prediction -- on a busy node or a fast link it can be off by 2x (docs/choosing.md)
TRIAL_ROUNDS = 5
#: a candidate is preferred to an earlier one only when predicted this much sooner (the
#: measurements' noise: two settings closer than that are a tie, and the earlier one wins)
TOLERANCE = 0.03
#: compressed candidates run on trial, one after another, at most: the chosen one and the next
#: best predicted (:attr:`Decision.contenders`) -- where the timing model's error (2x either way)
#: could swap them, their measured steps decide (measured at 1 Gbit/s on the 17.1M MLP, the
#: model priced dense over int8 ahead of gTop-k, whose measured step made it the faster to dense
#: float32's accuracy)
CONTENDERS = 2
#: the next best compressed candidate runs on trial too where predicted within this factor of the
#: chosen one's score (the timing model's error on a busy node)
SPREAD = 2.0
#: what :class:`Probe` does after each of the first measured rounds, in order: ``(bytes, round
#: trips)`` pairs between rank 0 and its peer (the first round trip of each size untimed; 4 MiB is
#: past the emulated links' token bucket, and one round trip of it is 70 ms at 1 Gbit/s, 0.7 s at
#: 100 Mbit/s: one per piece), or ``None``: rank 0 times the candidates' local work
PROBES = (((8, 3), (1 << 20, 3)), ((4 << 20, 1),), ((4 << 20, 1),), ((4 << 20, 1),), ((4 << 20, 1),), None)
#: the local work is timed on at most this many elements and scaled
PROFILE_ELEMENTS = 1 << 20
#: the two-level exchange's copies and adds are timed on this many elements (32 MB: beyond the caches)
TWO_LEVEL_PROFILE = 1 << 23
#: the gradient's concentration (:func:`top_share`: the share of its energy in its largest 1 % of
#: entries, over the measured rounds) at or above which a sparse candidate is priced
#: :data:`CONCENTRATED_SAVING` fewer epochs (:func:`epochs_of`): as auto measured it (one seed each,
#: 1 Gbit/s, four ranks), 0.57 on the 17.1M MLP, 0.53 on the convolutional model and 0.72 on the
#: Transformer, where gTop-k needed 0.5-1.5 times dense's epochs (docs/choosing.md, "What it decides")
CONCENTRATED = 0.65
#: the epochs a sparse candidate is priced fewer on a concentrated gradient: gTop-k 1.5, the most
#: it needed on the Transformer and on the 17.1M MLP, against the 2.0 of the convolutional model
CONCENTRATED_SAVING = 0.5
#: the concentration is measured on a strided sample of about this many elements of the gradient
CONCENTRATION_SAMPLE = 1 << 18
#: the concentration where it was not measured (a device's gradients, a state saved before it was kept)
UNMEASURED = -1.0


@dataclass(frozen=True)
class Candidate:
    """One setting auto may choose: ``algorithm`` at ``density`` over ``wire_dtype``.

    ``epochs``: the epochs it needs to reach dense float32's accuracy, relative to dense float32
    (1.0: as many) -- the values of docs/choosing.md ("What it decides"), from the digits models.
    The 16-bit wires keep dense float32's curve (1.0).  gTop-k is priced at what it needed on the
    model where it needed the most, not the typical, so that it is chosen only where it pays on a
    bad model and seed too: with momentum correction (what ``memory="auto"`` gives a sparse
    algorithm under an SGD with momentum), after auto's ten dense rounds, it reached dense float32's
    target on the 17.1M MLP in 10, 9 and 9 epochs where dense took 9, 6 and 10 (1.1, 1.5 and 0.9
    times), and on the convolutional model in 10 where dense took 6, or not within 10 epochs where
    dense took 5-7 (on two hosts, in six seeds of seven): **2.0**, the most an epoch budget of ten
    can show against dense's five (until 2026-12-02 it was priced at the MLP's 1.5, which kept it on
    the convolutional model).  Top-k and Ok-Topk stayed below that target within 10 epochs where
    dense took 9 and gTop-k took 10 (0.969, 0.973 against 0.9835): 2.5 is assumed, more than
    gTop-k's.  Dense over
    int8 with momentum correction reached it in dense float32's own epochs or fewer in every seed
    on both the 17.1M MLP and the convolutional model (9, 6, 10 and 6, 6, 5 where dense took 9, 6,
    10 and 7, 6, 5): 1.0.  Dense over int4 with momentum correction followed dense float16's test
    accuracy within three test images, epoch by epoch, on the convolutional model (pinned from the
    first step, three seeds; docs/choosing.md, "Dense over int4"): 1.0."""

    algorithm: str
    density: float
    wire_dtype: str
    epochs: float

    @property
    def label(self) -> str:
        """The candidate as rank 0's lines name it: ``"dense over float16"``, ``"gtopk at density 0.01"``
        (followed by ``" over <wire>"`` for a sparse candidate on a wire other than float32)."""
        if self.algorithm == "dense":
            return f"dense over {self.wire_dtype}"
        return f"{self.algorithm} at density {self.density}" + (
            f" over {self.wire_dtype}" if self.wire_dtype != "float32" else "")

    @property
    def compressed(self) -> bool:
        """Whether it sends less than 16 bits a gradient element -- a sparse algorithm, or a dense
        one over int8 or int4: its epochs were measured with momentum correction only (it takes part where
        the exchange runs one, :func:`choose`'s ``sparse``), and a choice of it runs on trial
        (:data:`TRIAL_ROUNDS`) -- its step rests most on the timing model's prediction."""
        return self.algorithm != "dense" or get_wire(self.wire_dtype).value_bytes < 2

    def pin(self) -> str:
        """The arguments that pin this choice.

        Returns:
          Text such as ``algorithm='gtopk', density=0.01``.
        """
        parts = [f"algorithm={self.algorithm!r}"]
        if self.algorithm != "dense":
            parts.append(f"density={self.density}")
        if self.wire_dtype != "float32":
            parts.append(f"wire_dtype={self.wire_dtype!r}")
        return ", ".join(parts)


CANDIDATES: tuple[Candidate, ...] = (
    Candidate("dense", 1.0, "float32", 1.0),
    Candidate("dense", 1.0, "bfloat16", 1.0),
    Candidate("dense", 1.0, "float16", 1.0),
    Candidate("gtopk", 0.01, "float32", 2.0),
    Candidate("topk", 0.01, "float32", 2.5),
    Candidate("oktopk", 0.01, "float32", 2.5),
    Candidate("dense", 1.0, "int8", 1.0),
    Candidate("dense", 1.0, "int4", 1.0),  # (appended: the order is part of the saved state's format)
)
#: what the measured rounds run (the index into :data:`CANDIDATES`): dense over float16
MEASURING = next(i for i, c in enumerate(CANDIDATES) if c.algorithm == "dense" and c.wire_dtype == "float16")


def epochs_of(candidate: Candidate, concentration: float = UNMEASURED) -> float:
    """The epochs ``candidate`` is priced at: :attr:`Candidate.epochs`, less :data:`CONCENTRATED_SAVING`
    for a sparse one where ``concentration`` -- the share of the gradient's energy in its largest 1 %
    of entries (:func:`top_share`; :data:`UNMEASURED`: not measured) -- is at least
    :data:`CONCENTRATED` (its top-k keeps most of it)."""
    if candidate.algorithm != "dense" and concentration >= CONCENTRATED:
        return candidate.epochs - CONCENTRATED_SAVING
    return candidate.epochs


def energy_sample(x, start: int, n: int, sample: int = CONCENTRATION_SAMPLE) -> np.ndarray:
    """The squares (float64) of the entries of a gradient of ``n`` elements that a stride of
    ``ceil(n / sample)`` takes, among those of its part ``x`` that starts at element ``start`` (a
    bucket): the buckets' samples of a round, joined, are one sample of the whole gradient, every
    entry of equal weight."""
    stride = -(-int(n) // int(sample))
    return np.square(np.asarray(x).reshape(-1)[(-int(start)) % stride::stride], dtype=np.float64)


def top_share(squares, density: float = 0.01) -> float:
    """The share of ``squares``' sum (a sample's energy, :func:`energy_sample`) in its largest
    ``density`` of entries (at least one) -- the gradient's concentration; :data:`UNMEASURED` where
    the sum is zero or not finite."""
    squares = np.asarray(squares, np.float64).reshape(-1)
    total = float(squares.sum())
    if not (total > 0.0 and np.isfinite(total)):
        return UNMEASURED
    k = max(1, int(round(density * squares.size)))
    return float(np.partition(squares, squares.size - k)[squares.size - k:].sum() / total)


@dataclass(frozen=True)
class Prediction:
    """One candidate as :func:`predict` prices it.

    Attributes:
      candidate: the :class:`Candidate`.
      comm_s: the exchange's communication per step, seconds: the timing model's, plus the hosts' sums
        and broadcasts for a two-level exchange.
      local_s: its local work per step (selection, encoding, decoding), seconds, from the measurements.
      step_s: the predicted step: compute + ``comm_s`` + ``local_s``.
      score: ``step_s * epochs``, proportional to the time to accuracy.
      epochs: the epochs it is priced at (:func:`epochs_of`).
    """

    candidate: Candidate
    comm_s: float  # the exchange's communication, timing model
    local_s: float  # its local work (selection, encoding, decoding), measured
    step_s: float  # compute + comm + local
    score: float  # step_s * epochs: proportional to the time to accuracy
    epochs: float = 1.0


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` chose and why."""

    index: int  # into CANDIDATES
    compute_s: float
    link: AlphaBeta | None
    predictions: tuple[Prediction, ...]
    two_level: bool = False  # the chosen candidate in two levels (hosts' sums across hosts)
    #: dense over float16's measured step: the slowest rank's median over the undisturbed measured rounds
    reference_s: float = 0.0
    #: rounds the choice runs on trial (a compressed choice: :data:`TRIAL_ROUNDS`; 0: none)
    trial_rounds: int = 0
    #: ranks per core on the busiest host (:func:`oversubscription`): the local work's factor
    busy: float = 1.0
    #: the link the round trips measured, where :attr:`link`'s bandwidth is the measured rounds'
    #: (:func:`calibrated`); None: :attr:`link` is the round trips'
    probed: AlphaBeta | None = None
    #: the compressed candidates that run on trial, in order (the chosen one first; :data:`CONTENDERS`
    #: at most); empty for a choice without a trial
    contenders: tuple[int, ...] = ()
    #: the gradient's concentration over the measured rounds (:func:`top_share`; :data:`UNMEASURED`)
    concentration: float = UNMEASURED

    @property
    def candidate(self) -> Candidate:
        """The chosen :class:`Candidate` (``CANDIDATES[index]``)."""
        return CANDIDATES[self.index]

    def describe(self, workers: int, hosts: int | None = None) -> str:
        """The line rank 0 prints at the decision.

        Args:
          workers: the ranks.
          hosts: the hosts, where two levels were an option; None: not named.

        Returns:
          One line: the choice, why (predicted steps, the link), the trial, and how to pin it.
        """
        if hosts is not None and self.two_level:
            workers, two = f"{workers} ranks on {hosts} hosts (two-level)", ", hierarchical=True"
        else:
            workers, two = f"{workers} ranks" + (f" on {hosts} hosts (flat)" if hosts else ""), ""
        if not self.predictions:
            verb = "kept" if self.index == MEASURING else "chose"
            return (f"tfsparse: algorithm='auto' {verb} {self.candidate.label} for {workers} (the link could "
                    f"not be measured). Pin it with {self.candidate.pin()}{two}")
        chosen = self.predictions[self.index]
        f16 = next(p for p in self.predictions if p.candidate.algorithm == "dense" and
                   p.candidate.wire_dtype == "float16")
        link = "one rank, no link" if self.link is None else f"link {self.link}"
        if self.probed is not None and self.link is not None and self.probed.beta != self.link.beta:
            link += (f" (its bandwidth from dense over float16's measured rounds; round trips: "
                     f"{self.probed})")
        if self.busy > 1.0 and not self.two_level:  # (in two levels the leaders alone do it)
            link += f", local work x{self.busy:.3g} (more ranks than cores on a host)"
        why = (f"predicted step {1e3 * chosen.step_s:.0f} ms (compute {1e3 * self.compute_s:.0f} ms, exchange "
               f"{1e3 * (chosen.comm_s + chosen.local_s):.0f} ms), x{chosen.epochs} epochs")
        if chosen is not f16:
            why += f"; dense over float16: {1e3 * f16.step_s:.0f} ms, x{f16.epochs}"
        if self.concentration >= 0.0:
            why += f"; the largest 1 % of the gradient held {100 * self.concentration:.0f} % of its energy"
        then = "".join(f", then {CANDIDATES[i].label} for {self.trial_rounds} rounds" for i in self.contenders[1:])
        trial = "" if not self.trial_rounds else (
            f"; on trial for {self.trial_rounds} rounds{then}, against dense over float16's measured step "
            f"({1e3 * self.reference_s:.0f} ms){' and each other' if then else ''}")
        return (f"tfsparse: algorithm='auto' chose {chosen.candidate.label} for {workers} -- {why}; "
                f"{link}{trial}. Pin it with {chosen.candidate.pin()}{two}")


@dataclass(frozen=True)
class Verdict:
    """The end of a compressed choice's trial (:func:`confirm`): the candidate that runs on --
    of the contenders measured so far and dense over float16."""

    index: int  # into CANDIDATES: a tried one, or MEASURING (dense over float16)
    tried: int  # the candidate on trial last
    step_s: float  # its measured step, the slowest rank's median
    reference_s: float  # dense over float16's measured step
    #: the contenders tried before it and their measured steps: ``(index, seconds)`` pairs
    earlier: tuple[tuple[int, float], ...] = ()
    #: the gradient's concentration the epochs were priced at (:func:`epochs_of`)
    concentration: float = UNMEASURED

    @property
    def measured(self) -> tuple[tuple[int, float], ...]:
        """Every contender tried, in order, with its measured step (the last: :attr:`tried`)."""
        return self.earlier + ((self.tried, self.step_s),)

    def _steps(self) -> str:
        dense = CANDIDATES[MEASURING]
        tried = "; ".join(f"{CANDIDATES[i].label} measured {1e3 * s:.0f} ms a step, "
                          f"x{epochs_of(CANDIDATES[i], self.concentration)} epochs" for i, s in self.measured)
        return f"{tried}, against dense over float16's {1e3 * self.reference_s:.0f} ms, x{dense.epochs}"

    def describe(self, two_level: bool = False) -> str:
        """The line rank 0 prints at the trial's end.

        The candidate kept, or the switch to another (dense over float16, or a contender tried
        earlier), and the arguments that pin it where it is not the one the decision's line named.

        Args:
          two_level: the choice runs in two levels (the pin adds ``hierarchical=True``).

        Returns:
          One line.
        """
        chosen = CANDIDATES[self.index]
        pin = f". Pin it with {chosen.pin()}{', hierarchical=True' if two_level else ''}"
        if self.index == self.tried:  # the second contender: the decision's line pinned the first
            return f"tfsparse: algorithm='auto' keeps {chosen.label} -- {self._steps()}" + (pin if self.earlier else "")
        return f"tfsparse: algorithm='auto' switches to {chosen.label} -- {self._steps()}" + pin

    def describe_next(self, index: int) -> str:
        """The line rank 0 prints where another contender runs on trial next.

        Args:
          index: that contender, an index into :data:`CANDIDATES`.

        Returns:
          One line.
        """
        return f"tfsparse: algorithm='auto' tries {CANDIDATES[index].label} next -- {self._steps()}"


def _slowest(comm, values) -> np.ndarray:
    """Collective: the element-wise largest of every rank's ``values`` (the slowest rank's times)."""
    own = np.asarray(values, np.float64)
    if comm.size == 1:
        return own
    return np.max(np.array([np.asarray(v, np.float64) for v in comm.allgather(own)]), axis=0)


def confirm(comm, tried: int, reference_s: float, periods, earlier=(),
            concentration: float = UNMEASURED) -> Verdict:
    """Collective, every rank at the same round: the end of a candidate's trial.

    Each contender's measured step (the slowest rank's median) times its
    epochs (:func:`epochs_of`), and dense over float16's measured step: the smallest wins, and as
    :func:`choose` breaks ties, the first in :data:`CANDIDATES` order within :data:`TOLERANCE` of
    it -- dense over float16 before any compressed one.  Every rank returns the same verdict.

    Args:
      comm: the communicator (every rank calls it).
      tried: the candidate on trial (an index into :data:`CANDIDATES`).
      reference_s: dense over float16's measured step, seconds.
      periods: this rank's seconds between consecutive rounds' starts on trial.
      earlier: the contenders tried before, ``(index, measured step)`` pairs.
      concentration: the decision's (:attr:`Decision.concentration`).

    Returns:
      A :class:`Verdict`.
    """
    step = float(_slowest(comm, [float(np.median(periods)) if len(periods) else np.inf])[0])
    earlier = tuple((int(i), float(s)) for i, s in earlier)
    scores = {MEASURING: float(reference_s) * CANDIDATES[MEASURING].epochs}
    for i, s in earlier + ((tried, step),):
        scores[i] = s * epochs_of(CANDIDATES[i], concentration)
    best = min(scores.values())
    index = next(i for i in sorted(scores) if scores[i] <= best * (1.0 + TOLERANCE))
    return Verdict(index, tried, step, float(reference_s), earlier, float(concentration))


def predict(candidate: Candidate, n: int, workers: int, link: AlphaBeta | None, compute_s: float,
            local_s: float, hosts: tuple[int, int] | None = None, two_level_s: float = 0.0,
            concentration: float = UNMEASURED) -> Prediction:
    """The predicted step and score of ``candidate`` for a gradient of ``n`` elements.

    Args:
      candidate: a :class:`Candidate`.
      n: the gradient's elements.
      workers: the ranks that run the algorithm.
      link: the link (None: one rank, nothing sent).
      compute_s: the compute step, seconds.
      local_s: the candidate's local work, seconds.
      hosts: ``(hosts, ranks per host)`` where the ranks share their host's link (on several hosts,
        the flat exchange's ranks of one host send across the network together: each gets a share
        of its bandwidth; on one host nothing crosses a host's link, and ``link`` is what was
        measured between two of its ranks); None: every rank has its own.
      two_level_s: > 0: the two-level exchange instead -- the algorithm among the hosts over the
        whole link, plus ``two_level_s`` for the hosts' sums and broadcasts.
      concentration: the gradient's (:func:`epochs_of`); :data:`UNMEASURED`: not measured.

    Returns:
      A :class:`Prediction` (step and score: step × epochs).
    """
    comm_s = 0.0
    if hosts is not None and two_level_s > 0:
        workers = hosts[0]
    elif hosts is not None and hosts[0] > 1 and link is not None:
        link = shared_link(link, hosts[1])
    if link is not None and workers > 1:
        value_bytes = get_wire(candidate.wire_dtype).nbytes(n) / n  # with int8's and int4's scales
        comm_s = simulate(candidate.algorithm, workers, n, candidate.density, link, value_bytes=value_bytes).seconds
    comm_s += two_level_s
    step = compute_s + comm_s + local_s
    epochs = epochs_of(candidate, concentration)
    return Prediction(candidate, comm_s, local_s, step, step * epochs, epochs)


def choose(n: int, workers: int, link: AlphaBeta | None, compute_s: float, local_s, sparse: bool = True,
           hosts: tuple[int, int] | None = None, two_level_s: float = 0.0, busy: float = 1.0,
           concentration: float = UNMEASURED) -> Decision:
    """The first candidate whose predicted time to accuracy is within :data:`TOLERANCE` of the smallest.

    Dense float32 comes first: where the predictions differ by less than their noise, the simpler
    and lossless setting wins.  Where a two-level exchange is an option, each candidate is priced
    flat (the host's ranks sharing its link) and in two levels, and the flat one is kept unless the
    two-level one is predicted more than :data:`TOLERANCE` shorter.

    Args:
      n: the gradient's elements.
      workers: the ranks.
      link: the link (None: one rank).
      compute_s: the compute step, seconds.
      local_s: each candidate's measured local work, seconds, in :data:`CANDIDATES` order.
      sparse: whether the compressed candidates (:attr:`Candidate.compressed`) take part (False:
        dense over 16 or 32 bits alone).
      hosts: ``(hosts, ranks per host)`` where a two-level exchange is an option (several hosts,
        some of several ranks); None: not.
      two_level_s: the two-level exchange's sums and broadcasts inside the hosts, seconds.
      busy: the factor ``local_s`` carries for ranks that share cores (:func:`oversubscription`):
        in two levels only each host's leader does the local work while its other ranks wait
        quietly (:mod:`tfsparse.hierarchy`), so there it is priced without it.
      concentration: the gradient's, which prices the sparse candidates' epochs (:func:`epochs_of`).

    Returns:
      A :class:`Decision` (with the contenders that run on trial).
    """
    def priced(two_level_s, factor):
        return tuple(predict(c, n, workers, link, compute_s, float(t) / factor, hosts, two_level_s,
                             float(concentration)) for c, t in zip(CANDIDATES, local_s))

    def made(predictions, index, two_level=False):
        return Decision(index, compute_s, link, predictions, two_level=two_level, concentration=float(concentration),
                        contenders=_contenders(predictions, allowed, index))

    flat = priced(0.0, 1.0)
    allowed = [i for i, c in enumerate(CANDIDATES) if sparse or not c.compressed]
    best = min(flat[i].score for i in allowed)
    index = next(i for i in allowed if flat[i].score <= best * (1.0 + TOLERANCE))
    if hosts is None or hosts[0] < 2 or hosts[1] < 2 or link is None:
        return made(flat, index)
    two = priced(max(two_level_s, 1e-9), max(1.0, busy))
    best_two = min(two[i].score for i in allowed)
    if best_two * (1.0 + TOLERANCE) >= flat[index].score:
        return made(flat, index)
    return made(two, next(i for i in allowed if two[i].score <= best_two * (1.0 + TOLERANCE)), two_level=True)


def _contenders(predictions, allowed, index: int) -> tuple[int, ...]:
    """The compressed candidates that run on trial where ``index`` is chosen: itself, then the
    next best predicted compressed ones within :data:`SPREAD` of its score (:data:`CONTENDERS` in
    all); none where the choice is not compressed."""
    if not CANDIDATES[index].compressed:
        return ()
    limit = predictions[index].score * SPREAD
    rest = sorted((i for i in allowed if i != index and CANDIDATES[i].compressed and predictions[i].score <= limit),
                  key=lambda i: (predictions[i].score, i))
    return (index,) + tuple(rest[:CONTENDERS - 1])


def two_level_costs(n: int, per_host: int) -> float:
    """The two-level exchange's work inside a host for a gradient of ``n`` float32 elements.

    ``ceil(log2 per_host)`` levels of a binomial tree up (a vector received and added at each)
    and as many down (the result broadcast) -- a copy and an add timed here on
    :data:`TWO_LEVEL_PROFILE` elements (beyond the caches, as the gradient is) and scaled to
    ``n``.  The same for every candidate: a sparse result crosses the host as indices and values
    (:mod:`tfsparse.hierarchy`), but where a host runs more ranks than cores the rank it goes to
    is often not running when it is ready, and the share was measured to take as long as a dense
    broadcast (docs/cluster.md).

    Args:
      n: the gradient's elements.
      per_host: the ranks of a host.

    Returns:
      Seconds (0 for one rank per host).
    """
    if per_host < 2:
        return 0.0
    m = int(min(n, TWO_LEVEL_PROFILE))
    a, b = np.ones(m, np.float32), np.full(m, 0.5, np.float32)
    copy = _best_seconds(lambda: np.copyto(a, b))
    add = _best_seconds(lambda: np.add(a, b, out=a))
    return (per_host - 1).bit_length() * (2 * copy + add) * n / m


def _best_seconds(fn, repeats: int = 2) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def local_costs(n: int, workers: int) -> np.ndarray:
    """Each candidate's local work on a gradient of ``n`` elements, timed here.

    The selection of ``k`` of ``n`` (the sparse candidates; decoding P payloads adds a scatter of
    ``P·k`` values, counted as 5 % per rank) and a dense wire's encoding and decoding -- timed on
    at most :data:`PROFILE_ELEMENTS` elements and scaled to ``n`` (both are one pass over the
    vector).

    Args:
      n: the gradient's elements.
      workers: the ranks.

    Returns:
      Seconds per candidate, in :data:`CANDIDATES` order (0 for the lossless dense wire).
    """
    from . import ops

    m = int(min(n, PROFILE_ELEMENTS))
    x = np.random.default_rng(0).random(m, dtype=np.float32) - np.float32(0.5)
    out = np.zeros(len(CANDIDATES))
    selection: dict = {}
    for i, c in enumerate(CANDIDATES):
        if c.algorithm == "dense":
            wire = get_wire(c.wire_dtype)
            if not wire.lossy:
                continue

            def code(wire=wire):
                wire.decode(wire.encode(x), m)
            out[i] = _best_seconds(code) * n / m
        else:
            k = k_from_density(m, c.density)
            if k not in selection:
                selection[k] = _best_seconds(lambda: ops.topk_abs(x, k)) * (1.0 + 0.05 * workers) * n / m
            out[i] = selection[k]
    return out


def oversubscription(ranks: int, cores: int | None = None) -> float:
    """How many ranks share each core of a host, at least 1.

    The factor by which the local work timed alone on a core (:func:`local_costs`) takes longer
    when every rank of the host does it at once -- the timing model's rule for ranks that share
    cores (``max(1, busy / cores)``, :mod:`tfsparse.collectives.simulate`); four ranks on two
    cores: 2.

    Args:
      ranks: the ranks the host runs.
      cores: its cores; None: this host's (``os.cpu_count()``).

    Returns:
      A float >= 1.
    """
    cores = (os.cpu_count() or 1) if cores is None else int(cores)
    return max(1.0, int(ranks) / max(1, cores))


def calibrated(link: AlphaBeta, n: int, workers: int, exchange_s: float, local_s: float,
               hosts: tuple[int, int] | None = None) -> AlphaBeta:
    """``link`` with the bandwidth that makes the model's dense float16 exchange take what the measured rounds took.

    The round trips of a few MiB that ``link`` was fitted to are a few milliseconds on a fast
    link, where a rank that waits for a core adds as much: on a busy node their bandwidth can be
    off by an order of magnitude either way (docs/choosing.md).  The latency stays the fitted
    one; an exchange no longer than its latency terms leaves the bandwidth unbounded (1e13 B/s),
    one that cannot be measured (0) leaves ``link`` as it is.

    Args:
      link: the fitted link.
      n: the gradient's elements.
      workers: the ranks.
      exchange_s: the measured rounds' median exchange, seconds (tens of megabytes through the
        collective itself).
      local_s: dense over float16's measured local work, seconds.
      hosts: as :func:`predict` takes it.

    Returns:
      An :class:`~tfsparse.collectives.AlphaBeta`.
    """
    target = exchange_s - local_s
    if not exchange_s > 0.0 or workers < 2:
        return link
    measuring = CANDIDATES[MEASURING]

    def comm(beta):
        return predict(measuring, n, workers, AlphaBeta(link.alpha, beta), 0.0, 0.0, hosts).comm_s

    lo, hi = 1e5, 1e13  # bytes/s: 0.8 Mbit/s to 80 Tbit/s
    if comm(hi) >= target:
        return AlphaBeta(link.alpha, hi)
    if comm(lo) <= target:
        return AlphaBeta(link.alpha, lo)
    for _ in range(60):  # bisection in log(beta): comm falls as beta grows
        mid = float(np.sqrt(lo * hi))
        lo, hi = (lo, mid) if comm(mid) < target else (mid, hi)
    return AlphaBeta(link.alpha, float(np.sqrt(lo * hi)))


def _peer(comm) -> tuple[int, tuple[int, int]]:
    """The rank whose link to rank 0 auto measures: the first rank on another host than rank 0
    (the network, where there is one), else rank 1; and ``(hosts, most ranks on one host)``
    (collective: one allgather of a hostname hash)."""
    hosts = host_ids(comm)
    peer = next((r for r, h in enumerate(hosts) if h != hosts[0]), 1)
    return peer, (len(set(hosts)), max(hosts.count(h) for h in set(hosts)))


class Probe:
    """Auto's measurements of the link and of the local work, taken in pieces between the measured rounds.

    The exchange runs piece ``i`` of :data:`PROBES` (:meth:`run`) on its communication thread
    after the ``i+1``-th measured round's last bucket, where it overlaps the ranks' computation of
    the next gradients instead of lengthening a step.  Every rank runs every piece, at the same
    point of its communication (the first one has collectives: the peer's choice and a duplicate
    communicator, so the pings never count in the exchange's traffic).

    Args:
      n: the gradient's elements.
    """

    def __init__(self, n: int):
        self.n = int(n)
        self.done = 0  # pieces run
        self.submitted = 0  # pieces handed to the communication thread (the exchange's count)
        self.peer = 1
        self.link = None  # the duplicate communicator the round trips use
        self.times: dict[int, list[float]] = {}  # rank 0: one-way seconds per message size
        self.local = np.zeros(len(CANDIDATES))  # rank 0: each candidate's local work, seconds
        self.hosts = (1, 1)  # (hosts, most ranks on one host)
        self.two_level_s = 0.0  # rank 0: the two-level exchange's work inside a host, seconds
        self.busy = 1.0  # rank 0: ranks per core on the busiest host (oversubscription)

    def run(self, comm, index: int) -> None:
        """Runs piece ``index`` of :data:`PROBES` (collective; every rank, in order).

        Args:
          comm: the exchange's communicator.
          index: the piece; it must be the next one.

        Raises:
          RuntimeError: a piece out of order.
        """
        if index != self.done:
            raise RuntimeError(f"auto's measurement {index} ran after {self.done} of {len(PROBES)}")
        if index == 0 and comm.size > 1:
            self.peer, self.hosts = _peer(comm)
            self.link = comm.duplicate()
        piece = PROBES[index]
        if piece is None:
            if comm.rank == 0 and comm.size > 1:  # one rank: nothing to send, dense float32 costs nothing more
                self.busy = oversubscription(self.hosts[1])
                self.local = local_costs(self.n, comm.size) * self.busy
                if self.hosts[0] > 1:
                    self.two_level_s = two_level_costs(self.n, self.hosts[1]) * self.busy
        elif self.link is not None:
            for nbytes, count in piece:
                self.times.setdefault(nbytes, []).extend(round_trips(self.link, nbytes, count, self.peer))
        self.done = index + 1

    def finish(self, comm) -> None:
        """Runs the pieces not run yet (collective).

        Args:
          comm: the exchange's communicator.
        """
        for index in range(self.done, len(PROBES)):
            self.run(comm, index)

    def fit(self) -> AlphaBeta:
        """Rank 0: α and β fitted to the median one-way time of each size (its first round trip untimed).

        Where noise on a busy node hides the growth with the size there, fitted to the fastest
        instead (contention only adds time).

        Returns:
          An :class:`~tfsparse.collectives.AlphaBeta`.

        Raises:
          ValueError: neither fits.
        """
        sizes = sorted(self.times)
        timed = [self.times[s][1:] or self.times[s] for s in sizes]
        try:
            return fit_alpha_beta(sizes, [float(np.median(t)) for t in timed])
        except ValueError:
            return fit_alpha_beta(sizes, [float(np.min(t)) for t in timed])


def decide(comm, n: int, periods, rounds, sparse: bool = True, probe: Probe | None = None,
           workers: int | None = None, two_level: bool = True,
           concentration: float = UNMEASURED) -> Decision:
    """Collective, every rank at the same round: the choice for a gradient of ``n`` elements.

    Every rank returns the same decision.  A link whose round-trip times cannot be fitted (noise
    on a busy node) leaves the measured setting, dense over float16, on every rank, with a warning.

    Args:
      comm: the exchange's communicator.
      n: the gradient's elements.
      periods: this rank's seconds between consecutive measured rounds' starts.
      rounds: the earlier round's exchange, seconds, per period.
      sparse: whether the compressed candidates (sparse algorithms, dense over int8 or int4) may be chosen
        (their epochs are measured with momentum correction only).
      probe: the :class:`Probe` whose pieces were run between the rounds (the rest run now); None:
        all of them now.
      workers: how many run the algorithm (default every rank of ``comm``; a two-level exchange
        the user asked for: the hosts).
      two_level: whether the two-level exchange may be chosen (on several hosts, some of several
        ranks; :func:`choose`).
      concentration: rank 0's measure of the measured rounds' summed gradients (:func:`top_share`;
        every rank's sums are the same), broadcast; :data:`UNMEASURED`: not measured.

    Returns:
      A :class:`Decision`.
    """
    probe = Probe(n) if probe is None else probe
    probe.finish(comm)
    clean = list(periods[len(PROBES) + 1:]) or list(periods)  # the rounds no piece of the probe ran in
    exchanged = list(rounds[len(PROBES) + 1:]) or list(rounds)
    # the compute step from those alone: a piece of the probe that outlasts the computation it
    # overlaps (a 4 MiB round trip is 0.7 s at 100 Mbit/s) lengthens its period, not its round
    own = [p - r for p, r in zip(clean, exchanged)]
    # the medians of this rank's compute step, of a clean round's period and of its exchange
    medians = np.array([max(0.0, float(np.median(own))) if own else 0.0,
                        float(np.median(clean)) if clean else 0.0,
                        float(np.median(exchanged)) if exchanged else 0.0])
    link = None
    if comm.size > 1:
        medians = _slowest(comm, medians)
        fitted, error = np.array([np.nan, np.nan, concentration]), ""  # (rank 0's concentration broadcast too)
        if comm.rank == 0:
            try:
                ab = probe.fit()
                fitted[:2] = (ab.alpha, ab.beta)
            except ValueError as e:
                error = str(e)
        fitted = comm.bcast(fitted if comm.rank == 0 else None, root=0, shape=(3,), dtype=np.float64)
        concentration = float(fitted[2])
        if not np.all(np.isfinite(fitted[:2])):  # on every rank alike (rank 0's fit, broadcast)
            why = error or "rank 0 could not fit the round-trip times"
            warnings.warn(f"tfsparse: algorithm='auto' could not measure the link ({why}); it keeps dense over "
                          f"float16", RuntimeWarning, stacklevel=2)
            return Decision(MEASURING, float(medians[0]), None, (), concentration=concentration)
        link = AlphaBeta(alpha=float(fitted[0]), beta=float(fitted[1]))
    compute_s, reference_s, exchange_s = (float(m) for m in medians)
    # rank 0's timing of the local work, of the two-level exchange's inside a host, and its factor
    local = comm.bcast(np.append(probe.local, [probe.two_level_s, probe.busy]), root=0)
    probed, flat_hosts = link, (probe.hosts if two_level else None)  # as choose prices the flat exchange
    if link is not None and workers is None:  # the measured rounds ran flat: the link they used
        link = calibrated(link, n, comm.size, exchange_s, float(local[MEASURING]), flat_hosts)
    busy = float(local[-1])
    if workers is not None:  # in two levels already (hierarchical=True): the leaders alone do the local work
        decision = choose(n, int(workers), link, compute_s, local[:-2] / max(1.0, busy), sparse,
                          concentration=concentration)
    else:
        decision = choose(n, comm.size, link, compute_s, local[:-2], sparse, flat_hosts, float(local[-2]), busy,
                          concentration)
    trial = TRIAL_ROUNDS if decision.candidate.compressed and link is not None else 0
    return dataclasses.replace(decision, reference_s=reference_s, trial_rounds=trial, busy=busy,
                               probed=probed, contenders=decision.contenders if trial else ())
