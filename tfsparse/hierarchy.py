"""The two-level exchange's groups (``hierarchical=True``, :mod:`tfsparse.settings`): the ranks
of each host, and the host leaders that talk across hosts.

* **Inside a host**, the ranks add their bucket's gradients up a binomial tree to the first rank
  (the host's *leader*): rank r + d sends its subtree's sum to rank r, which adds it to its own
  (d = 1, 2, 4, ...: ``(g0 + g1) + (g2 + g3)`` on four ranks) -- one fixed order, so the host's
  sum is the same bits on every run, in ``ceil(log2 L)`` steps for L ranks (:meth:`TwoLevel.host_sum`).
* **Across hosts**, the leaders alone run the exchange's algorithm on their host's sum, over
  :attr:`TwoLevel.cross` (the communicator of the leaders, one per host).
* **Back inside the host**, the leader shares the result with its ranks (:meth:`TwoLevel.share`):
  a sparse result as it came off the network -- its indices and values, or the ranks' pieces --
  which each rank decodes as the leader did (the same function on the same inputs: the same
  bits), a dense one as it is.  The other ranks wait for it quietly (they sleep between tests
  of a small notice from the leader, :data:`NOTICE_PAUSE`), leaving the cores to the leaders'
  selection and exchange, and then receive the broadcast itself.

Each host is one worker of the algorithm: its error feedback (residual, velocity) lives on the
leader and compensates the host's sum -- BytePS' two-level compression: compressed once per
machine, on the sum of the machine's gradients, with error feedback per machine.
"""
from __future__ import annotations

import functools
import time

import numpy as np

from .aggregators.base import AllreduceResult
from .collectives.hosts import host_ids

#: how often a rank that waits for its leader's result tests for the notice that it is coming
#: (seconds; it sleeps in between): Open MPI's blocking waits poll, and on a host with fewer cores
#: than ranks that polling takes the cores the leaders select and exchange on
NOTICE_PAUSE = 50e-6
# what a notice says: the result's form, its lengths, and whether the leader decoded it into a
# result vector (the rank then does too, so the same code path writes the same bits)
DENSE, INDICES, PIECES = 0, 1, 2
_NOTICE = 5  # [form, elements, pieces, into a vector, index dtype's size]


def _timed(counter: str):
    """Adds each call's seconds (also one that raises) to the instance's attribute ``counter``."""
    def wrap(method):
        @functools.wraps(method)
        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - t0)
        return timed
    return wrap


class TwoLevel:
    """One rank's place in the two-level exchange, made by :meth:`of` (collective)."""

    def __init__(self, up, down, cross, hosts: int, notice):
        self.up = up  # the host's ranks: gradients to the leader (point to point, tag = bucket)
        self.down = down  # the host's ranks: the leader's result back (broadcasts, bucket order)
        #: the host's ranks: the leader's notice that a result follows (point to point, waited
        #: for quietly by the other ranks)
        self.notice = notice
        self.cross = cross  # the leaders, one per host (None on the other ranks)
        self.hosts = int(hosts)
        self._vectors: dict = {}  # the leader's: each bucket's host sum, one for the third and later ranks
        #: seconds spent in :meth:`host_sum` and :meth:`share` (this rank, all rounds)
        self.sum_seconds = self.share_seconds = 0.0

    @classmethod
    def of(cls, comm, ids=None) -> "TwoLevel":
        """The groups of ``comm``'s ranks by host (``ids``: each rank's host, in rank order; default
        :func:`~tfsparse.collectives.hosts.host_ids`, one allgather).  Collective."""
        ids = host_ids(comm) if ids is None else list(ids)
        order = list(dict.fromkeys(ids))  # hosts numbered by their first rank
        up = comm.split(order.index(ids[comm.rank]))
        down = up.duplicate()
        notice = up.duplicate()
        if up.rank != 0:
            notice.wait_quietly(NOTICE_PAUSE)
        if up.rank % 2:  # a rank that only sends up the tree waits for its sends quietly too (with
            up.wait_quietly(NOTICE_PAUSE)  # several buckets it would poll while its parent selects)
        cross = comm.split(0 if up.rank == 0 else None)
        return cls(up, down, cross, len(order), notice)

    @property
    def leader(self) -> bool:
        """Whether this rank is its host's leader (the first of its ranks), which talks across hosts."""
        return self.up.rank == 0

    @property
    def local_size(self) -> int:
        """The number of ranks on this rank's host."""
        return self.up.size

    @_timed("sum_seconds")
    def host_sum(self, space, arrays, tag: int):
        """The leader: its host's sum of the gradients ``arrays`` (one bucket's tensors) as a flat
        float32 vector, added up the binomial tree (module docstring; ``own + child`` is the same
        bits as ``child + own``, so a child's sum arrives straight in the vector, reused round
        after round per ``tag``, and the rank's own tensors are added to it).  Another rank: None,
        once its subtree's sum has reached its parent (its own tensors sent as they are, no copy)."""
        arrays = [np.asarray(space.to_host(a), np.float32).reshape(-1) for a in arrays]
        bounds = list(zip(np.cumsum([0] + [a.size for a in arrays[:-1]]), np.cumsum([a.size for a in arrays])))
        n = int(bounds[-1][1]) if bounds else 0
        me, size = self.up.rank, self.up.size
        partial = None  # this rank's subtree's sum once it has received one (else its own arrays)
        d = 1
        while d < size:
            if me % (2 * d) == d:  # its subtree's sum to its parent, as slices of the tensors (no copy)
                parts = arrays if partial is None else [partial[lo:hi] for lo, hi in bounds]
                for request in [self.up.isend(p, me - d, tag) for p in parts]:
                    request.wait()
                return None
            if me + d < size:
                into = self._vector(("sum", tag), n) if partial is None else self._vector("child", n)
                self._receive(me + d, tag, into, bounds)
                if partial is None:  # own + child's is the same bits as child's + own: added in place
                    for a, (lo, hi) in zip(arrays, bounds):
                        np.add(into[lo:hi], a, out=into[lo:hi])
                    partial = into
                else:
                    partial += into
            d *= 2
        if partial is None:  # alone on its host
            partial = self._vector(("sum", tag), n)
            for a, (lo, hi) in zip(arrays, bounds):
                partial[lo:hi] = a
        return partial

    def _receive(self, source: int, tag: int, into: np.ndarray, bounds) -> None:
        pending = [(self.up.irecv(source, hi - lo, tag, buffers=_Into(into[lo:hi])), into[lo:hi]) for lo, hi in bounds]
        for request, part in pending:
            got = request.wait()
            if got is not part:  # a transport that received elsewhere
                part[...] = got

    def _vector(self, key, n: int) -> np.ndarray:
        """A float32 vector of ``n`` elements kept under ``key`` and reused."""
        v = self._vectors.get(key)
        if v is None or v.size < n:
            v = self._vectors[key] = np.empty(n, np.float32)
        return v[:n]

    @_timed("share_seconds")
    def share(self, dense, n: int, out: np.ndarray | None = None, result: AllreduceResult | None = None,
              decoded_into: bool = False) -> np.ndarray:
        """The leader's result of ``n`` elements on every rank of its host (collective over the
        host: each rank calls it for the same bucket, in bucket order).  The leader passes its
        ``dense`` result and, where it decoded one, the aggregator's ``result`` and whether it
        decoded it into a result vector (``decoded_into``); a sparse result crosses as it is and
        every rank decodes it alike (module docstring).  ``out``: where another rank receives or
        decodes it when the leader decoded into a vector (default: a new vector)."""
        if self.leader:
            x = np.ascontiguousarray(dense, np.float32).reshape(-1)
            if self.down.size > 1:
                self._send(x, result, decoded_into)
            return x
        form, count, pieces, into, index_size = (int(v) for v in self._notice())
        if form == DENSE:
            if out is None:
                return self.down.bcast(None, root=0, shape=(n,), dtype=np.float32)
            return self.down.bcast(None, root=0, out=out)
        index_dtype = np.dtype(np.int32 if index_size == 4 else np.int64)
        idx = self.down.bcast(None, root=0, shape=(count,), dtype=index_dtype)
        val = self.down.bcast(None, root=0, shape=(count,), dtype=np.float32)
        if form == INDICES:
            got = AllreduceResult(idx, val, n=n)
        else:
            counts = self.down.bcast(None, root=0, shape=(pieces,), dtype=np.int64)
            bounds = np.concatenate(([0], np.cumsum(counts)))
            got = AllreduceResult(None, pieces=[(idx[a:b], val[a:b]) for a, b in zip(bounds[:-1], bounds[1:])], n=n)
        return got.to_dense(n, out if into else None)

    def _send(self, x: np.ndarray, result, decoded_into: bool) -> None:
        """The leader's side of :meth:`share`: a notice to each of its ranks, then the broadcasts."""
        form = DENSE
        if result is not None and result.pieces is not None:
            form = PIECES
            counts = np.array([len(p[0]) for p in result.pieces], np.int64)
            idx = np.concatenate([np.asarray(p[0]) for p in result.pieces]) if len(counts) else np.zeros(0, np.int64)
            val = np.concatenate([np.asarray(p[1], np.float32) for p in result.pieces]) if len(counts) else \
                np.zeros(0, np.float32)
        elif result is not None and result.indices is not None:
            form, counts = INDICES, np.zeros(0, np.int64)
            idx, val = np.asarray(result.indices), np.asarray(result.values, np.float32).reshape(-1)
        if form != DENSE and idx.dtype not in (np.int32, np.int64):
            idx = idx.astype(np.int64)
        notice = np.array([form, 0 if form == DENSE else idx.size, 0 if form == DENSE else counts.size,
                           int(bool(decoded_into)), 0 if form == DENSE else idx.dtype.itemsize], np.int64)
        sent = [self.notice.isend(notice, r, 0) for r in range(1, self.down.size)]
        if form == DENSE:
            self.down.bcast(x, root=0)
        else:
            self.down.bcast(np.ascontiguousarray(idx), root=0)
            self.down.bcast(np.ascontiguousarray(val), root=0)
            if form == PIECES:
                self.down.bcast(counts, root=0)
        for request in sent:
            request.wait()

    def _notice(self) -> np.ndarray:
        """Another rank's side: the leader's notice, waited for quietly."""
        return self.notice.irecv(0, _NOTICE, 0, np.int64).wait()


class _Into:
    """A :class:`tfsparse.buffers.Reusable` stand-in that hands out one given vector."""

    def __init__(self, vector):
        self.vector = vector

    def take(self, count, dtype):
        return self.vector
