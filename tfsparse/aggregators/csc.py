"""Coarse-grained sparse communication, CSC (gradientflow-sun2019 §3.2, Fig. 17 and 18).

The (residual-compensated) gradient is cut into chunks of ``chunk_size`` elements (32K in the
paper; the last chunk may be short).  Every rank computes each chunk's L1 norm
(:func:`tfsparse.ops.chunk_l1_norms`), the norms are summed over ranks (one small allreduce),
and every rank picks the same ``m`` chunks with the largest summed norms.  Only those chunks,
gathered into one buffer, go through a dense allreduce -- reduce-scatter + allgather, over any
``wire_dtype`` (:class:`~tfsparse.aggregators.dense.DenseAllreduce`) -- so the exchange keeps
dense communication's bandwidth; every other chunk stays in the residual.  All ranks agree on
the chunk set by construction (identical summed norms, ties broken by chunk index).

Volume per rank: ``2·(m·chunk_size)·(P−1)/P`` values plus the norms' allreduce
(``2·C·(P−1)/P`` float32 for ``C`` chunks).  ``m = ceil(k / chunk_size)`` for the exchange's
``k = ceil(density·n)``: ``density`` is the fraction of chunks, the paper's 10-15 % (15 % in
its AlexNet run, §4).

``chunk_selection``:

* ``"current"`` (default): the chunks are chosen from this step's norms, before the chunk
  allreduce (two collectives in a row per step).
* ``"previous"``: the paper's Fig. 18 schedule.  After the chunk allreduce every rank computes
  the norms of what it holds -- the summed gradient in the chunks just sent, divided by P, its
  own accumulated gradient elsewhere -- the norms are allreduced and the top ``m`` chunks are
  *the next step's* set.  The set is then known before a step begins (GradientFlow copies each
  important chunk into the allreduce buffer as soon as back-propagation fills it); the first
  step, and a step whose ``m`` changed, choose from their own norms as ``"current"`` does.
  The chosen set is explicit state (``chunks``), saved in checkpoints.

Schedule (:meth:`CoarseSparseAllreduce.schedule`): the chunk-norm allreduce (``C`` float32) and
the dense allreduce of the ``m`` chosen chunks, assumed full (exact unless the short last chunk
is among them); ``"previous"`` moves the norm allreduce after the chunks, plus one before them
on the first step (its :meth:`~CoarseSparseAllreduce.period` is step 2).

The selection is collective -- every rank must pick the same chunks, from the *allreduced*
norms -- so CSC selects in :meth:`~CoarseSparseAllreduce.exchange`, not through a local
:class:`~tfsparse.compressors.Compressor`.

GradientFlow pairs CSC with momentum correction and a dense warm-up (§3.2): use
``memory="momentum"`` and ``tfsparse.schedules.WarmUp``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import _checks, ops
from ..wire import Wire, WireLoss
from .base import NOTHING, Aggregator, AllreduceResult, check_acc
from .dense import DenseAllreduce
from .registry import register

SELECTIONS = ("current", "previous")


def check_chunk_size(chunk_size) -> int:
    """``chunk_size`` checked to be a number of elements per chunk.

    Args:
      chunk_size: an integer >= 1 (GradientFlow's is 32768).

    Returns:
      ``chunk_size`` as an int.

    Raises:
      ValueError: when it is not an integer >= 1.
    """
    return _checks.integer("chunk_size", chunk_size, 1,
                           hint=" (elements per chunk), e.g. chunk_size=32768 (GradientFlow's 32K)")


def chunk_elements(chunks: np.ndarray, chunk_size: int, n: int) -> np.ndarray:
    """The element indices (int64, ascending) of the ascending ``chunks`` of an ``n``-vector.

    Args:
      chunks: ascending chunk numbers.
      chunk_size: elements per chunk.
      n: the vector's elements (the last chunk may be shorter).

    Returns:
      int64 element indices, ascending.
    """
    chunks = np.asarray(chunks, np.int64)
    if chunks.size == 0:
        return np.empty(0, np.int64)
    elems = (chunks[:, None] * chunk_size + np.arange(chunk_size, dtype=np.int64)).reshape(-1)
    if chunks[-1] * chunk_size + chunk_size > n:  # the short last chunk
        elems = elems[elems < n]
    return elems


def top_chunks(norms: np.ndarray, m: int) -> np.ndarray:
    """The ``m`` chunks with the largest norms, ascending; ties go to the lower index, a NaN
    norm ranks first (the non-finite values then reach every rank).

    Args:
      norms: each chunk's norm.
      m: how many chunks to keep.

    Returns:
      Their numbers (int64), ascending.
    """
    key = np.where(np.isnan(norms), np.inf, norms).astype(np.float64)
    order = np.argsort(-key, kind="stable")[:m]
    return np.sort(order).astype(np.int64)


@dataclass
class _CSCPayload:
    acc: np.ndarray
    wire: Wire
    m: int
    norms: np.ndarray | None = None       # this rank's norms, when the set is chosen this step
    chunks: np.ndarray | None = None      # the set, when known before the step ("previous")
    dense: object = None                  # DenseAllreduce payload of the gathered chunks


@register("csc")
class CoarseSparseAllreduce(Aggregator):
    """GradientFlow's CSC: dense allreduce of the chunks with the largest summed L1 norms.

    Args:
      chunk_size: elements per chunk (default 32768, the paper's 32K).
      chunk_selection: ``"current"`` (default) or ``"previous"`` (the paper's Fig. 18: norms taken
        after the allreduce choose the next step's chunks); see the module doc.
    """

    def __init__(self, chunk_size: int = 32768, chunk_selection: str = "current"):
        self.chunk_size = check_chunk_size(chunk_size)
        self.selection = _checks.choice("chunk_selection", chunk_selection, SELECTIONS)
        self._dense = DenseAllreduce()
        self._next = np.empty(0, np.int64)  # "previous": the set chosen by the last step

    def chunks_for(self, n: int, k: int) -> int:
        """``m``: the chunks a bucket of ``n`` elements sends for ``k`` (at least one if k > 0).

        Args:
          n: the bucket's elements.
          k: the budget.

        Returns:
          ``m``, an int.
        """
        return min(math.ceil(n / self.chunk_size), math.ceil(k / self.chunk_size))

    def encode(self, comm, acc, k, wire, offer=NOTHING):
        """``m`` chunks for ``k``: under ``"previous"``, with a set of ``m`` chunks chosen by the last step, those
        chunks gathered and encoded for the dense allreduce; otherwise this rank's chunk L1 norms, which
        :meth:`exchange` allreduces.

        Args:
          comm: asked only for its rank and size (the dense allreduce's blocks).
          acc: this rank's vector.
          k: the budget, in elements; ``m = chunks_for(n, k)`` chunks carry it.
          wire: the encoding of the chunks' dense allreduce.
          offer: unused.

        Returns:
          The payload: the norms to allreduce, or the known chunks already encoded.
        """
        acc, k = check_acc(acc, k)
        m = self.chunks_for(acc.size, k)
        payload = _CSCPayload(acc, wire, m)
        if self.selection == "previous" and self._next.size == m and m > 0:
            payload.chunks = self._next
            payload.dense = self._dense.encode(comm, acc[chunk_elements(self._next, self.chunk_size, acc.size)],
                                               wire=wire)
        elif m > 0:
            payload.norms = ops.chunk_l1_norms(acc, self.chunk_size)
        return payload

    def exchange(self, comm, payload, out=None, settled=None):
        """The chunk set (the top ``m`` of the allreduced norms, unless known already), the dense
        allreduce of its elements and, under ``"previous"``, the next step's set (Fig. 18).

        Args:
          comm: the ranks the chunks are summed over.
          payload: what :meth:`encode` returned.
          out: ignored: the chunks' sum is received into a vector of their own size.
          settled: never called.

        Returns:
          An :class:`~tfsparse.aggregators.AllreduceResult` over the chosen chunks' elements, every rank
          contributing all of them.
        """
        acc, n, cs = payload.acc, payload.acc.size, self.chunk_size
        if payload.m == 0:
            self._next = np.empty(0, np.int64)
            return AllreduceResult(indices=np.empty(0, np.int64), values=np.empty(0, np.float32),
                                   contributed=np.empty(0, np.int64), sent_elements=0)
        chunks = payload.chunks
        if chunks is None:
            chunks = top_chunks(comm.allreduce(payload.norms, op="sum"), payload.m)
        elems = chunk_elements(chunks, cs, n)
        dense = payload.dense if payload.dense is not None else \
            self._dense.encode(comm, acc[elems], wire=payload.wire)
        result = self._dense.exchange(comm, dense)
        loss = WireLoss()
        for where, lost in result.loss.parts:  # from the gathered buffer's positions to the gradient's
            loss.add(elems[where], lost)
        if self.selection == "previous":
            self._next = self._choose_next(comm, acc, elems, result.values, payload.m)
        return AllreduceResult(indices=elems, values=result.values, contributed=elems,
                               sent_elements=int(elems.size), loss=loss)

    def _choose_next(self, comm, acc, elems, summed, m) -> np.ndarray:
        """Fig. 18: norms of what this rank holds after the allreduce (the sum / P in the chunks
        sent, its accumulated gradient elsewhere), allreduced; the top ``m`` for the next step."""
        held = acc.copy()
        held[elems] = summed / np.float32(comm.size)
        return top_chunks(comm.allreduce(ops.chunk_l1_norms(held, self.chunk_size), op="sum"), m)

    def schedule(self, b, n, k, step):
        """The chunk-norm allreduce (``C`` float32: before the chunks, or after them under
        ``"previous"`` and before them too at step 1) and the dense allreduce of the ``m`` chunks, taken as full.

        Args:
          b: the builder the two allreduces are declared to.
          n: the bucket's elements (``C = ceil(n / chunk_size)`` norms).
          k: the budget, which sets ``m``.
          step: 1 or later (under ``"previous"`` step 1 differs).
        """
        chunks = math.ceil(n / self.chunk_size)
        m = self.chunks_for(n, k)
        if self.selection == "current" or step == 1:
            b.allreduce("chunk norms", chunks, 4)
        b.allreduce("chunks", n if m == chunks else m * self.chunk_size, b.value_bytes)
        if self.selection == "previous":
            b.allreduce("chunk norms (next step)", chunks, 4)

    def period(self):
        """Step 2 under ``"previous"`` (step 1 allreduces the norms twice), else step 1: every step alike.

        Returns:
          ``((2, 1.0),)`` or ``((1, 1.0),)``.
        """
        return ((2, 1.0),) if self.selection == "previous" else ((1, 1.0),)

    def reset(self):
        """Forgets the set chosen for the next step (``"previous"``): that step chooses from its own norms."""
        self._next = np.empty(0, np.int64)

    def get_state(self):
        """``chunks``: the set chosen for the next step, under ``"previous"`` (nothing under ``"current"``).

        Returns:
          ``{name: numpy array}`` (empty where there is nothing to keep).
        """
        return {"chunks": self._next.copy()} if self.selection == "previous" else {}

    def set_state(self, state):
        """Restores the next step's chunk set (none where the state holds no ``chunks``).

        Args:
          state: what :meth:`get_state` returned.
        """
        super().set_state(state)
        chunks = state.get("chunks")
        self._next = np.empty(0, np.int64) if chunks is None else np.asarray(chunks, np.int64).reshape(-1).copy()

    def __repr__(self):
        return f"CoarseSparseAllreduce(chunk_size={self.chunk_size}, chunk_selection={self.selection!r})"
