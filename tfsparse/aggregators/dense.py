"""Dense allreduce (DenseAllReduce, gtopk-ssgd-shi2019 §II-D): lossless baseline."""
from __future__ import annotations

from .base import Aggregator, AllreduceResult, check_acc
from .registry import register


@register("dense")
class DenseAllreduce(Aggregator):
    """Sums the full gradient over ranks.  Volume per rank ``2n(P-1)/P`` elements (Eq. 5)."""

    uses_memory = False

    def allreduce(self, comm, acc, k=None):
        acc = check_acc(acc, acc.size if k is None else k)
        total = comm.allreduce(acc, op="sum")
        return AllreduceResult(indices=None, values=total, contributed=None, sent_elements=acc.size)
