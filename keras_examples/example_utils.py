"""What the examples share: argument types for argparse and this rank's shard of the digits.

Importing it imports neither TensorFlow nor tfsparse, so an example parses its arguments (and
answers ``--help``) at once.  Python puts an example's own directory on ``sys.path``, so the
examples import it as ``example_utils``.
"""
import argparse


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not an integer >= 1")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not an integer >= 0")
    return value


def positive_float(text):
    value = float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"{text} is not a number > 0")
    return value


def fraction(text):
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def digits(images: bool = False):
    """``(x_local, y_local, x_test, y_test)``: scikit-learn's bundled digits (nothing is
    downloaded) scaled to [0, 1] and shuffled alike on every rank; this rank's equal shard of the
    first 1,500 (``tfsparse.data.shard``: equal shards, equal step counts) and the other 297 for
    testing.  ``images``: as 8x8 grey images with one channel.  Call it after ``tfsparse.init()``."""
    import numpy as np
    from sklearn.datasets import load_digits

    import tfsparse

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    if images:
        x = x.reshape(-1, 8, 8, 1)
    perm = np.random.default_rng(0).permutation(len(x))  # the same order on every rank
    x, y = x[perm], y[perm].astype("int32")
    x_local, y_local = tfsparse.data.shard(x[:1500], y[:1500])
    return x_local, y_local, x[1500:], y[1500:]


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` prints the example's docstring ``doc`` as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def quiet_tensorflow() -> None:
    """TensorFlow's C++ start-up lines off (unless the environment sets their level): call it
    after parsing the arguments, before TensorFlow is imported."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
