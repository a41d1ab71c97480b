"""Aggregator interface: a sparse allreduce algorithm over a Communicator, in two phases.

``encode(comm, acc, k, wire, offer)`` is local: it validates its arguments, selects what this rank
sends and encodes the first messages -- it never communicates (``comm`` is only asked for
its rank and size).  ``exchange(comm, payload)`` runs the collectives (and whatever merging
happens between them) and returns the global result.  The exchange runs ``encode`` on the
caller's thread and ``exchange`` on its communication thread, so the selection of bucket
``i + 1`` overlaps the wire time of bucket ``i``.  ``allreduce`` is both in a row.

Timing: every aggregator declares the messages of one exchange step next to its code,
``schedule(builder, n, k, step)`` (and ``period()``, the steps that differ): the α-β simulator
(:mod:`tfsparse.timing`) and DRAGONN's cost model (:mod:`tfsparse.selection`) price that one
schedule (:mod:`tfsparse.collectives.simulate`).

State: what an aggregator carries from one call to the next (Ok-Topk's thresholds and
boundaries, DGC's random generator) is explicit data, ``get_state()`` -> a dict of numpy
arrays and ``set_state(state)``, so that checkpoints hold it and a resumed run continues
bit-identically.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _checks, traffic
from ..collectives.communicator import Communicator
from ..collectives.simulate import Builder
from ..state import Stateful
from ..wire import FLOAT32, Wire, WireLoss


@dataclass(frozen=True)
class Offer:
    """What error feedback's pass made for an aggregator's :meth:`Aggregator.encode` on the way,
    besides the vector itself (:mod:`tfsparse.compensation` makes it; nothing by default).

    Attributes:
      candidates: what the pass collected for :meth:`Aggregator.prefilter`'s answer
        (:class:`~tfsparse.compressors.Candidates`), handed to the compressor; None: nothing.
      in_place: the vector is the memory's scratch buffer, and the aggregator may leave the new
        residual in it (:attr:`Aggregator.in_place_residual`; ``result.residual_in_place``).
      encoded: the messages of :meth:`Aggregator.fused_spans`, encoded in the pass (in that
        order); None: the aggregator encodes what it sends itself.
    """

    candidates: object = None
    in_place: bool = False
    encoded: list | None = None


#: an offer of nothing: the vector alone
NOTHING = Offer()


class AllreduceResult:
    """Result of one sparse allreduce.

    Args:
      indices: int64 indices of the global result, ascending and unique; ``None``
        for a dense result (``values`` then holds every element).
      values: float32 values at ``indices``, **summed** over ranks; identical on all ranks (None:
        given as ``pieces``).
      contributed: this rank's indices whose values went into the result (residual
        bookkeeping); ``None`` means every element was contributed.
      sent_elements: gradient elements (values) this rank contributed, for density stats.
      loss: what this rank's encodings lost on values that reached the result
        (:class:`~tfsparse.wire.WireLoss`; empty for the float32 wire; None: empty).
      pieces: for an allgather result, the ``(indices, values)`` payloads of every rank in rank
        order (each with unique indices), not yet summed; ``values`` is then their dense sum,
        decoded on first access (:func:`sparse_decode`) -- a device-resident exchange decodes
        the pieces on the device instead (:mod:`tfsparse.space`), and the host never does.
      n: the vector's elements (what ``pieces`` are decoded into).
      residual_in_place: the aggregator wrote this rank's new residual into the offered vector
        itself (an :class:`Offer` with ``in_place``: what its encodings lost, everything having been
        contributed); ``loss`` is then empty.

    Raises:
      ValueError: neither ``values`` nor ``pieces`` is given.
    """

    def __init__(self, indices, values=None, contributed=None, sent_elements: int = 0, loss: WireLoss | None = None,
                 pieces: list | None = None, n: int | None = None, residual_in_place: bool = False):
        if values is None and pieces is None:
            raise ValueError("an AllreduceResult needs values or pieces")
        self.indices = indices
        self._values = values
        self.contributed = contributed
        self.sent_elements = int(sent_elements)
        self.loss = loss if loss is not None else WireLoss()
        self.pieces = pieces
        self.n = n
        self.residual_in_place = bool(residual_in_place)

    @property
    def values(self) -> np.ndarray:
        """The float32 values at ``indices`` (every element for a dense result); an allgather result's
        ``pieces`` are summed on first access (:func:`sparse_decode`) and kept."""
        if self._values is None:
            self._values = sparse_decode(self.n, self.pieces)
        return self._values

    def to_dense(self, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """The result as a dense float32 vector, written into ``out`` when given (a host vector of
        ``n`` elements: every element is written).  Into ``out``, a sparse result (allgathered
        pieces, or indices) is written in one sequential pass where its indices ascend
        (:func:`densify`), the same bits as zeros plus a scatter; a dense result already in
        ``out`` (the aggregator wrote it there) is not copied.

        Args:
          n: the vector's elements.
          out: a host float32 vector of ``n`` elements to write into (every element is written); None: a new one.

        Returns:
          ``out`` when given; else, for a dense result, the result's own values (not copied), and for
          a sparse one a new float32 vector.
        """
        if self.indices is None and (self.pieces is None or out is None):
            values = self.values.reshape(-1)
            if out is None:
                return values.astype(np.float32, copy=False)
            if values is not out and not np.shares_memory(values, out):
                traffic.count("decode", read=values.nbytes, written=values.nbytes)
                out[:] = values
            return out
        if out is None:
            traffic.count("decode", written=4 * n)  # the zeros under the scattered values
            out = np.zeros(n, dtype=np.float32)
            out[self.indices] = self.values
            return out
        if self.pieces is not None:
            densify(out, self.pieces, add=True)
        else:
            densify(out, [(self.indices, self.values)], add=False)
        return out


def densify(out: np.ndarray, pieces, add: bool = True) -> np.ndarray:
    """``out[:]`` = the dense sum of sparse ``(indices, values)`` pieces (each with unique
    indices), summed in piece order from zeros (``add``; ``add=False``: one piece, its values
    stored as they are).  Pieces whose indices ascend (exact top-k, thresholds, the tree and
    Ok-Topk results) are written in one sequential pass (:func:`tfsparse.ops.cpu.densify_into`);
    otherwise (pieces in any other order) ``out`` is zeroed and the pieces scattered into it --
    the same bits either way.

    Args:
      out: the host float32 vector to write.
      pieces: ``(indices, values)`` pairs, each with unique indices.
      add: sum the pieces from zeros; False: one piece, its values stored as they are.

    Returns:
      ``out``.
    """
    from ..ops import cpu

    idx = np.concatenate([p[0] for p in pieces]) if len(pieces) != 1 else pieces[0][0]
    val = np.concatenate([p[1] for p in pieces]) if len(pieces) != 1 else pieces[0][1]
    starts = np.cumsum([0] + [len(p[0]) for p in pieces])
    if cpu.densify_into(out, idx, val, starts, add=add):
        return out
    traffic.count("decode", written=out.nbytes)
    out.fill(0.0)
    if add:
        return cpu.scatter_add(out.size, idx, val, out=out)
    out[np.asarray(idx, np.int64)] = val
    return out


class Aggregator(Stateful):
    """Base class.  Subclasses set ``name`` and implement :meth:`encode` and :meth:`exchange`.

    ``uses_memory``: whether error feedback applies (False for lossless dense; a lossy wire
    turns it on in the exchange, which keeps what the wire lost).  State between calls:
    :class:`~tfsparse.state.Stateful` (``get_state``/``set_state``).
    """

    name = "base"
    uses_memory = True
    #: whether :meth:`encode` takes a CUDA device vector (selecting there and returning a host
    #: payload); otherwise a device-resident exchange hands it a host copy
    accepts_device = False
    #: the :class:`~tfsparse.compressors.Compressor` this aggregator selects through (None: it
    #: selects nothing locally)
    compressor = None
    #: whether :meth:`encode` takes an :class:`Offer` with ``in_place``: the offered vector is the
    #: memory's scratch buffer, and the aggregator may leave the new residual in it
    #: (``result.residual_in_place``)
    in_place_residual = False
    #: a :class:`~tfsparse.buffers.Reusable` the aggregator takes its messages from round after
    #: round (None: fresh ones), which a fused encoding (:meth:`fused_spans`) takes them from too
    buffers = None

    def encode(self, comm: Communicator, acc: np.ndarray, k: int, wire: Wire = FLOAT32, offer: Offer = NOTHING):
        """Local phase (no communication): returns the payload :meth:`exchange` takes.

        Args:
          comm: asked only for its rank and size.
          acc: this rank's vector (after error feedback).
          k: the budget: how many elements to send.
          wire: the values' encoding on the wire.
          offer: what error feedback's pass made on the way (:class:`Offer`): candidates for the
            compressor, the vector as the memory's scratch, messages encoded already.  An
            aggregator uses what it asked for (:meth:`prefilter`, :attr:`in_place_residual`,
            :meth:`fused_spans`) and nothing else; the result is the same bits with or without.

        Returns:
          The payload."""
        raise TypeError(f"{type(self).__name__} does not define encode()")

    def fused_spans(self, comm: Communicator, n: int, wire: Wire) -> list | None:
        """The ranges ``(start, stop)`` of the offered vector that :meth:`encode` (with
        ``in_place``) encodes, each a message of its own, where it takes them encoded already
        (:attr:`Offer.encoded`): the memory then sums and encodes them in one pass
        (:meth:`ResidualMemory.compensate_encode <tfsparse.memory.ResidualMemory.compensate_encode>`).
        None (the default): it encodes what it selects itself.

        Args:
          comm: asked only for its rank and size.
          n: the offered vector's elements.
          wire: the round's wire.

        Returns:
          A list of ``(start, stop)`` pairs, or None.
        """
        return None

    def prefilter(self, comm: Communicator, n: int, k: int, peek):
        """What the next :meth:`encode` of an ``n``-element vector at budget ``k`` needs of it, asked
        before error feedback makes the vector, so that the memory's pass collects it on the way
        (:meth:`tfsparse.compressors.Compressor.prefilter`; ``peek(positions)`` gives the vector's
        values at those positions).  None: nothing to collect, the selection reads the vector.
        Changes no state.

        Args:
          comm: asked only for its rank and size.
          n: the vector's elements.
          k: the budget.
          peek: ``peek(positions)``: the vector's values at int64 positions.

        Returns:
          A :class:`~tfsparse.compressors.Prefilter`, or None.
        """
        return None if self.compressor is None else self.compressor.prefilter(n, k, peek)

    def select(self, acc, k: int, candidates=None):
        """The compressor's selection of ``acc`` (from ``candidates`` where given).

        Args:
          acc: the offered vector.
          k: the budget.
          candidates: the :class:`~tfsparse.compressors.Candidates` of a fused pass, or None.

        Returns:
          ``(indices, values)``.
        """
        return self.compressor.compress(acc, k, candidates)

    def exchange(self, comm: Communicator, payload, out: np.ndarray | None = None, settled=None) -> AllreduceResult:
        """Communication phase: the collectives, merging in between, the global result.

        Args:
          comm: the communicator the collectives run over.
          payload: what :meth:`encode` returned.
          out: a host float32 vector of the payload's size that a dense result may be received
            into (the result's values are then ``out``; :meth:`AllreduceResult.to_dense` does
            not copy it); aggregators with a sparse result ignore it.
          settled: a callable to call once, as soon as a payload encoded in place holds this
            rank's whole new residual, before the rest of its messages travel, so that the next
            round's error feedback may start meanwhile (:meth:`Bucket.exchange
            <tfsparse.bucket.Bucket.exchange>`); an aggregator that has no such moment (every
            one but the dense allreduce over a lossy wire) never calls it.

        Returns:
          The global result, an :class:`AllreduceResult`."""
        raise TypeError(f"{type(self).__name__} does not define exchange()")

    def allreduce(self, comm: Communicator, acc: np.ndarray, k: int, wire: Wire = FLOAT32) -> AllreduceResult:
        """``exchange(comm, encode(comm, acc, k, wire))``.

        Args:
          comm: the communicator.
          acc: this rank's vector (after error feedback).
          k: the budget.
          wire: the values' encoding.

        Returns:
          An :class:`AllreduceResult`.
        """
        return self.exchange(comm, self.encode(comm, acc, k, wire))

    def schedule(self, b: Builder, n: int, k: int, step: int) -> None:
        """Declares to ``b`` the messages exchange step ``step`` (from 1) sends for a bucket of
        ``n`` elements and the budget ``k``: the collectives :meth:`exchange` calls, in order,
        with the sizes it calls them with (their expectations where those depend on the data).
        What the α-β simulator (:mod:`tfsparse.timing`) and the cost model price.

        Args:
          b: the :class:`~tfsparse.collectives.simulate.Builder` to declare to.
          n: the bucket's elements.
          k: the budget.
          step: the exchange step, counted from 1.
        """
        raise TypeError(f"{type(self).__name__} does not declare its schedule()")

    def period(self) -> tuple:
        """``((step, weight), ...)``: the distinct steps of the steady period of :meth:`schedule`
        and the fraction of steps like each; ``((1, 1.0),)``: every step alike.

        Returns:
          A tuple of ``(step, weight)`` pairs whose weights sum to 1.
        """
        return ((1, 1.0),)

    def reset(self) -> None:
        """Forgets cached state (thresholds, boundaries)."""

    def __repr__(self):
        return f"{type(self).__name__}()"


def check_k(k, n: int) -> int:
    """``k`` must be an integer in ``[0, n]``; raises ValueError before any communication.

    Args:
      k: the budget.
      n: the vector's elements.

    Returns:
      ``k`` as an int.

    Raises:
      ValueError: ``k`` is not an integer in ``[0, n]``.
    """
    return _checks.integer("k", k, 0, n, hint=f" (the number of elements to keep of the gradient's {n})")


def check_acc(acc: np.ndarray, k) -> tuple[np.ndarray, int]:
    """Flat contiguous float32 ``acc`` and a valid integer ``k`` (ValueError otherwise); a CUDA
    device vector stays on the device.

    Args:
      acc: a rank's vector (any float array, or a CUDA device vector).
      k: the budget.

    Returns:
      ``(acc, k)``: the vector flat and contiguous float32 (a device vector stays on the device),
      ``k`` an int.

    Raises:
      ValueError: ``k`` is not an integer in ``[0, acc.size]``.
    """
    from .. import ops

    if ops.device_kind(acc) == "cuda":
        acc = ops.backend("cuda").as_device(acc)
    else:
        acc = np.ascontiguousarray(acc, dtype=np.float32).reshape(-1)
    return acc, check_k(k, acc.size)


def reject_unknown_options(algorithm: str, unknown: dict, accepted) -> None:
    """Raises ValueError naming the unknown options and the accepted ones.

    Args:
      algorithm: the aggregator's name.
      unknown: the options it does not take, by name (nothing happens when empty).
      accepted: the names it takes.

    Raises:
      ValueError: ``unknown`` is not empty.
    """
    if unknown:
        names = ", ".join(f"{k}={v!r}" for k, v in sorted(unknown.items()))
        acc = ", ".join(accepted) if accepted else "(none)"
        raise ValueError(f"unknown option(s) {names} for algorithm={algorithm!r}; accepted: {acc}")


def sparse_decode(n: int, pieces) -> np.ndarray:
    """Sparse decoding (dragonn-wang2022 §4.3): the ``(indices, values)`` payloads of all ranks,
    concatenated in rank order, decoded by **one** :func:`tfsparse.ops.scatter_add` into the dense
    float32 sum -- "we batch these K compressed tensors, i.e. concatenate all of them, for one
    decoding operation"; "also applicable to other GS algorithms, such as DGC, TopK".  Each
    element is summed in rank order (``np.add.at``'s order), so every rank gets bit-identical
    sums.

    Args:
      n: the vector's elements.
      pieces: every rank's ``(indices, values)``, in rank order.

    Returns:
      The dense float32 sum.
    """
    from .. import ops

    if not pieces:
        return np.zeros(n, np.float32)
    idx = np.concatenate([p[0] for p in pieces])
    val = np.concatenate([p[1] for p in pieces])
    return ops.scatter_add(n, idx, val)
