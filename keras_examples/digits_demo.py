"""Sparse data-parallel training demo on scikit-learn's bundled digits data (offline).

    tfsparse-run -np 4 python keras_examples/digits_demo.py [--algorithms dense,topk] [--density 0.01]
        [--wire float16] [--bucket-bytes 65536]
        [--memory momentum --warmup-epochs 2] [--chunk-size 64]
        [--pipeline 2 --wire int8 --dsync-epochs 1] [--lr 0.05 --momentum 0.9 --lr-schedule cosine]
        [--json out.json] [--tensorboard results/tensorboard] [--tiny]

Every rank trains on its own shard with ``tfsparse.SparseStrategy``; rank 0 prints a table:
algorithm, final test accuracy, bytes each rank sent per step, and the mean step time.
``--tiny`` trains one epoch of each algorithm, a run of seconds.
``--json`` also holds, per run, rank 0's ``epoch_end_s`` (wall seconds from the start of ``fit``
to each epoch's end, validation included) and ``train_s`` (the training batches alone, cumulative).

``--memory`` is the library's ``memory=`` (default ``auto``: a sparse algorithm takes the SGD's
momentum over, momentum correction, ``momentum_rows``); ``--memory momentum`` is momentum correction
pinned (DGC / GradientFlow, masking everywhere; ``momentum_rows``: but in an Embedding's rows): the exchange applies the
momentum, so the optimizer becomes plain ``SGD(lr)``; ``--warmup-epochs E`` adds the dense
warm-up (``DensitySchedule(WarmUp(epochs=E))``); ``--chunk-size`` is CSC's (``algorithm="csc"``).
``--pipeline 2`` is Pipe-SGD (each step applies the previous step's aggregated gradient while its
own is on the wire); ``--dsync-epochs E`` trains the first E epochs synchronously over float32
(``DSyncWarmUp``), Pipe-SGD's warm-up.  ``--lr-schedule cosine`` decays the learning rate from
``--lr`` to 0 over the run (Keras' ``CosineDecay``), so that the final accuracy is that of a
converged model rather than of wherever a constant rate left it.  ``--tensorboard DIR`` writes, on rank 0 only, one
TensorBoard run per algorithm (``DIR/<algorithm>``): loss, accuracy, and what
``CommunicationStats`` adds -- ``comm_bytes``, ``density``, ``encode_ms``, ``comm_ms``,
``decode_ms``, ``wait_ms`` -- as epoch scalars (``tensorboard --logdir DIR``), e.g.
``--tensorboard results/tensorboard``.
"""
import json
import os
import time

from example_utils import argument_parser, fraction, non_negative_int, positive_float, positive_int, quiet_tensorflow


def timers(keras, skip_first_epoch=True):
    """A StepTimer and an EpochClock (Keras callbacks; defined once Keras is imported).
    ``skip_first_epoch``: the step timer leaves out the first epoch (tracing, warm-up)."""

    class StepTimer(keras.callbacks.Callback):
        """Wall times of the training steps, after the first epoch unless it is the only one."""

        def on_train_begin(self, logs=None):
            self.times, self.epoch = [], 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch > 0 or not skip_first_epoch:
                self.times.append(time.perf_counter() - self.t0)


    class EpochClock(keras.callbacks.Callback):
        """Wall seconds from the start of ``fit`` to each epoch's end (after its validation), and
        the training part alone (first batch to last batch of each epoch), cumulative."""

        def on_train_begin(self, logs=None):
            self.start, self.epoch_end_s, self.train_s, self.train = time.perf_counter(), [], [], 0.0

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.t1 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.train += self.t1 - self.t0
            self.train_s.append(self.train)
            self.epoch_end_s.append(time.perf_counter() - self.start)

    return StepTimer(), EpochClock()


def build_model(keras, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def learning_rate(keras, args, n_local):
    """``--lr``, or with ``--lr-schedule cosine`` a cosine decay from it to 0 over every step of the run."""
    if args.lr_schedule == "constant":
        return args.lr
    steps = args.epochs * -(-n_local // args.batch_size)
    return keras.optimizers.schedules.CosineDecay(args.lr, decay_steps=steps)


def parse_args():
    parser = argument_parser(__doc__)
    parser.add_argument("--algorithms", default="dense,topk", help="comma-separated algorithm names")
    parser.add_argument("--density", type=fraction, default=0.01)
    parser.add_argument("--epochs", type=positive_int, default=10)
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"],
                        help="constant, or cosine decay from --lr to 0 over the run")
    parser.add_argument("--wire", default="float32", help="wire_dtype: float32, float16, bfloat16 or int8")
    parser.add_argument("--bucket-bytes", type=positive_int, default=None,
                        help="lazy-allreduce threshold in bytes (default: one fused bucket)")
    parser.add_argument("--memory", default="auto", help="auto (default: momentum correction under the SGD's momentum "
                        "for a sparse algorithm), residual (error feedback) or momentum / momentum_rows (correction, masking "
                        "everywhere / but in an Embedding's rows; the SGD without)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--warmup-epochs", type=float, default=0.0, help="dense warm-up length (0: none)")
    parser.add_argument("--warmup-ramp", default="linear", help="linear (GradientFlow) or exponential (DGC)")
    parser.add_argument("--chunk-size", type=positive_int, default=None, help="CSC's chunk size (default 32768)")
    parser.add_argument("--csc-selection", default=None, help="CSC's chunk selection: current or previous")
    parser.add_argument("--selection", default=None,
                        help="cost_model: DRAGONN's per-tensor choice by Eq. 1 (default: every tensor compressed)")
    parser.add_argument("--clip-norm", type=positive_float, default=None,
                        help="DGC's local gradient clipping (default: off)")
    parser.add_argument("--pipeline", type=int, choices=[1, 2], default=1, help="1 (synchronous) or 2 (Pipe-SGD)")
    parser.add_argument("--dsync-epochs", type=non_negative_int, default=0,
                        help="Pipe-SGD's synchronous float32 warm-up epochs")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="initial weights and shuffling (default 0)")
    parser.add_argument("--json", default=None, help="write every run's per-epoch history here (rank 0)")
    parser.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="TensorBoard logs (rank 0): one run per algorithm under DIR")
    parser.add_argument("--tiny", action="store_true", help="one epoch of each algorithm: a run of seconds")
    args = parser.parse_args()
    if args.tiny:
        args.epochs = 1
    return args


def main():
    args = parse_args()  # before TensorFlow is imported: --help and bad arguments answer at once
    quiet_tensorflow()
    import numpy as np
    import keras
    from sklearn.datasets import load_digits

    import tfsparse
    from tfsparse.memory import keeps_velocity

    tfsparse.init()
    rank, size = tfsparse.rank(), tfsparse.size()
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm]
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    x_local, y_local = tfsparse.data.shard(x_train, y_train)   # equal shards: equal step counts

    rows, runs = [], {}
    correction = keeps_velocity(args.memory)  # momentum correction: the exchange applies the momentum
    for algorithm in args.algorithms.split(","):
        options = {}
        if algorithm == "csc":
            options = {k: v for k, v in (("chunk_size", args.chunk_size), ("chunk_selection", args.csc_selection)) if v}
        strategy = tfsparse.SparseStrategy(algorithm=algorithm, density=args.density, wire_dtype=args.wire,
                                           plan=args.selection if args.selection and algorithm != "dense"
                                           else args.bucket_bytes, memory=args.memory,
                                           momentum=args.momentum if correction else None,
                                           pipeline=args.pipeline, clip_norm=args.clip_norm, **options)
        with strategy.scope():
            model = build_model(keras, args.seed)
            # momentum correction: the exchange applies the momentum, the optimizer must not
            model.compile(optimizer=keras.optimizers.SGD(learning_rate(keras, args, len(x_local)),
                                                         momentum=0.0 if correction else args.momentum),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        if rank == 0:
            print(f"\n== {algorithm} (density {strategy.density if algorithm != 'dense' else 1.0}) "
                  f"on {size} processes, {model.count_params()} parameters", flush=True)
        timer, clock = timers(keras, skip_first_epoch=args.epochs > 1)
        callbacks = [tfsparse.keras.callbacks.CommunicationStats(), timer, clock]
        if args.warmup_epochs > 0 and algorithm != "dense":
            callbacks.insert(0, tfsparse.keras.callbacks.DensitySchedule(
                tfsparse.schedules.WarmUp(epochs=args.warmup_epochs, ramp=args.warmup_ramp)))
        if args.dsync_epochs:
            callbacks.insert(0, tfsparse.keras.callbacks.DSyncWarmUp(epochs=args.dsync_epochs))
        if args.tensorboard:  # after CommunicationStats, so its keys are in the logs it writes
            callbacks.append(tfsparse.keras.callbacks.rank_zero_only(
                keras.callbacks.TensorBoard(os.path.join(args.tensorboard, algorithm), write_graph=False)))
        hist = model.fit(x_local, y_local, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
                         validation_data=(x_test, y_test), verbose=2 if rank == 0 else 0)
        _, acc = model.evaluate(x_test, y_test, verbose=0)
        rows.append((algorithm, acc, hist.history["comm_bytes"][-1], hist.history["density"][-1],
                     1e3 * float(np.mean(timer.times))))
        # the History's numbers; CommunicationStats also puts the setting each epoch ended with there
        # (comm_algorithm, wire: strings, kept as they are)
        runs[algorithm] = {**{k: [v if isinstance(v, str) else float(v) for v in vals]
                              for k, vals in hist.history.items()},
                           "test_accuracy": float(acc), "step_ms": rows[-1][-1],
                           "epoch_end_s": clock.epoch_end_s, "train_s": clock.train_s}

    if rank == 0:
        print(f"\n{size} processes, digits ({len(x_train)} train / {len(x_test)} test), "
              f"{args.epochs} epochs, batch {args.batch_size}/rank, wire {args.wire}, pipeline {args.pipeline}, "
              f"{'one fused bucket' if args.bucket_bytes is None else f'buckets of {args.bucket_bytes} B'}")
        print(f"{'algorithm':<12}{'accuracy':>10}{'bytes/step':>14}{'density':>10}{'step ms':>10}")
        for algorithm, acc, nbytes, dens, ms in rows:
            print(f"{algorithm:<12}{acc:>10.4f}{nbytes:>14.0f}{dens:>10.4f}{ms:>10.1f}")
        if args.tensorboard:
            print(f"\nTensorBoard logs (comm_bytes, density, encode/comm/decode/wait ms per epoch): "
                  f"tensorboard --logdir {args.tensorboard}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"processes": size, "args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
