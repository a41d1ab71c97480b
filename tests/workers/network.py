"""Runs inside ``tfsparse-run --net``: reports this rank's address, its link's shaping and Open
MPI's transports, and times a point-to-point transfer from rank 0 to every other rank."""
import os
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

from mpi_harness import save_result

comm = MPI.COMM_WORLD
nbytes = int(sys.argv[1])
buf = np.ones(nbytes, np.uint8)
seconds = []
for peer in range(1, comm.size):
    comm.Barrier()
    start = time.perf_counter()
    if comm.rank == 0:
        comm.Send(buf, dest=peer)
        comm.Recv(buf[:1], source=peer)      # the receiver has everything
    elif comm.rank == peer:
        comm.Recv(buf, source=0)
        comm.Send(buf[:1], dest=0)
    seconds.append(time.perf_counter() - start)
addresses = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
qdisc = subprocess.run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
save_result(comm.rank, addresses=addresses, qdisc=qdisc, seconds=seconds,
            btl=os.environ.get("OMPI_MCA_btl", ""), checksum=int(buf.sum()))
