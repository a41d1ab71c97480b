"""Numpy-level transport: communicators with exact byte accounting, and the communication thread.

>>> from tfsparse import collectives as C
>>> comm = C.MPICommunicator()               # counts bytes
>>> comm.allreduce(x); comm.allgather(x); comm.bytes_sent

The sparse allreduce algorithms built on top live in :mod:`tfsparse.aggregators`.
"""
from .communicator import Communicator, Request, split_counts
from .horovod import HorovodCommunicator, horovod_available
from .inprocess import InProcessCommunicator, InProcessWorld
from .mpi import MPICommunicator
from .thread import CommThread

__all__ = [
    "Communicator", "Request", "split_counts", "MPICommunicator", "HorovodCommunicator",
    "InProcessWorld", "InProcessCommunicator", "horovod_available", "CommThread",
]
