"""Worker: runs GradientExchange inside a tf.function for several steps on seeded random
gradients and saves what each step returned, the residual, and the bytes sent.

argv: backend density steps algorithm [algorithm...]
"""
import sys

import numpy as np
import tensorflow as tf

import tfsparse
from tfsparse.exchange import GradientExchange
from tfsparse.pipelined import Pipelined
from tfsparse.schedules import k_from_density
from tfsparse.tf_glue import exchange_tensors
from mpi_harness import save_result

backend, density, steps, algorithms = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
comm = tfsparse.init(backend=backend)
comm.barrier()  # every backend has one (Horovod's TF API does not: the communicator supplies it)
rank = comm.rank
SHAPES = [(7, 5), (13,), (3, 2, 4)]


def grads_of(r, step):
    rng = np.random.default_rng(1000 * r + step)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


results = {}
for algorithm in algorithms:
    ex = Pipelined(GradientExchange(algorithm, density, communicator=comm))
    n = sum(int(np.prod(s)) for s in SHAPES)

    @tf.function
    def step_fn(g0, g1, g2):
        return exchange_tensors(ex, [g0, g1, g2])

    outs, residuals, nbytes = [], [], []
    for s in range(steps):
        before = ex.total.bytes_sent
        res = step_fn(*[tf.constant(g) for g in grads_of(rank, s)])
        nbytes.append(ex.total.bytes_sent - before)
        outs.append(np.concatenate([r.numpy().ravel() for r in res]))
        residuals.append(ex.residual if ex.uses_memory else np.zeros(n, np.float32))
    results.update({f"{algorithm}/outs": np.stack(outs), f"{algorithm}/residuals": np.stack(residuals),
                    f"{algorithm}/nbytes": nbytes,
                    f"{algorithm}/k": k_from_density(n, density) if ex.uses_memory else n})
save_result(rank, n=n, size=comm.size, backend=tfsparse.runtime.backend(), **results)
