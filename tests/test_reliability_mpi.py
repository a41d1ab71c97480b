"""Faults that must neither hang nor lose data, under real mpirun (P = 2 and 3): a rank killed
while it writes a checkpoint leaves the previous checkpoint loadable."""
from __future__ import annotations

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

