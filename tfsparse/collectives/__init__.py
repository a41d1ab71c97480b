"""Numpy-level transport: communicators with exact byte accounting, and the communication thread.

>>> from tfsparse import collectives as C
>>> comm = C.MPICommunicator()               # counts bytes
>>> comm.allreduce(x); comm.allgather(x); comm.bytes_sent
>>> ab = C.measure_alpha_beta(comm)          # the link's α-β model, by ping-pong
>>> from tfsparse.timing import simulate       # each aggregator's declared schedule, α-β-γ priced
>>> simulate("oktopk", 256, 25_200_000, 0.001, ab).seconds   # an exchange step at P = 256

The sparse allreduce algorithms built on top live in :mod:`tfsparse.aggregators`.
"""
from .alphabeta import AlphaBeta, measure_alpha_beta
from .communicator import Communicator, Request, split_counts
from .horovod import HorovodCommunicator, horovod_available
from .hosts import host_ids
from .inprocess import InProcessCommunicator, InProcessWorld
from .mpi import MPICommunicator
from .thread import CommThread

__all__ = [
    "Communicator", "Request", "split_counts", "MPICommunicator", "HorovodCommunicator",
    "InProcessWorld", "InProcessCommunicator", "horovod_available", "CommThread",
    "AlphaBeta", "measure_alpha_beta", "host_ids",
]
