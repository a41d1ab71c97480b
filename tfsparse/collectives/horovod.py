"""Horovod transport: Horovod's in-graph TensorFlow collectives, run eagerly on numpy data.

Collectives (allreduce, allgather, broadcast, alltoall) go through
``horovod.tensorflow``; point-to-point messages, which Horovod does not offer,
go through mpi4py on the same MPI world (Horovod is initialised with
``hvd.init(comm=MPI.COMM_WORLD)``).  The dense allreduce is a Horovod
reducescatter followed by an allgather so that, as with the MPI backend, every
element is reduced exactly once and all ranks hold bit-identical results.
"""
from __future__ import annotations

import numpy as np

from .communicator import Communicator
from .mpi import MPICommunicator


def horovod_available() -> bool:
    """True when ``horovod.tensorflow`` imports and was built with MPI or Gloo."""
    try:
        import horovod.tensorflow as hvd
    except Exception:  # ImportError, or a Horovod built against another TF
        return False
    try:
        return bool(hvd.mpi_built() or hvd.gloo_built())
    except Exception:
        return False


class HorovodCommunicator(Communicator):
    """Communicator on Horovod's collectives (``horovod.tensorflow``, run eagerly on numpy data), with
    point-to-point messages over mpi4py on the same MPI world (``comm``, default ``MPI.COMM_WORLD``;
    Horovod is initialised on it when it is not yet).  Each collective is named ``prefix`` + its kind + a
    call counter, the name by which Horovod matches it across the ranks."""

    name = "horovod"
    # two eager Horovod collectives in flight at once from two threads are refused ("a tensor
    # with the same name as another tensor that is currently being processed"), whatever
    # their names: measured with Horovod 0.28.1
    concurrent_collectives = False
    manual_progress = True  # point to point goes over MPI

    def __init__(self, comm=None, *, prefix: str = "tfsparse"):
        import horovod.tensorflow as hvd
        import tensorflow as tf
        from mpi4py import MPI

        world = comm if comm is not None else MPI.COMM_WORLD
        if not hvd.is_initialized():
            hvd.init(comm=world)
        self._hvd, self._tf = hvd, tf
        self._p2p = MPICommunicator(world)
        super().__init__(hvd.rank(), hvd.size())
        self.thread_safe = self._p2p.thread_safe
        self._prefix = prefix
        self._seq = 0
        self._dups = 0
        self._ops = {"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}

    def _name(self, what):
        # Horovod matches eager collectives across ranks by name: name them by call order.
        self._seq += 1
        return f"{self._prefix}.{what}.{self._seq}"

    def _duplicate(self):
        # Horovod's collectives are told apart by name (their own prefix); point-to-point
        # messages go over a duplicate of the MPI world.
        self._dups += 1
        return HorovodCommunicator(self._p2p.comm.Dup(), prefix=f"{self._prefix}.d{self._dups}")

    def _allreduce(self, x, op):
        hvd, tf = self._hvd, self._tf
        flat = x.reshape(-1)
        if op != "sum" or flat.size < self.size:  # min/max are exact in any order
            out = hvd.allreduce(tf.constant(flat), op=self._ops[op], name=self._name("ar"))
            return np.asarray(out.numpy(), dtype=x.dtype).reshape(x.shape)
        # reducescatter splits dim 0 like split_counts (first ranks get the remainder)
        mine = hvd.reducescatter(tf.constant(flat), op=self._ops[op], name=self._name("rs"))
        out = hvd.allgather(mine, name=self._name("ag"))
        return np.asarray(out.numpy(), dtype=x.dtype).reshape(x.shape)

    def _allgather(self, x):
        hvd, tf = self._hvd, self._tf
        sizes = hvd.allgather(tf.constant([x.size], dtype=tf.int64), name=self._name("agn")).numpy()
        data = hvd.allgather(tf.constant(x), name=self._name("agv")).numpy()
        offs = np.concatenate(([0], np.cumsum(sizes)))
        return [data[offs[i]:offs[i + 1]].astype(x.dtype, copy=False) for i in range(self.size)]

    def _bcast(self, x, root, shape, dtype):
        hvd, tf = self._hvd, self._tf
        buf = x if x is not None else np.zeros(shape, dtype=dtype)
        return hvd.broadcast(tf.constant(buf), root_rank=root, name=self._name("bc")).numpy()

    def _alltoall(self, blocks):
        hvd, tf = self._hvd, self._tf
        splits = [b.size for b in blocks]
        data = np.concatenate(blocks)
        out, recv_splits = hvd.alltoall(tf.constant(data), splits=tf.constant(splits, dtype=tf.int32),
                                        name=self._name("a2a"))
        out = out.numpy()
        offs = np.concatenate(([0], np.cumsum(recv_splits.numpy())))
        return [out[offs[i]:offs[i + 1]] for i in range(self.size)]

    def _barrier(self):
        # horovod.tensorflow has no barrier (horovod.torch does): MPI's, on the same world
        self._p2p._barrier()

    # point-to-point: mpi4py on the same world
    def _send(self, x, dest, tag):
        self._p2p._send(x, dest, tag)

    def progress(self):
        """Moves the point-to-point messages in flight, which go over MPI (:meth:`MPICommunicator.progress`)."""
        self._p2p.progress()

    def _isend(self, x, dest, tag):
        return self._p2p._isend(x, dest, tag)

    def _recv(self, source, tag, dtype):
        return self._p2p._recv(source, tag, dtype)

    def _irecv(self, source, count, tag, dtype, exact=True):
        return self._p2p._irecv(source, count, tag, dtype, exact)

    def _irecv_into(self, source, buf, tag, exact=True):
        return self._p2p._irecv_into(source, buf, tag, exact)
