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

#: the nice value the process's other threads get from :meth:`CommThread.take_precedence`
#: (CFS weights 1024 : 335, the communication thread's three to one)
PRECEDENCE_NICE = 5

_AHEAD: set = set()  # native ids of the communication threads that took precedence


class CommThread:
    """Runs submitted jobs one at a time, in submission order, on a daemon thread."""

    def __init__(self, name: str = "tfsparse-comm"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
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
        return self._thread.is_alive()

    def take_precedence(self, nice: int = PRECEDENCE_NICE) -> bool:
        """Lets this thread have the CPU before the rest of the process: every other thread (but
        the communication threads that took precedence before) runs at nice ``nice`` or above
        from now on -- and so do the threads they start later (Linux threads inherit their
        creator's nice: TensorFlow's and Numba's pools), while this one keeps its own (or goes
        back to 0 where the process may raise a priority).  Raising a thread's nice needs no
        privilege; nothing is lowered but this thread's.  For a transport that moves messages
        only while its calls run (Open MPI over TCP), on a node where training keeps every core
        busy: a message ready to move then waits at most a scheduler's wake-up for this thread,
        instead of its time slice behind the training's threads.  Linux only (per-thread nice);
        returns whether this thread now runs ahead of the others."""
        if not sys.platform.startswith("linux") or not self._thread.is_alive():
            return False
        me = self._thread.native_id
        try:
            if os.getpriority(os.PRIO_PROCESS, me) >= nice:  # inherited from a thread set back before
                os.setpriority(os.PRIO_PROCESS, me, 0)
        except OSError:  # no privilege to raise a priority: it stays with the others
            pass
        try:
            mine = os.getpriority(os.PRIO_PROCESS, me)
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            return False
        if mine >= nice:
            return False
        _AHEAD.add(me)
        for tid in tids:
            if tid in _AHEAD:
                continue
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:  # the thread ended meanwhile
                pass
        return True
