"""One MPI job at a time, and ending every process of a job: shared by the tests
(:mod:`mpi_harness`) and the benchmarks in ``tools/`` -- not part of the library.

The tests import it as ``mpi_jobs`` (``tests/`` is on their path), the tools as
``tests.mpi_jobs`` (they put the repository root on ``sys.path``).  It needs only the standard
library and :mod:`tfsparse.run` (numpy, not TensorFlow), so importing it costs a tool little.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import tempfile
import time
from pathlib import Path

from tfsparse.run import live_descendants, process_table

MPI_LOCK = Path(tempfile.gettempdir()) / "tfsparse-mpi.lock"


@contextlib.contextmanager
def mpi_lock(announce: bool = False):
    """Held while one MPI job runs: the tests, the benchmarks and the tools take it, so that
    jobs on a small machine run one at a time instead of sharing its cores.  ``announce``:
    say so on stdout when the lock is held by another job and this one waits."""
    with open(MPI_LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if announce:
                print(f"  waiting for the MPI lock {MPI_LOCK} ...", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def session_processes(leader: int) -> dict[int, str]:
    """The live processes of the session ``leader`` leads (a launcher started with
    ``start_new_session=True``) and its descendants, whatever session they moved to:
    ``{pid: "state command line"}`` (zombies left out)."""
    table = process_table()
    found = {pid for pid, (_, _, session) in table.items() if session == leader}
    found |= live_descendants(leader, table)
    live = {}
    for pid in sorted(found):
        if pid in table and table[pid][0] != "Z":
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            live[pid] = f"{table[pid][0]} {command}"
    return live


def kill_session(leader: int, sig: int = signal.SIGKILL, wait: float = 10.0) -> dict[int, str]:
    """Sends ``sig`` to every process of :func:`session_processes` (Open MPI starts each rank in
    a process group of its own, so a signal to the launcher's group alone leaves the ranks
    running, reparented to init), then waits up to ``wait`` seconds until they are gone: a
    killed process lingers while the kernel tears it down.  Returns those still there."""
    for pid in session_processes(leader):
        try:
            os.kill(pid, sig)
        except OSError:  # gone meanwhile, or not ours
            pass
    deadline = time.monotonic() + wait
    while (left := session_processes(leader)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
