"""The two-level exchange (hierarchical=True) across hosts: each rank's gradients of
tests/test_exchange_pipeline.py through GradientExchange for a few algorithms, with the results,
residuals and bytes of every round; the test compares them with the flat reference over the
hosts' sums.  Numpy only (no TensorFlow); run alone under tfsparse-run --emulate-hosts, and by
tests/workers/hosts.py inside its launch."""
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the gradients' definition

from test_exchange_pipeline import OPTIONS, STEPS, DENSITY, flat, grads_of  # noqa: E402

CASES = {"dense-float16": ("dense", "float16"), "topk": ("topk", "float32"), "gtopk": ("gtopk", "float32"),
         "oktopk": ("oktopk", "float32")}


def run_cases(comm) -> dict:
    from tfsparse.exchange import GradientExchange

    out = {"host": socket.gethostname()}
    for name, (algorithm, wire) in CASES.items():
        ex = GradientExchange(algorithm, DENSITY, wire_dtype=wire, communicator=comm, hierarchical=True, plan=2000,
                              **OPTIONS.get(algorithm, {}))
        for s in range(STEPS):
            before = ex.total.bytes_sent
            out[f"{name}/out{s}"] = flat(ex.exchange_numpy(grads_of(comm.rank, s)))
            out[f"{name}/bytes{s}"] = ex.total.bytes_sent - before
            residual = ex.residual
            if residual is not None:
                out[f"{name}/res{s}"] = residual
        out[f"{name}/buckets"] = [[b.start, b.stop] for b in ex.buckets]
        ex.close()
    return out


if __name__ == "__main__":
    import tfsparse
    from mpi_harness import save_result

    comm = tfsparse.init(backend="mpi")
    save_result(comm.rank, **run_cases(comm))
