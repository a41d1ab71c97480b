"""Gaussian-k's threshold (:class:`GaussianKThreshold`, as described in oktopk-li2022 §2 and §5.4)."""
from __future__ import annotations

import numpy as np

from .. import _checks, traffic
from .base import COMPRESSORS, Compressor, _count_above, magnitudes, threshold_select


def _mean_std(acc: np.ndarray, chunk: int = 1 << 20) -> tuple[float, float]:
    """Mean and (population) standard deviation in float64, two passes over float64 chunks
    (``np.std(dtype=float64)`` would materialise a float64 copy of the whole gradient)."""
    n = acc.size
    if n == 0:
        return 0.0, 0.0
    traffic.count("select", read=4 * n + 4 * n + 8 * n, written=8 * n)  # the sum; float64 copies, their dot
    total = 0.0
    for i in range(0, n, chunk):
        total += float(np.sum(acc[i:i + chunk], dtype=np.float64))
    mu = total / n
    sq = 0.0
    for i in range(0, n, chunk):
        c = acc[i:i + chunk].astype(np.float64) - mu
        sq += float(np.dot(c, c))
    return mu, float(np.sqrt(sq / n))


@COMPRESSORS.register
class GaussianKThreshold(Compressor):
    """Gaussian-k threshold (Gaussiank, as described in oktopk-li2022 §2 and §5.4).

    "Gaussiank approximates the gradient values distribution to a Gaussian distribution with
    the same mean and standard deviation, and then estimates a threshold using the
    percent-point function and selects the values above the threshold" (§2).  With density
    ``rho = k / n``, mean ``mu`` and standard deviation ``sigma`` of ``acc``, the threshold on
    ``|acc|`` is the two-sided Gaussian quantile

        ``t = |mu| + sigma * ppf(1 - rho / 2)``

    (``ppf`` the standard normal percent-point function), i.e. the magnitude exceeded by a
    fraction ``rho`` of a N(mu, sigma^2) sample.  Because the Gaussian tail usually predicts
    too large a threshold (too few values), "we gradually scale the predicted threshold of
    Gaussiank until the number of selected values is more than 3k/4" (§5.4): while at most
    ``3k/4`` entries pass, ``t *= scale`` (at most ``max_adjust`` times).  Entries with
    ``|acc| > t`` are sent.  Overestimates of k are not corrected (§5.2).

    Args:
      scale: factor in (0, 1) applied to the threshold per adjustment step.
      max_adjust: most adjustment steps (0 disables the adjustment).
    """

    name = "gaussiank"
    ascending = True

    def __init__(self, scale: float = 0.9, max_adjust: int = 50):
        self.scale = _checks.real("scale", scale, 0.0, 1.0, lo_open=True, hi_open=True)
        self.max_adjust = _checks.integer("max_adjust", max_adjust, 0)
        self.last_threshold = None
        self.last_adjustments = 0

    @staticmethod
    def gaussian_threshold(acc: np.ndarray, k: int) -> float:
        """``|mu| + sigma * ppf(1 - k/(2n))`` of ``acc`` (before adjustment).

        Args:
          acc: the vector.
          k: the budget.

        Returns:
          The threshold, a float.
        """
        from statistics import NormalDist

        n = acc.size
        rho = min(1.0, max(k, 0) / n) if n else 1.0
        if rho >= 1.0:
            return 0.0
        mu, sigma = _mean_std(acc)
        return abs(mu) + sigma * NormalDist().inv_cdf(1.0 - rho / 2.0)

    def compress(self, acc, k, candidates=None):
        """``|acc| > t``, the Gaussian ``t`` scaled while at most ``3k/4`` pass (§5.4; fewer non-zeros: all).

        Args:
          acc: the offered vector.
          k: the budget the threshold aims at.
          candidates: ignored (it answers no prefilter).

        Returns:
          ``(indices, values)``: the entries above the threshold, indices ascending.
        """
        k = int(k)
        n = acc.size
        if k <= 0 or n == 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        t = self.gaussian_threshold(acc, k)
        mag = magnitudes(acc)
        need = 3 * k / 4
        adjustments = 0
        if np.isfinite(t) and t > 0:
            count = _count_above(mag, t)
            if count <= need and _count_above(mag, 0.0) <= need:
                t = 0.0  # fewer non-zeros than 3k/4: send every non-zero entry
            else:
                while count <= need and adjustments < self.max_adjust:
                    t *= self.scale
                    adjustments += 1
                    count = _count_above(mag, t)
        self.last_threshold = float(t)
        self.last_adjustments = adjustments
        idx = threshold_select(acc, t, strict=True, mag=mag)
        return idx, acc[idx]

    def __repr__(self):
        return f"{type(self).__name__}(scale={self.scale}, max_adjust={self.max_adjust})"
