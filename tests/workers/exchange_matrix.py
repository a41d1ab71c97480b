"""Worker: every algorithm x wire dtype x plan through GradientExchange on real MPI ranks
(numpy only), a few rounds each, GradientFlow's cases (tests/test_gradientflow.py) and the dense
16/8-bit exchange decoding in pieces; saves every round's result, residual, bytes and the Ok-Topk
thresholds, for tests/test_exchange_mpi.py to check against tests/exchange_ref.py."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from mpi_harness import save_result  # noqa: E402
from test_exchange_pipeline import ALGOS, DENSITY, OPTIONS, PLANS, STEPS, WIRES, flat, grads_of  # noqa: E402
from test_gradientflow import MPI_CASES, STEPS as GF_STEPS  # noqa: E402
from test_exchange_mpi import PIECES, pieces_grads  # noqa: E402
from tfsparse.wire import values as wire_module  # noqa: E402
from tfsparse.collectives import MPICommunicator  # noqa: E402
from tfsparse.wire import INT8_CHUNK  # noqa: E402
from tfsparse.exchange import GradientExchange  # noqa: E402


def main():
    comm = MPICommunicator()
    out = {}
    for algorithm in ALGOS:
        for wire in WIRES:
            for plan in PLANS:
                key = f"{algorithm}/{wire}/{plan}"
                ex = GradientExchange(algorithm, DENSITY, wire_dtype=wire, communicator=comm, **PLANS[plan],
                                      **OPTIONS.get(algorithm, {}))
                meta = {"bytes": [], "infos": []}
                for s in range(STEPS):
                    before = ex.total.bytes_sent
                    out[f"{key}/out{s}"] = flat(ex.exchange_numpy(grads_of(comm.rank, s)))
                    res = ex.residual
                    out[f"{key}/res{s}"] = np.zeros(0, np.float32) if res is None else res
                    meta["bytes"].append(int(ex.total.bytes_sent - before))
                    meta["infos"].append([{k: (v.tolist() if isinstance(v, np.ndarray) else v)
                                           for k, v in getattr(a, "last_info", {}).items()} for a in ex.aggregators])
                meta["buckets"] = [(b.start, b.stop) for b in ex.buckets]
                out[f"{key}/meta"] = json.dumps(meta)
                ex.close()
    for name, (algorithm, density, options) in MPI_CASES.items():  # GradientFlow's pieces
        ex = GradientExchange(algorithm, density, communicator=comm, **options)
        for s in range(GF_STEPS):
            out[f"{name}/out{s}"] = flat(ex.exchange_numpy(grads_of(comm.rank, s)))
            out[f"{name}/res{s}"] = ex.residual
        ex.close()
    # the 16/8-bit dense exchange decoding its blocks in pieces, the transport's progress run
    # between them (pieces of one int8 chunk here, so that blocks of ~10K values take several)
    wire_module.DECODE_PIECE = INT8_CHUNK
    calls = []
    progress = MPICommunicator.progress
    MPICommunicator.progress = lambda self: (calls.append(1), progress(self))  # the exchange's duplicates too
    for key, (wire, options) in PIECES.items():
        ex = GradientExchange("dense", 1.0, wire_dtype=wire, communicator=comm, **options)
        out[f"pieces/{key}/out"] = flat(ex.exchange_numpy(pieces_grads(comm.rank)))
        out[f"pieces/{key}/res"] = ex.residual
        ex.close()
    out["pieces/progress_calls"] = len(calls)
    out["P"] = comm.size
    out["tensorflow_imported"] = "tensorflow" in sys.modules
    save_result(comm.rank, **out)


if __name__ == "__main__":
    main()
