"""A rank that leaves early must not leave the others waiting forever.

An uncaught exception already ends every rank (``tfsparse.init(abort_on_error=True)``:
``MPI_Abort`` from ``sys.excepthook``), and ``mpirun`` ends the job when a rank is killed by
a signal.  What neither catches is a rank whose program *ends normally* while the others
still need it -- ``fit`` returned early on one rank (``stop_training`` set there alone, a
callback order that makes ranks stop at different epochs), or a script that runs one more
step on some ranks: the departed rank then waits in ``MPI_Finalize`` and the others in their
next collective, forever.

:class:`DepartureWatch` closes that gap.  At a normal interpreter exit every rank tells every
other rank that it is leaving (one tiny non-blocking message each, on a duplicate of the world
communicator).  A daemon thread on every rank receives those notices; when a rank has left and
this rank has been blocked in a collective for ``grace`` seconds since (tracked by
:func:`tracked`, which every public :class:`~tfsparse.collectives.Communicator` collective
goes through), it prints which rank left and calls ``MPI_Abort`` (:func:`abort_world`, which
also ends this rank itself should Open MPI's abort block): every rank exits non-zero, within
``grace`` plus a poll interval.  Ranks that finish together, or that keep working
without communicating, are left alone.  It needs ``MPI_THREAD_MULTIPLE`` (as the exchange's
communication thread does).
"""
from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import time

import numpy as np

_busy: dict[int, float] = {}  # thread ident -> when its outermost collective began

TAG = 0x7F5A


def tracked(fn):
    """Marks the calling thread as blocked in a collective while ``fn`` runs."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        me = threading.get_ident()
        outer = me not in _busy
        if outer:
            _busy[me] = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            if outer:
                _busy.pop(me, None)
    return wrapper


ABORT_DEADLINE = 30.0
"""Seconds a rank gives ``MPI_Abort`` to end it before it ends itself (:func:`abort_world`)."""


def abort_world(world, message: str, deadline: float = ABORT_DEADLINE) -> None:
    """Writes ``message`` to stderr, then ``world.Abort(1)`` (every rank of the job ends).

    Open MPI's abort can itself block: ``PMIx_Abort`` deadlocks at times (open-mpi/ompi#3225,
    #1379), and this project's CI once saw ``mpirun`` keep a job alive after a rank's
    ``MPI_Abort``.  So the last resort is armed first: a rank still alive ``deadline`` seconds
    later ends itself -- ``SIGALRM`` with its default action (works whatever the calling thread
    and even if ``MPI_Abort`` holds the GIL), or ``os._exit(1)`` from a timer thread when the
    program installed a ``SIGALRM`` handler of its own.  ``mpirun`` then sees a rank end without
    finalising and ends the job, so no rank is left waiting for it."""
    sys.stdout.flush()
    sys.stderr.write(message)
    sys.stderr.flush()
    if signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None):
        signal.alarm(max(1, math.ceil(deadline)))
    else:
        timer = threading.Timer(deadline, os._exit, (1,))
        timer.daemon = True
        timer.start()
    world.Abort(1)


def blocked_since() -> float | None:
    """When the longest-running collective of any thread of this process began (None: none)."""
    values = list(_busy.values())
    return min(values) if values else None


class DepartureWatch:
    """Aborts the job when a rank has left and this rank waits for it (module doc).

    Args:
      grace: seconds this rank may stay blocked in a collective after another rank left
        (a collective the departed rank already finished its part of completes well within it).
      poll: seconds between checks for notices.
    """

    def __init__(self, grace: float = 10.0, poll: float = 0.25):
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = MPI.COMM_WORLD.Dup()  # collective: every rank constructs it in tfsparse.init()
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self.grace, self.poll = float(grace), float(poll)
        self.departed: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tfsparse-departure-watch", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        status = self._MPI.Status()
        while self._comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=TAG, status=status):
            buf = np.empty(1, np.int64)
            self._comm.Recv(buf, source=status.Get_source(), tag=TAG)
            self.departed.setdefault(int(buf[0]), time.monotonic())

    def gone(self, wait: float = 0.5) -> list[int]:
        """The ranks known to have ended, after listening ``wait`` more seconds for notices."""
        deadline = time.monotonic() + wait
        while True:
            if not self._stop.is_set():
                self._receive()
            if self.departed or time.monotonic() >= deadline:
                return sorted(self.departed)
            time.sleep(0.05)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self._receive()
            since = blocked_since()
            if not self.departed or since is None:
                continue
            first = min(self.departed.values())
            if time.monotonic() - max(since, first) > self.grace:
                self._abort()

    def _abort(self) -> None:
        gone = sorted(self.departed)
        abort_world(self._MPI.COMM_WORLD,
                    f"tfsparse: rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} ended (the program "
                    f"finished or fit returned early on that rank) while rank {self.rank} waits for it in a "
                    f"collective for more than {self.grace:g} s; aborting all {self.size} ranks (MPI_Abort)\n")

    def depart(self) -> None:
        """At a normal exit: tell every other rank, then stop watching."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2 * self.poll + 1.0)
        me = np.array([self.rank], np.int64)
        requests = [self._comm.Isend(me, dest=r, tag=TAG) for r in range(self.size) if r != self.rank]
        deadline = time.monotonic() + 2.0
        while requests and not self._MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(0.01)
