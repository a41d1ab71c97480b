"""The Communicator interface: numpy-level transport with exact byte accounting.

A Communicator moves numpy arrays between the ranks of one job.  Aggregators
(:mod:`tfsparse.aggregators`) only ever talk to this interface, so the same
algorithm runs over MPI (:class:`~tfsparse.collectives.mpi.MPICommunicator`),
Horovod (:class:`~tfsparse.collectives.horovod.HorovodCommunicator`) or threads
in one process (:class:`~tfsparse.collectives.inprocess.InProcessWorld`).

Byte accounting
---------------
Every public call adds to :attr:`Communicator.bytes_sent` the bytes *this rank*
hands to the network.  Point-to-point sends count their payload.  Collectives
count the per-rank volume of the bandwidth-optimal algorithm for that call
(gtopk-ssgd-shi2019 §II-D, Eq. 5-6), independent of what the MPI library
picks internally, so that measured volumes compare against the papers:

==============  ==============================================================
``allreduce``   reduce-scatter + allgather (ring): ``2 * nbytes * (P-1) / P``
``allgather``   ring allgather(v): every block but the successor's,
                ``sum(nbytes_j) - nbytes_{(rank+1) % P}``
``bcast``       binomial tree: ``nbytes * children(rank)``
``alltoall``    direct: the bytes of every block addressed to another rank
``send/isend``  the payload
==============  ==============================================================

Every blocking call marks its thread as waiting in a collective
(:func:`~tfsparse.collectives.watchdog.tracked`), so that a rank whose peers have left can
tell (:class:`~tfsparse.collectives.watchdog.DepartureWatch`).

Results of ``allreduce`` are bit-identical on every rank (each element is
reduced exactly once, by its owner in the reduce-scatter), which is what keeps
the replicas' weights bit-identical after every step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .. import _checks
from .watchdog import tracked

_OPS = ("sum", "max", "min")


def _check_op(op: str) -> None:
    _checks.choice("op", op, _OPS, accepted=", ".join(_OPS))


def binomial_children(rank: int, size: int, root: int = 0) -> int:
    """Number of children of ``rank`` in a binomial broadcast tree rooted at ``root``."""
    rel = (rank - root) % size
    children = 0
    mask = 1
    while mask < size:
        if rel & mask:
            break
        if rel + mask < size:
            children += 1
        mask <<= 1
    return children


class Request:
    """Handle of a non-blocking operation; :meth:`wait` returns the received array (or None)."""

    def __init__(self, wait_fn):
        self._wait_fn = wait_fn
        self._done = False
        self._value = None

    @tracked
    def wait(self):
        """Waits for the operation (once: later calls return the same value); the array received, or None for
        a send."""
        if not self._done:
            self._value = self._wait_fn()
            self._done = True
        return self._value


class Communicator(ABC):
    """Base class: byte accounting around the transport primitives of a subclass.

    Subclasses implement the underscored primitives; the public methods validate
    arguments, count bytes and delegate.  All arrays are contiguous numpy arrays;
    every rank must call collectives in the same order with the same dtype.
    """

    name = "base"
    #: whether this transport may be used from several threads at once (the exchange's
    #: communication thread next to the training thread); MPI: MPI_THREAD_MULTIPLE
    thread_safe = True
    #: whether collectives on two duplicates may be in flight at once from two threads (a
    #: pipelined exchange's round next to the training thread's metric averaging); Horovod's
    #: eager collectives may not
    concurrent_collectives = True
    #: whether messages in flight move only inside this transport's calls (Open MPI over TCP
    #: runs no progress thread): a long computation meant to overlap them calls
    #: :meth:`progress` now and then
    manual_progress = False
    #: whether :meth:`split` can form groups of ranks (the two-level exchange's host groups)
    forms_groups = False

    def __init__(self, rank: int, size: int):
        self.rank = int(rank)
        self.size = int(size)
        self.bytes_sent = 0
        self.calls = 0
        #: seconds a point-to-point wait sleeps between tests of its request (None: the
        #: transport's own wait, which may poll); see :meth:`wait_quietly`
        self.quiet_pause: float | None = None

    def wait_quietly(self, pause: float | None) -> bool:
        """From now on, this communicator's point-to-point requests (``isend``, ``irecv`` and what
        is built on them) wait by testing every ``pause`` seconds and sleeping in between, instead
        of the transport's busy polling -- for a thread that should leave the CPU to others while
        it waits (None: poll again).  Returns whether this transport does so; the base class does
        not (its waits are its own)."""
        return False

    # -- statistics -------------------------------------------------------
    def _count(self, nbytes) -> None:
        self.bytes_sent += int(nbytes)
        self.calls += 1

    # -- collectives ------------------------------------------------------
    @tracked
    def allreduce(self, x: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray:
        """Element-wise reduction over ranks; identical (bit for bit) on every rank.  ``out``: a
        contiguous array of ``x``'s size and dtype to receive the result (returned, shaped like
        ``x``), instead of a new one."""
        _check_op(op)
        shape = np.shape(x)
        x = np.ascontiguousarray(x)
        if out is not None and not (isinstance(out, np.ndarray) and out.size == x.size and out.dtype == x.dtype
                                    and out.flags.c_contiguous):
            raise ValueError(f"out must be a contiguous {x.dtype} array of {x.size} elements")
        if self.size == 1:
            if out is None:
                return x.copy().reshape(shape)
            np.copyto(out.reshape(-1), x.reshape(-1))
            return out.reshape(shape)
        self._count(2 * x.nbytes * (self.size - 1) // self.size)
        result = self._allreduce(x, op) if out is None else self._allreduce_into(x, op, out.reshape(-1))
        return result.reshape(shape)

    @tracked
    def allgather(self, x: np.ndarray) -> list[np.ndarray]:
        """Gathers one 1-D array per rank (sizes may differ); returns them in rank order."""
        x = np.ascontiguousarray(x).reshape(-1)
        if self.size == 1:
            return [x.copy()]
        parts = self._allgather(x)
        succ = (self.rank + 1) % self.size
        self._count(sum(p.nbytes for p in parts) - parts[succ].nbytes)
        return parts

    @tracked
    def bcast(self, x: np.ndarray | None, root: int = 0, *, shape=None, dtype=None,
              out: np.ndarray | None = None) -> np.ndarray:
        """Broadcast from ``root``.  Non-root ranks may pass ``None`` with ``shape``/``dtype``,
        or pass an array of the right shape and dtype (its content is ignored); ``out``: a
        contiguous array of that shape and dtype to receive into (non-root ranks; returned)."""
        if not 0 <= root < self.size:
            raise ValueError(f"root={root} is out of range for a world of size {self.size}")
        if self.rank == root:
            shape = np.shape(x)
            x = np.ascontiguousarray(x).reshape(shape) if np.ndim(x) else np.array(x)
            dtype = x.dtype
        elif x is not None:
            shape, dtype = np.shape(x), np.asarray(x).dtype
        elif out is not None:
            if not (isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable):
                raise ValueError("bcast's out= must be a writeable C-contiguous numpy array")
            shape, dtype = out.shape, out.dtype
        elif shape is None or dtype is None:
            raise ValueError("bcast on a non-root rank needs an array or shape= and dtype=")
        if self.size == 1:
            return np.array(x, copy=True)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        self._count(nbytes * binomial_children(self.rank, self.size, root))
        if out is not None and self.rank != root:
            got = self._bcast_into(out, root)
            return got.reshape(shape)
        out = self._bcast(x if self.rank == root else None, root, tuple(shape), np.dtype(dtype))
        return np.asarray(out).reshape(shape)

    @tracked
    def alltoall(self, blocks: list[np.ndarray]) -> list[np.ndarray]:
        """Sends ``blocks[j]`` to rank j; returns the blocks received, in source-rank order."""
        if len(blocks) != self.size:
            raise ValueError(f"alltoall needs one block per rank ({self.size}), got {len(blocks)}")
        blocks = [np.ascontiguousarray(b).reshape(-1) for b in blocks]
        dtypes = {b.dtype for b in blocks}
        if len(dtypes) != 1:
            raise ValueError(f"alltoall blocks must share one dtype, got {sorted(map(str, dtypes))}")
        if self.size == 1:
            return [blocks[0].copy()]
        self._count(sum(b.nbytes for j, b in enumerate(blocks) if j != self.rank))
        return self._alltoall(blocks)

    @tracked
    def barrier(self) -> None:
        """Returns once every rank has called it (at once on a world of one rank)."""
        if self.size > 1:
            self._barrier()

    @tracked
    def duplicate(self) -> "Communicator":
        """A communicator over the same ranks whose traffic never mixes with this one's
        (``MPI_Comm_dup``), with its own byte counters.  Collective: every rank calls it, in
        the same order.  The exchange's communication thread talks over one."""
        return self._duplicate()

    @tracked
    def split(self, color: int | None) -> "Communicator | None":
        """Communicators over the ranks that give the same ``color`` (an int >= 0), ranked in this
        communicator's order (``MPI_Comm_split``); None for a rank that gives None.  Collective:
        every rank calls it, in the same order."""
        if color is not None and (isinstance(color, bool) or not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"color={color!r} must be an int >= 0 or None")
        return self._split(None if color is None else int(color))

    def progress(self) -> None:
        """Let the transport move the data of the point-to-point operations in flight (cheap: a
        few microseconds).  A no-op where it moves them by itself (``manual_progress`` False)."""

    # -- point to point ---------------------------------------------------
    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{what}={peer} must be another rank in [0, {self.size})")

    @tracked
    def send(self, x: np.ndarray, dest: int, tag: int = 0) -> None:
        """Blocking send of ``x`` to rank ``dest`` with ``tag``; counts its bytes."""
        self._check_peer(dest, "dest")
        x = np.ascontiguousarray(x)
        self._count(x.nbytes)
        self._send(x, dest, tag)

    def isend(self, x: np.ndarray, dest: int, tag: int = 0) -> Request:
        """Non-blocking send of ``x`` to rank ``dest`` with ``tag``; counts its bytes and returns the
        :class:`Request` to wait on."""
        self._check_peer(dest, "dest")
        x = np.ascontiguousarray(x)
        self._count(x.nbytes)
        return self._isend(x, dest, tag)

    @tracked
    def recv(self, source: int, tag: int = 0, dtype=np.float32) -> np.ndarray:
        """Blocking receive of a 1-D array of unknown length."""
        self._check_peer(source, "source")
        return self._recv(source, tag, np.dtype(dtype))

    def irecv(self, source: int, count: int, tag: int = 0, dtype=np.float32, *, exact: bool = True,
              buffers=None) -> Request:
        """Non-blocking receive of exactly ``count`` elements -- or, with ``exact=False``, of at most
        ``count`` (a message whose length the receiver knows only within bounds); the request's
        ``wait()`` returns the elements received.  Posting receives early lets a large message's
        transfer start as soon as its sender is ready, whatever the receiver is doing.
        ``buffers``: a :class:`tfsparse.buffers.Reusable` to receive into (no fresh pages)."""
        self._check_peer(source, "source")
        dtype = np.dtype(dtype)
        if buffers is None:
            return self._irecv(source, int(count), tag, dtype, bool(exact))
        return self._irecv_into(source, buffers.take(int(count), dtype), tag, bool(exact))

    @tracked
    def sendrecv(self, x: np.ndarray, peer: int, tag: int = 0) -> np.ndarray:
        """Exchange with ``peer`` (both send, both receive), deadlock-free."""
        req = self.isend(x, peer, tag)
        got = self.recv(peer, tag, np.asarray(x).dtype)
        req.wait()
        return got

    # -- primitives for subclasses ----------------------------------------
    def _allreduce_into(self, x, op, out):
        """:meth:`_allreduce` received into ``out`` (flat); this default copies the result there."""
        np.copyto(out, self._allreduce(x, op).reshape(-1))
        return out

    @abstractmethod
    def _allreduce(self, x, op):
        """Transport primitive, implemented by each backend."""

    @abstractmethod
    def _allgather(self, x):
        """Transport primitive, implemented by each backend."""

    @abstractmethod
    def _bcast(self, x, root, shape, dtype):
        """Transport primitive, implemented by each backend."""

    @abstractmethod
    def _alltoall(self, blocks):
        """Transport primitive, implemented by each backend."""

    @abstractmethod
    def _barrier(self):
        """Transport primitive, implemented by each backend."""

    @abstractmethod
    def _duplicate(self):
        """Transport primitive, implemented by each backend."""

    @abstractmethod
    def _send(self, x, dest, tag):
        """Transport primitive, implemented by each backend."""

    @abstractmethod
    def _isend(self, x, dest, tag):
        """Transport primitive, implemented by each backend."""

    @abstractmethod
    def _recv(self, source, tag, dtype):
        """Transport primitive, implemented by each backend."""

    @abstractmethod
    def _irecv(self, source, count, tag, dtype, exact=True):
        """Transport primitive, implemented by each backend."""

    def _bcast_into(self, out, root):
        """:meth:`_bcast` received into ``out`` (a non-root rank); this default copies it there."""
        np.copyto(out, np.asarray(self._bcast(None, root, out.shape, out.dtype)).reshape(out.shape))
        return out

    def _split(self, color):
        """Transport primitive; a transport without it cannot form groups of ranks."""
        raise ValueError(f"the {self.name!r} transport ({type(self).__name__}) cannot form groups of ranks (a "
                         f"two-level exchange, hierarchical=True, needs them); use tfsparse.init(backend='mpi')")

    def _irecv_into(self, source, buf, tag, exact=True):
        """:meth:`_irecv` into ``buf``; this default receives into a buffer of its own."""
        return self._irecv(source, buf.size, tag, buf.dtype, exact)

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


def split_counts(n: int, parts: int) -> np.ndarray:
    """Block sizes of ``n`` elements over ``parts`` owners (first ones get the remainder)."""
    base, extra = divmod(int(n), int(parts))
    return np.array([base + (1 if i < extra else 0) for i in range(parts)], dtype=np.int64)
