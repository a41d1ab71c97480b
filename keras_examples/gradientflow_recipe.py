"""GradientFlow's recipe (gradientflow-sun2019) on the digits MLP: coarse-grained sparse
communication, momentum correction, an fp16 wire, lazy allreduce and a dense warm-up.

    tfsparse-run -np 2 python keras_examples/gradientflow_recipe.py [--density 0.15] [--chunk-size 64]
        [--epochs 20] [--warmup-epochs 2] [--tiny]

The settings are docs/gradientflow.md's (its convergence table's "csc +mc +warmup" row):

* ``algorithm="csc"``, ``density=0.15``: every step the ranks sum their chunks' L1 norms and
  exchange only the 15 % of chunks with the largest norms, densely (§3.2);
* ``chunk_size``: the paper's 32K gradients per chunk would cut this 50,826-parameter model into 2
  chunks, so the example uses 64 (795 chunks), as the documentation's measurement does;
* ``memory="momentum", momentum=0.9``: momentum correction -- the exchange applies the momentum,
  so the optimizer is ``SGD(0.05)`` *without* momentum (with it tfsparse raises ValueError);
* ``wire_dtype="float16"``: values travel as fp16; ``plan=4 << 20``: lazy allreduce, buckets of
  at least 4 MB (this small model fits in one);
* ``DensitySchedule(tfsparse.WarmUp(epochs=2))``: the first step dense, the density falling
  linearly to 0.15 over two epochs (§3.2 "Warm-Up Dense Training").

Rank 0 prints each epoch's density and bytes per step, then the test accuracy.  ``--tiny``: two
epochs, one of them warm-up.  Digits from scikit-learn (bundled, nothing is downloaded).
"""

from example_utils import argument_parser, digits, fraction, positive_int, quiet_tensorflow


def parse_args():
    parser = argument_parser(__doc__)
    parser.add_argument("--density", type=fraction, default=0.15, help="the fraction of chunks sent")
    parser.add_argument("--chunk-size", type=positive_int, default=64, help="elements per chunk (paper: 32768)")
    parser.add_argument("--epochs", type=positive_int, default=20)
    parser.add_argument("--warmup-epochs", type=positive_int, default=2, help="length of the dense warm-up")
    parser.add_argument("--tiny", action="store_true", help="two epochs, one of warm-up")
    args = parser.parse_args()
    if args.tiny:
        args.epochs, args.warmup_epochs = 2, 1
    return args


def main():
    args = parse_args()  # before TensorFlow is imported: --help and bad arguments answer at once
    quiet_tensorflow()
    import keras

    import tfsparse

    tfsparse.init()
    x_local, y_local, x_test, y_test = digits()

    strategy = tfsparse.SparseStrategy(
        algorithm="csc", density=args.density, chunk_size=args.chunk_size,   # coarse-grained sparsity
        memory="momentum", momentum=0.9,                                       # momentum correction ...
        wire_dtype="float16", plan=4 << 20)                                    # fp16 wire, lazy allreduce
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.05),                    # ... so no momentum here
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    callbacks = [tfsparse.keras.callbacks.DensitySchedule(tfsparse.WarmUp(epochs=args.warmup_epochs)),
                 tfsparse.keras.callbacks.CommunicationStats()]
    history = model.fit(x_local, y_local, batch_size=32, epochs=args.epochs, callbacks=callbacks,
                        verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if tfsparse.rank() == 0:
        for epoch, (density, sent) in enumerate(zip(history.history["density"], history.history["comm_bytes"])):
            print(f"epoch {epoch + 1}: density {density:.3f}, {sent:.0f} bytes sent per step and rank, "
                  f"accuracy {history.history['accuracy'][epoch]:.4f}")
        print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
