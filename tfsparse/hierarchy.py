"""The two-level exchange's groups (``hierarchical=True``, :mod:`tfsparse.settings`): the ranks
of each host, and the host leaders that talk across hosts.

* **Inside a host**, every rank but the first (the host's *leader*) sends its bucket's gradient
  to the leader, which adds them to its own in rank order: one fixed order, so the host's sum is
  the same bits on every run (:meth:`TwoLevel.host_sum`).
* **Across hosts**, the leaders alone run the exchange's algorithm on their host's sum, over
  :attr:`TwoLevel.cross` (the communicator of the leaders, one per host).
* **Back inside the host**, the leader broadcasts the dense result to its ranks
  (:meth:`TwoLevel.share`): every rank applies the leader's bits.

Each host is one worker of the algorithm: its error feedback (residual, velocity) lives on the
leader and compensates the host's sum -- BytePS' two-level compression: compressed once per
machine, on the sum of the machine's gradients, with error feedback per machine.
"""
from __future__ import annotations

import numpy as np

from .collectives.hosts import host_ids


class TwoLevel:
    """One rank's place in the two-level exchange, made by :meth:`of` (collective)."""

    def __init__(self, up, down, cross, hosts: int):
        self.up = up  # the host's ranks: gradients to the leader (point to point, tag = bucket)
        self.down = down  # the host's ranks: the leader's result back (broadcasts, bucket order)
        self.cross = cross  # the leaders, one per host (None on the other ranks)
        self.hosts = int(hosts)

    @classmethod
    def of(cls, comm, ids=None) -> "TwoLevel":
        """The groups of ``comm``'s ranks by host (``ids``: each rank's host, in rank order; default
        :func:`~tfsparse.collectives.hosts.host_ids`, one allgather).  Collective."""
        ids = host_ids(comm) if ids is None else list(ids)
        order = list(dict.fromkeys(ids))  # hosts numbered by their first rank
        up = comm.split(order.index(ids[comm.rank]))
        down = up.duplicate()
        cross = comm.split(0 if up.rank == 0 else None)
        return cls(up, down, cross, len(order))

    @property
    def leader(self) -> bool:
        return self.up.rank == 0

    @property
    def local_size(self) -> int:
        return self.up.size

    def host_sum(self, space, arrays, tag: int):
        """The leader: the flat float32 sum of its host's gradients (its own ``arrays`` first, then
        each other rank's, in rank order) and None.  Another rank: None and the request of its
        gradient's send to the leader (wait for it before the buffer is touched again)."""
        own = np.concatenate([np.asarray(space.to_host(a), np.float32).reshape(-1) for a in arrays]) \
            if len(arrays) != 1 else np.array(space.to_host(arrays[0]), np.float32, copy=True).reshape(-1)
        if not self.leader:
            return None, self.up.isend(own, 0, tag)
        pending = [self.up.irecv(r, own.size, tag) for r in range(1, self.up.size)]
        for request in pending:  # rank order: the same bits on every run
            own += request.wait()
        return own, None

    def share(self, dense, n: int) -> np.ndarray:
        """The leader's dense result of ``n`` elements on every rank of its host (collective over
        the host: each rank calls it for the same bucket, in bucket order)."""
        x = np.ascontiguousarray(dense, np.float32).reshape(-1) if self.leader else None
        if self.down.size == 1:
            return x
        return self.down.bcast(x, root=0, shape=(n,), dtype=np.float32)
