"""The last resort behind MPI_Abort: a rank whose abort blocks (Open MPI's PMIx_Abort can
deadlock) still ends, non-zero, so ``mpirun`` ends the job instead of hanging."""
import signal
import subprocess
import sys
import time

import pytest

from mpi_harness import REPO

STUCK = """
import signal, sys, threading, time
from tfsparse.collectives.watchdog import abort_world

class StuckWorld:  # an MPI_Abort that never returns nor ends the process
    def Abort(self, code):
        time.sleep(120)

if sys.argv[2] == "own-handler":
    signal.signal(signal.SIGALRM, lambda *_: None)
go = lambda: abort_world(StuckWorld(), "tfsparse: aborting all 3 ranks (MPI_Abort)\\n", deadline=1.0)
if sys.argv[1] == "thread":  # as the departure watch calls it
    worker = threading.Thread(target=go, daemon=True)
    worker.start()
    worker.join()
else:  # as the excepthook calls it
    go()
print("still alive", flush=True)
"""


@pytest.mark.parametrize("caller", ["main", "thread"])
@pytest.mark.parametrize("handler", ["default", "own-handler"])
def test_a_rank_whose_mpi_abort_blocks_ends_itself_after_the_deadline(caller, handler):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STUCK, caller, handler], capture_output=True, text=True,
                          timeout=60, cwd=str(REPO))
    elapsed = time.monotonic() - started
    assert "aborting all 3 ranks" in proc.stderr
    assert "still alive" not in proc.stdout
    # SIGALRM's default action where the program left it alone, else os._exit(1) from a timer
    assert proc.returncode == (-signal.SIGALRM if handler == "default" else 1), proc.stderr[-2000:]
    assert elapsed < 30, elapsed  # deadline 1 s, plus the interpreter's start and imports
