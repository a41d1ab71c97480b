"""A small convolutional network on the digits as 8x8x1 images, trained with a sparse allreduce.

    tfsparse-run -np 2 python keras_examples/conv_digits.py [--algorithm gtopk|topk] [--density 0.02]
        [--epochs 8] [--batch-size 32] [--tiny]

What it shows: ``tfsparse.SparseStrategy`` with gTop-k (or top-k) on a Keras conv net; each rank
trains on its own equal shard (``tfsparse.data.shard``); ``CommunicationStats`` adds the bytes
each rank sent per step (``comm_bytes``) and the achieved ``density`` to the epoch logs; rank 0
prints the test accuracy, which every rank computes alike (the weights are identical on every
rank).  ``--tiny`` trains one epoch, for a run of a few seconds.  scikit-learn's bundled digits:
nothing is downloaded.
"""

from example_utils import argument_parser, digits, fraction, positive_int, quiet_tensorflow


def parse_args():
    parser = argument_parser(__doc__)
    parser.add_argument("--algorithm", default="gtopk", choices=["gtopk", "topk"])
    parser.add_argument("--density", type=fraction, default=0.02, help="fraction of gradient elements sent")
    parser.add_argument("--epochs", type=positive_int, default=8)
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank")
    parser.add_argument("--tiny", action="store_true", help="one epoch: a smoke test of a few seconds")
    return parser.parse_args()


def main():
    args = parse_args()  # before TensorFlow is imported: --help and bad arguments answer at once
    quiet_tensorflow()
    import keras

    import tfsparse

    tfsparse.init()                                  # the MPI world (or Horovod's under horovodrun)
    # this rank's equal shard of the digits as 8x8 grey images, one channel (example_utils)
    x_local, y_local, x_test, y_test = digits(images=True)

    strategy = tfsparse.SparseStrategy(algorithm=args.algorithm, density=args.density)
    with strategy.scope():                           # variables start from rank 0's values
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),            # 4x4x32
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    epochs = 1 if args.tiny else args.epochs
    history = model.fit(x_local, y_local, batch_size=args.batch_size, epochs=epochs,
                        callbacks=[tfsparse.keras.callbacks.CommunicationStats()],
                        verbose=2 if tfsparse.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)   # a collective: every rank calls it
    if tfsparse.rank() == 0:
        print(f"{args.algorithm} at density {args.density} on {tfsparse.size()} processes, "
              f"{model.count_params()} parameters: {history.history['comm_bytes'][-1]:.0f} bytes sent "
              f"per step and rank (a dense float32 allreduce: {8 * (tfsparse.size() - 1) * model.count_params() // tfsparse.size()})")
        print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
