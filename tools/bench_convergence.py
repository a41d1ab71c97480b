"""Convergence benchmark: digits, P processes, against synchronous dense float32.

* ``--suite gradientflow`` (default): every sparse algorithm with and without GradientFlow's/DGC's
  recipe (momentum correction + dense warm-up);
* ``--suite pipesgd``: Pipe-SGD -- ``pipeline=2`` over float32 and int8 (quantization), with
  and without the D-Sync warm-up;
* ``--suite dragonn``: DRAGONN and DGC at density 0.01, plain and with momentum correction +
  dense warm-up (the paper trains with momentum correction, §5), and with the cost model.

    python tools/bench_convergence.py [--suite gradientflow] [--np 4] [--epochs 20] [--out results/bench_convergence]
    python tools/bench_convergence.py --suite pipesgd --out results/bench_pipesgd
    python tools/bench_convergence.py --suite dragonn --out results/bench_dragonn

Each group is one ``tfsparse-run -np P python keras_examples/digits_demo.py ... --json`` launch
(the demo's model: 64-256-128-10, 50,826 parameters, SGD lr 0.05, batch 32 per rank).  Writes
``<out>.json`` (every run's per-epoch history) and ``<out>.png`` (test accuracy per epoch, and
the final accuracy and bytes per step per configuration); prints a Markdown table.

CSC runs with 64-element chunks: GradientFlow's 32K chunks would cut this 51K-parameter model
into 2 chunks; 64 gives 795, the order of the paper's 797 chunks for ResNet-50.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--memory", "momentum", "--warmup-epochs", "2"]
GRADIENTFLOW = [  # (label suffix, demo arguments)
    ("", ["--algorithms", "dense"]),
    ("", ["--algorithms", "topk,gtopk,oktopk", "--density", "0.01"]),
    ("", ["--algorithms", "csc", "--density", "0.15", "--chunk-size", "64"]),
    ("+mc+warmup", ["--algorithms", "topk,gtopk,oktopk", "--density", "0.01", *RECIPE]),
    ("+mc+warmup", ["--algorithms", "csc", "--density", "0.15", "--chunk-size", "64", *RECIPE]),
    ("+mc+warmup (previous)", ["--algorithms", "csc", "--density", "0.15", "--chunk-size", "64",
                               "--csc-selection", "previous", *RECIPE]),
]
PIPESGD = [
    ("", ["--algorithms", "dense"]),
    (" pipeline=2", ["--algorithms", "dense", "--pipeline", "2"]),
    (" pipeline=2 int8", ["--algorithms", "dense", "--pipeline", "2", "--wire", "int8"]),
    (" pipeline=2 int8 +dsync2", ["--algorithms", "dense", "--pipeline", "2", "--wire", "int8", "--dsync-epochs", "2"]),
]
DRAGONN = [  # dragonn-wang2022 §5: DRAGONN vs DGC at density 0.01, with momentum correction as the paper runs them
    ("", ["--algorithms", "dense"]),
    ("", ["--algorithms", "dgc,dragonn", "--density", "0.01"]),
    ("+mc+warmup", ["--algorithms", "dgc,dragonn", "--density", "0.01", *RECIPE]),
    ("+mc+warmup+cost_model", ["--algorithms", "dragonn", "--density", "0.01", "--selection", "cost_model", *RECIPE]),
]
SUITES = {"gradientflow": GRADIENTFLOW, "pipesgd": PIPESGD, "dragonn": DRAGONN}


def run_group(np_, epochs, args, env):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "tfsparse.run", "-np", str(np_), sys.executable,
               str(ROOT / "keras_examples" / "digits_demo.py"), "--epochs", str(epochs), "--json", path, *args]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for label, run in results["runs"].items():
        style = "-" if "+mc" in label or label == "dense" else ":"
        ax1.plot(range(1, len(run["val_accuracy"]) + 1), run["val_accuracy"], style, label=label)
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("test accuracy")
    ax1.set_ylim(0.8, 1.0)
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    labels = list(results["runs"])
    acc = [results["runs"][k]["test_accuracy"] for k in labels]
    ax2.barh(labels, acc, color=["tab:gray" if k == "dense" else "tab:blue" for k in labels])
    ax2.axvline(results["runs"]["dense"]["test_accuracy"] - 0.015, color="tab:red", ls="--", lw=1,
                label="dense − 1.5 points")
    ax2.set_xlim(0.85, 1.0)
    ax2.set_xlabel("final test accuracy")
    ax2.legend(fontsize=7)
    fig.suptitle(f"digits, {results['processes']} processes, {results['epochs']} epochs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="gradientflow", choices=sorted(SUITES))
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "results" / "bench_convergence"))
    parser.add_argument("--plot-only", action="store_true", help="redraw <out>.png and the table from <out>.json")
    args = parser.parse_args()
    if args.plot_only:
        with open(args.out + ".json") as f:
            results = json.load(f)
    else:
        env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        results = {"processes": args.np, "epochs": args.epochs, "runs": {}}
        for suffix, demo_args in SUITES[args.suite]:
            got = run_group(args.np, args.epochs, demo_args, env)
            for algorithm, run in got["runs"].items():
                results["runs"][algorithm + suffix] = {**run, "demo_args": demo_args}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=1)
    plot(results, args.out + ".png")
    dense = results["runs"]["dense"]["test_accuracy"]
    print(f"\n| configuration | density | test accuracy | vs dense | bytes/step/rank |\n|---|---|---|---|---|")
    for label, run in results["runs"].items():
        print(f"| {label} | {run['density'][-1]:.4f} | {run['test_accuracy']:.4f} | {100 * (run['test_accuracy'] - dense):+.2f} "
              f"| {run['comm_bytes'][-1]:,.0f} |")


if __name__ == "__main__":
    main()
