"""The device-resident exchange (tfsparse.space.CudaSpace) without a GPU, under Numba's CUDA
simulator: every algorithm, memory and mode gives the host exchange's results bit for bit, the
selection of topk/gtopk/dragonn runs on the device, and on real mpirun jobs (P = 2, 3) the
device exchange equals the reference computed from all ranks' inputs on every rank."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from exchange_ref import reference_run
from mpi_harness import mpirun
from ops_cuda_workers.device_exchange import CHECK_NAMES
from ops_cuda_workers.sim_check import run_in_simulator
from test_exchange_pipeline import DENSITY, OPTIONS, STEPS, flat, grads_of

WORKER = Path(__file__).resolve().parent / "ops_cuda_workers" / "device_exchange.py"
SIM_ENV = {"NUMBA_ENABLE_CUDASIM": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.fixture(scope="module")
def sim_results():
    pytest.importorskip("numba.cuda")
    return run_in_simulator(WORKER, timeout=600)


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_device_exchange_in_simulator(sim_results, name):
    assert sim_results.get(name) == "ok", sim_results.get(name, f"check {name} did not run")


CASES = ("topk:float32", "gtopk:bfloat16", "dragonn:float32", "oktopk:float32", "dense:int8")


def check_device_equals_host_and_reference(results, P, cases):
    """Per round and rank: the device exchange's result bit-identical on every rank and to the
    host exchange's (itself checked against the references in test_exchange_mpi.py, Ok-Topk's
    threshold reuse included), the residuals equal, and both equal to the reference computed from
    all ranks' gradients."""
    grads = [[flat(grads_of(r, s)) for r in range(P)] for s in range(STEPS)]
    for case in cases:
        algorithm, wire = case.split(":")
        buckets = [tuple(b) for b in results[0][f"{case}/buckets"].tolist()]
        want = None if algorithm == "oktopk" else reference_run(algorithm, wire, buckets, grads, DENSITY,
                                                                 options=OPTIONS.get(algorithm))
        for s in range(STEPS):
            for r in range(P):
                got = results[r][f"{case}/dev{s}"]
                np.testing.assert_array_equal(got.view(np.uint32), results[0][f"{case}/dev{s}"].view(np.uint32),
                                              err_msg=f"{case}: ranks differ")
                np.testing.assert_array_equal(got.view(np.uint32), results[r][f"{case}/host{s}"].view(np.uint32),
                                              err_msg=f"{case}: device != host")
                np.testing.assert_array_equal(results[r][f"{case}/devres{s}"], results[r][f"{case}/hostres{s}"],
                                              err_msg=f"{case}: residuals differ")
                if want is not None:
                    result, residuals = want[s]
                    np.testing.assert_allclose(got, result, rtol=2e-5, atol=2e-5, err_msg=case)
                    if residuals is not None:
                        np.testing.assert_allclose(results[r][f"{case}/devres{s}"], residuals[r], rtol=2e-5,
                                                   atol=2e-5, err_msg=case)


@pytest.mark.mpi
@pytest.mark.parametrize("P", [2, 3])
def test_device_exchange_on_mpi_ranks_equals_reference(P):
    results, _ = mpirun(P, "device_exchange_mpi.py", *CASES, timeout=600, env=SIM_ENV)
    check_device_equals_host_and_reference(results, P, CASES)
    assert all(all(r["device"]) for r in results)


# synchronous rounds only: a pipelined round's decode on the communication thread would overlap the
# next step's kernels, which the simulator cannot run at once (the single-process simulator worker
# checks the pipelined TF glue, inline)
TF_CASES = ("topk:float32", "gtopk:bfloat16", "dragonn:float32", "oktopk:float32")


@pytest.mark.mpi
@pytest.mark.parametrize("P", [3])
def test_tf_glue_on_the_cuda_path_equals_the_host_path_on_mpi_ranks(P):
    """GradientExchange inside a tf.function, its "cuda" path (tf.py_function, the gradients
    viewed on the device, a CudaSpace) against its host path (tf.numpy_function), as above, at
    P = 3 (the device exchange itself is checked at P = 2 and 3 above)."""
    pytest.importorskip("tensorflow")
    results, _ = mpirun(P, "device_exchange_tf_mpi.py", *TF_CASES, timeout=600, env=SIM_ENV)
    for case in TF_CASES:
        for r in range(P):
            assert results[r][f"{case}/dev/ops"] == ["EagerPyFunc"] and results[r][f"{case}/dev/space"] == "cuda"
            assert results[r][f"{case}/host/ops"] == ["PyFunc"] and results[r][f"{case}/host/space"] == "host"
    check_device_equals_host_and_reference(results, P, TF_CASES)


def test_tf_glue_picks_the_path_from_where_the_gradients_live():
    """tfsparse.ops.tf.exchange_device: the host path (None) on the "cpu" path and for gradients
    placed on a CPU even when the "cuda" path is chosen (outside the simulator); on the "cuda"
    path, gradients placed on a GPU stay there and unplaced ones go to TF's first GPU (here, with
    no GPU, the CPU device: what the simulator tests run on)."""
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("numba.cuda")
    from tfsparse.ops import tf as ops_tf

    with tf.device("/cpu:0"):
        on_cpu = tf.zeros([3])

    class Placed:
        device = "/job:localhost/replica:0/task:0/device:GPU:1"

    try:
        ops_tf.set_path("cpu")
        assert ops_tf.exchange_device([on_cpu]) is None
        assert ops_tf.exchange_device([Placed()]) is None
        ops_tf.set_path("cuda")
        assert ops_tf.exchange_device([on_cpu]) is None
        assert ops_tf.exchange_device([Placed()]) == Placed.device

        chosen = []

        @tf.function
        def unplaced(x):
            y = x * 2.0
            assert y.device == ""
            chosen.append(ops_tf.exchange_device([y]))
            return y

        unplaced.get_concrete_function(tf.TensorSpec([3], tf.float32))
        assert chosen == ["/device:CPU:0"]  # no GPU here
        assert ops_tf.exchange_device([tf.constant([1.0])]) is None  # eager: placed on the CPU
    finally:
        ops_tf.set_path(None)


@pytest.mark.mpi
def test_gpu_exchange_benchmark_checks_bits_across_ranks_in_the_simulator(tmp_path):
    """tools/bench_gpu_exchange.py (what tools/gpu_check.sh runs on a GPU) on 2 MPI ranks under the
    simulator (3 ranks above): every setting's device exchange equals the host exchange bit for bit
    on every rank, the ranks agree, and rank 0 writes the report (no timings there: the simulator
    is slow)."""
    import json
    import sys

    from mpi_harness import REPO, run_locked
    from tfsparse.run import build_command

    tool = REPO / "tools" / "bench_gpu_exchange.py"
    cmd, env = build_command(2, [sys.executable, str(tool), "--model", "tiny", "--density", "0.1", "--steps", "1",
                                 "--warmup", "1", "--out", str(tmp_path)])
    text = run_locked(cmd, timeout=600, env={**env, **SIM_ENV, "OMPI_MCA_rmaps_base_oversubscribe": "1"})
    report = json.loads((tmp_path / "gpu_exchange_tiny.json").read_text())
    assert report["machine"]["ranks"] == 2 and report["failures"] == [], text[-3000:]
    assert set(report["settings"]) == {"topk", "gtopk", "dragonn", "dense:int8"}
    for r in report["settings"].values():
        assert r["device_equals_host"] and r["residual_equals_host"] and r["ranks_agree"]
