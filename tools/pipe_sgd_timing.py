"""Pipe-SGD's timing model (pipe-sgd-li2018 §3.1, Eq. 2-5) against measured step times.

Reads a ``tools/bench_fit_step.py`` result (runs with ``pipeline`` 1 and 2, measured on one
launch) and predicts every run's step time from measured parts:

* ``l_compute`` = l_up + l_comp (forward, backward, update: everything but the exchange), measured
  once, on the synchronous float32 dense run (D-Sync): its step time minus the exchange's
  encoding and the time the training thread waited for the communication thread;
* per run, the compression on the training thread (``encode_ms``) and the allreduce
  ``l_comm``, either **measured** (the communication thread's time per step: ``comm_ms +
  decode_ms``) or from the **α-β ring model** of Eq. 5: ``2(p-1)·α + bytes/bandwidth``, where
  ``bytes`` (what one rank sends per step, ``2(p-1)/p`` of the wire's gradient bytes) was counted
  -- the ring of the dense aggregator's schedule (:mod:`tfsparse.timing`), given the measured
  bytes of whatever wire and buckets the run used.  The link is a
  :class:`tfsparse.collectives.AlphaBeta` (``--bandwidth``, ``--latency`` as it parses them).

D-Sync (``pipeline=1``, Eq. 2): ``l_compute + encode + l_comm``;
Pipe-SGD (``pipeline=2``, Eq. 4): ``max(l_compute + encode, l_comm)`` -- and, where the run keeps a
residual (error feedback: a lossy wire, unless ``memory="none"``), ``max(l_compute + encode,
l_comm + max(0, encode - l_comm / 2))``: step t+1's compression needs round t's residual, a
dependency the paper's Eq. 4 does not have -- but only up to the end of round t's reduce-scatter
(the residual is whole then; the allgather, half of the ring's bytes, overlaps the next encoding),
so it lengthens the step only where the encoding is longer than the allgather.

    python tools/pipe_sgd_timing.py results/pipe_1gbit.json --bandwidth 1gbit --latency 0 \\
        --out results/pipe_timing

Writes ``<out>.json`` (per run: measured and both predictions, ms) and ``<out>.png``.  Runs
that are not tfsparse's dense exchange (the compute floor ``bench_fit_step.py`` measures first,
Horovod's runs) are left out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfsparse import files  # noqa: E402
from tfsparse.collectives.alphabeta import AlphaBeta  # noqa: E402


def ring_seconds(ab: AlphaBeta, processes: int, nbytes: float) -> float:
    """Eq. 5: the ring allreduce's ``2(p-1)`` messages and the ``nbytes`` one rank sends in them."""
    return 2 * (processes - 1) * ab.alpha + nbytes / ab.beta


def predict(results: dict, ab: AlphaBeta) -> dict:
    runs, p = results["runs"], int(results["processes"])
    base = next((r for r in runs if r.get("algorithm") == "dense" and int(r.get("pipeline", 1)) == 1
                 and r.get("wire_dtype", "float32") == "float32"), None)
    if base is None:
        raise ValueError("the results need a synchronous float32 dense run (D-Sync) to measure l_compute")
    l_compute = base["step_ms"] - base["encode_ms"] - base["wait_ms"]
    rows = []
    for r in runs:
        if r.get("algorithm") != "dense":  # the compute floor and Horovod's runs have no exchange to model
            continue
        pipelined = int(r.get("pipeline", 1)) == 2
        residual = r.get("wire_dtype", "float32") != "float32" and r.get("memory", "residual") != "none"
        measured_comm = r["comm_ms"] + r["decode_ms"]
        ab_comm = 1e3 * ring_seconds(ab, p, r["mb_per_step"] * 1e6)

        def model(l_comm):
            busy = l_compute + r["encode_ms"]
            if not pipelined:
                return busy + l_comm
            # with a residual, the next encoding waits for the reduce-scatter half of the round
            return max(busy, l_comm + (max(0.0, r["encode_ms"] - l_comm / 2) if residual else 0.0))

        rows.append({"label": r["label"], "pipeline": 2 if pipelined else 1, "error_feedback": residual,
                     "measured_ms": r["step_ms"],
                     "model_measured_comm_ms": round(model(measured_comm), 1),
                     "model_alpha_beta_ms": round(model(ab_comm), 1),
                     "l_comm_measured_ms": round(measured_comm, 1), "l_comm_alpha_beta_ms": round(ab_comm, 1),
                     "encode_ms": round(r["encode_ms"], 1), "speedup_vs_dsync": round(base["step_ms"] / r["step_ms"], 2)})
    return {"processes": p, "network": results.get("network"), "bandwidth_bytes_per_s": ab.beta,
            "latency_s": ab.alpha, "l_compute_ms": round(l_compute, 1), "runs": rows}


def plot(model: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = model["runs"]
    y = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.6))
    for off, key, name in ((-0.27, "measured_ms", "measured"), (0.0, "model_measured_comm_ms", "Eq. 2/4, measured l_comm"),
                           (0.27, "model_alpha_beta_ms", "Eq. 2/4, α-β l_comm (Eq. 5)")):
        ax.barh(y + off, [r[key] for r in rows], height=0.26, label=name)
    ax.set_yticks(y, [r["label"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"Pipe-SGD timing model, {model['processes']} processes, {model['network']} "
                 f"(l_compute {model['l_compute_ms']} ms)", fontsize=9)
    fig.tight_layout()
    files.save_figure(fig, path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a tools/bench_fit_step.py JSON")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="link rate: bit, kbit, mbit, gbit, tbit, e.g. 1gbit (default)")
    parser.add_argument("--latency", default="0", help="α per message: s, ms, us, ns or 0, e.g. 50us (default 0)")
    parser.add_argument("--out", default="results/pipe_timing")
    args = parser.parse_args(argv)
    try:  # tfsparse.collectives.alphabeta's parse_rate and parse_time
        ab = AlphaBeta.from_strings(args.bandwidth, args.latency)
    except ValueError as e:
        parser.error(str(e))
    with open(args.results) as f:
        results = json.load(f)
    model = predict(results, ab)
    files.write_text(args.out + ".json", json.dumps(model, indent=1))
    plot(model, args.out + ".png")
    for r in model["runs"]:
        print(f"{r['label']:28s} measured {r['measured_ms']:8.1f} ms   model {r['model_measured_comm_ms']:8.1f} ms   "
              f"α-β model {r['model_alpha_beta_ms']:8.1f} ms")


if __name__ == "__main__":
    main()
