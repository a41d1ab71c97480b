"""The compressors' interface (:class:`Compressor`, the fused pass's :class:`Candidates` and
:class:`Prefilter`), their registry, and the selection helpers the threshold compressors share."""
from __future__ import annotations

import math

import numpy as np

from .. import _checks, traffic
from .._registry import Registry
from ..state import Stateful


class Candidates:
    """What a fused error-feedback pass collected for a compressor (:meth:`Compressor.prefilter`).

    Every element of the offered vector whose magnitude key (:mod:`tfsparse.ops._common`) is at
    least ``key``.

    Args:
      idx: their positions (int64, ascending).
      val: their values (float32).
      key: the key they reach.
      threshold: what the prefilter derived the key from, where the compressor needs it again
        (DRAGONN's sampled threshold); None otherwise.
    """

    __slots__ = ("idx", "val", "key", "threshold")

    def __init__(self, idx, val, key: int, threshold: float | None = None):
        self.idx, self.val, self.key, self.threshold = idx, val, int(key), threshold

    def at_least(self, key: int):
        """The candidates whose key is at least ``key``.

        Args:
          key: a key at least :attr:`key` (then these are all such elements of the vector).

        Returns:
          ``(idx, val)``.
        """
        from ..ops import cpu

        if key <= self.key:
            return self.idx, self.val
        keep = cpu.keys_of(self.val) >= key
        return self.idx[keep], self.val[keep]


class Prefilter:
    """A compressor's answer to :meth:`Compressor.prefilter`: collect every element whose key is at least ``key``.

    Args:
      key: the magnitude key (:mod:`tfsparse.ops._common`).
      threshold: rides along to :class:`Candidates`; None: nothing.
    """

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
        """The entries to send of ``acc``.

        Args:
          acc: the offered vector (error feedback's sum), float32.
          k: the budget: how many entries to send (a threshold compressor sends about that many).
          candidates: what the fused pass collected for :meth:`prefilter`'s answer (only given to a
            compressor that answered one); the result must be the same as without them.

        Returns:
          ``(indices, values)``: int64 positions (strictly ascending where :attr:`ascending`) and
          their float32 values.
        """
        raise TypeError(f"{type(self).__name__} does not define compress()")

    def prefilter(self, n: int, k: int, peek) -> Prefilter | None:
        """Fusion with error feedback (the memory's pass over gradient and residual).

        The key such that the next :meth:`compress` of an ``n``-element ``acc`` needs only the
        elements at or above it, decided before ``acc`` exists.  Does not change the compressor's
        state.

        Args:
          n: the vector's elements.
          k: the budget.
          peek: ``peek(positions)`` gives ``acc``'s values at int64 ``positions`` (a sample).

        Returns:
          A :class:`Prefilter`; None (the default): the compressor reads ``acc`` itself.
        """
        return None

    def expected_count(self, n: int, k: int) -> float:
        """The entries :meth:`compress` is expected to send of an ``n``-element vector for the budget ``k`` (the α-β schedules price it).

        Args:
          n: the vector's elements.
          k: the budget.

        Returns:
          ``min(k, n)`` for a compressor that keeps to its budget; a float for one that does not.
        """
        return min(k, n)

    def __repr__(self):
        return f"{type(self).__name__}()"


# -- threshold compressors (approximate top-k) ------------------------------------------

def check_small_density(small_density) -> float | None:
    """Checks ``small_density=``.

    Args:
      small_density: None, or a number in ``(0, 1]``.

    Returns:
      None, or the number as a float.

    Raises:
      ValueError: any other value.
    """
    return None if small_density is None else _checks.real("small_density", small_density, 0.0, 1.0, lo_open=True)


def sample_sizes(n: int, k: int, sample_ratio: float, min_samples: int) -> tuple[int, int]:
    """DGC's sample of an ``n``-element vector.

    Args:
      n: the vector's elements.
      k: the budget.
      sample_ratio: the fraction of the vector sampled.
      min_samples: the fewest positions sampled (all of them when ``n`` is smaller).

    Returns:
      ``(s, ks)``: ``s = max(ceil(sample_ratio·n), min(n, min_samples))`` positions, and
      ``ks = ceil(k·s/n)`` (in ``[1, s]``), the rank among them of the estimate of the k-th
      largest magnitude.
    """
    s = int(max(math.ceil(sample_ratio * n), min(n, min_samples)))
    return s, int(min(s, max(1, math.ceil(k * s / n))))


def sampled_count(n: int, k: int, sample_ratio: float, min_samples: int, strict: bool) -> float:
    """Expected entries that pass the ``ks``-th largest of ``s`` uniform samples (:func:`sample_sizes`).

    With every element sampled: exactly ``ks - 1`` strictly above it (``strict``, no ties) or
    ``k`` at or above it; otherwise the fraction of the vector above the ``ks``-th largest of
    ``s`` uniform samples is ``Beta(ks, s-ks+1)``, of mean ``ks / (s + 1)``.

    Args:
      n: the vector's elements.
      k: the budget.
      sample_ratio: as :func:`sample_sizes`.
      min_samples: as :func:`sample_sizes`.
      strict: whether entries must lie strictly above the estimate.

    Returns:
      The expected count, a float.
    """
    s, ks = sample_sizes(n, k, sample_ratio, min_samples)
    if s >= n:
        return float(ks - 1) if strict else float(k)
    return n * ks / (s + 1)


def magnitudes(acc: np.ndarray) -> np.ndarray:
    """``np.abs(acc)``, counted (:mod:`tfsparse.traffic`).

    Args:
      acc: a float32 vector.

    Returns:
      A new float32 vector.
    """
    traffic.count("select", read=acc.nbytes, written=acc.nbytes)
    return np.abs(acc)


def _count_above(mag: np.ndarray, t: float) -> int:
    """``count_nonzero(mag > t)``, counted (:mod:`tfsparse.traffic`)."""
    traffic.count("select", read=mag.nbytes + mag.size, written=mag.size)
    return int(np.count_nonzero(mag > t))


def threshold_select(acc: np.ndarray, threshold: float, strict: bool = True, mag: np.ndarray | None = None) -> np.ndarray:
    """Indices of the entries of ``acc`` whose magnitude passes ``threshold``.

    A non-positive threshold selects the non-zero entries only (sending zeros is never useful); a
    NaN threshold selects nothing but NaN entries.  NaN entries always pass, as in
    :func:`topk_indices`.

    Args:
      acc: a float32 vector.
      threshold: the magnitude to pass.
      strict: ``|acc| > threshold`` (dragonn-wang2022 Alg. 3, "mask <- |G| > t"); False:
        ``|acc| >= threshold``.
      mag: ``np.abs(acc)`` if already computed; None: computed here.

    Returns:
      int64 indices, ascending.
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
    """The compressors a ``compressor=`` option may name.

    Every registered one that works without its own aggregator (not Ok-Topk's reused threshold,
    whose re-evaluations only :class:`~tfsparse.aggregators.oktopk.OkTopkAllreduce` schedules).

    Returns:
      A dict of compressor classes by their ``name``.
    """
    return {name: cls for name, cls in COMPRESSORS.items() if cls.standalone}


def check_compressor(compressor) -> Compressor:
    """Checks ``compressor=``, before anything communicates.

    Args:
      compressor: a :class:`Compressor` instance, or the name of one (built with its defaults).

    Returns:
      The :class:`Compressor`.

    Raises:
      ValueError: any other value; the message names the accepted ones.
    """
    if isinstance(compressor, Compressor):
        return compressor
    names = compressors_by_name()
    _checks.choice("compressor", compressor, tuple(names), accepted="a tfsparse.compressors.Compressor instance or "
                   f"one of {', '.join(repr(n) for n in names)}")
    return names[compressor]()
