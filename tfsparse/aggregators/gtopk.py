"""gTop-k sparse allreduce (gtopk-ssgd-shi2019 §III, Alg. 3 "gTopKAllReduce" and Alg. 4).

Every rank selects its exact local top-k (Alg. 4 lines 5-7).  The sparse vectors are then
reduced up a recursive-doubling tree with the ⊤ operation of Definition 1 (§III-C): at
round j the ranks pair at distance ``2^(j-1)``, the higher rank of a pair sends its
``[V, I]`` (2k elements) to the lower one, which merges with ⊤ -- the exact top-k of the
*sum* of the two sparse vectors -- and goes on to the next round (Alg. 3 lines 4-18).
After ``log2 P`` rounds rank 0 holds ``G~ = G~^1 ⊤ G~^2 ⊤ ... ⊤ G~^P`` (at most k
entries), which it broadcasts (Alg. 3 line 19).  Rank 0's traffic is ``2k log2 P`` elements
received plus ``2k log2 P`` sent in the binomial broadcast: the ``4k log2 P`` of Eq. 7.

Non-power-of-two P (the paper assumes a power of two, §III): with ``P2`` the largest power
of two ``<= P``, the surplus ranks ``P2 .. P-1`` are first folded into the tree -- rank
``P2 + i`` sends to rank ``i``, which merges with ⊤ -- and the recursive doubling then runs
over ranks ``0 .. P2-1``.  This adds one round (``ceil(log2 P)`` in total, the same depth
as a binomial tree) and keeps every merge a ⊤ of two operands, so the result still has at
most k entries.  The broadcast is a binomial tree over all P ranks, so every rank ends with
the same result.  Alg. 3 line 17's per-round ``Barrier()`` is left out: the paired
point-to-point messages already order the rounds, a barrier would only add latency.

Residuals (Alg. 4 line 10): ``G^g += G~^g ⊙ ¬gMask ⊙ Mask`` -- of this rank's local top-k
(``Mask``) only the entries whose index is in the global result (``gMask``) leave the
residual.  So ``contributed = Mask ∩ gMask``.  **Known loss:** a local value can be dropped
by an intermediate ⊤ (its partial sum was not in the top-k at that tree node) while the
same index still reaches the final result through another subtree; that value is then
neither applied nor kept in the residual.  This is exactly what Alg. 4 defines and what the
authors' code does; ``applied + residuals`` therefore falls short of the raw gradients by
these dropped values (tests/test_aggregators.py measures it against a tree reference).

Wire (``wire_dtype``): every tree message and the broadcast carry their values encoded; a
receiver merges the decoded values with its own at full precision.  Each rank keeps what its
own encodings lost, for the indices that reach the result: a leaf on its local top-k, an
inner node on the partial sums it forwards, rank 0 on the broadcast result.

``encode`` is the local top-k (Alg. 4 lines 5-7, the :class:`~tfsparse.compressors.TopK`
compressor); ``exchange`` is Alg. 3 (the tree and the broadcast).

Schedule (:meth:`GTopKAllreduce.schedule`): the rounds of :func:`tree_schedule`, one ``k``-entry
message per sender (a ⊤ merge always keeps exactly ``k`` entries) and a ``2k``-element merge per
receiver; then rank 0's binomial broadcasts of the result's length (8 bytes) and of the
``k``-entry result -- ``3⌈log2 P⌉`` rounds, Eq. 7's ``4k log2 P`` volume at rank 0.  Every message's
indices ascend, so they travel blocked (:func:`tfsparse.wire.index_codec`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..collectives.simulate import Round
from ..compressors import TopK, topk_indices
from ..wire import Wire, WireLoss, index_codec, pack_sparse, unpack_sparse
from .base import NOTHING, Aggregator, AllreduceResult, check_acc, reject_unknown_options
from .registry import register

TAG_GTOPK = 7301


@dataclass
class _GTopKPayload:
    k: int
    local_idx: np.ndarray
    local_val: np.ndarray
    codec: object  # how the indices travel (tfsparse.wire.index_codec)
    wire: Wire


# -- the ⊤ operation ------------------------------------------------------------------------

def top_merge(a_idx, a_val, b_idx, b_val, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``G~^a ⊤ G~^b`` (gtopk-ssgd-shi2019 §III-C, Definition 1): the exact top-k (by
    magnitude) of the sum of two sparse vectors.  Inputs and output: ascending unique int64
    indices with float32 values; the output has ``min(k, |I^a ∪ I^b|)`` entries.

    Args:
      a_idx: the first vector's indices.
      a_val: its values.
      b_idx: the second vector's indices.
      b_val: its values.
      k: how many entries to keep.

    Returns:
      ``(indices, values)``.
    """
    from ..ops import cpu

    union, summed = cpu.merge_sum(a_idx, a_val, b_idx, b_val)  # one linear merge of the sorted inputs
    keep = topk_indices(summed, k)
    return union[keep], summed[keep]


def tree_schedule(size: int):
    """The reduction tree as a list of rounds, each a list of ``(receiver, sender)`` pairs:
    the fold round for the surplus ranks (if ``size`` is not a power of two), then the
    recursive-doubling rounds at distance 1, 2, 4, ... (Alg. 3 lines 4-18).

    Args:
      size: the ranks.

    Returns:
      A list of rounds.
    """
    p2 = 1 << (size.bit_length() - 1)
    rounds = []
    if size > p2:
        rounds.append([(r - p2, r) for r in range(p2, size)])
    dist = 1
    while dist < p2:
        rounds.append([(r, r + dist) for r in range(0, p2, 2 * dist)])
        dist *= 2
    return rounds


@register("gtopk")
class GTopKAllreduce(Aggregator):
    """gTopKAllReduce (gtopk-ssgd-shi2019 Alg. 3) with Alg. 4's residual rule.

    No options.  ``allreduce(comm, acc, k)`` returns at most k entries (values summed over
    the ranks whose contributions survived the tree), identical on every rank;
    ``contributed`` is ``Mask ∩ gMask`` (Alg. 4 line 10, see the module docstring for the
    known loss).  After each call ``last_info`` holds ``rounds`` (the tree depth),
    ``received_bytes`` (bytes this rank received in the reduction), ``local_count`` and
    ``global_count``.

    Args:
      **unknown: any other keyword is refused (ValueError naming the accepted options).
    """

    def __init__(self, **unknown):
        reject_unknown_options("gtopk", unknown, ())
        self.compressor = TopK()  # Alg. 4 lines 5-7: the exact local top-k
        self.last_info: dict = {}

    @property
    def accepts_device(self) -> bool:
        """The local top-k runs where ``acc`` lives; only the k entries come back."""
        return self.compressor.on_device

    def encode(self, comm, acc, k, wire, offer=NOTHING):
        """The exact local top-k of ``acc`` (Alg. 4 lines 5-7, :class:`~tfsparse.compressors.TopK`) and the index
        codec of ``k``-entry messages; nothing is encoded before :meth:`exchange`.

        Args:
          comm: unused (the tree's ranks are the exchange's).
          acc: this rank's vector (host or CUDA device: the top-k runs where it lives).
          k: the size of the local and of the global top-k.
          wire: the values' encoding in the tree's messages and the broadcast.
          offer: its ``candidates``, where the fused pass collected them for the top-k.

        Returns:
          The payload: the local top-k (indices ascending), ``k``, the codec and the wire.
        """
        acc, k = check_acc(acc, k)
        # Alg. 4 lines 5-7: exact local top-k (Mask)
        local_idx, local_val = self.select(acc, k, offer.candidates)
        return _GTopKPayload(k, local_idx, local_val, index_codec(acc.size, k), wire)

    def schedule(self, b, n, k, step):
        """The rounds of :func:`tree_schedule` (one ``k``-entry message per sender, a ``2k``-element merge
        per receiver), then rank 0's broadcasts of the result's length and of the result (Alg. 3 line 19).

        Args:
          b: the builder the tree's messages are declared to.
          n: the bucket's elements (the index codec's).
          k: the entries of each message and of the result.
          step: ignored: every step alike.
        """
        msg = b.message(n, k)
        tree = tree_schedule(b.P)  # the fold round (non-power-of-two P), then recursive doubling
        sent = np.zeros(b.P)
        for pairs in tree:  # the higher rank of a pair sends
            sent[[sender for _, sender in pairs]] += msg
        b.point_to_point("reduction tree", "tree",
                         [Round("reduction tree", "tree", 1, msg, 2 * k, busy=len(pairs)) for pairs in tree], sent)
        b.bcast("broadcast length", 8)       # Alg. 3 line 19: the result's length first (int64) ...
        b.bcast("broadcast result", msg)     # ... then the k-entry result

    def exchange(self, comm, payload, out=None, settled=None):
        """Alg. 3: the ⊤ merges up the tree (:func:`top_merge`) and rank 0's broadcast of the result;
        ``contributed`` is Alg. 4 line 10's ``Mask ∩ gMask``.

        Args:
          comm: the ranks of the tree.
          payload: what :meth:`encode` returned.
          out: ignored: the result has at most ``k`` entries.
          settled: never called.

        Returns:
          An :class:`~tfsparse.aggregators.AllreduceResult` of at most ``k`` ascending indices, the same on
          every rank; ``contributed`` this rank's surviving entries.
        """
        k, local_idx, codec, wire = payload.k, payload.local_idx, payload.codec, payload.wire
        cur_idx, cur_val = local_idx, payload.local_val
        rank, size = comm.rank, comm.size
        loss = WireLoss()
        received = 0
        rounds = tree_schedule(size)
        active = True
        for pairs in rounds:  # Alg. 3 lines 4-18 (fold round first when P is not a power of two)
            if not active:
                break
            for receiver, sender in pairs:
                if rank == sender:
                    message, lost = pack_sparse(cur_idx, cur_val, codec, wire)
                    loss.add(cur_idx, lost)
                    comm.send(message, receiver, tag=TAG_GTOPK)
                    active = False
                elif rank == receiver:
                    buf = comm.recv(sender, tag=TAG_GTOPK, dtype=np.uint8)
                    received += buf.nbytes
                    r_idx, r_val = unpack_sparse(buf, codec, wire)
                    cur_idx, cur_val = top_merge(r_idx, r_val, cur_idx, cur_val, k)  # recvs ⊤ sends
        # Alg. 3 line 19: Bcast(sends, root=0); its length goes first (the result may hold < k)
        if size > 1:
            message = None
            if rank == 0:
                message, lost = pack_sparse(cur_idx, cur_val, codec, wire)
                loss.add(cur_idx, lost)
            nbytes = comm.bcast(np.array([message.size], dtype=np.int64) if rank == 0 else None, root=0,
                                shape=(1,), dtype=np.int64)
            message = comm.bcast(message, root=0, shape=(int(nbytes[0]),), dtype=np.uint8)
            g_idx, g_val = unpack_sparse(message, codec, wire)
        else:
            g_idx, g_val = cur_idx, cur_val.astype(np.float32, copy=False)
        # Alg. 3 lines 21-22 (gMask) and Alg. 4 line 10: Mask ∩ gMask leaves the residual
        from ..ops import cpu

        contributed = cpu.intersect_sorted(local_idx, g_idx)  # a linear merge: both are ascending
        self.last_info = {"rounds": len(rounds), "received_bytes": received, "local_count": int(local_idx.size),
                          "global_count": int(g_idx.size)}
        return AllreduceResult(indices=g_idx, values=g_val, contributed=contributed,
                               sent_elements=int(local_idx.size), loss=loss.restrict(g_idx))
