"""Message-schedule simulator: the machinery that prices each aggregator's rounds under the α-β-γ
model, to 1024 workers.

Pure numpy, no MPI.  For ``P`` workers, a bucket of ``n`` gradient elements and ``k`` of them to
send (``k = ceil(density * n)``, :func:`tfsparse.schedules.k_from_density`, as the exchange
computes it), an aggregator declares the messages one exchange step sends to a :class:`Builder`
-- the collectives it calls, with the sizes it calls them with (float32 values by default,
int32 indices below 2**31 elements: the float32 wire's ``[indices | values]`` messages) -- into
a :class:`Schedule`, and :func:`price` prices it:

    seconds = Σ_rounds (alpha · messages + (bytes - free) / beta) + gamma · elements

* a **round** (:class:`Round`) is one communication step all ranks take together: ``messages``
  and ``bytes`` are the maximum over ranks of the messages one rank starts and of the bytes it
  sends *or* receives in it (links are full duplex, each rank has its own: the emulated cluster
  of ``tfsparse-run --net``, the papers' α-β model -- gtopk-ssgd-shi2019 §II-D, oktopk-li2022
  §2); ``elements`` are the values the busiest rank adds, merges or selects in it;
* ``gamma`` (seconds per element, default 0) prices that local work -- the reductions and
  top-k merges *inside* the exchange.  The local selection before it (``encode``) and the
  residual update after it are not part of the model; leave gamma at 0 for the pure α-β
  model of the papers' Tables (gtopk-ssgd-shi2019 Table I, oktopk-li2022 Table 1);
* ``free`` are the bytes a token-bucket-shaped link lets through at once (``ab.burst``, default
  0: none): the bucket is full when the step starts and fills at ``beta`` while the link is
  idle (latency, local work), so a message after a pause passes its first ``burst`` bytes at
  once and back-to-back ring rounds pass only the first's (:func:`through_bucket`).  Real
  switches have no such burst; ``tfsparse-run --net`` has one (``tc tbf``, 128 KiB at 1 Gbit/s,
  one millisecond's worth at 10), and a model of its runs must be told it;
* ``cores`` (default None: every rank has its own) prices ranks that share a node's cores, as
  ``tfsparse-run --net`` does on one machine: a round whose local work ``busy`` ranks do at
  the same time takes ``max(1, busy / cores)`` times its ``gamma · elements`` (every rank in a
  ring step or Ok-Topk's rotation, only the receivers of a gTop-k tree round);
* ``bytes`` of the result is the most bytes one rank sends in the step, counted **exactly as**
  :class:`~tfsparse.collectives.Communicator` counts ``bytes_sent`` (ring allreduce
  ``2·nbytes·(P-1)/P``, ring allgather of all blocks but the successor's, binomial broadcast,
  direct alltoall, point-to-point payloads) -- ``tests/test_simulate.py`` runs the real
  aggregators on :class:`~tfsparse.collectives.InProcessWorld` and checks the equality.

Collectives' rounds.  A collective is priced as the faster of two classic algorithms (what an
MPI library's tuned decision picks by message size; Thakur, Rabenseifner and Gropp 2005, which
oktopk-li2022 §2 cites for its Table 1): the bandwidth-optimal one the byte counts describe and
a logarithmic-depth one with the same or more bytes in fewer rounds --

==============  ===================================  ===========================================
``allreduce``   ring reduce-scatter + ring allgather  recursive halving + doubling (Rabenseifner;
                ``2(P-1)`` rounds (gtopk Eq. 5)       surplus ranks folded in first, non-power-of-
                                                      two P), ``2⌈log2 P⌉`` rounds (oktopk Tab. 1)
``allgather``   ring, ``P-1`` rounds of the largest   Bruck, ``⌈log2 P⌉`` rounds of growing
                block                                 windows of blocks
``alltoall``    direct (pairwise), ``P-1`` rounds     Bruck, ``⌈log2 P⌉`` rounds of ~P/2 blocks
``bcast``       binomial tree, ``⌈log2 P⌉`` rounds    (the same; gtopk-ssgd-shi2019 §III-D)
==============  ===================================  ===========================================

The bytes counted (``bytes``) are always the first column's, as the Communicator counts them;
``prefer="ring"`` (:meth:`Schedule.seconds`) prices the first column where a phase has it (the
ring that DRAGONN's cost model, dragonn-wang2022 §4.2, assumes).

Per algorithm: each aggregator declares the schedule of its own exchange step next to its
code -- ``Aggregator.schedule(builder, n, k, step)`` calls the :class:`Builder` with the
collectives it runs, in order, and ``Aggregator.period()`` names its distinct steps (Ok-Topk's
re-evaluation and repartition steps, CSC's first step) -- see each module of
:mod:`tfsparse.aggregators`.  This layer knows only collectives; :mod:`tfsparse.timing` looks an
aggregator up by name, has it declare its schedule here and prices it (:func:`price`), and the
cost model (:mod:`tfsparse.selection`) prices the same schedules.  The fidelity test
(``tests/test_simulate.py``) runs the real aggregators and checks the bytes.

Left out: overlap with back-propagation and between buckets (one fused bucket is priced), the
local selection before the exchange, contention inside the switch (every rank has its own
full-duplex link into a non-blocking one), MPI's segmentation of large broadcasts, and, for
the data-dependent algorithms, how real gradients differ from uniformly spread selections
(ranks' top-k overlap shrinks Ok-Topk's reduced regions; hot regions trigger its balancing).

>>> from tfsparse.collectives import AlphaBeta
>>> from tfsparse.timing import simulate
>>> r = simulate("gtopk", 32, 25_200_000, 0.001, AlphaBeta.from_strings("1gbit", "50us"))
>>> r.seconds, r.bytes          # 0.0169 s, 1,008,040 bytes (rank 0's broadcasts)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .. import _checks
from ..wire import index_codec
from .alphabeta import AlphaBeta
from .communicator import binomial_children, split_counts

VALUE_BYTES = 4          # float32 wire


# -- the model's parts -------------------------------------------------------------------------

@dataclass(frozen=True)
class Round:
    """One communication step of all ranks (or, with ``messages == 0``, local work).

    Attributes:
      phase: what it belongs to (the aggregator's call, e.g. ``"allgather (index, value)"``).
      method: how the collective runs (``"ring"``, ``"bruck"``, ``"binomial"``, ``"tree"``, ...).
      messages: messages the busiest rank starts in the round (the α terms).
      bytes: the most bytes one rank sends or receives in the round (the β term).
      elements: values the busiest rank adds, merges or selects (the γ term).
      weight: the fraction of steps the round occurs in (1.0; less for Ok-Topk's periodic steps
        in a period mean).
      busy: the ranks that do this local work at the same time (they share ``cores``).
      free: of ``bytes``, those the link's token bucket let through at once (``AlphaBeta.burst``;
        set by :meth:`Schedule.rounds`).
    """

    phase: str
    method: str
    messages: int
    bytes: int
    elements: int = 0
    weight: float = 1.0
    busy: int = 1
    free: float = 0.0

    def local_seconds(self, gamma: float = 0.0, cores: int | None = None) -> float:
        """``gamma · elements · max(1, busy / cores)`` (unweighted).

        Args:
          gamma: seconds per element added, merged or selected.
          cores: the cores the round's ``busy`` ranks share; None: each has its own.

        Returns:
          Seconds, not weighted.
        """
        share = max(1.0, self.busy / cores) if cores else 1.0
        return gamma * self.elements * share

    def seconds(self, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None) -> float:
        """``weight · (alpha · messages + (bytes - free) / beta + gamma · elements · max(1, busy / cores))``.

        Args:
          ab: the link: ``alpha`` per message, ``beta`` for the bytes the token bucket did not free.
          gamma: seconds per element of the round's local work.
          cores: as :meth:`local_seconds` takes them.

        Returns:
          Seconds, weighted by :attr:`weight`.
        """
        return self.weight * (ab.alpha * self.messages + (self.bytes - self.free) / ab.beta
                              + self.local_seconds(gamma, cores))


def through_bucket(rounds, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None,
                   tokens: float | None = None) -> tuple:
    """``(rounds, tokens)``: ``rounds`` with :attr:`Round.free` set as a token bucket of depth
    ``ab.burst`` lets them through, starting with ``tokens`` bytes in it (None: full), and the
    tokens left.  The bucket fills at ``beta`` while the link is idle -- during each round's
    latency and its local work, which follows the transfer (a received block is reduced or
    merged after it arrived) -- and each round's bytes first take what it holds.  The same
    bucket shapes what a rank sends and what it receives (``tfsparse-run --net``), and a round's
    ``bytes`` are the larger of the two, so one bucket stands for both.

    Args:
      rounds: the rounds, in order.
      ab: the link, whose ``burst`` is the bucket's depth and ``beta`` its fill rate.
      gamma: seconds per element of local work (the bucket fills meanwhile).
      cores: the cores the ranks share; None: each has its own.
      tokens: the bytes in the bucket at the start; None: full.

    Returns:
      ``(rounds, tokens)``: the rounds with ``free`` set, and the bytes left in the bucket.
    """
    tokens = ab.burst if tokens is None else min(ab.burst, tokens)
    out = []
    for r in rounds:
        tokens = min(ab.burst, tokens + ab.alpha * r.messages * ab.beta)
        free = min(float(r.bytes), tokens)
        out.append(replace(r, free=free))
        tokens = min(ab.burst, tokens - free + r.local_seconds(gamma, cores) * ab.beta)
    return tuple(out), tokens


@dataclass(frozen=True, eq=False)
class Phase:
    """One call of the aggregator (a collective, a point-to-point exchange, local work) with
    its alternative round structures ``variants``: ``((method, rounds), ...)``."""

    name: str
    variants: tuple

    def best(self, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None, tokens: float | None = None,
             prefer: str | None = None) -> tuple:
        """``(rounds, tokens)``: the fastest variant's rounds under the model -- the variant named
        ``prefer`` where the phase has one -- starting with ``tokens`` in the link's token bucket
        (None: full), and the tokens left (:func:`through_bucket`).

        Args:
          ab: the link each variant is priced over.
          gamma: seconds per element of local work.
          cores: the cores the ranks share; None: each has its own.
          tokens: the bytes in the link's token bucket at the start; None: full.
          prefer: the variant to take where the phase has one of that name; None: the fastest.

        Returns:
          ``(rounds, tokens)`` of the variant taken.
        """
        variants = [rounds for method, rounds in self.variants if method == prefer] or \
            [rounds for _, rounds in self.variants]
        priced = [through_bucket(rounds, ab, gamma, cores, tokens) for rounds in variants]
        return min(priced, key=lambda p: sum(r.seconds(ab, gamma, cores) for r in p[0]))


@dataclass(frozen=True, eq=False)
class Schedule:
    """The messages of one exchange step.

    Attributes:
      algorithm, workers, n, density, k, step: what was scheduled (``step`` counts from 1).
      phases: the aggregator's calls, in order (:class:`Phase`).
      sent: bytes each rank sends, counted as :class:`~tfsparse.collectives.Communicator`
        counts them (float64: Ok-Topk's and the threshold selections' are expectations).
    """

    algorithm: str
    workers: int
    n: int
    density: float
    k: int
    step: int
    phases: tuple
    sent: np.ndarray

    @property
    def bytes(self) -> int:
        """The most bytes one rank sends in the step (rounded to whole bytes)."""
        return int(round(float(self.sent.max()))) if self.sent.size else 0

    def rounds(self, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None, prefer: str | None = None) -> tuple:
        """The rounds of the fastest variant of every phase under the model (``prefer``: the
        variant of that name where a phase has one, e.g. ``"ring"``), in order; the step starts
        with a full token bucket (the link idle during the backward pass and the local selection
        before the exchange).

        Args:
          ab: the link the step is priced over.
          gamma: seconds per element of local work.
          cores: the cores the ranks share; None: each has its own.
          prefer: a variant's name to take wherever a phase has it; None: each phase's fastest.

        Returns:
          A tuple of :class:`Round`, every phase's in order.
        """
        return priced_rounds(self.phases, ab, gamma, cores, prefer)

    def seconds(self, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None, prefer: str | None = None) -> float:
        """The step's predicted seconds under the model: the sum over the rounds of :meth:`rounds`
        (:func:`seconds_of`).

        Args:
          ab: the link.
          gamma: seconds per element of local work.
          cores: the ranks' shared cores (None: their own).
          prefer: as :meth:`rounds` takes it.

        Returns:
          The step's seconds.
        """
        return seconds_of(self.phases, ab, gamma, cores, prefer)


def priced_rounds(phases, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None,
                  prefer: str | None = None) -> tuple:
    """The rounds of ``phases`` as :meth:`Schedule.rounds` prices them.

    Args:
      phases: the :class:`Phase` s, in order (the token bucket carries from one to the next).
      ab: the link.
      gamma: seconds per element of local work.
      cores: the cores the ranks share; None: each has its own.
      prefer: a variant's name; None: each phase's fastest.

    Returns:
      A tuple of :class:`Round`.
    """
    out, tokens = [], None
    for phase in phases:
        rounds, tokens = phase.best(ab, gamma, cores, tokens, prefer)
        out += rounds
    return tuple(out)


def seconds_of(phases, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None,
               prefer: str | None = None) -> float:
    """The seconds of :func:`priced_rounds`.

    Args:
      phases: the :class:`Phase` s, in order.
      ab: the link.
      gamma: the local work's seconds per element.
      cores: the shared cores, or None.
      prefer: as :func:`priced_rounds` takes it.

    Returns:
      The sum of the rounds' seconds.
    """
    return float(sum(r.seconds(ab, gamma, cores) for r in priced_rounds(phases, ab, gamma, cores, prefer)))


@dataclass(frozen=True)
class SimResult:
    """A predicted exchange step.

    Attributes:
      algorithm, workers, n, density, k: the case (``k = ceil(density · n)``).
      seconds: predicted exchange time per step (the mean over the algorithm's period of steps
        when no ``step`` was given).
      bytes: the most bytes one rank sends per step (Communicator accounting; a period mean,
        rounded, likewise).
      rounds: the rounds priced, each with the ``weight`` of the steps it occurs in.
      ab, gamma, cores: the model.
    """

    algorithm: str
    workers: int
    n: int
    density: float
    k: int
    seconds: float
    bytes: int
    rounds: tuple = field(repr=False)
    ab: AlphaBeta = None
    gamma: float = 0.0
    cores: int | None = None

    @property
    def messages(self) -> float:
        """Messages the busiest rank starts per step (sum over rounds, weighted)."""
        return float(sum(r.weight * r.messages for r in self.rounds))

    def breakdown(self) -> dict:
        """Seconds per phase, in schedule order.

        Returns:
          ``{phase: seconds}``.
        """
        out: dict = {}
        for r in self.rounds:
            out[r.phase] = out.get(r.phase, 0.0) + r.seconds(self.ab, self.gamma, self.cores)
        return out

    def as_dict(self) -> dict:
        """Plain values (JSON): the case, ``seconds``, ``bytes``, the model and the phases.

        Returns:
          A dict of plain values.
        """
        return {"algorithm": self.algorithm, "workers": self.workers, "n": self.n, "density": self.density,
                "k": self.k, "seconds": self.seconds, "bytes": self.bytes,
                "rounds": float(sum(r.weight for r in self.rounds if r.messages)),
                "messages": self.messages, "alpha_s": self.ab.alpha, "beta_bytes_per_s": self.ab.beta,
                "burst_bytes": self.ab.burst,
                "gamma_s_per_element": self.gamma, "cores": self.cores, "phases_s": self.breakdown()}


# -- collectives: counted bytes and round variants ------------------------------------------------

def _log2_ceil(p: int) -> int:
    return (int(p) - 1).bit_length()


class Builder:
    """Accumulates one step's phases and the per-rank bytes the Communicator would count: what
    an aggregator's ``schedule(builder, n, k, step)`` calls, one method per collective.

    Attributes:
      P: the workers.
      value_bytes: bytes of one value on the wire (4: float32; the cost model prices 16-bit
        wires' 2, int4's 0.5).

    Args:
      workers: P, the ranks.
      value_bytes: bytes of one value on the wire.
    """

    def __init__(self, workers: int, value_bytes: float = VALUE_BYTES):
        self.P = int(workers)
        self.value_bytes = int(value_bytes) if float(value_bytes).is_integer() else float(value_bytes)
        self.sent = np.zeros(self.P, dtype=np.float64)
        self.phases: list = []

    def message(self, n: int, count: float, budget: float | None = None, ascending: bool = True) -> float:
        """Bytes of a sparse message of ``count`` ``(index, value)`` entries of an ``n``-element
        vector: its indices as :func:`tfsparse.wire.index_codec` codes them for messages of about
        ``budget`` entries (default ``count``; blocked where they ascend and that is smaller, else
        int32 -- int64 from 2**31 elements), then the values.

        Args:
          n: the vector's elements.
          count: the entries sent (may be an expectation).
          budget: the entries the index codec is chosen for; None: ``count``.
          ascending: whether the indices ascend.

        Returns:
          Bytes.
        """
        codec = index_codec(n, count if budget is None else budget, ascending)
        return codec.nbytes(count) + count * self.value_bytes

    def finish(self, algorithm: str, n: int, density: float, k: int, step: int) -> "Schedule":
        """The :class:`Schedule` of what was declared.

        Args:
          algorithm: the aggregator's name.
          n: the bucket's elements.
          density: the fraction sent.
          k: the budget.
          step: the step, counted from 1.

        Returns:
          A :class:`Schedule`.
        """
        return Schedule(algorithm, self.P, n, density, k, step, tuple(self.phases), self.sent)

    def seconds(self, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None, prefer: str | None = None) -> float:
        """The price of what was declared so far (:meth:`Schedule.seconds`).

        Args:
          ab: the link the phases declared so far are priced over.
          gamma: seconds per element of their local work.
          cores: the cores the ranks share, or None.
          prefer: as :meth:`Schedule.rounds` takes it.

        Returns:
          Seconds (:func:`seconds_of` of the phases so far).
        """
        return seconds_of(self.phases, ab, gamma, cores, prefer)

    def _phase(self, name, *variants):
        self.phases.append(Phase(name, tuple((method, tuple(rounds)) for method, rounds in variants)))

    def local(self, name, elements) -> None:
        """Local work of the busiest rank (no messages): the γ term only (none on one rank:
        nothing is exchanged).

        Args:
          name: the phase's name.
          elements: values the busiest rank adds, merges or selects.
        """
        if elements and self.P > 1:
            self._phase(name, ("local", [Round(name, "local", 0, 0, int(round(elements)), busy=self.P)]))

    def allreduce(self, name, count: int, itemsize: int, reduce: bool = True) -> None:
        """``comm.allreduce`` of ``count`` elements: counted ``2·nbytes·(P-1)//P`` per rank.

        Args:
          name: the phase's name.
          count: the elements reduced.
          itemsize: bytes per element.
          reduce: whether the ranks add what they receive (the γ term).
        """
        P = self.P
        if P == 1:
            return
        self.sent += 2 * count * itemsize * (P - 1) // P
        block = int(split_counts(count, P).max())
        ring = [Round(name, "ring reduce-scatter", 1, block * itemsize, block if reduce else 0, busy=P)] * (P - 1) + \
               [Round(name, "ring allgather", 1, block * itemsize)] * (P - 1)
        p2 = 1 << (P.bit_length() - 1)
        halving = []
        if P > p2:  # the surplus ranks hand their vector to a partner first, get the result last
            halving.append(Round(name, "fold", 1, count * itemsize, count if reduce else 0, busy=P - p2))
        segments = [math.ceil(count / 2**j) for j in range(1, p2.bit_length())]
        halving += [Round(name, "recursive halving", 1, s * itemsize, s if reduce else 0, busy=p2) for s in segments]
        halving += [Round(name, "recursive doubling", 1, s * itemsize) for s in reversed(segments)]
        if P > p2:
            halving.append(Round(name, "unfold", 1, count * itemsize))
        self._phase(name, ("ring", ring), ("halving-doubling", halving))

    def allgather(self, name, blocks) -> None:
        """``comm.allgather`` of per-rank blocks of ``blocks`` bytes (a number or one per rank):
        counted as every block but the successor's.

        Args:
          name: the phase's name.
          blocks: each rank's block, in bytes (one number for all, or one per rank).
        """
        P = self.P
        if P == 1:
            return
        b = np.broadcast_to(np.asarray(blocks, dtype=np.float64), (P,)).copy()
        self.sent += b.sum() - np.roll(b, -1)
        ring = [Round(name, "ring", 1, int(round(b.max())))] * (P - 1)
        bruck = []
        csum = np.concatenate(([0.0], np.cumsum(np.concatenate([b, b]))))
        for j in range(_log2_ceil(P)):
            d = 1 << j
            c = min(d, P - d)
            windows = csum[P + 1:2 * P + 1] - csum[P + 1 - c:2 * P + 1 - c]  # blocks r-c+1 .. r of rank r
            bruck.append(Round(name, "bruck", 1, int(round(windows.max()))))
        self._phase(name, ("ring", ring), ("bruck", bruck))

    def bcast(self, name, nbytes: int, root: int = 0) -> None:
        """``comm.bcast`` of ``nbytes``: binomial tree, counted ``nbytes · children(rank)``.

        Args:
          name: the phase's name.
          nbytes: the bytes broadcast.
          root: the rank that broadcasts.
        """
        P = self.P
        if P == 1:
            return
        self.sent += np.array([nbytes * binomial_children(r, P, root) for r in range(P)], dtype=np.float64)
        self._phase(name, ("binomial", [Round(name, "binomial", 1, int(nbytes))] * _log2_ceil(P)))

    def alltoall(self, name, block: int) -> None:
        """``comm.alltoall`` of one ``block``-byte block per destination: counted ``(P-1)·block``.

        Args:
          name: the phase's name.
          block: the bytes sent to each other rank.
        """
        P = self.P
        if P == 1:
            return
        self.sent += (P - 1) * block
        direct = [Round(name, "direct", 1, int(block))] * (P - 1)
        ranks = np.arange(P)
        bruck = [Round(name, "bruck", 1, int(block * np.count_nonzero((ranks >> j) & 1)))
                 for j in range(_log2_ceil(P))]
        self._phase(name, ("direct", direct), ("bruck", bruck))

    def point_to_point(self, name, method, rounds, sent) -> None:
        """An aggregator's own messages: ``rounds`` and the bytes each rank sends.

        Args:
          name: the phase's name.
          method: the variant's name.
          rounds: the :class:`Round` s.
          sent: the bytes each rank sends (one per rank).
        """
        if self.P == 1:
            return
        self.sent += np.asarray(sent, dtype=np.float64)
        self._phase(name, (method, rounds))


# -- pricing -----------------------------------------------------------------------------------

def check_model(ab, gamma, cores) -> tuple:
    """``(ab, gamma, cores)`` validated: an :class:`AlphaBeta`, ``gamma >= 0``, ``cores`` None or
    an integer >= 1 (ValueError naming the argument and the accepted values otherwise).

    Args:
      ab: must be an :class:`AlphaBeta`.
      gamma: must be a real number >= 0.
      cores: must be None or an integer >= 1.

    Returns:
      ``(ab, gamma, cores)``, ``gamma`` a float and ``cores`` an int or None.

    Raises:
      ValueError: naming the argument and the accepted values.
    """
    if not isinstance(ab, AlphaBeta):
        raise ValueError(f"ab={ab!r} is not valid; accepted: a tfsparse.collectives.AlphaBeta, e.g. "
                         f"AlphaBeta.from_strings('1gbit', '50us')")
    gamma = _checks.real("gamma", gamma, 0.0)
    if cores is not None:
        cores = _checks.integer("cores", cores, 1, hint=" (or None: every rank has its own)")
    return ab, gamma, cores


def price(steps, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None) -> SimResult:
    """The :class:`SimResult` of ``steps``, ``((schedule, weight), ...)``: one exchange step's
    :class:`Schedule` (weight 1.0) or the distinct steps of an aggregator's period with the
    fraction of steps like each; ``seconds`` and ``bytes`` are the weighted sums.

    Args:
      steps: ``((schedule, weight), ...)``.
      ab: the link every step is priced over.
      gamma: seconds per element of local work.
      cores: the cores the ranks share; None: each has its own.

    Returns:
      A :class:`SimResult` of the weighted sums.
    """
    rounds, sent, case = [], None, None
    for s, weight in steps:
        case = s
        rounds += [replace(r, weight=r.weight * weight) for r in s.rounds(ab, gamma, cores)]
        sent = s.sent * weight if sent is None else sent + s.sent * weight
    seconds = float(sum(r.seconds(ab, gamma, cores) for r in rounds))
    return SimResult(case.algorithm, case.workers, case.n, case.density, case.k, seconds,
                     int(round(float(sent.max()))) if sent.size else 0, tuple(rounds), ab, gamma, cores)
