"""The α-β model of :mod:`tfsparse.timing` against emulated runs.

    python tools/validate_network_model.py                        # P = 2, 3, 4 at 1 Gbit/s
    python tools/validate_network_model.py --procs 2 3 --rates 1gbit 10gbit --n 4000000

For each link rate and P one launch ``tfsparse-run -np P --net RATE`` (every rank in its own
network namespace, tbf-shaped link; needs root) runs the worker: it measures the link with
:func:`tfsparse.collectives.measure_alpha_beta`, then runs every algorithm's real aggregator on
per-rank synthetic gradients (Laplace noise, a different seed per rank; float32 wire) and
times the **exchange alone** (``Aggregator.exchange`` after a barrier; the local selection is
outside it, as in the model) -- the slowest rank's time, median over ``--steps`` steps after
one warm-up step (Ok-Topk: steps that re-evaluate the thresholds and steps that reuse them,
timed separately); with ``--repeats R`` each P is launched R times and every number is the
median over the launches (on this 2-core machine the CPU-bound cells move by up to a third
from one launch to the next).  Next to it: :func:`~tfsparse.timing.simulate` of the same
step with the measured α and β and γ = 0 (the papers' α-β model), and with γ -- seconds per
element of the local work the schedule counts -- fitted per algorithm on the smallest P and
used to predict the others.  All ranks of a launch share this machine's cores; the model is
not told so by default: ``--cores C`` slows local work done by more ranks at once than there are
cores by ``busy / cores``, which on top of a γ fitted on whole steps at P = 2 overprices
Ok-Topk's re-evaluation steps at P = 4 (measured: 0.71 at 100 Mbit/s, 0.48 at 1 Gbit/s, against
0.94 and 0.92 without).  The model is told the links' token bucket
(:attr:`tfsparse.network.NetSpec.burst`: the first 128 KiB after an idle moment pass at once;
``--no-burst`` leaves it out).  The model runs in this process, after the launches:
``--reanalyze JSON`` reprices an earlier run's stored measurements without launching anything.

Open MPI's own choice of collective algorithms is not the ring the model prices.  The
Communicator's allreduce is a ``Reduce_scatter`` and an ``Allgatherv`` (bit-identical on every
rank), so those are the calls to pin: at 1 Gbit/s, P = 4, 25.2M floats Open MPI's default
decision took 2086 ms, the ring reduce-scatter and ring allgatherv 1539 ms (the model: 1265 ms;
measured here).  The launches therefore pin the rings of the collectives the aggregators call
(reduce-scatter, allgather, allgatherv, allreduce) and the binomial tree of their broadcasts
the model prices (gTop-k's exchange at P = 4, 100 Mbit/s, 4M elements, density 0.01: 129 ms under
Open MPI's default decision, 117 ms with the binomial tree pinned, one launch each);
``--mpi-default`` leaves Open MPI's decision.
They also open two TCP connections per pair of ranks (``--mca btl_tcp_links 2``): with Open MPI's
one, an exchange that sends both ways between the same two ranks at once -- the whole ring at
P = 2 -- ran at two thirds of the link's rate (ring allreduce of 16 MB at 100 Mbit/s: 1858 ms,
1412 ms with two; the model 1338 ms).  Each launch takes the MPI lock (``/tmp/tfsparse-mpi.lock``).
Output: a table, ``results/validate_network_model.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RING = "--mca coll_tuned_use_dynamic_rules 1 " + " ".join(
    f"--mca coll_tuned_{name}_algorithm {ring}"
    for name, ring in (("reduce_scatter", 3), ("allgatherv", 3), ("allgather", 4), ("allreduce", 4), ("bcast", 6)))
FULL_DUPLEX = "--mca btl_tcp_links 2"
ALGORITHMS = ("dense", "topk", "gtopk", "oktopk")
TOLERANCE = 0.25


def series(algorithms):
    """``(label, algorithm, options)`` of the timed runs: Ok-Topk twice, re-evaluating its
    thresholds at every step (``tau_prime=1``) and reusing them (the default period's steps
    2-32), so that both kinds of step are medians over ``--steps`` steps."""
    for name in algorithms:
        if name == "oktopk":
            yield "oktopk (re-evaluation steps)", name, {"tau_prime": 1}
            yield "oktopk (reuse steps)", name, {}
        else:
            yield name, name, {}


#: label -> (algorithm, options) of every timed series
SERIES = {label: (name, options) for label, name, options in series(ALGORITHMS)}


def worker(args) -> None:
    import tfsparse
    from tfsparse.aggregators import get_aggregator
    from tfsparse.collectives import measure_alpha_beta
    from tfsparse.wire import get_wire

    comm = tfsparse.init(backend="mpi")
    ab = measure_alpha_beta(comm)
    rng = np.random.default_rng([comm.rank, 7])
    k = int(np.ceil(args.density * args.n))
    wire = get_wire("float32")
    rows = []
    for label, name, options in series(args.algorithms):
        agg = get_aggregator(name, **options)
        times = []
        for step in range(1, args.steps + 2):
            acc = rng.laplace(size=args.n).astype(np.float32)
            payload = agg.encode(comm, acc, k, wire)
            comm.barrier()
            t0 = time.perf_counter()
            agg.exchange(comm, payload)
            mine = time.perf_counter() - t0
            times.append(float(comm.allreduce(np.array([mine]), op="max")[0]))
        # step 1 (warm-up; Ok-Topk's repartition) is not timed: every later step is alike
        rows.append({"algorithm": label, "measured_s": float(np.median(times[1:]))})
    if comm.rank == 0:
        print("RESULT " + json.dumps({"P": comm.size, "alpha_s": ab.alpha, "beta_bytes_per_s": ab.beta,
                                      "rows": rows}), flush=True)


def launch(P: int, rate: str, args) -> dict:
    from tests.mpi_jobs import mpi_lock

    cmd = [sys.executable, "-m", "tfsparse.run", "-np", str(P), "--net", rate]
    cmd += ["--mpi-args", FULL_DUPLEX if args.mpi_default else f"{RING} {FULL_DUPLEX}"]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--worker", "--n", str(args.n),
            "--density", str(args.density), "--steps", str(args.steps), "--algorithms", *args.algorithms]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with mpi_lock():
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            return {"rate": rate, **json.JSONDecoder().raw_decode(line.split("RESULT ", 1)[1])[0]}
    raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def combine(launches: list) -> dict:
    """One cell from repeated launches of the same P and rate: every measured number the median
    over the launches (the spread between launches on a shared machine is larger than within
    one), the launches' own measurements kept as ``measured_runs_s``."""
    cell = dict(launches[0], launches=len(launches))
    for key in ("alpha_s", "beta_bytes_per_s"):
        cell[key] = float(np.median([c[key] for c in launches]))
    cell["rows"] = [{"algorithm": rows[0]["algorithm"], "measured_runs_s": [r["measured_s"] for r in rows],
                     "measured_s": float(np.median([r["measured_s"] for r in rows]))}
                    for rows in zip(*(c["rows"] for c in launches))]
    return cell


def model(cell: dict, label: str, args, gamma: float = 0.0) -> float:
    """The simulator's time of one step (step 2: no repartition) of the row ``label`` of ``cell``:
    the measured α and β, the token bucket of ``tfsparse-run --net`` (unless ``--no-burst``),
    ``cores`` and ``gamma``."""
    from tfsparse.collectives import AlphaBeta
    from tfsparse.network import NetSpec
    from tfsparse.timing import simulate

    name, options = SERIES[label]
    ab = AlphaBeta(cell["alpha_s"], cell["beta_bytes_per_s"],
                   burst=0 if args.no_burst else NetSpec.parse(cell["rate"]).burst)
    return simulate(name, cell["P"], args.n, args.density, ab, gamma, step=2, cores=args.cores or None,
                    **options).seconds


def fit_gamma(cell: dict, row: dict, args) -> float:
    """The γ (seconds per element of the local work the schedule counts) at which the model
    gives the measured time: bisection from the row's ``predicted_s`` (γ = 0, already priced;
    the model's time does not fall as γ grows -- the local work it adds refills the token bucket
    by at most its own duration's worth of bytes), 0 when the α-β terms alone already reach the
    measured time or the schedule counts no local work."""
    target, plain = row["measured_s"], row["predicted_s"]
    if plain >= target or model(cell, row["algorithm"], args, 1.0) == plain:
        return 0.0
    lo, hi = 0.0, 1e-9
    while model(cell, row["algorithm"], args, hi) < target:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if model(cell, row["algorithm"], args, mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


def calibrate(cells, args) -> None:
    """The α-β model's prediction of every row, and γ -- the exchange's CPU cost, which the pure
    α-β model leaves out -- fitted per algorithm and link on the smallest P, then used to
    predict the others."""
    for c in cells:
        for r in c["rows"]:
            r["predicted_s"] = model(c, r["algorithm"], args)
            r["ratio"] = r["measured_s"] / r["predicted_s"]
    for rate in {c["rate"] for c in cells}:
        mine = sorted((c for c in cells if c["rate"] == rate), key=lambda c: c["P"])
        for i, row in enumerate(mine[0]["rows"]):
            gamma = fit_gamma(mine[0], row, args)
            row["gamma_s_per_element"], row["calibration"] = gamma, True
            for c in mine[1:]:
                r = c["rows"][i]
                r["gamma_s_per_element"] = gamma
                r["predicted_gamma_s"] = model(c, r["algorithm"], args, gamma)
                r["ratio_gamma"] = r["measured_s"] / r["predicted_gamma_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--rates", nargs="+", default=["1gbit"])
    p.add_argument("--n", type=int, default=25_175_040, help="gradient elements (default: the 25.2M MLP)")
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--steps", type=int, default=8, help="timed steps per algorithm (after one warm-up)")
    p.add_argument("--repeats", type=int, default=1,
                   help="launches per P and rate; each number is the median over them (default 1)")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--mpi-default", action="store_true", help="leave Open MPI's decision of collective algorithms")
    p.add_argument("--cores", type=int, default=0,
                   help="cores the ranks share, for the model (default 0: every rank has its own; e.g. 2 for "
                        "this machine: local work of more ranks at once than cores is slowed by busy/cores)")
    p.add_argument("--no-burst", action="store_true",
                   help="model plain links (default: the model is told the token bucket of tfsparse-run --net)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--reanalyze", metavar="JSON",
                   help="launch nothing: the model (with this run's --cores, --no-burst) against the "
                        "measurements stored in JSON, an earlier run's output (written back there by default)")
    p.add_argument("--out", help="output JSON (default results/validate_network_model.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, str(REPO))
    from tfsparse import files

    if args.reanalyze:
        stored = json.loads(Path(args.reanalyze).read_text())
        args.n, args.density, args.steps = (stored[key] for key in ("n", "density", "steps"))
        args.repeats = stored.get("repeats", 1)
        args.mpi_default, date, machine = not stored["ring_pinned"], stored["date"], stored["machine"]
        keep = ("algorithm", "measured_s", "measured_runs_s")
        cells = [dict(c, rows=[{key: r[key] for key in keep if key in r} for r in c["rows"]]) for c in stored["cells"]]
    else:
        date, machine = time.strftime("%Y-%m-%d"), f"{os.cpu_count()} cores, {os.uname().release}"
        cells = [combine([launch(P, rate, args) for _ in range(args.repeats)])
                 for rate in args.rates for P in args.procs]
    calibrate(cells, args)
    print(f"{'link':>7} {'P':>2} {'algorithm':<32} {'measured':>10} {'α-β':>10} {'ratio':>6} {'α-β-γ':>10} {'ratio':>6}")
    for c in cells:
        for r in c["rows"]:
            flag = "" if r.get("ratio_gamma") is None or abs(r["ratio_gamma"] - 1) <= TOLERANCE else "  (outside 25 %)"
            gamma = ("  (γ fitted here)" if r.get("calibration") else
                     f"{1e3 * r['predicted_gamma_s']:>8.1f}ms {r['ratio_gamma']:>6.2f}")
            print(f"{c['rate']:>7} {c['P']:>2} {r['algorithm']:<32} {1e3 * r['measured_s']:>8.1f}ms "
                  f"{1e3 * r['predicted_s']:>8.1f}ms {r['ratio']:>6.2f} {gamma}{flag}")
    out = Path(args.out or args.reanalyze or REPO / "results" / "validate_network_model.json")
    files.write_text(out, json.dumps({"machine": machine, "date": date,
                                      "ring_pinned": not args.mpi_default, "model_cores": args.cores or None,
                                      "model_burst": not args.no_burst, "steps": args.steps,
                                      "repeats": args.repeats, "n": args.n, "density": args.density,
                                      "cells": cells}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
