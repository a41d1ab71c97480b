"""Ok-Topk: the O(k) sparse allreduce (oktopk-li2022 §3, Alg. 1) with Ok-Topk SGD's
residual rule (Alg. 2).

Semantics (§3.1): ``Topk(Σ_i Topk(G_i))`` -- the inner top-k is each rank's local selection,
the outer one the global selection -- where both selections use *thresholds* that are
computed exactly every ``tau_prime`` steps and reused in between (§3.1.3).

One call (= one training iteration ``t``, counted from 1) runs Alg. 1:

* lines 2-4 -- **local threshold**: if ``(t-1) % tau_prime == 0`` it is re-evaluated as the
  exact k-th largest ``|acc|``; otherwise the cached one is reused.  Local top-k =
  ``|acc| >= local_th``.
* lines 5-7 -- **space repartition** (§3.1.1): if ``(t-1) % tau == 0`` every rank computes
  the P-1 interior boundaries that split *its* local top-k indices into P equal-count
  regions; the consensus is the average of these boundary vectors (one allreduce of P-1
  numbers, floored to integers).  Region ``i`` ``[b_i, b_{i+1})`` is reduced by rank ``i``.
* line 8 -- **split and reduce** (§3.1.1, Fig. 2): each rank sends the local top-k entries of
  region ``j`` to rank ``j``.  Message lengths are exchanged first (an alltoall of P numbers)
  so that receives can be posted non-blocking.  *Destination rotation*: at step ``s = 1..P-1``
  rank ``r`` sends to ``(r+s) % P`` and receives from ``(r-s) % P``, so no rank is a hot spot.
  *Bucketing*: the steps are grouped into buckets of ``bucket_size`` peers whose messages are
  all in flight at once (``isend``/``irecv``); the local reduction of one bucket's data runs
  while the next bucket's messages are in flight (the own region's contribution is reduced
  while the first bucket is in flight).  The reduced region is a sparse vector, each part
  merged into it in arrival order (a linear merge of ascending indices: a new index gets
  ``0 + value``, a known one its sum plus the value -- what adding into a zeroed region vector
  gives); its indices are ``reduced_topk^i``.
* lines 9-12 -- **global threshold**: on re-evaluation steps the reduced values of all
  regions are all-gathered (values only: the threshold needs no indices) and ``global_th`` =
  the exact k-th largest magnitude; otherwise the cached one is reused.
* line 13 -- **balance and allgatherv** (§3.1.2, Fig. 3): each rank keeps its reduced entries
  with ``|v| >= global_th`` and packs them (COO) into one buffer.  The P buffer sizes are
  all-gathered; if ``max > balance_factor * mean`` (``balance_factor=4``, §5.3) the
  concatenation (in rank order) is re-split into P equal chunks by point-to-point messages
  (each rank computes the whole scheme from the sizes); then one allgatherv of the
  (balanced) buffers gives every rank ``u_t`` and the global top-k indexes, sorted by index.
* line 14 -- ``indexes = local_topk_indexes ∩ global_topk_indexes`` = ``contributed``: every
  local value at such an index went into the reduced sum of that index (the owner added every
  rank's local top-k entry of its region), so zeroing exactly these entries (Alg. 2 line 6)
  keeps ``applied + residuals == raw gradients``.

Threshold adjustment between re-evaluations (the authors' code, not in the paper; on by
default, ``1.0`` turns each rule off and gives §3.1.3's plain reuse): with error feedback the
accumulated residuals grow between re-evaluations, so a reused threshold admits more and more
entries (measured: 80k entries instead of k after 10 steps on a 25M-parameter MLP), which
breaks Eq. 3's volume bound.  The authors' code rescales both thresholds toward ``k``:

* ``local_raise`` (1.03): on a reuse step, before selecting, the local threshold is
  multiplied by 1.03 while more than ``4k/3`` entries pass (computed exactly over the entries
  that pass the unraised threshold, so it costs no extra pass over the gradient);
* ``local_adjust`` (1.012): after selecting, the threshold kept for the next step is divided
  by 1.012 when fewer than ``2k/3`` entries passed and multiplied when more than ``5k/4``;
* ``global_adjust`` (1.008): after the allgatherv, the global threshold kept for the next
  step is divided by 1.008 when the global top-k holds fewer than ``2k/3`` entries and
  multiplied when more than ``4k/3`` (the count is the same on every rank, so is the result).

``last_info`` reports the thresholds a step *used*; the state holds the ones the next step
starts from.

When ``k``, the gradient length or the world size changes (e.g. a density warm-up), cached
thresholds are stale (they estimate a k-th largest value): the call re-evaluates them (and,
for a new length or world size, the boundaries) regardless of the period; the step counter
keeps running, so every rank still agrees on the schedule.

Volume per rank: ``≈ 2k(P-1)/P`` (split and reduce, with balanced regions) + at most
``2k(P-1)/P`` (data balancing, only when triggered) + ``≈ 2k(P-1)/P`` (ring allgatherv of
the global top-k) ``≤ 6k(P-1)/P`` elements (Eq. 3) on steps that reuse the thresholds.  Steps
that re-evaluate the global threshold add the all-gather of the reduced values (line 10).  Every
(index, value) message's indices ascend; they travel blocked where that is smaller for messages
of ``k/P`` entries (:func:`tfsparse.wire.index_codec`).

Wire (``wire_dtype``): every message carries its values encoded -- split-and-reduce parts,
the reduced values all-gathered for the threshold, balancing parts and the final allgatherv.
An owner adds the decoded parts to its own region's entries (full precision); whoever encodes
a value that reaches the result keeps what the encoding lost (a sender for its local entries,
a region's holder for the reduced sums it all-gathers).

Phases: ``encode`` is lines 2-4 (local threshold and selection, by the
:class:`~tfsparse.compressors.ReusedThreshold` compressor, which holds the local threshold) and
advances the iteration counter; ``exchange`` is lines 5-14. State (``get_state``/``set_state``):
the counter, the cached thresholds, the boundaries, and the ``(n, P)`` and ``k`` they belong to,
so a run resumed between two re-evaluations reuses exactly the thresholds it would have reused.

Schedule (:meth:`OkTopkAllreduce.schedule`), with the *expected* counts under uniformly spread,
independent selections (density ``ρ = k/n`` on every rank) and balanced regions: every rank
selects ``k``; the boundary allreduce (``P-1`` float64) on repartition steps; the alltoall of
message lengths; ``P-1`` destination-rotation rounds of ``k/P`` entries (Eq. 1; buckets only
overlap them); on re-evaluation steps the allgather of every region's reduced values,
``(n/P)(1-(1-ρ)^P)`` each (the union of the ranks' selections in a region), and the k-th largest
of them; the allgather of the global top-k counts; the allgatherv of ``k/P`` entries per rank.
Data balancing runs only when the largest buffer exceeds ``balance_factor`` times the mean, which
equal expected buffers never do, so it is not in the expected schedule.  Its period
(:meth:`OkTopkAllreduce.period`) is ``lcm(tau, tau_prime)`` steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import _checks
from ..collectives.simulate import Round
from ..compressors import ReusedThreshold, adjusted_threshold, check_factor, kth_largest_magnitude
from ..wire import Wire, WireLoss, index_codec, pack_sparse, unpack_sparse
from .base import NOTHING, Aggregator, AllreduceResult, check_acc, reject_unknown_options
from .registry import register

TAG_REDUCE = 7401
TAG_BALANCE = 7402

_OPTIONS = ("tau", "tau_prime", "bucket_size", "balance_factor", "local_raise", "local_adjust",
            "global_adjust")


@dataclass
class _OkTopkPayload:
    n: int
    k: int
    t: int
    fresh: bool
    repartition: bool
    local_idx: np.ndarray
    local_val: np.ndarray
    codec: object  # how the indices travel (tfsparse.wire.index_codec, for messages of k/P entries)
    wire: Wire
    local_threshold: float   # the one used (the compressor already holds the next step's)


def local_boundaries(sel: np.ndarray, n: int, size: int) -> np.ndarray:
    """The P-1 interior boundaries that split the sorted local top-k indices ``sel`` into P
    regions holding equal numbers of them (§3.1.1); an even split of ``[0, n)`` when the rank
    selected fewer than P entries.

    Args:
      sel: this rank's local top-k indices, ascending.
      n: the vector's elements.
      size: P, the ranks.

    Returns:
      The P-1 boundaries (int64).
    """
    cnt = sel.size
    j = np.arange(1, size, dtype=np.int64)
    if cnt < size:
        return (j * n) // size
    return sel[(j * cnt) // size].astype(np.int64)


def balance_plan(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Data-balancing scheme (§3.1.2, Fig. 3) from the all-gathered buffer sizes.

    The buffers, concatenated in rank order, are re-split into P chunks of
    ``split_counts(total, P)`` entries.

    Args:
      counts: every rank's buffer size, in rank order.

    Returns:
      ``(starts, targets, moves)`` where ``moves[p, q]`` is the number of entries rank p sends
      to rank q, taken from p's buffer at offset ``max(starts[p], targets[q]) - starts[p]``.
    """
    counts = np.asarray(counts, dtype=np.int64)
    size = counts.size
    total = int(counts.sum())
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    base, extra = divmod(total, size)
    chunk = np.array([base + (1 if q < extra else 0) for q in range(size)], dtype=np.int64)
    targets = np.concatenate(([0], np.cumsum(chunk)[:-1]))
    lo = np.maximum(starts[:, None], targets[None, :])
    hi = np.minimum((starts + counts)[:, None], (targets + chunk)[None, :])
    moves = np.maximum(hi - lo, 0)
    return starts, targets, moves


@register("oktopk")
class OkTopkAllreduce(Aggregator):
    """O(k) sparse allreduce of Ok-Topk (oktopk-li2022 Alg. 1) -- see the module docstring.

    Args:
      tau: space repartition period τ in iterations (§3.1.1; default 64).
      tau_prime: threshold re-evaluation period τ' in iterations (§3.1.3; default 32).
      bucket_size: peers per communication bucket in split and reduce (§3.1.1, Fig. 2(b));
        the paper gives no number, 4 is the authors' implementation's throttle.
      balance_factor: data balancing runs when the largest global top-k buffer exceeds this
        many times the mean (§5.3; default 4).
      local_raise: the authors' threshold adjustment between re-evaluations (module
        docstring; default 1.03; 1.0 turns the rule off; all three at 1.0 is the paper's plain
        reuse).
      local_adjust: the same, the local threshold's adjustment (default 1.012).
      global_adjust: the same, the global threshold's adjustment (default 1.008).
      **unknown: any other keyword is refused (ValueError naming the accepted options).

    After each call ``last_info`` holds ``step``, ``fresh_thresholds``, ``repartitioned``,
    ``balanced``, ``local_count``, ``global_count``, ``local_threshold``,
    ``global_threshold`` and ``boundaries``.
    """

    def __init__(self, tau: int = 64, tau_prime: int = 32, bucket_size: int = 4, balance_factor: float = 4.0,
                 local_raise: float = 1.03, local_adjust: float = 1.012, global_adjust: float = 1.008,
                 **unknown):
        reject_unknown_options("oktopk", unknown, _OPTIONS)
        self.tau = _positive_int("tau", tau)
        self.tau_prime = _positive_int("tau_prime", tau_prime)
        self.bucket_size = _positive_int("bucket_size", bucket_size)
        self.balance_factor = _checks.real("balance_factor", balance_factor, 1.0, hint=(
            " (data balancing runs when the largest buffer exceeds balance_factor times the mean; default 4)"))
        #: the local selection, lines 2-4: the reused local threshold is its state
        self.compressor = ReusedThreshold(local_raise=local_raise, local_adjust=local_adjust)
        self.global_adjust = check_factor("global_adjust", global_adjust, 1.008)
        self.reset()

    def reset(self) -> None:
        """Starts afresh: the counter at 0, no thresholds, boundaries, layout or ``k`` (re-evaluated next call)."""
        self._t = 0
        self._layout = None  # (n, size) the cached state belongs to
        self._k = None
        self.compressor.threshold = None
        self.global_threshold = None
        self.boundaries = None
        self.last_info: dict = {}

    # -- explicit state ---------------------------------------------------------------------
    def get_state(self):
        """``t`` (the iteration counter), the layout and ``k`` the cache belongs to, the two
        thresholds (NaN: none yet) and the region boundaries (empty: none yet).

        Returns:
          ``{name: numpy array}`` (all five keys; NaN thresholds and empty ``boundaries`` where none is kept yet).
        """
        none, local = float("nan"), self.compressor.threshold
        return {"t": np.array([self._t], np.int64),
                "layout": np.array(self._layout if self._layout is not None else (-1, -1), np.int64),
                "k": np.array([-1 if self._k is None else self._k], np.int64),
                "thresholds": np.array([none if local is None else local,
                                        none if self.global_threshold is None else self.global_threshold],
                                       np.float64),
                "boundaries": (np.empty(0, np.int64) if self.boundaries is None
                               else np.asarray(self.boundaries, np.int64).copy())}

    def set_state(self, state):
        """Restores :meth:`get_state`'s output over a :meth:`reset` (an empty state: start afresh).

        Args:
          state: what :meth:`get_state` returned.
        """
        super().set_state(state)
        self.reset()
        if not state:  # nothing saved: start afresh
            return
        self._t = int(np.asarray(state["t"]).reshape(-1)[0])
        layout = tuple(int(v) for v in np.asarray(state["layout"]).reshape(-1))
        self._layout = None if layout[0] < 0 else layout
        k = int(np.asarray(state["k"]).reshape(-1)[0])
        self._k = None if k < 0 else k
        local, glob = (float(v) for v in np.asarray(state["thresholds"], np.float64).reshape(-1))
        self.compressor.threshold = None if np.isnan(local) else local
        self.global_threshold = None if np.isnan(glob) else glob
        bounds = np.asarray(state["boundaries"], np.int64).reshape(-1)
        self.boundaries = bounds.copy() if bounds.size else None

    def due(self, t: int) -> tuple[bool, bool]:
        """Whether step ``t`` (from 1) re-evaluates the thresholds (every ``tau_prime`` steps,
        §3.1.3) and repartitions the space (every ``tau``, §3.1.1) by the period alone.

        Args:
          t: the step, counted from 1.

        Returns:
          ``(re-evaluate, repartition)``.
        """
        return (t - 1) % self.tau_prime == 0, (t - 1) % self.tau == 0

    # -- timing (module docstring) ------------------------------------------------------------
    def schedule(self, b, n, k, step):
        """Step ``step``'s expected messages (module docstring), its phases as :meth:`due` decides them.

        Args:
          b: the builder the step's phases are declared to.
          n: the bucket's elements.
          k: the budget (``k/P`` expected entries per rank and region).
          step: which step of the period (:meth:`due`).
        """
        P = b.P
        fresh, repartition = self.due(step)
        share = k / P                                    # expected entries per (rank, region)
        message = b.message(n, share)
        if repartition:                                  # Alg. 1 lines 5-7
            b.allreduce("space repartition (boundaries)", P - 1, 8)
        b.alltoall("split and reduce: message lengths", 8)
        rotation = [Round("split and reduce", "rotation", 1, int(round(message)), int(round(share)), busy=P)
                    for _ in range(P - 1)]              # Alg. 1 line 8, Eq. 1
        b.point_to_point("split and reduce", "rotation", rotation, np.full(P, (P - 1) * message))
        b.local("split and reduce: own region", share)
        if fresh:                                        # Alg. 1 lines 9-12
            union = (n / P) * (1.0 - (1.0 - k / n) ** P)
            b.allgather("global threshold (reduced values)", union * b.value_bytes)
            b.local("global threshold: k-th largest", P * union)
        if P > 1:                                        # Alg. 1 line 13
            b.allgather("balance: buffer sizes", 8)
            b.allgather("allgatherv (global top-k)", message)
            b.local("allgatherv: concatenate", k)

    def period(self):
        """One period of ``lcm(tau, tau_prime)`` steps: step 1 repartitions and re-evaluates,
        ``1 + tau_prime·j`` re-evaluate, the rest reuse.

        Returns:
          A tuple of ``(step, weight)`` pairs.
        """
        length = math.lcm(self.tau, self.tau_prime)
        kinds: dict = {}
        for t in range(1, length + 1):
            first, count = kinds.get(self.due(t), (t, 0))
            kinds[self.due(t)] = (first, count + 1)
        return tuple((first, count / length) for first, count in sorted(kinds.values()))

    # -- Alg. 1 ---------------------------------------------------------------------------
    def prefilter(self, comm, n, k, peek):
        """The local selection's prefilter, told whether the next :meth:`encode` re-evaluates the
        threshold (as it decides: the period, a new layout or ``k``, no threshold yet).

        Args:
          comm: asked only for its size.
          n: the vector's elements.
          k: the budget.
          peek: ``peek(positions)``: the vector's values at int64 positions.

        Returns:
          A :class:`~tfsparse.compressors.Prefilter`, or None.
        """
        selection = self.compressor
        fresh = (self.due(self._t + 1)[0] or self._layout != (n, comm.size) or self._k != k
                 or selection.threshold is None or self.global_threshold is None)
        return selection.prefilter(n, k, peek, fresh=fresh)

    def encode(self, comm, acc, k, wire, offer=NOTHING):
        """Lines 2-4 (local threshold, local top-k by threshold: :attr:`compressor`) and the
        step's schedule.

        Args:
          comm: asked only for its size (the codec's ``k/P``-entry messages).
          acc: this rank's vector.
          k: the budget of the local and of the global selection.
          wire: the values' encoding in every message.
          offer: its ``candidates``, collected for :meth:`prefilter`'s answer.

        Returns:
          The payload: the step's counter and schedule, the local selection, the codec, the wire and
          the local threshold used.
        """
        acc, k = check_acc(acc, k)
        n, size = acc.size, comm.size
        selection = self.compressor
        if self._layout != (n, size):
            self.boundaries = None
            selection.threshold = self.global_threshold = None
            self._layout = (n, size)
        if self._k != k:
            selection.threshold = self.global_threshold = None
            self._k = k
        self._t += 1
        t = self._t
        fresh, repartition = self.due(t)
        fresh = fresh or selection.threshold is None or self.global_threshold is None
        repartition = repartition or self.boundaries is None
        if fresh:
            selection.threshold = None  # line 3: re-evaluated by the selection
        local_idx, local_val = self.select(acc, k, offer.candidates)
        return _OkTopkPayload(n, k, t, fresh, repartition, local_idx, local_val, index_codec(n, k / comm.size), wire,
                              selection.last_threshold)

    def exchange(self, comm, payload, out=None, settled=None):
        """Lines 5-14: repartition, split and reduce, global threshold, balance, allgatherv.

        Args:
          comm: the ranks of the step.
          payload: what :meth:`encode` returned.
          out: ignored: the result is the union of the regions' global top-k.
          settled: never called.

        Returns:
          An :class:`~tfsparse.aggregators.AllreduceResult` (ascending indices, identical everywhere);
          ``contributed`` is local ∩ global (line 14).
        """
        k, local_idx, codec, wire = payload.k, payload.local_idx, payload.codec, payload.wire
        n, size = payload.n, comm.size
        loss = WireLoss()

        # lines 5-7: space repartition (consensus = average of the local boundary vectors)
        if payload.repartition:
            mine = local_boundaries(local_idx, n, size).astype(np.float64)
            avg = comm.allreduce(mine, op="sum") / size if size > 1 else mine
            inner = np.clip(np.floor(avg).astype(np.int64), 0, n)
            self.boundaries = np.concatenate(([0], inner, [n])).astype(np.int64)
        bounds = self.boundaries

        # line 8: split and reduce
        red_idx, red_val = split_and_reduce(comm, local_idx, payload.local_val, bounds, codec, wire, loss,
                                            self.bucket_size)

        # lines 9-12: global threshold (all-gather of the reduced values on re-evaluation steps)
        if payload.fresh:
            gathered = [wire.decode(b, wire.entries(b.size)) for b in comm.allgather(wire.encode(red_val))]
            self.global_threshold = kth_largest_magnitude(np.concatenate(gathered), k)
        if k == 0:
            keep = np.zeros(red_val.size, dtype=bool)
        elif self.global_threshold <= 0.0:
            keep = np.ones(red_val.size, dtype=bool)
        else:
            keep = ~(np.abs(red_val) < self.global_threshold)
        g_idx, g_val = red_idx[keep], red_val[keep]

        # line 13: balance and allgatherv
        u_idx, u_val, balanced = balance_and_allgatherv(comm, g_idx, g_val, codec, wire, loss,
                                                        self.balance_factor)

        # line 14: indexes = local ∩ global
        from ..ops import cpu

        contributed = cpu.intersect_sorted(local_idx, u_idx)  # a linear merge: both are ascending
        self.last_info = {"step": payload.t, "fresh_thresholds": bool(payload.fresh),
                          "repartitioned": bool(payload.repartition), "balanced": bool(balanced),
                          "local_count": int(local_idx.size), "global_count": int(u_idx.size),
                          "local_threshold": float(payload.local_threshold),
                          "global_threshold": float(self.global_threshold), "boundaries": bounds.copy()}
        # the authors' adjustment toward k (u_idx.size is the same on every rank)
        self.global_threshold = adjusted_threshold(self.global_threshold, u_idx.size, k, 4 / 3, self.global_adjust)
        return AllreduceResult(indices=u_idx, values=u_val, contributed=contributed,
                               sent_elements=int(local_idx.size), loss=loss.restrict(u_idx))

    def __repr__(self):
        return (f"{type(self).__name__}(tau={self.tau}, tau_prime={self.tau_prime}, "
                f"bucket_size={self.bucket_size}, balance_factor={self.balance_factor}, "
                f"local_raise={self.compressor.local_raise}, local_adjust={self.compressor.local_adjust}, "
                f"global_adjust={self.global_adjust})")


# -- §3.1.1 ---------------------------------------------------------------------------

def split_and_reduce(comm, local_idx, local_val, bounds, codec, wire, loss, bucket_size: int):
    """Returns this rank's region's reduced local top-k entries (ascending indices).  The
    own region's entries go in at full precision, the others' decoded from the wire.

    Split and reduce (§3.1.1, Alg. 1 line 8): each region's entries go to its owner, in buckets
    of ``bucket_size`` peers by destination rotation (Fig. 2(b)), reduced as they arrive.

    Args:
      comm: the communicator.
      local_idx: this rank's local top-k indices, ascending.
      local_val: their values.
      bounds: the P+1 region boundaries.
      codec: the index codec of the messages.
      wire: the values' encoding.
      loss: the round's :class:`~tfsparse.wire.WireLoss`, to record what the encodings lost.
      bucket_size: peers per communication bucket.

    Returns:
      ``(indices, values)`` of this rank's region, summed over the ranks.
    """
    rank, size = comm.rank, comm.size
    cuts = np.searchsorted(local_idx, bounds)  # local_idx[cuts[j]:cuts[j+1]] lies in region j
    messages = [None] * size
    for dst in range(size):
        c0, c1 = int(cuts[dst]), int(cuts[dst + 1])
        if dst != rank and c1 > c0:
            part = local_idx[c0:c1]
            messages[dst], lost = pack_sparse(part, local_val[c0:c1], codec, wire)
            loss.add(part, lost)
    send_bytes = np.array([0 if m is None else m.size for m in messages], dtype=np.int64)
    if size > 1:  # message lengths first, so that every receive can be posted at once
        recv_bytes = np.concatenate(comm.alltoall([send_bytes[j:j + 1] for j in range(size)]))
    else:
        recv_bytes = send_bytes.copy()
    from ..ops import cpu

    # the region's sum so far as a sparse vector (ascending indices): each part is merged in
    # (ops.cpu.merge_sum: a new index gets 0 + value, a known one its sum + value) -- what
    # adding the parts into a zeroed region vector gives, without the region-sized passes
    reduced_idx, reduced_val = np.empty(0, np.int64), np.empty(0, np.float32)

    def reduce_part(idx, val):
        nonlocal reduced_idx, reduced_val
        reduced_idx, reduced_val = cpu.merge_sum(reduced_idx, reduced_val, idx, val)

    steps = list(range(1, size))
    buckets = [steps[i:i + bucket_size] for i in range(0, len(steps), bucket_size)]
    sends = []
    pending = None  # (list of (source, request)) of the bucket in flight
    own = slice(int(cuts[rank]), int(cuts[rank + 1]))
    own_reduced = False
    for bucket in buckets + [[]]:  # the last, empty bucket reduces what the one before it brought
        posted = []
        for s in bucket:  # destination rotation (Fig. 2(b))
            dst, src = (rank + s) % size, (rank - s) % size
            if recv_bytes[src] > 0:
                posted.append((src, comm.irecv(src, int(recv_bytes[src]), tag=TAG_REDUCE, dtype=np.uint8)))
            if messages[dst] is not None:
                sends.append(comm.isend(messages[dst], dst, tag=TAG_REDUCE))
        # overlap: reduce what is already here while this bucket is in flight
        if not own_reduced:
            reduce_part(local_idx[own], local_val[own])
            own_reduced = True
        if pending is not None:
            for _src, req in pending:
                reduce_part(*unpack_sparse(req.wait(), codec, wire))
        pending = posted
    for req in sends:
        req.wait()
    return reduced_idx, reduced_val


# -- §3.1.2 ---------------------------------------------------------------------------

def balance_and_allgatherv(comm, g_idx, g_val, codec, wire, loss, balance_factor: float):
    """All ranks get the concatenation (rank order) of every rank's global top-k buffer.
    Whoever encodes values (a balancing sender, a buffer's holder) keeps what that lost.

    Data balancing (§3.1.2) runs first where the largest buffer exceeds ``balance_factor`` times the mean.

    Args:
      comm: the communicator.
      g_idx: this rank's global top-k buffer's indices.
      g_val: their values.
      codec: the index codec of the messages.
      wire: the values' encoding.
      loss: the round's :class:`~tfsparse.wire.WireLoss`, to record what the encodings lost.
      balance_factor: the aggregator's ``balance_factor``.

    Returns:
      ``(indices, values, balanced)``.
    """
    size, rank = comm.size, comm.rank
    if size == 1:
        return g_idx.astype(np.int64, copy=False), g_val.astype(np.float32, copy=False), False
    counts = np.concatenate(comm.allgather(np.array([g_idx.size], dtype=np.int64)))
    total = int(counts.sum())
    balanced = total > 0 and counts.max() > balance_factor * (total / size)
    if balanced:
        starts, targets, moves = balance_plan(counts)
        sends = []
        for q in range(size):
            if q != rank and moves[rank, q] > 0:
                off = max(starts[rank], targets[q]) - starts[rank]
                sl = slice(int(off), int(off + moves[rank, q]))
                message, lost = pack_sparse(g_idx[sl], g_val[sl], codec, wire)
                loss.add(g_idx[sl], lost)
                sends.append(comm.isend(message, q, tag=TAG_BALANCE))
        parts_idx, parts_val = [], []
        for p in range(size):  # the chunk in global order: pieces from lower ranks first
            if moves[p, rank] == 0:
                continue
            if p == rank:
                off = max(starts[rank], targets[rank]) - starts[rank]
                sl = slice(int(off), int(off + moves[rank, rank]))
                parts_idx.append(g_idx[sl])
                parts_val.append(g_val[sl])
            else:
                i, v = unpack_sparse(comm.recv(p, tag=TAG_BALANCE, dtype=np.uint8), codec, wire)
                parts_idx.append(i)
                parts_val.append(v)
        for req in sends:
            req.wait()
        mine_idx = np.concatenate(parts_idx) if parts_idx else np.empty(0, np.int64)
        mine_val = np.concatenate(parts_val) if parts_val else np.empty(0, np.float32)
    else:
        mine_idx, mine_val = g_idx, g_val
    message, lost = pack_sparse(mine_idx, mine_val, codec, wire)
    loss.add(mine_idx, lost)
    pieces = [unpack_sparse(b, codec, wire) for b in comm.allgather(message)]
    u_idx = np.concatenate([p[0] for p in pieces]) if pieces else np.empty(0, np.int64)
    u_val = np.concatenate([p[1] for p in pieces]) if pieces else np.empty(0, np.float32)
    return u_idx, u_val, bool(balanced)


def _positive_int(name, value) -> int:
    return _checks.integer(name, value, 1)
