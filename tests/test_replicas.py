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
