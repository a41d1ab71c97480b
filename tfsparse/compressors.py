"""Compressors decide *what* a rank sends: a sparse (indices, values) payload of its
accumulated gradient (GRACE's "compressor" part).

Each compressor maps ``acc`` (float32, 1-D: gradient + residual) and a budget ``k``
to ``(indices, values)`` with ``indices`` int64 and ascending, and says how many entries it
expects to send (:meth:`Compressor.expected_count`: what the α-β schedule of an aggregator that
sends its payload prices, :mod:`tfsparse.timing`).  Every aggregator that selects locally
selects through one (``aggregator.compressor``).
"""
from __future__ import annotations

import math

import numpy as np

from . import _checks, traffic
from ._registry import Registry
from .schedules import small_tensor_k
from .state import Stateful

_M64 = (1 << 64) - 1


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
        from .ops import cpu

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


def topk_indices(acc: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the ``k`` entries of largest ``|acc|`` (exact selection).

    Runs the Numba selection kernel :func:`tfsparse.ops.topk_abs` (sample + radix select,
    no sort).  Ties at the k-th magnitude go to the lowest index (on both paths), so the
    selection is a function of the values alone -- the 16-bit wires make ties common.
    NaN compares larger than any number, so non-finite gradients are always sent
    (and show up in the result instead of hiding in the residual).
    """
    idx, _ = topk_with_values(acc, k)
    return idx


def topk_with_values(acc, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, acc[indices])`` of :func:`topk_indices`; a CUDA device ``acc`` is selected on
    the device (:func:`tfsparse.ops.topk_abs`, the same indices) and only the payload comes back."""
    from . import ops

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
        # once, their k-th largest by a two-pass 16-bit histogram select (``ops._cpu_select._kth_key``;
        # measured, one core: 342K keys 0.30 ms, 17M 18 ms, against 2.9 and 190 ms for numpy's
        # introselect); the kernel's ordered pass then takes every larger one and the
        # lowest-index ties, with no sort (the same indices as numpy's masks and sort)
        from .ops import cpu

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
    another path (``k`` above ``n / 64``, small vectors)."""
    from .ops import cpu

    plan = cpu.prefilter_plan(n, k) if 0 < k <= n // 16 else None
    if plan is None:
        return None
    positions, rank = plan
    return Prefilter(cpu.kth_key(cpu.keys_of(peek(positions)), rank))


def topk_of(acc, k: int, candidates: Candidates | None):
    """:func:`topk_with_values`, from ``candidates`` when they hold at least ``k`` elements."""
    if candidates is not None:
        from .ops import cpu

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
        """The exact top-k (:func:`topk_with_values`), taken among ``candidates`` when they hold at least ``k``."""
        return topk_of(acc, k, candidates)

    def prefilter(self, n, k, peek):
        return topk_prefilter(n, k, peek)


@COMPRESSORS.register
class Identity(Compressor):
    """Sends everything (dense)."""

    name = "identity"
    ascending = True

    def compress(self, acc, k, candidates=None):
        """Every index ``0 .. n-1`` and a copy of ``acc``."""
        return np.arange(acc.size, dtype=np.int64), acc.copy()

    def expected_count(self, n, k):
        """``n``: every element, whatever ``k``."""
        return n


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
        each, then the buffered 32-bit half): drawing resumes exactly where it stopped."""
        st = self._rng.bit_generator.state
        words = []
        for big in (st["state"]["state"], st["state"]["inc"]):
            words += [big >> 64, big & _M64]
        words += [st["has_uint32"], st["uinteger"]]
        return {"rng": np.array(words, dtype=np.uint64)}

    def set_state(self, state: dict) -> None:
        """Restores :meth:`get_state`'s sampler words; an empty state restarts the generator from ``seed``."""
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
        """The sampled estimate of the k-th largest ``|acc|``."""
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
        """Steps 1-6 of the class docstring: sampled threshold, adaptation, truncation (``k >= n``: the non-zeros)."""
        k = small_tensor_k(acc.size, int(k), self.small_density)
        if k <= 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        if k >= acc.size:  # density 1: everything (non-zero) is sent, no estimate needed
            idx = threshold_select(acc, 0.0)
            self.last_threshold = 0.0
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
        cut to ``k`` by the truncation -- ``k`` with the defaults."""
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


_SMALLEST_POSITIVE = float(np.nextafter(np.float32(0.0), np.float32(1.0)))


@COMPRESSORS.register
class HashedThreshold(Compressor):
    """DRAGONN's hashing-based index extraction (dragonn-wang2022 §3.2, Alg. 1), per step:

    1. the threshold ``t``: DGC's sampled estimate of the k-th largest ``|acc|`` (a
       ``sample_ratio`` sample, :func:`tfsparse.ops.sample_threshold`), the exact k-th largest
       (:func:`tfsparse.ops.kth_largest_abs`) when fewer than ``min_samples`` would be drawn;
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
        """The seed of step ``step`` (default: the next one) -- the same on every rank."""
        return self.seed * 2**32 + (self.step if step is None else int(step))

    def threshold(self, acc: np.ndarray, k: int, seed: int) -> float:
        """DGC's sampled estimate of the k-th largest ``|acc|`` (exact for small tensors)."""
        from . import ops

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
        collects exactly what the hash table takes (every element at or above it)."""
        from .ops import _common as C, cpu

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
        """Alg. 1 with this step's seed (the step counter then advances): threshold, hash table, survivors."""
        from . import ops

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
            from .ops import _common as C, cpu

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
        keep one (balls into bins; dragonn-wang2022 App. A.2) -- about ``0.89 k`` for ``m = 4k``."""
        k = small_tensor_k(n, int(k), self.small_density)
        if k >= n:
            return float(n)
        passed = sampled_count(n, k, self.sample_ratio, self.min_samples, strict=False)
        m = self.capacity_factor * k
        return float(m * -math.expm1(passed * math.log1p(-1.0 / m))) if m > 1 else min(1.0, passed)

    def get_state(self):
        """``step``: the step counter, which seeds the next step's hash and sample."""
        return {"step": np.array([self.step], np.int64)}

    def set_state(self, state):
        """Restores the step counter (an empty state: step 0)."""
        super().set_state(state)
        self.step = int(np.asarray(state["step"]).reshape(-1)[0]) if state else 0

    def __repr__(self):
        return (f"{type(self).__name__}(capacity_factor={self.capacity_factor}, sample_ratio={self.sample_ratio}, "
                f"min_samples={self.min_samples}, seed={self.seed}, small_density={self.small_density})")


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
        """``|mu| + sigma * ppf(1 - k/(2n))`` of ``acc`` (before adjustment)."""
        from statistics import NormalDist

        n = acc.size
        rho = min(1.0, max(k, 0) / n) if n else 1.0
        if rho >= 1.0:
            return 0.0
        mu, sigma = _mean_std(acc)
        return abs(mu) + sigma * NormalDist().inv_cdf(1.0 - rho / 2.0)

    def compress(self, acc, k, candidates=None):
        """``|acc| > t``, the Gaussian ``t`` scaled while at most ``3k/4`` pass (§5.4; fewer non-zeros: all)."""
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


# -- Ok-Topk's reused local threshold (oktopk-li2022 §3.1.3) --------------------------------

def kth_largest_magnitude(values: np.ndarray, k: int, candidates: Candidates | None = None) -> float:
    """The exact k-th largest ``|values|`` (the "accurate threshold", §3.1.3); 0.0 when there
    are at most k values (then every non-zero value passes, also on the steps that reuse it).
    ``candidates`` (of ``values``): taken from them when they hold at least ``k``."""
    from . import ops

    m = values.size
    if k <= 0:
        return float("inf")
    if m <= k:
        return 0.0
    if candidates is not None and candidates.idx.size >= k:
        from .ops import _common as C, cpu

        return float(C.key_to_float(cpu.kth_key(cpu.keys_of(candidates.val), k)))
    return float(ops.kth_largest_abs(values, k))  # one radix select, no sort (NaN > Inf > finite)


def select_local(acc: np.ndarray, threshold: float, candidates: Candidates | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, values)`` of ``|acc| >= threshold``, indices ascending (NaN entries always
    pass); a non-positive threshold selects the non-zero entries.  One pass, no temporaries, for
    a positive one; none with ``candidates`` collected at or below the threshold."""
    from . import ops
    from .ops import _common as C

    if threshold > 0.0:
        key = C.threshold_key(threshold)
        if candidates is not None and key >= candidates.key:
            return candidates.at_least(key)
        return ops.select_threshold(acc, threshold)
    idx = threshold_select(acc, threshold, strict=False)
    return idx, acc[idx]


def check_factor(name, value, default) -> float:
    """One of the Ok-Topk authors' threshold adjustment factors (>= 1)."""
    return _checks.real(name, value, 1.0, hint=(
        f" (the authors' threshold adjustment factor; default {default}, 1.0 turns it off)"))


def adjusted_threshold(threshold, count, k, high, factor):
    """The next step's threshold: ÷ ``factor`` below ``2k/3`` entries, × above ``high * k``."""
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
        at or above the kept threshold (a raised one passes a subset)."""
        from .ops import _common as C

        if fresh is None:
            fresh = self.threshold is None
        if fresh:
            return topk_prefilter(n, k, peek) if n > k > 0 else None
        return Prefilter(C.threshold_key(self.threshold)) if k > 0 and self.threshold > 0.0 else None

    def compress(self, acc, k, candidates=None):
        """``|acc| >= threshold`` (the exact k-th largest where none is kept), raised and adjusted as the class says."""
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
        """``threshold``: the one the next call starts from (NaN: none, re-evaluate)."""
        return {"threshold": np.array([np.nan if self.threshold is None else self.threshold], np.float64)}

    def set_state(self, state):
        """Restores the kept threshold (NaN or an empty state: None, re-evaluate)."""
        super().set_state(state)
        t = float(np.asarray(state["threshold"], np.float64).reshape(-1)[0]) if state else float("nan")
        self.threshold = None if np.isnan(t) else t

    def __repr__(self):
        return f"{type(self).__name__}(local_raise={self.local_raise}, local_adjust={self.local_adjust})"


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
