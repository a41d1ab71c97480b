"""Worker (run with NUMBA_ENABLE_CUDASIM=1): the TensorFlow glue of GradientExchange on its
``"cuda"`` path (tf.py_function ops, the gradients viewed on the device, the exchange's vectors in
a CudaSpace) next to its host path (tf.numpy_function), on the same gradients, inside a
tf.function; saves both results and residuals per round, and what each graph ran, for
tests/test_exchange_device.py.

argv: algorithm:wire [...]
"""
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from mpi_harness import save_result  # noqa: E402
from test_exchange_pipeline import DENSITY, OPTIONS, STEPS, flat, grads_of  # noqa: E402
from tfsparse.collectives import MPICommunicator  # noqa: E402
from tfsparse.exchange import GradientExchange  # noqa: E402
from tfsparse.pipelined import Pipelined  # noqa: E402
from tfsparse.tf_glue import exchange_tensors  # noqa: E402
from tfsparse.ops import cuda as kc  # noqa: E402
from tfsparse.ops import tf as ops_tf  # noqa: E402

kc.set_block_shape(32, 8, 2)  # few simulated threads per launch
comm = MPICommunicator()
out = {}
for case in sys.argv[1:]:
    algorithm, wire = case.split(":")
    for path, key in (("cuda", "dev"), ("cpu", "host")):
        ops_tf.set_path(path)  # read when the exchange is built (its first trace)
        ex = Pipelined(GradientExchange(algorithm, DENSITY, wire_dtype=wire, communicator=comm,
                                        **OPTIONS.get(algorithm, {})))
        step = tf.function(functools.partial(exchange_tensors, ex), autograph=False)
        for s in range(STEPS):
            got = step([tf.constant(g) for g in grads_of(comm.rank, s)])
            out[f"{case}/{key}{s}"] = flat([g.numpy() for g in got])
            res = ex.residual
            out[f"{case}/{key}res{s}"] = np.zeros(0, np.float32) if res is None else res
        graph = step.get_concrete_function([tf.TensorSpec(g.shape, tf.float32) for g in grads_of(0, 0)]).graph
        out[f"{case}/{key}/ops"] = sorted({op.type for op in graph.get_operations()} & {"EagerPyFunc", "PyFunc"})
        out[f"{case}/{key}/space"] = ex.space.name
        out[f"{case}/buckets"] = np.array([(b.start, b.stop) for b in ex.buckets], np.int64)
        ex.close()
ops_tf.set_path(None)
save_result(comm.rank, **out)
