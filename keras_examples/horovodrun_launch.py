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

from example_utils import argument_parser, digits, fraction, positive_int, quiet_tensorflow


def parse_args():
    parser = argument_parser(__doc__)
    parser.add_argument("--algorithm", default="topk",
                        choices=["dense", "topk", "gtopk", "oktopk", "dgc", "gaussiank", "dragonn", "csc"])
    parser.add_argument("--density", type=fraction, default=0.01)
    parser.add_argument("--epochs", type=positive_int, default=10)
    parser.add_argument("--tiny", action="store_true", help="two epochs: a smoke test")
    return parser.parse_args()


def main():
    args = parse_args()  # before TensorFlow is imported: --help and bad arguments answer at once
    quiet_tensorflow()
    import keras

    import tfsparse

    tfsparse.init()                                  # "auto": Horovod under horovodrun, else MPI
    x_local, y_local, x_test, y_test = digits()

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
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if tfsparse.rank() == 0:
        print(f"backend: {tfsparse.runtime.backend()}, {tfsparse.size()} processes, "
              f"{args.algorithm} at density {args.density}")
        print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
