"""Error feedback's pass over a bucket, the stage between its memory and its aggregator: chosen
once, when the bucket is made (:func:`compensation_for`), and run by
:meth:`Bucket.encode <tfsparse.bucket.Bucket.encode>` every round through one method::

    acc, offer, finite = bucket.compensation.run(comm, arrays, aggregator, k, wire)
    payload = aggregator.encode(comm, acc, k, wire, offer)

``acc`` is the vector the aggregator encodes, ``offer`` what the pass made for it on the way
(:class:`~tfsparse.aggregators.base.Offer`), ``finite`` whether every sum was finite.  Two kinds:

* :class:`Separate` -- the memory's :meth:`~tfsparse.memory.ResidualMemory.compensate`, one
  gradient after the other, then the finite check: for a memory that keeps nothing (a lossless
  dense exchange) and for one that lives on a device.
* :class:`Fused` -- host error feedback in one pass over gradient and residual that also checks
  the sums and either collects what the compressor asked for ahead
  (:meth:`Aggregator.prefilter <tfsparse.aggregators.Aggregator.prefilter>`;
  :meth:`ResidualMemory.compensate_select <tfsparse.memory.ResidualMemory.compensate_select>`)
  or, for a dense exchange over a lossy wire, encodes the blocks for the other ranks
  (:meth:`Aggregator.fused_spans <tfsparse.aggregators.Aggregator.fused_spans>`;
  :meth:`ResidualMemory.compensate_encode <tfsparse.memory.ResidualMemory.compensate_encode>`).
  Gradients the pass cannot read (other than contiguous float32 arrays) go the separate way.

Every kind gives the same bits: the fused passes compute what the separate ones do.
"""
from __future__ import annotations

import numpy as np

from . import traffic
from .aggregators.base import NOTHING, Offer
from .memory import ResidualMemory


class Separate:
    """Error feedback one gradient at a time, then the finite check over the bucket.

    Args:
      memory: the bucket's memory (its ``acc`` is the vector offered).
    """

    def __init__(self, memory):
        self.memory = memory

    def run(self, comm, arrays, aggregator, k: int, wire) -> tuple:
        """One round's pass over ``arrays`` (the bucket's gradients, in the memory's space).

        Args:
          comm: the communicator the aggregator encodes for.
          arrays: the bucket's gradients, in order.
          aggregator: the round's aggregator.
          k: the round's budget.
          wire: the round's wire.

        Returns:
          ``(acc, offer, finite)``: the vector to encode, what the pass made for the aggregator,
          whether every sum was finite.
        """
        memory = self.memory
        off = 0
        for a in arrays:
            size = int(np.size(a))
            memory.compensate(a, slice(off, off + size))
            off += size
        traffic.count("finite", read=4 * memory.acc.size)
        return self.offer(aggregator, wire, memory.space.all_finite(memory.acc))

    def offer(self, aggregator, wire, finite: bool, candidates=None) -> tuple:
        """What the aggregator is offered once the memory's ``acc`` is made.

        A vector that is not finite on this rank is made harmless (its round is dropped on every
        rank); a device vector is copied to the host for an aggregator that takes none; the memory's
        scratch is offered in place to an aggregator that writes the new residual there.

        Args:
          aggregator: the round's aggregator.
          wire: the round's wire.
          finite: whether every element of ``acc`` is finite.
          candidates: the selection's :class:`~tfsparse.compressors.Candidates` from a fused pass, or None.

        Returns:
          ``(acc, offer, finite)`` as :meth:`run`.
        """
        memory = self.memory
        space, acc = memory.space, memory.acc
        if not finite:
            space.zero_nonfinite(acc)
            candidates = None
        offered = acc if aggregator.accepts_device or not space.on_device else space.to_host(acc)
        in_place = aggregator.in_place_residual and offered is acc and wire.lossy
        if candidates is None and not in_place:
            return offered, NOTHING, finite
        return offered, Offer(candidates=candidates, in_place=in_place), finite


class Fused(Separate):
    """Host error feedback in one pass with the finite check, and the selection's candidates or
    a dense exchange's encoded blocks (the module docstring)."""

    def run(self, comm, arrays, aggregator, k: int, wire) -> tuple:
        """:meth:`Separate.run` in one pass: error feedback with the finite check and the selection's candidates or the encoded blocks.

        Falls back to :meth:`Separate.run` where the memory does not fuse these gradients.

        Args:
          comm: asked by the aggregator for the blocks it takes encoded and for its prefilter.
          arrays: the bucket's gradients: contiguous float32 host arrays where the pass fuses.
          aggregator: tells what the pass collects (:meth:`~tfsparse.aggregators.Aggregator.prefilter`)
            or encodes (:meth:`~tfsparse.aggregators.Aggregator.fused_spans`).
          k: the budget its prefilter is asked about.
          wire: the wire the fused blocks are encoded with.

        Returns:
          ``(acc, offer, finite)`` as :meth:`Separate.run`; the offer holds the candidates or the
          encoded blocks.
        """
        memory = self.memory
        if not memory.fuses(arrays):
            return super().run(comm, arrays, aggregator, k, wire)
        n = memory.acc.size
        spans = aggregator.fused_spans(comm, n, wire) if aggregator.in_place_residual else None
        if spans is not None:  # the blocks for the other ranks encoded in the same pass
            messages, finite = memory.compensate_encode(arrays, spans, wire, aggregator.buffers)
            if finite:
                return memory.acc, Offer(in_place=True, encoded=messages), True
            del messages  # some sum is not finite: the round is dropped, compensated again below as ever
        prefilter = aggregator.prefilter(comm, n, k, lambda at: memory.peek(arrays, at))
        candidates, finite = memory.compensate_select(arrays, prefilter)
        return self.offer(aggregator, wire, finite, candidates)


def compensation_for(memory) -> Separate:
    """The pass for a bucket's memory.

    Args:
      memory: the bucket's memory.

    Returns:
      :class:`Fused` for error feedback on the host (a :class:`~tfsparse.memory.ResidualMemory`
      or one of its kinds), else :class:`Separate`.
    """
    if isinstance(memory, ResidualMemory) and not memory.space.on_device:
        return Fused(memory)
    return Separate(memory)
