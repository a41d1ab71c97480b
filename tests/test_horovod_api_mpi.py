"""``tfsparse.horovod.tensorflow`` -- Horovod's names and meaning for scripts moved from Horovod --
on real ranks under ``mpirun`` and ``horovodrun`` (P = 2 and the non-power-of-two 3): the
process queries, ``allreduce`` (every op, the scale factors, fp16 compression, integers,
IndexedSlices), ``allgather`` (ranks of different lengths), ``broadcast``, ``broadcast_variables``
(eagerly and in a ``tf.function``), Horovod's gradients of the three collectives, collectives of a
``tf.function`` in the order written, ``broadcast_object`` and ``allgather_object``, the questions
about the build (``mpi_built()``, ``nccl_built()``, ...), each against its numpy reference, and a custom training
loop as Horovod's TF2 examples write it (``DistributedGradientTape``, ``broadcast_variables``
after the first batch; an Embedding among the layers) (tests/workers/horovod_api.py);
and the errors: before ``init``, after ``shutdown``, unsupported ops, process sets and names.
``tfsparse.horovod.tensorflow.keras`` the same way (tests/workers/horovod_keras.py): ``model.fit``
as Horovod's Keras examples write it (DistributedOptimizer, BroadcastGlobalVariablesCallback,
MetricAverageCallback, LearningRateWarmupCallback; an Embedding; every rank its own initial
weights), each update against the numpy mean (``op=Sum``: sum) of the ranks' own gradients
(``gradient_predivide_factor``, ``Compression.fp16``, ``backward_passes_per_step``),
LearningRateScheduleCallback with momentum correction, ``algorithm="gtopk"`` one keyword away."""
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
        b = res["built"]
        assert b["is_homogeneous"] is True and b["mpi_built"] is True and b["mpi_enabled"] is True  # (Horovod: MPI)
        assert isinstance(b["mpi_threads_supported"], bool) and b["cuda_built"] == "bool"
        assert b["nccl_built"] == 0 and not any(b[k] for k in ("gloo_enabled", "gloo_built", "ddl_built", "ccl_built",
                                                                "rocm_built"))
        o = res["objects"]
        assert o["broadcast"] == [8, 30]  # rank 1's epoch and its lambda (v * 3)
        assert o["gathered"] == [{"rank": q, "rows": list(range(q + 1))} for q in range(P)]
        assert "broadcast_object sends a Python object: call it eagerly" in o["in_function"], o["in_function"]
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
                                       "horovod.tensorflow.join; provided: init, shutdown")
        assert "rank >= 1" in e["scalar"]
        assert "accepted: num_groups=0, groups=None" in e["groups"]
        shapes = ", ".join(f"(2, {q + 1})" for q in range(P))
        why = ("allgather: every rank's tensor must have the same rank and the same dimensions after the first; "
               f"got shapes [{shapes}]")
        assert e["shapes"] == f"ValueError: {why}"
        assert e["shapes_graph"].startswith("InvalidArgumentError: ") and why in e["shapes_graph"], e["shapes_graph"]
        ranks = ", ".join(f"rank {q}: float32 [{q + 1}]" for q in range(P))
        assert e["reduce_shapes"] == f"ValueError: allreduce: every rank's tensor must have the same shape and " \
                                     f"dtype; got {ranks}"
        assert e["reduce_dtypes"].endswith("got rank 0: float64 [2], " +
                                           ", ".join(f"rank {q}: float32 [2]" for q in range(1, P))), e["reduce_dtypes"]
        assert e["gather_dtypes"] == "ValueError: allgather: every rank's tensor must have the same dtype; got " + \
            ", ".join(f"rank {q}: {'int32' if q == 1 else 'int64'}" for q in range(P))
        assert e["bcast_shapes"].startswith("ValueError: broadcast: ") and f"rank {P - 1}: float32 [1, {P}]" in \
            e["bcast_shapes"], e["bcast_shapes"]
        assert e["after_shapes"] == [float(q) for q in range(P)]
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


def under_horovodrun(tmp_path, worker: str, P: int, timeout: float) -> list:
    """``horovodrun -np P`` of ``tests/workers/<worker>``; the ranks' results (skipped without a
    Horovod built with MPI)."""
    from tfsparse.collectives import horovod_available

    if not horovod_available():
        pytest.skip("Horovod is not installed with MPI (bash tools/install.sh --horovod builds it)")
    run_locked([launcher("horovodrun"), "-np", str(P), "-H", f"localhost:{P}", sys.executable,
                str(REPO / "tests" / "workers" / worker)], timeout=timeout,
               env={"TFSPARSE_TEST_OUT": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "3"})
    return [load_result(tmp_path, r) for r in range(P)]


@pytest.mark.horovod
@pytest.mark.parametrize("P", [2, 3])
def test_horovod_api_under_horovodrun(tmp_path, P):
    _check(under_horovodrun(tmp_path, "horovod_api.py", P, 300), P, "horovod")


def _check_keras(results, P, backend):
    assert len(results) == P
    lossless = 2e-6  # float32 sums in another order than the float64 reference
    for r, res in enumerate(results):
        assert res["backend"] == backend and res["name"] == "HorovodOptimizer"
        # Horovod's Keras example: rank 0's weights and optimizer state everywhere, the epoch logs
        # the ranks' mean (the same History on every rank), the loss falling, Horovod's warm-up
        np.testing.assert_array_equal(res["fit_weights"], results[0]["fit_weights"])
        assert res["history"] == results[0]["history"]
        assert res["metric_error"] < 1e-9
        assert res["history"]["loss"][-1] < 0.6 * res["history"]["loss"][0], res["history"]["loss"]
        assert res["lr_error"] < 1e-6, (res["lr_error"], res["lrs"])
        u = res["updates"]
        for key in ("average", "sum", "predivide", "passes", "passes averaged", "passes in fit"):
            assert u[key] < lossless, (key, u)
        assert u["fp16"] < 2e-3, u
        assert res["passes"] == [True, 2, True, 2]  # no update after the first pass; iterations count both
        # a None gradient in every pass: left out, the other exchanged once after both (the mean of 3 (q + 1))
        assert res["accumulate_none"] == [[0.0] * 3, [-1.5 * (P + 1)] * 3, [1.0, 1.0]], res["accumulate_none"]
        # staircase schedule, 0.1 * 0.5 ** (epoch - 1) from epoch 1 to 2: 0.1, 0.1, 0.05, then left at 0.05
        np.testing.assert_allclose(res["schedule_lrs"], [0.1] * 4 + [0.05] * 4, rtol=1e-6)
        assert res["correction"] < 1e-6
        np.testing.assert_array_equal(res["schedule_weights"], results[0]["schedule_weights"])
        np.testing.assert_array_equal(res["sparse_weights"], results[0]["sparse_weights"])
        assert res["sparse_losses"][-1] < 0.8 * res["sparse_losses"][0], res["sparse_losses"]
        # local_variables: that kernel each rank's own (fit's replica check passed), the rest rank 0's
        assert (r == 0) == np.array_equal(res["local_head"], results[0]["local_head"])
        np.testing.assert_array_equal(res["local_rest"], results[0]["local_rest"])
        # a local BatchNormalization moving mean is not averaged at fit's end; the moving variance is
        assert (r == 0) == np.array_equal(res["local_mean"], results[0]["local_mean"])
        np.testing.assert_array_equal(res["averaged_variance"], results[0]["averaged_variance"])
        e = res["errors"]
        assert "op=3 is not supported; accepted: hvd.Average, hvd.Sum (DistributedOptimizer" in e["op"]
        assert "backward_passes_per_step=0 is not valid; accepted: an integer >= 1" in e["passes"]
        assert "gradient_predivide_factor=2.0 needs op=hvd.Average" in e["predivide"]
        assert "accepted: a keras.optimizers.Optimizer (Keras 3)" in e["v1"]
        assert e["missing"].startswith("AttributeError: tfsparse.horovod.tensorflow.keras.callbacks does not provide "
                                       "horovod.tensorflow.keras.callbacks.BestModelCheckpoint; provided: "
                                       "BroadcastGlobalVariablesCallback")
        assert "horovod.tensorflow.keras.load_model; provided:" in e["load_model"]


@pytest.mark.parametrize("P", [2, 3])
def test_horovod_keras_under_mpirun(P):
    results, _ = mpirun(P, "horovod_keras.py", timeout=400)
    _check_keras(results, P, "mpi")


@pytest.mark.horovod
@pytest.mark.parametrize("P", [2, 3])
def test_horovod_keras_under_horovodrun(tmp_path, P):
    _check_keras(under_horovodrun(tmp_path, "horovod_keras.py", P, 400), P, "horovod")
