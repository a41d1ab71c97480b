"""How concentrated each benchmark model's gradient is: the share of its energy (sum of squares) in
its largest 1 % of entries, over training -- a candidate signal for how many epochs a sparse
exchange needs on a model, which ``algorithm="auto"`` prices per candidate, not per model.

    python tools/gradient_concentration.py [--models mlp17m conv transformer] [--seeds 0 1]
        [--steps 120] [--density 0.01] [--out results/gradient_concentration]

One process, no exchange: the models, data, learning rates and batch of
``tools/bench_time_to_accuracy.py``, trained with dense SGD (momentum 0.9) on rank 0's shard of
a four-rank job (``tfsparse.data.shard``: the first quarter of the training rows, batch 32).  At
each step it records

* ``global``: the top-``density`` share of the gradient of the four ranks' batches of that step
  (their 128 rows: the average of the ranks' gradients, the vector gTop-k approximates and auto's
  measured dense rounds see);
* ``local``: the same of rank 0's batch of 32;
* ``feedback``: the same of ``g + residual``, top-k with error feedback on the shard (the residual
  keeps what was not selected), and ``residual_ratio``: ``|residual| / |g|``;
* per tensor (``tensors``): its share of the gradient's energy, the fraction of its entries that
  top-k with error feedback sends, the share of its ``g + residual`` energy they hold, and its own
  ``|residual| / |g|`` -- whether a global selection starves some tensors.

Writes ``OUT.json``: per model and seed, the means over the first 10 steps, steps 10-40 and the
last 40 (per tensor: steps 10-40 and the last 40).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import bench_host  # noqa: E402
import tfsparse.data  # noqa: E402
from tfsparse import files  # noqa: E402
from tfsparse.schedules import k_from_density  # noqa: E402

#: the ranks of the job whose shard and batches it takes (the benchmark's)
RANKS = 4


def top_share(squares: np.ndarray, k: int) -> float:
    """The share of ``squares.sum()`` held by its ``k`` largest entries."""
    total = float(squares.sum())
    if total <= 0.0:
        return 0.0
    return float(np.partition(squares, squares.size - k)[squares.size - k:].sum()) / total


def measure(name: str, seed: int, steps: int, density: float) -> dict:
    """One model and seed: the per-step shares, summarised (see the module)."""
    import keras
    import tensorflow as tf

    import bench_time_to_accuracy as tta

    x_all, y_all, _, _ = tta.data(seed, name)
    shards = [tfsparse.data.shard(x_all, y_all, rank=r, size=RANKS) for r in range(RANKS)]
    x, y = shards[0]
    model = tta.build(name, seed)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(tta.RATES[name], momentum=tta.MOMENTUM)
    variables = model.trainable_variables
    sizes = [int(np.prod(v.shape)) for v in variables]
    n = sum(sizes)
    k = k_from_density(n, density)  # what the exchange sends of a bucket of n

    @tf.function
    def grads(xb, yb):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=True))
        return tape.gradient(value, variables)

    def flat(gs):
        return np.concatenate([np.asarray(tf.convert_to_tensor(g)).reshape(-1) for g in gs])

    residual = np.zeros(n, np.float32)
    rows = {"global": [], "local": [], "feedback": [], "residual_ratio": []}
    starts = np.cumsum([0] + sizes[:-1])
    per_tensor = {"share": [], "sent": [], "captured": [], "residual_ratio": []}  # steps x tensors each
    per_epoch = len(x) // tta.BATCH
    for step in range(steps):
        i = (step % per_epoch) * tta.BATCH
        g_list = grads(x[i:i + tta.BATCH], y[i:i + tta.BATCH])
        g = flat(g_list)
        big = flat(grads(np.concatenate([sx[i:i + tta.BATCH] for sx, _ in shards]),
                         np.concatenate([sy[i:i + tta.BATCH] for _, sy in shards])))
        acc = g + residual
        squares = acc * acc
        chosen = np.argpartition(squares, n - k)[n - k:]
        rows["global"].append(top_share(big * big, k))
        rows["local"].append(top_share(g * g, k))
        rows["feedback"].append(top_share(squares, k))
        rows["residual_ratio"].append(float(np.linalg.norm(residual) / max(np.linalg.norm(g), 1e-30)))
        per_tensor_step(per_tensor, g, residual, squares, chosen, starts, n)
        residual = acc
        residual[chosen] = 0.0
        opt.apply_gradients(zip(g_list, variables))  # dense training: the shares are what it would send

    tensors = [{"name": v.path, "size": size,
                **{key: spans(np.array(per_tensor[key])[:, i], first=False) for key in per_tensor}}
               for i, (v, size) in enumerate(zip(variables, sizes))]
    return {"model": name, "seed": seed, "parameters": n, "k": k, **{key: spans(v) for key, v in rows.items()},
            "tensors": tensors}


def spans(values, first: bool = True) -> dict:
    """Means of ``values`` (one per step), rounded to 4 places: over the first 10 steps (``first``),
    steps 10-40 and the last 40."""
    cuts = {"first_10": slice(None, 10)} if first else {}
    cuts.update({"steps_10_40": slice(10, 40), "last_40": slice(-40, None)})
    return {span: round(float(np.mean(values[cut])), 4) for span, cut in cuts.items()}


def per_tensor_step(per_tensor: dict, g, residual, squares, chosen, starts, n: int) -> None:
    """One step's figures per tensor, appended to ``per_tensor``: its share of the gradient's energy
    (``share``), the fraction of its entries the top-k with error feedback sends (``sent``), the share
    of its ``g + residual`` energy they hold (``captured``) and ``|residual| / |g|`` within it."""
    sizes = np.diff(np.append(starts, n))
    g2 = np.add.reduceat(g.astype(np.float64) ** 2, starts)
    acc2 = np.add.reduceat(squares.astype(np.float64), starts)
    mask = np.zeros(n, np.float64)
    mask[chosen] = squares[chosen]
    sent_energy = np.add.reduceat(mask, starts)
    count = np.bincount(np.searchsorted(starts, chosen, side="right") - 1, minlength=starts.size)
    r2 = np.add.reduceat(residual.astype(np.float64) ** 2, starts)
    per_tensor["share"].append(g2 / max(g2.sum(), 1e-300))
    per_tensor["sent"].append(count / sizes)
    per_tensor["captured"].append(sent_energy / np.maximum(acc2, 1e-300))
    per_tensor["residual_ratio"].append(np.sqrt(r2) / np.maximum(np.sqrt(g2), 1e-30))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", help="among tools/bench_time_to_accuracy.py's MODELS (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--out", default="results/gradient_concentration")
    args = parser.parse_args(argv)
    if args.steps < 50:
        raise ValueError(f"--steps {args.steps} is not valid; accepted: 50 or more (the summary's last 40 "
                         f"steps follow the first 10)")
    if not 0.0 < args.density < 1.0:
        raise ValueError(f"--density {args.density} is not valid; accepted: a number in (0, 1)")
    import bench_time_to_accuracy as tta  # loads Keras: after the checks that need nothing

    args.models = args.models or list(tta.MODELS)
    unknown = [name for name in args.models if name not in tta.MODELS]
    if unknown:
        raise ValueError(f"--models {unknown[0]!r} is not valid; accepted: {', '.join(tta.MODELS)}")
    runs = []
    for name in args.models:
        for seed in args.seeds:
            t0 = time.perf_counter()
            run = measure(name, seed, args.steps, args.density)
            run["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(run), flush=True)
            runs.append(run)
    record = {"machine": bench_host.describe(), "date": time.strftime("%Y-%m-%d"), "steps": args.steps,
              "density": args.density, "runs": runs}
    files.write_text(args.out + ".json", json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
