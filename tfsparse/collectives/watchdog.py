"""A rank that leaves early must not leave the others waiting forever.

An uncaught exception already ends every rank (``tfsparse.init(abort_on_error=True)``:
``MPI_Abort`` as the failing process exits, or from the ``sys.excepthook`` that
``quiet_workers`` chains), and ``mpirun`` ends the job when a rank is killed by
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

The same thread reports stalls (:class:`DepartureWatch`'s ``stall_warning`` and
``stall_timeout``, set by ``tfsparse.init``): a collective that waits too long makes rank 0 ask
every rank for its :func:`report` -- its round (:func:`note_round`, set by the engine) and the
collective it waits in or left last (:func:`tracked` records them) -- and log which ranks have
not arrived (:func:`describe`); past the timeout the waiting rank aborts the job with that report.
With ``stacks`` (``tfsparse.init(stall_stacks=True)``) each rank also writes its threads' Python
stacks at an inquiry (:func:`thread_stacks`), and ``faulthandler`` writes them where the watch
thread itself cannot run.
"""
from __future__ import annotations

import faulthandler
import functools
import math
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np

_busy: dict[int, float] = {}  # thread ident -> when its outermost collective began
#: what this process last did, for a stall report: the exchange's round (set by the engine when a
#: round starts), the outermost collective entered last, and when it ended (None: still in it)
progress: dict = {"round": None, "collective": None, "left": None}

TAG = 0x7F5A
TAG_STALL, TAG_QUERY, TAG_REPORT, TAG_FAILED = TAG + 1, TAG + 2, TAG + 3, TAG + 4


def tracked(fn):
    """Decorator: marks the calling thread as blocked in a collective while ``fn`` runs.

    The outermost such call on a thread is recorded in :data:`progress` (for a stall report).

    Args:
      fn: a collective of a communicator.

    Returns:
      The wrapped function.
    """
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        me = threading.get_ident()
        outer = me not in _busy
        if outer:
            _busy[me] = time.monotonic()
            progress["collective"], progress["left"] = name, None
        try:
            return fn(*args, **kwargs)
        finally:
            if outer:
                _busy.pop(me, None)
                progress["left"] = time.monotonic()
    return wrapper


def note_round(index: int) -> None:
    """The exchange's round ``index`` starts on this rank (what a stall report names).

    Args:
      index: the round.
    """
    progress["round"] = index


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
    finalising and ends the job, so no rank is left waiting for it.

    Args:
      world: the communicator to abort (``MPI.COMM_WORLD``).
      message: the text written first (one clear message).
      deadline: seconds before this rank ends itself should the abort block.
    """
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
    """When the longest-running collective of any thread of this process began.

    Returns:
      A ``time.monotonic()`` value, or None when no thread is in a collective.
    """
    values = list(_busy.values())
    return min(values) if values else None


def report(rank: int) -> dict:
    """This rank's part of a stall report.

    Args:
      rank: this rank.

    Returns:
      ``{"rank", "round", "collective", "waiting_s", "idle_s"}``: its round, and either the
      collective it waits in and for how long, or how long ago it left its last collective (and
      which).
    """
    now = time.monotonic()
    since = blocked_since()
    left = progress["left"]
    return {"rank": rank, "round": progress["round"], "collective": progress["collective"],
            "waiting_s": None if since is None else now - since,
            "idle_s": None if since is not None or left is None else now - left}


def thread_stacks(rank: int) -> str:
    """Every Python thread's stack in this process, for a stall report (``stall_stacks``).

    Args:
      rank: this rank, named in the head line.

    Returns:
      The text: a head line, then per thread its name and its calls, outermost first.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [f"tfsparse: rank {rank}'s threads at a stall inquiry (stall_stacks):"]
    for ident, frame in sys._current_frames().items():
        lines.append(f"  thread {names.get(ident, ident)}:")
        lines += ["    " + entry.rstrip("\n").replace("\n", "\n    ") for entry in traceback.format_stack(frame)]
    return "\n".join(lines) + "\n"


def describe(reports: dict, size: int) -> str:
    """The lines of a stall report: first the ranks that have not arrived, then those that wait.

    A rank has not arrived when it is not in a collective, or did not answer.

    Args:
      reports: ``{rank: report(rank)}`` of the ranks that answered.
      size: the ranks of the job.

    Returns:
      The text, a head line and one line per rank.
    """
    late = [r for r in range(size) if r not in reports or reports[r]["waiting_s"] is None]
    lines = []
    for r in late + [r for r in range(size) if r not in late]:
        rep = reports.get(r)
        if rep is None:
            lines.append(f"  rank {r}: no answer (a thread holding Python's GIL, a process not scheduled -- "
                         f"stopped, or the machine paused -- or gone)")
            continue
        where = "" if rep["round"] is None else f"round {rep['round']}, "
        if rep["waiting_s"] is not None:
            lines.append(f"  rank {r}: {where}waiting in {rep['collective']} for {rep['waiting_s']:.0f} s")
        else:
            last = (f"left its last collective ({rep['collective']}) {rep['idle_s']:.0f} s ago"
                    if rep["idle_s"] is not None else "has not entered any collective yet")
            lines.append(f"  rank {r}: {where}not in a collective: {last}")
    head = (f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} ha{'ve' if len(late) > 1 else 's'} "
            f"not arrived" if late else "every rank waits (in different collectives?)")
    return head + ":\n" + "\n".join(lines)


class DepartureWatch:
    """Watches the other ranks from a daemon thread: aborts the job when a rank has left and
    this rank waits for it (module doc), and reports stalls.

    Stalls: when a collective of this rank has waited longer than ``stall_warning`` seconds,
    rank 0 asks every rank what it is doing and logs which ranks have not arrived -- their round
    and what they last did -- once per ``stall_warning`` seconds while the stall lasts (Horovod's
    stall check).  When it has waited longer than ``stall_timeout`` seconds, the waiting rank
    makes the same inquiry and ends every rank (``MPI_Abort``) with that message.  Each rank's
    watch thread answers the inquiries, so a rank stuck in user code (sleeping, deadlocked, a
    hung file system) is reported as long as it does not hold Python's GIL.  With ``stacks``,
    every rank that answers an inquiry (and, once the answers are in, the one that makes it)
    writes its threads' stacks to its standard error (:func:`thread_stacks`), and the watch thread keeps ``faulthandler``'s
    timer armed, ``stall_warning`` (else ``stall_timeout``) seconds plus two polls ahead,
    re-arming it about once a poll (also while its own inquiry waits for answers): where some
    thread holds the GIL so long that the watch thread cannot run for those seconds,
    ``faulthandler`` writes every thread's stack from a thread of its own (under the head line
    ``Timeout (h:mm:ss.us)!``).

    Args:
      grace: seconds this rank may stay blocked in a collective after another rank left
        (a collective the departed rank already finished its part of completes well within it).
      poll: seconds between checks for notices.
      departures: abort when a rank has left (``tfsparse.init(abort_on_error=True)``).
      stall_warning: seconds of waiting before the warning (None: no warning).
      stall_timeout: seconds of waiting before every rank is ended (None: never).
      answer_within: seconds an inquiry waits for the ranks' answers.
      stacks: write the threads' stacks as above (``tfsparse.init(stall_stacks=...)``).
    """

    def __init__(self, grace: float = 10.0, poll: float = 0.25, *, departures: bool = True,
                 stall_warning: float | None = 60.0, stall_timeout: float | None = None,
                 answer_within: float = 5.0, stacks: bool = False):
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = MPI.COMM_WORLD.Dup()  # collective: every rank constructs it in tfsparse.init()
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self.grace, self.poll = float(grace), float(poll)
        self.departures = departures
        self.stall_warning, self.stall_timeout, self.answer_within = stall_warning, stall_timeout, answer_within
        self.stacks = stacks
        self._armed = -math.inf  # when faulthandler's timer was last armed (stacks: _keep_armed)
        self.departed: dict[int, float] = {}
        self.failed: dict[int, str] = {}  # rank -> the exception that stopped it (announce_failure)
        self.failing = False  # this rank stops with an exception of its own: say nothing of others'
        self._warned: tuple | None = None  # (the stall's start, when rank 0 last logged it)
        self._noticed: float | None = None  # rank 0: when another rank last said it waits too long
        self._sends: list = []  # this rank's sends not known to be complete (_send, _sends_pending)
        self._sending = threading.RLock()  # the watch thread and a failing main thread both send
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tfsparse-departure-watch", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        status = self._MPI.Status()
        while self._comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=TAG, status=status):
            buf = np.empty(1, np.int64)
            self._comm.Recv(buf, source=status.Get_source(), tag=TAG)
            self.departed.setdefault(int(buf[0]), time.monotonic())

    def _receive_failures(self) -> None:
        status = self._MPI.Status()
        while self._comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=TAG_FAILED, status=status):
            source = status.Get_source()
            name = self._comm.recv(source=source, tag=TAG_FAILED)
            if not self.failed and not self.failing:
                sys.stdout.flush()
                sys.stderr.write(f"tfsparse: rank {self.rank} stops: rank {source} failed with {name} "
                                 f"(its traceback is printed by rank {source})\n")
                sys.stderr.flush()
            self.failed.setdefault(source, name)

    def announce_failure(self, name: str, linger: float = 1.0) -> None:
        """Tells every other rank that this one stops with an exception (each prints one line naming it).

        Args:
          name: the exception's name.
          linger: seconds to wait for their watch threads to take it before the caller aborts the job.
        """
        self.failing = True
        for r in range(self.size):
            if r != self.rank:
                self._send(name, r, TAG_FAILED)
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline and self._sends_pending():
            time.sleep(0.02)
        time.sleep(max(0.0, min(2 * self.poll, deadline - time.monotonic())))  # their next poll prints

    def first_failure(self, wait: float = 0.3) -> tuple[int, str] | None:
        """A rank that announced its failure, after listening a little longer.

        Args:
          wait: the most seconds to listen (it returns as soon as one is known).

        Returns:
          ``(rank, exception name)`` of the lowest such rank; None when none did.
        """
        deadline = time.monotonic() + wait
        while not self.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.failed:
            return None
        rank = min(self.failed)
        return rank, self.failed[rank]

    def _send(self, obj, dest: int, tag: int) -> None:
        """Sends ``obj`` to ``dest`` without waiting; the request is kept until it completes.  From
        either thread: one at a time (a request completed by two threads at once is an MPI error,
        and the list's rewrite in one thread would lose the other's request)."""
        with self._sending:
            self._sends_pending()  # (drops the completed ones, under the same hold of the lock)
            self._sends.append(self._comm.isend(obj, dest=dest, tag=tag))

    def _sends_pending(self) -> bool:
        """Whether a send made by :meth:`_send` has not completed yet; the completed ones are dropped."""
        with self._sending:
            self._sends = [q for q in self._sends if not q.Test()]
            return bool(self._sends)

    def _answer(self) -> None:
        """Answers other ranks' inquiries with :func:`report`; rank 0 also notes stall notices."""
        status = self._MPI.Status()
        answered = False
        while self._comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=TAG_QUERY, status=status):
            asker = self._comm.recv(source=status.Get_source(), tag=TAG_QUERY)
            self._send(report(self.rank), asker, TAG_REPORT)
            answered = True
        if answered:  # once for the inquiries queued together (after a hold of the GIL: several)
            self._write_stacks()
        while self._comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=TAG_STALL, status=status):
            self._comm.recv(source=status.Get_source(), tag=TAG_STALL)
            self._noticed = time.monotonic()

    def inquire(self) -> dict:
        """Every rank's :func:`report`, answering others' inquiries meanwhile.

        Returns:
          ``{rank: report}``; a rank that does not answer within ``answer_within`` seconds is left out.
        """
        for r in range(self.size):
            if r != self.rank:
                self._send(self.rank, r, TAG_QUERY)
        reports = {self.rank: report(self.rank)}
        status = self._MPI.Status()
        deadline = time.monotonic() + self.answer_within
        while len(reports) < self.size and time.monotonic() < deadline:
            self._keep_armed()  # this thread runs: no stacks from faulthandler while it waits for answers
            self._answer()
            if self._comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=TAG_REPORT, status=status):
                rep = self._comm.recv(source=status.Get_source(), tag=TAG_REPORT)
                reports[rep["rank"]] = rep
            else:
                time.sleep(0.01)
        self._write_stacks()  # after the answers: apart in time from the others' stacks
        return reports

    def _write_stacks(self) -> None:
        """With ``stacks``: this rank's threads' stacks to the process's standard error
        (``sys.__stderr__``, not a ``sys.stderr`` the program may have redirected); where that
        fails, the stacks are switched off (the watch thread goes on)."""
        if not self.stacks:
            return
        try:
            sys.__stderr__.write(thread_stacks(self.rank))
            sys.__stderr__.flush()
        except (AttributeError, OSError, ValueError):  # no usable stream (None, closed, no descriptor)
            self.stacks = False

    def _keep_armed(self) -> None:
        """With ``stacks``: ``faulthandler``'s timer re-armed, two polls longer than the stall's
        seconds, at most once a poll (this thread calls it at every poll, and while an inquiry
        waits) and not once the watch stops, so that it fires only where this thread has not run
        for those seconds at least.  Where ``faulthandler`` cannot write to the process's standard
        error, the stacks are switched off."""
        seconds = self.stall_warning or self.stall_timeout
        now = time.monotonic()
        if not self.stacks or seconds is None or now - self._armed < self.poll or self._stop.is_set():
            return
        self._armed = now
        try:
            faulthandler.dump_traceback_later(seconds + 2 * self.poll, repeat=False, file=sys.__stderr__)
        except (AttributeError, OSError, ValueError, RuntimeError):  # None, closed, no descriptor
            self.stacks = False

    def _check_stall(self) -> None:
        since = blocked_since()
        now = time.monotonic()
        waited = None if since is None else now - since
        if self.stall_timeout is not None and waited is not None and waited > self.stall_timeout:
            text = describe(self.inquire(), self.size)
            abort_world(self._MPI.COMM_WORLD,
                        f"tfsparse: stall timeout: rank {self.rank} waited in {progress['collective']} for more than "
                        f"{self.stall_timeout:g} s (tfsparse.init(stall_timeout=...) or TFSPARSE_STALL_TIMEOUT); "
                        f"{text}\naborting all {self.size} ranks (MPI_Abort)\n")
        if self.stall_warning is None:
            return
        mine = waited is not None and waited > self.stall_warning
        if self.rank != 0:
            if mine and (self._warned is None or self._warned[0] != since):
                self._warned = (since, now)
                self._send(self.rank, 0, TAG_STALL)  # rank 0 makes the inquiry and logs it
            return
        noticed = self._noticed is not None and now - self._noticed < 2 * self.stall_warning
        if not (mine or noticed):
            return
        if self._warned is not None and now - self._warned[1] < self.stall_warning:
            return
        self._warned = (since, now)
        self._noticed = None
        text = describe(self.inquire(), self.size)
        sys.stderr.write(f"tfsparse: a collective has waited more than {self.stall_warning:g} s (stall warning: "
                         f"tfsparse.init(stall_warning=...) or TFSPARSE_STALL_WARNING); {text}\n")
        sys.stderr.flush()

    def gone(self, wait: float = 0.5) -> list[int]:
        """The ranks known to have ended, after listening a little longer for notices.

        Args:
          wait: the most seconds to listen (it returns as soon as a departure is known).

        Returns:
          Their ranks, sorted.
        """
        deadline = time.monotonic() + wait
        while True:
            if not self._thread.is_alive():  # else the watch thread receives them: never both
                self._receive()  # (both probing one notice, one would wait in Recv for good)
            if self.departed or time.monotonic() >= deadline:
                return sorted(self.departed)
            time.sleep(0.05)

    def _late(self, since: float) -> None:
        """After a poll that came ``since`` seconds after this thread went to sleep: where that is
        longer than the poll by more than the stall warning, the rank says so on its standard
        error -- its watch thread did not run meanwhile (a thread held the GIL, or the process was
        not scheduled: stopped, or the machine paused), which an inquiry meanwhile reported as
        "no answer".  (A hold of the GIL that begins while this thread is awake, between two
        waits, is not measured.)"""
        late = since - self.poll
        if self.stall_warning is not None and late > self.stall_warning:
            sys.stderr.write(f"tfsparse: rank {self.rank}'s watch thread could not run for {late:.0f} s (a thread "
                             f"of this process held Python's GIL, or the process was not scheduled: stopped, or "
                             f"the machine paused)\n")
            sys.stderr.flush()

    def _run(self) -> None:
        while True:
            asleep = time.monotonic()
            if self._stop.wait(self.poll):
                return
            self._late(time.monotonic() - asleep)
            self._keep_armed()
            self._receive()
            self._receive_failures()
            self._answer()
            self._check_stall()
            since = blocked_since()
            if not self.departures or not self.departed or since is None:
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
        if self.stacks:
            faulthandler.cancel_dump_traceback_later()
        me = np.array([self.rank], np.int64)
        requests = [self._comm.Isend(me, dest=r, tag=TAG) for r in range(self.size) if r != self.rank]
        deadline = time.monotonic() + 2.0
        while requests and not self._MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(0.01)
