"""Predicted exchange time per step of each algorithm on a network, from the α-β-γ model.

Replays an aggregator's own message schedule (:func:`tfsparse.timing.simulate`, priced by
:mod:`tfsparse.collectives.simulate`: rounds, message sizes per rank -- gTop-k's tree and broadcasts, Ok-Topk's rotation rounds, threshold
re-evaluations and allgathers, ...) on a link of the given bandwidth and latency:

    python tools/simulate_network.py --algorithm gtopk --workers 32 --n 25200000 --density 0.001 \\
        --bandwidth 1gbit --latency 50us            # one line
    python tools/simulate_network.py ... --json     # one JSON object: "seconds", "bytes", ...
    python tools/simulate_network.py --sweep        # P = 2..1024 at 1 and 10 Gbit/s -> results/

``seconds`` is the predicted exchange time of one step (Ok-Topk: the mean over its period of
threshold re-evaluations), ``bytes`` the most bytes one rank sends per step, counted as
``Communicator.bytes_sent`` counts them.  ``--gamma`` adds seconds per element of local work
inside the exchange (reductions, merges; default 0: the pure α-β model), ``--cores`` the cores
the ranks share when they run on one node (``tfsparse-run --net``), ``--burst`` the depth in
bytes of a token bucket that shapes the links (``tfsparse-run --net``'s do: 131072 at 1gbit).
``--latency`` defaults to 50us, ``--n`` to 25.2M (the MLP 1024-4096-4096-1024) and
``--density`` to 0.001.

``--sweep`` writes ``results/simulate_network.json`` and ``results/simulate_network.png``: the
predicted time per step against P = 2, 4, .., 1024 for each algorithm at 1 and 10 Gbit/s, and the
speed-up over dense, with the speed-ups the gTop-k and Ok-Topk papers report.  Those are
end-to-end *training* speed-ups (computation included, which the model leaves out), so the
model's exchange-only speed-ups should lie above them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tfsparse import files  # noqa: E402
from tfsparse.collectives.alphabeta import AlphaBeta, parse_rate, parse_time  # noqa: E402
from tfsparse.timing import ALGORITHMS, simulate  # noqa: E402

# powers of two, as the papers scale (a non-power-of-two P adds fold rounds -- gTop-k's tree, the
# halving-doubling allreduce -- and would zigzag the curves; the CLI takes any P)
SWEEP_WORKERS = tuple(2**j for j in range(1, 11))
SWEEP_BANDWIDTHS = ("1gbit", "10gbit")
# csc is left out: it is meant for chunk densities of 10-15 % (gradientflow-sun2019 §4); at the
# sweep's density 0.001 it would allreduce a single 32K chunk.  dgc and gaussiank have topk's
# schedule with their expected selection sizes (in the JSON; in the figure they lie on topk).
SWEEP_ALGORITHMS = ("dense", "topk", "dgc", "gaussiank", "gtopk", "oktopk")
PLOTTED = ("dense", "topk", "gtopk", "oktopk")
MLP_N = 25_200_000  # the 1024-4096-4096-1024 MLP of issue 8 (25.2M float32 parameters)

# Speed-ups over dense the papers report (end-to-end training throughput, not the exchange alone).
PAPERS = (
    # gtopk-ssgd-shi2019 §V-D, Table VII ("The system training throughput on a 32-GPU cluster"),
    # 32 workers on 1 Gbps Ethernet (§V-A, Table III), density 0.001: gTop-k over dense S-SGD
    # ("g/d") 2.7x (ResNet-20) .. 12.8x (AlexNet); VGG-16 7.5x, ResNet-50 3.65x.
    {"paper": "gtopk-ssgd-shi2019", "where": "§V-D, Table VII", "algorithm": "gtopk", "workers": 32,
     "speedup_low": 2.7, "speedup_high": 12.8, "network": "1 Gbps Ethernet", "panel": "1gbit"},
    # oktopk-li2022 §5.4.3 (Figure 12, BERT pre-training, weak scaling) and the abstract: "On 256
    # GPUs, Ok-Topk outperforms all counterparts by 3.29x-12.95x" -- dense among the counterparts;
    # Piz Daint's Cray Aries network (§5), faster than either panel's link.
    {"paper": "oktopk-li2022", "where": "§5.4.3, Figure 12", "algorithm": "oktopk", "workers": 256,
     "speedup_low": 3.29, "speedup_high": 12.95, "network": "Cray Aries (Piz Daint)", "panel": "10gbit"},
)


# -- argument types: argparse reports "argument --x: ..." with the accepted values ---------------

def _type(fn):
    def convert(text):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = fn.__name__
    return convert


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{text!r} is not valid; accepted: an integer >= 1")
    return value


def _float(ok, accepted):
    """A float argument type accepting what ``ok`` accepts (``accepted`` says what that is)."""
    def convert(text):
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not ok(value):
            raise ValueError(f"{text!r} is not valid; accepted: {accepted}")
        return value
    return convert


_density = _float(lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
_gamma = _float(lambda v: 0.0 <= v < float("inf"), "seconds per element, a number >= 0")
_burst = _float(lambda v: 0.0 <= v < float("inf"), "bytes, a number >= 0")


def _rate(text):
    parse_rate(text)
    return text


def _latency(text):
    parse_time(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", choices=ALGORITHMS, help="the aggregator (one step of it)")
    p.add_argument("--workers", type=_type(_positive_int), help="P, the number of ranks")
    p.add_argument("--n", type=_type(_positive_int), default=MLP_N,
                   help=f"gradient elements, one fused bucket (default {MLP_N:,})")
    p.add_argument("--density", type=_type(_density), default=0.001, help="k = ceil(density * n) (default 0.001)")
    p.add_argument("--bandwidth", type=_type(_rate), default="1gbit",
                   help="per-rank link rate: bit, kbit, mbit, gbit, tbit (default 1gbit)")
    p.add_argument("--latency", type=_type(_latency), default="50us",
                   help="per-message latency: s, ms, us, ns, or 0 (default 50us)")
    p.add_argument("--gamma", type=_type(_gamma), default=0.0,
                   help="seconds per element of local work in the exchange (default 0)")
    p.add_argument("--burst", type=_type(_burst), default=0.0,
                   help="bytes a token-bucket-shaped link lets through at once after an idle moment "
                        "(default 0: a plain link; tfsparse-run --net's bucket: 131072 at 1gbit)")
    p.add_argument("--cores", type=_type(_positive_int), default=None,
                   help="cores all the ranks share on one node (default: every rank has its own); local "
                        "work done by more ranks at once than cores is slowed by busy/cores")
    p.add_argument("--step", type=_type(_positive_int), default=None,
                   help="price this step only (from 1; default: the mean over the algorithm's period)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sweep", action="store_true",
                   help="P = 2..1024 at 1 and 10 Gbit/s for every algorithm: JSON + PNG under --out")
    p.add_argument("--out", default=str(REPO / "results" / "simulate_network"),
                   help="--sweep: output path without suffix (default results/simulate_network)")
    return p


def one(args) -> dict:
    ab = AlphaBeta.from_strings(args.bandwidth, args.latency, burst=args.burst)
    res = simulate(args.algorithm, args.workers, args.n, args.density, ab, args.gamma, step=args.step,
                   cores=args.cores)
    out = {"algorithm": res.algorithm, "workers": res.workers, "n": res.n, "density": res.density, "k": res.k,
           "bandwidth": args.bandwidth, "latency": args.latency, "step": args.step, **res.as_dict()}
    return out


def line(r: dict) -> str:
    step = f", step {r['step']}" if r["step"] else ""
    return (f"{r['algorithm']}: P={r['workers']}, n={r['n']:,}, density {r['density']:g} (k={r['k']:,}), "
            f"{r['bandwidth']}, latency {r['latency']}{step}: {r['seconds'] * 1e3:.3f} ms per step, "
            f"{r['bytes']:,} bytes sent by the busiest rank, {r['messages']:g} messages")


def sweep(args) -> dict:
    curves = {}
    for bw in SWEEP_BANDWIDTHS:
        ab = AlphaBeta.from_strings(bw, args.latency)
        curves[bw] = {}
        for algorithm in SWEEP_ALGORITHMS:
            rows = [simulate(algorithm, p, args.n, args.density, ab, args.gamma) for p in SWEEP_WORKERS]
            curves[bw][algorithm] = {"seconds": [r.seconds for r in rows], "bytes": [r.bytes for r in rows]}
        dense = curves[bw]["dense"]["seconds"]
        for algorithm in SWEEP_ALGORITHMS:
            c = curves[bw][algorithm]
            c["speedup_over_dense"] = [d / s if s > 0 else None for d, s in zip(dense, c["seconds"])]
    k = simulate("dense", 1, args.n, args.density, AlphaBeta(0.0, 1.0)).k
    return {"model": "alpha-beta-gamma (tfsparse.timing)", "n": args.n, "density": args.density,
            "k": k, "latency": args.latency, "gamma_s_per_element": args.gamma, "workers": list(SWEEP_WORKERS),
            "bandwidths": list(SWEEP_BANDWIDTHS), "curves": curves, "papers": list(PAPERS)}


STYLE = {"dense": ("black", "-", 2.2), "topk": ("tab:blue", "-", 1.8), "gtopk": ("tab:orange", "-", 2.0),
         "oktopk": ("tab:green", "-", 2.0)}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = result["workers"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5), sharex=True)
    for col, bw in enumerate(result["bandwidths"]):
        top, bottom = axes[0, col], axes[1, col]
        for algorithm in PLOTTED:
            c = result["curves"][bw][algorithm]
            color, ls, lw = STYLE[algorithm]
            label = "topk (= dgc, gaussiank)" if algorithm == "topk" else algorithm
            top.plot(ps, [s * 1e3 for s in c["seconds"]], ls, color=color, lw=lw, marker="o", ms=3.5, label=label)
            if algorithm != "dense":
                bottom.plot(ps, c["speedup_over_dense"], ls, color=color, lw=lw, marker="o", ms=3.5, label=label)
        for paper in result["papers"]:
            if paper["panel"] != bw:
                continue
            color = STYLE[paper["algorithm"]][0]
            lo, hi, p = paper["speedup_low"], paper["speedup_high"], paper["workers"]
            bottom.vlines(p, lo, hi, color=color, lw=6, alpha=0.45)
            bottom.plot([p, p], [lo, hi], "_", color=color, ms=14, mew=2)
            bottom.annotate(f"{paper['paper']} {paper['where']}:\n{lo:g}-{hi:g}x end-to-end training speed-up\n"
                            f"over dense, P={p}, {paper['network']}", (p, lo), textcoords="axes fraction",
                            xytext=(0.03, 0.06), fontsize=8, color=color,
                            arrowprops={"arrowstyle": "-", "color": color, "lw": 0.8})
        top.set_title(f"{bw.replace('gbit', ' Gbit/s')} per rank, latency {result['latency']}: "
                      f"n={result['n'] / 1e6:g}M, density {result['density']:g} (k={result['k']:,})", fontsize=9.5)
        top.set_ylabel("predicted exchange time per step [ms]")
        bottom.set_ylabel("speed-up of the exchange over dense")
        bottom.set_xlabel("workers P")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        bottom.axhline(1.0, color="black", lw=0.8)
        top.legend(fontsize=8)
        bottom.legend(fontsize=8, loc="upper right")
    fig.suptitle("α-β model of each aggregator's message schedule (tools/simulate_network.py); "
                 "paper bars: end-to-end training speed-ups", fontsize=10)
    fig.tight_layout()
    files.save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sweep:
        if args.algorithm is not None or args.workers is not None or args.step is not None:
            parser.error("--sweep runs every algorithm at P = 2..1024; it takes no --algorithm, --workers or --step")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = sweep(args)
        files.write_text(out.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
        plot(result, out.with_suffix(".png"))
        if args.json:
            print(json.dumps(result))
        else:
            at = [p for p in (4, 32, 256, 1024) if p in result["workers"]]
            for bw in result["bandwidths"]:
                print(f"{bw}, latency {args.latency}: ms per step at P = {', '.join(map(str, at))}")
                for algorithm, c in result["curves"][bw].items():
                    ms = [c["seconds"][result["workers"].index(p)] * 1e3 for p in at]
                    print(f"  {algorithm:10s}" + "".join(f"{v:12.2f}" for v in ms))
            print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
        return 0
    missing = [name for name in ("algorithm", "workers") if getattr(args, name) is None]
    if missing:
        parser.error(f"{', '.join('--' + m for m in missing)} required (or --sweep); accepted algorithms: "
                     f"{', '.join(ALGORITHMS)}")
    try:
        r = one(args)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(r) if args.json else line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
