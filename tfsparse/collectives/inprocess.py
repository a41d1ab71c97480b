"""An in-process world of P ranks on threads, for unit tests of aggregators.

>>> world = InProcessWorld(3)
>>> world.run(lambda comm: comm.allreduce(np.ones(2) * comm.rank))   # one result per rank

Collectives are rendezvous on a shared board guarded by a barrier; point-to-point
messages go through per-(source, dest, tag) queues.  A rank that waits longer
than ``timeout`` seconds raises instead of hanging.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .communicator import Communicator, Request

_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


class InProcessWorld:
    """Shared state of ``size`` thread-ranks.  :meth:`run` executes ``fn(comm)`` on each."""

    def __init__(self, size: int, timeout: float = 60.0):
        if size < 1:
            raise ValueError(f"size={size} must be >= 1")
        self.size = size
        self.timeout = timeout
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._board: list = [None] * size
        self._queues: dict = {}
        self._lock = threading.Lock()
        self.comms = [InProcessCommunicator(self, r) for r in range(size)]

    def _queue(self, src, dst, tag):
        with self._lock:
            return self._queues.setdefault((src, dst, tag), queue.Queue())

    def exchange(self, rank, item):
        """Every rank posts ``item``; every rank gets the list of all items."""
        self._board[rank] = item
        self._barrier.wait()
        items = list(self._board)
        self._barrier.wait()
        return items

    def run(self, fn, *args):
        with ThreadPoolExecutor(self.size) as pool:
            futures = [pool.submit(fn, c, *args) for c in self.comms]
            return [f.result(timeout=self.timeout * 4) for f in futures]


class InProcessCommunicator(Communicator):
    name = "inprocess"

    def __init__(self, world: InProcessWorld, rank: int):
        super().__init__(rank, world.size)
        self.world = world

    def _allreduce(self, x, op):
        items = self.world.exchange(self.rank, x)
        out = items[0].copy()
        for other in items[1:]:
            out = _REDUCE[op](out, other)
        return out

    def _allgather(self, x):
        return [a.copy() for a in self.world.exchange(self.rank, x)]

    def _bcast(self, x, root, shape, dtype):
        items = self.world.exchange(self.rank, x)
        return np.array(items[root], dtype=dtype, copy=True).reshape(shape)

    def _alltoall(self, blocks):
        items = self.world.exchange(self.rank, blocks)
        return [items[src][self.rank].copy() for src in range(self.size)]

    def _barrier(self):
        self.world.exchange(self.rank, None)

    def _send(self, x, dest, tag):
        self.world._queue(self.rank, dest, tag).put(x.copy())

    def _isend(self, x, dest, tag):
        self._send(x, dest, tag)
        return Request(lambda: None)

    def _recv(self, source, tag, dtype):
        got = self.world._queue(source, self.rank, tag).get(timeout=self.world.timeout)
        return np.asarray(got, dtype=dtype).reshape(-1)

    def _irecv(self, source, count, tag, dtype):
        def wait():
            got = self._recv(source, tag, dtype)
            if got.size != count:
                raise RuntimeError(f"irecv expected {count} elements from rank {source}, got {got.size}")
            return got

        return Request(wait)
