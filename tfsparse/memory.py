"""Memory: error feedback, and momentum correction (GRACE's "memory" part).

A memory turns a rank's gradient into what it offers to the exchange (``compensate``, into
its buffer :attr:`acc`) and keeps what was not sent (``update``).  One instance per bucket; it
owns its vectors -- the offered buffer ``acc``, the ``residual`` (one float32 vector per
bucket) and, for momentum correction, the ``velocity`` -- and its explicit state
(:class:`~tfsparse.state.Stateful`: ``residual`` and ``velocity``, saved in checkpoints).

* :class:`ResidualMemory` (``memory="residual"``; what ``memory="auto"``, the default, runs unless
  the optimizer's momentum can be taken over, :mod:`tfsparse.settings`) -- gtopk-ssgd-shi2019 Alg. 1
  line 4 and line 8: ``acc = residual + grad``; after the exchange, every entry of ``acc``
  that was *not* contributed to the global result stays in the residual, and so does what
  the wire lost on the values that were (``acc - decode(encode(acc))``,
  :class:`~tfsparse.wire.WireLoss`).
* :class:`MomentumMemory` (``memory="momentum"``) -- momentum correction with momentum factor
  masking (DGC, Lin et al. 2018 §3.2; gradientflow-sun2019 §3.2 Alg. 1 applies momentum SGD
  correction to the unsent chunks): the velocity ``u = m·u + grad`` is accumulated, ``acc =
  residual + u`` is what gets sparsified, and where values were sent both the residual and the
  velocity are cleared.  The exchanged sum then *is* the momentum update, so the optimizer
  must apply it without momentum of its own (``keras.optimizers.SGD(lr)``, ``momentum=0``).
  A dense exchange (``algorithm="dense"``, a dense warm-up step) keeps the velocity: that step
  is then exactly momentum SGD (``w -= lr·u``), which masking would turn into plain SGD.
* :class:`RowsMomentumMemory` (``memory="momentum_rows"``; what ``memory="auto"`` runs for a
  sparse algorithm under an SGD with momentum) -- the same, but the velocity of row-sparse
  gradients (an Embedding's) is never cleared.
* :class:`NoMemory` (``memory="none"``) -- nothing kept: what lossless aggregation over a
  lossless wire (dense, float32) uses, and, chosen, no error feedback at all (Pipe-SGD's
  compressed allreduce as published; gradient dropping for a sparse algorithm).
"""
from __future__ import annotations

import numpy as np

from . import _checks, traffic
from ._registry import Registry
from .space import HOST
from .state import Stateful

MEMORIES = Registry("memory", "memory")
register_memory = MEMORIES.register  # class decorator: the class under its name


def available_memories() -> tuple[str, ...]:
    """The names ``memory=`` accepts (:func:`get_memory`; the settings add ``"auto"``), sorted.

    Returns:
      A tuple of names: ``("momentum", "momentum_rows", "none", "residual")`` unless more memories are
      registered.
    """
    return MEMORIES.names()


def rows_spans(rows) -> tuple:
    """The spans of a bucket's row-sparse gradients, normalized.

    Args:
      rows: ``(start, stop)`` pairs (any integers, any order).

    Returns:
      A tuple of ``(start, stop)`` int pairs, sorted, the empty ones left out.
    """
    return tuple(sorted((int(a), int(b)) for a, b in rows if int(b) > int(a)))


def keeps_velocity(memory: str) -> bool:
    """Whether a memory is a momentum correction, which keeps a velocity and applies the optimizer's momentum in the exchange.

    Args:
      memory: a memory's name.

    Returns:
      True for ``"momentum"`` and ``"momentum_rows"``; False for the others, ``"auto"`` and
      unknown names.
    """
    return memory in MEMORIES.names() and MEMORIES.get(memory).has_velocity


def check_memory(memory, momentum=None) -> dict:
    """Validates ``memory`` and its options.

    Args:
      memory: a registered name (:func:`available_memories`).
      momentum: the momentum factor, for a momentum correction only; None: its default.

    Returns:
      The memory's options, e.g. ``{"momentum": 0.9}`` (``{}`` for one without options).

    Raises:
      ValueError: ``memory`` is not registered, or ``momentum`` is given where it has no meaning
        or is out of ``[0, 1)``.
    """
    return MEMORIES.get(memory).check_options(momentum)


def get_memory(memory: str, size: int, options: dict, needed: bool, space=HOST, reuse=None, rows=()):
    """The memory of a bucket of ``size`` elements.

    Without loss and without momentum nothing is kept (:class:`NoMemory`).

    Args:
      memory: a registered name (:func:`available_memories`).
      size: the bucket's elements.
      options: what :func:`check_memory` returned.
      needed: whether anything is lost in the exchange (a sparse algorithm or a lossy wire).
      space: where the bucket's vectors live (:mod:`tfsparse.space`).
      reuse: a memory returned as it is -- its residual, velocity and vectors kept -- when it is
        what this call would build (the same kind, options, size and space): a bucket rebuilt
        with other stages (``algorithm="auto"``'s switch) keeps its memory without copying or
        allocating.  None: build one.
      rows: the ``(start, stop)`` spans of the bucket whose gradients are row-sparse (an
        Embedding's), for the memories that treat them apart (:class:`RowsMomentumMemory`).

    Returns:
      The memory (``reuse`` or a new one).
    """
    cls = MEMORIES.get(memory)
    if not needed and not cls.always:
        cls, options = NoMemory, {}
    if cls.takes_rows:
        options = {**options, "rows": rows_spans(rows)}
    if (type(reuse) is cls and reuse.space is space and reuse.acc.shape[0] == size
            and all(getattr(reuse, k) == v if k == "rows" else np.float32(getattr(reuse, k)) == np.float32(v)
                    for k, v in options.items())):
        return reuse
    return cls(size, **options, space=space)


def _without_momentum(name: str, momentum) -> dict:
    """The options of a memory without a momentum factor (ValueError if one is given)."""
    if momentum is not None:
        raise ValueError(f"momentum={momentum!r} needs memory='momentum' (momentum correction); with "
                         f"memory={name!r} the optimizer applies the momentum")
    return {}


@register_memory
class NoMemory(Stateful):
    """``memory="none"``: no error feedback -- what the exchange does not deliver is dropped.

    That is the unsent entries and what a lossy wire loses.  What the papers' lossless exchanges
    need, and Pipe-SGD's compressed allreduce as the paper describes it (pipe-sgd-li2018 §3.2
    quantizes and truncates without keeping the error); with a sparse algorithm it is plain
    gradient dropping.

    Args:
      size: elements of the bucket.
      space: where its vectors live (:mod:`tfsparse.space`).
    """

    name = "none"
    always = False
    has_velocity = False
    takes_rows = False

    def __init__(self, size: int = 0, space=HOST):
        self.space = space
        self.acc = space.empty(int(size))  # what the bucket offers to the exchange this round
        self.residual = None

    @classmethod
    def check_options(cls, momentum=None) -> dict:
        """The options of this memory: none (the optimizer applies any momentum).

        Args:
          momentum: must be None.

        Returns:
          ``{}``.

        Raises:
          ValueError: when ``momentum`` is given (it needs ``memory="momentum"``).
        """
        return _without_momentum(cls.name, momentum)

    def compensate(self, grad: np.ndarray, span: slice) -> np.ndarray:
        """``acc[span] = grad`` (the gradient travels as it is).

        Args:
          grad: this round's float32 gradient for ``span``.
          span: a slice of the bucket.

        Returns:
          :attr:`acc`, the whole bucket's offered vector.
        """
        nbytes = 4 * (span.stop - span.start)
        traffic.count("compensate", read=nbytes, written=nbytes)
        self.space.copy(self.acc[span], grad)
        return self.acc

    def fuses(self, arrays) -> bool:
        """No selection follows a memory that keeps nothing (lossless dense).

        Args:
          arrays: the bucket's gradients.

        Returns:
          False.
        """
        return False

    def update(self, result) -> None:
        """Nothing is kept.

        Args:
          result: the round's outcome (unused).
        """

    def swap(self) -> None:
        """Nothing is kept: once the aggregator has settled (read ``acc`` for the last time),
        ``acc`` is free for the next round."""

    def drop_nonfinite(self) -> None:
        """After a skipped round (a non-finite gradient): nothing is kept, nothing to clean."""


def _clear_contributed(space, buf, result) -> None:
    if result.contributed is None:
        traffic.count("update", written=4 * buf.size)
        space.fill(buf, 0.0)
    else:
        space.zero_at(buf, result.contributed)


@register_memory
class ResidualMemory(Stateful):
    """Residual accumulation (error feedback).

    Args:
      size: elements of the bucket.
      space: where its vectors live (:mod:`tfsparse.space`).
    """

    name = "residual"
    always = False  # only where the exchange loses something
    has_velocity = False  # no momentum of its own: the optimizer applies it
    takes_rows = False  # the spans of row-sparse gradients (get_memory's rows) make no difference

    def __init__(self, size: int = 0, space=HOST):
        self.space = space
        self.acc = space.empty(int(size))
        self.residual = space.zeros(int(size))

    @classmethod
    def check_options(cls, momentum=None) -> dict:
        """No options, as :meth:`NoMemory.check_options`.

        Args:
          momentum: must be None (the optimizer applies its momentum; momentum correction is
            ``memory="momentum"``).

        Returns:
          ``{}``.

        Raises:
          ValueError: ``momentum`` is given.
        """
        return _without_momentum(cls.name, momentum)

    def compensate(self, grad: np.ndarray, span: slice) -> np.ndarray:
        """``acc[span] = grad + residual[span]`` (float32, in one pass).

        Args:
          grad: this round's float32 gradient for ``span``.
          span: a slice of the bucket.

        Returns:
          :attr:`acc`, the whole bucket's offered vector.
        """
        nbytes = 4 * (span.stop - span.start)
        traffic.count("compensate", read=2 * nbytes, written=nbytes)
        self.space.add(grad, self.residual[span], self.acc[span])
        return self.acc

    def drop_nonfinite(self) -> None:
        """After a skipped round (a non-finite gradient): the residual was not touched by the
        round; nothing else is kept."""

    # -- error feedback fused with the selection and the finite check ---------------------
    def fuses(self, arrays) -> bool:
        """Whether :meth:`compensate_select` takes these gradients.

        Args:
          arrays: the bucket's gradients, in order.

        Returns:
          True where they are contiguous float32 host arrays (whose float32 sum with the residual is
          what :meth:`compensate` computes) and the residual is on the host.
        """
        return not self.space.on_device and all(
            isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)

    def peek(self, arrays, positions) -> np.ndarray:
        """``grad + residual`` at some positions of the bucket, computed ahead of :meth:`compensate`.

        A compressor's sample (:meth:`Compressor.prefilter
        <tfsparse.compressors.Compressor.prefilter>`) reads it.

        Args:
          arrays: the bucket's gradients, in order.
          positions: int64 positions in the bucket, ascending.

        Returns:
          A float32 vector, one value per position: what :meth:`compensate` will write there.
        """
        out = np.empty(positions.size, np.float32)
        lo = 0
        for a in arrays:
            hi = lo + a.size
            i, j = np.searchsorted(positions, (lo, hi))
            if j > i:
                at = positions[i:j]
                np.add(a.reshape(-1)[at - lo], self.residual[at], out=out[i:j])
            lo = hi
        return out

    def compensate_select(self, arrays, prefilter=None):
        """:meth:`compensate` of the whole bucket, the finite check and the collection of ``prefilter``'s elements in one pass.

        One pass over gradient and residual (:func:`tfsparse.ops.cpu.add_select`).

        Args:
          arrays: the bucket's gradients, in order (:meth:`fuses` holds).
          prefilter: a :class:`~tfsparse.compressors.Prefilter` (the elements whose key reaches its
            key are collected); None: none collected.

        Returns:
          ``(candidates, finite)``: the :class:`~tfsparse.compressors.Candidates` (None without a
          prefilter) and whether every element of :attr:`acc` is finite.
        """
        from .compressors import Candidates
        from .ops import _common as C, cpu

        key = C.NAN_KEY + 1 if prefilter is None else prefilter.key  # above every key: collects nothing
        idx, val, finite, lo = [], [], True, 0
        stream = self.acc.size >= cpu.STREAM_MIN  # the whole vector leaves the cache: stream it
        for a in arrays:
            hi = lo + a.size
            i, v, ok = cpu.add_select(a.reshape(-1), self.residual[lo:hi], self.acc[lo:hi], key, lo, stream)
            idx.append(i)
            val.append(v)
            finite = finite and ok
            lo = hi
        if prefilter is None:
            return None, finite
        one = len(arrays) == 1
        return Candidates(idx[0] if one else np.concatenate(idx), val[0] if one else np.concatenate(val),
                          prefilter.key, prefilter.threshold), finite

    def compensate_encode(self, arrays, spans, wire, buffers=None) -> tuple[list, bool]:
        """:meth:`compensate` of the whole bucket with the encoding of ``spans`` fused into it.

        Each span ``(start, stop)`` of :attr:`acc` is summed and encoded by ``wire`` in one pass
        (:meth:`Wire.compensate_encode <tfsparse.wire.Wire.compensate_encode>`), what the encoding
        lost written over it (the new residual, built in place); the rest of :attr:`acc` is summed
        with the finite check (:func:`tfsparse.ops.cpu.add_select`).

        Args:
          arrays: the bucket's gradients, in order.
          spans: ``(start, stop)`` spans to encode: a dense exchange's blocks for the other ranks
            (:meth:`Aggregator.fused_spans <tfsparse.aggregators.Aggregator.fused_spans>`).
          wire: a :class:`~tfsparse.wire.Wire` with ``fuses_compensation``.
          buffers: a :class:`tfsparse.buffers.Reusable` to take the messages from; None: new arrays.

        Returns:
          ``(messages, finite)``, a message per span; where some sum is not finite the messages and
          :attr:`acc` are undefined (the caller compensates again).
        """
        from .ops import _common as C, cpu

        stream = self.acc.size >= cpu.STREAM_MIN
        flat, starts = [a.reshape(-1) for a in arrays], [0]
        for a in flat:
            starts.append(starts[-1] + a.size)
        messages, finite = [], True
        edges = [(s0, s1, True) for s0, s1 in spans]
        gaps, at = [], 0
        for s0, s1 in sorted(spans):
            if s0 > at:
                gaps.append((at, s0, False))
            at = s1
        if at < self.acc.size:
            gaps.append((at, self.acc.size, False))
        for s0, s1, encoded in edges + gaps:
            pieces = []
            for a, lo, hi in zip(flat, starts, starts[1:]):
                x0, x1 = max(lo, s0), min(hi, s1)
                if x1 > x0:
                    pieces.append((a[x0 - lo:x1 - lo], self.residual[x0:x1], x0))
            if encoded:
                message, ok = wire.compensate_encode([(g, r, x0 - s0) for g, r, x0 in pieces], self.acc[s0:s1],
                                                     buffers, stream)
                messages.append(message)
            else:
                ok = True
                for g, r, x0 in pieces:
                    ok = cpu.add_select(g, r, self.acc[x0:x0 + g.size], C.NAN_KEY + 1, x0, stream)[2] and ok
            finite = finite and ok
        return messages, finite

    def update(self, result) -> None:
        """Builds the new residual in place of ``acc`` (the two buffers then swap).

        The contributed entries are removed (``result.contributed``; ``None`` means everything) and
        what the wire lost (``result.loss``) added -- or, where the aggregator built it in ``acc``
        already (``result.residual_in_place``), that is kept.

        Args:
          result: the round's :class:`~tfsparse.aggregators.AllreduceResult`.
        """
        if not result.residual_in_place:
            _clear_contributed(self.space, self.acc, result)
            result.loss.apply_to(self.acc, self.space)
        self.swap()

    def swap(self) -> None:
        """``acc``, which holds the new residual, becomes the residual, and the old residual's
        buffer the next round's scratch: :meth:`update`'s last step, and all of it for a round
        whose aggregator built the whole residual in ``acc`` and contributed every element -- done
        as soon as the aggregator says so (the ``settled`` of :meth:`Aggregator.exchange
        <tfsparse.aggregators.Aggregator.exchange>`),
        while the rest of its messages travel."""
        self.acc, self.residual = self.residual, self.acc

    def get_state(self):
        """The memory's state for a checkpoint.

        Returns:
          ``{"residual": ...}``: a host copy of the residual (float32).
        """
        return {"residual": np.array(self.space.to_host(self.residual), np.float32)}

    def set_state(self, state):
        """Restores the residual in place.

        Args:
          state: what :meth:`get_state` returned (zeros where it holds no residual).
        """
        super().set_state(state)
        self.space.load(self.residual, state.get("residual"))


@register_memory
class MomentumMemory(ResidualMemory):
    """Momentum correction + momentum factor masking (DGC §3.2, GradientFlow Alg. 1).

    Args:
      size: elements of the bucket.
      momentum: the momentum factor ``m`` (default 0.9, DGC's and GradientFlow's).
      space: where its vectors live (:mod:`tfsparse.space`).
    """

    name = "momentum"
    always = True  # the velocity is kept even for a lossless dense exchange
    has_velocity = True

    DEFAULT_MOMENTUM = 0.9

    def __init__(self, size: int = 0, momentum: float = DEFAULT_MOMENTUM, space=HOST):
        super().__init__(size, space)
        self.momentum = np.float32(momentum)
        self.velocity = space.zeros(int(size))
        self._taken = None  # the velocity's pieces, where a fused pass took this round's gradient and must run again

    @staticmethod
    def check_options(momentum=None) -> dict:
        """The options of momentum correction: its factor.

        Args:
          momentum: the momentum factor ``m``, in ``[0, 1)``; None: :attr:`DEFAULT_MOMENTUM` (0.9).

        Returns:
          ``{"momentum": m}``, ``m`` a float.

        Raises:
          ValueError: when ``momentum`` is not a number in ``[0, 1)``.
        """
        if momentum is None:
            return {"momentum": MomentumMemory.DEFAULT_MOMENTUM}
        return {"momentum": _checks.real("momentum", momentum, 0.0, 1.0, hi_open=True, hint=", e.g. momentum=0.9")}

    def compensate(self, grad, span):
        """``u = m·u + grad; acc = residual + u`` over ``span`` of the bucket.

        Args:
          grad: this round's float32 gradient for ``span``.
          span: a slice of the bucket.

        Returns:
          :attr:`acc`, the whole bucket's offered vector.
        """
        nbytes = 4 * (span.stop - span.start)
        traffic.count("compensate", read=5 * nbytes, written=3 * nbytes)  # u *= m; u += g; acc = u + r
        self.space.momentum(self.velocity[span], self.momentum, grad, self.residual[span], self.acc[span])
        return self.acc

    # -- fused: the velocity's own pass, then error feedback's fused passes over it --------
    # (:class:`ResidualMemory` takes the velocity where it took the gradient: ``acc = u + residual``)
    def _take(self, arrays) -> list:
        """``u = m·u + grad`` per tensor (the same float32 operations as :meth:`compensate`);
        returns the velocity's pieces, which the fused passes then take as the gradient."""
        pieces, lo = [], 0
        for a in arrays:
            hi = lo + a.size
            u = self.velocity[lo:hi]
            np.multiply(u, self.momentum, out=u)
            np.add(u, a.reshape(-1), out=u)
            pieces.append(u)
            lo = hi
        traffic.count("compensate", read=12 * lo, written=8 * lo)  # u *= m; u += g
        return pieces

    def peek(self, arrays, positions) -> np.ndarray:
        """``m·u + grad + residual`` at ``positions``: what :meth:`compensate_select` will write there.

        ``u + residual`` where the velocity took this round's gradient already.

        Args:
          arrays: the bucket's gradients, in order.
          positions: int64 positions in the bucket, ascending.

        Returns:
          A float32 vector, one value per position.
        """
        if self._taken is not None:
            return super().peek(self._taken, positions)
        pieces, lo = [], 0
        for a in arrays:
            hi = lo + a.size
            i, j = np.searchsorted(positions, (lo, hi))
            at = positions[i:j] - lo
            u = np.multiply(self.velocity[lo:hi][at], self.momentum)
            pieces.append(np.add(u, a.reshape(-1)[at]))
            lo = hi
        flat = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        return np.add(flat, self.residual[positions])

    def compensate_select(self, arrays, prefilter=None):
        """:meth:`ResidualMemory.compensate_select` over the velocity, once it took the gradient.

        Args:
          arrays: the bucket's gradients, in order.
          prefilter: a :class:`~tfsparse.compressors.Prefilter`, or None.

        Returns:
          ``(candidates, finite)`` as :meth:`ResidualMemory.compensate_select`.
        """
        taken, self._taken = self._taken, None
        return super().compensate_select(self._take(arrays) if taken is None else taken, prefilter)

    def compensate_encode(self, arrays, spans, wire, buffers=None) -> tuple[list, bool]:
        """:meth:`ResidualMemory.compensate_encode` over the velocity, once it took the gradient.

        Where some sum is not finite the caller compensates again (:meth:`compensate_select`), from
        the velocity as it is now.

        Args:
          arrays: the bucket's gradients, in order.
          spans: ``(start, stop)`` spans to encode.
          wire: a :class:`~tfsparse.wire.Wire` with ``fuses_compensation``.
          buffers: a :class:`tfsparse.buffers.Reusable`, or None.

        Returns:
          ``(messages, finite)`` as :meth:`ResidualMemory.compensate_encode`.
        """
        taken = self._take(arrays)
        messages, finite = super().compensate_encode(taken, spans, wire, buffers)
        self._taken = None if finite else taken
        return messages, finite

    def update(self, result):
        """The residual as :class:`ResidualMemory` keeps it; the velocity cleared where values were contributed.

        That is momentum factor masking -- unless everything was contributed (a dense exchange: plain
        momentum SGD).

        Args:
          result: the round's :class:`~tfsparse.aggregators.AllreduceResult`.
        """
        if result.contributed is not None:
            self.space.zero_at(self.velocity, self._masked(result.contributed))
        super().update(result)

    def _masked(self, contributed):
        """Where the velocity is cleared: every sent position."""
        return contributed

    def drop_nonfinite(self) -> None:
        """After a skipped round: the velocity took the round's gradient in ``compensate``;
        its non-finite entries are cleared, so that it never keeps NaN/Inf."""
        self.space.zero_nonfinite(self.velocity)

    def get_state(self):
        """The memory's state for a checkpoint.

        Returns:
          ``{"residual": ..., "velocity": ...}``: host copies of both (float32).
        """
        return {**super().get_state(), "velocity": np.array(self.space.to_host(self.velocity), np.float32)}

    def set_state(self, state):
        """Restores the residual and the velocity in place.

        Args:
          state: what :meth:`get_state` returned (zeros for one it lacks).
        """
        super().set_state(state)
        self.space.load(self.velocity, state.get("velocity"))

    def __repr__(self):
        return f"{type(self).__name__}(momentum={float(self.momentum)})"


@register_memory
class RowsMomentumMemory(MomentumMemory):
    """Momentum correction whose masking spares row-sparse gradients (``memory="momentum_rows"``,
    what ``memory="auto"`` gives a sparse algorithm under an SGD with momentum): the velocity is
    cleared where values were sent, as :class:`MomentumMemory` does (DGC §3.2), except in the
    tensors whose gradients arrive as rows (``rows``: an Embedding's ``tf.IndexedSlices``, most
    of its rows zero in a step), whose velocity is kept.

    Momentum SGD moves a row that one step touched by ``lr·g / (1 - m)`` over the following
    steps; with masking, a row sent in the step that touched it moves by ``lr·g``: a tenth at
    m = 0.9.  Measured (docs/choosing.md, "Masking and embeddings"): on a Transformer whose
    20,000x128 embedding is 95 % of its weights, masking everywhere left gTop-k 3.3-4.9 points
    below dense; sparing the embedding, it ended at or above dense's accuracy.  Dense gradients
    keep DGC's masking, with which the digits MLPs end within a point of dense (without it, 1.9
    points below in the median of three seeds).

    Args:
      size: elements of the bucket.
      momentum: the momentum factor ``m`` (default 0.9).
      space: where its vectors live (:mod:`tfsparse.space`).
      rows: ``(start, stop)`` spans of the bucket holding row-sparse gradients (default none:
        :class:`MomentumMemory`'s behaviour).
    """

    name = "momentum_rows"
    takes_rows = True

    def __init__(self, size: int = 0, momentum: float = MomentumMemory.DEFAULT_MOMENTUM, space=HOST, rows=()):
        super().__init__(size, momentum, space)
        self.rows = rows_spans(rows)
        self._edges = np.array([e for span in self.rows for e in span], np.int64)  # ascending: start, stop, ...

    def _masked(self, contributed):
        """The sent positions outside the row-sparse spans (on a GPU the indices cross to the
        host and back: a copy each way per round that ``"momentum"`` does not make)."""
        if not self.rows:
            return contributed
        at = contributed if isinstance(contributed, np.ndarray) else self.space.to_host(contributed)
        return at[np.searchsorted(self._edges, at, side="right") % 2 == 0]  # odd: inside a span
