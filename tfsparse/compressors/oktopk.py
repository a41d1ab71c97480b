"""Ok-Topk's reused local threshold (:class:`ReusedThreshold`, oktopk-li2022 §3.1.3) and its helpers."""
from __future__ import annotations

import numpy as np

from .. import _checks
from .base import COMPRESSORS, Candidates, Compressor, Prefilter, threshold_select
from .topk import topk_prefilter


# -- Ok-Topk's reused local threshold (oktopk-li2022 §3.1.3) --------------------------------

def kth_largest_magnitude(values: np.ndarray, k: int, candidates: Candidates | None = None) -> float:
    """The exact k-th largest ``|values|`` (the "accurate threshold", §3.1.3); 0.0 when there
    are at most k values (then every non-zero value passes, also on the steps that reuse it).
    ``candidates`` (of ``values``): taken from them when they hold at least ``k``.

    Args:
      values: the vector.
      k: the rank of the magnitude.
      candidates: the :class:`~tfsparse.compressors.Candidates` of a fused pass, or None.

    Returns:
      The magnitude, a float (``inf`` for ``k <= 0``: nothing passes).
    """
    from .. import ops

    m = values.size
    if k <= 0:
        return float("inf")
    if m <= k:
        return 0.0
    if candidates is not None and candidates.idx.size >= k:
        from ..ops import _common as C, cpu

        return float(C.key_to_float(cpu.kth_key(cpu.keys_of(candidates.val), k)))
    return float(ops.kth_largest_abs(values, k))  # one radix select, no sort (NaN > Inf > finite)


def select_local(acc: np.ndarray, threshold: float, candidates: Candidates | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, values)`` of ``|acc| >= threshold``, indices ascending (NaN entries always
    pass); a non-positive threshold selects the non-zero entries.  One pass, no temporaries, for
    a positive one; none with ``candidates`` collected at or below the threshold.

    Args:
      acc: the vector.
      threshold: the magnitude to reach.
      candidates: the :class:`~tfsparse.compressors.Candidates` of a fused pass, or None.

    Returns:
      ``(indices, values)``.
    """
    from .. import ops
    from ..ops import _common as C

    if threshold > 0.0:
        key = C.threshold_key(threshold)
        if candidates is not None and key >= candidates.key:
            return candidates.at_least(key)
        return ops.select_threshold(acc, threshold)
    idx = threshold_select(acc, threshold, strict=False)
    return idx, acc[idx]


def check_factor(name, value, default) -> float:
    """One of the Ok-Topk authors' threshold adjustment factors (>= 1).

    Args:
      name: the option's name.
      value: its value, a number >= 1 (1.0 turns the adjustment off).
      default: the authors' value, named in the error.

    Returns:
      The factor, a float >= 1.

    Raises:
      ValueError: any other value.
    """
    return _checks.real(name, value, 1.0, hint=(
        f" (the authors' threshold adjustment factor; default {default}, 1.0 turns it off)"))


def adjusted_threshold(threshold, count, k, high, factor):
    """The next step's threshold: ÷ ``factor`` below ``2k/3`` entries, × above ``high * k``.

    Args:
      threshold: this step's threshold.
      count: the entries it selected.
      k: the budget.
      high: the upper bound, in units of ``k``.
      factor: the adjustment factor.

    Returns:
      The threshold, a float (a None ``threshold`` is returned as it is).
    """
    if factor == 1.0 or k <= 0 or threshold is None or not 0.0 < threshold < np.inf:
        return threshold
    if count < 2 * k / 3:
        return threshold / factor
    if count > high * k:
        return threshold * factor
    return threshold


@COMPRESSORS.register
class ReusedThreshold(Compressor):
    """Ok-Topk's local selection (oktopk-li2022 §3.1.3; Alg. 1 lines 2-4): the entries with
    ``|acc| >= threshold``, where the threshold is re-evaluated -- the exact k-th largest
    ``|acc|`` -- when :attr:`threshold` is None and reused otherwise.  Its aggregator
    (:class:`~tfsparse.aggregators.oktopk.OkTopkAllreduce`) decides when: it clears
    :attr:`threshold` every ``tau_prime`` steps and whenever ``k`` or the layout changes.

    Between re-evaluations the Ok-Topk authors' adjustment (not in the paper) keeps the count
    near ``k``: ``local_raise`` (1.03) -- on a reuse step the threshold is multiplied by it while
    more than ``4k/3`` entries pass (evaluated over the entries passing the unraised threshold,
    no extra pass over the gradient); ``local_adjust`` (1.012) -- the threshold kept for the next
    call is divided by it below ``2k/3`` entries and multiplied above ``5k/4``.  1.0 turns a rule
    off.

    State: :attr:`threshold`, the one the next call starts from (None: re-evaluate);
    :attr:`last_threshold` is the one the last call used.

    Args:
      local_raise: the factor a reused threshold is raised by (>= 1; the authors' 1.03).
      local_adjust: the factor of the adjustment for the next step (>= 1; the authors' 1.012).
    """

    name = "oktopk"
    ascending = True
    standalone = False  # only Ok-Topk's aggregator clears the threshold for re-evaluation

    def __init__(self, local_raise: float = 1.03, local_adjust: float = 1.012):
        self.local_raise = check_factor("local_raise", local_raise, 1.03)
        self.local_adjust = check_factor("local_adjust", local_adjust, 1.012)
        self.threshold = None
        self.last_threshold = None

    def prefilter(self, n, k, peek, fresh: bool | None = None):
        """What the next :meth:`compress` reads: on a re-evaluation step (``fresh``; default: no
        threshold kept) the exact top-k's candidates (:func:`topk_prefilter`), else every element
        at or above the kept threshold (a raised one passes a subset).

        Args:
          n: the vector's elements.
          k: the budget.
          peek: reads the exact top-k's sample ahead of the pass (on a re-evaluation step).
          fresh: whether the next call re-evaluates; None: where no threshold is kept.

        Returns:
          A :class:`~tfsparse.compressors.Prefilter`, or None.
        """
        from ..ops import _common as C

        if fresh is None:
            fresh = self.threshold is None
        if fresh:
            return topk_prefilter(n, k, peek) if n > k > 0 else None
        return Prefilter(C.threshold_key(self.threshold)) if k > 0 and self.threshold > 0.0 else None

    def compress(self, acc, k, candidates=None):
        """``|acc| >= threshold`` (the exact k-th largest where none is kept), raised and adjusted as the class says.

        Args:
          acc: the offered vector.
          k: the budget (the re-evaluated threshold is the k-th largest ``|acc|``).
          candidates: the fused pass's collection for :meth:`prefilter`'s answer, or None.

        Returns:
          ``(indices, values)``: indices ascending.
        """
        fresh = self.threshold is None
        if fresh:
            self.threshold = kth_largest_magnitude(acc, k, candidates)
        if k > 0:
            idx, val = select_local(acc, self.threshold, candidates)
        else:
            idx, val = np.empty(0, np.int64), np.empty(0, np.float32)
        limit = 4 * k / 3
        if not fresh and idx.size > limit and self.local_raise > 1.0 and self.threshold > 0.0:
            self.threshold, idx, val = self._raised(idx, val, limit)
        self.last_threshold = self.threshold
        self.threshold = adjusted_threshold(self.threshold, idx.size, k, 5 / 4, self.local_adjust)
        return idx, val

    def _raised(self, idx, val, limit):
        """The authors' ``threshold *= local_raise while count(|acc| >= threshold) > limit``,
        evaluated over the selected ``(idx, val)`` (a raised threshold passes a subset).  NaN
        entries always pass, so the loop also stops once the threshold exceeds every finite
        magnitude.  Returns the raised threshold and the entries that pass it."""
        threshold = self.threshold
        mag = np.abs(val)
        finite = mag[np.isfinite(mag)]
        top = float(finite.max()) if finite.size else 0.0
        passing = ~(mag < threshold)
        while np.count_nonzero(passing) > limit and threshold <= top:
            threshold *= self.local_raise
            passing = ~(mag < threshold)
        return threshold, idx[passing], val[passing]

    def get_state(self):
        """``threshold``: the one the next call starts from (NaN: none, re-evaluate).

        Returns:
          ``{name: numpy array}``.
        """
        return {"threshold": np.array([np.nan if self.threshold is None else self.threshold], np.float64)}

    def set_state(self, state):
        """Restores the kept threshold (NaN or an empty state: None, re-evaluate).

        Args:
          state: what :meth:`get_state` returned.
        """
        super().set_state(state)
        t = float(np.asarray(state["threshold"], np.float64).reshape(-1)[0]) if state else float("nan")
        self.threshold = None if np.isnan(t) else t

    def __repr__(self):
        return f"{type(self).__name__}(local_raise={self.local_raise}, local_adjust={self.local_adjust})"
