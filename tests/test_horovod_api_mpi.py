"""``tfsparse.horovod.tensorflow`` -- Horovod's names and meaning for scripts moved from Horovod --
on real ranks under ``mpirun`` (P = 2 and the non-power-of-two 3) and ``horovodrun``: the
process queries, ``allreduce`` (every op, the scale factors, fp16 compression, integers,
IndexedSlices), ``allgather`` (ranks of different lengths), ``broadcast``, ``broadcast_variables``
(eagerly and in a ``tf.function``), Horovod's gradients of the three collectives, collectives of a
``tf.function`` in the order written, each against its numpy reference, and a custom training
loop as Horovod's TF2 examples write it (``DistributedGradientTape``, ``broadcast_variables``
after the first batch; an Embedding among the layers) (tests/workers/horovod_api.py);
and the errors: before ``init``, after ``shutdown``, unsupported ops, process sets and names."""
import sys

import numpy as np
import pytest

from mpi_harness import REPO, launcher, load_result, mpirun, run_locked

pytestmark = pytest.mark.mpi


def _check(results, P, backend):
    assert len(results) == P
    for r, res in enumerate(results):
        assert res["failures"] == [], res["failures"]
        assert res["backend"] == backend
        assert res["queries"] == [r, P, r, P, 0, 1, True]  # one host: every rank local, one cross rank
        np.testing.assert_array_equal(res["weights"], results[0]["weights"])  # rank 0's weights everywhere
        assert res["before_init"] == res["after_shutdown"] == \
            "ValueError: Horovod has not been initialized; use hvd.init()."
        e = res["errors"]
        assert "op=hvd.Adasum is not supported by tfsparse.horovod; accepted: hvd.Average, hvd.Sum, hvd.Min, " \
               "hvd.Max" in e["adasum"]
        assert e["both"].startswith("ValueError: op=1 and average=True")
        assert f"root_rank={P} is not valid; accepted: an integer from 0 to {P - 1}" in e["root"]
        assert "process_set=" in e["process_set"] and "accepted: hvd.global_process_set" in e["process_set"]
        assert e["missing"].startswith("AttributeError: tfsparse.horovod.tensorflow does not provide "
                                       "horovod.tensorflow.mpi_threads_supported; provided: init, shutdown")
        assert "rank >= 1" in e["scalar"]
        assert "accepted: num_groups=0, groups=None" in e["groups"]
        # the custom loop (DistributedGradientTape, variables broadcast after the first batch):
        # the same weights and optimizer state on every rank, the loss falling, the tape's
        # gradient the mean of the ranks' own
        np.testing.assert_array_equal(res["loop_weights"], results[0]["loop_weights"])
        assert res["losses"] == results[0]["losses"]
        assert np.mean(res["losses"][-4:]) < 0.5 * np.mean(res["losses"][:4])
        assert res["tape_error"] < 1e-6


@pytest.mark.parametrize("P", [2, 3])
def test_horovod_api_under_mpirun(P):
    results, _ = mpirun(P, "horovod_api.py", timeout=240)
    _check(results, P, "mpi")


@pytest.mark.horovod
def test_horovod_api_under_horovodrun(tmp_path):
    from tfsparse.collectives import horovod_available

    if not horovod_available():
        pytest.skip("Horovod is not installed with MPI (bash tools/install.sh --horovod builds it)")
    run_locked([launcher("horovodrun"), "-np", "3", "-H", "localhost:3", sys.executable,
                str(REPO / "tests" / "workers" / "horovod_api.py")], timeout=300,
               env={"TFSPARSE_TEST_OUT": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "3"})
    _check([load_result(tmp_path, r) for r in range(3)], 3, "horovod")
