"""Exact top-k by magnitude (:class:`TopK`, the selection of gtopk-ssgd-shi2019 and of top-k
sparsification) and :class:`Identity` (everything, dense)."""
from __future__ import annotations

import numpy as np

from .base import COMPRESSORS, Candidates, Compressor, Prefilter


def topk_indices(acc: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the ``k`` entries of largest ``|acc|`` (exact selection).

    Runs the Numba selection kernel :func:`tfsparse.ops.topk_abs` (sample + radix select,
    no sort).  Ties at the k-th magnitude go to the lowest index (on both paths), so the
    selection is a function of the values alone -- the 16-bit wires make ties common.
    NaN compares larger than any number, so non-finite gradients are always sent
    (and show up in the result instead of hiding in the residual).

    Args:
      acc: the vector (float32).
      k: how many entries.

    Returns:
      int64 indices, ascending.
    """
    idx, _ = topk_with_values(acc, k)
    return idx


def topk_with_values(acc, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, acc[indices])`` of :func:`topk_indices`; a CUDA device ``acc`` is selected on
    the device (:func:`tfsparse.ops.topk_abs`, the same indices) and only the payload comes back.

    Args:
      acc: the vector (float32, host or CUDA device).
      k: how many entries.

    Returns:
      ``(indices, values)`` on the host.
    """
    from .. import ops

    n = acc.size
    k = int(min(max(k, 0), n))
    if ops.device_kind(acc) == "cuda":
        idx, val = ops.topk_abs(acc, k)
        return idx.copy_to_host(), val.copy_to_host()
    if k == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, np.float32)
    if k == n:
        return np.arange(n, dtype=np.int64), np.asarray(acc).reshape(-1)
    if k > n // 16:
        # dense selections (e.g. density warm-up at 0.25, gTop-k's merges): the magnitudes' keys
        # once, their k-th largest by a two-pass 16-bit histogram select (``ops._cpu_select._kth_key``,
        # no copy of the keys; timed against numpy's introselect by tools/bench_choices.py, the
        # ``dense_select`` rows of docs/engine_choices.json); the kernel's ordered pass then takes
        # every larger one and the lowest-index ties, with no sort (the same indices as numpy's
        # masks and sort)
        from ..ops import cpu

        if isinstance(acc, np.ndarray) and acc.dtype == np.float32:
            return cpu.topk_ties_low(acc, k)
        mag = np.abs(acc)
        mag[np.isnan(mag)] = np.inf  # NaN first, as in the kernel
        t = mag[np.argpartition(mag, n - k)[n - k]]  # the k-th largest magnitude
        above = np.flatnonzero(mag > t)
        ties = np.flatnonzero(mag == t)[:k - above.size]  # ties to the lowest index, as in the kernel
        idx = np.sort(np.concatenate([above, ties])).astype(np.int64, copy=False)
        return idx, acc[idx]
    idx, val = ops.topk_abs(np.ascontiguousarray(acc, dtype=np.float32), k)
    return np.asarray(idx, dtype=np.int64), val


def topk_prefilter(n: int, k: int, peek) -> Prefilter | None:
    """The exact top-k's prefilter (:func:`tfsparse.ops.topk_abs`'s own sample, read through
    ``peek``): a key below the k-th largest with high probability; None where the top-k takes
    another path (``k`` above ``n / 64``, small vectors).

    Args:
      n: the vector's elements.
      k: how many the top-k keeps.
      peek: ``peek(positions)``: the vector's values at the sample's int64 positions.

    Returns:
      A :class:`~tfsparse.compressors.Prefilter` with the sample's key, or None.
    """
    from ..ops import cpu

    plan = cpu.prefilter_plan(n, k) if 0 < k <= n // 16 else None
    if plan is None:
        return None
    positions, rank = plan
    return Prefilter(cpu.kth_key(cpu.keys_of(peek(positions)), rank))


def topk_of(acc, k: int, candidates: Candidates | None):
    """:func:`topk_with_values`, from ``candidates`` when they hold at least ``k`` elements.

    Args:
      acc: the vector (float32, host or CUDA device).
      k: how many entries to keep.
      candidates: what a fused pass collected for :func:`topk_prefilter`; None, or fewer than
        ``k`` of them: ``acc`` is read itself.

    Returns:
      ``(indices, values)``: the exact top-k, indices ascending, on the host.
    """
    if candidates is not None:
        from ..ops import cpu

        top = cpu.topk_of_candidates(candidates.idx, candidates.val, int(k))
        if top is not None:
            return top
    return topk_with_values(acc, k)


@COMPRESSORS.register
class TopK(Compressor):
    """Exact local top-k by magnitude (gtopk-ssgd-shi2019 Alg. 1 lines 5-7).  Fused with error
    feedback (:meth:`prefilter`): the top-k's sample is read from gradient + residual before the
    pass, the pass collects the elements above the sample's lower bound, and the top-k is taken
    among them -- the same indices and values."""

    name = "topk"
    on_device = True
    ascending = True

    def compress(self, acc, k, candidates=None):
        """The exact top-k (:func:`topk_with_values`), taken among ``candidates`` when they hold at least ``k``.

        Args:
          acc: the offered vector (float32, host or CUDA device).
          k: how many entries to send.
          candidates: the fused pass's collection for :meth:`prefilter`'s key, or None.

        Returns:
          ``(indices, values)``: the exact top-k, indices ascending.
        """
        return topk_of(acc, k, candidates)

    def prefilter(self, n, k, peek):
        """:func:`topk_prefilter`: a key below the k-th largest magnitude with high probability;
        where the pass collects fewer than ``k`` elements, :meth:`compress` reads ``acc`` itself.

        Args:
          n: the vector's elements.
          k: how many entries the next :meth:`compress` keeps.
          peek: reads the sample's values ahead of the pass.

        Returns:
          A :class:`~tfsparse.compressors.Prefilter`, or None (no fusion this round).
        """
        return topk_prefilter(n, k, peek)


@COMPRESSORS.register
class Identity(Compressor):
    """Sends everything (dense)."""

    name = "identity"
    ascending = True

    def compress(self, acc, k, candidates=None):
        """Every index ``0 .. n-1`` and a copy of ``acc``.

        Args:
          acc: the offered vector.
          k: ignored: every element is sent.
          candidates: ignored (it answers no prefilter).

        Returns:
          ``(arange(n), acc.copy())``.
        """
        return np.arange(acc.size, dtype=np.int64), acc.copy()

    def expected_count(self, n, k):
        """``n``: every element, whatever ``k``.

        Args:
          n: the vector's elements.
          k: ignored.

        Returns:
          ``n``.
        """
        return n
