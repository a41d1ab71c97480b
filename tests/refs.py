"""Independent numpy references of the aggregators' semantics, computed from all ranks' inputs.

Used by tests/test_aggregators.py (in-process worlds) and tests/test_aggregators_mpi.py
(real mpirun).  Written without the aggregators' code paths: plain dense arithmetic and
dictionaries, so a shared bug does not hide.
"""
from __future__ import annotations

from statistics import NormalDist

import numpy as np


def exact_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x| (ascending), by a full sort (not argpartition)."""
    if k <= 0:
        return np.empty(0, np.int64)
    order = np.argsort(-np.abs(x.astype(np.float64)), kind="stable")
    return np.sort(order[:k]).astype(np.int64)


def dense_ref(accs):
    return np.sum(np.stack(accs).astype(np.float64), axis=0)


def topk_allgather_ref(accs, k):
    """TopKAllReduce: Σ_i Topk(G_i) (gtopk-ssgd-shi2019 Alg. 1 lines 12-21)."""
    out = np.zeros(accs[0].size, np.float64)
    for a in accs:
        idx = exact_topk(a, k)
        out[idx] += a[idx]
    return out


def gtopk_tree_ref(accs, k):
    """gTopKAllReduce's reduction tree with provenance.

    Returns ``(result_dense, lost)`` where ``lost[r]`` is a dense vector of rank r's local
    top-k values that Alg. 4 line 10 removes from r's residual (index in the global result)
    although they did not reach the result (dropped by an intermediate ⊤).
    """
    P = len(accs)
    n = accs[0].size
    local = [exact_topk(a, k) for a in accs]
    # a sparse vector: {index: (value, frozenset of contributing ranks)}
    vecs = [{int(i): (float(np.float32(accs[r][i])), frozenset([r])) for i in local[r]} for r in range(P)]

    def merge(a, b):
        keys = sorted(set(a) | set(b))
        summed = {}
        for i in keys:
            va, ra = a.get(i, (0.0, frozenset()))
            vb, rb = b.get(i, (0.0, frozenset()))
            summed[i] = (float(np.float32(np.float32(va) + np.float32(vb))), ra | rb)
        mags = np.array([abs(summed[i][0]) for i in keys])
        order = np.argsort(-mags, kind="stable")[:k]
        return {keys[j]: summed[keys[j]] for j in order}

    p2 = 1
    while p2 * 2 <= P:
        p2 *= 2
    for i in range(P - p2):  # fold the surplus ranks first
        vecs[i] = merge(vecs[p2 + i], vecs[i])
    step = 1
    while step < p2:
        for r in range(0, p2, 2 * step):
            vecs[r] = merge(vecs[r + step], vecs[r])
        step *= 2
    final = vecs[0]
    result = np.zeros(n, np.float64)
    lost = [np.zeros(n, np.float64) for _ in range(P)]
    for i, (v, ranks) in final.items():
        result[i] = v
    for r in range(P):
        for i in local[r]:
            i = int(i)
            if i in final and r not in final[i][1]:
                lost[r][i] = accs[r][i]
    return result, lost


def oktopk_ref(accs, k, local_thresholds=None, global_threshold=None):
    """Topk(Σ_i Topk(G_i)) (oktopk-li2022 §3.1).  With thresholds given, the selections are
    ``|G_i| >= local_thresholds[i]`` and ``|Σ| >= global_threshold`` (a reuse step, §3.1.3);
    otherwise both are exact top-k.  Returns (result_dense, local selections)."""
    n = accs[0].size
    total = np.zeros(n, np.float64)
    touched = np.zeros(n, bool)
    sels = []
    for r, a in enumerate(accs):
        if local_thresholds is None:
            sel = exact_topk(a, k)
        else:
            th = local_thresholds[r]
            sel = np.flatnonzero(np.abs(a) >= th) if th > 0 else np.flatnonzero(a != 0)
        sels.append(sel)
        total[sel] += a[sel]
        touched[sel] = True
    cand = np.flatnonzero(touched)
    if global_threshold is None:
        keep = cand[exact_topk(total[cand], k)] if cand.size > k else cand
    elif global_threshold > 0:
        keep = cand[np.abs(total[cand]) >= global_threshold]
    else:
        keep = cand
    out = np.zeros(n, np.float64)
    out[keep] = total[keep]
    return out, sels


def gaussiank_selection(a, k, scale=0.9, max_adjust=50):
    """Gaussian-k (oktopk-li2022 §2, §5.4): ``|a| > |mu| + sigma * ppf(1 - k/2n)``, the
    threshold scaled by ``scale`` while at most 3k/4 entries pass."""
    n = a.size
    a64 = a.astype(np.float64)
    t = abs(a64.mean()) + a64.std() * NormalDist().inv_cdf(1 - (k / n) / 2)
    mag = np.abs(a)
    if np.count_nonzero(mag > 0) <= 3 * k / 4 and np.count_nonzero(mag > t) <= 3 * k / 4:
        return np.flatnonzero(mag > 0)
    it = 0
    while np.count_nonzero(mag > t) <= 3 * k / 4 and it < max_adjust:
        t *= scale
        it += 1
    return np.flatnonzero(mag > t)


def dgc_selection(a, k, rng, sample_ratio=0.01, min_samples=1024, adapt_iters=10, lower=1.0, upper=1.3,
                  adapt_factor=0.9, truncate="largest", exact_below=16384):
    """DGC (dragonn-wang2022 §2.3, App. B Alg. 3): threshold = the estimated k-th largest |a|
    from a uniform sample (drawn from ``rng`` exactly as the compressor does); select |a| > t;
    then DGC's published adaptation (÷/× adapt_factor until the count is in [lower k, upper k])
    and truncation to k (the largest, or the first positions); exact top-k for small tensors."""
    n = a.size
    mag = np.abs(a)
    if n <= exact_below:
        return np.sort(np.argsort(-mag, kind="stable")[:k])
    s = int(max(np.ceil(sample_ratio * n), min(n, min_samples)))
    sample = mag if s >= n else mag[rng.integers(0, n, size=s)]
    ks = int(min(s, max(1, np.ceil(k * s / n))))
    t = float(np.sort(sample)[::-1][ks - 1])
    sel = np.flatnonzero(mag > t)
    for _ in range(adapt_iters):
        if sel.size > upper * k:
            t /= adapt_factor
        elif sel.size < lower * k:
            t *= adapt_factor
        else:
            break
        sel = np.flatnonzero(mag > t)
    if truncate is not None and sel.size > k:
        sel = sel[:k] if truncate == "first" else np.sort(sel[np.argsort(-mag[sel], kind="stable")[:k]])
    return sel


def dragonn_selection(a, k, step, capacity_factor=4, sample_ratio=0.01, min_samples=1024, seed=0):
    """DRAGONN (dragonn-wang2022 Alg. 1) run sequentially, from the numpy reference kernels
    (tfsparse.ops.reference): the sampled threshold of step ``step``'s seed ``seed·2**32 + step``
    (the exact k-th largest |a| below ``min_samples`` samples), every index passing ``|a| >= t``
    written in ascending order to its hash slot of ``capacity_factor·k`` (a later index
    overwrites an earlier one), empty slots dropped.  Returns the surviving indices, sorted (as
    they travel)."""
    from tfsparse.ops import reference as R

    n = a.size
    st = seed * 2**32 + step
    samples = min(n, min_samples)
    if sample_ratio * n >= samples:
        t = R.sample_threshold(a, k, sample_ratio, st)
    elif samples < n:
        t = R.sample_threshold(a, k, samples / n, st)
    else:
        t = R.kth_largest_abs(a, k)
    passing = np.flatnonzero(~(np.abs(a) < t))
    m = capacity_factor * k
    table = {}
    for i, slot in zip(passing, R.hash_slots(passing, m, st)):
        table[int(slot)] = int(i)  # Alg. 1: "the previous index is overwritten by the latter ones"
    return np.array(sorted(table.values()), dtype=np.int64)


def sum_selected(accs, sels):
    out = np.zeros(accs[0].size, np.float64)
    for a, s in zip(accs, sels):
        out[s] += a[s]
    return out


def kth_largest_magnitude(values: np.ndarray, k: int) -> float:
    """The k-th largest |value| by a full sort; 0.0 when there are at most k values, inf for k <= 0."""
    if k <= 0:
        return float("inf")
    if values.size <= k:
        return 0.0
    return float(np.sort(np.abs(values.astype(np.float32)))[::-1][k - 1])
