"""MPI transport over mpi4py (the default engine)."""
from __future__ import annotations

import time

import numpy as np

from .communicator import Communicator, Request, split_counts


_RING_TAG = 7601  # the allgather ring's messages (point-to-point, apart from the aggregators' tags)


def _mpi():
    from mpi4py import MPI  # imported lazily: importing tfsparse must not start MPI

    return MPI


class MPICommunicator(Communicator):
    """Communicator on an ``mpi4py`` communicator (``MPI.COMM_WORLD`` by default).

    Uses the buffer (upper-case) mpi4py API throughout.  ``allreduce`` is a
    ``Reduce_scatter`` followed by an allgather of the reduced blocks: each element is reduced
    once, by one owner, so the result is bit-identical on every rank regardless of the
    algorithm Open MPI selects.

    The allgathers (``allgather`` and the second half of ``allreduce``) run as a ring of
    ``Sendrecv`` s (:meth:`_ring_allgatherv`, the algorithm whose volume the byte counts
    assume) rather than ``Allgatherv``: Open MPI 4.1's choice for ``Allgatherv`` at 4 ranks,
    the neighbour exchange, sends both ways over each link at once, and took about 1.6x the
    ring's time on the emulated 1 Gbit/s network (measured side by side: docs/network.md).
    """

    name = "mpi"
    forms_groups = True
    manual_progress = True

    def __init__(self, comm=None):
        MPI = _mpi()
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        super().__init__(self.comm.Get_rank(), self.comm.Get_size())
        self.thread_safe = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    def progress(self):
        """Lets Open MPI's progress engine move the messages in flight: one ``Iprobe`` (any source, any tag),
        which receives nothing."""
        # any MPI call runs Open MPI's progress engine; a probe that matches nothing changes nothing
        self.comm.Iprobe()  # any source, any tag

    def _allreduce(self, x, op):
        return self._allreduce_into(x, op, None)

    def _allreduce_into(self, x, op, out):
        flat = x.reshape(-1)
        counts = split_counts(flat.size, self.size)
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        mine = np.empty(int(counts[self.rank]), dtype=flat.dtype)
        self.comm.Reduce_scatter(flat, mine, recvcounts=counts.tolist(), op=self._ops[op])
        out = np.empty_like(flat) if out is None else out
        self._ring_allgatherv(mine, out, counts, displs)
        return out

    def _allgather(self, x):
        counts = np.empty(self.size, dtype=np.int64)
        self.comm.Allgather(np.array([x.size], dtype=np.int64), counts)
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        out = np.empty(int(counts.sum()), dtype=x.dtype)
        self._ring_allgatherv(x, out, counts, displs)
        return [out[int(d):int(d + c)] for d, c in zip(displs, counts)]

    def _ring_allgatherv(self, mine, out, counts, displs) -> None:
        """``out[displs[j]:displs[j] + counts[j]]`` = rank ``j``'s ``mine``, on every rank: a ring of
        ``P - 1`` steps, in step ``s`` each rank passes block ``rank - s`` to its successor and
        takes block ``rank - s - 1`` from its predecessor -- every link carries one direction
        at a time, and each rank sends every block but its successor's."""
        P, r = self.size, self.rank
        out[int(displs[r]):int(displs[r] + counts[r])] = mine
        succ, pred = (r + 1) % P, (r - 1) % P
        for step in range(P - 1):
            s, t = (r - step) % P, (r - step - 1) % P
            self.comm.Sendrecv(out[int(displs[s]):int(displs[s] + counts[s])], succ, _RING_TAG,
                               out[int(displs[t]):int(displs[t] + counts[t])], pred, _RING_TAG)

    def _bcast(self, x, root, shape, dtype):
        buf = x if x is not None else np.empty(shape, dtype=dtype)
        buf = np.ascontiguousarray(buf)
        self.comm.Bcast(buf, root=root)
        return buf

    def _bcast_into(self, out, root):
        self.comm.Bcast(out, root=root)
        return out

    def _alltoall(self, blocks):
        send_counts = np.array([b.size for b in blocks], dtype=np.int64)
        recv_counts = np.empty(self.size, dtype=np.int64)
        self.comm.Alltoall(send_counts, recv_counts)
        sdispl = np.concatenate(([0], np.cumsum(send_counts)[:-1]))
        rdispl = np.concatenate(([0], np.cumsum(recv_counts)[:-1]))
        dtype = blocks[0].dtype
        sendbuf = np.concatenate(blocks) if blocks else np.empty(0, dtype)
        recvbuf = np.empty(int(recv_counts.sum()), dtype=dtype)
        self.comm.Alltoallv([sendbuf, (send_counts.tolist(), sdispl.tolist())],
                            [recvbuf, (recv_counts.tolist(), rdispl.tolist())])
        return [recvbuf[int(d):int(d + c)] for d, c in zip(rdispl, recv_counts)]

    def wait_quietly(self, pause):
        """Open MPI waits by polling (``MPI_Wait`` spins, yielding at most); here a quiet wait
        calls ``MPI_Test`` -- one turn of the progress engine, which moves what the sockets
        take -- every ``pause`` seconds and sleeps in between."""
        self.quiet_pause = None if pause is None else float(pause)
        return True

    def _barrier(self):
        self.comm.Barrier()

    def _duplicate(self):
        return MPICommunicator(self.comm.Dup())

    def _split(self, color):
        MPI = _mpi()
        part = self.comm.Split(MPI.UNDEFINED if color is None else color, self.rank)
        return None if part == MPI.COMM_NULL else MPICommunicator(part)

    def _send(self, x, dest, tag):
        self.comm.Send(x, dest=dest, tag=tag)

    def _isend(self, x, dest, tag):
        req = self.comm.Isend(x, dest=dest, tag=tag)
        pause = self.quiet_pause
        return Request(lambda: _wait(req, x, pause))  # x stays referenced until the send completes

    def _recv(self, source, tag, dtype):
        MPI = _mpi()
        status = MPI.Status()
        self.comm.Probe(source=source, tag=tag, status=status)
        n = status.Get_count(MPI.BYTE) // dtype.itemsize
        buf = np.empty(n, dtype=dtype)
        self.comm.Recv(buf, source=source, tag=tag)
        return buf

    def _irecv(self, source, count, tag, dtype, exact=True):
        return self._irecv_into(source, np.empty(count, dtype=dtype), tag, exact)

    def _irecv_into(self, source, buf, tag, exact=True):
        dtype = buf.dtype
        req = self.comm.Irecv(buf, source=source, tag=tag)
        pause = self.quiet_pause

        def wait():
            if exact:
                _wait(req, buf, pause)
                return buf
            status = _mpi().Status()
            _wait(req, buf, pause, status)
            return buf[:status.Get_count(_mpi().BYTE) // dtype.itemsize]

        return Request(wait)


def _wait(req, _buffer, pause=None, status=None):
    """``req.Wait(status)`` -- or, with a ``pause``, ``req.Test(status)`` every ``pause`` seconds
    (:meth:`MPICommunicator.wait_quietly`)."""
    if pause is None:
        req.Wait(status)
        return
    while not req.Test(status):
        time.sleep(pause)
