"""The last resort behind MPI_Abort: a rank whose abort blocks (Open MPI's PMIx_Abort can
deadlock) still ends, non-zero, so ``mpirun`` ends the job instead of hanging; and the departure
watch's messages, sent from two threads, all kept."""
import signal
import subprocess
import sys
import threading
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


class _Pending:
    """A send request that never completes; counts the ``Test`` calls running at once."""
    running = 0
    most = 0
    guard = threading.Lock()

    def Test(self):
        with _Pending.guard:
            _Pending.running += 1
            _Pending.most = max(_Pending.most, _Pending.running)
        time.sleep(0)  # lets the other thread run here, as MPI_Test's own call may
        with _Pending.guard:
            _Pending.running -= 1
        return False


def test_the_departure_watch_keeps_every_send_made_from_two_threads():
    """The watch thread answers inquiries (``_send``) while the failing main thread announces
    its failure (``_send`` and the wait on the sends): no request is lost from the list the
    announcement waits on, and none is tested by both threads at once (MPI forbids completing
    one request from two threads)."""
    from tfsparse.collectives.watchdog import DepartureWatch

    class Comm:
        def isend(self, obj, dest, tag):
            return _Pending()

    _Pending.most = 0
    watch = object.__new__(DepartureWatch)  # without MPI: only the send bookkeeping is used
    watch._comm, watch._sends, watch._sending = Comm(), [], threading.RLock()

    def sends():
        for i in range(100):
            watch._send(i, 1, 0)
            watch._sends_pending()

    threads = [threading.Thread(target=sends, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)  # a deadlock fails here, not at the interpreter's exit
    assert len(watch._sends) == 200 and _Pending.most == 1
