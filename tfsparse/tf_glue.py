"""The TensorFlow glue: a pipelined exchange (:class:`~tfsparse.pipelined.Pipelined`) run on
gradient tensors inside a TF graph.

Per bucket, one op starts the bucket (error feedback, selection, encoding; then the
communication thread takes over) as soon as its gradients exist, and one finishes it (waits
for the result).  It honours the exchange's pipelining: pipelined, the tensors returned are the
previous round's.

Where the gradients live picks the path (:func:`tfsparse.ops.tf.exchange_device`):

* on the host -- ``tf.numpy_function`` ops; TF hands over its host buffers;
* on a GPU (TensorFlow sees one and ``numba.cuda`` works: the ``"cuda"`` path of
  :mod:`tfsparse.ops.tf`) -- ``tf.py_function`` ops placed on that GPU.  The fused gradient
  never leaves it: the ops view TF's device buffers through DLPack, the exchange's vectors live
  there (:class:`tfsparse.space.CudaSpace` of that GPU), the algorithms that select on the
  device do (``topk``, ``gtopk``, ``dragonn``), only the payload is copied to the host for the
  transport, and the result is decoded on the device and copied device-to-device into a tensor
  TF allocates (gtopk-ssgd-shi2019 §III-F, dragonn-wang2022 §4.3).  The path is fixed when the
  exchange is built.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import numpy as np
import tensorflow as tf

from ._tf_private import reject_xla
from .exchange import in_space
from .ops import tf as ops_tf
from .plan import Layout, TensorSpec
from .space import cuda_space


def check_float_variables(variables) -> None:
    """Only floating-point variables can be trained through a gradient exchange."""
    for v in variables:
        dtype = tf.as_dtype(getattr(v, "dtype", None))
        name = getattr(v, "path", None) or getattr(v, "name", "?")
        if not dtype.is_floating:
            raise ValueError(f"trainable variable {name!r} has dtype={dtype.name}; only "
                             f"float16/bfloat16/float32/float64 variables can be trained with tfsparse. "
                             f"Mark it trainable=False or make it a float variable.")


def exchange_tensors(exchange, grads, names=None) -> list:
    """Exchanges a list of gradient tensors inside a TF graph with ``exchange`` (a
    :class:`~tfsparse.pipelined.Pipelined`, or a synchronous
    :class:`~tfsparse.exchange.GradientExchange`); returns the summed tensors.  ``names``: the
    gradients' names (the variables' paths; default ``gradient_<i>``)."""
    reject_xla("the gradient exchange")
    rows = [isinstance(g, tf.IndexedSlices) for g in grads]  # an Embedding's: row-sparse (plan.TensorSpec)
    grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
    if not grads:
        return []
    for g in grads:
        if not g.shape.is_fully_defined():
            raise ValueError(f"gradient of shape {g.shape} is not fully defined; tfsparse needs static "
                             f"variable shapes")
    engine = _engine(exchange)
    names = list(names) if names is not None else [f"gradient_{i}" for i in range(len(grads))]
    device = ops_tf.exchange_device(grads)
    with tf.init_scope():  # the first build's collectives run now, eagerly (Horovod's need it)
        space = None if device is None or engine.layout is not None else cuda_space(ops_tf.device_ordinal(device))
        engine.build(Layout(TensorSpec(str(nm), tuple(g.shape.as_list()), g.dtype.name, r)
                            for nm, g, r in zip(names, grads, rows)), space)
    as_f32 = [g if g.dtype == tf.float32 else tf.cast(g, tf.float32) for g in grads]
    if engine.clip_norm is not None:  # DGC's local clipping, over all of this rank's gradients
        as_f32 = tf.clip_by_global_norm(as_f32, engine.local_clip_norm)[0]
    glue = _Glue(exchange)
    if engine.space.on_device:
        as_f32 = [tf.reshape(g, [-1]) for g in as_f32]  # flat views (the kernels take 1-D arrays)

        def op(fn, inputs, dtype, name):
            with tf.device(device) if device else contextlib.nullcontext():
                return tf.py_function(fn, inputs, dtype, name=name)
        start, finish = glue.start_device, glue.finish_device
    else:
        def op(fn, inputs, dtype, name):
            return tf.numpy_function(fn, inputs, dtype, stateful=True, name=name)
        start, finish = glue.start, glue.finish
    buckets = engine.bucket_states
    tokens = [op(functools.partial(start, b.spec.index), as_f32[b.spec.first:b.spec.last], tf.int64,
                 f"tfsparse_start_{b.spec.index}") for b in buckets]
    out = [None] * len(grads)
    for b, token in zip(buckets, tokens):
        summed = op(functools.partial(finish, b.spec.index), [token], tf.float32, f"tfsparse_finish_{b.spec.index}")
        sizes = [int(s) for s in engine.layout.sizes[b.spec.first:b.spec.last]]
        if engine.space.on_device:
            summed.set_shape([b.spec.size])
            parts = tf.split(summed, sizes) if len(sizes) > 1 else [summed]
        else:
            # the host result vector padded to 64 bytes (glue.finish): each tensor is a slice of it,
            # which TensorFlow shares without a copy where the slice is 64-byte aligned
            summed.set_shape([glue.padded_size(b.spec.index)])
            offs = np.concatenate(([0], np.cumsum(sizes)))
            parts = [summed[int(lo):int(hi)] for lo, hi in zip(offs[:-1], offs[1:])]
        for i, part in zip(range(b.spec.first, b.spec.last), parts):
            out[i] = tf.cast(tf.reshape(part, grads[i].shape), grads[i].dtype)
    return out


def loss_scaled(exchange, grads, scale, names=None) -> list:
    """:func:`exchange_tensors` for a loss-scaling optimizer that decides on the exchanged
    gradient: ``grads / scale`` go through the exchange on every rank, whatever they hold, and a
    bucket that is not finite on some rank comes back NaN on every rank (the engine's
    ``nonfinite_result``), so that every rank's finite test fails together."""
    _engine(exchange).on_nonfinite("nan")
    # an Embedding's tf.IndexedSlices stay row-sparse (the layout marks them: plan.TensorSpec.rows)
    return exchange_tensors(exchange, [on_values(g, lambda v: v / tf.cast(scale, v.dtype)) for g in grads],
                            names=names)


def on_values(g, fn):
    """``fn`` of a gradient's values: of a ``tf.IndexedSlices``' values (its rows kept sparse), or
    of the tensor; None stays None."""
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(fn(g.values), g.indices, g.dense_shape)
    return fn(g)


def _engine(exchange):
    """The round engine of ``exchange`` (a Pipelined wrapper's, or the engine itself)."""
    return getattr(exchange, "engine", exchange)


class _Glue:
    """The bodies of the per-bucket ops: host arrays or device tensors in, the bucket started or
    finished through the pipelined exchange.

    It holds the exchange weakly: TensorFlow keeps every ``tf.numpy_function``'s Python function
    for the life of the process (in the outermost graph: eager mode's global one), and through it
    the exchange -- its residuals and buffers -- after the model that traced it is gone.  A model
    holds its exchange (its strategy's, or its ``DistributedOptimizer``'s) as long as it can run
    the traced step."""

    def __init__(self, exchange):
        self._exchange = weakref.ref(exchange)
        self.space = _engine(exchange).space  # in_space enters it

    @property
    def exchange(self):
        exchange = self._exchange()
        if exchange is None:
            raise RuntimeError("tfsparse: the gradient exchange this TensorFlow graph was traced with has "
                               "been freed; keep a reference to it (the strategy, the DistributedOptimizer "
                               "or the GradientExchange) while the traced function runs")
        return exchange

    def _bucket(self, index: int):
        return _engine(self.exchange).bucket_states[index]

    def start(self, bucket: int, *arrays):
        return np.int64(self.exchange.begin(self._bucket(bucket), arrays))

    def padded_size(self, bucket: int) -> int:
        """The length of what :meth:`finish` returns for ``bucket``: its size rounded up to 16."""
        return -(-int(self._bucket(bucket).spec.size) // 16) * 16

    def finish(self, bucket: int, index):
        """``tf.numpy_function`` body: the bucket's result, handed to TensorFlow as the aligned
        result vector itself, padded to 64 bytes (its tail is never read), so that TensorFlow takes
        it without a copy; a result the exchange made elsewhere (a held Pipe-SGD sum, a skipped
        round) is copied into such a vector."""
        b = self._bucket(bucket)
        vec = self.exchange.finish(b, int(index))
        outputs = b.outputs
        padded = outputs.padded(vec) if hasattr(outputs, "padded") else None
        if padded is None:
            padded = outputs.take()
            n = padded.size
            padded = outputs.padded(padded)
            padded[:n] = vec
        return padded

    @in_space
    def start_device(self, bucket: int, *tensors):
        """``tf.py_function`` body: the bucket's gradients (TF tensors on the exchange's GPU) viewed
        in place and the bucket started from them."""
        return np.int64(self.exchange.begin(self._bucket(bucket), ops_tf.device_views(tensors)))

    @in_space
    def finish_device(self, bucket: int, index):
        """``tf.py_function`` body: the bucket's result, copied on the device into a TF tensor."""
        return ops_tf.to_tensor(self.exchange.finish(self._bucket(bucket), int(index)), tf.float32, index.device)
