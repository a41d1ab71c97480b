"""Time to accuracy under SparseStrategy: test accuracy against wall-clock seconds for a list of
exchange settings, side by side in one launch, beside the compute-only run of the same model in
the same processes (plain Keras, no strategy, no exchange: each rank trains its own shard).

    tfsparse-run -np 4 [--net 1gbit] python tools/bench_time_to_accuracy.py CONFIGS_JSON
        [--model mlp17m|conv|transformer] [--epochs 10] [--target dense|0.95] [--seed 0] [--network LABEL]
        [--out results/time_to_accuracy]

``CONFIGS_JSON``: a list of ``{"label": ..., "algorithm": ..., "density": ..., **options}``, as
``tools/bench_fit_step.py`` takes them (``wire_dtype``, ``plan``, ``pipeline``, ``memory``, ...;
``"warmup_epochs": E`` adds ``DensitySchedule(WarmUp(epochs=E))``, ``"densities": [d0, d1, ...]``
adds ``DensitySchedule([d0, d1, ...])`` (epoch ``i`` at ``di``, later ones at ``density``; not
with ``warmup_epochs``); ``"dense_below": N`` sends every tensor of fewer than ``N`` elements
dense (a bucket per tensor: ``plan=PerTensorPlan(...)``, as docs/choosing.md shows; not with
``plan``); ``"init_seed": S`` starts the row from the initial weights (and batch order) of seed ``S``
with the same data and split (a dense row with it measures the target rule's own noise); a
pinned momentum correction,
``"memory": "momentum"`` or ``"momentum_rows"``, runs the SGD without its momentum), e.g.::

    '[{"label": "dense f32", "algorithm": "dense"}, {"label": "gtopk 0.01", "algorithm": "gtopk", "density": 0.01}]'

The target (``--target``, default ``dense``) is dense float32's own accuracy in the same launch:
the best test accuracy of the first setting with ``"algorithm": "dense"`` and a float32 wire, less
0.5 point; or a fixed number.  ``--seed`` picks the initial weights and the split of the data into
training and test rows (for the transformer, the rows themselves); every setting of a launch uses
the same.

Models (1536 training rows split evenly over the ranks, 12 steps per epoch at P = 4; batch 32 per
rank, SGD with momentum 0.9, the same initial weights):

* ``mlp17m`` -- the 64-4096-4096-10 MLP (17.1M parameters) on digits (8x8 images, bundled with
  scikit-learn, 261 test rows), learning rate 0.05;
* ``conv``   -- two 3x3 convolutions (32, 64 channels) and a 4096-2048-10 head (8.4M parameters),
  the same data and rate;
* ``transformer`` -- a small Transformer text classifier (2.7M parameters): a 20,000 x 128
  embedding, one pre-norm block of 4-head self-attention and a 256-wide feed-forward layer (each
  with a residual), LayerNormalization, mean pooling, 4 classes; on a synthetic topic task
  (:func:`topics`, nothing downloaded; 512 test rows of 64 tokens), learning rate 0.02 (at 0.05
  and above attention sat at chance for several epochs).

Validation: each rank evaluates its shard of the test rows (``tfsparse.data.shard(...,
drop_remainder=False)``: every row in one shard), and the strategy averages the metric states
over the ranks, so ``val_accuracy`` is the whole test set's (the compute-only run, without a
strategy to average anything, validates every test row -- but in the records made 2026-11-30
23:51 to 12-01 00:09, whose ``"validation"`` ends in "metrics summed", it validated rank 0's
shard).  In a record without a ``"validation"`` key (made before 2026-11-30 23:50 UTC) every rank
evaluated every test row: the same accuracy at P times the work.

Per setting, rank 0 records each epoch's end (after validation) in wall seconds from the start of
``fit``, the test accuracy, every step's time (the slowest rank's) and the **time outside steps**:
each epoch's wall time less its steps and its validation -- the gap between steps and around epoch
boundaries where no rank trains (``stall_s``: the longest such gap of the run; ``outside_s``: their
sum per epoch) -- and ``longest_step_s``, the longest step after the first (which traces the step
function): a stall inside a step, which the median hides.  The compute-only run of the same model is trained first and reported the same way,
so its gaps are the floor: what plain Keras itself has in this launch.

Rank 0 writes ``<out>.json`` and ``<out>.png`` (accuracy against seconds and against epochs, a curve
per setting and the compute-only run; time to ``--target`` per setting) and prints a table:
time to target, its ratio to the first setting's (``speedup``), the median step, its ratio to the
compute-only step, the longest stall and the longest step.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfsparse  # noqa: E402
from tfsparse import files  # noqa: E402
from tfsparse.memory import keeps_velocity  # noqa: E402
from tfsparse.plan import PerTensorPlan  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, also where loaded by path
import bench_host  # noqa: E402

TRAIN_ROWS, BATCH, LR, MOMENTUM = 1536, 32, 0.05, 0.9


class Timeline(keras.callbacks.Callback):
    """perf_counter stamps of every batch, validation and epoch; the gaps are computed afterwards."""

    def on_train_begin(self, logs=None):
        self.t_begin, self.steps, self.tests, self.epoch_ends, self.epoch_begins = time.perf_counter(), [], [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_begins.append(time.perf_counter())
        self.steps.append([])
        self.tests.append(0.0)

    def on_train_batch_begin(self, batch, logs=None):
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1].append((self._t, time.perf_counter()))

    def on_test_begin(self, logs=None):
        self._v = time.perf_counter()

    def on_test_end(self, logs=None):
        if self.steps:  # validation inside fit
            self.tests[-1] += time.perf_counter() - self._v

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_ends.append(time.perf_counter())

    def summary(self) -> dict:
        """Per epoch: end (s from fit start), steps' seconds, validation seconds, time outside steps
        (epoch wall less steps less validation; the first epoch's includes tracing), the longest gap
        between consecutive steps -- across epoch boundaries too, validation excluded."""
        step_s = [[b - a for a, b in ep] for ep in self.steps]
        outside = [(end - begin) - sum(s) - v for begin, end, s, v
                   in zip(self.epoch_begins, self.epoch_ends, step_s, self.tests)]
        gaps, prev_end = [], None
        for e, ep in enumerate(self.steps):
            for i, (a, b) in enumerate(ep):
                if prev_end is not None:
                    gaps.append(a - prev_end - (self.tests[e - 1] if i == 0 else 0.0))
                prev_end = b
        return {"epoch_end_s": [t - self.t_begin for t in self.epoch_ends], "step_s": step_s,
                "validation_s": self.tests, "outside_s": outside, "gaps_s": gaps}


VOCAB, SEQ, TOPICS, TOPIC_WORDS = 20_000, 64, 4, 25
#: the learning rate of each model's SGD (momentum MOMENTUM)
RATES = {"mlp17m": LR, "conv": LR, "transformer": 0.02}


def topics(seed=0, test_rows=512):
    """The transformer's synthetic task: rows of 64 tokens of a 20,000-word vocabulary, where each
    of 4 topics owns 25 words; a row of topic ``c`` holds 3-8 words of ``c`` and at most 2 (and
    fewer than of ``c``) of each other topic, at random places among background words, and is
    labelled ``c``: the topic it mentions most.  ``seed`` draws the rows; the first 1536 train."""
    rng = np.random.default_rng(1000 + seed)
    rows = TRAIN_ROWS + test_rows
    x = rng.integers(TOPICS * TOPIC_WORDS, VOCAB, (rows, SEQ))
    y = rng.integers(0, TOPICS, rows)
    for i in range(rows):
        places = rng.permutation(SEQ)
        own = int(rng.integers(3, 9))
        counts = [own if c == y[i] else int(rng.integers(0, min(own - 1, 2) + 1)) for c in range(TOPICS)]
        start = 0
        for c, k in enumerate(counts):
            x[i, places[start:start + k]] = c * TOPIC_WORDS + rng.integers(0, TOPIC_WORDS, k)
            start += k
    x, y = x.astype("int32"), y.astype("int32")
    return x[:TRAIN_ROWS], y[:TRAIN_ROWS], x[TRAIN_ROWS:], y[TRAIN_ROWS:]


def data(seed=0, model="mlp17m"):
    if model == "transformer":
        return topics(seed)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = x[perm], y[perm].astype("int32")
    return x[:TRAIN_ROWS], y[:TRAIN_ROWS], x[TRAIN_ROWS:], y[TRAIN_ROWS:]


def build(name, seed=0):
    keras.utils.set_random_seed(seed)
    if name == "mlp17m":
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(4096, activation="relu"),
                                 keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(10)])
    if name == "transformer":
        tokens = keras.Input((SEQ,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 128)(tokens)
        a = keras.layers.LayerNormalization()(h)
        h = h + keras.layers.MultiHeadAttention(4, 32)(a, a)
        a = keras.layers.LayerNormalization()(h)
        h = h + keras.layers.Dense(128)(keras.layers.Dense(256, activation="relu")(a))
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(h))
        return keras.Model(tokens, keras.layers.Dense(TOPICS)(h))
    return keras.Sequential([keras.Input((64,)), keras.layers.Reshape((8, 8, 1)),
                             keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                             keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(2048, activation="relu"),
                             keras.layers.Dense(10)])


MODELS = tuple(RATES)
#: how the records' validation ran (the ``"validation"`` key)
VALIDATION = ("each rank its shard of the test rows (tfsparse.data.shard, drop_remainder=False), metric states "
              "averaged over the ranks; the compute-only run every test row")


def small_dense(below: int) -> PerTensorPlan:
    """A bucket per tensor, the tensors of fewer than ``below`` elements sent dense (the rest with
    the row's algorithm and density)."""
    return PerTensorPlan(lambda spec: {"algorithm": "dense", "density": 1.0} if spec.size < below else None)


def train(comm, config, args, arrays):
    """One run: ``config`` None is the compute-only run (no strategy), which validates on every
    test row (``arrays``: this rank's training rows, its shard of the test rows, all test rows)."""
    x_local, y_local, x_shard, y_shard, x_all, y_all = arrays
    # the runs under the strategy validate shards, their metric states averaged over the ranks;
    # plain Keras averages nothing, so the compute-only run (a rank alone) validates every row
    x_test, y_test = (x_all, y_all) if config is None else (x_shard, y_shard)
    strategy = None
    if config is not None:
        tool_keys = ("label", "algorithm", "density", "warmup_epochs", "densities", "dense_below",
                     "init_seed")  # this tool's
        options = {k: v for k, v in config.items() if k not in tool_keys}
        if config.get("dense_below"):
            options["plan"] = small_dense(int(config["dense_below"]))
        strategy = tfsparse.SparseStrategy(config["algorithm"], config.get("density", 0.01), **options)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = build(args.model, args.seed if config is None else config.get("init_seed", args.seed))
        # momentum correction pinned (``"memory": "momentum"`` or ``"momentum_rows"``) applies the
        # momentum in the exchange (factor 0.9, MOMENTUM): the SGD then runs without it
        pinned = config is not None and keeps_velocity(config.get("memory", "auto"))
        model.compile(keras.optimizers.SGD(RATES[args.model], momentum=0.0 if pinned else MOMENTUM),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    timeline = Timeline()
    callbacks = [timeline] + ([tfsparse.keras.callbacks.CommunicationStats()] if strategy is not None else [])
    # a density schedule: a dense warm-up per step, or densities per epoch (main refuses both)
    schedule = None if config is None else (
        tfsparse.schedules.WarmUp(epochs=config["warmup_epochs"]) if config.get("warmup_epochs") else
        list(config["densities"]) if config.get("densities") else None)
    if schedule is not None:
        callbacks.insert(0, tfsparse.keras.callbacks.DensitySchedule(schedule))
    hist = model.fit(x_local, y_local, batch_size=BATCH, epochs=args.epochs, verbose=0, callbacks=callbacks,
                     validation_data=(x_test, y_test))
    own = timeline.summary()
    # the slowest rank's step times; rank 0's clock for the rest (every rank waits for the slowest)
    flat = np.array([s for ep in own["step_s"] for s in ep])
    slowest = np.stack(comm.allgather(flat)).max(axis=0) if comm.size > 1 else flat
    gaps_all = np.stack(comm.allgather(np.array(own["gaps_s"]))) if comm.size > 1 else np.array([own["gaps_s"]])
    accuracy = [float(a) for a in hist.history["val_accuracy"]]
    run = {"label": config["label"] if config else "compute only", "config": config,
           "parameters": model.count_params(), "val_accuracy": accuracy, **own,
           "step_ms_median": round(1e3 * float(np.median(slowest[1:])), 1),
           "stall_s": round(float(gaps_all.max()), 3) if gaps_all.size else 0.0,
           "longest_step_s": round(float(slowest[1:].max()), 3) if slowest.size > 1 else 0.0,
           "outside_s_per_epoch": round(float(np.mean(own["outside_s"][1:])) if len(own["outside_s"]) > 1 else 0.0, 3)}
    if strategy is not None:
        run["comm_bytes"] = hist.history["comm_bytes"][-1]
        run["setting"] = {k: v for k, v in strategy.exchange.engine.settings.config().items() if k != "algorithm_options"}
    return run


def reach(run, target) -> None:
    """The run's time and epochs to ``target`` (None: not reached), its best and final accuracy."""
    accuracy = run["val_accuracy"]
    reached = [t for t, a in zip(run["epoch_end_s"], accuracy) if a >= target]
    run["time_to_target_s"] = round(reached[0], 2) if reached else None
    run["epochs_to_target"] = next((e + 1 for e, a in enumerate(accuracy) if a >= target), None)
    run["best_accuracy"], run["final_accuracy"] = max(accuracy), accuracy[-1]


def _dense_f32(config: dict) -> bool:
    """Whether a setting is dense float32 (``--target dense`` takes its accuracy)."""
    return config["algorithm"] == "dense" and config.get("wire_dtype", "float32") == "float32"


def target_of(runs, target: str) -> float:
    """``--target``: a number, or ``dense``: the best test accuracy of the first dense float32 run
    less 0.5 point."""
    if target != "dense":
        return float(target)
    dense = next((r for r in runs if r["config"] is not None and _dense_f32(r["config"])), None)
    if dense is None:  # (main refuses this before any training)
        raise ValueError("--target dense needs a setting with \"algorithm\": \"dense\" over float32")
    return round(max(dense["val_accuracy"]) - 0.005, 4)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    for run in results["runs"]:
        style = dict(ls="--", color="gray") if run["config"] is None else {}
        epochs = np.arange(1, len(run["val_accuracy"]) + 1)
        ax1.plot(run["epoch_end_s"], run["val_accuracy"], marker="o", ms=3, label=run["label"], **style)
        ax2.plot(epochs, run["val_accuracy"], marker="o", ms=3, label=run["label"], **style)
    for ax, xlabel in ((ax1, "wall seconds from the start of fit"), (ax2, "epoch")):
        ax.axhline(results["target"], color="k", lw=0.6, ls=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(max(0.0, results["target"] - 0.35), 1.0)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    runs = [r for r in results["runs"] if r["config"] is not None]
    ttt = [r["time_to_target_s"] or r["epoch_end_s"][-1] for r in runs]
    ax3.barh([r["label"] for r in runs], ttt, color=["tab:blue" if r["time_to_target_s"] else "tab:red"
                                                      for r in runs])
    ax3.invert_yaxis()
    ax3.set_xlabel(f"seconds to test accuracy {results['target']} (red: not reached, whole run)")
    fig.suptitle(f"{results['model']} ({results['runs'][0]['parameters'] / 1e6:.1f}M parameters), "
                 f"{results['processes']} processes, {results['network']}, {results['machine']}")
    fig.tight_layout()
    files.save_figure(fig, path, dpi=110)


def table(results) -> str:
    runs = results["runs"]
    compute = next(r for r in runs if r["config"] is None)
    base = next((r for r in runs if r["config"] is not None), None)
    lines = [f"| setting | time to {results['target']} (s) | speedup | epochs | step ms | x compute | "
             "longest stall (s) | longest step (s) | outside steps per epoch (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ttt = r["time_to_target_s"]
        speed = (f"{base['time_to_target_s'] / ttt:.2f}x" if ttt and base and base["time_to_target_s"]
                 and r["config"] is not None else "")
        lines.append(f"| {r['label']} | {ttt if ttt is not None else 'not reached'} | {speed} | "
                     f"{r['epochs_to_target'] or '-'} | {r['step_ms_median']} | "
                     f"{r['step_ms_median'] / compute['step_ms_median']:.2f} | {r['stall_s']} | "
                     f"{r.get('longest_step_s', '-')} | {r['outside_s_per_epoch']} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", help="JSON list of settings (see the module doc)")
    parser.add_argument("--model", default="mlp17m", choices=MODELS)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--target", default="dense", help="'dense' (dense float32's best less 0.5 point) or a number")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and the train/test split (the transformer: the rows themselves)")
    parser.add_argument("--network", default="shared memory", help="a label for the link, e.g. '1 Gbit/s'")
    parser.add_argument("--out", default="results/time_to_accuracy")
    args = parser.parse_args(argv)
    configs = json.loads(args.configs)
    if not isinstance(configs, list) or not all(isinstance(c, dict) and "algorithm" in c for c in configs):
        raise ValueError(f"configs={args.configs!r}: expected a JSON list of objects with an 'algorithm'")
    for config in configs:  # before any training
        if config.get("densities") and config.get("warmup_epochs"):
            raise ValueError(f"setting {config.get('label')!r}: \"densities\" and \"warmup_epochs\" both "
                             f"schedule the density; give one")
        below = config.get("dense_below")
        if below is not None and (isinstance(below, bool) or not isinstance(below, int) or below < 1):
            raise ValueError(f"setting {config.get('label')!r}: \"dense_below\"={below!r} is not valid; accepted: "
                             f"a positive whole number of elements")
        init_seed = config.get("init_seed")
        if init_seed is not None and (isinstance(init_seed, bool) or not isinstance(init_seed, int) or init_seed < 0):
            raise ValueError(f"setting {config.get('label')!r}: \"init_seed\"={init_seed!r} is not valid; accepted: "
                             f"a whole number >= 0")
        if below is not None and "plan" in config:
            raise ValueError(f"setting {config.get('label')!r}: \"dense_below\" makes the plan; give it or "
                             f"\"plan\", not both")

    if args.target == "dense":  # checked before any training, like a numeric target
        if not any(_dense_f32(c) for c in configs):
            raise ValueError(f"--target dense needs a setting with \"algorithm\": \"dense\" over float32 in "
                             f"CONFIGS_JSON (got {[c.get('label', c['algorithm']) for c in configs]}); give one "
                             f"or a number as --target")
    else:
        try:
            float(args.target)
        except ValueError:
            raise ValueError(f"--target {args.target!r} is not valid; accepted: 'dense' or a number such as "
                             f"0.95") from None
    comm = tfsparse.init()
    x_train, y_train, x_test, y_test = data(args.seed, args.model)
    # every rank validates its shard of the test rows, all rows kept: the strategy averages the metric
    # states over the ranks, so the logged accuracy is the whole test set's, each rank doing a P-th
    arrays = (*tfsparse.data.shard(x_train, y_train), *tfsparse.data.shard(x_test, y_test, drop_remainder=False),
              x_test, y_test)
    runs = [train(comm, None, args, arrays)]
    for config in configs:
        config.setdefault("label", config["algorithm"])
        runs.append(train(comm, config, args, arrays))
        if comm.rank == 0:
            print(f"{config['label']}: accuracy {[round(a, 3) for a in runs[-1]['val_accuracy']]}, step "
                  f"{runs[-1]['step_ms_median']} ms, longest stall {runs[-1]['stall_s']} s, longest step "
                  f"{runs[-1]['longest_step_s']} s", flush=True)
    target = target_of(runs, args.target)
    for run in runs:
        reach(run, target)
    if comm.rank == 0:
        results = {"model": args.model, "processes": comm.size, "epochs": args.epochs, "target": target,
                   "target_rule": "dense f32 best - 0.005" if args.target == "dense" else "fixed", "seed": args.seed,
                   "validation": VALIDATION,
                   "network": args.network,
                   "machine": bench_host.describe(), "batch_per_rank": BATCH, "learning_rate": RATES[args.model],
                   "date": time.strftime("%Y-%m-%d"), "runs": runs}
        files.write_text(args.out + ".json", json.dumps(results, indent=1))
        plot(results, args.out + ".png")
        print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
