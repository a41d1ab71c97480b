"""Faults that must neither hang nor lose data, under real mpirun (P = 2 and 3): a rank killed
while it writes a checkpoint leaves the previous checkpoint loadable; a rank that stops is
reported by name while the others wait, and a stall longer than the timeout ends every rank."""
from __future__ import annotations

import re
import time

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
    _, text = mpirun(nproc, "stall.py", 7, 2, timeout=180)
    assert text.count("fit returned") == nproc, text[-3000:]  # the stall ends, training goes on
    assert "a collective has waited more than 2 s" in text, text[-3000:]
    assert "rank 1 has not arrived" in text, text[-3000:]
    assert re.search(r"rank 1: round \d+, not in a collective: left its last collective \(\w+\) \d+ s ago", text), \
        text[-3000:]
    assert re.search(r"rank 0: round \d+, waiting in \w+ for \d+ s", text), text[-3000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_stall_longer_than_the_timeout_ends_every_rank(nproc):
    started = time.time()
    _, text = mpirun(nproc, "stall.py", 600, "none", timeout=180, env={"TFSPARSE_STALL_TIMEOUT": "4"},
                     expect_fail=True)
    stopped = float(re.search(r"rank 1: stops for 600 s at ([0-9.]+)", text).group(1))
    assert time.time() - stopped < 4 + 30, text[-3000:]  # the timeout plus 30 s, every rank ended
    assert "stall timeout: rank 0 waited" in text and "rank 1 has not arrived" in text, text[-3000:]
    assert "fit returned" not in text and time.time() - started < 150, text[-3000:]
