"""Pipe-SGD (pipe-sgd-li2018) on the digits MLP: a pipelined dense allreduce over an 8-bit wire,
after a synchronous float32 warm-up.

    tfsparse-run -np 2 python keras_examples/pipesgd_recipe.py [--epochs 20] [--dsync-epochs 4]
        [--lr 0.2] [--tiny]

The settings are docs/pipe-sgd.md's:

* ``algorithm="dense", wire_dtype="int8"``: every message of the reduce-scatter and allgather is
  quantized to 8 bits (one float32 scale per 4096 values; what is lost stays in the residual);
* ``pipeline=2``: step t's exchange runs on the communication thread while step t+1 computes,
  and step t+1 applies it -- one step stale (the first pipelined step applies zeros);
* ``tfsparse.keras.callbacks.DSyncWarmUp(epochs=4)``: the first epochs synchronous over float32,
  then pipelined and compressed (§4, the paper's default of 4);
* plain SGD (the paper's Alg. 1), lr 0.2 decayed to 0 by a cosine: a one-step-stale gradient
  narrows the stable rates, much more with heavy-ball momentum (see docs/pipe-sgd.md, Convergence).

Rank 0 prints each epoch's mode (D-Sync or pipelined), bytes per step and accuracy, then the test
accuracy.  ``--tiny``: two epochs, the first of them D-Sync.  Digits from scikit-learn (bundled).
"""

from example_utils import (argument_parser, digits, non_negative_int, positive_float, positive_int,
                           quiet_tensorflow)


def parse_args():
    parser = argument_parser(__doc__)
    parser.add_argument("--epochs", type=positive_int, default=20)
    parser.add_argument("--dsync-epochs", type=non_negative_int, default=4,
                        help="synchronous float32 epochs before pipelining (0: none)")
    parser.add_argument("--lr", type=positive_float, default=0.2, help="initial rate of plain SGD")
    parser.add_argument("--tiny", action="store_true", help="two epochs, one of them D-Sync")
    args = parser.parse_args()
    if args.tiny:
        args.epochs, args.dsync_epochs = 2, 1
    return args


def main():
    args = parse_args()  # before TensorFlow is imported: --help and bad arguments answer at once
    quiet_tensorflow()
    import keras

    import tfsparse

    tfsparse.init()
    x_local, y_local, x_test, y_test = digits()
    batch = 32
    steps = args.epochs * -(-len(x_local) // batch)

    strategy = tfsparse.SparseStrategy("dense", 1.0, wire_dtype="int8", pipeline=2)   # Pipe-SGD + Q
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(args.lr, steps)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    callbacks = [tfsparse.keras.callbacks.DSyncWarmUp(epochs=args.dsync_epochs),   # D-Sync first
                 tfsparse.keras.callbacks.CommunicationStats()]
    history = model.fit(x_local, y_local, batch_size=batch, epochs=args.epochs, callbacks=callbacks, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if tfsparse.rank() == 0:
        for epoch, sent in enumerate(history.history["comm_bytes"]):
            mode = "D-Sync float32" if epoch < args.dsync_epochs else "pipelined int8"
            print(f"epoch {epoch + 1}: {mode}, {sent:.0f} bytes sent per step and rank, "
                  f"accuracy {history.history['accuracy'][epoch]:.4f}")
        print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
