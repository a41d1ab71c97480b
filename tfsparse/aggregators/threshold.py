"""Threshold-selection baselines aggregated by allgather (TopkA-style, oktopk-li2022 §2,
Table 1): the payload is chosen by an *estimated* threshold instead of an exact top-k, the
(index, value) pairs are all-gathered and summed.  Volume per rank ``2k'(P-1)`` elements,
``k'`` the number of entries actually selected (only approximately k).

* ``dgc`` -- Deep Gradient Compression's sampled threshold (dragonn-wang2022 §2.3, App. B
  Alg. 3): :class:`~tfsparse.compressors.DGCSampledThreshold`.
* ``gaussiank`` -- Gaussian-k (oktopk-li2022 §2, threshold adjustment of §5.4):
  :class:`~tfsparse.compressors.GaussianKThreshold`.

Schedule: topk's (:meth:`~tfsparse.aggregators.topk.AllgatherAggregator.schedule`) with the
compressor's *expected* selection size: DGC's sampled threshold (the ``ks``-th largest of ``s``
samples leaves a fraction ``ks/(s+1)`` of the gradient above it; exact -- ``k-1`` strictly above
-- when every element is sampled), moved into ``[k, 1.3k]`` by the adaptation and cut to ``k``
(so ``k`` with the defaults); Gaussian-k's ``k`` (its threshold is the Gaussian quantile of
density ``k/n``).

``contributed`` is the selected payload: every selected value goes into the global sum, so
``applied + residuals == raw gradients``.
"""
from __future__ import annotations

from ..compressors import DGCSampledThreshold, GaussianKThreshold
from .base import reject_unknown_options
from .registry import register
from .topk import AllgatherAggregator


@register("dgc")
class DGCAllgather(AllgatherAggregator):
    """DGC sampled-threshold selection + allgather (dragonn-wang2022 §2.3, App. B), with the
    threshold adaptation toward ``[k, 1.3k]``, the truncation to exactly ``k`` and the exact
    top-k of small tensors of DGC's published implementation (see
    :class:`~tfsparse.compressors.DGCSampledThreshold`).

    Args:
      sample_ratio: fraction of the gradient sampled to estimate the k-th largest magnitude
        (default 0.01, DGC's 1%).
      min_samples: lower bound on the sample size (default 1024; capped at n).
      seed: seed of the sampler (None: fresh entropy per instance).
      adapt_iters: the threshold adaptation: at most this many steps (default 10) ...
      lower: ... until the count is at least ``lower · k`` (default 1.0) ...
      upper: ... and at most ``upper · k`` (default 1.3) ...
      adapt_factor: ... multiplying or dividing the threshold by this factor (default 0.9).
      truncate: ``"largest"`` (default: the k largest candidates, DGC's code), ``"first"``
        (the k lowest positions, the DRAGONN authors' DGC baseline) or None.
      exact_below: tensors of at most this many elements take the exact top-k (default 16384).
      small_density: None, or the density the DRAGONN authors' baseline gives every tensor of at
        most 131072 elements (their 0.01, whatever ``density`` says).
      **unknown: any other keyword is refused (ValueError naming the accepted options).

    State (``get_state``): the sampler's random generator, so a resumed run draws the same
    samples as an uninterrupted one.

    Momentum correction (DGC §3.2) is the exchange's ``memory="momentum"``; local gradient
    clipping (DGC §3.3) its ``clip_norm``.
    """

    OPTIONS = ("sample_ratio", "min_samples", "seed", "adapt_iters", "lower", "upper", "adapt_factor",
               "truncate", "exact_below", "small_density")

    def __init__(self, sample_ratio: float = 0.01, min_samples: int = 1024, seed=None, adapt_iters: int = 10,
                 lower: float = 1.0, upper: float = 1.3, adapt_factor: float = 0.9, truncate="largest",
                 exact_below: int = 16384, small_density: float | None = None, **unknown):
        reject_unknown_options("dgc", unknown, self.OPTIONS)
        super().__init__(compressor=DGCSampledThreshold(
            sample_ratio=sample_ratio, min_samples=min_samples, seed=seed, adapt_iters=adapt_iters, lower=lower,
            upper=upper, adapt_factor=adapt_factor, truncate=truncate, exact_below=exact_below,
            small_density=small_density))


@register("gaussiank")
class GaussianKAllgather(AllgatherAggregator):
    """Gaussian-k threshold selection + allgather (oktopk-li2022 §2 and §5.4).

    Args:
      scale: factor applied to the Gaussian threshold while at most 3k/4 entries pass
        (default 0.9).
      max_adjust: most adjustment steps (default 50; 0 = pure Gaussian threshold).
      **unknown: any other keyword is refused (ValueError naming the accepted options).
    """

    def __init__(self, scale: float = 0.9, max_adjust: int = 50, **unknown):
        reject_unknown_options("gaussiank", unknown, ("scale", "max_adjust"))
        super().__init__(compressor=GaussianKThreshold(scale=scale, max_adjust=max_adjust))
