"""Convergence benchmark: digits, P processes, against synchronous dense float32.

* ``--suite gradientflow`` (default): every sparse algorithm with and without GradientFlow's/DGC's
  recipe (momentum correction + dense warm-up);
* ``--suite pipesgd``: Pipe-SGD -- ``pipeline=2`` over float32 and int8 (quantization), with
  the paper's update (Alg. 1: plain SGD) and with the demo's momentum SGD, with and without the
  D-Sync warm-up, each setting against its own synchronous float32 run, cosine learning-rate decay;
* ``--suite dragonn``: DRAGONN and DGC at density 0.01, plain and with momentum correction +
  dense warm-up (the paper trains with momentum correction, §5), and with the cost model.

    python tools/bench_convergence.py [--suite gradientflow] [--np 4] [--epochs 20] [--out results/bench_convergence]
    python tools/bench_convergence.py --suite pipesgd --seeds 0 1 2 3 --out results/bench_pipesgd
    python tools/bench_convergence.py --suite dragonn --out results/bench_dragonn

Each group and seed is one ``tfsparse-run -np P python keras_examples/digits_demo.py ... --json``
launch (the demo's model: 64-256-128-10, 50,826 parameters, SGD lr 0.05, batch 32 per rank);
``--seeds`` repeats every group with other initial weights and shuffling (297 test images: one
image is 0.34 points, and one seed's final accuracy is noisy).  Writes ``<out>.json`` (every run's
per-epoch history for the first seed, every seed's final accuracy) and ``<out>.png`` (test
accuracy per epoch, and the final accuracy per configuration, mean and range over the seeds);
prints a Markdown table, each run against the synchronous dense run of its setting.

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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfsparse import files  # noqa: E402

RECIPE = ["--memory", "momentum", "--warmup-epochs", "2"]
PLAIN = ["--memory", "residual"]  # plain error feedback under the SGD's momentum (memory="auto" would correct it)
GRADIENTFLOW = [  # (setting, label suffix, demo arguments)
    ("", "", ["--algorithms", "dense"]),
    ("", "", ["--algorithms", "topk,gtopk,oktopk", "--density", "0.01", *PLAIN]),
    ("", "", ["--algorithms", "csc", "--density", "0.15", "--chunk-size", "64", *PLAIN]),
    ("", "+mc+warmup", ["--algorithms", "topk,gtopk,oktopk", "--density", "0.01", *RECIPE]),
    ("", "+mc+warmup", ["--algorithms", "csc", "--density", "0.15", "--chunk-size", "64", *RECIPE]),
    ("", "+mc+warmup (previous)", ["--algorithms", "csc", "--density", "0.15", "--chunk-size", "64",
                                   "--csc-selection", "previous", *RECIPE]),
]
# pipe-sgd-li2018 Alg. 1 updates w[t] = w[t-1] - γ·gsum[t-K]: plain SGD.  With heavy-ball momentum β
# a gradient one step late is stable only for γ·h < 1 - β on a curvature h (γ·h < 2(1 + β)
# synchronously), so the suite trains both ways, each against its own synchronous float32 run.
MOMENTUM = ("momentum 0.9, lr 0.05: ", ["--lr-schedule", "cosine"])
ALG1 = ("no momentum (Alg. 1), lr 0.2, 40 epochs: ",
        ["--lr-schedule", "cosine", "--momentum", "0", "--lr", "0.2", "--epochs", "40"])
PIPESGD = [
    *((setting, suffix, [*config, *common]) for setting, common in (MOMENTUM, ALG1) for suffix, config in (
        ("", ["--algorithms", "dense"]),
        (" pipeline=2", ["--algorithms", "dense", "--pipeline", "2"]),
        (" pipeline=2 int8", ["--algorithms", "dense", "--pipeline", "2", "--wire", "int8"]))),
    (MOMENTUM[0], " pipeline=2 int8 +D-Sync 4",
     ["--algorithms", "dense", "--pipeline", "2", "--wire", "int8", "--dsync-epochs", "4", *MOMENTUM[1]]),
]
DRAGONN = [  # dragonn-wang2022 §5: DRAGONN vs DGC at density 0.01, with momentum correction as the paper runs them
    ("", "", ["--algorithms", "dense"]),
    ("", "", ["--algorithms", "dgc,dragonn", "--density", "0.01", *PLAIN]),
    ("", "+mc+warmup", ["--algorithms", "dgc,dragonn", "--density", "0.01", *RECIPE]),
    ("", "+mc+warmup+cost_model", ["--algorithms", "dragonn", "--density", "0.01", "--selection", "cost_model", *RECIPE]),
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


def seeds_of(run):
    """Every seed's final test accuracy (one for the JSON of a single-seed run)."""
    return run.get("test_accuracy_seeds", [run["test_accuracy"]])


def baseline_of(results, label):
    """The synchronous dense run of ``label``'s setting."""
    return results["runs"][results["runs"][label].get("setting", "") + "dense"]


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.5 + 0.12 * len(results["runs"])))
    for label, run in results["runs"].items():
        style = "-" if "+mc" in label or label.endswith("dense") else ":"
        ax1.plot(range(1, len(run["val_accuracy"]) + 1), run["val_accuracy"], style, label=label)
    ax1.set_xlabel("epoch" + (" (first seed)" if len(seeds_of(next(iter(results["runs"].values())))) > 1 else ""))
    ax1.set_ylabel("test accuracy")
    ax1.set_ylim(0.8, 1.0)
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    labels = list(results["runs"])[::-1]
    acc = [results["runs"][k]["test_accuracy"] for k in labels]
    span = np.array([[a - min(seeds_of(results["runs"][k])), max(seeds_of(results["runs"][k])) - a]
                     for k, a in zip(labels, acc)]).T
    ax2.barh(labels, acc, xerr=span, capsize=3,
             color=["tab:gray" if k.endswith("dense") else "tab:blue" for k in labels])
    ax2.plot([baseline_of(results, k)["test_accuracy"] - 0.01 for k in labels], labels, "r|", ms=12,
             label="its synchronous dense − 1 point")
    ax2.set_xlim(0.85, 1.0)
    ax2.set_xlabel("final test accuracy (mean and range over seeds)")
    ax2.tick_params(axis="y", labelsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle(f"digits, {results['processes']} processes, {results['epochs']} epochs unless the label says otherwise, "
                 f"seeds {results.get('seeds', [0])}")
    fig.tight_layout()
    files.save_figure(fig, path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="gradientflow", choices=sorted(SUITES))
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one launch per group and seed")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench_convergence"))
    parser.add_argument("--plot-only", action="store_true", help="redraw <out>.png and the table from <out>.json")
    args = parser.parse_args()
    if args.plot_only:
        with open(args.out + ".json") as f:
            results = json.load(f)
    else:
        env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        results = {"processes": args.np, "epochs": args.epochs, "seeds": args.seeds, "runs": {}}
        for setting, suffix, demo_args in SUITES[args.suite]:
            for seed in args.seeds:
                got = run_group(args.np, args.epochs, [*demo_args, "--seed", str(seed)], env)
                for algorithm, run in got["runs"].items():
                    label = setting + algorithm + suffix
                    first = results["runs"].setdefault(label, {**run, "setting": setting, "demo_args": demo_args,
                                                               "test_accuracy_seeds": []})
                    first["test_accuracy_seeds"].append(run["test_accuracy"])
                    first["test_accuracy"] = float(np.mean(first["test_accuracy_seeds"]))
        files.write_text(args.out + ".json", json.dumps(results, indent=1))
    plot(results, args.out + ".png")
    print("\n| configuration | density | test accuracy (mean) | seeds | vs its synchronous dense (points) "
          "| bytes/step/rank |\n|---|---|---|---|---|---|")
    for label, run in results["runs"].items():
        gap = 100 * (run["test_accuracy"] - baseline_of(results, label)["test_accuracy"])
        print(f"| {label} | {run['density'][-1]:.4f} | {run['test_accuracy']:.4f} | "
              f"{' '.join(f'{a:.4f}' for a in seeds_of(run))} | {gap:+.2f} | {run['comm_bytes'][-1]:,.0f} |")


if __name__ == "__main__":
    main()
