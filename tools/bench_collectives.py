"""Measured communication volume of every sparse allreduce next to its paper's formula.

    python tools/bench_collectives.py                       # P = 2, 4, 8; n = 25M; density 0.001
    python tools/bench_collectives.py --n 2000000 --procs 2 3 4

For each P the tool launches one real ``mpirun`` job (``--oversubscribe``; it takes the same
global lock as the tests, ``/tmp/tfsparse-mpi.lock``, so only one MPI job runs at a time on
the machine).  Every rank draws a fresh N(0, 1) float32 gradient of ``n`` elements per step;
each algorithm runs ``--steps`` allreduces with ``k = ceil(density * n)``, and the bytes each
rank handed to the network (``Communicator.bytes_sent``, see
tfsparse/collectives/communicator.py for the per-call accounting) are recorded per step.

Paper formulas, in bytes (an element = 4 bytes; COO = value + int32 index):

=========  =====================================  ==========================================
dense      ``2n(P-1)/P`` per rank                 gtopk-ssgd-shi2019 Eq. 5, oktopk-li2022 T. 1
topk       ``2k(P-1)`` per rank                   gtopk-ssgd-shi2019 Eq. 6
gtopk      ``4k log2 P`` at the root (recv+sent)  gtopk-ssgd-shi2019 Eq. 7 (ceil(log2 P) rounds)
oktopk     ``<= 6k(P-1)/P`` per rank              oktopk-li2022 Eq. 3 (steps reusing thresholds)
dgc        ``2k(P-1)`` per rank (allgather)       as topk, k' = the entries actually selected
gaussiank  ``2k(P-1)`` per rank (allgather)       oktopk-li2022 Table 1
dragonn    ``2k'(P-1)``, k' occupied slots         dragonn-wang2022 §4.2 (k' ≈ 0.89k of 4k slots)
=========  =====================================  ==========================================

Measured: mean and max over ranks of the per-step bytes (for oktopk over the steps that
reuse thresholds; its first step re-evaluates them and also all-gathers the reduced values,
reported separately), and for gtopk the root's bytes sent and sent+received.  The table is
printed and written as JSON to ``results/bench_collectives.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tfsparse import files  # noqa: E402

ALGOS = ("dense", "topk", "gtopk", "oktopk", "dgc", "gaussiank", "dragonn")


def paper_bytes(algo: str, n: int, k: int, P: int) -> float:
    if algo == "dense":
        return 4 * 2 * n * (P - 1) / P
    if algo in ("topk", "dgc", "gaussiank", "dragonn"):
        return 4 * 2 * k * (P - 1)
    if algo == "gtopk":  # the tree has ceil(log2 P) rounds (= log2 P for the paper's powers of two)
        return 4 * 4 * k * math.ceil(math.log2(P))
    if algo == "oktopk":
        return 4 * 6 * k * (P - 1) / P
    raise ValueError(f"algorithm={algo!r} has no formula; accepted: {', '.join(ALGOS)}")


FORMULA = {"dense": "2n(P-1)/P", "topk": "2k(P-1)", "gtopk": "4k log2 P @root", "oktopk": "<=6k(P-1)/P",
           "dgc": "2k(P-1)", "gaussiank": "2k(P-1)", "dragonn": "2k'(P-1), k'~0.89k"}


# -- worker (one per rank, under mpirun) -------------------------------------------------

def worker(args) -> None:
    sys.path.insert(0, str(REPO))
    from tfsparse import aggregators as A
    from tfsparse import collectives as C

    comm = C.MPICommunicator()
    P, rank = comm.size, comm.rank
    n, k = args.n, max(1, math.ceil(args.density * args.n))
    rows = []
    for algo in args.algorithms:
        agg = A.get_aggregator(algo)
        per_step = []
        for s in range(args.steps):
            acc = np.random.default_rng([rank, s, 2024]).standard_normal(n, dtype=np.float32)
            comm.barrier()
            before = comm.bytes_sent
            t0 = time.perf_counter()
            res = agg.allreduce(comm, acc, k)
            dt = time.perf_counter() - t0
            info = getattr(agg, "last_info", {})
            per_step.append({"bytes": comm.bytes_sent - before, "seconds": dt, "sent": res.sent_elements,
                             "result_size": int(n if res.indices is None else res.indices.size),
                             "received": int(info.get("received_bytes", 0)),
                             "fresh": bool(info.get("fresh_thresholds", True))})
            del acc, res
        gathered = comm.comm.gather(per_step, root=0)
        if rank == 0:
            rows.append({"algorithm": algo, "P": P, "n": n, "k": k, "steps": gathered})
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(rows))


# -- driver ------------------------------------------------------------------------------

def summarize(row: dict) -> dict:
    algo, P, n, k = row["algorithm"], row["P"], row["n"], row["k"]
    steps = row["steps"]  # [rank][step]
    nsteps = len(steps[0])
    use = list(range(nsteps))
    fresh_bytes = None
    if algo == "oktopk":
        reuse = [s for s in range(nsteps) if not steps[0][s]["fresh"]]
        fresh = [s for s in range(nsteps) if steps[0][s]["fresh"]]
        fresh_bytes = float(np.mean([steps[r][s]["bytes"] for r in range(P) for s in fresh])) if fresh else None
        use = reuse or use
    b = np.array([[steps[r][s]["bytes"] for s in use] for r in range(P)], dtype=np.float64)
    per_rank = b.mean(axis=1)
    out = {"algorithm": algo, "P": P, "n": n, "k": k, "mean": float(per_rank.mean()), "max": float(per_rank.max()),
           "paper": paper_bytes(algo, n, k, P), "formula": FORMULA[algo],
           "seconds": float(np.max([[steps[r][s]["seconds"] for s in use] for r in range(P)])),
           "sent_elements_mean": float(np.mean([[steps[r][s]["sent"] for s in use] for r in range(P)])),
           "result_size": float(np.mean([steps[0][s]["result_size"] for s in use]))}
    if algo == "gtopk":
        root_sent = float(b[0].mean())
        root_recv = float(np.mean([steps[0][s]["received"] for s in use]))
        out.update(root_sent=root_sent, root_total=root_sent + root_recv, measured=root_sent + root_recv)
    elif algo == "oktopk":
        out.update(measured=out["max"], fresh_step_mean=fresh_bytes)
    else:
        out.update(measured=out["mean"])
    out["ratio"] = out["measured"] / out["paper"] if out["paper"] else float("nan")
    return out


def run_job(P: int, args) -> list[dict]:
    sys.path.insert(0, str(REPO))
    from tests.mpi_jobs import mpi_lock
    from tfsparse.run import build_command

    with tempfile.TemporaryDirectory(prefix="tfsparse-bench-") as tmp:
        result = Path(tmp) / "rows.json"
        cmd, env = build_command(P, [sys.executable, str(Path(__file__).resolve()), "--worker",
                                     "--worker-out", str(result), "--n", str(args.n), "--density", str(args.density),
                                     "--steps", str(args.steps), "--algorithms", *args.algorithms])
        if "--oversubscribe" not in cmd:
            cmd.insert(1, "--oversubscribe")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("OMPI_MCA_btl", "self,vader,tcp")
        with mpi_lock():
            t0 = time.time()
            proc = subprocess.run(cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"mpirun -np {P} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
        print(f"  P={P}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        return [summarize(row) for row in json.loads(result.read_text())]


def table(rows: list[dict]) -> str:
    mb = 1e6
    head = (f"{'algorithm':<10} {'P':>2} {'mean MB/rank':>12} {'max MB/rank':>11} {'root MB':>13} "
            f"{'paper formula':<16} {'paper MB':>9} {'ratio':>6} {'s/step':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        root = ""
        if r["algorithm"] == "gtopk":
            root = f"{r['root_sent'] / mb:.3f}+{(r['root_total'] - r['root_sent']) / mb:.3f}"
        lines.append(f"{r['algorithm']:<10} {r['P']:>2} {r['mean'] / mb:>12.4f} {r['max'] / mb:>11.4f} {root:>13} "
                     f"{r['formula']:<16} {r['paper'] / mb:>9.4f} {r['ratio']:>6.3f} {r['seconds']:>7.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=25_000_000, help="gradient elements (default 25M)")
    p.add_argument("--density", type=float, default=0.001, help="k = ceil(density * n) (default 0.001)")
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4, 8], help="world sizes (default 2 4 8)")
    p.add_argument("--algorithms", nargs="+", default=list(ALGOS), help="default: all")
    p.add_argument("--steps", type=int, default=3, help="allreduces per algorithm (default 3)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per mpirun job")
    p.add_argument("--out", default=str(REPO / "results" / "bench_collectives.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n {args.n}: must be >= 1")
    if not 0 < args.density <= 1:
        p.error(f"--density {args.density}: must be in (0, 1]")
    if args.steps < 2 and "oktopk" in args.algorithms:
        p.error(f"--steps {args.steps}: oktopk needs >= 2 steps (the first re-evaluates its thresholds)")
    unknown = [a for a in args.algorithms if a not in ALGOS]
    if unknown:
        p.error(f"--algorithms {unknown}: accepted: {', '.join(ALGOS)}")
    if args.worker:
        worker(args)
        return 0
    rows = []
    for P in args.procs:
        if P < 2:
            p.error(f"--procs {P}: world sizes must be >= 2")
        rows += run_job(P, args)
    text = table(rows)
    print(f"n = {args.n}, density = {args.density}, k = {rows[0]['k']}; bytes sent per rank per step "
          f"(MB = 1e6 bytes); ratio = measured / paper (gtopk: root sent+received; oktopk: max rank, "
          f"threshold-reuse steps)")
    print(text)
    ok = [r for r in rows if r["algorithm"] == "oktopk" and r.get("fresh_step_mean")]
    for r in ok:
        print(f"oktopk P={r['P']}: first step (fresh thresholds, + all-gather of reduced values): "
              f"{r['fresh_step_mean'] / 1e6:.4f} MB/rank")
    out = Path(args.out)
    files.write_text(out, json.dumps({"n": args.n, "density": args.density, "procs": args.procs, "rows": rows},
                                     indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
