"""Time to accuracy: test accuracy against wall-clock seconds, dense against sparse, and its figure.

    tfsparse-run -np 2 python keras_examples/time_to_accuracy.py --tiny                 # seconds, shared memory
    tfsparse-run -np 4 python keras_examples/time_to_accuracy.py [--model mlp17m] [--epochs 7]
    tfsparse-run -np 4 --net 1gbit python keras_examples/time_to_accuracy.py --network "1 Gbit/s"   # root, tc

A thin wrapper: it runs tools/bench_time_to_accuracy.py's own ``main`` (imported from the file, in
these same processes) with a short list of settings, the way README's headline table was made.
The tool first trains the model with plain Keras and no exchange (the compute floor), then once
per setting under ``SparseStrategy``; rank 0 writes ``<out>.json`` and ``<out>.png`` (accuracy
against seconds and against epochs, and the seconds to ``--target`` per setting) and prints a
table.  ``tfsparse-run --net 1gbit`` (root, with ``tc`` and network namespaces) puts each rank
behind its own emulated 1 Gbit/s link: there the sparse settings reach the target sooner than
dense, which on shared memory they need not (docs/network.md).  ``--network`` only labels the
figure.

``--tiny``: the tool's small convolutional model, two epochs, one setting (top-k) beside the
compute-only run, target 0.3 -- about half a minute at P = 2.

``--demo`` is ``make demo``: 4 ranks, the 17.1M-parameter MLP, ten epochs, dense float32 against
``algorithm="auto"``, the default (ten measured dense rounds, then its choice), to dense float32's
own accuracy (its best test accuracy less 0.5 point), on an emulated 1 Gbit/s link when the
machine can make one (root, ``ip``, ``tc``) and on shared memory otherwise; rank 0 writes
``results/demo.json`` and ``results/demo.png``.
"""
import importlib.util
import json
from pathlib import Path

from example_utils import argument_parser, fraction as accuracy, positive_int

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_time_to_accuracy.py"
SETTINGS = [{"label": "dense f32", "algorithm": "dense"},
            {"label": "dense f16", "algorithm": "dense", "wire_dtype": "float16"},
            {"label": "topk 0.01", "algorithm": "topk", "density": 0.01},
            {"label": "gtopk 0.01", "algorithm": "gtopk", "density": 0.01}]
TINY = [{"label": "topk 0.05", "algorithm": "topk", "density": 0.05}]
DEMO = [{"label": "dense f32", "algorithm": "dense"}, {"label": "auto (the default)", "algorithm": "auto"}]


def parse_args():
    parser = argument_parser(__doc__)
    parser.add_argument("--model", default="mlp17m", choices=["mlp17m", "conv"],
                        help="the tool's 17.1M-parameter MLP or its 8.4M-parameter conv net")
    parser.add_argument("--epochs", type=positive_int, default=7)
    parser.add_argument("--target", type=accuracy, default=0.95, help="the test accuracy to reach")
    parser.add_argument("--settings", default=json.dumps(SETTINGS),
                        help="JSON list of {label, algorithm, density, options...} (default: dense f32, "
                             "dense f16, topk 0.01, gtopk 0.01)")
    parser.add_argument("--network", default="shared memory", help="a label for the link, in the figure")
    parser.add_argument("--out", default="results/time_to_accuracy_example",
                        help="rank 0 writes OUT.json and OUT.png")
    parser.add_argument("--tiny", action="store_true", help="conv model, two epochs, top-k only, target 0.3")
    parser.add_argument("--demo", action="store_true",
                        help="make demo: the 17.1M MLP, ten epochs, dense f32 against auto, to dense f32's own "
                             "accuracy, written to results/demo")
    args = parser.parse_args()
    if args.tiny:
        args.model, args.epochs, args.target, args.settings = "conv", 2, 0.3, json.dumps(TINY)
    if args.demo:
        args.model, args.epochs, args.target, args.settings = "mlp17m", 10, "dense", json.dumps(DEMO)
        args.out = "results/demo"
    try:
        settings = json.loads(args.settings)
    except json.JSONDecodeError as e:
        parser.error(f"--settings is not JSON: {e}")
    if not isinstance(settings, list) or not all(isinstance(s, dict) and "algorithm" in s for s in settings):
        parser.error("--settings: expected a JSON list of objects, each with an 'algorithm'")
    return args


def main():
    args = parse_args()  # before TensorFlow is imported: --help and bad arguments answer at once
    spec = importlib.util.spec_from_file_location("bench_time_to_accuracy", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)                    # imports TensorFlow, Keras and tfsparse
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # the tool's command line: it calls tfsparse.init(), trains, and rank 0 writes and prints
    return tool.main([args.settings, "--model", args.model, "--epochs", str(args.epochs),
                      "--target", str(args.target), "--network", args.network, "--out", args.out])


if __name__ == "__main__":
    raise SystemExit(main())
