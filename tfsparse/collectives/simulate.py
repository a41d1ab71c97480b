"""Message-schedule simulator: each aggregator's rounds under the α-β-γ model, to 1024 workers.

Pure numpy, no MPI.  For an algorithm of the aggregator registry, ``P`` workers, ``n`` gradient
elements and a density (``k = ceil(density * n)``, as the exchange computes it), :func:`schedule`
builds the messages one exchange step sends -- the collectives each aggregator calls, with the
sizes it calls them with (float32 values, int32 indices below 2**31 elements: the float32 wire's
``[indices | values]`` messages) -- and :func:`simulate` prices them:

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

The bytes counted (``bytes``) are always the first column's, as the Communicator counts them.

Per algorithm (the schedules mirror the aggregators in :mod:`tfsparse.aggregators`; the
collectives layer may not import them, the fidelity test ties the two together):

* ``dense`` -- one float32 allreduce of the ``n`` values (DenseAllReduce, gtopk §II-D, Eq. 5).
* ``topk`` -- one allgather of every rank's ``k`` (index, value) pairs, then the sum of the
  ``P·k`` pairs (TopKAllReduce, gtopk §II-E, Eq. 6; oktopk Table 1 "TopkA").  ``dgc`` and
  ``gaussiank`` are the same schedule with their *expected* selection size: DGC's sampled
  threshold (the ``ks``-th largest of ``s`` samples leaves a fraction ``ks/(s+1)`` of the
  gradient above it; exact -- ``k-1`` strictly above -- when every element is sampled),
  moved into ``[k, 1.3k]`` by the published adaptation and cut to ``k`` (so ``k`` with the
  defaults), Gaussian-k's ``k`` (its threshold is the Gaussian quantile of density ``k/n``; oktopk §2).
* ``dragonn`` -- the same allgather with the expected number of occupied hash slots: the
  threshold passes about ``k`` elements, ``m(1-(1-1/m)^l)`` of the ``m = 4k`` slots keep one
  (dragonn-wang2022 §3.2, App. A.2), and one sparse decode of the ``P`` payloads (§4.3).
* ``gtopk`` -- the reduction tree of Alg. 3 (gtopk §III): a fold round for the ranks above the
  largest power of two, then ``log2`` recursive-doubling rounds, one ``k``-entry message per
  sender (a ⊤ merge always keeps exactly ``k`` entries) and a ``2k``-element merge per
  receiver; then rank 0's binomial broadcast of the result's length (8 bytes) and of the
  ``k``-entry result -- ``3⌈log2 P⌉`` rounds, Eq. 7's ``4k log2 P`` volume at rank 0.
* ``oktopk`` -- Alg. 1 (oktopk §3) with the *expected* counts under uniformly spread,
  independent selections (density ``ρ = k/n`` on every rank) and balanced regions (§3.1.1):
  every rank selects ``k``; the boundary allreduce (``P-1`` float64) on repartition steps
  (every ``tau``); the alltoall of message lengths; ``P-1`` destination-rotation rounds of
  ``k/P`` entries (Eq. 1; buckets only overlap them); on re-evaluation steps (every
  ``tau_prime``) the allgather of every region's reduced values, ``(n/P)(1-(1-ρ)^P)`` each (the
  union of the ranks' selections in a region), and the k-th largest of them; the allgather of
  the global top-k counts; the allgatherv of ``k/P`` entries per rank.  Data balancing
  (§3.1.2) runs only when the largest buffer exceeds ``balance_factor`` times the mean, which
  equal expected buffers never do, so it is not in the expected schedule.
  Without ``step`` the result is the mean over one period of ``lcm(tau, tau_prime)`` steps.
* ``csc`` -- the chunk-norm allreduce (``⌈n/chunk_size⌉`` float32) and the dense allreduce of
  the ``m = ⌈k/chunk_size⌉`` chosen chunks (gradientflow-sun2019 §3.2), assumed full chunks
  (exact unless the short last chunk is among them); ``chunk_selection="previous"`` moves the norm
  allreduce after the chunks (plus one before them on the first step).

Left out: overlap with back-propagation and between buckets (one fused bucket is priced), the
local selection before the exchange, contention inside the switch (every rank has its own
full-duplex link into a non-blocking one), MPI's segmentation of large broadcasts, and, for
the data-dependent algorithms, how real gradients differ from uniformly spread selections
(ranks' top-k overlap shrinks Ok-Topk's reduced regions; hot regions trigger its balancing).

>>> from tfsparse.collectives import AlphaBeta
>>> from tfsparse.collectives.simulate import simulate
>>> r = simulate("gtopk", 32, 25_200_000, 0.001, AlphaBeta.from_strings("1gbit", "50us"))
>>> r.seconds, r.bytes          # 0.0169 s, 1,008,040 bytes (rank 0's broadcasts)
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from .. import _checks
from ..schedules import small_tensor_k
from .alphabeta import AlphaBeta
from .communicator import binomial_children, split_counts

ALGORITHMS = ("dense", "topk", "dgc", "gaussiank", "dragonn", "gtopk", "oktopk", "csc")
VALUE_BYTES = 4          # float32 wire


def index_bytes(n: int) -> int:
    """Bytes of one index on the wire: int32 below 2**31 elements, else int64 (as the aggregators)."""
    return 4 if n < 2**31 else 8


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
        """``gamma · elements · max(1, busy / cores)`` (unweighted)."""
        share = max(1.0, self.busy / cores) if cores else 1.0
        return gamma * self.elements * share

    def seconds(self, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None) -> float:
        """``weight · (alpha · messages + (bytes - free) / beta + gamma · elements · max(1, busy / cores))``."""
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
    ``bytes`` are the larger of the two, so one bucket stands for both."""
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

    def best(self, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None, tokens: float | None = None) -> tuple:
        """``(rounds, tokens)``: the fastest variant's rounds under the model, starting with
        ``tokens`` in the link's token bucket (None: full), and the tokens left
        (:func:`through_bucket`)."""
        priced = [through_bucket(rounds, ab, gamma, cores, tokens) for _, rounds in self.variants]
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

    def rounds(self, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None) -> tuple:
        """The rounds of the fastest variant of every phase under the model, in order; the step
        starts with a full token bucket (the link idle during the backward pass and the local
        selection before the exchange)."""
        out, tokens = [], None
        for phase in self.phases:
            rounds, tokens = phase.best(ab, gamma, cores, tokens)
            out += rounds
        return tuple(out)

    def seconds(self, ab: AlphaBeta, gamma: float = 0.0, cores: int | None = None) -> float:
        return float(sum(r.seconds(ab, gamma, cores) for r in self.rounds(ab, gamma, cores)))


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
        """Seconds per phase, in schedule order."""
        out: dict = {}
        for r in self.rounds:
            out[r.phase] = out.get(r.phase, 0.0) + r.seconds(self.ab, self.gamma, self.cores)
        return out

    def as_dict(self) -> dict:
        """Plain values (JSON): the case, ``seconds``, ``bytes``, the model and the phases."""
        return {"algorithm": self.algorithm, "workers": self.workers, "n": self.n, "density": self.density,
                "k": self.k, "seconds": self.seconds, "bytes": self.bytes,
                "rounds": float(sum(r.weight for r in self.rounds if r.messages)),
                "messages": self.messages, "alpha_s": self.ab.alpha, "beta_bytes_per_s": self.ab.beta,
                "burst_bytes": self.ab.burst,
                "gamma_s_per_element": self.gamma, "cores": self.cores, "phases_s": self.breakdown()}


# -- collectives: counted bytes and round variants ------------------------------------------------

def _log2_ceil(p: int) -> int:
    return (int(p) - 1).bit_length()


class _Builder:
    """Accumulates one step's phases and the per-rank bytes the Communicator would count."""

    def __init__(self, workers: int):
        self.P = int(workers)
        self.sent = np.zeros(self.P, dtype=np.float64)
        self.phases: list = []

    def _phase(self, name, *variants):
        self.phases.append(Phase(name, tuple((method, tuple(rounds)) for method, rounds in variants)))

    def local(self, name, elements) -> None:
        """Local work of the busiest rank (no messages): the γ term only (none on one rank:
        nothing is exchanged)."""
        if elements and self.P > 1:
            self._phase(name, ("local", [Round(name, "local", 0, 0, int(round(elements)), busy=self.P)]))

    def allreduce(self, name, count: int, itemsize: int, reduce: bool = True) -> None:
        """``comm.allreduce`` of ``count`` elements: counted ``2·nbytes·(P-1)//P`` per rank."""
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
        counted as every block but the successor's."""
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
        """``comm.bcast`` of ``nbytes``: binomial tree, counted ``nbytes · children(rank)``."""
        P = self.P
        if P == 1:
            return
        self.sent += np.array([nbytes * binomial_children(r, P, root) for r in range(P)], dtype=np.float64)
        self._phase(name, ("binomial", [Round(name, "binomial", 1, int(nbytes))] * _log2_ceil(P)))

    def alltoall(self, name, block: int) -> None:
        """``comm.alltoall`` of one ``block``-byte block per destination: counted ``(P-1)·block``."""
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
        """An aggregator's own messages: ``rounds`` and the bytes each rank sends."""
        if self.P == 1:
            return
        self.sent += np.asarray(sent, dtype=np.float64)
        self._phase(name, (method, rounds))


# -- the algorithms -----------------------------------------------------------------------------

def _dense(b: _Builder, n, k, step, opts) -> None:
    b.allreduce("allreduce", n, VALUE_BYTES)


def _allgather_sparse(b: _Builder, n, count) -> None:
    b.allgather("allgather (index, value)", count * (index_bytes(n) + VALUE_BYTES))
    b.local("sum of the gathered pairs", b.P * count)


def _topk(b, n, k, step, opts) -> None:
    _allgather_sparse(b, n, k)


def dgc_expected_count(n: int, k: int, sample_ratio: float = 0.01, min_samples: int = 1024) -> float:
    """Expected entries DGC's sampled threshold selects (tfsparse.compressors.DGCSampledThreshold):
    ``s`` samples, threshold = their ``ks``-th largest, entries strictly above it are sent.
    With every element sampled that is exactly ``ks - 1`` (no ties); otherwise the fraction of
    the gradient above the ``ks``-th largest of ``s`` uniform samples is ``Beta(ks, s-ks+1)``,
    of mean ``ks / (s + 1)``."""
    if k >= n:
        return float(n)
    s = int(max(math.ceil(sample_ratio * n), min(n, min_samples)))
    ks = int(min(s, max(1, math.ceil(k * s / n))))
    return float(ks - 1) if s >= n else n * ks / (s + 1)


def dgc_adapted_count(n: int, k: int, opts: dict) -> float:
    """Expected entries of DGC as published (tfsparse.compressors.DGCSampledThreshold): the exact
    top-k (``k``) for tensors of at most ``exact_below`` elements; otherwise the sampled
    estimate's count, moved into ``[lower k, upper k]`` by the adaptation (assumed to succeed
    when ``adapt_iters > 0``) and cut to ``k`` by the truncation."""
    if n <= opts["exact_below"] or k >= n:
        return float(min(k, n))
    count = dgc_expected_count(n, k, opts["sample_ratio"], opts["min_samples"])
    if opts["adapt_iters"] > 0:
        count = min(max(count, opts["lower"] * k), opts["upper"] * k)
    if opts["truncate"] is not None:
        count = min(count, k)
    return float(count)


def _dgc(b, n, k, step, opts) -> None:
    _allgather_sparse(b, n, dgc_adapted_count(n, small_tensor_k(n, k, opts["small_density"]), opts))


def dragonn_expected_count(n: int, k: int, capacity_factor: int = 4, sample_ratio: float = 0.01,
                           min_samples: int = 1024) -> float:
    """Expected entries DRAGONN sends (tfsparse.aggregators.dragonn): its sampled threshold
    passes ``l`` elements (``>=``: ``k`` when every element is sampled, else DGC's ``n·ks/(s+1)``
    plus the one at the threshold), hashed into ``m = capacity_factor·k`` slots, of which
    ``m(1 - (1 - 1/m)^l)`` are occupied (balls into bins; dragonn-wang2022 App. A.2)."""
    if k >= n:
        return float(n)
    s = int(max(math.ceil(sample_ratio * n), min(n, min_samples)))
    ks = int(min(s, max(1, math.ceil(k * s / n))))
    passed = float(k) if s >= n else n * ks / (s + 1)
    m = capacity_factor * k
    return float(m * -math.expm1(passed * math.log1p(-1.0 / m))) if m > 1 else min(1.0, passed)


def _dragonn(b, n, k, step, opts) -> None:
    count = dragonn_expected_count(n, small_tensor_k(n, k, opts["small_density"]), opts["capacity_factor"],
                                   opts["sample_ratio"], opts["min_samples"])
    b.allgather("allgather (index, value)", count * (index_bytes(n) + VALUE_BYTES))
    b.local("sparse decode of the gathered pairs", b.P * count)


def _gaussiank(b, n, k, step, opts) -> None:
    _allgather_sparse(b, n, k)


def _gtopk(b: _Builder, n, k, step, opts) -> None:
    P = b.P
    msg = k * (index_bytes(n) + VALUE_BYTES)
    p2 = 1 << (P.bit_length() - 1)
    senders = [list(range(p2, P))] if P > p2 else []  # the fold round (non-power-of-two P)
    dist = 1
    while dist < p2:  # Alg. 3 lines 4-18: recursive doubling, the higher rank of a pair sends
        senders.append(list(range(dist, p2, 2 * dist)))
        dist *= 2
    sent = np.zeros(P)
    for group in senders:
        sent[group] += msg
    rounds = [Round("reduction tree", "tree", 1, msg, 2 * k, busy=len(group)) for group in senders]
    b.point_to_point("reduction tree", "tree", rounds, sent)
    b.bcast("broadcast length", 8)       # Alg. 3 line 19: the result's length first (int64) ...
    b.bcast("broadcast result", msg)     # ... then the k-entry result


def _oktopk(b: _Builder, n, k, step, opts) -> None:
    P = b.P
    tau, tau_prime = opts["tau"], opts["tau_prime"]
    fresh = (step - 1) % tau_prime == 0
    repartition = (step - 1) % tau == 0
    entry = index_bytes(n) + VALUE_BYTES
    share = k / P                                    # expected entries per (rank, region)
    if repartition:                                  # Alg. 1 lines 5-7
        b.allreduce("space repartition (boundaries)", P - 1, 8)
    b.alltoall("split and reduce: message lengths", 8)
    rotation = [Round("split and reduce", "rotation", 1, int(round(share * entry)), int(round(share)), busy=P)
                for _ in range(P - 1)]              # Alg. 1 line 8, Eq. 1
    b.point_to_point("split and reduce", "rotation", rotation, np.full(P, (P - 1) * share * entry))
    b.local("split and reduce: own region", share)
    if fresh:                                        # Alg. 1 lines 9-12
        union = (n / P) * (1.0 - (1.0 - k / n) ** P)
        b.allgather("global threshold (reduced values)", union * VALUE_BYTES)
        b.local("global threshold: k-th largest", P * union)
    if P > 1:                                        # Alg. 1 line 13
        b.allgather("balance: buffer sizes", 8)
        b.allgather("allgatherv (global top-k)", share * entry)
        b.local("allgatherv: concatenate", k)


def _csc(b: _Builder, n, k, step, opts) -> None:
    cs = opts["chunk_size"]
    chunks = math.ceil(n / cs)
    m = min(chunks, math.ceil(k / cs))
    elements = n if m == chunks else m * cs
    if opts["chunk_selection"] == "current":
        b.allreduce("chunk norms", chunks, 4)
        b.allreduce("chunks", elements, VALUE_BYTES)
    else:
        if step == 1:
            b.allreduce("chunk norms", chunks, 4)
        b.allreduce("chunks", elements, VALUE_BYTES)
        b.allreduce("chunk norms (next step)", chunks, 4)


def _int_at_least(minimum):
    return functools.partial(_checks.integer, minimum=minimum)


_positive_int = _int_at_least(1)


def _number(lo, hi=None, lo_open=False, hi_open=False):
    """A validator ``check(name, value)`` of a finite number from ``lo`` to ``hi`` (None: unbounded)."""
    return functools.partial(_checks.real, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open)


def _selection(name, value):
    if value not in ("current", "previous"):
        raise ValueError(f"{name}={value!r} is not valid; accepted: 'current', 'previous'")
    return value


def _reduce_scatter(name, value):
    if value not in ("direct", "ring"):
        raise ValueError(f"{name}={value!r} is not valid; accepted: 'direct', 'ring'")
    return value


def _truncate(name, value):
    if value not in ("largest", "first", None):
        raise ValueError(f"{name}={value!r} is not valid; accepted: 'largest', 'first', None")
    return value


def _optional_fraction(name, value):
    return None if value is None else _number(0.0, 1.0, lo_open=True)(name, value)


def _any(name, value):
    return value


# name -> (schedule builder, {option: (default, validator)}).  The options are the aggregator's;
# those that do not change the expected schedule are accepted (and validated) for parity.
_ALGORITHMS = {
    # the ring reduce-scatter of a lossy wire sends the same bytes (the model prices the allreduce)
    "dense": (_dense, {"reduce_scatter": ("direct", _reduce_scatter)}),
    "topk": (_topk, {}),
    "dgc": (_dgc, {"sample_ratio": (0.01, _number(0.0, 1.0, lo_open=True)),
                   "min_samples": (1024, _positive_int), "seed": (None, _any),
                   "adapt_iters": (10, _int_at_least(0)), "lower": (1.0, _number(0.0, lo_open=True)),
                   "upper": (1.3, _number(0.0, lo_open=True)),
                   "adapt_factor": (0.9, _number(0.0, 1.0, lo_open=True, hi_open=True)),
                   "truncate": ("largest", _truncate), "exact_below": (16384, _int_at_least(0)),
                   "small_density": (None, _optional_fraction)}),
    "gaussiank": (_gaussiank, {"scale": (0.9, _number(0.0, 1.0, lo_open=True, hi_open=True)),
                               "max_adjust": (50, _int_at_least(0))}),
    "dragonn": (_dragonn, {"capacity_factor": (4, _positive_int),
                           "sample_ratio": (0.01, _number(0.0, 1.0, lo_open=True)),
                           "min_samples": (1024, _positive_int), "seed": (0, _int_at_least(0)),
                           "small_density": (None, _optional_fraction)}),
    "gtopk": (_gtopk, {}),
    "oktopk": (_oktopk, {"tau": (64, _positive_int), "tau_prime": (32, _positive_int),
                         "bucket_size": (4, _positive_int), "balance_factor": (4.0, _number(1.0)),
                         # the authors' threshold adjustment between re-evaluations: it keeps the
                         # counts near k, which is what the expected schedule assumes
                         "local_raise": (1.03, _number(1.0)), "local_adjust": (1.012, _number(1.0)),
                         "global_adjust": (1.008, _number(1.0))}),
    "csc": (_csc, {"chunk_size": (32768, _positive_int), "chunk_selection": ("current", _selection)}),
}
assert set(_ALGORITHMS) == set(ALGORITHMS)


def _check_case(algorithm, workers, n, density, options) -> tuple:
    if not isinstance(algorithm, str) or algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not supported; accepted: "
                         f"{', '.join(repr(a) for a in ALGORITHMS)}")
    for name, value in (("workers", workers), ("n", n)):
        _checks.integer(name, value, 1)
    _checks.real("density", density, 0.0, 1.0, lo_open=True)
    accepted = _ALGORITHMS[algorithm][1]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(f'{u}={options[u]!r}' for u in unknown)} for "
                         f"algorithm={algorithm!r}; accepted: {', '.join(accepted) or '(none)'}")
    opts = {name: check(name, options[name]) if name in options else default
            for name, (default, check) in accepted.items()}
    n = int(n)
    k = int(min(n, max(1, math.ceil(float(density) * n))))   # GradientExchange.k_for
    return int(workers), n, float(density), k, opts


def schedule(algorithm: str, workers: int, n: int, density: float, *, step: int = 1, **options) -> Schedule:
    """The messages of exchange step ``step`` (counted from 1) of ``algorithm`` on ``workers``
    ranks for a bucket of ``n`` float32 elements at ``density``.  ``options`` are the
    aggregator's (``tau``, ``tau_prime`` for Ok-Topk, ``chunk_size``, ``chunk_selection`` for CSC,
    ``sample_ratio``, ``min_samples`` for DGC; the others are accepted and change nothing).
    ValueError naming the argument and the accepted values on bad input."""
    workers, n, density, k, opts = _check_case(algorithm, workers, n, density, options)
    step = _positive_int("step", step)
    b = _Builder(workers)
    _ALGORITHMS[algorithm][0](b, n, k, step, opts)
    return Schedule(algorithm, workers, n, density, k, step, tuple(b.phases), b.sent)


def period(algorithm: str, **options) -> tuple:
    """``((step, weight), ...)``: the distinct steps of the algorithm's steady period and the
    fraction of steps like each.  Ok-Topk: one period of ``lcm(tau, tau_prime)`` steps
    (step 1 repartitions and re-evaluates, ``1 + tau_prime·j`` re-evaluate, the rest reuse);
    CSC with ``chunk_selection="previous"``: step 2 (the first step alone differs); others: step 1."""
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not supported; accepted: "
                         f"{', '.join(repr(a) for a in ALGORITHMS)}")
    *_, opts = _check_case(algorithm, 1, 1, 1.0, options)
    if algorithm == "oktopk":
        tau, tau_prime = opts["tau"], opts["tau_prime"]
        length = math.lcm(tau, tau_prime)
        kinds: dict = {}
        for t in range(1, length + 1):
            key = ((t - 1) % tau_prime == 0, (t - 1) % tau == 0)
            first, count = kinds.get(key, (t, 0))
            kinds[key] = (first, count + 1)
        return tuple((first, count / length) for first, count in sorted(kinds.values()))
    if algorithm == "csc" and opts["chunk_selection"] == "previous":
        return ((2, 1.0),)
    return ((1, 1.0),)


def simulate(algorithm: str, workers: int, n: int, density: float, ab: AlphaBeta, gamma: float = 0.0, *,
             step: int | None = None, cores: int | None = None, **options) -> SimResult:
    """Predicted time and bytes of one exchange step under the α-β-γ model.

    Args:
      algorithm: one of :data:`ALGORITHMS` (the aggregator registry's names).
      workers: P (>= 1).  n: elements of the (one, fused) bucket.  density: in (0, 1].
      ab: the link (:class:`~tfsparse.collectives.AlphaBeta`; its ``burst``, a token bucket's
        depth, lets the first bytes after an idle moment through at once).
      gamma: seconds per element of local work inside the exchange (>= 0; default 0, the pure
        α-β model).
      cores: the cores all ``workers`` ranks share on one node (>= 1); None (default): every
        rank has cores of its own.  Local work that more ranks than cores do at once is slowed
        by ``busy / cores``.
      step: the step to price (from 1); None: the mean over the algorithm's :func:`period`.
      options: the aggregator's options (see :func:`schedule`).

    Returns a :class:`SimResult` (``seconds``, ``bytes`` -- max bytes sent by one rank --,
    ``rounds``).  One rank (``workers=1``) communicates nothing: 0 seconds, 0 bytes.
    """
    if not isinstance(ab, AlphaBeta):
        raise ValueError(f"ab={ab!r} is not valid; accepted: a tfsparse.collectives.AlphaBeta, e.g. "
                         f"AlphaBeta.from_strings('1gbit', '50us')")
    gamma = _number(0.0)("gamma", gamma)
    if cores is not None:
        cores = _checks.integer("cores", cores, 1, hint=" (or None: every rank has its own)")
    steps = ((step, 1.0),) if step is not None else period(algorithm, **options)
    rounds, sent, case = [], None, None
    for t, weight in steps:
        s = schedule(algorithm, workers, n, density, step=t, **options)
        case = s
        rounds += [replace(r, weight=r.weight * weight) for r in s.rounds(ab, gamma, cores)]
        sent = s.sent * weight if sent is None else sent + s.sent * weight
    seconds = float(sum(r.seconds(ab, gamma, cores) for r in rounds))
    return SimResult(case.algorithm, case.workers, case.n, case.density, case.k, seconds,
                     int(round(float(sent.max()))) if sent.size else 0, tuple(rounds), ab, gamma, cores)
