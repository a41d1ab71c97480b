"""Which ranks share a host: one allgather of a hash of each rank's hostname."""
from __future__ import annotations

import hashlib
import socket

import numpy as np


def host_ids(comm) -> list[int]:
    """Each rank's host, as a 64-bit hash of its hostname, in rank order (collective: one
    allgather of 8 bytes; no communication where ``comm`` has one rank).  Ranks with the same
    id run on the same host."""
    name = np.frombuffer(hashlib.sha1(socket.gethostname().encode()).digest()[:8], np.int64).copy()
    if comm.size == 1:
        return [int(name[0])]
    return [int(h[0]) for h in comm.allgather(name)]
