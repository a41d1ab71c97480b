"""Callbacks on real MPI ranks: ``rank_zero_only`` keeps every other rank's wrapped callback
silent (TensorBoard writes its events in ``set_model`` already)."""
import pytest

from mpi_harness import mpirun

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("route", ["strategy", "optimizer"])
def test_rank_zero_only_tensorboard_and_csv_write_on_rank_zero_alone(tmp_path, route):
    res, _ = mpirun(3, "rank_zero_only.py", tmp_path, route, timeout=240)
    zero = res[0]
    assert any(f.startswith("tb/train/events.out.tfevents") for f in zero["files"]), zero["files"]
    assert any(f.startswith("tb/validation/events.out.tfevents") for f in zero["files"]), zero["files"]
    assert "log.csv" in zero["files"]
    assert sorted(zero["calls"][:2]) == ["set_model", "set_params"]
    assert zero["calls"][2:] == ["on_train_begin", "on_epoch_end", "on_epoch_end"]
    assert zero["inner_has_model"]
    for rank, other in enumerate(res[1:], start=1):
        assert not other["exists"] and other["files"] == [], (rank, other["files"])  # no directory at all
        assert other["calls"] == [], (rank, other["calls"])  # not even set_model / set_params
    for r in res:  # the wrappers themselves know the model and the run's parameters on every rank
        assert r["wrapper_has_model"] and r["wrapper_epochs"] == [2, 2, 2]
