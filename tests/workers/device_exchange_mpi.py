"""Worker (run with NUMBA_ENABLE_CUDASIM=1): a device-resident GradientExchange on real MPI
ranks -- every rank hands its gradients over as (simulated) CUDA device arrays -- next to the
host exchange on the same gradients; saves both results and residuals per round for
tests/test_exchange_device.py to check against tests/exchange_ref.py.

argv: algorithm:wire [algorithm:wire ...]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from mpi_harness import save_result  # noqa: E402
from test_exchange_pipeline import DENSITY, OPTIONS, STEPS, flat, grads_of  # noqa: E402
from tfsparse.collectives import MPICommunicator  # noqa: E402
from tfsparse.exchange import GradientExchange  # noqa: E402
from tfsparse.ops import cuda as kc  # noqa: E402

kc.set_block_shape(32, 8, 2)  # few simulated threads per launch
comm = MPICommunicator()
out = {"device": [], "sizes": comm.size}
for case in sys.argv[1:]:
    algorithm, wire = case.split(":")
    opts = OPTIONS.get(algorithm, {})
    dev = GradientExchange(algorithm, DENSITY, wire_dtype=wire, communicator=comm, **opts)
    host = GradientExchange(algorithm, DENSITY, wire_dtype=wire, communicator=comm, **opts)
    for s in range(STEPS):
        g = grads_of(comm.rank, s)
        got = dev.exchange_numpy([cuda.to_device(x) for x in g])
        out["device"].append(all(type(x).__name__ == "FakeCUDAArray" for x in got))
        out[f"{case}/dev{s}"] = flat([x.copy_to_host() for x in got])
        out[f"{case}/host{s}"] = flat(host.exchange_numpy(g))
        for name, ex in (("devres", dev), ("hostres", host)):
            res = ex.residual
            out[f"{case}/{name}{s}"] = np.zeros(0, np.float32) if res is None else res
    out[f"{case}/buckets"] = np.array([(b.start, b.stop) for b in dev.buckets], np.int64)
    dev.close()
    host.close()
save_result(comm.rank, **out)
