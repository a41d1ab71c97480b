"""TopKAllReduce baseline (gtopk-ssgd-shi2019 §II-E, Alg. 1 lines 12-21).

Every rank selects a sparse payload with its :class:`~tfsparse.compressors.Compressor`
(exact local top-k by default), the (index, value) messages are all-gathered (one allgatherv
of ``[indices | values]`` buffers) and summed in rank order by one sparse decode of the P
payloads (dragonn-wang2022 §4.3, :func:`~tfsparse.aggregators.base.sparse_decode`: the result is
dense; a device-resident exchange decodes them on the GPU).  With a compressor that selects on
the device (exact top-k, DRAGONN's hashing) a device vector is encoded where it lives and only
the payload comes to the host.  Volume per rank ``2k(P-1)`` elements (Eq. 6), values as ``wire_dtype``,
indices as :func:`tfsparse.wire.index_codec` codes them (2 bytes each, blocked, for ascending
selections: ``6k`` bytes per float32 message rather than ``8k``).

Schedule (:meth:`AllgatherAggregator.schedule`): one allgather of every rank's payload -- the
compressor's expected count (:meth:`~tfsparse.compressors.Compressor.expected_count`: ``k`` for
the exact top-k; gtopk §II-E, oktopk Table 1 "TopkA") -- then the sum of the ``P`` payloads.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..compressors import Compressor, TopK, check_compressor
from ..wire import Wire, WireLoss, index_codec, pack_sparse, unpack_sparse
from .base import NOTHING, Aggregator, AllreduceResult, check_acc
from .registry import register


@dataclass
class _SparsePayload:
    n: int
    message: np.ndarray
    indices: np.ndarray
    codec: object  # how the indices travel (tfsparse.wire.index_codec)
    wire: Wire
    loss: WireLoss


@register("topk")
class AllgatherAggregator(Aggregator):
    """Compress locally, allgather (index, value) messages, sum in rank order.

    Args:
      compressor: the :class:`~tfsparse.compressors.Compressor` that selects (a name or an
        instance: :func:`~tfsparse.compressors.check_compressor`); the subclasses build their own.
    """

    def __init__(self, compressor: Compressor | str | None = None):
        """``compressor``: a :class:`~tfsparse.compressors.Compressor` or its name (``"topk"``,
        ``"dgc"``, ``"gaussiank"``, ``"identity"``); default exact top-k."""
        self.compressor = check_compressor(compressor) if compressor is not None else TopK()

    @property
    def accepts_device(self) -> bool:
        """Whether the compressor selects on a CUDA device (exact top-k, DRAGONN's hashing)."""
        return self.compressor.on_device

    def encode(self, comm, acc, k, wire, offer=NOTHING):
        """The compressor's selection of ``acc`` (from ``offer.candidates`` where given) packed into one
        ``[indices | values]`` message (:func:`tfsparse.wire.pack_sparse`), what the wire lost recorded.

        Args:
          comm: unused (the ranks gathered from are the exchange's).
          acc: this rank's vector (host, or a device where the compressor selects there).
          k: the compressor's budget.
          wire: the values' encoding in the message.
          offer: its ``candidates``, handed to the compressor.

        Returns:
          The payload: the message, the selected indices, the codec, the wire and what it lost.
        """
        acc, k = check_acc(acc, k)
        idx, val = self.select(acc, k, offer.candidates)
        idx = np.asarray(idx, dtype=np.int64)
        codec = index_codec(acc.size, k, self.compressor.ascending)
        message, lost = pack_sparse(idx, val, codec, wire)
        loss = WireLoss()
        loss.add(idx, lost)
        return _SparsePayload(acc.size, message, idx, codec, wire, loss)

    def exchange(self, comm, payload, out=None, settled=None):
        """One allgather of every rank's message, summed in rank order (:meth:`combine`).

        Args:
          comm: the ranks gathered from.
          payload: what :meth:`encode` returned.
          out: ignored: the result keeps the ranks' pieces.
          settled: never called.

        Returns:
          An :class:`~tfsparse.aggregators.AllreduceResult` whose ``pieces`` are every rank's entries (its
          ``values`` their sum, on first access); ``contributed`` this rank's selection.
        """
        return self.combine(comm.allgather(payload.message), payload)

    def combine(self, messages, payload) -> AllreduceResult:
        """The local half of :meth:`exchange`: every rank's message (rank order) summed.  Also
        what the cost model (:mod:`tfsparse.selection`) times as the decoding cost.

        Args:
          messages: every rank's message, in rank order.
          payload: this rank's payload (its index codec and wire).

        Returns:
          An :class:`~tfsparse.aggregators.AllreduceResult` whose ``pieces`` are the decoded messages.
        """
        pieces = [unpack_sparse(m, payload.codec, payload.wire) for m in messages]
        return AllreduceResult(indices=None, pieces=pieces, n=payload.n, contributed=payload.indices,
                               sent_elements=int(payload.indices.size), loss=payload.loss)

    #: the local phase after the allgather (its γ term)
    DECODE = "sum of the gathered pairs"

    def schedule(self, b, n, k, step):
        """The allgather of the compressor's expected count
        (:meth:`~tfsparse.compressors.Compressor.expected_count`) and the sum of the ``P`` payloads
        (:meth:`gather_schedule`).

        Args:
          b: the builder the allgather is declared to.
          n: the bucket's elements.
          k: the compressor's budget.
          step: ignored: every step alike.
        """
        self.gather_schedule(b, n, self.compressor.expected_count(n, k), k)

    def gather_schedule(self, b, n, count, k=None) -> None:
        """The exchange of ``count`` entries per rank (for the budget ``k``, default ``count``):
        their allgather and the sum of the ``P`` payloads (what the cost model prices for the
        ``k`` entries of dragonn-wang2022 Eq. 1).

        Args:
          b: the :class:`~tfsparse.collectives.simulate.Builder` to declare to.
          n: the bucket's elements.
          count: the entries each rank sends.
          k: the budget; None: ``count``.
        """
        b.allgather("allgather (index, value)", b.message(n, count, k, self.compressor.ascending))
        b.local(self.DECODE, b.P * count)

    def get_state(self):
        """The compressor's state (DGC's random generator, DRAGONN's step counter; none for the exact
        top-k).

        Returns:
          ``{name: numpy array}`` (empty where there is nothing to keep).
        """
        return self.compressor.get_state()

    def set_state(self, state):
        """Restores the compressor's state.

        Args:
          state: what :meth:`get_state` returned.
        """
        self.compressor.set_state(state)

    def __repr__(self):
        return f"{type(self).__name__}(compressor={self.compressor!r})"
