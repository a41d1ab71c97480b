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


@pytest.mark.mpi
@pytest.mark.parametrize("P", [2, 3])
def test_device_exchange_on_mpi_ranks_equals_reference(P):
    results, _ = mpirun(P, "device_exchange_mpi.py", *CASES, timeout=600, env=SIM_ENV)
    grads = [[flat(grads_of(r, s)) for r in range(P)] for s in range(STEPS)]
    for case in CASES:
        algorithm, wire = case.split(":")
        buckets = [tuple(b) for b in results[0][f"{case}/buckets"].tolist()]
        want = None if algorithm == "oktopk" else reference_run(algorithm, wire, buckets, grads, DENSITY,
                                                                 options=OPTIONS.get(algorithm))
        for s in range(STEPS):
            for r in range(P):
                got = results[r][f"{case}/dev{s}"]
                # bit-identical on every rank, and to the host exchange (itself checked against the
                # references in test_exchange_mpi.py, Ok-Topk's threshold reuse included)
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
    assert all(all(r["device"]) for r in results)
