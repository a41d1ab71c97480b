"""Step time of the gradient exchange (numpy level, real mpirun) for algorithms x wires x plans.

    python tools/bench_exchange.py                                   # P = 4, the 25.2M-parameter MLP
    python tools/bench_exchange.py --np 3 --scale 0.1 --steps 5      # smaller, quicker
    python tools/bench_exchange.py --mpi-args "--mca btl tcp,self"   # e.g. TCP only
    python tools/bench_exchange.py --wrapper ./enter_netns.sh        # each rank started through a wrapper

The gradients are those of the MLP 1024-4096-4096-1024 (25.2M float32 parameters in six
tensors; ``--scale`` shrinks every width).  For every configuration each rank runs
``--warmup`` + ``--steps`` exchange rounds (``GradientExchange.exchange_numpy``, error feedback
included) on fresh N(0, 1) gradients; a round is timed from a barrier to its result.
Reported per configuration: the median over steps of the slowest rank's round time, the phase
times of the exchange's own counters (``encode``: error feedback + selection + encoding on the
caller's thread; ``comm``: the collectives on the communication thread; ``decode``: dense
result + residual update), and the bytes one rank sent per round.  Phases run on two threads
and overlap from one bucket to the next, so their sum can exceed the round's wall time.  Every rank's Numba kernels
get ``cpu_count // P`` threads (several ranks on one node must not oversubscribe the cores).

The job takes the tests' MPI lock (``/tmp/tfsparse-mpi.lock``): one MPI job at a time.  Output:
a table, ``results/bench_exchange.json`` and ``results/bench_exchange.png`` (stacked phase
bars per configuration, the round time as a marker).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tfsparse import files  # noqa: E402
import bench_host  # noqa: E402  (run as a script: tools/ is on the path)

WIDTHS = (1024, 4096, 4096, 1024)


def mlp_shapes(scale: float) -> list[tuple]:
    w = [max(1, int(round(d * scale))) for d in WIDTHS]
    shapes = []
    for a, b in zip(w[:-1], w[1:]):
        shapes += [(a, b), (b,)]
    return shapes


def parse_plan(text: str) -> dict:
    """``fused`` | ``buckets:<bytes>`` | ``per_tensor``."""
    if text.startswith("buckets:"):
        return {"plan": int(float(text.split(":", 1)[1]))}
    return {"plan": text}


# -- worker (one per rank, under mpirun) -------------------------------------------------

def worker(args) -> None:
    sys.path.insert(0, str(REPO))
    import numba

    from tfsparse import traffic
    from tfsparse.collectives import MPICommunicator
    from tfsparse.exchange import GradientExchange
    from tfsparse.wire import get_wire

    comm = MPICommunicator()
    numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS, (os.cpu_count() or 1) // comm.size)))
    shapes = mlp_shapes(args.scale)
    pool = [[np.random.default_rng([comm.rank, s, i]).standard_normal(sh, dtype=np.float32)
             for i, sh in enumerate(shapes)] for s in range(2)]
    rows = []
    for algo in args.algorithms.split(","):
        for wire in args.wires.split(","):
            if get_wire(wire).dense_only and algo != "dense":
                continue  # (int4: the dense exchange only)
            for plan in args.plans.split(","):
                ex = GradientExchange(algo, args.density, wire_dtype=wire, communicator=comm, **parse_plan(plan))
                times = []
                for s in range(args.warmup):
                    ex.exchange_numpy(pool[s % 2])
                ex.stats.reset()
                with traffic.recording() as moved:
                    for s in range(args.steps):
                        comm.barrier()
                        t0 = time.perf_counter()
                        ex.exchange_numpy(pool[s % 2])
                        times.append(time.perf_counter() - t0)
                st = ex.stats
                mine = np.array(times + [st.encode_seconds, st.comm_seconds, st.decode_seconds,
                                                      st.bytes_per_step])
                every = np.stack(comm.allgather(mine))
                ex.close()
                per_step = every[:, :args.steps].max(axis=0)  # the slowest rank sets the pace
                steps = max(st.steps, 1)
                rows.append({"algorithm": algo, "wire": wire, "plan": plan, "buckets": len(ex.buckets),
                             "step_ms": float(np.median(per_step) * 1e3),
                             "encode_ms": float(every[:, args.steps].mean() / steps * 1e3),
                             "comm_ms": float(every[:, args.steps + 1].mean() / steps * 1e3),
                             "decode_ms": float(every[:, args.steps + 2].mean() / steps * 1e3),
                             "bytes": float(every[:, args.steps + 3].max()),
                             # rank 0's memory traffic per round, in passes over the gradient
                             "passes": moved.passes(4 * sum(int(np.prod(s)) for s in shapes), args.steps)})
    if comm.rank == 0:
        Path(args.worker_out).write_text(json.dumps(rows))


# -- driver ------------------------------------------------------------------------------

def run_job(args) -> list[dict]:
    sys.path.insert(0, str(REPO))
    from tests.mpi_jobs import mpi_lock
    from tfsparse.run import build_command

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        inner = shlex.split(args.wrapper) + [sys.executable, str(Path(__file__).resolve()), "--worker",
                                             "--worker-out", str(out)]
        for name in ("scale", "density", "steps", "warmup", "algorithms", "wires", "plans"):
            inner += [f"--{name}", str(getattr(args, name))]
        cmd, env = build_command(args.np, inner, args.mpi_args)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with mpi_lock():
            subprocess.run(cmd, env=env, check=True, timeout=args.timeout)
        return json.loads(out.read_text())


def short_plan(plan: str) -> str:
    return f"θ={int(plan.split(':')[1]) / 2**20:g}MB" if plan.startswith("buckets:") else plan


def plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['algorithm']}\n{r['wire']}\n{short_plan(r['plan'])}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(rows)), 5))
    bottom = np.zeros(len(rows))
    for key, color in (("encode_ms", "#4c72b0"), ("comm_ms", "#dd8452"), ("decode_ms", "#55a868")):
        vals = np.array([r[key] for r in rows])
        ax.bar(x, vals, bottom=bottom, color=color, label=key.replace("_ms", ""))
        bottom += vals
    ax.plot(x, [r["step_ms"] for r in rows], "k_", markersize=18, mew=2, label="round (wall)")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("ms per round")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.save_figure(fig, path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--scale", type=float, default=1.0, help="width multiplier of the MLP (1.0: 25.2M parameters)")
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--algorithms", default="dense,topk,gtopk,oktopk")
    p.add_argument("--wires", default="float32,float16")
    p.add_argument("--plans", default="fused,buckets:4194304")
    p.add_argument("--mpi-args", default="", help="extra mpirun arguments (one quoted string)")
    p.add_argument("--wrapper", default="", help="a command each rank is started through (e.g. entering a "
                                                  "network namespace), one quoted string")
    p.add_argument("--label", default="", help="appended to the machine description (e.g. the link)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=str(REPO / "results" / "bench_exchange.json"))
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from an existing --out JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.plot_only:
        saved = json.loads(Path(args.out).read_text())
        plot(saved["rows"], Path(args.out).with_suffix(".png"), f"tools/bench_exchange.py: {saved['machine']}")
        return 0
    n = sum(int(np.prod(s)) for s in mlp_shapes(args.scale))
    rows = run_job(args)
    machine = f"{bench_host.describe()}, P={args.np}, n={n:,}, density {args.density}" + \
        (f", {args.label}" if args.label else "")
    print(f"{machine}; median of {args.steps} rounds (slowest rank); phases: mean per round")
    print(f"{'algorithm':<10}{'wire':<10}{'plan':<18}{'buckets':>8}{'round ms':>10}{'encode':>9}{'comm':>9}"
          f"{'decode':>9}{'MB/round':>10}{'passes':>8}")
    for r in rows:
        print(f"{r['algorithm']:<10}{r['wire']:<10}{r['plan']:<18}{r['buckets']:>8}{r['step_ms']:>10.1f}"
              f"{r['encode_ms']:>9.1f}{r['comm_ms']:>9.1f}{r['decode_ms']:>9.1f}{r['bytes'] / 1e6:>10.3f}"
              f"{r['passes']['total']:>8.1f}")
    print("passes per stage (rank 0; bytes read + written / 4n per round; tfsparse.traffic):")
    for r in rows:
        print(f"  {r['algorithm']:<10}{r['wire']:<10}" + "  ".join(f"{k} {v}" for k, v in r["passes"].items() if v))
    out = Path(args.out)
    files.write_text(out, json.dumps({"machine": machine, "args": {k: v for k, v in vars(args).items()
                                                                   if not k.startswith("worker")}, "rows": rows},
                                     indent=1))
    plot(rows, out.with_suffix(".png"), f"tools/bench_exchange.py: {machine}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
