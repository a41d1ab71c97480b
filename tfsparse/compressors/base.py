"""The compressors' interface (:class:`Compressor`, the fused pass's :class:`Candidates` and
:class:`Prefilter`), their registry, and the selection helpers the threshold compressors share."""
from __future__ import annotations

import math

import numpy as np

from .. import _checks, traffic
from .._registry import Registry
from ..state import Stateful


class Candidates:
    """What a fused error-feedback pass collected for a compressor (:meth:`Compressor.prefilter`):
    every element of the offered vector whose magnitude key (:mod:`tfsparse.ops._common`) is at
    least ``key`` -- ``idx`` (int64, ascending) and ``val`` -- and ``threshold``, what the
    prefilter derived the key from where the compressor needs it again (DRAGONN's sampled
    threshold)."""

    __slots__ = ("idx", "val", "key", "threshold")

    def __init__(self, idx, val, key: int, threshold: float | None = None):
        self.idx, self.val, self.key, self.threshold = idx, val, int(key), threshold

    def at_least(self, key: int):
        """``(idx, val)`` of the candidates whose key is at least ``key`` (which must be at least
        :attr:`key`: then these are all such elements of the vector)."""
        from ..ops import cpu

        if key <= self.key:
            return self.idx, self.val
        keep = cpu.keys_of(self.val) >= key
        return self.idx[keep], self.val[keep]


class Prefilter:
    """A compressor's answer to :meth:`Compressor.prefilter`: collect every element whose key is at
    least ``key``; ``threshold`` rides along to :class:`Candidates`."""

    __slots__ = ("key", "threshold")

    def __init__(self, key: int, threshold: float | None = None):
        self.key, self.threshold = int(key), threshold


#: every compressor class by its ``name`` (``compressor=`` may name one)
COMPRESSORS = Registry("compressor", "compressor")


class Compressor(Stateful):
    """Base class; subclasses implement :meth:`compress`, and :meth:`prefilter` where the
    selection can be fused with error feedback."""

    name = "base"
    #: whether any aggregator that selects locally may use it (``compressor=``); False for a
    #: compressor that needs its own aggregator to drive it
    standalone = True
    #: whether :meth:`compress` takes a CUDA device vector (and returns host arrays)
    on_device = False
    #: whether :meth:`compress` returns strictly ascending indices: then they travel blocked
    #: (:class:`tfsparse.wire.BlockedIndices`, where that is smaller), else as int32
    ascending = False

    def compress(self, acc: np.ndarray, k: int, candidates: Candidates | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Returns (indices, values) of the entries to send.  ``candidates``: what the fused pass
        collected for :meth:`prefilter`'s answer (only given to a compressor that answered one);
        the result must be the same as without them."""
        raise TypeError(f"{type(self).__name__} does not define compress()")

    def prefilter(self, n: int, k: int, peek) -> Prefilter | None:
        """Fusion with error feedback (the memory's pass over gradient and residual): the key
        such that the next :meth:`compress` of an ``n``-element ``acc`` needs only the elements at
        or above it, decided before ``acc`` exists -- ``peek(positions)`` gives ``acc``'s values at
        int64 ``positions`` (a sample).  None (the default): the compressor reads ``acc`` itself.
        Does not change the compressor's state."""
        return None

    def expected_count(self, n: int, k: int) -> float:
        """The entries :meth:`compress` is expected to send of an ``n``-element vector for the
        budget ``k`` (the α-β schedules price it): ``k`` for a compressor that keeps to its budget."""
        return min(k, n)

    def __repr__(self):
        return f"{type(self).__name__}()"


# -- threshold compressors (approximate top-k) ------------------------------------------

def check_small_density(small_density) -> float | None:
    """``small_density``: None, or checked to be a number in ``(0, 1]`` (as a float); ValueError otherwise."""
    return None if small_density is None else _checks.real("small_density", small_density, 0.0, 1.0, lo_open=True)


def sample_sizes(n: int, k: int, sample_ratio: float, min_samples: int) -> tuple[int, int]:
    """DGC's sample of an ``n``-element vector: ``s = max(ceil(sample_ratio·n), min(n, min_samples))``
    positions, and ``ks = ceil(k·s/n)`` (in ``[1, s]``), the rank among them of the estimate of the
    k-th largest magnitude."""
    s = int(max(math.ceil(sample_ratio * n), min(n, min_samples)))
    return s, int(min(s, max(1, math.ceil(k * s / n))))


def sampled_count(n: int, k: int, sample_ratio: float, min_samples: int, strict: bool) -> float:
    """Expected entries that pass the ``ks``-th largest of ``s`` uniform samples
    (:func:`sample_sizes`): with every element sampled exactly ``ks - 1`` strictly above it
    (``strict``, no ties) or ``k`` at or above it; otherwise the fraction of the vector above
    the ``ks``-th largest of ``s`` uniform samples is ``Beta(ks, s-ks+1)``, of mean ``ks / (s + 1)``."""
    s, ks = sample_sizes(n, k, sample_ratio, min_samples)
    if s >= n:
        return float(ks - 1) if strict else float(k)
    return n * ks / (s + 1)


def magnitudes(acc: np.ndarray) -> np.ndarray:
    """``np.abs(acc)``, counted (:mod:`tfsparse.traffic`)."""
    traffic.count("select", read=acc.nbytes, written=acc.nbytes)
    return np.abs(acc)


def _count_above(mag: np.ndarray, t: float) -> int:
    """``count_nonzero(mag > t)``, counted (:mod:`tfsparse.traffic`)."""
    traffic.count("select", read=mag.nbytes + mag.size, written=mag.size)
    return int(np.count_nonzero(mag > t))


def threshold_select(acc: np.ndarray, threshold: float, strict: bool = True, mag: np.ndarray | None = None) -> np.ndarray:
    """Indices (ascending, int64) of the entries of ``acc`` whose magnitude passes ``threshold``.

    ``strict``: ``|acc| > threshold`` (dragonn-wang2022 Alg. 3, "mask <- |G| > t"), else
    ``|acc| >= threshold``.  A non-positive threshold selects the non-zero entries only
    (sending zeros is never useful); a NaN threshold selects nothing but NaN entries.  NaN
    entries always pass, as in :func:`topk_indices`.  ``mag``: ``np.abs(acc)`` if already computed.
    """
    mag = magnitudes(acc) if mag is None else mag
    traffic.count("select", read=mag.nbytes + mag.size, written=mag.size)  # the mask, then its indices
    threshold = float(threshold)
    if np.isnan(threshold):
        threshold = np.inf
    if threshold <= 0.0:
        return np.flatnonzero(~(mag <= 0.0)).astype(np.int64, copy=False)
    mask = ~(mag <= threshold) if strict else ~(mag < threshold)
    return np.flatnonzero(mask).astype(np.int64, copy=False)


def compressors_by_name() -> dict:
    """The compressors a ``compressor=`` option may name, by their ``name``: every registered one
    that works without its own aggregator (not Ok-Topk's reused threshold, whose re-evaluations
    only :class:`~tfsparse.aggregators.oktopk.OkTopkAllreduce` schedules)."""
    return {name: cls for name, cls in COMPRESSORS.items() if cls.standalone}


def check_compressor(compressor) -> Compressor:
    """``compressor=``: a :class:`Compressor` instance or the name of one (built with its
    defaults); ValueError otherwise, before anything communicates."""
    if isinstance(compressor, Compressor):
        return compressor
    names = compressors_by_name()
    _checks.choice("compressor", compressor, tuple(names), accepted="a tfsparse.compressors.Compressor instance or "
                   f"one of {', '.join(repr(n) for n in names)}")
    return names[compressor]()
