"""tfsparse.data.agree_on_data in one process: the per-step vote's policies, with a stand-in
collective that returns every rank's flag (the MPI cases: tests/test_reliability_mpi.py)."""
import numpy as np
import pytest
import tensorflow as tf

from tfsparse import StepCountMismatch
from tfsparse.data import DataAgreement, agree_on_data, mark_last_batch, unmark
from tfsparse.strategies.sparse_strategy import _then_more


class Ranks:
    """A collective over P ranks where rank ``r`` has ``batches[r]`` batches (this rank is 0)."""

    def __init__(self, batches):
        self.batches, self.calls = batches, []

    def __call__(self, fn):
        step = len(self.calls)
        self.calls.append(step)

        class Comm:
            def allgather(_, flag):
                return [flag] + [np.array([1.0 if step < n else 0.0]) for n in self.batches[1:]]

        return fn(Comm())


def run(batches, policy="end", spec_kind="tuple"):
    x = np.arange(batches[0] * 4, dtype=np.float32).reshape(-1, 2)
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, 0]) if spec_kind == "tuple" else x).batch(2)
    return [e for e in agree_on_data(ds, DataAgreement(Ranks(batches), policy))]


def test_every_rank_ends_at_the_shortest_rank():
    got = run([4, 4, 3])
    assert len(got) == 3 and got[0][0].shape == (2, 2)  # structure kept
    assert len(run([3, 5], spec_kind="plain")) == 3  # this rank the shortest: it ends at its own end
    assert len(run([4, 4])) == 4


def test_error_policy_and_empty_shards():
    # raised in tf.data's thread, it reaches the caller as TensorFlow's error with its message
    with pytest.raises(tf.errors.UnknownError, match="StepCountMismatch: rank 2 ran out of data after 3 batches"):
        run([4, 4, 3], "error")
    with pytest.raises(StepCountMismatch, match="rank 1 ran out of data after 2 batches"):
        vote = DataAgreement(Ranks([4, 2]), "error")
        for step in range(3):
            vote(step, True)
    with pytest.raises(tf.errors.OpError, match="rank 1 has no data for fit"):
        run([4, 0])
    with pytest.raises(ValueError, match="uneven_data='drop' is not supported; accepted: 'end'"):
        DataAgreement(Ranks([1]), "drop")


def test_join_repeats_the_first_batch_with_zero_weights_until_every_rank_is_done():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    ds = tf.data.Dataset.from_tensor_slices((x, np.arange(6))).batch(2)
    got = [[t.numpy() for t in e] for e in agree_on_data(ds, DataAgreement(Ranks([3, 5]), "join"))]
    assert len(got) == 5
    np.testing.assert_array_equal([w for _, _, w in got], [[1, 1]] * 3 + [[0, 0]] * 2)
    np.testing.assert_array_equal(got[4][0], got[0][0])
    with pytest.raises(ValueError, match=r"uneven_data='join' needs \(x, y\)"):
        agree_on_data(tf.data.Dataset.from_tensor_slices(x).batch(2), DataAgreement(Ranks([3]), "join"))


def test_shard_drops_or_spreads_the_remainder():
    """tfsparse.data.shard: equal shards of consecutive (or seeded random) rows, the remainder
    dropped; with ``drop_remainder=False`` every row in exactly one shard, the first ``n % P``
    shards one row longer; bad arguments refused by name."""
    from tfsparse.data import shard

    x, y = np.arange(11) * 10, np.arange(11)
    assert [shard(x, rank=r, size=3).tolist() for r in range(3)] == [[0, 10, 20], [30, 40, 50], [60, 70, 80]]
    spread = [shard(x, y, rank=r, size=3, drop_remainder=False) for r in range(3)]
    assert [s[1].tolist() for s in spread] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert all((xs == ys * 10).all() for xs, ys in spread)  # the same rows of each array
    shuffled = [shard(y, rank=r, size=4, shuffle_seed=5, drop_remainder=False).tolist() for r in range(4)]
    assert sorted(sum(shuffled, [])) == list(range(11)) and [len(s) for s in shuffled] == [3, 3, 3, 2]
    assert shuffled[0] == shard(y, rank=0, size=4, shuffle_seed=5, drop_remainder=False).tolist()
    with pytest.raises(ValueError, match="drop_remainder=1 is not supported; accepted: True, False"):
        shard(x, rank=0, size=3, drop_remainder=1)
    with pytest.raises(ValueError, match="11 rows cannot be split over 12 ranks"):
        shard(x, rank=0, size=12, drop_remainder=False)


def test_a_shorter_ranks_last_batch_carries_the_others_remaining_steps_in_every_pass():
    """Validation data with fewer batches than another rank's: each batch is paired with the number
    of test steps the others run after it -- 0, but 2 after the last -- in every pass over it, and
    unmark gives the element back as it was (anything else unchanged, with None)."""
    x, y = np.arange(10, dtype=np.float32).reshape(5, 2), np.arange(5)
    marked = mark_last_batch(tf.data.Dataset.from_tensor_slices((x, y)).batch(2), 3, 2)
    for _ in range(2):  # fit's validation iterates the same dataset each epoch
        got = [unmark(e) for e in marked]
        assert [int(n) for _, n in got] == [0, 0, 2]
        np.testing.assert_array_equal(np.concatenate([e[0].numpy() for e, _ in got]), x)
        assert all(type(e) is tuple and len(e) == 2 for e, _ in got)
    assert unmark((x, y))[1] is None and unmark((x, {"y": y}))[1] is None


def test_the_last_test_step_of_a_shorter_rank_averages_its_average_again_for_each_remaining_step():
    """_then_more: the step's own averaging, then one per step the others have left, each of the
    average it got before (its states unchanged); ``more`` = 0 is one averaging."""
    sent = []

    def sync(packed):
        sent.append(packed.copy())
        return packed / 2 + 1  # a stand-in for the mean with another rank's states

    out = _then_more(sync, np.array([4.0, 8.0]), np.int64(2))
    np.testing.assert_array_equal(out, [2.25, 2.75])
    assert [list(s) for s in sent] == [[4.0, 8.0], [3.0, 5.0], [2.5, 3.5]]
    np.testing.assert_array_equal(_then_more(sync, np.array([4.0]), np.int64(0)), [3.0])
