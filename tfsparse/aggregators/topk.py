"""TopKAllReduce baseline (gtopk-ssgd-shi2019 §II-E, Alg. 1 lines 12-21).

Every rank selects a sparse payload with its :class:`~tfsparse.compressors.Compressor`
(exact local top-k by default), the (index, value) pairs are all-gathered and summed.
Volume per rank ``2k(P-1)`` elements (Eq. 6).
"""
from __future__ import annotations

import numpy as np

from ..compressors import Compressor, TopK
from .base import Aggregator, AllreduceResult, check_acc, sum_sparse
from .registry import register


@register("topk")
class AllgatherAggregator(Aggregator):
    """Compress locally, allgather (index, value) pairs, sum in rank order."""

    def __init__(self, compressor: Compressor | None = None):
        self.compressor = compressor if compressor is not None else TopK()

    def allreduce(self, comm, acc, k):
        acc = check_acc(acc, k)
        idx, val = self.compressor.compress(acc, k)
        idx = np.asarray(idx, dtype=np.int64)
        val = np.asarray(val, dtype=np.float32)
        # indices travel as int32 when they fit (as in the papers' 2k volume), else int64
        itype = np.int32 if acc.size < 2**31 else np.int64
        all_idx = comm.allgather(idx.astype(itype))
        all_val = comm.allgather(val)
        g_idx, g_val = sum_sparse(all_idx, all_val)
        return AllreduceResult(indices=g_idx, values=g_val, contributed=idx, sent_elements=int(idx.size))

    def __repr__(self):
        return f"{type(self).__name__}(compressor={self.compressor!r})"
