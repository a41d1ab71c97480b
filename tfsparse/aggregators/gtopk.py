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
"""
from __future__ import annotations

import numbers

import numpy as np

from ..compressors import topk_indices
from .base import Aggregator, AllreduceResult, check_acc
from .registry import register

TAG_GTOPK = 7301


# -- helpers shared by the point-to-point aggregators ------------------------------------

def reject_unknown_options(algorithm: str, unknown: dict, accepted) -> None:
    """Raises ValueError naming the unknown options and the accepted ones."""
    if unknown:
        names = ", ".join(f"{k}={v!r}" for k, v in sorted(unknown.items()))
        acc = ", ".join(accepted) if accepted else "(none)"
        raise ValueError(f"unknown option(s) {names} for algorithm={algorithm!r}; accepted: {acc}")


def check_k(k, n: int) -> int:
    """``k`` must be an integer in ``[0, n]``; raises ValueError before any communication."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise ValueError(f"k={k!r} must be an integer in [0, {n}] (the number of elements to keep)")
    if not 0 <= int(k) <= n:
        raise ValueError(f"k={k} must be in [0, {n}] (the gradient has {n} elements)")
    return int(k)


def index_dtype(n: int):
    """Indices travel as int32 when they fit (the papers' 2k-element COO volume), else int64."""
    return np.int32 if n < 2**31 else np.int64


def pack_sparse(idx: np.ndarray, val: np.ndarray, itype) -> np.ndarray:
    """One contiguous byte buffer ``[indices as itype | values as float32]`` (one message)."""
    idx = np.ascontiguousarray(idx, dtype=itype)
    val = np.ascontiguousarray(val, dtype=np.float32)
    return np.concatenate([idx.view(np.uint8), val.view(np.uint8)])


def entry_bytes(itype) -> int:
    return np.dtype(itype).itemsize + 4


def unpack_sparse(buf: np.ndarray, itype) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_sparse`: returns (int64 indices, float32 values)."""
    buf = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    isz = np.dtype(itype).itemsize
    m = buf.size // (isz + 4)
    if m * (isz + 4) != buf.size:
        raise RuntimeError(f"corrupt sparse message of {buf.size} bytes")
    idx = buf[:m * isz].copy().view(itype).astype(np.int64)
    val = buf[m * isz:].copy().view(np.float32)
    return idx, val


# -- the ⊤ operation ------------------------------------------------------------------------

def top_merge(a_idx, a_val, b_idx, b_val, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``G~^a ⊤ G~^b`` (gtopk-ssgd-shi2019 §III-C, Definition 1): the exact top-k (by
    magnitude) of the sum of two sparse vectors.  Inputs and output: ascending unique int64
    indices with float32 values; the output has ``min(k, |I^a ∪ I^b|)`` entries."""
    a_idx = np.asarray(a_idx, dtype=np.int64)
    b_idx = np.asarray(b_idx, dtype=np.int64)
    union, inverse = np.unique(np.concatenate([a_idx, b_idx]), return_inverse=True)
    summed = np.zeros(union.size, dtype=np.float32)
    summed[inverse[:a_idx.size]] = a_val
    summed[inverse[a_idx.size:]] += np.asarray(b_val, dtype=np.float32)
    keep = topk_indices(summed, k)
    return union[keep], summed[keep]


def tree_schedule(size: int):
    """The reduction tree as a list of rounds, each a list of ``(receiver, sender)`` pairs:
    the fold round for the surplus ranks (if ``size`` is not a power of two), then the
    recursive-doubling rounds at distance 1, 2, 4, ... (Alg. 3 lines 4-18)."""
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
    ``received_bytes`` (bytes this rank received in the reduction) and ``local_count``.
    """

    def __init__(self, **unknown):
        reject_unknown_options("gtopk", unknown, ())
        self.last_info: dict = {}

    def allreduce(self, comm, acc, k):
        acc = check_acc(acc, check_k(k, np.size(acc)))
        k = int(k)
        n = acc.size
        itype = index_dtype(n)
        # Alg. 4 lines 5-7: exact local top-k (Mask)
        local_idx = topk_indices(acc, k)
        cur_idx, cur_val = local_idx, acc[local_idx]
        rank, size = comm.rank, comm.size
        received = 0
        rounds = tree_schedule(size)
        active = True
        for pairs in rounds:  # Alg. 3 lines 4-18 (fold round first when P is not a power of two)
            if not active:
                break
            for receiver, sender in pairs:
                if rank == sender:
                    comm.send(pack_sparse(cur_idx, cur_val, itype), receiver, tag=TAG_GTOPK)
                    active = False
                elif rank == receiver:
                    buf = comm.recv(sender, tag=TAG_GTOPK, dtype=np.uint8)
                    received += buf.nbytes
                    r_idx, r_val = unpack_sparse(buf, itype)
                    cur_idx, cur_val = top_merge(r_idx, r_val, cur_idx, cur_val, k)  # recvs ⊤ sends
        # Alg. 3 line 19: Bcast(sends, root=0); the entry count goes first (the result may hold < k)
        if size > 1:
            count = comm.bcast(np.array([cur_idx.size], dtype=np.int64) if rank == 0 else None, root=0,
                               shape=(1,), dtype=np.int64)
            m = int(count[0])
            payload = comm.bcast(pack_sparse(cur_idx, cur_val, itype) if rank == 0 else None, root=0,
                                 shape=(m * entry_bytes(itype),), dtype=np.uint8)
            g_idx, g_val = unpack_sparse(payload, itype)
        else:
            g_idx, g_val = cur_idx, cur_val.astype(np.float32, copy=False)
        # Alg. 3 lines 21-22 (gMask) and Alg. 4 line 10: Mask ∩ gMask leaves the residual
        contributed = np.intersect1d(local_idx, g_idx, assume_unique=True)
        self.last_info = {"rounds": len(rounds), "received_bytes": received, "local_count": int(local_idx.size),
                          "global_count": int(g_idx.size)}
        return AllreduceResult(indices=g_idx, values=g_val, contributed=contributed,
                               sent_elements=int(local_idx.size))
