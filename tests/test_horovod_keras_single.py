"""tfsparse.horovod.tensorflow.keras.DistributedOptimizer's settings in one process: lossless dense
by default, a float16 wire for Compression.fp16, tfsparse's algorithms one keyword away, and a
SparseStrategy's own algorithm kept inside its scope."""
import keras

import tfsparse
import tfsparse.horovod.tensorflow.keras as hvd


def test_defaults_compression_keywords_and_a_strategy_scope():
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert (opt.algorithm, opt.exchange.wire.name) == ("dense", "float32")
    assert hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16).exchange.wire.name \
        == "float16"
    sparse = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), algorithm="gtopk", density=0.05)
    assert (sparse.algorithm, sparse.density) == ("gtopk", 0.05)
    strategy = tfsparse.SparseStrategy("topk", 0.02)
    with strategy.scope():
        inside = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert (inside.algorithm, inside.density) == ("topk", 0.02)  # the strategy's, not dense


def test_an_op_given_as_a_numpy_integer_is_taken():
    import numpy as np
    import pytest

    from tfsparse.horovod.tensorflow import _resolve_op

    assert _resolve_op(np.int64(hvd.Sum), None) == hvd.Sum and type(_resolve_op(np.int64(hvd.Sum), None)) is int
    with pytest.raises(ValueError, match=r"op=True is not supported; accepted: hvd\.Average"):
        _resolve_op(True, None)


def test_cuda_built_leaves_tensorflow_s_devices_to_be_set(tmp_path):
    """hvd.cuda_built() asks for the physical devices only: a Horovod script may still choose its
    GPU (tf.config.set_visible_devices) or its thread pools after asking, as with Horovod, where
    asking for the logical devices would have initialized TensorFlow's runtime and made that a
    RuntimeError."""
    import subprocess
    import sys

    script = ("import tensorflow as tf, tfsparse.horovod.tensorflow as hvd\n"
              "assert hvd.cuda_built() in (True, False)\n"
              "tf.config.set_visible_devices([], 'GPU')\n"
              "tf.config.threading.set_intra_op_parallelism_threads(1)\n"  # raises once the runtime is up
              "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
