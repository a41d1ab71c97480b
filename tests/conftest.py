import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402

# `make test-fast` runs `pytest -m fast`: the development subset, chosen here and nowhere else --
# every test not marked `mpi` except the slow ones in NOT_FAST, plus one small MPI job per area in
# FAST_MPI.  An entry without "[...]" names every parameter set of a test.  `make test` runs all.
FAST_MPI = (
    "tests/test_exchange_mpi.py::test_every_wire_and_plan_equals_reference[3-topk]",       # exchange
    "tests/test_aggregators_mpi.py::test_result_equals_reference_and_volume[3-oktopk]",    # aggregators
    "tests/test_foundation_mpi.py::test_tfsparse_run_launches_ranks_on_the_mpi_backend_by_default",  # launcher
    "tests/test_foundation_mpi.py::test_horovodrun_launch_uses_the_horovod_backend",       # Horovod
    "tests/test_foundation_mpi.py::test_fit_digits_all_routes[2]",                         # Keras fit, both routes
    "tests/test_callbacks_mpi.py::test_rank_zero_only_tensorboard_and_csv_write_on_rank_zero_alone[strategy]",
    "tests/test_foundation_mpi.py::test_checkpoint_holds_every_ranks_residual_and_restores",  # checkpoints
    "tests/test_backup_mpi.py::test_resumed_training_is_bit_identical_p2",                 # BackupAndRestore
    "tests/test_foundation_mpi.py::test_a_failing_or_departing_rank_ends_every_rank_within_a_minute"
    "[raise-strategy-mpi]",                                                                # failures
    "tests/test_reliability_mpi.py::test_one_traceback_when_a_rank_raises[3]",             # reliability
    "tests/test_pipe_sgd.py::test_keras_updates_follow_the_pipelined_sequence[2-strategy]",  # Pipe-SGD
    "tests/test_examples.py::test_custom_loop",                                            # examples
    "tests/test_replicas_mpi.py::test_every_rank_ends_with_the_same_bits[2-text-topk-adam]",  # replicas
)
NOT_FAST = (  # not marked `mpi`, but too slow for the development loop (CUDA simulator, mpirun jobs)
    "tests/test_tools.py::test_bench_kernels_cuda_path_runs_in_the_simulator",
    "tests/test_ops_cuda.py::test_cuda_kernel_matches_reference_in_simulator",
    "tests/test_exchange_device.py::test_device_exchange_in_simulator",
    "tests/test_pipe_sgd.py::test_keras_updates_follow_the_pipelined_sequence",
    "tests/test_pipe_sgd.py::test_keras_dsync_warmup_then_pipelined_int8",
    "tests/test_pipe_sgd.py::test_a_rank_failing_during_a_pending_exchange_stops_every_rank",
)


def _listed(nodeid: str, entries) -> str | None:
    return next((e for e in entries if nodeid == e or ("[" not in e and nodeid.split("[")[0] == e)), None)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    used = set()
    for item in items:
        fast = _listed(item.nodeid, FAST_MPI)
        if fast or (item.get_closest_marker("mpi") is None and not _listed(item.nodeid, NOT_FAST)):
            item.add_marker(pytest.mark.fast)
        used.update(e for e in (fast, _listed(item.nodeid, NOT_FAST)) if e)
    # under -m fast, an entry naming no test of a collected file is stale (a renamed test): say so
    files = {item.nodeid.split("::")[0] for item in items}
    stale = [e for e in FAST_MPI + NOT_FAST if e not in used and e.split("::")[0] in files]
    if "fast" in (config.getoption("markexpr") or "") and stale and not any("::" in a for a in config.args):
        raise pytest.UsageError(f"tests/conftest.py names tests that do not exist (renamed?): {stale}")
