"""GradientExchange: composes Memory + Aggregator over a Communicator, and the glue
that runs it inside a compiled TensorFlow train step.

One exchange per optimizer (or per strategy).  Per step, all gradients are fused
into one flat float32 vector and handed to a single stateful ``tf.numpy_function``
(one Python call per step, ~1 ms overhead), which

1. adds the residual (error feedback, :mod:`tfsparse.memory`),
2. runs the aggregator (:mod:`tfsparse.aggregators`) with ``k = ceil(density * n)``,
3. returns the global sum (dense) and the new residual.

The result is the **sum** over ranks; callers divide by P (or rely on Keras
scaling the loss by ``1/num_replicas_in_sync`` under :class:`SparseStrategy`).
"""
from __future__ import annotations

import math
import numbers
import threading
import time

import numpy as np

from .aggregators import available_aggregators, get_aggregator
from .memory import NoMemory, ResidualMemory


def validate_config(algorithm, density) -> float:
    """Checks ``algorithm`` and ``density``; raises ValueError before any communication."""
    names = available_aggregators()
    if not isinstance(algorithm, str) or algorithm not in names:
        raise ValueError(f"algorithm={algorithm!r} is not supported; accepted: "
                         f"{', '.join(repr(a) for a in names)}")
    if isinstance(density, bool) or not isinstance(density, numbers.Real) or not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density={density!r} must be a number in (0, 1] (the fraction of gradient "
                         f"elements each rank sends), e.g. density=0.01")
    return float(density)


def check_float_variables(variables) -> None:
    """Only floating-point variables can be trained through a gradient exchange."""
    import tensorflow as tf

    for v in variables:
        dtype = getattr(v, "dtype", None)
        name = getattr(v, "path", None) or getattr(v, "name", "?")
        if not tf.as_dtype(dtype).is_floating:
            raise ValueError(f"trainable variable {name!r} has dtype={tf.as_dtype(dtype).name}; only "
                             f"float16/bfloat16/float32/float64 variables can be trained with tfsparse. "
                             f"Mark it trainable=False or make it a float variable.")


class ExchangeStats:
    """Counters of one exchange; CommunicationStats reads and resets them."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.steps = 0
        self.bytes_sent = 0
        self.sent_elements = 0
        self.total_elements = 0
        self.seconds = 0.0

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0

    @property
    def density(self) -> float:
        return self.sent_elements / self.total_elements if self.total_elements else 0.0


class GradientExchange:
    """Sparsify + aggregate + error feedback for one set of gradients.

    Args:
      algorithm: registered aggregator name (``tfsparse.collectives.available_aggregators()``).
      density: fraction of elements each rank sends, in (0, 1]; ``k = ceil(density * n)``.
        Mutable (``exchange.density = ...``) e.g. by ``DensitySchedule``.
      communicator: a :class:`~tfsparse.collectives.Communicator`; default: the world's.
      **options: passed to the aggregator.
    """

    def __init__(self, algorithm: str = "topk", density: float = 0.01, communicator=None, **options):
        self.density = validate_config(algorithm, density)
        self.algorithm = algorithm
        self.options = dict(options)
        self.aggregator = get_aggregator(algorithm, **options)
        self.memory = ResidualMemory() if self.aggregator.uses_memory else NoMemory()
        self._comm = communicator
        self.stats = ExchangeStats()
        self.total = ExchangeStats()  # never reset: whole-run totals
        self._lock = threading.Lock()
        self._pre_step_hooks: list = []

    # -- configuration ----------------------------------------------------
    @property
    def comm(self):
        if self._comm is None:
            from . import runtime

            self._comm = runtime.communicator()
        return self._comm

    @property
    def uses_memory(self) -> bool:
        return self.memory.stateful

    def k_for(self, n: int) -> int:
        if not self.aggregator.uses_memory:
            return n
        return int(min(n, max(1, math.ceil(self.density * n))))

    def add_pre_step_hook(self, fn) -> None:
        """``fn(comm)`` runs once at the start of the next exchange (used for step-count agreement)."""
        with self._lock:
            self._pre_step_hooks.append(fn)

    # -- numpy level ------------------------------------------------------
    def exchange_numpy(self, flat: np.ndarray, residual: np.ndarray | None = None):
        """One step on numpy data: returns ``(global_sum_dense, new_residual_or_None)``."""
        comm = self.comm
        with self._lock:
            hooks, self._pre_step_hooks = self._pre_step_hooks, []
        for hook in hooks:
            hook(comm)
        t0 = time.perf_counter()
        flat = np.ascontiguousarray(flat, dtype=np.float32).reshape(-1)
        acc = self.memory.compensate(flat, residual) if self.memory.stateful else flat
        n = acc.size
        before = comm.bytes_sent
        result = self.aggregator.allreduce(comm, acc, self.k_for(n))
        dense = result.to_dense(n)
        new_residual = self.memory.update(acc, result.contributed) if self.memory.stateful else None
        dt = time.perf_counter() - t0
        for s in (self.stats, self.total):
            s.steps += 1
            s.bytes_sent += comm.bytes_sent - before
            s.sent_elements += result.sent_elements
            s.total_elements += n
            s.seconds += dt
        return dense, new_residual

    # -- TensorFlow glue --------------------------------------------------
    def __call__(self, grads, residual=None):
        """Exchanges a list of gradient tensors in a TF graph; returns the summed tensors.

        ``residual``: a float32 variable of shape ``[sum of sizes]`` (required when
        the algorithm uses memory).
        """
        import tensorflow as tf

        from .strategies._tf_private import reject_xla

        reject_xla("the gradient exchange")
        grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
        if not grads:
            return []
        shapes = [g.shape for g in grads]
        for g in grads:
            if not g.shape.is_fully_defined():
                raise ValueError(f"gradient of shape {g.shape} is not fully defined; tfsparse needs static "
                                 f"variable shapes")
        sizes = [int(s.num_elements()) for s in shapes]
        n = sum(sizes)
        flat = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1]) for g in grads], axis=0)
        if self.memory.stateful:
            if residual is None or int(residual.shape[0]) != n:
                got = None if residual is None else tuple(residual.shape)
                raise ValueError(f"algorithm={self.algorithm!r} keeps a residual of {n} elements; got {got}")
            summed, new_res = tf.numpy_function(self._np_with_memory, [flat, tf.convert_to_tensor(residual)], [tf.float32, tf.float32],
                                                stateful=True, name="tfsparse_exchange")
            new_res.set_shape([n])
            residual.assign(new_res)
        else:
            summed = tf.numpy_function(self._np_without_memory, [flat], tf.float32, stateful=True,
                                       name="tfsparse_exchange")
        summed.set_shape([n])
        parts = tf.split(summed, sizes, axis=0)
        return [tf.cast(tf.reshape(p, s), g.dtype) for p, s, g in zip(parts, shapes, grads)]

    def _np_with_memory(self, flat, residual):
        dense, res = self.exchange_numpy(flat, residual)
        return dense, res.astype(np.float32, copy=False)

    def _np_without_memory(self, flat):
        return self.exchange_numpy(flat)[0]

    def get_config(self) -> dict:
        return {"algorithm": self.algorithm, "density": self.density, **self.options}

    def __repr__(self):
        return f"GradientExchange(algorithm={self.algorithm!r}, density={self.density}, aggregator={self.aggregator!r})"
