"""Faults that must neither hang nor lose data, under real mpirun (P = 2 and 3): a rank killed
while it writes a checkpoint leaves the previous checkpoint loadable; a rank that stops is
reported by name while the others wait, and a stall longer than the timeout ends every rank;
data that runs out at different steps on different ranks ends the epoch together (or raises, by
policy), an empty shard is named, and StepCountMismatch reaches the caller's except."""
from __future__ import annotations

import re
import time

import numpy as np
import pytest

from mpi_harness import mpirun
from tfsparse import files

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nproc,weights_only", [(2, False), (3, True)])
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path, nproc, weights_only):
    _, text = mpirun(nproc, "save_crash.py", tmp_path, int(weights_only), timeout=180, expect_fail=True)
    assert "rank 0: killed while saving" in text, text[-3000:]
    assert "fit returned" not in text, text[-3000:]
    path = tmp_path / ("ckpt.weights.h5" if weights_only else "ckpt.keras")
    files.check_saved_file(path)  # complete, not the 3,119 bytes the killed save left
    assert path.read_bytes() == (tmp_path / "epoch1.bytes").read_bytes()
    # the killed save's partial file is beside it, cut short, and the next save overwrites it
    partial = files.partial_path(path)
    assert partial.stat().st_size == 3119
    with pytest.raises(files.TruncatedFile, match="3119 bytes"):
        files.check_saved_file(partial)



@pytest.mark.parametrize("nproc", [2, 3])
def test_a_stalled_rank_is_reported_while_the_others_wait(nproc):
    """At P = 3 also with TFSPARSE_STALL_STACKS: every rank writes its threads' stacks, rank 1's
    showing the callback it sleeps in; at P = 2 (the default, off) none."""
    stacks = nproc == 3
    _, text = mpirun(nproc, "stall.py", 7, 2, timeout=180, env={"TFSPARSE_STALL_STACKS": "1"} if stacks else None)
    assert text.count("fit returned") == nproc, text[-3000:]  # the stall ends, training goes on
    assert "a collective has waited more than 2 s" in text, text[-3000:]
    assert "rank 1 has not arrived" in text, text[-3000:]
    assert re.search(r"rank 1: round \d+, not in a collective: left its last collective \(\w+\) \d+ s ago", text), \
        text[-3000:]
    assert re.search(r"rank 0: round \d+, waiting in \w+ for \d+ s", text), text[-3000:]
    heads = {r: f"tfsparse: rank {r}'s threads at a stall inquiry (stall_stacks):" in text for r in range(nproc)}
    assert heads == {r: stacks for r in range(nproc)}, text[-3000:]
    assert ("in on_train_batch_end" in text) == stacks, text[-3000:]  # only rank 1 is in the callback


def test_a_rank_that_holds_the_gil_is_shown_by_faulthandler():
    """Rank 1 holds Python's GIL for 10 s (libc's sleep through ctypes.PyDLL): its watch thread
    cannot answer the inquiry (made after 2 s, answers awaited 5 s), so the report says "no
    answer", and with TFSPARSE_STALL_STACKS faulthandler's own thread writes rank 1's stacks
    once its watch thread has not run for the 2 s of the warning: where it stopped; when it runs
    again, it says for how long it could not."""
    _, text = mpirun(2, "stall.py", 10, 2, "gil", timeout=180, env={"TFSPARSE_STALL_STACKS": "1"})
    assert text.count("fit returned") == 2, text[-3000:]
    assert "rank 1: no answer (a thread holding Python's GIL, a process not scheduled" in text, text[-3000:]
    # once it runs again, its watch thread says how long it could not (10 s less at most a poll)
    late = re.search(r"rank 1's watch thread could not run for (\d+) s \(a thread of this process held", text)
    assert late and 5 <= int(late.group(1)) <= 11, text[-3000:]
    # faulthandler's head line and its form of a frame (no comma before "in"), rank 1's stacks written
    # seconds before the asking rank's (after the answers)
    assert "Timeout (0:00:02.500000)!" in text and re.search(r"line \d+ in on_train_batch_end", text), text[-3000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_stall_longer_than_the_timeout_ends_every_rank(nproc):
    started = time.time()
    _, text = mpirun(nproc, "stall.py", 600, "none", timeout=180, env={"TFSPARSE_STALL_TIMEOUT": "4"},
                     expect_fail=True)
    stopped = float(re.search(r"rank 1: stops for 600 s at ([0-9.]+)", text).group(1))
    assert time.time() - stopped < 4 + 30, text[-3000:]  # the timeout plus 30 s, every rank ended
    # whichever waiting rank passes the timeout first ends the job (at P = 3, rank 0 or rank 2)
    waiting = re.search(r"stall timeout: rank (\d+) waited", text)
    assert waiting and waiting.group(1) != "1" and "rank 1 has not arrived" in text, text[-3000:]
    assert "fit returned" not in text and time.time() - started < 150, text[-3000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_data_of_unknown_length_that_runs_out_early_ends_the_epoch_on_every_rank(nproc):
    res, _ = mpirun(nproc, "uneven.py", "end", timeout=240)
    for r in res:
        assert r["steps"] == [9, 9, 9]  # the last rank has 9 batches, the others 10
        np.testing.assert_array_equal(r["weights"], res[0]["weights"])
        assert r["eval"] == res[0]["eval"]
        assert r["freed"] == [True, True, True]  # model, strategy, exchange
        # validation each epoch, an evaluate inside fit and one before it, on data of known length whose
        # last rank has a batch fewer: the ranks with fewer take part in the others' remaining averagings
        assert r["uneven"] == res[0]["uneven"] and len(r["uneven"]) == 6
        counts = ", ".join(f"rank {q}: {9 if q == nproc - 1 else 10}" for q in range(nproc))
        assert r["beyond"] is not None and f"({counts})" in r["beyond"], r["beyond"]  # steps=10: caught everywhere
        for sharded, whole in r["uneven"]:
            assert abs(sharded - whole) <= 1e-6 * max(1.0, abs(whole)), r["uneven"]


@pytest.mark.parametrize("nproc", [2, 3])
def test_uneven_data_error_policy_raises_step_count_mismatch(nproc):
    _, text = mpirun(nproc, "uneven.py", "error", timeout=240, expect_fail=True)
    assert "StepCountMismatch" in text and f"rank {nproc - 1} ran out of data after 9 batches" in text, text[-3000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_an_empty_shard_is_named(nproc):
    _, text = mpirun(nproc, "uneven.py", "empty", timeout=240, expect_fail=True)
    assert f"rank {nproc - 1} has no data for fit (an empty shard)" in text, text[-3000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_step_count_mismatch_reaches_the_callers_except(nproc):
    res, _ = mpirun(nproc, "uneven.py", "known", timeout=240)
    for r in res:
        assert r["caught"] is not None and "rank 0: 4, rank 1: 6" in r["caught"], r


@pytest.mark.parametrize("nproc", [2, 3])
def test_one_traceback_when_a_rank_raises(nproc):
    _, text = mpirun(nproc, "faults.py", "raise", "mpi", timeout=180, expect_fail=True)
    assert text.count("Traceback (most recent call last)") == 1, text[-4000:]
    assert "RuntimeError: a callback failed on rank 1" in text, text[-3000:]
    for r in set(range(nproc)) - {1}:  # the others: one line each, naming the rank that failed
        assert f"tfsparse: rank {r} stops: rank 1 failed with RuntimeError" in text, text[-3000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_an_error_raised_alike_on_every_rank_is_printed_once(nproc):
    """Known batch counts differ: every rank raises the same StepCountMismatch; rank 0 prints its
    traceback, the others one line each."""
    _, text = mpirun(nproc, "uneven.py", "known_uncaught", timeout=180, expect_fail=True)
    assert text.count("Traceback (most recent call last)") == 1, text[-4000:]
    for r in range(1, nproc):
        assert (f"tfsparse: rank {r} stopped with StepCountMismatch: ranks were given different numbers of batches "
                f"per epoch (rank 0: 4, rank 1: 6") in text and "the same error as on rank 0" in text, text[-3000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_gradient_accumulation_exchanges_once_per_applied_update(nproc):
    res, _ = mpirun(nproc, "accumulate.py", timeout=240)
    for r in res:
        assert r["iterations"] == 4 and r["rounds"] == 4  # 8 steps, accumulated in pairs
        np.testing.assert_array_equal(r["weights"], res[0]["weights"])
        np.testing.assert_allclose(r["weights"], r["reference"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nproc", [2, 3])
def test_batchnorm_statistics_of_a_custom_loop_are_averaged_by_one_call(nproc):
    res, _ = mpirun(nproc, "custom_loop_bn.py", timeout=240)
    mean_before = np.mean([r["before"].astype(np.float64) for r in res], axis=0)
    assert not np.array_equal(res[0]["before"], res[1]["before"])  # each rank's own statistics
    for r in res:
        np.testing.assert_array_equal(r["after"], res[0]["after"])
        np.testing.assert_allclose(r["after"], mean_before, rtol=1e-6)
        np.testing.assert_array_equal(r["trainable"], res[0]["trainable"])


@pytest.mark.parametrize("nproc", [2, 3])
def test_configuration_mismatch_reaches_the_callers_except(nproc):
    res, _ = mpirun(nproc, "uneven.py", "other_algorithm", timeout=240)
    for r in res:
        assert r["caught"] is not None, r
        assert f"rank {nproc - 1} differs from rank 0" in r["caught"] and "'gtopk' vs 'topk'" in r["caught"], r


@pytest.mark.parametrize("nproc", [2, 3])
def test_join_trains_on_every_batch_with_zero_weights_where_a_rank_ran_out(nproc):
    res, _ = mpirun(nproc, "uneven.py", "join", timeout=240)
    for r in res:
        assert r["steps"] == [10, 10]  # every batch of the ranks with 10; the last rank joins with weight 0
        np.testing.assert_array_equal(r["weights"], res[0]["weights"])
        np.testing.assert_array_equal(r["weights"], r["reference"])
