"""Dense allreduce (DenseAllReduce, gtopk-ssgd-shi2019 §II-D): the lossless baseline, and the
dense exchange over a 16/8-bit wire (GradientFlow's fp16 communication, gradientflow-sun2019
§2.3; Pipe-SGD's truncation and quantization, pipe-sgd-li2018 §3.2).

Schedule (:meth:`DenseAllreduce.schedule`): one allreduce of the ``n`` values (Eq. 5), priced
as the faster of the ring and recursive halving-doubling; a lossy wire's reduce-scatter (direct
or ring) sends the ring's bytes."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _checks
from ..buffers import Reusable
from ..collectives.communicator import split_counts
from ..wire import FLOAT32, Wire, WireLoss
from .base import NOTHING, Aggregator, AllreduceResult, check_acc
from .registry import register


_RS_TAG, _AG_TAG = 71, 72  # the 16/8-bit exchange's point-to-point messages (on the exchange's own communicator)


def _progress(comm):
    """What a decode that overlaps messages in flight calls between its pieces, so that they move
    meanwhile (:meth:`Wire.decode_into`, in pieces of :data:`tfsparse.wire.DECODE_PIECE`)."""
    return comm.progress if comm.manual_progress else None


@dataclass
class _DensePayload:
    acc: np.ndarray
    wire: Wire
    counts: np.ndarray | None = None
    blocks: list | None = None  # encoded block for each rank (None for this rank's own)
    loss: WireLoss | None = None
    in_place: bool = False  # what each encoding loses is written over the values it encoded


@register("dense")
class DenseAllreduce(Aggregator):
    """Sums the full gradient over ranks.  Volume per rank ``2n(P-1)/P`` values (Eq. 5).

    float32 wire: ``comm.allreduce`` (reduce-scatter + allgather, bit-identical everywhere).

    A 16/8-bit wire -- Pipe-SGD's compressed allreduce (pipe-sgd-li2018 §3.2, Fig. 3b: every
    message of the reduce-scatter and of the allgather travels compressed):

    * reduce-scatter: every rank sends block ``j`` of its gradient, encoded, straight to its
      owner ``j`` (all sends posted at once); the owner decodes and sums the blocks in rank
      order in float32 (its own at full precision), overlapping the decoding with the blocks
      still on the wire;
    * allgather around the ring: the owner encodes the sum once; each of the ``P - 1`` hops
      forwards the last encoded block received to the right-hand neighbour and decodes it
      while the next one travels (Fig. 3's pipelining of transfer and decompression).

    Every rank decodes the same bytes, so the result is bit-identical everywhere.  Bytes per
    rank are the ring's: ``wire.nbytes`` of ``n - n_rank`` values out in the reduce-scatter and
    ``n - n_(rank+1)`` in the allgather -- exactly half of float32's for a 16-bit wire when
    ``P`` divides ``n``, a quarter plus the scales for int8.  The sender keeps what encoding
    its blocks lost, the owner what encoding the sum lost.

    Args:
      reduce_scatter: ``"direct"`` (default, above: each value is quantized once before it is
        summed) or ``"ring"`` -- the paper's ring reduce-scatter (Fig. 2c / 3b): ``P - 1`` hops
        around the ring, each decoding the partial sum it receives, adding its own block and
        re-compressing the new partial sum for the next hop ("repeated invocation of compression
        and decompression, i.e. for each transmit-and-reduce step").  The same bytes, ``P - 1``
        sequential messages instead of one round, and more quantization error (every hop's);
        each hop's sender keeps what its encoding of the partial sum lost, so applied +
        residuals still equal the gradients.  Float32 wires ignore it (``comm.allreduce``).
    """

    uses_memory = False
    in_place_residual = True
    REDUCE_SCATTERS = ("direct", "ring")

    def __init__(self, reduce_scatter: str = "direct"):
        self.reduce_scatter = _checks.choice("reduce_scatter", reduce_scatter, self.REDUCE_SCATTERS)
        #: the 16/8-bit exchange's messages, receive buffers and block sums, reused round after round
        self.buffers = Reusable(keep=32)

    def fused_spans(self, comm, n, wire):
        """The direct reduce-scatter's blocks for the other ranks, over a lossy wire whose
        encoding fuses the error feedback's sum (:attr:`Wire.fuses_compensation
        <tfsparse.wire.Wire.fuses_compensation>`).

        Args:
          comm: asked only for its rank and size.
          n: the offered vector's elements.
          wire: the round's wire.

        Returns:
          The ``P - 1`` blocks' ``(start, stop)``; None where the wire is lossless or does not fuse,
          on one rank, or where the reduce-scatter is not the direct one.
        """
        if not (wire.lossy and wire.fuses_compensation) or comm.size == 1 or self.reduce_scatter != "direct":
            return None
        offs = np.concatenate(([0], np.cumsum(split_counts(n, comm.size))))
        return [(int(offs[j]), int(offs[j + 1])) for j in range(comm.size) if j != comm.rank]

    def encode(self, comm, acc, k=None, wire=FLOAT32, offer=NOTHING):
        """``offer.in_place``: ``acc`` (finite) is the memory's scratch vector -- each block's
        encoding writes what it lost over the block it read (one pass), so that after the
        exchange ``acc`` holds this rank's new residual (``result.residual_in_place``) and nothing
        else is kept.  ``offer.encoded``: those blocks' messages, made already with the error
        feedback's pass (in the order of :meth:`fused_spans`).

        Args:
          comm: asked only for its rank and size (the reduce-scatter's blocks).
          acc: this rank's whole vector, every element of which is sent.
          k: not used, but checked to be an integer in ``[0, acc.size]``: the dense sum has every
            element (None: ``acc.size``).
          wire: the encoding of the blocks (float32: one ``comm.allreduce`` of ``acc`` as it is).
          offer: ``in_place`` and ``encoded`` as above; its ``candidates`` are never asked for.

        Returns:
          The payload: ``acc``, the wire and, over a lossy wire, this rank's encoded blocks.
        """
        in_place, encoded = offer.in_place, offer.encoded
        acc, _ = check_acc(acc, np.size(acc) if k is None else k)
        if not wire.lossy or comm.size == 1:
            return _DensePayload(acc, wire)
        counts = split_counts(acc.size, comm.size)
        offs = np.concatenate(([0], np.cumsum(counts)))
        loss = WireLoss()
        if self.reduce_scatter == "ring":  # the partial sums are encoded hop by hop, in exchange()
            return _DensePayload(acc, wire, counts, None, loss, in_place)
        if encoded is not None:
            blocks = list(encoded)
            blocks.insert(comm.rank, None)
            return _DensePayload(acc, wire, counts, blocks, loss, in_place)
        blocks = []
        for j in range(comm.size):
            if j == comm.rank:
                blocks.append(None)
                continue
            block = slice(int(offs[j]), int(offs[j + 1]))
            blocks.append(self._encode(wire, acc[block], acc, block, loss, in_place))
        return _DensePayload(acc, wire, counts, blocks, loss, in_place)

    def exchange(self, comm, payload, out=None, settled=None):
        """``settled``: called once ``payload.acc`` holds this rank's new residual (a payload
        encoded ``in_place``): after the reduce-scatter and the encoding of this rank's block of
        the sum, before the allgather, which reads ``acc`` no more.

        Args:
          comm: the ranks the sum is over.
          payload: what :meth:`encode` returned.
          out: a host float32 vector of ``acc``'s size that the sum is written into; None: a new one.
          settled: as above; None: nothing to call.

        Returns:
          A dense :class:`~tfsparse.aggregators.AllreduceResult` (``indices`` None): every element's sum,
          identical on every rank.
        """
        acc, wire = payload.acc, payload.wire
        if payload.counts is None:
            total = comm.allreduce(acc, op="sum", out=out)
            return AllreduceResult(indices=None, values=total, contributed=None, sent_elements=acc.size)
        rank, size, counts = comm.rank, comm.size, payload.counts
        offs = np.concatenate(([0], np.cumsum(counts)))
        own = slice(int(offs[rank]), int(offs[rank + 1]))
        loss = payload.loss
        if payload.blocks is None:
            mine = self._ring_reduce_scatter(comm, acc, wire, offs, loss, payload.in_place)
        else:
            mine = self._direct_reduce_scatter(comm, payload, offs)
        buf = self._encode(wire, mine, acc, own, loss, payload.in_place)  # acc[own] went into the sum
        if settled is not None and payload.in_place:
            settled()  # the residual is whole: the allgather below reads only the encoded sums
        # allgather around the ring: each hop forwards the encoded block it received last and
        # decodes it while the next one travels; every rank decodes the same bytes
        total = out if out is not None else np.empty(acc.size, np.float32)
        right, left = (rank + 1) % size, (rank - 1) % size
        progress = _progress(comm)
        # every hop's receive posted first (matched in order: same source and tag), so that the
        # next block flows in while this rank decodes the last one
        recvs = [comm.irecv(left, wire.max_nbytes(int(counts[(rank - hop - 1) % size])), _AG_TAG, np.uint8,
                            exact=False, buffers=self.buffers) for hop in range(size - 1)]
        for hop in range(size):
            j = (rank - hop) % size
            req = comm.isend(buf, right, _AG_TAG) if hop < size - 1 else None
            wire.decode_into(buf, int(counts[j]), total[int(offs[j]):int(offs[j + 1])], progress=progress)
            if req is not None:
                buf = recvs[hop].wait()
                req.wait()
        return AllreduceResult(indices=None, values=total, contributed=None, sent_elements=acc.size, loss=loss,
                               residual_in_place=payload.in_place)

    def _direct_reduce_scatter(self, comm, payload, offs) -> np.ndarray:
        """Every block goes straight to its owner; all sends and all receives are posted first
        (receiving one source after the other held the later senders back at their rendezvous),
        and the owner decodes each block while the others are still on the wire; summed in rank order (the same float32 rounding
        whatever the arrival order)."""
        rank, size, acc, wire = comm.rank, comm.size, payload.acc, payload.wire
        n_own = int(offs[rank + 1] - offs[rank])
        sends = [comm.isend(payload.blocks[(rank + i) % size], (rank + i) % size, _RS_TAG) for i in range(1, size)]
        # every receive posted at once: a block's transfer starts when its sender is ready, not when
        # this rank gets to it (a large message waits for its receive); decoded in rank order
        recvs = {src: comm.irecv(src, wire.max_nbytes(n_own), _RS_TAG, np.uint8, exact=False, buffers=self.buffers)
                 for src in range(size) if src != rank}
        mine = self.buffers.take(n_own, np.float32)
        mine.fill(0.0)
        progress = _progress(comm)
        for src in range(size):
            if src == rank:
                mine += acc[int(offs[rank]):int(offs[rank + 1])]
            else:
                wire.decode_into(recvs[src].wait(), n_own, mine, accumulate=True, progress=progress)
        for req in sends:
            req.wait()
        return mine

    def _ring_reduce_scatter(self, comm, acc, wire, offs, loss: WireLoss, in_place: bool) -> np.ndarray:
        """The paper's ring: at hop ``s`` rank ``r`` encodes its partial sum of block
        ``r - s - 1`` for its right-hand neighbour (keeping what the encoding lost -- in place,
        over that block of ``acc``, which went into the partial sum at the hop before) and adds its
        own values to the partial sum of block ``r - s - 2`` from its left; after ``P - 1`` hops it
        holds the whole sum of its own block ``r``."""
        rank, size = comm.rank, comm.size
        right, left = (rank + 1) % size, (rank - 1) % size

        def block(j):
            return slice(int(offs[j % size]), int(offs[j % size + 1]))

        first = block(rank - 1)
        partial = self.buffers.take(first.stop - first.start, np.float32)
        partial[:] = acc[first]
        intos = [block(rank - hop - 2) for hop in range(size - 1)]  # the block each hop receives
        # every hop's receive posted first (matched in order: same source and tag)
        recvs = [comm.irecv(left, wire.max_nbytes(into.stop - into.start), _RS_TAG, np.uint8, exact=False,
                            buffers=self.buffers) for into in intos]
        progress = _progress(comm)
        for hop, into in enumerate(intos):
            out = block(rank - hop - 1)
            buf = self._encode(wire, partial, acc, out, loss, in_place)
            req = comm.isend(buf, right, _RS_TAG)
            partial = self.buffers.take(into.stop - into.start, np.float32)
            wire.decode_into(recvs[hop].wait(), partial.size, partial, progress=progress)  # every element written
            partial += acc[into]
            req.wait()
        return partial

    def schedule(self, b, n, k, step):
        """One allreduce of the ``n`` values in the wire's value bytes (Eq. 5), whatever ``k`` and ``step``.

        Args:
          b: the builder the allreduce is declared to.
          n: the values summed.
          k: ignored.
          step: ignored: every step alike.
        """
        b.allreduce("allreduce", n, b.value_bytes)

    def _encode(self, wire, values, acc, where: slice, loss: WireLoss, in_place: bool) -> np.ndarray:
        """``values`` encoded for the wire; what that lost is kept for the elements ``acc[where]``
        they stand for -- written over ``acc[where]`` (``in_place``, the message in a reused
        buffer), or recorded in ``loss``."""
        if in_place:
            return wire.encode(values, acc[where], self.buffers)
        lost = np.empty(np.size(values), np.float32) if wire.lossy else None
        buf = wire.encode(values, lost)
        loss.add(where, lost)
        return buf

    def __repr__(self):
        return f"{type(self).__name__}(reduce_scatter={self.reduce_scatter!r})"



