"""tfsparse.ops: Numba CPU kernels against the numpy reference, and TensorFlow tensors as inputs.

The CUDA kernels are checked in tests/test_ops_cuda.py (PTX for sm_90 + the simulator).
"""
from __future__ import annotations

import numba
import numpy as np
import pytest

import tfsparse.ops as ops
from tfsparse.ops import _common as C
from tfsparse.ops import _cpu_bits, _cpu_select, cpu
from tfsparse import buffers
from tfsparse.ops import reference as R

BIG = 3 * (1 << 16) + 12345  # > one parallel chunk: the sampled prefilter and the multi-chunk paths run


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    cpu.warmup()  # compile once (or load the Numba cache) so that the tests time the kernels only


def mixed(n, seed=0, ties=True):
    """Gaussian with NaN (two payloads), +-Inf, -0.0 and tied magnitudes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if n >= 64:
        pos = rng.permutation(n)
        x[pos[0]] = np.nan
        x[pos[1]] = -np.float32(np.nan)
        x[pos[2]] = np.inf
        x[pos[3]] = -np.inf
        x[pos[4:8]] = -0.0
        if ties:
            x[pos[8:40]] = 1.75
            x[pos[40:60]] = -1.75
    return x


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.kind == "f":
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        view = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
        np.testing.assert_array_equal(a[~np.isnan(a)].view(view), b[~np.isnan(b)].view(view))
    else:
        np.testing.assert_array_equal(a, b)


def same_scalar(a, b):
    a, b = np.float32(a), np.float32(b)
    assert (np.isnan(a) and np.isnan(b)) or a == b, (a, b)


def assert_valid_topk(x, k, idx, val):
    """Property check independent of the reference: exactly k, ascending, all |x| > t in, rest at t."""
    keys = R.mag_keys(x)
    assert idx.dtype == np.int64 and val.dtype == np.float32 and idx.size == k == val.size
    assert np.all(np.diff(idx) > 0)
    same_bits(val, x[idx])
    if k:
        t = keys[idx].min()
        assert np.all(np.isin(np.nonzero(keys > t)[0], idx))
        assert np.all(keys[idx] >= t)


# ----------------------------------------------------------------------------- top-k, thresholds

@pytest.mark.parametrize("n", [0, 1, 2, 100, 5000, BIG])
def test_topk_abs_matches_reference(n):
    x = mixed(n, seed=n)
    for k in sorted({0, min(1, n), min(3, n), n // 1000, n // 37, n // 2, max(n - 1, 0), n}):
        idx, val = ops.topk_abs(x, k)
        ridx, rval = R.topk_abs(x, k)
        same_bits(idx, ridx)
        same_bits(val, rval)
        assert_valid_topk(x, k, idx, val)


def test_topk_abs_without_ties_is_the_unique_set():
    x = np.random.default_rng(3).permutation(np.arange(1, BIG + 1, dtype=np.float32)) * np.float32(-1) ** np.arange(BIG)
    k = BIG // 1000
    idx, _ = ops.topk_abs(x, k)
    np.testing.assert_array_equal(idx, np.sort(np.argsort(-np.abs(x), kind="stable")[:k]))


def test_topk_abs_ties_take_lowest_indices():
    x = np.full(BIG, 0.5, np.float32)
    x[::7] = -0.5
    idx, val = ops.topk_abs(x, 1000)
    np.testing.assert_array_equal(idx, np.arange(1000))
    z = np.zeros(300, np.float32)
    z[::2] = -0.0  # -0.0 and 0.0 tie
    np.testing.assert_array_equal(ops.topk_abs(z, 5)[0], np.arange(5))


def test_topk_abs_nan_inf_first():
    x = np.random.default_rng(4).standard_normal(BIG).astype(np.float32)
    x[[10, 20000, BIG - 1]] = [np.nan, np.inf, -np.inf]
    idx, val = ops.topk_abs(x, 2)
    np.testing.assert_array_equal(idx, [10, 20000])  # NaN, then the first of the infinities
    idx, _ = ops.topk_abs(x, 3)
    np.testing.assert_array_equal(idx, [10, 20000, BIG - 1])


def test_topk_abs_rejects_bad_k():
    x = np.ones(10, np.float32)
    for k in (-1, 11):
        with pytest.raises(ValueError):
            ops.topk_abs(x, k)


def test_topk_abs_accepts_any_shape_and_dtype():
    x = mixed(600, 5).reshape(20, 30).astype(np.float64)
    same_bits(ops.topk_abs(x, 17)[0], R.topk_abs(x.astype(np.float32), 17)[0])


def test_topk_abs_exact_when_the_sample_misleads():
    """The sampled prefilter yields fewer than k candidates -> the radix fallback keeps it exact."""
    n, k = BIG, 1000
    x = np.random.default_rng(6).standard_normal(n).astype(np.float32)
    s = cpu._prefilter_samples(n)
    pos = R.sample_positions(n, s, 0)
    x[pos[:200]] = 100.0  # the sample over-represents huge values
    xu = x.view(np.uint32)
    lower = cpu._sampled_lower_key(xu, k)
    assert np.count_nonzero(R.mag_keys(x) >= lower) < k  # the first pass really is short
    assert cpu._sampled_candidates(xu, x, k) is None
    idx, val = ops.topk_abs(x, k)
    same_bits(idx, R.topk_abs(x, k)[0])
    assert ops.kth_largest_abs(x, k) == R.kth_largest_abs(x, k)


@pytest.mark.parametrize("n", [0, 1, 100, 5000, BIG])
def test_kth_largest_abs_matches_reference(n):
    x = mixed(n, seed=n + 1)
    for k in sorted({0, min(1, n), min(2, n), min(4, n), n // 100, n // 2, n}):
        same_scalar(ops.kth_largest_abs(x, k), R.kth_largest_abs(x, k))


def test_kth_largest_abs_policy():
    x = np.array([1.0, np.nan, -np.inf, 3.0, -0.0], np.float32)
    assert np.isnan(ops.kth_largest_abs(x, 0))  # nothing ranks above NaN
    assert np.isnan(ops.kth_largest_abs(x, 1))
    assert ops.kth_largest_abs(x, 2) == np.inf
    assert ops.kth_largest_abs(x, 3) == 3.0
    assert ops.kth_largest_abs(x, 5) == 0.0
    for k in range(1, 6):  # select_threshold(kth_largest_abs) returns >= k elements
        assert ops.select_threshold(x, ops.kth_largest_abs(x, k))[0].size >= k


@pytest.mark.parametrize("ratio,seed", [(0.01, 0), (0.1, 3), (1.0, 0)])
def test_sample_threshold_matches_reference(ratio, seed):
    for n in (0, 1, 1000, BIG):
        x = mixed(n, seed=n + 2)
        for k in sorted({0, min(1, n), n // 1000, n // 10, n}):
            same_scalar(ops.sample_threshold(x, k, ratio=ratio, seed=seed), R.sample_threshold(x, k, ratio, seed))


def test_sample_threshold_estimates_k():
    x = np.random.default_rng(7).standard_normal(1 << 20).astype(np.float32)
    k = 1 << 10
    t = ops.sample_threshold(x, k, ratio=0.05)
    got = ops.select_threshold(x, t)[0].size
    assert 0.7 * k < got < 1.5 * k
    assert ops.sample_threshold(x, k, ratio=1.0) == ops.kth_largest_abs(x, k)  # the full sample is exact
    with pytest.raises(ValueError):
        ops.sample_threshold(x, k, ratio=0.0)


@pytest.mark.parametrize("n", [0, 1, 100, BIG])
def test_select_threshold_matches_reference(n):
    x = mixed(n, seed=n + 3)
    for t in (0.0, -0.0, -1.0, 0.3, 1.75, 3.0, np.inf, np.nan, np.float32(1e-40)):
        idx, val = ops.select_threshold(x, t)
        ridx, rval = R.select_threshold(x, t)
        same_bits(idx, ridx)
        same_bits(val, rval)
        assert np.all(np.isin(np.nonzero(np.isnan(x))[0], idx))  # NaN is always selected


def test_select_threshold_dense_chunks_overflow_staging():
    x = mixed(BIG, 8)  # t = 0.01 selects ~99%: every chunk overflows its staging area and is rescanned
    same_bits(ops.select_threshold(x, 0.01)[0], R.select_threshold(x, 0.01)[0])


# ----------------------------------------------------------------------------- hash select

@pytest.mark.parametrize("n", [0, 1, 100, BIG])
def test_hash_select_matches_reference(n):
    x = mixed(n, seed=n + 4)
    for t in (0.0, 1.0, 1.75, np.inf, np.nan):
        for capacity in (0, 1, 7, 64, 4096):
            for seed in (0, 11):
                idx, val = ops.hash_select(x, t, capacity, seed=seed)
                ridx, rval = R.hash_select(x, t, capacity, seed)
                same_bits(idx, ridx)
                same_bits(val, rval)


def test_hash_select_collisions_and_overflow():
    """DRAGONN Alg. 1: one index per slot (the largest that hashed there), -1/0 for empty slots,
    at most ``capacity`` survivors when more pass the threshold."""
    x = np.random.default_rng(9).standard_normal(BIG).astype(np.float32)
    t, capacity = 2.0, 97
    idx, val = ops.hash_select(x, t, capacity, seed=1)
    assert idx.shape == val.shape == (capacity,) and idx.dtype == np.int64 and val.dtype == np.float32
    passing = np.nonzero(np.abs(x) >= t)[0]
    assert passing.size > capacity  # overflow: most candidates are dropped
    slots = R.hash_slots(passing, capacity, 1)
    for j in range(capacity):
        hit = passing[slots == j]
        if hit.size:
            assert idx[j] == hit.max() and val[j] == x[hit.max()]
        else:
            assert idx[j] == -1 and val[j] == 0.0
    # decoding the table directly skips the empty slots
    dense = ops.scatter_add(BIG, idx, val)
    assert np.count_nonzero(dense) == np.count_nonzero(idx >= 0)


def test_hash_select_deterministic_across_thread_counts():
    x = np.random.default_rng(10).standard_normal(BIG).astype(np.float32)
    ref = ops.hash_select(x, 1.5, 333, seed=2)
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = ops.hash_select(x, 1.5, 333, seed=2)
    finally:
        numba.set_num_threads(old)
    same_bits(ref[0], one[0])
    assert not np.array_equal(ref[0], ops.hash_select(x, 1.5, 333, seed=3)[0])  # the seed picks the hash


def test_hash_select_rejects_bad_capacity():
    with pytest.raises(ValueError):
        ops.hash_select(np.ones(4, np.float32), 0.5, -1)
    with pytest.raises(ValueError):
        ops.hash_select(np.ones(4, np.float32), 0.5, 2**32)


# ----------------------------------------------------------------------------- sparse decoding

@pytest.mark.parametrize("itype", [np.int32, np.int64])
def test_scatter_add_matches_add_at(itype):
    rng = np.random.default_rng(11)
    n = BIG
    idx = rng.integers(-1, n, 50000).astype(itype)  # duplicates and -1 (empty hash slots)
    val = rng.standard_normal(idx.size).astype(np.float32)
    same_bits(ops.scatter_add(n, idx, val), R.scatter_add(n, idx, val))  # same order: same bits
    base = rng.standard_normal(n).astype(np.float32)
    out = base.copy()
    res = ops.scatter_add(n, idx, val, out=out)
    assert res is out
    same_bits(out, R.scatter_add(n, idx, val, out=base.copy()))


def test_scatter_add_equals_dense_decoding_of_payloads():
    """DRAGONN §4.3: one decode of the concatenated payloads == sum of per-payload dense decodes."""
    rng = np.random.default_rng(12)
    n, k, payloads = 20000, 200, 8
    parts = [ops.topk_abs(rng.standard_normal(n).astype(np.float32), k) for _ in range(payloads)]
    dense = np.zeros(n, np.float32)
    for i, v in parts:
        d = np.zeros(n, np.float32)
        d[i] = v
        dense += d
    sparse = ops.scatter_add(n, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    np.testing.assert_allclose(sparse, dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("itype", [np.int32, np.int64])
def test_densify_into_is_zeros_plus_scatter_bit_for_bit(itype):
    """The sequential decode of ascending pieces: the bits of np.add.at into zeros (piece order,
    from +0.0: -0.0 entries, shared indices, NaN, Inf), whatever ``out`` held; one piece stored
    as it is with ``add=False``; False (``out`` untouched) for pieces that do not ascend."""
    rng = np.random.default_rng(21)
    n = BIG
    pieces = [ops.topk_abs(mixed(n, seed), 500) for seed in range(3)]
    pieces.append((pieces[0][0][:50], np.full(50, -0.0, np.float32)))  # shared indices, signed zeros
    pieces.append((np.array([0, n - 1]), np.array([-0.0, 2.5], np.float32)))
    idx = np.concatenate([p[0] for p in pieces]).astype(itype)
    val = np.concatenate([p[1] for p in pieces])
    starts = np.cumsum([0] + [p[0].size for p in pieces])
    out = rng.standard_normal(n).astype(np.float32)
    assert cpu.densify_into(out, idx, val, starts)
    same_bits(out, R.scatter_add(n, idx, val))
    one = rng.standard_normal(n).astype(np.float32)
    assert cpu.densify_into(one, pieces[4][0], pieces[4][1], [0, 2], add=False)
    want = np.zeros(n, np.float32)
    want[pieces[4][0]] = pieces[4][1]
    same_bits(one, want)
    kept = out.copy()
    assert not cpu.densify_into(out, idx[::-1].copy(), val, starts)
    assert not cpu.densify_into(out, np.array([3, -1]), np.ones(2, np.float32), [0, 2])  # an empty hash slot
    same_bits(out, kept)
    assert cpu.densify_into(out, np.zeros(0, np.int64), np.zeros(0, np.float32), [0])
    same_bits(out, np.zeros(n, np.float32))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("t", [0.0, 0.5, 2.0, np.inf, np.nan])
def test_add_select_is_add_then_select_threshold(t, stream):
    """Error feedback, the finite check and a threshold selection in one pass: the float32 sum,
    the elements with |sum| >= t (NaN always), offset by ``base``, and whether all sums are finite
    -- with plain and with non-temporal stores."""
    g, r = mixed(BIG, 3), mixed(BIG, 4, ties=False)
    acc = np.empty(BIG, np.float32)
    idx, val, finite = cpu.add_select(g, r, acc, C.threshold_key(t), 1000, stream)
    same_bits(acc, g + r)
    ref_idx, ref_val = R.select_threshold(g + r, t)
    same_bits(idx, ref_idx + 1000)
    same_bits(val, ref_val)
    assert finite is False
    fg, fr = np.ones(BIG, np.float32), np.full(BIG, -0.0, np.float32)
    assert cpu.add_select(fg, fr, acc, C.NAN_KEY + 1)[2] is True
    assert cpu.add_select(fg, fr, acc, C.NAN_KEY + 1)[0].size == 0  # a key above every key: nothing


@pytest.mark.parametrize("offset", [0, 1, 5, 15])
@pytest.mark.parametrize("n", [1, 17, 1000, BIG + 7])
def test_add_select_streams_the_sums_whatever_the_alignment(offset, n):
    """The sums reach ``acc`` (non-temporal stores from its first 64-byte aligned element on, plain
    ones before and after) for any alignment and length, the hits staged the same -- with
    ``acc``'s neighbours untouched; t = 0 collects every element (the chunks' overflow rescan);
    vectors from ``STREAM_MIN`` elements on are streamed by default, smaller ones not."""
    assert cpu.STREAM_MIN > BIG + 7
    g, r = mixed(n + 16, 6)[offset:offset + n], mixed(n + 16, 7, ties=False)[16 - offset:16 - offset + n]
    for t in (0.0, 1.0):
        whole = np.full(n + 32, 7.0, np.float32)
        acc = whole[offset + 8:offset + 8 + n]
        idx, val, finite = cpu.add_select(g, r, acc, C.threshold_key(t), 3, stream=True)
        same_bits(acc, g + r)
        same_bits(whole[:offset + 8], np.full(offset + 8, 7.0, np.float32))
        same_bits(whole[offset + 8 + n:], np.full(24 - offset, 7.0, np.float32))
        ref_idx, ref_val = R.select_threshold(g + r, t)
        same_bits(idx, ref_idx + 3)
        same_bits(val, ref_val)
        assert finite == bool(np.all(np.isfinite(g + r)))


@pytest.mark.parametrize("around", [-17, -9, 0, 1, 7, 16])
def test_staging_fills_to_its_end(around):
    """A chunk with about as many hits as its staging area holds (``_STG`` + ``around``): the
    staging takes them 16 at a time while 16 fit (:func:`_cpu_bits._compress16` on AVX-512) and one by one
    after, and a chunk with more is rescanned -- the same indices and values as the reference, for
    the threshold selection and error feedback's pass, NaN (always a hit) and a key above NaN's
    (nothing) included."""
    rng = np.random.default_rng(around + 40)
    n = 2 * cpu._CH + 77
    x = np.full(n, 0.25, np.float32)
    x[rng.choice(cpu._CH, cpu._STG + around, replace=False)] = -3.0  # chunk 0
    x[cpu._CH + rng.choice(cpu._CH, cpu._STG - around, replace=False)] = 2.0  # chunk 1
    x[[9, cpu._CH + 3, n - 1]] = [np.nan, np.inf, -0.0]
    acc = np.empty_like(x)
    for t in (1.0, 0.25):
        ref_idx, ref_val = R.select_threshold(x, t)
        idx, val = ops.select_threshold(x, t)
        same_bits(idx, ref_idx)
        same_bits(val, ref_val)
        idx, val, finite = cpu.add_select(x, np.zeros_like(x), acc, C.threshold_key(t), 5)
        same_bits(idx, ref_idx + 5)
        same_bits(val, ref_val)
        assert not finite
    idx, val, _ = cpu.add_select(x, np.zeros_like(x), acc, C.NAN_KEY + 1)
    assert idx.size == 0 and val.size == 0
    idx, _, _ = cpu.add_select(x, np.zeros_like(x), acc, C.NAN_KEY)
    same_bits(idx, np.array([9]))


def test_candidates_give_the_exact_topk_and_the_hash_table():
    """From the elements at or above a key: the exact top-k (when there are at least k) and
    DRAGONN's table -- what topk_abs and hash_select make of the whole vector."""
    x = mixed(BIG, 5)
    k = 700
    positions, rank = cpu.prefilter_plan(x.size, k)
    lower = cpu.kth_key(cpu.keys_of(x[positions]), rank)
    acc = np.empty_like(x)
    idx, val, _ = cpu.add_select(x, np.zeros_like(x), acc, lower)
    assert idx.size >= k
    for a, b in zip(cpu.topk_of_candidates(idx, val, k), cpu.topk_abs(x, k)):
        same_bits(a, b)
    assert cpu.topk_of_candidates(idx[:k - 1], val[:k - 1], k) is None
    t = float(ops.sample_threshold(x, k, ratio=0.01, seed=9))
    idx, val, _ = cpu.add_select(x, np.zeros_like(x), acc, C.threshold_key(t))
    for a, b in zip(cpu.hash_candidates(idx, val, t, 4 * k, seed=9), cpu.hash_select(x, t, 4 * k, seed=9)):
        same_bits(a, b)
    # the table's occupied slots in index order, without a sort (what DRAGONN sends)
    table, values = cpu.hash_select(x, t, 4 * k, seed=9)
    full = table >= 0
    order = np.argsort(table[full])
    got = cpu.hash_survivors(idx, val, t, 4 * k, seed=9)
    same_bits(got[0], table[full][order])
    same_bits(got[1], values[full][order])
    assert np.all(np.diff(got[0]) > 0)


SPECIAL = np.array([-0.0, 0.0, np.nan, np.inf, -np.inf, 3e38], np.float32)


def _sparse(rng, n, count):
    idx = np.sort(rng.choice(n, count, replace=False)).astype(np.int64)
    val = rng.standard_normal(count).astype(np.float32)
    val[rng.integers(0, count, min(count, 6))] = SPECIAL[:min(count, 6)]
    return idx, val


@pytest.mark.parametrize("seed", range(4))
def test_merge_sum_is_unique_then_scatter_bit_for_bit(seed):
    """gTop-k's ⊤ sums two sparse vectors: one linear merge gives what np.unique of the
    concatenation, a in zeros and b added give -- -0.0, NaN, Inf and overflow included."""
    rng = np.random.default_rng(seed)
    a_idx, a_val = _sparse(rng, 5000, 900)
    b_idx, b_val = _sparse(rng, 5000, 1300)
    union, inverse = np.unique(np.concatenate([a_idx, b_idx]), return_inverse=True)
    summed = np.zeros(union.size, np.float32)
    summed[inverse[:a_idx.size]] = a_val
    with np.errstate(invalid="ignore", over="ignore"):
        summed[inverse[a_idx.size:]] += b_val
    got_idx, got_val = cpu.merge_sum(a_idx.astype(np.int32), a_val, b_idx, b_val)
    same_bits(got_idx, union)
    same_bits(got_val, summed)
    for a, b in ((a_idx[:0], b_idx), (a_idx, b_idx[:0])):
        same_bits(cpu.intersect_sorted(a, b), np.empty(0, np.int64))
    same_bits(cpu.intersect_sorted(a_idx, b_idx), np.intersect1d(a_idx, b_idx, assume_unique=True))


@pytest.mark.parametrize("seed", range(7))
def test_topk_ties_low_is_numpys_dense_selection(seed):
    """The dense top-k (k above n / 16): every larger magnitude and the lowest-index ties at the
    k-th, NaN counted as Inf, indices ascending -- numpy's partition-mask-sort path, no sort.
    Seed 6 is past ``_RADIX_MIN`` elements: the threshold from the radix select."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 4000)) if seed < 6 else 3 * _cpu_select._RADIX_MIN + 5
    x = np.round(rng.standard_normal(n) * 3).astype(np.float32) / 2  # many ties
    x[rng.integers(0, n, 6)] = SPECIAL
    for k in (1, n // 16 + 1, n // 2, n - 1):
        mag = np.abs(x)
        mag[np.isnan(mag)] = np.inf
        t = mag[np.argpartition(mag, n - k)[n - k]]
        above = np.flatnonzero(mag > t)
        ref = np.sort(np.concatenate([above, np.flatnonzero(mag == t)[:k - above.size]]))
        idx, val = cpu.topk_ties_low(x, k)
        same_bits(idx, ref.astype(np.int64))
        same_bits(val, x[ref])


@pytest.mark.parametrize("seed", range(4))
def test_kth_key_radix_select_is_the_sorted_kth(seed):
    """From ``_RADIX_MIN`` keys the k-th largest comes from a two-pass radix select: the same
    value as the sorted array's, with heavy ties, NaN/Inf keys and every boundary ``k``; keys
    outside ``[0, 2**32)`` take the introselect path."""
    rng = np.random.default_rng(seed)
    m = _cpu_select._RADIX_MIN + int(rng.integers(0, 70000))
    x = np.round(rng.standard_normal(m) * 3).astype(np.float32) / 2  # many ties
    x[rng.integers(0, m, 12)] = np.resize(SPECIAL, 12)
    cases = [cpu.keys_of(x), cpu.keys_of(mixed(m, seed)), rng.integers(0, 2**32, m),
             rng.integers(-3, 2**40, m)]
    for keys in cases:
        keys = np.asarray(keys, np.int64)
        ordered = np.sort(keys)
        for k in (1, 2, m // 3, m - 1, m, int(rng.integers(1, m + 1))):
            assert cpu.kth_key(keys, k) == ordered[m - k], k


def test_sample_positions_are_where_the_samples_read():
    x = mixed(BIG, 6)
    s = C.sample_count(x.size, 0.01)
    keys = cpu.keys_of(x[cpu.sample_positions(x.size, s, seed=4)])
    same_scalar(C.key_to_float(cpu.kth_key(keys, C.sample_rank(300, x.size, s))),
                ops.sample_threshold(x, 300, ratio=0.01, seed=4))


@pytest.mark.parametrize("encode", ["half", "bf16", "int8"])
def test_encoders_write_the_loss_over_their_input(encode):
    """The 16/8-bit encoders with ``loss=`` the input itself: the same codes, and the input then
    holds exactly the loss a separate vector gets (a float16 overflow keeps the value there)."""
    x = np.random.default_rng(7).standard_normal(BIG).astype(np.float32)
    x[::101] = -0.0
    x[5] = 70000.0
    run = {"half": lambda v, **kw: cpu.half_encode(v, **kw)[:2],
           "bf16": lambda v, **kw: cpu.bfloat16_encode(v, **kw),
           "int8": lambda v, **kw: cpu.quantize_int8_chunks(v, 4096, **kw)[::2]}[encode]
    codes, loss = run(x)
    y = x.copy()
    codes2, loss2 = run(y, loss=y)
    same_bits(codes, codes2)
    assert loss2 is y or np.shares_memory(loss2, y)
    want = loss.copy()
    if encode == "half":
        want[5] = 70000.0  # overflowed to Inf: the kernel keeps the value as its "loss"
    same_bits(y, want)


def test_scatter_add_edge_cases():
    same_bits(ops.scatter_add(5, np.zeros(0, np.int64), np.zeros(0, np.float32)), np.zeros(5, np.float32))
    assert ops.scatter_add(0, [], []).shape == (0,)
    with pytest.raises(IndexError):
        ops.scatter_add(10, np.array([1, 10]), np.ones(2, np.float32))
    with pytest.raises(ValueError):
        ops.scatter_add(10, np.array([1, 2]), np.ones(3, np.float32))
    with pytest.raises(TypeError):
        ops.scatter_add(10, np.array([1]), np.ones(1, np.float32), out=np.zeros(10, np.float64))
    got = ops.scatter_add(4, [0, 0, 2, 3], np.array([np.nan, 1.0, np.inf, -np.inf], np.float32))
    assert np.isnan(got[0]) and got[1] == 0 and got[2] == np.inf and got[3] == -np.inf


# ----------------------------------------------------------------------------- quantization

def test_quantize_int8_matches_reference_and_bounds_error():
    x = (np.random.default_rng(13).standard_normal(BIG) * 5).astype(np.float32)
    q, scale = ops.quantize_int8(x)
    rq, rscale = R.quantize_int8(x)
    same_bits(q, rq)
    assert scale == rscale == np.abs(x).max() / np.float32(127)
    assert q.dtype == np.int8 and np.abs(q.astype(int)).max() == 127
    x2 = ops.dequantize_int8(q, scale)
    same_bits(x2, R.dequantize_int8(rq, rscale))
    assert np.abs(x2 - x).max() <= scale * 0.5 * (1 + 1e-5)


def test_quantize_int8_rounds_half_to_even():
    x = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 0.0], np.float32)
    q, scale = ops.quantize_int8(x)
    assert scale == 1.0
    np.testing.assert_array_equal(q, [127, 0, 2, 2, 0, -2, 0])


def test_quantize_int8_non_finite_and_empty():
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    for bad, check in ((np.nan, np.isnan), (np.inf, np.isposinf), (-np.inf, np.isposinf)):
        y = x.copy()
        y[3] = bad
        q, scale = ops.quantize_int8(y)
        rq, rscale = R.quantize_int8(y)
        assert check(scale) and check(rscale)
        assert not q.any()
        assert np.isnan(ops.dequantize_int8(q, scale)).all()  # the receiver sees the bad gradient
    q, scale = ops.quantize_int8(np.zeros(10, np.float32))
    assert scale == 0 and not q.any() and not ops.dequantize_int8(q, scale).any()
    q, scale = ops.quantize_int8(np.zeros(0, np.float32))
    assert q.shape == (0,) and scale == 0


def test_truncate_fp16_matches_reference_bitwise():
    bits = np.random.default_rng(14).integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).copy()  # every class: normals, subnormals, Inf, NaN payloads
    h = ops.truncate_fp16(x)
    assert h.dtype == np.float16
    same_bits(h, R.truncate_fp16(x))


def test_truncate_fp16_rounds_toward_zero():
    x = np.array([1.0 + 2**-11, -(1.0 + 2**-11), 65504.0, 65519.0, 1e9, -1e9, 2.0**-24, 2.0**-25, -0.0,
                  np.inf, -np.inf, np.nan, 1.0 + 3 * 2**-12], np.float32)
    h = ops.truncate_fp16(x)
    np.testing.assert_array_equal(h[:10], np.array([1.0, -1.0, 65504.0, 65504.0, 65504.0, -65504.0, 2.0**-24, 0.0,
                                                    -0.0, np.inf], np.float16))
    assert np.signbit(h[8]) and h[10] == -np.inf and np.isnan(h[11])
    assert np.float16(x[12]) > 1.0 and h[12] == 1.0  # nearest rounds up, truncation goes down
    assert np.all(np.abs(h[np.isfinite(h)].astype(np.float32)) <= np.abs(x[np.isfinite(h)]))


# ----------------------------------------------------------------------------- chunk norms

@pytest.mark.parametrize("chunk", [1, 1000, 32768, 10**7])
def test_chunk_l1_norms_matches_reference(chunk):
    x = np.random.default_rng(15).standard_normal(BIG).astype(np.float32)
    norms = ops.chunk_l1_norms(x, chunk)
    assert norms.dtype == np.float32 and norms.shape == (C.num_chunks(BIG, chunk),)
    np.testing.assert_allclose(norms, R.chunk_l1_norms(x, chunk), rtol=1e-6)


def test_chunk_l1_norms_non_finite_and_edges():
    x = np.ones(100, np.float32)
    x[5], x[50] = np.nan, -np.inf
    norms = ops.chunk_l1_norms(x, 40)
    assert np.isnan(norms[0]) and norms[1] == np.inf and norms[2] == 20
    assert ops.chunk_l1_norms(np.zeros(0, np.float32), 8).shape == (0,)
    with pytest.raises(ValueError):
        ops.chunk_l1_norms(x, 0)


# ----------------------------------------------------------------------------- dispatch

class _FakeCAI:
    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False), "version": 3}


class _FakeDLPack:
    def __init__(self, dev):
        self._dev = dev

    def __dlpack__(self, stream=None):
        raise BufferError

    def __dlpack_device__(self):
        return self._dev


def test_device_kind_table():
    assert ops.device_kind(np.zeros(3)) == "cpu"
    assert ops.device_kind([1.0, 2.0]) == "cpu"
    assert ops.device_kind(_FakeCAI()) == "cuda"
    assert ops.device_kind(_FakeDLPack((2, 0))) == "cuda"   # kDLCUDA, e.g. a TF GPU tensor
    assert ops.device_kind(_FakeDLPack((1, 0))) == "cpu"
    assert ops.backend("cpu") is cpu


def test_tf_cpu_tensor_dispatches_to_cpu():
    tf = pytest.importorskip("tensorflow")
    x = mixed(500, 16)
    t = tf.constant(x)
    assert ops.device_kind(t) == "cpu"
    same_bits(ops.topk_abs(t, 9)[0], R.topk_abs(x, 9)[0])


# ----------------------------------------------------------------------------- TensorFlow side

def test_tf_set_path_validates():
    pytest.importorskip("tensorflow")
    from tfsparse.ops import tf as T

    with pytest.raises(ValueError):
        T.set_path("tpu")
    assert set(T.PATHS) == {"cpu", "cuda"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("n,offset,threads", [(3 * 65536 + 2049, 3, 1), (2048, 0, 1), (100, 1, 1),
                                               (2_000_003, 5, 1), (5 * 65536 + 77, 7, 2)])
def test_add_encode16_is_the_sum_then_the_encoding(n, offset, threads, half, stream, monkeypatch):
    """Error feedback fused with the float16 / bfloat16 encoding: the same codes and loss bits as
    ``g + r`` encoded with the loss over it -- for ``acc`` starting at every offset from a cache
    line (the non-temporal stores begin at the first aligned element), partial steps and tasks,
    several threads; sums that are float16 subnormals, exact (loss +0), -0.0, float16's largest
    value and the values around its rounding to Inf (65520: counted as overflows, as half_encode
    counts them); a NaN or Inf sum reported."""
    if threads > 1:
        monkeypatch.setattr(cpu, "PARALLEL_MIN", 1)  # several tasks on several threads
    rng = np.random.default_rng(n)
    g = rng.standard_normal(n + 16).astype(np.float32)[offset:offset + n]
    r = (0.1 * rng.standard_normal(n + 16)).astype(np.float32)[offset:offset + n]
    edge = np.array([2.0**-24, 3 * 2.0**-25, -2.0**-20, 0.5, -0.0, 65504.0, 65519.99, -65519.0],
                    np.float32)
    for j, v in enumerate(edge):  # sums of exactly these values
        g[j * 37 % n], r[j * 37 % n] = v, (-0.0 if v == 0 else 0.0)
    acc = buffers.aligned_empty(n + 16)[offset % 16:offset % 16 + n]
    codes = np.empty(n, np.uint16)
    over, finite = cpu.add_encode16(g, r, acc, codes, half, stream)
    s = g + r
    if half:
        c0, l0, o0 = cpu.half_encode(s)
    else:
        (c0, l0), o0 = cpu.bfloat16_encode(s), 0
    assert finite and over == o0 == 0
    assert np.array_equal(codes, c0)
    np.testing.assert_array_equal(acc.view(np.uint32), l0.view(np.uint32))
    g[n // 2], g[n // 3], r[n // 2], r[n // 3] = 65520.0, -7e4, 0.0, 0.0  # both round to Inf
    assert cpu.add_encode16(g, r, acc, codes, half, stream) == (2 * int(half), True)
    keep = np.ones(n, bool)
    keep[[n // 2, n // 3]] = False
    c1 = cpu.half_encode(g + r)[0] if half else cpu.bfloat16_encode(g + r)[0]
    assert np.array_equal(codes[keep], c1[keep])  # the others encoded as ever
    g[n - 1] = np.nan
    assert not cpu.add_encode16(g, r, acc, codes, half, stream)[1]
    g[n - 1] = -np.inf
    assert not cpu.add_encode16(g, r, acc, codes, half, stream)[1]
    with pytest.raises(TypeError, match="acc contiguous and aligned"):
        cpu.add_encode16(g, r, np.empty(n + 1, np.float32), codes, half)


def test_dlpack_view_of_tf_tensor_is_zero_copy_and_owned():
    tf = pytest.importorskip("tensorflow")
    import gc

    from tfsparse.ops import _dlpack

    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = tf.constant(src)
    assert _dlpack.device_type(t) == _dlpack.CPU and _dlpack.device_type([1.0]) is None
    v = _dlpack.view(t)
    assert v.dtype == np.float32 and v.shape == (3, 4)
    assert v.__array_interface__["data"][0] == _dlpack.view(t).__array_interface__["data"][0]  # same buffer
    del t
    gc.collect()
    np.testing.assert_array_equal(v, src)  # the view owns the tensor now
    for dtype in (tf.int32, tf.int64, tf.int8, tf.float16, tf.uint16):
        np.testing.assert_array_equal(_dlpack.view(tf.constant([3, 0, 1], dtype=dtype)), [3, 0, 1])
    same_bits(ops.topk_abs(_dlpack.view(tf.constant(mixed(700, 19))), 5)[0], R.topk_abs(mixed(700, 19), 5)[0])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n,offset", [(3 * 4096 + 17, 3), (4096, 0), (100, 1), (2_000_003, 5)])
@pytest.mark.parametrize("bits", [8, 4])
def test_add_quantize_chunks_is_the_sum_then_the_quantization(n, offset, stream, bits):
    """Error feedback fused with the int8 (chunks of 4096) or int4 (chunks of 512, two codes a
    byte) encoding: the same codes, scales and loss bits as ``g + r`` quantized in place, for
    vectors that start off a cache line (the non-temporal stores begin at the first aligned
    element), a last partial chunk (an odd one: int4's last high nibble unused), a chunk of
    zeros, one holding NaN and one holding Inf (scales NaN / Inf: the caller's finite check)."""
    fused, plain, chunk, ncodes = {8: (cpu.add_quantize_int8_chunks, cpu.quantize_int8_chunks, 4096, n),
                                   4: (cpu.add_quantize_int4_chunks, cpu.quantize_int4_chunks, 512, (n + 1) // 2)}[bits]
    rng = np.random.default_rng(n)
    g = rng.standard_normal(n + 16).astype(np.float32)[offset:offset + n]
    r = (0.1 * rng.standard_normal(n + 16)).astype(np.float32)[offset:offset + n]
    if n > 3 * 4096:
        g[4096:8192] = r[4096:8192] = 0.0
        g[8200], g[2] = np.nan, -np.inf
    acc = np.empty(n + 16, np.float32)[offset:offset + n]
    q = np.empty(ncodes, np.uint8)
    scales = fused(g, r, acc, chunk, q, stream)
    q0, s0, loss0 = plain(g + r, chunk)
    assert np.array_equal(q, q0.view(np.uint8))
    np.testing.assert_array_equal(scales.view(np.uint32), s0.view(np.uint32))
    np.testing.assert_array_equal(acc.view(np.uint32), loss0.view(np.uint32))
    with pytest.raises(TypeError, match="acc contiguous and aligned"):
        fused(g, r, np.empty(n + 1, np.float32), chunk, q)


def test_stage_hits_without_compressing_stores(monkeypatch):
    """A full block staged by the sub-block tests, as on CPUs without cheap compressing stores
    (``_COMPRESS`` off, run here as Python; this CPU's compiled way: the tests above): the hits in
    order, counted past the staging area's end, stored only inside it."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(_cpu_bits._BLK).astype(np.float32)
    x[[3, 40]] = [np.nan, -np.inf]
    xu = x.view(np.uint32)
    monkeypatch.setattr(_cpu_select, "_COMPRESS", False)
    for klo in (C.threshold_key(1.0), C.threshold_key(0.1), C.NAN_KEY, C.NAN_KEY + 1):
        want = np.flatnonzero(np.minimum(xu & 0x7FFFFFFF, C.NAN_KEY) >= klo)
        for w0 in (0, cpu._STG - 5, cpu._STG + 2):
            st_idx = np.full(cpu._STG + 8, -1, np.int64)
            st_val = np.zeros(cpu._STG + 8, np.float32)
            w = _cpu_select._stage_hits.py_func(xu, x, 0, _cpu_bits._BLK, np.uint32(klo << 1), klo, st_idx, st_val, 0, w0, 100)
            assert w == w0 + want.size
            stored = max(0, min(cpu._STG, w) - w0)
            same_bits(st_idx[w0:w0 + stored], want[:stored] + 100)
            same_bits(st_val[w0:w0 + stored], x[want[:stored]])
            assert (st_idx[max(w0, min(w, cpu._STG)):] == -1).all()
