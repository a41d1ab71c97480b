"""Training-step time of ``model.fit`` under SparseStrategy, for a list of exchange settings,
side by side in one launch beside the compute floor and Horovod: the 25.2M-parameter MLP
1024-4096-4096-1024 (``--model mlp25m``, batch 16 per rank) or the 17.1M-parameter
64-4096-4096-10 (``--model mlp17m``, batch 32 per rank, the digits MLP of
``bench_time_to_accuracy.py``), SGD momentum, MSE on random data, 12 steps per setting, median
over steps 4-12 of the slowest rank's step time, its ratio to the compute floor (``x_compute``),
the bytes one rank sends per step, rank 0's exchange phases per step, medians over the same
steps (``encode_ms``, ``comm_ms``, ``decode_ms``, ``wait_ms``: see ``CommunicationStats``), and rank 0's memory traffic
per step in passes over the gradient, per stage (``passes``: :mod:`tfsparse.traffic`).

Memory speed is measured in the same launch too: ``pass_ms`` is one pass over the model's
float32 gradient while every rank streams at once (the slowest rank's median time of
``acc = g + r`` over the gradient's size -- three passes -- divided by three), and each setting's
``memory_ms`` prices its ``passes`` at that speed: what the exchange's memory traffic alone
costs per step on this machine with every rank at work, however fast its kernels.

    tfsparse-run -np 4 python tools/bench_fit_step.py CONFIGS_JSON [--model mlp25m] [--out results/bench_fit_step]
        [--backend horovod] [--no-compute]

The **compute floor** runs first in every launch: the same model and data in plain Keras (no
strategy, no exchange; each rank trains alone), so every setting's ``x_compute`` is a ratio measured
side by side; ``{"algorithm": "compute", "barrier": true}`` is the same with a barrier after every
step (the ranks in lockstep, as a synchronous exchange holds them).  A config
``{"algorithm": "horovod", "compression": "none" | "fp16"}`` is the peer a
user would otherwise pick: the same model trained by a custom loop whose gradients go through
Horovod's ``hvd.allreduce`` (Tensor Fusion, average; Horovod's ``DistributedGradientTape`` fails on
Keras 3 variables) -- it needs Horovod (``tools/install.sh --horovod``).
``{"algorithm": "tfsparse.horovod", "compression": "none" | "fp16"}`` is that user's script
moved to :mod:`tfsparse.horovod.tensorflow.keras`: ``model.fit`` with its ``DistributedOptimizer``
(lossless dense, or a float16 wire).  ``--model resnet50`` is Horovod's synthetic benchmark's
model (``keras.applications.ResNet50``, untrained, 25.6M parameters) on 64x64 images, batch 8
per rank.

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
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import keras  # noqa: E402

import tfsparse  # noqa: E402
from tfsparse import files, traffic  # noqa: E402
from tfsparse.keras.ownership import exchange_of  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, also where loaded by path
import bench_host  # noqa: E402

STEPS, SKIP = 12, 3
#: input shape, hidden widths (None: keras.applications.ResNet50, untrained), outputs, batch per rank
MODELS = {"mlp25m": ((1024,), [4096, 4096], 1024, 16), "mlp17m": ((64,), [4096, 4096], 10, 32),
          "resnet50": ((64, 64, 3), None, 1000, 8)}


class StepTimes(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.t0)


class PhaseTimes(keras.callbacks.Callback):
    """This rank's exchange phases per step (:class:`~tfsparse.bucket.ExchangeStats`' sums, read
    after every batch), so that they are medians over the same steps as the step time -- an
    epoch's mean would fold in the first steps' compilation and first touch of fresh memory."""

    PHASES = tfsparse.keras.callbacks.CommunicationStats.PHASES

    def on_train_begin(self, logs=None):
        self.steps = []

    def _sums(self) -> np.ndarray:
        st = exchange_of(self.model).stats
        return np.array([getattr(st, f"{phase}_seconds") for phase in self.PHASES])

    def on_epoch_begin(self, epoch, logs=None):
        self._last = self._sums()  # (after CommunicationStats, listed before, has reset them)

    def on_train_batch_end(self, batch, logs=None):
        now = self._sums()
        self.steps.append(now - self._last)
        self._last = now

    def medians_ms(self) -> dict:
        per_step = np.array(self.steps[SKIP:]).reshape(-1, len(self.PHASES))
        return {f"{phase}_ms": round(1e3 * float(np.median(per_step[:, i])), 1) if len(per_step) else 0.0
                for i, phase in enumerate(self.PHASES)}


def default_label(config: dict) -> str:
    """``algorithm density option=value ...`` for a config given without a label."""
    rest = " ".join(f"{k}={v}" for k, v in config.items() if k not in ("label", "algorithm", "density"))
    return " ".join(str(part) for part in (config["algorithm"], config.get("density", ""), rest) if part != "")


def check_configs(configs) -> list[dict]:
    """The configs as a list of dicts with a label each; a ValueError names what is wrong before
    anything runs."""
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise ValueError(f"CONFIGS_JSON={configs!r} must be a JSON list of objects, e.g. "
                         '\'[{"algorithm": "gtopk", "density": 0.01}]\'')
    for c in configs:
        if "algorithm" not in c:
            raise ValueError(f"config {c!r} has no 'algorithm' (an exchange algorithm, 'compute' or 'horovod')")
    return [{"label": default_label(c), **c} if "label" not in c else c for c in configs]


def build(model_name):
    shape, hidden, outputs, _ = MODELS[model_name]
    keras.utils.set_random_seed(0)
    if hidden is None:  # Horovod's synthetic benchmark's model (25.6M parameters), at a CPU-sized image and batch
        return keras.applications.ResNet50(weights=None, input_shape=shape, classes=outputs,
                                           classifier_activation=None)
    return keras.Sequential([keras.Input(shape)] + [keras.layers.Dense(h, activation="relu") for h in hidden]
                            + [keras.layers.Dense(outputs)])


def slowest_ms(comm, times):
    slowest = np.stack(comm.allgather(np.array(times[SKIP:]))).max(axis=0)
    return round(1e3 * float(np.median(slowest)), 1)


def measure(comm, config, x, y, model_name):
    batch = MODELS[model_name][3]
    if config["algorithm"] == "compute":
        return measure_compute(comm, x, y, model_name, barrier=bool(config.get("barrier")))
    if config["algorithm"] == "horovod":
        return measure_horovod(comm, config, x, y, model_name)
    if config["algorithm"] == "tfsparse.horovod":  # a Horovod Keras script moved to tfsparse.horovod
        import tfsparse.horovod.tensorflow.keras as hvd

        hvd.init()
        compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[config.get("compression", "none")]
        model = build(model_name)
        model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), compression=compression),
                      "mse")
    else:
        options = {k: v for k, v in config.items() if k not in ("label", "algorithm", "density")}
        strategy = tfsparse.SparseStrategy(config["algorithm"], config.get("density", 0.01), **options)
        with strategy.scope():
            model = build(model_name)
            model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
    timer, phases = StepTimes(), PhaseTimes()
    with traffic.recording() as moved:
        hist = model.fit(x, y, batch_size=batch, epochs=1, verbose=0,
                         callbacks=[timer, tfsparse.keras.callbacks.CommunicationStats(), phases])
    return {"step_ms": slowest_ms(comm, timer.times), "mb_per_step": hist.history["comm_bytes"][-1] / 1e6,
            "passes": moved.passes(4 * model.count_params(), len(timer.times)), **phases.medians_ms(),
            "parameters": model.count_params()}


class Barrier(keras.callbacks.Callback):
    """Every rank waits for the others after each step (``comm.barrier()``): the compute in lockstep."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def on_train_batch_end(self, batch, logs=None):
        self.comm.barrier()


def measure_compute(comm, x, y, model_name, barrier: bool = False):
    """The compute floor: plain Keras, no strategy, no exchange (each rank trains alone) -- or,
    ``barrier``, with the ranks in lockstep (a barrier after every step, as a synchronous exchange
    holds them), to tell what waiting for the slowest rank alone costs from what the exchange does."""
    model = build(model_name)
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
    timer = StepTimes()
    callbacks = [timer, Barrier(comm)] if barrier else [timer]
    model.fit(x, y, batch_size=MODELS[model_name][3], epochs=1, verbose=0, callbacks=callbacks)
    return {"step_ms": slowest_ms(comm, timer.times), "mb_per_step": 0.0, "parameters": model.count_params()}


def measure_pass(comm, n: int, repeats: int = 9) -> float:
    """Milliseconds of one pass over ``n`` float32 while every rank streams at once: the slowest
    rank's median ``acc = g + r`` (read, read, write: three passes) over ``n`` elements, / 3."""
    g, r, acc = (np.ones(n, np.float32) for _ in range(3))  # every page touched before timing
    times = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        np.add(g, r, out=acc)
        times.append(time.perf_counter() - t0)
    slowest = np.stack(comm.allgather(np.array(times))).max(axis=0)
    return round(1e3 * float(np.median(slowest)) / 3, 2)


def measure_horovod(comm, config, x, y, model_name):
    """The peer: a custom loop, every gradient through ``hvd.allreduce`` (average, Tensor Fusion),
    as Horovod's synthetic benchmark writes it."""
    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[config.get("compression", "none")]
    model = build(model_name)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [hvd.allreduce(g, op=hvd.Average, compression=compression) for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    batch, times = MODELS[model_name][3], []
    for i in range(STEPS):
        t0 = time.perf_counter()
        step(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]).numpy()
        times.append(time.perf_counter() - t0)
    wire = 2 if config.get("compression") == "fp16" else 4
    return {"step_ms": slowest_ms(comm, times), "parameters": model.count_params(),
            "mb_per_step": 2 * (comm.size - 1) / comm.size * wire * model.count_params() / 1e6}  # ring allreduce


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
    files.save_figure(fig, path, dpi=110)


def table(results) -> str:
    """Markdown: each setting's step, its ratio to the compute floor, and to Horovod's matching run."""
    peers = {r.get("compression", "none"): r["step_ms"] for r in results["runs"] if r["algorithm"] == "horovod"}
    lines = ["| setting | step ms | x compute | MB/step | x Horovod fp16 | passes | memory ms |",
             "|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        vs = f"{r['step_ms'] / peers['fp16']:.2f}" if "fp16" in peers else ""
        passes = r["passes"]["total"] if "passes" in r else ""
        lines.append(f"| {r['label']} | {r['step_ms']} | {r.get('x_compute', '')} | {r['mb_per_step']:.1f} | {vs} "
                     f"| {passes} | {r.get('memory_ms', '')} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", help="JSON list of {label, algorithm, density, **options}")
    parser.add_argument("--model", default="mlp25m", choices=sorted(MODELS))
    parser.add_argument("--no-compute", action="store_true", help="skip the compute floor")
    parser.add_argument("--network", default="shared memory", help="a label for the link, e.g. '1 Gbit/s'")
    parser.add_argument("--out", default="results/bench_fit_step")
    parser.add_argument("--backend", default="mpi", choices=("mpi", "horovod"),
                        help="tfsparse.init(backend=...): mpi4py (default) or Horovod's TF collectives")
    args = parser.parse_args()
    configs = check_configs(json.loads(args.configs))
    comm = tfsparse.init(backend=args.backend)
    shape, _, outputs, batch = MODELS[args.model]
    x = np.random.default_rng(comm.rank).standard_normal((batch * STEPS, *shape)).astype(np.float32)
    y = np.random.default_rng(comm.rank + 9).standard_normal((batch * STEPS, outputs)).astype(np.float32)
    results = {"processes": comm.size, "network": args.network, "backend": args.backend, "model": args.model,
               "machine": bench_host.describe(), "date": time.strftime("%Y-%m-%d"),
               "runs": []}
    if not args.no_compute:
        configs = [{"label": "compute only (no exchange)", "algorithm": "compute"}] + configs
    results["pass_ms"] = measure_pass(comm, build(args.model).count_params())
    for config in configs:
        results["runs"].append({**config, **measure(comm, config, x, y, args.model)})
        if "passes" in results["runs"][-1]:
            results["runs"][-1]["memory_ms"] = round(results["runs"][-1]["passes"]["total"] * results["pass_ms"], 1)
        floor = results["runs"][0]["step_ms"] if not args.no_compute else None
        if floor:
            results["runs"][-1]["x_compute"] = round(results["runs"][-1]["step_ms"] / floor, 2)
        if comm.rank == 0:
            print(json.dumps(results["runs"][-1]), flush=True)
    if comm.rank == 0:
        files.write_text(args.out + ".json", json.dumps(results, indent=1))
        plot(results, args.out + ".png")
        print(f"one pass over the gradient with every rank streaming: {results['pass_ms']} ms")
        print(table(results))


if __name__ == "__main__":
    main()
