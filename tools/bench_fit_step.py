"""Training-step time of ``model.fit`` under SparseStrategy, for a list of exchange settings,
side by side in one launch: the 25.2M-parameter MLP 1024-4096-4096-1024 (batch 16 per rank,
SGD momentum, MSE on random data), 12 steps per setting, median over steps 4-12 of the slowest
rank's step time, the bytes one rank sends per step, and rank 0's exchange phases per step
(``encode_ms``, ``comm_ms``, ``decode_ms``, ``wait_ms``: see ``CommunicationStats``).

    tfsparse-run -np 4 python tools/bench_fit_step.py CONFIGS_JSON [--out results/bench_fit_step] [--backend horovod]

``CONFIGS_JSON``: a list of ``{"label": ..., "algorithm": ..., "density": ..., **options}``
(``wire_dtype``, ``plan``, ``pipeline``, ``chunk_size``, ...), e.g. GradientFlow's comparison::

    '[{"label": "dense f32 fused", "algorithm": "dense"},
      {"label": "dense f16, θ=4MB", "algorithm": "dense", "wire_dtype": "float16", "plan": 4194304}]'

Launch it under an emulated network (network namespaces + ``tc tbf``) to measure a slow link.
Rank 0 writes ``<out>.json`` and ``<out>.png`` (step time and MB per step, per setting).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import keras  # noqa: E402

import tfsparse  # noqa: E402

STEPS, SKIP, BATCH = 12, 3, 16


class StepTimes(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.t0)


def measure(comm, config, x, y):
    options = {k: v for k, v in config.items() if k not in ("label", "algorithm", "density")}
    strategy = tfsparse.SparseStrategy(config["algorithm"], config.get("density", 0.01), **options)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096, activation="relu"),
                                  keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(1024)])
        model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
    timer = StepTimes()
    hist = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                     callbacks=[timer, tfsparse.keras.callbacks.CommunicationStats()])
    slowest = np.stack(comm.allgather(np.array(timer.times[SKIP:]))).max(axis=0)
    return {"step_ms": round(1e3 * float(np.median(slowest)), 1), "mb_per_step": hist.history["comm_bytes"][-1] / 1e6,
            "encode_ms": hist.history["encode_ms"][-1], "comm_ms": hist.history["comm_ms"][-1],
            "decode_ms": hist.history["decode_ms"][-1], "wait_ms": hist.history["wait_ms"][-1],
            "parameters": model.count_params()}


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in results["runs"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.5 * len(labels) + 1.8))
    ax1.barh(labels, [r["step_ms"] for r in results["runs"]], color="tab:blue")
    ax1.set_xlabel("median step time (ms)")
    ax1.invert_yaxis()
    ax2.barh(labels, [r["mb_per_step"] for r in results["runs"]], color="tab:orange")
    ax2.set_xlabel("MB sent per rank per step")
    ax2.invert_yaxis()
    ax2.set_yticklabels([])
    fig.suptitle(f"{results['processes']} processes, {results['network']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", help="JSON list of {label, algorithm, density, **options}")
    parser.add_argument("--network", default="shared memory", help="a label for the link, e.g. '1 Gbit/s'")
    parser.add_argument("--out", default="results/bench_fit_step")
    parser.add_argument("--backend", default="mpi", choices=("mpi", "horovod"),
                        help="tfsparse.init(backend=...): mpi4py (default) or Horovod's TF collectives")
    args = parser.parse_args()
    configs = json.loads(args.configs)
    comm = tfsparse.init(backend=args.backend)
    x = np.random.default_rng(comm.rank).standard_normal((BATCH * STEPS, 1024)).astype(np.float32)
    y = np.random.default_rng(comm.rank + 9).standard_normal((BATCH * STEPS, 1024)).astype(np.float32)
    results = {"processes": comm.size, "network": args.network, "backend": args.backend, "runs": []}
    for config in configs:
        results["runs"].append({**config, **measure(comm, config, x, y)})
        if comm.rank == 0:
            print(json.dumps(results["runs"][-1]), flush=True)
    if comm.rank == 0:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=1)
        plot(results, args.out + ".png")


if __name__ == "__main__":
    main()
