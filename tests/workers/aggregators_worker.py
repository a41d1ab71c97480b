"""Runs every aggregation algorithm on real MPI ranks (numpy only: no TensorFlow), many cases
in one launch, and saves what each rank saw for tests/test_aggregators_mpi.py.

Cases per algorithm NAME (keys ``NAME__...``):
* ``NAME__s{step}_*`` -- STEPS allreduce steps on gradient-like data: the rank's input,
  the dense result, ``contributed``, bytes sent, and the aggregator's ``last_info``;
* ``NAME__sgd_*`` -- 50 steps of plain SGD through GradientExchange: raw gradient total,
  applied update total, final residual (and for gtopk every step's accumulator).
Plus ``oktopk_bal__...``: Ok-Topk with stale boundaries and crowded global top-k values,
so that data balancing runs over real point-to-point messages.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from mpi_harness import save_result  # noqa: E402
from tfsparse import aggregators as A  # noqa: E402
from tfsparse import collectives as C  # noqa: E402
from tfsparse.exchange import GradientExchange  # noqa: E402

N, K, STEPS = 3000, 60, 3
SGD_N, SGD_DENSITY, SGD_STEPS = 500, 0.04, 50
ALGOS = ("dense", "topk", "gtopk", "oktopk", "dgc", "gaussiank", "dragonn")
OPTIONS = {"dgc": {"seed": 5}}


def make_acc(rank, step, n):
    rng = np.random.default_rng([rank, step, 17])
    shared = np.random.default_rng([999]).standard_normal(n) * 0.5
    return (rng.laplace(size=n) + shared).astype(np.float32)


def allreduce_steps(comm, name, accs, k, options, out, key):
    agg = A.get_aggregator(name, **options)
    for s, acc in enumerate(accs):
        comm.barrier()
        before = comm.bytes_sent
        res = agg.allreduce(comm, acc, k)
        nbytes = comm.bytes_sent - before
        info = {kk: (v.tolist() if isinstance(v, np.ndarray) else v)
                for kk, v in getattr(agg, "last_info", {}).items()}
        out[f"{key}__s{s}_acc"] = acc
        out[f"{key}__s{s}_dense"] = res.to_dense(acc.size)
        out[f"{key}__s{s}_indices"] = np.asarray([] if res.indices is None else res.indices, np.int64)
        out[f"{key}__s{s}_contributed"] = np.asarray([] if res.contributed is None else res.contributed, np.int64)
        out[f"{key}__s{s}_meta"] = json.dumps({"bytes": int(nbytes), "sent": int(res.sent_elements), "info": info})


def sgd(comm, name, options, out):
    ex = GradientExchange(name, SGD_DENSITY, communicator=comm, **options)
    n = SGD_N
    w = np.zeros(n, np.float64)
    target = np.random.default_rng([comm.rank, 77]).standard_normal(n)
    residual = np.zeros(n, np.float32)
    raw = np.zeros(n, np.float64)
    applied = np.zeros(n, np.float64)
    accs = []
    for s in range(SGD_STEPS):
        grad = ((w - target) + 0.3 * np.random.default_rng([comm.rank, s]).standard_normal(n)).astype(np.float32)
        raw += grad
        accs.append(grad + residual if ex.uses_memory else grad)
        summed = ex.exchange_numpy(grad)
        applied += summed
        if ex.uses_memory:
            residual = ex.residual
        w -= 0.05 * summed / comm.size
    out[f"{name}__sgd_raw"] = raw
    out[f"{name}__sgd_applied"] = applied
    out[f"{name}__sgd_residual"] = residual.astype(np.float64)
    out[f"{name}__sgd_w"] = w
    if name == "gtopk":
        out[f"{name}__sgd_accs"] = np.stack(accs)


def main():
    comm = C.MPICommunicator()
    out = {}
    for name in ALGOS:
        accs = [make_acc(comm.rank, s, N) for s in range(STEPS)]
        allreduce_steps(comm, name, accs, K, OPTIONS.get(name, {}), out, name)
        sgd(comm, name, OPTIONS.get(name, {}), out)
    # Ok-Topk data balancing: step 1 sets even boundaries, step 2 puts every rank's top-k on
    # the same indices inside region 0 (tau_prime=1: fresh thresholds every step)
    P = comm.size
    hot = np.random.default_rng(11).choice(max(N // (4 * P), K), size=K, replace=False)
    bal = []
    for s in range(2):
        a = np.random.default_rng([s, comm.rank, 3]).standard_normal(N).astype(np.float32)
        if s == 1:
            a *= 0.01
            a[hot] = 5.0 + comm.rank
        bal.append(a)
    allreduce_steps(comm, "oktopk", bal, K, {"tau_prime": 1, "balance_factor": 1.5}, out, "oktopk_bal")
    out["P"] = int(comm.size)
    out["tensorflow_imported"] = "tensorflow" in sys.modules
    save_result(comm.rank, **out)


if __name__ == "__main__":
    main()
