"""The digits MLP launched by Horovod's launcher: tfsparse on Horovod's collectives.

    horovodrun -np 2 -H localhost:2 python keras_examples/horovodrun_launch.py [--algorithm topk]
        [--density 0.01] [--epochs 10] [--tiny]

What it shows: the script is the same as under ``tfsparse-run``; only the launcher differs.
``tfsparse.init()`` (backend ``"auto"``) sees that ``horovodrun`` started the job and picks the
Horovod backend -- Horovod's in-graph TensorFlow collectives carry the exchange, point-to-point
messages go over mpi4py on the same world -- and rank 0 prints which backend ran.  Launched with
``tfsparse-run -np 2 python keras_examples/horovodrun_launch.py`` it runs on the MPI backend.
Horovod must be installed with MPI (``make install-horovod``); ``-H localhost:2`` spares
horovodrun a long probe of the network interfaces.  ``--tiny``: two epochs.  Digits from
scikit-learn (bundled, nothing is downloaded).
"""
import argparse
import os


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not an integer >= 1")
    return value


def fraction(text):
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="topk",
                        choices=["dense", "topk", "gtopk", "oktopk", "dgc", "gaussiank", "dragonn", "csc"])
    parser.add_argument("--density", type=fraction, default=0.01)
    parser.add_argument("--epochs", type=positive_int, default=10)
    parser.add_argument("--tiny", action="store_true", help="two epochs: a smoke test")
    return parser.parse_args()


def main():
    args = parse_args()  # before TensorFlow is imported: --help and bad arguments answer at once
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import keras
    from sklearn.datasets import load_digits

    import tfsparse

    tfsparse.init()                                  # "auto": Horovod under horovodrun, else MPI
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm]
    x_local, y_local = tfsparse.data.shard(x[:1500], y[:1500])

    strategy = tfsparse.SparseStrategy(algorithm=args.algorithm, density=args.density)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    model.fit(x_local, y_local, batch_size=32, epochs=2 if args.tiny else args.epochs,
              verbose=2 if tfsparse.rank() == 0 else 0)
    _, accuracy = model.evaluate(x[1500:], y[1500:], verbose=0)
    if tfsparse.rank() == 0:
        print(f"backend: {tfsparse.runtime.backend()}, {tfsparse.size()} processes, "
              f"{args.algorithm} at density {args.density}")
        print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
