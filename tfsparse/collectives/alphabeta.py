"""The α-β model of a link: a message of ``n`` bytes takes ``t(n) = alpha + n / beta`` one way.

``alpha`` is the latency (start-up time) of one message in seconds, ``beta`` the bandwidth in
bytes per second -- the "α-β communication model" both gTop-k (gtopk-ssgd-shi2019 §II-D, Eq. 5,
where β is written as seconds per byte; §V-C measures α = 0.436 ms and 1/β ≈ 111 MB/s on 1 GbE
with a point-to-point benchmark) and Ok-Topk (oktopk-li2022 §2, "the cost of sending a message
of size L is α + βL") analyse their allreduces with.  :mod:`tfsparse.collectives.simulate`
replays each aggregator's message schedule under it.

Two ways to get one:

>>> ab = AlphaBeta.from_strings("1gbit", "50us")       # stated: a link rate and a latency
>>> ab = measure_alpha_beta(comm)                      # measured: ping-pong between ranks 0 and 1

:func:`measure_alpha_beta` is the point-to-point test of gtopk-ssgd-shi2019 §V-C (Fig. 8): rank 0
sends a message of ``n`` bytes to rank 1, which sends it back; half the round trip is the one-way
time, for sizes from 8 B to 16 MiB; the slope over the megabyte messages gives 1/β, the small
messages' times less their transfer give α (:func:`fit_alpha_beta`).
"""
from __future__ import annotations

import math
import numbers
import re
import time
from dataclasses import dataclass

import numpy as np

from .. import _checks
from .communicator import Communicator

#: bit-rate units of ``from_strings`` (tc's, decimal: ``1gbit`` = 10**9 bit/s), as ``tfsparse-run --net``
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
#: latency units of ``from_strings``
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
#: default message sizes of the ping-pong: 8 B .. 16 MiB
DEFAULT_SIZES = (8, 64, 512, 4096, 32768, 262144, 1048576, 4194304, 16777216)
#: the bandwidth is fitted over the sizes from here on (see :func:`fit_alpha_beta`)
BANDWIDTH_FROM = 1 << 20

_TAG = 7501


def parse_rate(text, name: str = "bandwidth") -> float:
    """``"1gbit"`` -> 125e6 (bytes per second).  Units: bit, kbit, mbit, gbit, tbit (bits per
    second, decimal, as tc and ``tfsparse-run --net`` write them).  ``name``: the argument
    the error messages name."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-z]+)\s*", str(text).lower())
    if not m or m.group(3) not in RATE_UNITS:
        raise ValueError(f"{name}={text!r} is not a bit rate; accepted: a positive number followed by one of "
                         f"{', '.join(RATE_UNITS)} (e.g. 1gbit, 10gbit, 100mbit)")
    bits = float(m.group(1) + (f"e{m.group(2)}" if m.group(2) else "")) * RATE_UNITS[m.group(3)]
    if not bits > 0 or not math.isfinite(bits):
        raise ValueError(f"{name}={text!r} must be a positive, finite rate (e.g. 1gbit)")
    return bits / 8.0


def parse_time(text, name: str = "latency") -> float:
    """``"50us"`` -> 5e-05 (seconds).  Units: s, ms, us, ns; a bare ``0`` is zero latency."""
    raw = str(text).strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", raw)
    if not m or (m.group(2) not in TIME_UNITS and not (m.group(2) == "" and float(m.group(1)) == 0.0)):
        raise ValueError(f"{name}={text!r} is not a duration; accepted: 0 or a non-negative number followed by "
                         f"one of {', '.join(TIME_UNITS)} (e.g. 50us, 1ms)")
    return float(m.group(1)) * TIME_UNITS.get(m.group(2), 1.0)


def format_rate(beta: float) -> str:
    """Bytes per second -> the shortest bit-rate string (``125e6`` -> ``"1gbit"``)."""
    bits = beta * 8.0
    for unit, scale in sorted(RATE_UNITS.items(), key=lambda u: -u[1]):
        if bits >= scale:
            return f"{bits / scale:.4g}{unit}"
    return f"{bits:.4g}bit"


def format_time(seconds: float) -> str:
    """Seconds -> ``"50us"``-style text."""
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if seconds >= scale:
            return f"{seconds / scale:.4g}{unit}"
    return f"{seconds / 1e-9:.4g}ns"


@dataclass(frozen=True)
class AlphaBeta:
    """A link under the α-β model (gtopk-ssgd-shi2019 §II-D; oktopk-li2022 §2).

    Attributes:
      alpha: latency of one message, seconds (>= 0).
      beta: bandwidth, bytes per second (> 0).  (The papers write β as the *time* per byte or
        per word; here it is the rate, so a transfer of ``n`` bytes takes ``n / beta``.)
      burst: bytes the link lets through at once after an idle moment (>= 0; default 0, a plain
        link): the depth of a token bucket that shapes it -- ``tc ... tbf burst``, what
        ``tfsparse-run --net`` sets (:attr:`tfsparse.network.NetSpec.burst`).  The bucket fills
        at ``beta`` while the link is idle; :mod:`~tfsparse.collectives.simulate` carries it
        through a step's rounds.  :meth:`time` is a plain link's.
    """

    alpha: float
    beta: float
    burst: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "alpha", _checks.real("alpha", self.alpha, 0.0, hint=" (seconds)"))
        object.__setattr__(self, "beta", _checks.real("beta", self.beta, 0.0, lo_open=True, hint=" (bytes/s)"))
        object.__setattr__(self, "burst", _checks.real("burst", self.burst, 0.0, hint=" (bytes)"))

    def time(self, nbytes):
        """One-way time of a message of ``nbytes`` bytes: ``alpha + nbytes / beta`` seconds
        (``nbytes`` may be an array)."""
        n = np.asarray(nbytes, dtype=np.float64)
        if np.any(n < 0) or not np.all(np.isfinite(n)):
            raise ValueError(f"nbytes={nbytes!r} must be a finite number of bytes >= 0")
        out = self.alpha + n / self.beta
        return float(out) if out.ndim == 0 else out

    @classmethod
    def from_strings(cls, bandwidth: str, latency: str = "0", burst: float = 0.0) -> "AlphaBeta":
        """``AlphaBeta.from_strings("1gbit", "50us")``: bandwidth as a bit rate (bit, kbit, mbit,
        gbit, tbit per second, decimal, e.g. ``1gbit``, ``10gbit``, ``100mbit``) and latency as a
        duration (s, ms, us, ns, e.g. ``50us``, ``1ms``; ``0`` for none); ``burst`` in bytes."""
        return cls(alpha=parse_time(latency), beta=parse_rate(bandwidth), burst=burst)

    def __str__(self):
        text = f"{format_rate(self.beta)}, {format_time(self.alpha)} latency"
        return text + (f", {self.burst:.0f} B burst" if self.burst else "")


def _check_sizes(sizes) -> tuple[int, ...]:
    bad = ValueError(f"sizes={sizes!r} is not valid; accepted: a sequence of at least two distinct positive "
                     f"integers (message sizes in bytes), e.g. sizes={DEFAULT_SIZES}")
    try:
        items = list(sizes)
    except TypeError:
        raise bad from None
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or int(s) < 1 for s in items):
        raise bad
    out = tuple(sorted({int(s) for s in items}))
    if len(out) < 2:
        raise bad
    return out


def _check_count(name, value, minimum, example) -> int:
    return _checks.integer(name, value, minimum, hint=f" (e.g. {name}={example})")


def fit_alpha_beta(sizes, seconds) -> AlphaBeta:
    """Fit of ``t(n) = alpha + n / beta`` to one-way times ``seconds`` of messages of ``sizes``
    bytes, each regime where it shows (Hockney's two-parameter model):

    * ``1/beta`` is the least-squares slope over the sizes of at least :data:`BANDWIDTH_FROM`
      bytes (the two largest when fewer are): links let small messages through faster than
      their sustained rate -- buffers, a token bucket's burst (``tfsparse-run --net``), TCP's
      initial window -- so a line through all sizes, or one weighted toward small ones,
      overstates the bandwidth of the megabyte messages that decide a dense allreduce
      (measured on a 1 Gbit/s emulated link: 6 Gbit/s from a relative-error fit);
    * ``alpha`` is the smallest message's ``t(n) - n / beta`` (a few bytes take almost only
      latency; mid-sized messages may ride the burst), at least 0.

    Raises ValueError when the times do not grow with the size (no bandwidth to fit).
    """
    n = np.asarray(sizes, dtype=np.float64).reshape(-1)
    t = np.asarray(seconds, dtype=np.float64).reshape(-1)
    if n.size != t.size or n.size < 2 or np.unique(n).size < 2:
        raise ValueError(f"sizes and seconds must be two equally long sequences over at least two distinct sizes, "
                         f"got {n.size} sizes and {t.size} times")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"seconds={seconds!r} must all be positive, finite times")
    order = np.argsort(n)
    n, t = n[order], t[order]
    big = n >= BANDWIDTH_FROM
    if np.unique(n[big]).size < 2:
        big = n >= n[-2] if n[-2] < n[-1] else n >= np.unique(n)[-2]
    c = np.polyfit(n[big], t[big], 1)[0]
    if not c * n[-1] > 1e-3 * t[-1]:  # the transfer must be a visible part of the largest message's time
        raise ValueError(f"the one-way times {t.tolist()} do not grow with the message size {n.tolist()}: no "
                         f"bandwidth to fit (use larger sizes)")
    a = max(0.0, float(t[0] - n[0] * c))
    return AlphaBeta(alpha=a, beta=float(1.0 / c))


def measure_alpha_beta(comm: Communicator, sizes=DEFAULT_SIZES, repeats: int = 10, warmup: int = 2,
                       peer: int = 1) -> AlphaBeta:
    """Measures the α-β model of the link between ranks 0 and ``peer`` (default 1) by ping-pong (gtopk-ssgd-shi2019
    §V-C, Fig. 8's point-to-point test).  Collective: every rank of ``comm`` calls it, with the
    same arguments; every rank returns the same :class:`AlphaBeta`.

    For each size ``n`` in ``sizes`` (bytes), rank 0 sends ``n`` bytes to ``peer`` and ``peer`` sends
    them back, ``warmup`` untimed then ``repeats`` timed round trips; the median round trip over
    2 is the one-way time ``t(n)``, and :func:`fit_alpha_beta` fits ``t(n) = alpha + n / beta``.
    The other ranks stay idle (waiting in the final broadcast), and rank 0 broadcasts the
    result, so the value is identical on every rank.

    The messages travel over a duplicate of ``comm`` (:meth:`Communicator.duplicate`), so they
    never mix with other traffic and ``comm.bytes_sent`` is unchanged; they go through the
    Communicator's ``send``/``irecv``, i.e. what an aggregator's point-to-point messages cost
    (buffer allocation included).  On a shared-memory machine the result describes shared
    memory, on ``tfsparse-run --net RATE`` the emulated link.  Ranks idle in a collective may
    spin on a CPU; on an oversubscribed machine that adds noise to the timings.

    Args:
      comm: a :class:`~tfsparse.collectives.Communicator` of at least 2 ranks.
      sizes: message sizes in bytes (at least two distinct positive integers); default 8 B to
        16 MiB (:data:`DEFAULT_SIZES`).
      repeats: timed round trips per size (>= 1; default 10).
      warmup: untimed round trips per size before them (>= 0; default 2).
      peer: the rank at the link's other end (1 to ``comm.size - 1``; default 1) -- e.g. the first
        rank on another host, to measure the network rather than shared memory.

    Raises:
      ValueError: on a bad argument (before any communication), and on a world of one rank:
        a ping-pong needs a peer -- there is no link to measure; state one with
        ``AlphaBeta.from_strings(bandwidth, latency)`` instead.  Also (on every rank) if the
        times do not grow with the message size.
    """
    if not isinstance(comm, Communicator):
        raise ValueError(f"comm={comm!r} is not valid; accepted: a tfsparse.collectives.Communicator "
                         f"(MPICommunicator, HorovodCommunicator, InProcessCommunicator)")
    sizes = _check_sizes(sizes)
    repeats = _check_count("repeats", repeats, 1, 10)
    warmup = _check_count("warmup", warmup, 0, 2)
    if comm.size < 2:
        raise ValueError(f"measure_alpha_beta needs a world of at least 2 ranks (comm.size={comm.size}): the "
                         f"ping-pong has no peer; for one process there is no link to measure -- state one with "
                         f"AlphaBeta.from_strings(bandwidth, latency), e.g. ('1gbit', '50us')")
    peer = _checks.integer("peer", peer, 1, comm.size - 1)
    link = comm.duplicate()
    result = np.full(2, np.nan)
    error = ""
    if link.rank in (0, peer):
        one_way = _ping_pong(link, sizes, repeats, warmup, peer)
        if link.rank == 0:
            try:
                ab = fit_alpha_beta(sizes, one_way)
                result[:] = (ab.alpha, ab.beta)
            except ValueError as e:  # every rank raises it, after the broadcast
                error = str(e)
    result = link.bcast(result if link.rank == 0 else None, root=0, shape=(2,), dtype=np.float64)
    if not np.all(np.isfinite(result)):
        raise ValueError(error or "measure_alpha_beta: rank 0 could not fit the ping-pong times (the times do not "
                         "grow with the message size; use larger sizes)")
    return AlphaBeta(alpha=float(result[0]), beta=float(result[1]))


def round_trips(link: Communicator, nbytes: int, count: int, peer: int = 1) -> list[float]:
    """Ranks 0 and ``peer`` of ``link`` (every other rank returns at once): ``count`` round trips
    of ``nbytes`` bytes, rank 0 sending first; rank 0 returns each one's one-way time (half the
    round trip, its clock), ``peer`` an empty list.  Point-to-point only: the two ranks call it at
    the same point of their traffic on ``link``."""
    buf = np.full(int(nbytes), 0xA5, dtype=np.uint8)
    times: list[float] = []
    for _ in range(int(count)):
        if link.rank == 0:
            req = link.irecv(peer, nbytes, tag=_TAG, dtype=np.uint8)
            t0 = time.perf_counter()
            link.send(buf, peer, tag=_TAG)
            req.wait()
            times.append((time.perf_counter() - t0) / 2.0)
        elif link.rank == peer:
            echo = link.irecv(0, nbytes, tag=_TAG, dtype=np.uint8).wait()
            link.send(echo, 0, tag=_TAG)
    return times


def _ping_pong(link: Communicator, sizes, repeats: int, warmup: int, peer: int = 1) -> np.ndarray:
    """Ranks 0 and ``peer``: the median one-way time of each size (rank 0's clock; NaN on ``peer``)."""
    out = np.full(len(sizes), np.nan)
    for i, nbytes in enumerate(sizes):
        times = round_trips(link, nbytes, warmup + repeats, peer)[warmup:]
        if times:
            out[i] = float(np.median(times))
    return out
