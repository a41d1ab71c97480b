"""Measures the α-β model of the link between ranks 0 and 1 by ping-pong on real MPI ranks
(tfsparse.collectives.measure_alpha_beta) and saves what every rank got, for
tests/test_alphabeta_mpi.py.  Also checks that a bad argument raises ValueError on every rank
before anything communicates (the job must then still finish: no rank waits in a collective)."""
import numpy as np

from mpi_harness import save_result
from tfsparse.collectives import MPICommunicator, measure_alpha_beta

SIZES = (8, 256, 8192, 262144, 1048576)
PROBE = (0, 100, 4096, 1 << 20)

comm = MPICommunicator()
bad = ""
try:
    measure_alpha_beta(comm, sizes=SIZES, repeats=0)
except ValueError as e:
    bad = str(e)
before = comm.bytes_sent
ab = measure_alpha_beta(comm, sizes=SIZES, repeats=6, warmup=2)
again = measure_alpha_beta(comm, sizes=SIZES, repeats=6, warmup=2)   # collective twice in a row: no mix-up
comm.barrier()
save_result(comm.rank, alpha=ab.alpha, beta=ab.beta, alpha2=again.alpha, beta2=again.beta,
            times=np.array([ab.time(n) for n in PROBE]), probe=np.array(PROBE), bad=bad,
            bytes_delta=comm.bytes_sent - before, size=comm.size)
