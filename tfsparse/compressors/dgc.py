"""DGC's sampled threshold (:class:`DGCSampledThreshold`), the baseline dragonn-wang2022 compares
against."""
from __future__ import annotations

import numpy as np

from .. import _checks
from ..schedules import small_tensor_k
from .base import (COMPRESSORS, Compressor, check_small_density, magnitudes, sample_sizes, sampled_count,
                   threshold_select)
from .topk import topk_indices, topk_with_values

_M64 = (1 << 64) - 1


@COMPRESSORS.register
class DGCSampledThreshold(Compressor):
    """Deep Gradient Compression's sampled threshold (approximate top-k), as described in
    dragonn-wang2022 §2.3 and App. B (Alg. 3 "Existing approximate TopK GS"), with the
    threshold adaptation and truncation of the DGC baseline the DRAGONN authors run.

    "It first estimates the kth largest absolute value from a subset where each gradient in
    this set is uniformly sampled from the gradient tensor.  Next, DGC uses this approximate
    value as a threshold.  Only gradients with absolute values greater than this threshold
    [are] selected" (§2.3).  Concretely, with ``n`` elements and a budget ``k``:

    1. tensors of at most ``exact_below`` elements take the exact top-k (no estimate);
    2. draw ``s = max(ceil(sample_ratio * n), min(n, min_samples))`` positions uniformly
       (with replacement) and take ``|acc|`` there;
    3. ``t`` = the ``ceil(k * s / n)``-th largest sampled magnitude (the sample's estimate of
       the k-th largest magnitude of the whole tensor);
    4. select ``mask = |acc| > t`` (Alg. 3 line 1);
    5. adaptation (DGC's published implementation, which the DRAGONN authors' baseline
       keeps): while the count is outside ``[lower * k, upper * k]`` = ``[k, 1.3k]`` the
       threshold is divided (too many) or multiplied (too few) by ``adapt_factor`` = 0.9 and
       the mask recomputed, at most ``adapt_iters`` = 10 times;
    6. truncation: more than ``k`` entries left are cut to exactly ``k`` -- ``"largest"``
       keeps the ``k`` of largest magnitude (DGC's own code re-selects the top-k among the
       candidates), ``"first"`` the ``k`` lowest positions (the DRAGONN authors' baseline,
       ``indices[:num_selects]``).  The cut entries stay in the residual.

    ``adapt_iters=0, truncate=None, exact_below=0`` is the plain Alg. 3 of the paper (only
    approximately ``k`` entries).  The seeds do not fix the sample size; ``sample_ratio=0.01``
    is the 1% that DGC samples, and ``min_samples`` keeps the estimate meaningful on small
    tensors (when ``s >= n`` every element is used and the threshold is exact).

    Args:
      sample_ratio: fraction of the elements sampled, in (0, 1].
      min_samples: lower bound on the sample size (capped at ``n``).
      seed: seed of this compressor's random generator (None: fresh OS entropy).
      adapt_iters: most threshold adaptation steps (>= 0; default 10).
      lower: the accepted count range is ``[lower * k, upper * k]`` (default 1.0).
      upper: see ``lower`` (default 1.3).
      adapt_factor: threshold factor per adaptation step, in (0, 1) (default 0.9).
      truncate: ``"largest"`` (default), ``"first"`` or None (no cut).
      exact_below: tensors of at most this many elements take the exact top-k (default
        16384, the DRAGONN authors' DGC baseline; 0: never).
      small_density: None (default: the requested k everywhere) or the density the authors'
        code gives every tensor of at most 131072 elements (their 0.01, whatever the requested
        density -- it changes what small tensors send).
    """

    name = "dgc"
    ascending = True
    TRUNCATE = ("largest", "first", None)

    def __init__(self, sample_ratio: float = 0.01, min_samples: int = 1024, seed=None, *, adapt_iters: int = 10,
                 lower: float = 1.0, upper: float = 1.3, adapt_factor: float = 0.9, truncate="largest",
                 exact_below: int = 16384, small_density: float | None = None):
        self.small_density = check_small_density(small_density)
        self.sample_ratio = _checks.real("sample_ratio", sample_ratio, 0.0, 1.0, lo_open=True)
        self.min_samples = _checks.integer("min_samples", min_samples, 1)
        self.seed = None if seed is None else _checks.integer("seed", seed, 0, hint=" or None")
        self.adapt_iters = _checks.integer("adapt_iters", adapt_iters, 0)
        self.lower = _checks.real("lower", lower, 0.0, lo_open=True)
        self.upper = _checks.real("upper", upper, self.lower, lo_open=True)
        self.adapt_factor = _checks.real("adapt_factor", adapt_factor, 0.0, 1.0, lo_open=True, hi_open=True)
        self.truncate = _checks.choice("truncate", truncate, self.TRUNCATE)
        self.exact_below = _checks.integer("exact_below", exact_below, 0)
        self._rng = np.random.default_rng(seed)
        self.last_threshold = None
        self.last_adaptations = 0

    def get_state(self) -> dict:
        """The sampler's PCG64 state as six uint64 words (state and increment, 128 bits
        each, then the buffered 32-bit half): drawing resumes exactly where it stopped.

        Returns:
          ``{name: numpy array}``.
        """
        st = self._rng.bit_generator.state
        words = []
        for big in (st["state"]["state"], st["state"]["inc"]):
            words += [big >> 64, big & _M64]
        words += [st["has_uint32"], st["uinteger"]]
        return {"rng": np.array(words, dtype=np.uint64)}

    def set_state(self, state: dict) -> None:
        """Restores :meth:`get_state`'s sampler words; an empty state restarts the generator from ``seed``.

        Args:
          state: what :meth:`get_state` returned.

        Raises:
          ValueError: a non-empty state that does not hold six words.
        """
        super().set_state(state)
        if not state:  # nothing saved: start afresh, from the seed
            self._rng = np.random.default_rng(self.seed)
            return
        w = [int(v) for v in np.asarray(state["rng"], dtype=np.uint64).reshape(-1)]
        if len(w) != 6:
            raise ValueError(f"DGC sampler state must hold 6 words, got {len(w)}")
        self._rng.bit_generator.state = {"bit_generator": "PCG64",
                                         "state": {"state": (w[0] << 64) | w[1], "inc": (w[2] << 64) | w[3]},
                                         "has_uint32": w[4], "uinteger": w[5]}

    def threshold(self, acc: np.ndarray, k: int) -> float:
        """The sampled estimate of the k-th largest ``|acc|``.

        Args:
          acc: the vector.
          k: the budget.

        Returns:
          The threshold, a float.
        """
        n = acc.size
        if k <= 0 or n == 0:
            return float("inf")
        s, ks = sample_sizes(n, k, self.sample_ratio, self.min_samples)
        if s >= n:
            sample = np.abs(acc)
        else:
            sample = np.abs(acc[self._rng.integers(0, n, size=s)])
        return float(np.partition(sample, s - ks)[s - ks])

    def compress(self, acc, k, candidates=None):
        """Steps 1-6 of the class docstring: sampled threshold, adaptation, truncation (``k >= n``: the non-zeros).

        Args:
          acc: the offered vector.
          k: the budget: the threshold is adapted toward ``[lower·k, upper·k]`` (where ``adapt_iters > 0``)
            and the result cut to ``k`` (where ``truncate`` is set).
          candidates: ignored (it answers no prefilter).

        Returns:
          ``(indices, values)``: indices ascending (the truncation keeps their order).
        """
        k = small_tensor_k(acc.size, int(k), self.small_density)
        if k <= 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        if k >= acc.size:  # density 1: everything (non-zero) is sent, no estimate needed
            idx = threshold_select(acc, 0.0)
            self.last_threshold, self.last_adaptations = 0.0, 0
            return idx, acc[idx]
        if acc.size <= self.exact_below:
            self.last_threshold, self.last_adaptations = None, 0
            return topk_with_values(acc, k)
        t = self.threshold(acc, k)
        mag = magnitudes(acc)
        idx = threshold_select(acc, t, strict=True, mag=mag)
        adaptations = 0
        while adaptations < self.adapt_iters and np.isfinite(t) and t > 0:
            if idx.size > self.upper * k:
                t /= self.adapt_factor
            elif idx.size < self.lower * k:
                t *= self.adapt_factor
            else:
                break
            adaptations += 1
            idx = threshold_select(acc, t, strict=True, mag=mag)
        self.last_threshold, self.last_adaptations = t, adaptations
        if self.truncate is not None and idx.size > k:
            idx = idx[:k] if self.truncate == "first" else idx[topk_indices(acc[idx], k)]
        return idx, acc[idx]

    def expected_count(self, n, k):
        """The exact top-k (``k``) for tensors of at most ``exact_below`` elements; otherwise the
        sampled threshold's expected count (:func:`sampled_count`, strictly above it), moved into
        ``[lower k, upper k]`` by the adaptation (assumed to succeed when ``adapt_iters > 0``) and
        cut to ``k`` by the truncation -- ``k`` with the defaults.

        Args:
          n: the tensor's elements.
          k: the budget.

        Returns:
          The expected count, a float (``k`` with the defaults).
        """
        k = small_tensor_k(n, int(k), self.small_density)
        if n <= self.exact_below or k >= n:
            return float(min(k, n))
        count = sampled_count(n, k, self.sample_ratio, self.min_samples, strict=True)
        if self.adapt_iters > 0:
            count = min(max(count, self.lower * k), self.upper * k)
        if self.truncate is not None:
            count = min(count, k)
        return float(count)

    def __repr__(self):
        return (f"{type(self).__name__}(sample_ratio={self.sample_ratio}, min_samples={self.min_samples}, "
                f"seed={self.seed}, adapt_iters={self.adapt_iters}, lower={self.lower}, upper={self.upper}, "
                f"adapt_factor={self.adapt_factor}, truncate={self.truncate!r}, exact_below={self.exact_below}, "
                f"small_density={self.small_density})")
