"""The communication thread: one dedicated thread per exchange that runs all of its collectives.

MPI collectives must be called in the same order on every rank.  An exchange therefore hands
every communicating job to one thread (funnelled), which runs them strictly in submission
order, while the caller's thread goes on encoding the next bucket -- so the selection and
encoding of bucket ``i + 1`` overlap the wire time of bucket ``i``, and a round can be started
in one training step and finished in the next.

The thread talks over its own communicator (:meth:`~tfsparse.collectives.Communicator.duplicate`),
so collectives other code runs on the world communicator from other threads (a callback's
broadcast, say) can never interleave with the exchange's.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
from concurrent.futures import Future

_STOP = object()

#: how much higher the nice of the process's other threads is made than a communication thread's
#: by :meth:`CommThread.take_precedence` (CFS weights 1024 : 335 at 0 and 5: three to one)
PRECEDENCE_NICE = 5

_AHEAD: set = set()  # native ids of the communication threads that took precedence
_ALLOWED: list = [False]  # whether take_precedence may renice (tfsparse.init(thread_priority=...))


def allow_precedence(allowed: bool) -> None:
    """Lets :meth:`CommThread.take_precedence` renice the process's threads from now on (or not):
    off until :func:`tfsparse.init` switches it on (``thread_priority``), since it changes every
    other thread of the user's process."""
    _ALLOWED[0] = bool(allowed)


class _Starter:
    """A thread left at the nice the process had when a communication thread first took
    precedence: it starts the communication threads created after that to run ahead as well,
    which so inherit that nice (Linux threads take their creator's) rather than the raised one of
    the thread that creates them -- which no unprivileged process could lower again."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="tfsparse-starter", daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int:
        return self._thread.native_id

    def _loop(self):
        while True:
            thread, done, failed = self._jobs.get()
            try:
                thread.start()
            except BaseException as e:  # handed to the caller
                failed.append(e)
            done.set()

    def start(self, thread: threading.Thread) -> None:
        done, failed = threading.Event(), []
        self._jobs.put((thread, done, failed))
        done.wait()
        if failed:
            raise failed[0]


_STARTER: list = []  # the _Starter, once a communication thread took precedence


class CommThread:
    """Runs submitted jobs one at a time, in submission order, on a daemon thread.

    ``ahead``: the thread is to run ahead of the training's threads (:meth:`take_precedence`),
    so once another communication thread did, it starts at the process's own nice, not at the
    raised one of its creator; otherwise it starts at its creator's nice, level with the
    training's threads -- a synchronous exchange's thread, which polls while it waits, must not
    take the CPU from the training of a process where a pipelined exchange ran before."""

    def __init__(self, name: str = "tfsparse-comm", ahead: bool = False):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        if ahead and _STARTER:  # at the process's own nice, not the one raised for the training's threads
            _STARTER[0].start(self._thread)
        else:
            self._thread.start()

    def submit(self, fn, *args) -> Future:
        """Queues ``fn(*args)``; the returned future holds its result (or its exception)."""
        if self._closed:
            raise RuntimeError("the communication thread was closed")
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def run(self, fn, *args):
        """Runs ``fn(*args)`` after every job submitted so far and returns its result."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def _loop(self):
        while True:
            item = self._jobs.get()
            if item is _STOP:
                _AHEAD.discard(threading.get_native_id())
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits for this job
                fut.set_exception(e)
            # nothing of a finished job stays referenced from here while the next is awaited (a
            # bucket reuses its result vector once nothing refers to it, tfsparse.space.HostOutputs)
            del item, fut, fn, args

    def close(self, wait: bool = True) -> None:
        """Stops the thread after the jobs already submitted; ``wait``: until they are done (so
        that no collective is left running when MPI finalizes at exit)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(_STOP)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (False once :meth:`close` has stopped it)."""
        return self._thread.is_alive()

    def take_precedence(self, offset: int = PRECEDENCE_NICE) -> bool:
        """Lets this thread have the CPU before the rest of the process: every other thread (but
        the communication threads that took precedence before) runs at a nice ``offset`` above
        this one's, or higher, from now on -- and so do the threads they start later (Linux
        threads inherit their creator's nice: TensorFlow's and Numba's pools).  Only nice values
        are raised, which needs no privilege, and they stay raised.  Communication threads
        created later to run ahead (``CommThread(ahead=True)``) start from a thread left at this
        one's nice (:class:`_Starter`), so that they too can; the others start level with the
        training's threads.  For a transport that moves messages only while its calls run
        (Open MPI over TCP), on a node where training keeps every core busy: a message ready to
        move then waits at most a scheduler's wake-up for this thread, instead of its time slice
        behind the training's threads.  Linux only (per-thread nice); returns whether this
        thread now runs ahead of the others -- never before :func:`allow_precedence` (``tfsparse.init(
        thread_priority=True)``).  (A thread that ends while the others are reniced leaves its id
        to be reused: the window is a few system calls.)"""
        if not _ALLOWED[0] or not sys.platform.startswith("linux") or not self._thread.is_alive():
            return False
        me = self._thread.native_id
        try:
            base = os.getpriority(os.PRIO_PROCESS, me)
        except OSError:
            return False
        if not _STARTER:  # before any thread's nice is raised: it keeps the process's own
            _STARTER.append(_Starter())
        _AHEAD.add(me)
        keep = _AHEAD | {_STARTER[0].native_id}
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            return False
        for tid in tids:
            if tid in keep:
                continue
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < base + offset:
                    os.setpriority(os.PRIO_PROCESS, tid, base + offset)
            except OSError:  # the thread ended meanwhile
                pass
        return True
