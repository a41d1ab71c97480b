"""Checkpoints and resume: tfsparse's ModelCheckpoint and load_model, and BackupAndRestore for a
job that fails and is relaunched.

    tfsparse-run -np 2 python keras_examples/checkpoint_resume.py [--dir results/checkpoint_resume]
        [--epochs 6] [--tiny]
    tfsparse-run -np 2 --max-restarts 1 python keras_examples/checkpoint_resume.py --fail-at-epoch 2

What it shows:

1. ``tfsparse.keras.callbacks.ModelCheckpoint(path)`` on every rank: rank 0 writes the file, and it
   holds **every rank's** exchange state (each rank's top-k residual, the round counter).
2. A later "job" (here: the same script, a second time) builds the same ``SparseStrategy`` and
   calls ``tfsparse.keras.load_model(path)`` **inside its scope** on every rank: each rank gets its
   own residual back and training continues (``initial_epoch``) where it stopped.
3. ``tfsparse.keras.callbacks.BackupAndRestore(dir)`` on every rank backs up the whole state at
   each epoch's end; when a job fails, ``tfsparse-run --max-restarts N`` relaunches it (up to N
   times) and ``fit`` resumes after the last epoch backed up.  ``--fail-at-epoch E`` makes rank 1
   raise once at the end of epoch E (a file in ``--dir`` remembers it): run it with the second
   command above to see the relaunch resume at epoch E+1.  A ``fit`` that completes deletes its
   backup.

``--tiny``: one epoch, then one resumed epoch.  Digits from scikit-learn (bundled).
"""
import os

from example_utils import argument_parser, digits, positive_int, quiet_tensorflow


def parse_args():
    parser = argument_parser(__doc__)
    parser.add_argument("--dir", default="results/checkpoint_resume", help="checkpoint and backup directory")
    parser.add_argument("--epochs", type=positive_int, default=6, help="in all: half before the resume")
    parser.add_argument("--fail-at-epoch", type=positive_int, default=None,
                        help="rank 1 raises once at the end of this epoch of the first fit")
    parser.add_argument("--tiny", action="store_true", help="one epoch, then one resumed epoch")
    args = parser.parse_args()
    if args.tiny:
        args.epochs = 2
    if args.epochs < 2:
        parser.error(f"--epochs {args.epochs}: at least 2 (some before the resume, some after)")
    if args.fail_at_epoch is not None and args.fail_at_epoch >= args.epochs // 2:
        parser.error(f"--fail-at-epoch {args.fail_at_epoch}: must be below {args.epochs // 2}, "
                     f"the first fit's last epoch (--epochs {args.epochs})")
    return args


def main():
    args = parse_args()  # before TensorFlow is imported: --help and bad arguments answer at once
    quiet_tensorflow()
    import keras

    import tfsparse

    tfsparse.init()
    rank = tfsparse.rank()
    x_local, y_local, x_test, y_test = digits()
    checkpoint = os.path.join(args.dir, "model.keras")
    failed_once = os.path.join(args.dir, "failed-once")
    first = args.epochs // 2

    class FailOnce(keras.callbacks.Callback):
        """Rank 1 raises at the end of --fail-at-epoch, the first time only: the job fails."""

        def on_epoch_end(self, epoch, logs=None):
            if rank == 1 and epoch + 1 == args.fail_at_epoch and not os.path.exists(failed_once):
                open(failed_once, "w").close()
                raise RuntimeError(f"simulated failure at the end of epoch {epoch + 1}")

    def callbacks():
        # every callback on every rank; BackupAndRestore first so that it backs up before FailOnce
        return [tfsparse.keras.callbacks.BackupAndRestore(os.path.join(args.dir, "backup")),
                tfsparse.keras.callbacks.ModelCheckpoint(checkpoint), FailOnce()]

    # --- the first job: train, a checkpoint at each epoch's end ---
    os.makedirs(args.dir, exist_ok=True)
    with tfsparse.SparseStrategy("topk", 0.05).scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(x_local, y_local, batch_size=32, epochs=first, callbacks=callbacks(), verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if rank == 0:
        print(f"first fit: epochs {[e + 1 for e in history.epoch]} trained in this launch, "
              f"test accuracy {accuracy:.4f}, checkpoint {checkpoint}", flush=True)

    # --- a later job: the same strategy, the checkpoint loaded inside its scope on every rank ---
    with tfsparse.SparseStrategy("topk", 0.05).scope():
        model = tfsparse.keras.load_model(checkpoint)   # each rank takes its own residual back
    history = model.fit(x_local, y_local, batch_size=32, initial_epoch=first, epochs=args.epochs,
                        callbacks=callbacks(), verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if rank == 0:
        print(f"resumed from {checkpoint}: epochs {[e + 1 for e in history.epoch]}")
        print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
