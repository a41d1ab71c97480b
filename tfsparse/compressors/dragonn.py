"""DRAGONN's hashing-based index extraction (:class:`HashedThreshold`, dragonn-wang2022 §3.2)."""
from __future__ import annotations

import math

import numpy as np

from .. import _checks
from ..schedules import small_tensor_k
from .base import COMPRESSORS, Compressor, Prefilter, check_small_density, sampled_count


_SMALLEST_POSITIVE = float(np.nextafter(np.float32(0.0), np.float32(1.0)))


@COMPRESSORS.register
class HashedThreshold(Compressor):
    """DRAGONN's hashing-based index extraction (dragonn-wang2022 §3.2, Alg. 1), per step:

    1. the threshold ``t``: DGC's sampled estimate of the k-th largest ``|acc|`` (a
       ``sample_ratio`` sample, :func:`tfsparse.ops.sample_threshold`), the exact k-th largest
       (:func:`tfsparse.ops.kth_largest_abs`) when the sample, raised to at least
       ``min_samples`` positions, would hold the whole tensor;
    2. every ``i`` with ``|acc[i]| >= t`` is written to slot ``h(i)`` of a table of
       ``capacity_factor · k`` slots (:func:`tfsparse.ops.hash_select`; a later index
       overwrites an earlier one, so one survives per slot);
    3. the occupied slots are returned **in index order**, so that they travel blocked
       (:class:`tfsparse.wire.BlockedIndices`) and are summed in one sequential pass: fused with
       error feedback (the pass collected every element at or above ``t``, ascending) the
       candidates are walked once more and each one that kept its slot is taken -- no sort;
       otherwise (a table made on a CUDA device, or from the whole vector) the occupied slots
       are sorted by index.  Alg. 1's indices are "in random orders"; only their order on the
       wire differs, not which entries are sent nor any sum.

    ``h`` and the sample positions of step ``s`` come from the seed ``seed · 2**32 + s``: every
    rank derives the same.  The step counter is explicit state.  ``k >= n`` sends every non-zero
    entry (no hashing: nothing may collide); a threshold of 0 (more zeros than ``n - k``) is
    raised to the smallest positive float, so zeros are never sent.  ``small_density``: as in
    :class:`DGCSampledThreshold` (the authors' 0.01 for tensors of at most 131072 elements).

    Args:
      capacity_factor: slots per selected element, ``m = capacity_factor · k`` (an integer >= 1).
      sample_ratio: fraction of the gradient sampled for the threshold.
      min_samples: the fewest positions sampled; a tensor of at most this many elements takes the
        exact k-th largest magnitude.
      seed: base seed of the hash functions and the sampling positions.
      small_density: None, or the density every tensor of at most 131072 elements runs at.
    """

    name = "dragonn"
    on_device = True  # the threshold and the table are made on the device; the table comes back
    ascending = True

    def __init__(self, capacity_factor: int = 4, sample_ratio: float = 0.01, min_samples: int = 1024, seed: int = 0,
                 small_density: float | None = None):
        self.small_density = check_small_density(small_density)
        self.capacity_factor = _checks.integer("capacity_factor", capacity_factor, 1)
        self.sample_ratio = _checks.real("sample_ratio", sample_ratio, 0.0, 1.0, lo_open=True)
        self.min_samples = _checks.integer("min_samples", min_samples, 1)
        self.seed = _checks.integer("seed", seed, 0)
        self.step = 0
        self.last_threshold = None

    def step_seed(self, step: int | None = None) -> int:
        """The seed of step ``step`` (default: the next one) -- the same on every rank.

        Args:
          step: the step; None: the next one.

        Returns:
          The seed, an int.
        """
        return self.seed * 2**32 + (self.step if step is None else int(step))

    def threshold(self, acc: np.ndarray, k: int, seed: int) -> float:
        """DGC's sampled estimate of the k-th largest ``|acc|`` (exact for small tensors).

        Args:
          acc: the vector.
          k: the budget.
          seed: the step's seed (the sample's positions).

        Returns:
          The threshold, a float.
        """
        from .. import ops

        ratio = self._sample_ratio(acc.size)
        if ratio is None:
            return float(ops.kth_largest_abs(acc, k))
        return float(ops.sample_threshold(acc, k, ratio=ratio, seed=seed))

    def _sample_ratio(self, n: int) -> float | None:
        """The ratio the threshold samples at; None: the exact k-th largest instead."""
        ratio = self.sample_ratio
        if ratio * n < min(n, self.min_samples):
            ratio = min(n, self.min_samples) / n
            if ratio >= 1.0:
                return None
        return ratio

    def prefilter(self, n, k, peek):
        """The step's sampled threshold, from the sample positions read through ``peek``: the pass
        collects exactly what the hash table takes (every element at or above it).

        Args:
          n: the vector's elements.
          k: the budget (the hash table has ``capacity_factor·k`` slots).
          peek: reads the step's sample positions ahead of the pass.

        Returns:
          A :class:`~tfsparse.compressors.Prefilter` at the sampled threshold (which it carries to
          :meth:`compress`), or None for a tensor that takes another path.
        """
        from ..ops import _common as C, cpu

        k = small_tensor_k(n, int(k), self.small_density)
        ratio = self._sample_ratio(n) if 0 < k < n else None
        if ratio is None:
            return None
        s = C.sample_count(n, ratio)
        key = cpu.kth_key(cpu.keys_of(peek(cpu.sample_positions(n, s, seed=self.step_seed()))), C.sample_rank(k, n, s))
        t = float(C.key_to_float(key))
        if t <= 0.0:  # as compress() raises it (NaN stays NaN: only NaN entries pass)
            t = _SMALLEST_POSITIVE
        return Prefilter(C.threshold_key(t), t)

    def compress(self, acc, k, candidates=None):
        """Alg. 1 with this step's seed (the step counter then advances): threshold, hash table, survivors.

        Args:
          acc: the offered vector (host or CUDA device).
          k: the budget.
          candidates: the fused pass's collection at :meth:`prefilter`'s threshold, or None.

        Returns:
          ``(indices, values)``: the survivors, indices ascending.
        """
        from .. import ops

        seed = self.step_seed()
        self.step += 1
        k = small_tensor_k(acc.size, int(k), self.small_density)
        if k <= 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        if k >= acc.size:  # density 1: every non-zero entry
            if hasattr(acc, "copy_to_host"):
                acc = acc.copy_to_host()
            idx = np.flatnonzero(acc).astype(np.int64)
            return idx, acc[idx]
        fused = candidates is not None and candidates.threshold is not None
        t = candidates.threshold if fused else self.threshold(acc, k, seed)
        if t <= 0.0:
            t = _SMALLEST_POSITIVE
        self.last_threshold = t
        if fused:  # the pass collected every element at or above t: hash those (index order)
            from ..ops import _common as C, cpu

            return cpu.hash_survivors(*candidates.at_least(C.threshold_key(t)), t, self.capacity_factor * k,
                                      seed=seed)
        if ops.device_kind(acc) == "cuda":  # the survivors packed in index order on the device
            idx, values = ops.backend("cuda").hash_survivors(acc, t, self.capacity_factor * k, seed=seed)
            return idx.copy_to_host(), values.copy_to_host()
        table, values = ops.hash_select(acc, t, self.capacity_factor * k, seed=seed)
        full = table >= 0
        table, values = table[full], values[full]
        order = np.argsort(table)  # unique indices: the survivors in index order
        return table[order], values[order]

    def expected_count(self, n, k):
        """The occupied slots: the sampled threshold passes ``l`` elements (:func:`sampled_count`,
        at or above it), hashed into ``m = capacity_factor·k`` slots, of which ``m(1 - (1 - 1/m)^l)``
        keep one (balls into bins; dragonn-wang2022 App. A.2) -- about ``0.89 k`` for ``m = 4k``.

        Args:
          n: the tensor's elements.
          k: the budget.

        Returns:
          The expected occupied slots, a float.
        """
        k = small_tensor_k(n, int(k), self.small_density)
        if k >= n:
            return float(n)
        passed = sampled_count(n, k, self.sample_ratio, self.min_samples, strict=False)
        m = self.capacity_factor * k
        return float(m * -math.expm1(passed * math.log1p(-1.0 / m))) if m > 1 else min(1.0, passed)

    def get_state(self):
        """``step``: the step counter, which seeds the next step's hash and sample.

        Returns:
          ``{name: numpy array}``.
        """
        return {"step": np.array([self.step], np.int64)}

    def set_state(self, state):
        """Restores the step counter (an empty state: step 0).

        Args:
          state: what :meth:`get_state` returned.
        """
        super().set_state(state)
        self.step = int(np.asarray(state["step"]).reshape(-1)[0]) if state else 0

    def __repr__(self):
        return (f"{type(self).__name__}(capacity_factor={self.capacity_factor}, sample_ratio={self.sample_ratio}, "
                f"min_samples={self.min_samples}, seed={self.seed}, small_density={self.small_density})")
