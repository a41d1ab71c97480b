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
        self._channels: dict = {}
        self._queues: dict = {}
        self._lock = threading.Lock()
        self.comms = [InProcessCommunicator(self, r) for r in range(size)]
        self._parts: dict = {}

    def part(self, key, size: int) -> "InProcessWorld":
        """The world of the group ``key`` (a split's channel, count and color), made by the
        first of its ranks to ask."""
        with self._lock:
            if key not in self._parts:
                self._parts[key] = InProcessWorld(size, self.timeout)
            return self._parts[key]

    def _queue(self, channel, src, dst, tag):
        with self._lock:
            return self._queues.setdefault((channel, src, dst, tag), queue.Queue())

    def _channel(self, channel):
        with self._lock:
            if channel not in self._channels:
                self._channels[channel] = (threading.Barrier(self.size, timeout=self.timeout), [None] * self.size)
            return self._channels[channel]

    def exchange(self, rank, item, channel=()):
        """Every rank posts ``item``; every rank gets the list of all items (per channel: a
        duplicated communicator has its own)."""
        barrier, board = self._channel(channel)
        board[rank] = item
        barrier.wait()
        items = list(board)
        barrier.wait()
        return items

    def run(self, fn, *args):
        """Runs ``fn(comm, *args)`` for every rank's communicator, one thread each, and returns the results in
        rank order (each waited for at most ``4 * timeout`` seconds)."""
        with ThreadPoolExecutor(self.size) as pool:
            futures = [pool.submit(fn, c, *args) for c in self.comms]
            return [f.result(timeout=self.timeout * 4) for f in futures]


class InProcessCommunicator(Communicator):
    """The communicator of rank ``rank`` of an :class:`InProcessWorld` (``channel``: which duplicate of it).
    Collectives meet on the world's board (every rank posts a copy, every rank reads them all; sums in
    rank order, the same bits on every rank); point-to-point messages go through queues, a receive
    waiting at most the world's ``timeout``.  It forms groups (:meth:`Communicator.split`)."""

    name = "inprocess"
    forms_groups = True

    def __init__(self, world: InProcessWorld, rank: int, channel: tuple = ()):
        super().__init__(rank, world.size)
        self.world = world
        self.channel = channel
        self._dups = 0

    def _duplicate(self):
        self._dups += 1
        return InProcessCommunicator(self.world, self.rank, self.channel + (self._dups,))

    def _split(self, color):
        self._dups += 1
        colors = self.world.exchange(self.rank, color, self.channel)
        if color is None:
            return None
        members = [r for r, c in enumerate(colors) if c == color]
        world = self.world.part((self.channel, self._dups, color), len(members))
        return InProcessCommunicator(world, members.index(self.rank))

    def _exchange(self, item):
        # post a private copy: the caller may reuse its buffer while others still read the board
        item = [np.array(b, copy=True) for b in item] if isinstance(item, list) else \
            (None if item is None else np.array(item, copy=True))
        return self.world.exchange(self.rank, item, self.channel)

    def _allreduce(self, x, op):
        items = self._exchange(x)
        out = items[0].copy()
        for other in items[1:]:
            out = _REDUCE[op](out, other)
        return out

    def _allgather(self, x):
        return [a.copy() for a in self._exchange(x)]

    def _bcast(self, x, root, shape, dtype):
        items = self._exchange(x)
        return np.array(items[root], dtype=dtype, copy=True).reshape(shape)

    def _alltoall(self, blocks):
        items = self._exchange(blocks)
        return [items[src][self.rank].copy() for src in range(self.size)]

    def _barrier(self):
        self._exchange(None)

    def _send(self, x, dest, tag):
        self.world._queue(self.channel, self.rank, dest, tag).put(x.copy())

    def _isend(self, x, dest, tag):
        self._send(x, dest, tag)
        return Request(lambda: None)

    def _recv(self, source, tag, dtype):
        got = self.world._queue(self.channel, source, self.rank, tag).get(timeout=self.world.timeout)
        return np.asarray(got, dtype=dtype).reshape(-1)

    def _irecv(self, source, count, tag, dtype, exact=True):
        def wait():
            got = self._recv(source, tag, dtype)
            if got.size > count or (exact and got.size != count):
                raise RuntimeError(f"irecv expected {'' if exact else 'at most '}{count} elements from rank "
                                   f"{source}, got {got.size}")
            return got

        return Request(wait)
