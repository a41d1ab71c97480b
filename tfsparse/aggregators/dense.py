"""Dense allreduce (DenseAllReduce, gtopk-ssgd-shi2019 §II-D): the lossless baseline, and the
dense exchange over a 16/8-bit wire (GradientFlow's fp16 communication, gradientflow-sun2019
§2.3; Pipe-SGD's truncation and quantization, pipe-sgd-li2018 §3.2)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..collectives.communicator import split_counts
from ..wire import FLOAT32, Wire, WireLoss
from .base import Aggregator, AllreduceResult, check_acc
from .registry import register


@dataclass
class _DensePayload:
    acc: np.ndarray
    wire: Wire
    counts: np.ndarray | None = None
    blocks: list | None = None  # encoded block for each rank (None for this rank's own)
    loss: WireLoss | None = None


@register("dense")
class DenseAllreduce(Aggregator):
    """Sums the full gradient over ranks.  Volume per rank ``2n(P-1)/P`` values (Eq. 5).

    float32 wire: ``comm.allreduce`` (reduce-scatter + allgather, bit-identical everywhere).
    A 16/8-bit wire: a reduce-scatter in which every rank sends block ``j`` of its gradient,
    encoded, to rank ``j`` (one alltoall); the owner sums the decoded blocks in rank order in
    float32 (its own block at full precision), encodes the sum once and all-gathers it.
    Every rank decodes the same bytes, so the result is bit-identical everywhere.  Bytes per
    rank: ``wire.nbytes`` of ``n - n_rank`` values out and ``n - n_(rank+1)`` in the ring
    allgather -- exactly half of float32's for a 16-bit wire when ``P`` divides ``n``.  The
    sender keeps what encoding its blocks lost, the owner what encoding the sum lost.
    """

    uses_memory = False

    def encode(self, comm, acc, k=None, wire=FLOAT32):
        acc, _ = check_acc(acc, np.size(acc) if k is None else k)
        if not wire.lossy or comm.size == 1:
            return _DensePayload(acc, wire)
        counts = split_counts(acc.size, comm.size)
        offs = np.concatenate(([0], np.cumsum(counts)))
        loss = WireLoss()
        blocks = []
        for j in range(comm.size):
            if j == comm.rank:
                blocks.append(None)
                continue
            block = slice(int(offs[j]), int(offs[j + 1]))
            buf, lost = wire.encode_with_loss(acc[block])
            loss.add(block, lost)
            blocks.append(buf)
        return _DensePayload(acc, wire, counts, blocks, loss)

    def exchange(self, comm, payload):
        acc, wire = payload.acc, payload.wire
        if payload.blocks is None:
            total = comm.allreduce(acc, op="sum")
            return AllreduceResult(indices=None, values=total, contributed=None, sent_elements=acc.size)
        rank, size, counts = comm.rank, comm.size, payload.counts
        offs = np.concatenate(([0], np.cumsum(counts)))
        own = slice(int(offs[rank]), int(offs[rank + 1]))
        blocks = [b if b is not None else np.empty(0, np.uint8) for b in payload.blocks]
        received = comm.alltoall(blocks)
        mine = np.zeros(int(counts[rank]), np.float32)
        for src in range(size):  # rank order: the same float32 rounding on every owner
            if src == rank:
                mine += acc[own]
            else:
                wire.decode_into(received[src], int(counts[rank]), mine, accumulate=True)
        buf, lost = wire.encode_with_loss(mine)
        loss = payload.loss
        loss.add(own, lost)
        parts = comm.allgather(buf)
        total = np.empty(acc.size, np.float32)
        for j in range(size):
            wire.decode_into(parts[j], int(counts[j]), total[int(offs[j]):int(offs[j + 1])])
        return AllreduceResult(indices=None, values=total, contributed=None, sent_elements=acc.size, loss=loss)
