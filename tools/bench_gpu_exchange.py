#!/usr/bin/env python
"""The device-resident exchange across ranks on a GPU, against the host exchange (a benchmark
and a check; it needs a GPU, or Numba's CUDA simulator with a small ``--model``).

Run one process per rank; the ranks may share one GPU::

    mpirun -np 2 python tools/bench_gpu_exchange.py                  # 17.1M MLP, 4 settings
    mpirun -np 2 python tools/bench_gpu_exchange.py --model 25m --density 0.001
    python tools/bench_gpu_exchange.py --threads 2                   # no MPI: 2 ranks as threads

Every rank makes its gradients on the host from a seed (rank, step, tensor), copies them to the
GPU, and runs each setting through two exchanges on the same communicator:

* **device**: ``GradientExchange.exchange_numpy`` on the device arrays -- error feedback,
  selection and decoding on the GPU, only the payload crosses to the host for MPI;
* **copy to host**: the path a TensorFlow user has otherwise -- the gradients copied to the host,
  the host exchange, the result copied back to the GPU.

Per step it checks that the device exchange's result and residual equal the host exchange's bit
for bit and that every rank holds the same result (a digest compared across ranks), and it times
both paths between barriers (the slowest rank's time, CUDA synchronised).  Rank 0 prints a table
and writes ``<out>/gpu_exchange_<model>.json``; the exit status is 1 when any check failed.
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import platform
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: the models of the network benchmarks (docs/network.md): layer shapes of the MLPs
MODELS = {
    "17m": [(64, 4096), (4096,), (4096, 4096), (4096,), (4096, 10), (10,)],
    "25m": [(1024, 4096), (4096,), (4096, 4096), (4096,), (4096, 1024), (1024,)],
    "tiny": [(40, 30), (30,), (30, 20), (20,), (25, 8)],   # for the CUDA simulator
}
SETTINGS = ("topk", "gtopk", "dragonn", "dense:int8")


def gradients(shapes, rank: int, step: int) -> list[np.ndarray]:
    """Gradient-like tensors: heavy-tailed per-rank noise plus a signal the ranks share."""
    out = []
    for i, shape in enumerate(shapes):
        rng = np.random.default_rng([rank, step, i])
        shared = np.random.default_rng([999, i]).standard_normal(shape, dtype=np.float32)
        out.append((rng.laplace(size=shape).astype(np.float32) + np.float32(0.5) * shared) * np.float32(1e-2))
    return out


def digest(arrays) -> np.ndarray:
    h = hashlib.sha1()
    for a in arrays:
        h.update(np.ascontiguousarray(a).view(np.uint8))
    return np.frombuffer(h.digest(), np.uint8)


def slowest(comm, seconds: float) -> float:
    return float(max(a[0] for a in comm.allgather(np.array([seconds], np.float64))))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32).ravel(), np.asarray(b, np.float32).ravel()
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def run_rank(comm, args) -> dict | None:
    from numba import cuda

    from tfsparse.exchange import GradientExchange

    shapes = MODELS[args.model]
    n = sum(int(np.prod(s)) for s in shapes)
    report = {"settings": {}, "failures": []}
    for setting in args.settings:
        algorithm, _, wire = setting.partition(":")
        options = {"wire_dtype": wire or "float32"}
        dev = GradientExchange(algorithm, args.density, communicator=comm, **options)
        host = GradientExchange(algorithm, args.density, communicator=comm, **options)
        times = {"device": [], "copy_to_host": []}
        profiler = cProfile.Profile() if args.profile and comm.rank == 0 else None
        checks = {"device_equals_host": True, "residual_equals_host": True, "ranks_agree": True}
        for step in range(args.warmup + args.steps):
            g = gradients(shapes, comm.rank, step)
            d = [cuda.to_device(x) for x in g]
            cuda.synchronize()

            comm.barrier()
            profiling = profiler is not None and step >= args.warmup
            if profiling:
                profiler.enable()
            t0 = time.perf_counter()
            got = dev.exchange_numpy(d)
            cuda.synchronize()
            t_dev = time.perf_counter() - t0
            if profiling:
                profiler.disable()

            comm.barrier()
            t0 = time.perf_counter()
            ref = host.exchange_numpy([x.copy_to_host() for x in d])
            back = [cuda.to_device(r) for r in ref]
            cuda.synchronize()
            t_host = time.perf_counter() - t0
            del back

            got_h = [x.copy_to_host() for x in got]
            ok = all(same_bits(a, b) for a, b in zip(got_h, ref))
            res_ok = (dev.residual is None and host.residual is None) or same_bits(dev.residual, host.residual)
            agree = len({a.tobytes() for a in comm.allgather(digest(got_h))}) == 1
            checks["device_equals_host"] &= ok
            checks["residual_equals_host"] &= res_ok
            checks["ranks_agree"] &= agree
            if step >= args.warmup:
                times["device"].append(slowest(comm, t_dev))
                times["copy_to_host"].append(slowest(comm, t_host))
        dev.close()
        host.close()
        if profiler is not None:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
            print(f"--- {setting}: the device exchange's {args.steps} timed steps on rank 0, by own time\n"
                  + text.getvalue(), flush=True)
        med = {key: float(np.median(v)) for key, v in times.items()}
        report["settings"][setting] = {
            "n": n, "density": args.density, "steps": args.steps,
            "device_ms": med["device"] * 1e3, "copy_to_host_ms": med["copy_to_host"] * 1e3,
            "speedup": med["copy_to_host"] / med["device"],
            "device_ms_all": [t * 1e3 for t in times["device"]],
            "copy_to_host_ms_all": [t * 1e3 for t in times["copy_to_host"]], **checks}
        report["failures"] += [f"{setting}: {key}" for key, ok in checks.items() if not ok]
    return report if comm.rank == 0 else None


def machine(comm_size: int, transport: str) -> dict:
    import numba
    from numba import cuda

    dev = cuda.get_current_device()
    name = getattr(dev, "name", "CUDA simulator")
    info = {"gpu": name.decode() if isinstance(name, bytes) else str(name),
            "compute_capability": list(getattr(dev, "compute_capability", ())),
            "ranks": comm_size, "transport": transport, "python": platform.python_version(),
            "numpy": np.__version__, "numba": numba.__version__}
    try:
        from importlib import metadata

        info["numba_cuda"] = metadata.version("numba-cuda")
    except Exception:  # noqa: BLE001 -- informative only
        pass
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="17m")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="comma-separated algorithm[:wire] (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per setting")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps (kernel compilation)")
    ap.add_argument("--threads", type=int, default=0, metavar="P",
                    help="P ranks as threads of this process (no MPI) instead of one rank per MPI process")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print rank 0's N most expensive functions of the device exchange (cProfile)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    args.settings = [s for s in args.settings.split(",") if s]
    if args.threads:
        from tfsparse.collectives import InProcessWorld

        results = InProcessWorld(args.threads, timeout=600).run(lambda comm: run_rank(comm, args))
        report, size, transport = results[0], args.threads, "threads"
    else:
        from tfsparse.runtime import init

        # the world, and a rank's failure ends every rank (no TensorFlow needed); the host kernels
        # keep Numba's own thread count, as the host baseline always had
        comm = init(backend="mpi", cores_per_rank=None)
        report, size, transport = run_rank(comm, args), comm.size, "mpi"
        if comm.rank != 0:
            return 0
    report = {"machine": machine(size, transport), "model": args.model, **report}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_exchange_{args.model}.json").write_text(json.dumps(report, indent=1))
    m = report["machine"]
    print(f"{m['gpu']}, P = {size} ({transport}), model {args.model}, density {args.density}")
    print(f"{'setting':<12} {'device ms':>10} {'copy-to-host ms':>16} {'speed-up':>9}  bit-identical / ranks agree")
    for setting, r in report["settings"].items():
        print(f"{setting:<12} {r['device_ms']:10.2f} {r['copy_to_host_ms']:16.2f} {r['speedup']:8.2f}x  "
              f"{r['device_equals_host'] and r['residual_equals_host']} / {r['ranks_agree']}")
    print(f"wrote {out / f'gpu_exchange_{args.model}.json'}")
    if report["failures"]:
        print("FAILED: " + "; ".join(report["failures"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
