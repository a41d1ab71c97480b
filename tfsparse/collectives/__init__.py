"""Numpy-level collectives: communicators and sparse-allreduce aggregators.

>>> from tfsparse import collectives as C
>>> comm = C.MPICommunicator()               # counts bytes
>>> agg = C.get_aggregator("topk")
>>> res = agg.allreduce(comm, acc, k)        # res.indices, res.values (summed), res.contributed
"""
from .communicator import Communicator, Request, split_counts
from .horovod import HorovodCommunicator, horovod_available
from .inprocess import InProcessCommunicator, InProcessWorld
from .mpi import MPICommunicator
from ..aggregators import AllreduceResult, Aggregator, available_aggregators, get_aggregator

__all__ = [
    "Communicator", "Request", "split_counts", "MPICommunicator", "HorovodCommunicator",
    "InProcessWorld", "InProcessCommunicator", "horovod_available",
    "Aggregator", "AllreduceResult", "get_aggregator", "available_aggregators",
]
