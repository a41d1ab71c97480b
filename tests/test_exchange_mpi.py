"""The exchange pipeline on real mpirun jobs (P = 2, 3, 4): every algorithm x wire dtype x plan
(CSC included; GradientFlow's momentum correction and previous-step chunk choice; the dense
16/8-bit exchange decoding in pieces) equals the reference computed from all ranks' inputs
(tests/exchange_ref.py), bit-identical on every rank; dense float16 sends exactly half of
float32's bytes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from exchange_ref import dense_ring_round, dense_round, reference_run
from mpi_harness import mpirun
from test_exchange_pipeline import ALGOS, DENSITY, OPTIONS, PLANS, STEPS, WIRES, flat, grads_of
from test_gradientflow import MPI_CASES, STEPS as GF_STEPS, mpi_case_reference

pytestmark = pytest.mark.mpi

#: the dense 16/8/4-bit exchanges that tests/workers/exchange_matrix.py runs decoding in pieces of
#: one int8 chunk (``wire.DECODE_PIECE``), the communicator's progress called between them
PIECES = {"int8": ("int8", {}), "int8-ring": ("int8", {"reduce_scatter": "ring"}),
          "bfloat16": ("bfloat16", {}), "float16": ("float16", {}),
          "int4": ("int4", {}), "int4-ring": ("int4", {"reduce_scatter": "ring"})}


def pieces_grads(rank: int) -> list[np.ndarray]:
    """40,003 values: a block of 10,000 or more at P <= 4, three int8 chunks and a part."""
    rng = np.random.default_rng([rank, 77])
    return [rng.laplace(size=(200, 200)).astype(np.float32), rng.standard_normal(3).astype(np.float32)]


@pytest.fixture(scope="module", params=[2, 3, 4])
def job(request):
    P = request.param
    results, _ = mpirun(P, "exchange_matrix.py", timeout=300)
    assert all(r["P"] == P for r in results)
    assert not any(r["tensorflow_imported"] for r in results)
    return P, results


@pytest.mark.parametrize("algorithm", ALGOS)
def test_every_wire_and_plan_equals_reference(job, algorithm):
    P, results = job
    grads = [[flat(grads_of(r, s)) for r in range(P)] for s in range(STEPS)]
    for wire in WIRES:
        for plan in PLANS:
            key = f"{algorithm}/{wire}/{plan}"
            meta = json.loads(results[0][f"{key}/meta"])
            want = reference_run(algorithm, wire, meta["buckets"], grads, DENSITY, meta["infos"],
                                 OPTIONS.get(algorithm))
            for s in range(STEPS):
                result, residuals = want[s]
                for r in range(P):
                    got = results[r][f"{key}/out{s}"]
                    np.testing.assert_array_equal(got, results[0][f"{key}/out{s}"], err_msg=f"{key}: ranks differ")
                    np.testing.assert_allclose(got, result, rtol=2e-5, atol=2e-5, err_msg=key)
                    np.testing.assert_array_equal(np.flatnonzero(got), np.flatnonzero(result), err_msg=key)
                    if residuals is not None:
                        np.testing.assert_allclose(results[r][f"{key}/res{s}"], residuals[r], rtol=2e-5, atol=2e-5,
                                                   err_msg=key)


@pytest.mark.parametrize("name", list(MPI_CASES))
def test_gradientflow_cases_equal_reference(job, name):
    """CSC with the paper's previous-step chunk choice, and momentum correction (CSC, topk,
    dense), against the references from every rank's gradients."""
    P, results = job
    for s, (result, residuals) in enumerate(mpi_case_reference(name, P)[:GF_STEPS]):
        for r in range(P):
            got = results[r][f"{name}/out{s}"]
            np.testing.assert_array_equal(got, results[0][f"{name}/out{s}"], err_msg=f"{name}: ranks differ")
            np.testing.assert_allclose(got, result, rtol=2e-5, atol=2e-5, err_msg=name)
            np.testing.assert_array_equal(np.flatnonzero(got), np.flatnonzero(result), err_msg=name)
            np.testing.assert_allclose(results[r][f"{name}/res{s}"], residuals[r], rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("key", list(PIECES))
def test_dense_decoding_in_pieces_equals_reference(job, key):
    """Decoding in pieces with Open MPI's progress run between them (what moves the blocks still
    on the wire) changes no value: the sum and every residual equal the reference exactly."""
    P, results = job
    wire, options = PIECES[key]
    round_of = dense_ring_round if options.get("reduce_scatter") == "ring" else dense_round
    result, residuals, _ = round_of([flat(pieces_grads(r)) for r in range(P)], wire)
    for r in range(P):
        assert results[r]["pieces/progress_calls"] > 0
        np.testing.assert_array_equal(results[r][f"pieces/{key}/out"], result.astype(np.float32), err_msg=key)
        np.testing.assert_array_equal(results[r][f"pieces/{key}/res"], residuals[r], err_msg=key)


def test_dense_half_precision_sends_half_the_bytes(job):
    P, results = job
    for r in range(P):
        b32 = json.loads(results[r]["dense/float32/fused/meta"])["bytes"]
        for wire in ("float16", "bfloat16"):
            b16 = json.loads(results[r][f"dense/{wire}/fused/meta"])["bytes"]
            n = 2050
            if n % P == 0:
                assert b16 == [b // 2 for b in b32]
            # exactly: every block but this rank's out, every block but the successor's in
            counts = [n // P + (1 if i < n % P else 0) for i in range(P)]
            assert b16 == [2 * (2 * n - counts[r] - counts[(r + 1) % P])] * STEPS
