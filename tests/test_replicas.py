"""The replica digest (tfsparse.keras.replicas): what it tells apart, and the message it raises."""
import numpy as np
import pytest

from tfsparse.keras.replicas import ReplicasDiverged, compare, digest, digests


def test_the_digest_tells_every_flipped_bit_and_swapped_words_apart_whatever_the_dtype():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    d = digest(x)
    for i in (0, 17, 999):
        for bit in (0, 13, 31):
            y = x.copy()
            y.view(np.uint32)[i] ^= np.uint32(1 << bit)
            assert not np.array_equal(digest(y), d)
    swapped = x.copy()
    swapped[[3, 700]] = swapped[[700, 3]]
    assert not np.array_equal(digest(swapped), d)
    np.testing.assert_array_equal(digest(x.copy()), d)  # the bits alone, not the array
    for value in (x.astype(np.float16), x.astype(np.float64), np.int64(7), np.float32(0.5), x[:3]):
        assert digest(value).dtype == np.uint64 and digest(value).shape == (2,)
    assert digests([x, x[:5]]).shape == (2, 2)


def reference_digest(value) -> np.ndarray:
    """The digest's definition in numpy (what the one-pass kernel must give bit for bit)."""
    raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    raw = np.concatenate([raw, np.zeros(-raw.size % 4, np.uint8)])
    words = raw.view(np.uint32).astype(np.uint64)
    weights = np.arange(words.size, dtype=np.uint64) % np.uint64(65521) + np.uint64(1)
    with np.errstate(over="ignore"):
        return np.array([words.sum(dtype=np.uint64), (words * weights).sum(dtype=np.uint64)], np.uint64)


@pytest.mark.parametrize("size", [0, 1, 3, 65520, 65521, 65522, 3 * 65521 + 7, 1 << 20])
def test_the_digest_is_its_definition_bit_for_bit(size):
    """Sums past 2**64 wrap as the definition's; position weights start again every 65521 words."""
    rng = np.random.default_rng(size)
    words = rng.integers(0, 1 << 32, size, dtype=np.uint64).astype(np.uint32)
    words[: size // 2] |= np.uint32(0xFFFF0000)  # large words: the weighted sum wraps (the larger sizes)
    np.testing.assert_array_equal(digest(words), reference_digest(words))
    frozen = words.copy()
    frozen.flags.writeable = False  # as tf.numpy_function may hand them over
    np.testing.assert_array_equal(digest(frozen), reference_digest(words))
    np.testing.assert_array_equal(digest(np.repeat(words, 2)[::2]), reference_digest(words))  # strided
    half = rng.standard_normal(size).astype(np.float16)  # 2-byte elements: the last word padded
    np.testing.assert_array_equal(digest(half), reference_digest(half))


def test_compare_names_the_first_differing_variable_and_the_ranks():
    names = ["dense/kernel", "dense/bias", "adam/iteration"]
    ok = digests([np.ones(4, np.float32), np.zeros(2, np.float32), np.int64(3)])
    off = ok.copy()
    off[1, 0] += np.uint64(1)
    compare(names, [ok.reshape(-1), ok.reshape(-1), ok.reshape(-1)])  # flat, as an allgather returns them
    with pytest.raises(ReplicasDiverged, match=r"after step 9: variable 'dense/bias' holds other bits on "
                                               r"ranks 1, 2 than on rank 0 \(1 of 3 variables differ\)"):
        compare(names, [ok, off, off], "after step 9")


def test_replica_check_rejects_bad_input_before_communicating():
    pytest.importorskip("keras")
    from tfsparse.keras.callbacks import ReplicaCheck

    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"every=.* is not valid; accepted: an integer >= 1 \(epochs between checks\)"):
            ReplicaCheck(every=bad)
