"""A custom training loop: tf.GradientTape and tfsparse.keras.DistributedOptimizer, no model.fit.

    tfsparse-run -np 2 python keras_examples/custom_loop.py [--algorithm topk] [--density 0.05]
        [--epochs 5] [--tiny]

What it shows, in the order a loop needs it:

* ``tfsparse.keras.callbacks.broadcast_variables(model.variables)`` once at the start: every rank
  starts from rank 0's weights (nothing else does it for you outside ``fit``);
* ``DistributedOptimizer.apply_gradients`` exchanges the gradients (the sum over the ranks,
  divided by P) before the wrapped SGD applies them, so the trainable weights stay identical;
* the model has a ``BatchNormalization`` layer, whose moving statistics each rank updates from its
  own batches: ``tfsparse.keras.callbacks.average_moving_statistics(model)`` at each epoch's end
  replaces them by their mean over the ranks, so every rank evaluates alike;
* the test accuracy, computed on every rank, and the largest difference of the weights between
  ranks (0.0), printed by rank 0.

Digits from scikit-learn (bundled, nothing is downloaded).  ``--tiny``: one epoch.
"""

from example_utils import argument_parser, digits, fraction, positive_int, quiet_tensorflow


def parse_args():
    parser = argument_parser(__doc__)
    parser.add_argument("--algorithm", default="topk", choices=["dense", "topk", "gtopk", "oktopk", "dgc"])
    parser.add_argument("--density", type=fraction, default=0.05)
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank")
    parser.add_argument("--tiny", action="store_true", help="one epoch: a smoke test of a few seconds")
    return parser.parse_args()


def main():
    args = parse_args()  # before TensorFlow is imported: --help and bad arguments answer at once
    quiet_tensorflow()
    import numpy as np
    import keras
    import tensorflow as tf

    import tfsparse

    world = tfsparse.init()                          # the communicator of every rank
    rank, size = world.rank, world.size
    x_local, y_local, x_test, y_test = digits()     # this rank's equal shard (example_utils)

    keras.utils.set_random_seed(rank)                # different initial weights per rank on purpose ...
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128),
                              keras.layers.BatchNormalization(), keras.layers.Activation("relu"),
                              keras.layers.Dense(10)])
    tfsparse.keras.callbacks.broadcast_variables(model.variables)   # ... until rank 0's are broadcast
    optimizer = tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                    algorithm=args.algorithm, density=args.density)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))   # this rank's mean: the wrapper averages
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))   # exchange, then SGD
        return loss

    steps = len(x_local) // args.batch_size          # the same on every rank: every step is a collective
    for epoch in range(1 if args.tiny else args.epochs):
        order = np.random.default_rng(100 * epoch + rank).permutation(len(x_local))
        losses = [float(train_step(x_local[idx], y_local[idx]))
                  for idx in np.array_split(order[:steps * args.batch_size], steps)]
        averaged = tfsparse.keras.callbacks.average_moving_statistics(model)   # every rank, every epoch
        if rank == 0:
            print(f"epoch {epoch + 1}: rank 0's mean loss {np.mean(losses):.4f}, "
                  f"{averaged} moving statistics averaged over {size} ranks", flush=True)

    predictions = np.argmax(model(x_test, training=False), axis=1)
    accuracy = float(np.mean(predictions == y_test))
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()])   # moving statistics included
    spread = np.max(np.ptp(np.stack(world.allgather(weights)), axis=0))
    if rank == 0:
        print(f"largest difference of any weight between ranks: {spread}")
        print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
