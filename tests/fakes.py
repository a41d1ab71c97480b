"""Test doubles shared by the test modules."""
from tfsparse.collectives import Communicator


class NoTalk(Communicator):
    """A communicator that fails on any communication: proves that argument errors come first."""

    def __init__(self, size: int = 4):
        super().__init__(0, size)

    def _fail(self, *a, **k):
        raise AssertionError("communication happened before argument validation")

    _allreduce = _allgather = _bcast = _alltoall = _barrier = _send = _isend = _recv = _irecv = _duplicate = _fail
