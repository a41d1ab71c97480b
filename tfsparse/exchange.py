"""GradientExchange: the one exchange pipeline that SparseStrategy and DistributedOptimizer share.

Per model there is one exchange.  It knows the gradients' :class:`~tfsparse.plan.Layout`
(names, shapes, sizes; captured at trace time), and a :mod:`plan <tfsparse.plan>` splits
the layout into buckets, each with its own aggregator instance, ``k``, wire and residual.
One step (a *round*) runs, for every bucket in bucket order:

1. **encode** (the caller's thread): ``acc = grad + residual`` written into the bucket's
   buffer in one pass (:mod:`tfsparse.memory`), then the aggregator's local phase --
   selection and encoding of the first messages (:meth:`Aggregator.encode
   <tfsparse.aggregators.Aggregator.encode>`);
2. **exchange** (the communication thread, :class:`~tfsparse.collectives.CommThread`):
   the aggregator's collectives, over a duplicate of the world communicator, strictly in
   bucket order; then the dense result and the new residual (what was not contributed,
   plus what the wire lost).

So while bucket ``i`` is on the wire, bucket ``i + 1`` is being selected and encoded; and
in a TensorFlow step each bucket starts as soon as back-propagation has produced its
gradients (bucket 0 holds the last layers).  :meth:`GradientExchange.start` returns a
:class:`Round` whose :meth:`~Round.wait` may come later (a round can be started in one step
and finished in the next).

**Pipelined training** (``pipeline=2``, Pipe-SGD, pipe-sgd-li2018 §3.1 and Alg. 1): a
training step calls :meth:`GradientExchange.step`, which starts this step's round and returns
the *previous* round's result -- so the communication of step ``t``'s gradient runs on the
communication thread while step ``t + 1`` computes, and the update applied at step ``t + 1``
is the aggregated gradient of step ``t`` (``w[t] = w[t-1] - lr * g[t-2]`` in the paper's
indexing, iteration dependency K = 2).  The first pipelined step applies a zero gradient
(Alg. 1 initialises ``g_sum`` of iterations ``1-K .. 0`` to zero).  A round still owed to the
next step is *pending*: :meth:`~GradientExchange.flush` finishes its communication and holds
its result, which is part of the explicit state (so a checkpoint keeps it and a resumed run
applies it); ``pipeline=1`` is the synchronous exchange.

The result is the **sum** over ranks; callers divide by P (or rely on Keras scaling the loss
by ``1/num_replicas_in_sync`` under :class:`SparseStrategy`).

State -- the residuals, every bucket aggregator's state and the round counter -- is explicit:
:meth:`~GradientExchange.get_state` / :meth:`~GradientExchange.set_state`, gathered from
every rank into Keras checkpoints by ``tfsparse.keras.callbacks.ModelCheckpoint``.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import numbers
import threading
import time
import weakref
from concurrent.futures import Future

import numpy as np

from . import _checks
from .aggregators import available_aggregators, get_aggregator
from .aggregators.dense import DenseAllreduce
from .collectives.agreement import check_agreement
from .collectives.thread import CommThread
from .memory import check_memory, get_memory
from .plan import Layout, TensorSpec, make_plan
from .schedules import check_density
from .selection import make_selection
from .space import HOST, space_for
from .wire import FLOAT32, get_wire

CHECKPOINT_PREFIX = "tfsparse."
PIPELINES = (1, 2)  # pipe-sgd-li2018 §3.1: K = 2 is optimal under limited resources, K > 2 only adds staleness
_AGREE_HINT = "Every rank must build the same model and the same SparseStrategy / DistributedOptimizer settings."


def check_clip_norm(clip_norm) -> float | None:
    """``clip_norm``: None (no clipping) or a positive finite number."""
    if clip_norm is None:
        return None
    return _checks.real("clip_norm", clip_norm, 0.0, lo_open=True, hint=(
        " or None (no clipping); DGC's local gradient clipping: each rank clips its gradient to clip_norm / sqrt(P)"))


def check_pipeline(pipeline) -> int:
    """``pipeline`` (Pipe-SGD's iteration dependency K) must be 1 (synchronous) or 2."""
    if isinstance(pipeline, bool) or not isinstance(pipeline, numbers.Integral) or int(pipeline) not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r} is not supported; accepted: 1 (synchronous) or 2 (Pipe-SGD, "
                         f"the update of step t+1 applies step t's aggregated gradient; pipe-sgd-li2018 §3.1 "
                         f"shows K > 2 only adds staleness)")
    return int(pipeline)


def validate_config(algorithm, density) -> float:
    """Checks ``algorithm`` and ``density``; raises ValueError before any communication."""
    names = available_aggregators()
    if not isinstance(algorithm, str) or algorithm not in names:
        raise ValueError(f"algorithm={algorithm!r} is not supported; accepted: "
                         f"{', '.join(repr(a) for a in names)}")
    return check_density(density)


def check_float_variables(variables) -> None:
    """Only floating-point variables can be trained through a gradient exchange."""
    import tensorflow as tf

    for v in variables:
        dtype = tf.as_dtype(getattr(v, "dtype", None))
        name = getattr(v, "path", None) or getattr(v, "name", "?")
        if not dtype.is_floating:
            raise ValueError(f"trainable variable {name!r} has dtype={dtype.name}; only "
                             f"float16/bfloat16/float32/float64 variables can be trained with tfsparse. "
                             f"Mark it trainable=False or make it a float variable.")


@functools.lru_cache(maxsize=None)
def _warm_kernels() -> None:
    """Once per process, before the first step: every Numba CPU kernel compiled, or loaded from
    its on-disk cache (< 1 s when ``tools/install.sh`` filled it; ~30 s to compile on 2 cores
    otherwise), so that no step stalls on a compile half-way."""
    from .ops import cpu

    cpu.warmup()


class ExchangeStats:
    """Counters of one exchange; CommunicationStats reads and resets them.

    ``encode_seconds`` (caller's thread: error feedback, selection, encoding),
    ``comm_seconds`` (communication thread: the collectives), ``decode_seconds``
    (communication thread: dense result and residual update) and ``wait_seconds`` (caller's
    thread: blocked until the communication thread delivered a result -- what the overlap did
    not hide) are summed over buckets.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.steps = 0
        self.bytes_sent = 0
        self.sent_elements = 0
        self.total_elements = 0
        self.seconds = 0.0
        self.encode_seconds = 0.0
        self.comm_seconds = 0.0
        self.decode_seconds = 0.0
        self.wait_seconds = 0.0
        self.skipped_buckets = 0

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0

    @property
    def density(self) -> float:
        return self.sent_elements / self.total_elements if self.total_elements else 0.0


class _Inline:
    """Runs jobs at once on the calling thread (a world of one rank has nothing to overlap)."""

    def submit(self, fn, *args):
        future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)
        return future

    def run(self, fn, *args):
        return fn(*args)

    def close(self):
        pass


class _BucketState:
    """A bucket at run time: its plan entry, aggregator, wire, memory and buffers."""

    def __init__(self, spec, aggregator, wire, density, memory, space):
        self.spec = spec
        self.aggregator = aggregator
        self.dense = None  # the bucket's DenseAllreduce, for dense steps of a sparse algorithm
        self.wire = wire
        self.density = density  # None: the exchange's
        self.memory = memory
        self.residual = space.zeros(spec.size) if memory.stateful else None
        self.acc = space.empty(spec.size)
        self.rounds = 0          # rounds started
        self.futures: dict = {}  # round index -> future of the communication job
        # pipelining: what a started round's step returns instead of its own result, as
        # (array, pipelined); the round whose result the next step takes (in flight); or its
        # result, already finished (held)
        self.owed: dict = {}
        self.next_owed: int | None = None
        self.held: np.ndarray | None = None


class _Outcome:
    __slots__ = ("dense", "bytes", "sent", "comm_s", "decode_s", "skipped")

    def __init__(self, dense, nbytes, sent, comm_s, decode_s, skipped=False):
        self.dense, self.bytes, self.sent, self.comm_s, self.decode_s = dense, nbytes, sent, comm_s, decode_s
        self.skipped = skipped


def _in_space(method):
    """An exchange method run with the exchange's space active (its GPU current in the calling
    thread, :meth:`tfsparse.space.CudaSpace.active`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.space.active():
            return method(self, *args, **kwargs)

    return run


class Round:
    """One step of an exchange, started by :meth:`GradientExchange.start`."""

    def __init__(self, exchange, index: int, flat: bool):
        self._exchange = exchange
        self.index = index
        self._flat = flat
        self._result = None

    def wait(self):
        """The summed gradients, shaped like the input of :meth:`GradientExchange.start` (a
        flat array, or a list of arrays in layout order).  Blocks until the round is done."""
        if self._result is None:
            ex = self._exchange
            with ex.space.active():
                self._result = ex._assemble({b.spec.index: ex._finish_bucket(b, self.index) for b in ex._buckets},
                                            self._flat)
        return self._result


class GradientExchange:
    """Error feedback + sparse allreduce over a typed wire, bucket by bucket, for one model.

    Args:
      algorithm: registered aggregator name (``tfsparse.aggregators.available_aggregators()``).
      density: fraction of elements each rank sends, in (0, 1]; a bucket of ``n`` elements
        sends ``k = ceil(density * n)``.  Mutable (``exchange.density = ...``), e.g. by
        ``DensitySchedule``.
      wire_dtype: how values travel: ``"float32"`` (default), ``"float16"``, ``"bfloat16"``
        (16-bit truncation) or ``"int8"`` (per-chunk max-scaled); see :mod:`tfsparse.wire`.
        A lossy wire keeps what it lost in the residual (dense included).
      bucket_bytes: ``None`` (default): one fused bucket; a number θ of bytes: GradientFlow's
        lazy allreduce, tensors packed into buckets of at least θ bytes; ``0``: one bucket per
        tensor.  See :mod:`tfsparse.plan`.
      plan: ``"fused"``, ``"buckets"``, ``"per_tensor"`` or a :class:`tfsparse.plan.Plan`.
      memory: ``"residual"`` (default): error feedback; ``"momentum"``: momentum correction
        with momentum factor masking (DGC §3.2, gradientflow-sun2019 Alg. 1) -- the optimizer
        then runs without momentum; ``"none"``: no error feedback (what is not delivered is
        dropped; Pipe-SGD's compression as published).  See :mod:`tfsparse.memory`.
      momentum: the momentum factor of ``memory="momentum"`` (default 0.9).
      pipeline: Pipe-SGD's iteration dependency K: ``1`` (default) synchronous; ``2``
        pipelined -- :meth:`step` returns the previous round's result while this round's
        communication overlaps the next step's compute (pipe-sgd-li2018 §3.1, Alg. 1).
      selection: ``None`` (default: every tensor takes ``algorithm``), ``"cost_model"``
        (DRAGONN's efficiency-aware tensor selection, dragonn-wang2022 §4.2 Eq. 1: α, β and the
        compression cost measured at the first step; a tensor is compressed only where that
        saves time, the others go dense) or a :class:`tfsparse.selection.CostModel` (stated
        numbers).  Plans the buckets itself (no ``plan``/``bucket_bytes``).
      clip_norm: DGC's local gradient clipping (Lin et al. 2018 §3.3): each rank clips its
        gradient (all tensors together) to the L2 norm ``clip_norm / sqrt(P)`` before it enters
        the memory.  Default None (no clipping).  The norm needs every gradient, so the first
        bucket starts only once back-propagation has finished.
      communicator: a :class:`~tfsparse.collectives.Communicator`; default: the world's.
      **algorithm_options: passed to every bucket's aggregator (validated here).

    A step whose density is 1 (a dense warm-up step, :class:`tfsparse.schedules.WarmUp`) runs
    a true dense allreduce (:class:`~tfsparse.aggregators.dense.DenseAllreduce`), not the sparse
    algorithm at ``k = n``; it flushes the residual.  :attr:`schedule` (``round -> density``)
    sets the density of every round.  While :attr:`dsync` is True, rounds run as Pipe-SGD's
    D-Sync warm-up (pipe-sgd-li2018 §4): synchronous, over a float32 wire, whatever
    ``pipeline`` and ``wire_dtype`` say.

    Every argument is validated here, before any communication.
    """

    def __init__(self, algorithm: str = "topk", density: float = 0.01, *, wire_dtype: str = "float32",
                 bucket_bytes: int | None = None, plan=None, memory: str = "residual",
                 momentum: float | None = None, pipeline: int = 1, selection=None, clip_norm: float | None = None,
                 communicator=None, **algorithm_options):
        self._density = validate_config(algorithm, density)
        self.pipeline = check_pipeline(pipeline)
        self.dsync = False  # D-Sync warm-up: synchronous float32 rounds (tfsparse.keras.callbacks.DSyncWarmUp)
        self.sync_points: tuple | None = None  # (first round, steps): a pipelined round that ends an epoch is waited for
        self._pipelined = False  # the mode of the round being started
        self.algorithm = algorithm
        self.options = dict(algorithm_options)
        self._prototype = get_aggregator(algorithm, **self.options)  # validates the options
        self.memory = memory
        self.memory_options = check_memory(memory, momentum)
        self.schedule = None  # callable round -> density, or None (the density as set)
        self._next_round = 0  # the round the next start of bucket 0 begins
        self.wire = get_wire(wire_dtype)
        self.selection = selection
        chosen = make_selection(selection, algorithm)
        if chosen is not None and (plan is not None or bucket_bytes is not None):
            raise ValueError(f"selection={selection!r} plans the buckets itself (one per compressed tensor); it "
                             f"cannot be combined with plan={plan!r} or bucket_bytes={bucket_bytes!r}")
        self.plan = chosen if chosen is not None else make_plan(plan, bucket_bytes)
        self.clip_norm = check_clip_norm(clip_norm)
        self._comm = communicator
        self._xcomm = None
        self._side = None  # pipelined: the communicator of run_collective (the caller's thread)
        self._runner = None
        self.layout: Layout | None = None
        self._buckets: list[_BucketState] = []
        self._round = 0  # rounds completed
        self._pending_state: dict | None = None
        self._gathered: tuple | None = None  # (round, every rank's state) from gather_state, on rank 0
        self._stats_lock = threading.Lock()
        self._round_t0: dict = {}
        self._failed: BaseException | None = None
        self.owner = None  # "optimizer" when a tfsparse.keras.DistributedOptimizer holds it
        # a round whose gradient is not finite on some rank is skipped on every rank; it returns
        # zeros ("zeros", with a warning), or NaN ("nan": set when Keras' LossScaleOptimizer decides
        # on the exchanged gradient, so that every rank skips the step and halves its loss scale)
        self.nonfinite_result = "zeros"
        self.stats = ExchangeStats()
        self.total = ExchangeStats()  # never reset: whole-run totals
        self.space = HOST  # where the buckets' vectors live: set by the first gradient (tfsparse.space)

    # -- configuration ----------------------------------------------------
    @property
    def comm(self):
        """The world communicator.  The exchange's own traffic goes over a duplicate of it and
        is counted in :attr:`stats` / :attr:`total` (the rounds' bytes)."""
        if self._comm is None:
            from . import runtime

            self._comm = runtime.communicator()
        return self._comm

    @property
    def density(self) -> float:
        return self._density

    @density.setter
    def density(self, value) -> None:
        self._density = check_density(value)

    @property
    def rounds_started(self) -> int:
        """Rounds begun since the start of training (restored with the state): the step that
        :attr:`schedule` is asked about next."""
        return self._next_round

    @property
    def wire_dtype(self) -> str:
        return self.wire.name

    @property
    def momentum(self) -> float | None:
        """The momentum factor applied by ``memory="momentum"`` (None for other memories)."""
        return self.memory_options.get("momentum")

    def check_optimizer(self, optimizer) -> None:
        """``memory="momentum"`` applies the momentum here (momentum correction): an optimizer
        (or a wrapped ``inner_optimizer``) with ``momentum`` or ``beta_1`` > 0 would apply it
        twice -- ValueError, raised before any step."""
        if self.memory != "momentum":
            return
        opt = optimizer
        while opt is not None:
            for attr in ("momentum", "beta_1"):
                value = getattr(opt, attr, None)
                if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0:
                    name = type(opt).__name__
                    raise ValueError(
                        f"memory='momentum' applies momentum {self.momentum} in the gradient exchange (momentum "
                        f"correction), and the optimizer {name} has {attr}={value}: momentum would be applied "
                        f"twice; use {name}({attr}=0.0) (e.g. keras.optimizers.SGD(learning_rate)), or "
                        f"memory='residual' to keep the optimizer's momentum")
            opt = getattr(opt, "inner_optimizer", None)

    @property
    def uses_memory(self) -> bool:
        """Whether the exchange keeps a residual (a sparse algorithm, a lossy wire, or momentum
        correction)."""
        if self._buckets:
            return any(b.residual is not None for b in self._buckets)
        if self.memory == "none":
            return False
        return self._prototype.uses_memory or self.wire.lossy or self.memory != "residual"

    @property
    def buckets(self):
        """The plan's buckets (after :meth:`build`)."""
        return [b.spec for b in self._buckets]

    @property
    def aggregators(self):
        """Every bucket's aggregator instance, in bucket order (after :meth:`build`)."""
        return [b.aggregator for b in self._buckets]

    def config(self) -> dict:
        """Every setting, as plain values (for configs and cross-rank comparison)."""
        return {"algorithm": self.algorithm, "density": self.density, "wire_dtype": self.wire.name,
                **self.plan.config(), "memory": self.memory, **self.memory_options, "pipeline": self.pipeline,
                "clip_norm": self.clip_norm, **self.options}

    def k_for(self, n: int, density: float | None = None, aggregator=None) -> int:
        """The ``k`` of a bucket of ``n`` elements (``n`` for dense)."""
        if not (aggregator or self._prototype).uses_memory:
            return int(n)
        d = self.density if density is None else density
        return int(min(n, max(1, math.ceil(d * n))))

    # -- building ---------------------------------------------------------
    def build(self, layout: Layout, space=None) -> None:
        """Plans the buckets for ``layout`` (the first time; later calls check the layout).
        ``space``: where the buckets' vectors live (:mod:`tfsparse.space`; default the host).

        The first call checks that every rank has the same settings, transport and gradient
        layout (:func:`~tfsparse.collectives.agreement.check_agreement`: the same
        ``ConfigurationMismatch`` on every rank otherwise) and duplicates the world communicator
        for the communication thread: collectives, reached by every rank at the same point (the
        first step)."""
        if self.layout is not None:
            if not layout.same_shapes(self.layout):
                raise ValueError(f"this exchange was built for gradients {self.layout.describe()} but got "
                                 f"{layout.describe()}; every model needs its own exchange (its own "
                                 f"SparseStrategy or DistributedOptimizer)")
            return
        self.space = space if space is not None else HOST
        with self.space.active():  # the vectors are allocated on the space's device
            self._build(layout)

    def _build(self, layout: Layout) -> None:
        comm = self.comm
        if self.plan.prepares:  # collectives of its own: only once every rank is known to agree
            _warm_kernels()
            check_agreement(comm, "the gradient exchange", self._agreement(layout, []), _AGREE_HINT)
            self.plan.prepare(comm, self)
        buckets = []
        for spec in self.plan.buckets(layout):
            algorithm = spec.algorithm or self.algorithm
            options = copy.deepcopy({**(self.options if algorithm == self.algorithm else {}), **spec.options})
            density = None if spec.density is None else check_density(spec.density, f"density of bucket {spec.index}")
            aggregator, wire = get_aggregator(algorithm, **options), get_wire(spec.wire_dtype or self.wire.name)
            memory = get_memory(self.memory, spec.size, self.memory_options, aggregator.uses_memory or wire.lossy,
                                self.space)
            buckets.append(_BucketState(spec, aggregator, wire, density, memory, self.space))
        _warm_kernels()
        check_agreement(comm, "the gradient exchange", self._agreement(layout, buckets), _AGREE_HINT)
        self._xcomm = comm.duplicate() if comm.size > 1 else comm
        # a thread of its own only where the transport allows calls from several threads
        # (MPI_THREAD_MULTIPLE); otherwise the collectives run inline, without overlap
        self._runner = CommThread() if comm.size > 1 and comm.thread_safe else _Inline()
        # pipelined, the caller's own collectives (metric averaging) must not queue behind the round
        # in flight: they get a communicator of their own, used from the caller's thread -- where the
        # transport allows two collectives in flight at once (not Horovod's: there they queue)
        pipelined = self.pipeline > 1 and isinstance(self._runner, CommThread)
        self._side = comm.duplicate() if pipelined and comm.concurrent_collectives else None
        weakref.finalize(self, self._runner.close)
        self.layout = layout
        self._buckets = buckets
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.set_state(state)

    def _agreement(self, layout: Layout, buckets) -> dict:
        """What every rank must share, compared at the first exchange (one 32-byte allgather):
        the settings, the transport, the gradient layout (shapes and dtypes in order -- not the
        names: Keras numbers layers per process, so a rank that built one more model has other
        names for the same layers) and the planned buckets."""
        config = {k: v for k, v in self.config().items() if k != "assign"}  # a function: compared by its buckets
        return {"settings": config, "transport": type(self.comm).__name__,
                "gradients": [[list(s.shape), s.dtype] for s in layout.specs],
                "buckets": [{"elements": [b.spec.start, b.spec.stop], "algorithm": type(b.aggregator).__name__,
                             "density": b.density, "wire": b.wire.name} for b in buckets]}

    def close(self) -> None:
        """Stops the communication thread (after the jobs already submitted)."""
        if self._runner is not None:
            self._runner.close()

    @property
    def pending(self) -> bool:
        """Whether a pipelined round's result is owed to the next step (in flight or held)."""
        return any(b.held is not None or b.next_owed is not None for b in self._buckets)

    @_in_space
    def flush(self) -> None:
        """Finishes the communication of the pipelined round owed to the next step and holds its
        result (the next :meth:`step` applies it; :meth:`get_state` saves it).  Call it on every
        rank at the same point; it waits for the communication thread, nothing else."""
        for b in self._buckets:
            self._hold_owed(b)

    def _hold_owed(self, b: _BucketState) -> None:
        if b.next_owed is not None:
            index, b.next_owed = b.next_owed, None
            b.held = self._finish_bucket(b, index)

    # -- numpy level ------------------------------------------------------
    def exchange_numpy(self, grads):
        """One round on numpy data: ``grads`` is one flat array or a list of arrays; returns
        the summed gradients in the same form.  The residuals stay in the exchange.

        **Device arrays** (CuPy, Numba, PyTorch CUDA tensors: anything with
        ``__cuda_array_interface__``): when the first round's gradients live on a CUDA device,
        the exchange keeps its vectors there (:class:`tfsparse.space.CudaSpace`) -- error
        feedback, the finite check and the residual on the device, the selection too for the
        algorithms that select there (``topk``, ``gtopk``, ``dragonn``; the others are handed a
        host copy of the bucket), only the payload crosses to the host for the transport, and
        the result is decoded on the device and returned as Numba device arrays (float32).  Every
        later round's input is taken to where the first one lived."""
        return self.start(grads).wait()

    def start(self, grads) -> Round:
        """Starts a round: every bucket is encoded here and handed to the communication
        thread; :meth:`Round.wait` returns the result."""
        with self._space_of(grads).active():
            flat, arrays = self._arrays(grads)
            index = None
            for b in self._buckets:
                index = self._start_bucket(b, arrays[b.spec.first:b.spec.last])
        return Round(self, index, flat)

    def step(self, grads):
        """One training step's exchange, honouring ``pipeline``: starts this step's round and
        returns the gradient to apply now -- this round's result (``pipeline=1``), or the
        previous round's (``pipeline=2``; zeros when there is none, e.g. at the first step),
        in the form of ``grads`` (one flat array or a list of arrays)."""
        with self._space_of(grads).active():
            flat, arrays = self._arrays(grads)
            tokens = [self._begin(b, arrays[b.spec.first:b.spec.last]) for b in self._buckets]
            return self._assemble({b.spec.index: self._finish(b, t) for b, t in zip(self._buckets, tokens)}, flat)

    def _space_of(self, grads):
        """The exchange's space once built; before, the space where ``grads`` live."""
        if self.layout is not None:
            return self.space
        return space_for(grads if not isinstance(grads, (list, tuple)) else (grads[0] if grads else None))

    def _arrays(self, grads) -> tuple[bool, list]:
        """``(flat, arrays)`` for numpy or device input (one flat array, or a list of arrays);
        builds the plan the first time (in the space where the gradients live), and afterwards
        checks the shapes."""
        single = not isinstance(grads, (list, tuple))
        space = self._space_of(grads)
        # one array is flat (a 2-D numpy array: a list of rows, as always); a list: one per tensor
        flat = single and not (isinstance(grads, np.ndarray) and grads.ndim > 1)
        arrays = [space.accept(grads).reshape(-1)] if flat else [space.accept(g) for g in grads]
        self.build(Layout.of(arrays), space)
        if self.clip_norm is not None:
            arrays = space.clip_by_global_norm(arrays, self.local_clip_norm)
        return flat, arrays

    @property
    def local_clip_norm(self) -> float | None:
        """The norm each rank clips its gradient to: ``clip_norm / sqrt(P)`` (DGC §3.3: "scale the
        threshold by N^{-1/2}", so that the sum over P ranks is clipped to ``clip_norm``)."""
        return None if self.clip_norm is None else self.clip_norm / math.sqrt(self.comm.size)

    def _assemble(self, dense: dict, flat: bool):
        """Bucket results (``{bucket index: flat array}``) as one flat array or per tensor."""
        if flat:
            return self.space.concat([dense[b.spec.index] for b in sorted(self._buckets, key=lambda b: b.spec.start)])
        out = [None] * len(self.layout)
        for b in self._buckets:
            offs = self.layout.offsets[b.spec.first:b.spec.last + 1] - b.spec.start
            for i, (lo, hi) in enumerate(zip(offs[:-1], offs[1:]), start=b.spec.first):
                out[i] = dense[b.spec.index][lo:hi].reshape(self.layout.specs[i].shape)
        return out

    def _take(self, b: _BucketState) -> np.ndarray:
        """What the bucket owes the step being started: the previous round's result (waiting for
        its communication), or zeros when nothing is owed."""
        self._hold_owed(b)
        out, b.held = b.held, None
        return self.space.zeros(b.spec.size) if out is None else out

    def _begin(self, b: _BucketState, arrays) -> int:
        """Starts the bucket's next round in the round's mode (decided at bucket 0); returns its
        index, for :meth:`_finish`."""
        if b.spec.index == 0:
            self._pipelined = self.pipeline > 1 and not self.dsync
        carry = None
        if self._pipelined or b.next_owed is not None or b.held is not None:
            # pipelined: the previous round's result (the residual the new round starts from is
            # then complete, too); synchronous after pipelined rounds: added to this round's,
            # so that no gradient is lost
            carry = self._take(b)
        index = self._start_bucket(b, arrays)
        if carry is not None:
            b.owed[index] = (carry, self._pipelined)
        return index

    def _finish(self, b: _BucketState, index: int) -> np.ndarray:
        """The gradient the step of round ``index`` applies (see :meth:`step`)."""
        carry, pipelined = b.owed.pop(index, (None, False))
        if not pipelined:
            out = self._finish_bucket(b, index)
            return out if carry is None else self.space.plus(out, carry)
        first, steps = self.sync_points or (0, 0)
        if steps and index >= first and (index - first + 1) % steps == 0:
            b.held = self._finish_bucket(b, index)  # an epoch's last step: nothing stays in flight
        else:
            b.next_owed = index
        return carry

    def _start_bucket(self, b: _BucketState, arrays) -> int:
        if self._failed is not None:
            raise RuntimeError(f"this exchange failed in an earlier round ({type(self._failed).__name__}: "
                               f"{self._failed}); the ranks are out of step, restart training") from self._failed
        if b.futures:
            raise RuntimeError(f"bucket {b.spec.index} of the exchange was started again before its round "
                               f"{min(b.futures)} finished; wait() for a round before starting the next")
        index = b.rounds
        if b.spec.index and self._buckets[b.spec.index - 1].rounds != index + 1:
            # collectives must run in the same order on every rank: bucket order, always
            raise RuntimeError(f"bucket {b.spec.index} was started before bucket {b.spec.index - 1} of the same "
                               f"round; buckets start in bucket order")
        t0 = time.perf_counter()
        if b.spec.index == 0:
            self._round_t0[index] = t0
            if self.schedule is not None:
                self._density = check_density(self.schedule(self._next_round), f"schedule({self._next_round})")
            self._next_round += 1
        off = 0
        for a in arrays:
            n = int(np.size(a))
            b.memory.compensate(a, None if b.residual is None else b.residual[off:off + n], b.acc[off:off + n],
                                slice(off, off + n))
            off += n
        density = self.density if b.density is None else b.density
        aggregator = b.aggregator
        if density >= 1.0 and aggregator.uses_memory:  # a dense step: a true dense allreduce
            if b.dense is None:
                b.dense = DenseAllreduce()
            aggregator = b.dense
        k = self.k_for(b.spec.size, density, aggregator)
        wire = FLOAT32 if self.dsync else b.wire
        space = self.space
        finite = space.all_finite(b.acc)
        if not finite:  # the round is dropped on every rank; encode something harmless meanwhile
            space.zero_nonfinite(b.acc)
        # on a device: aggregators that select there take the device vector, the others a host copy
        acc = b.acc if aggregator.accepts_device or not space.on_device else space.to_host(b.acc)
        payload = (aggregator, aggregator.encode(self._xcomm, acc, k, wire), finite, index)
        dt = time.perf_counter() - t0
        with self._stats_lock:
            for s in (self.stats, self.total):
                s.encode_seconds += dt
        b.rounds += 1
        b.futures[index] = self._runner.submit(self._run_bucket, b, payload)
        return index

    @_in_space
    def _run_bucket(self, b: _BucketState, payload) -> _Outcome:
        """The communication thread's job for one bucket."""
        t0 = time.perf_counter()
        aggregator, payload, finite, index = payload
        bad = self._nonfinite_ranks(finite)
        if bad:
            return self._skip_bucket(b, index, bad, time.perf_counter() - t0)
        before = self._xcomm.bytes_sent
        result = aggregator.exchange(self._xcomm, payload)
        t1 = time.perf_counter()
        dense = self.space.decode(result, b.spec.size)
        if b.residual is not None:
            new = b.memory.update(b.acc, result)
            b.acc, b.residual = b.residual, new
        return _Outcome(dense, self._xcomm.bytes_sent - before, result.sent_elements, t1 - t0,
                        time.perf_counter() - t1)

    def _nonfinite_ranks(self, finite: bool) -> list[int]:
        """The ranks whose input to this bucket (gradient + residual) is not finite: the flag
        travels first in every bucket's job (one allgather of an int32 per rank, on the
        communication thread, so all ranks decide together; counted by the communicator, not in
        the exchange's ``bytes_sent``)."""
        if self._xcomm.size == 1:
            return [] if finite else [0]
        flags = self._xcomm.allgather(np.array([0 if finite else 1], np.int32))
        return [r for r, f in enumerate(flags) if f[0]]

    def _skip_bucket(self, b: _BucketState, index: int, ranks: list[int], seconds: float) -> _Outcome:
        """A bucket whose input is not finite on some rank: no rank exchanges it, every residual
        stays as it was before the round (it never takes NaN/Inf), and every rank gets the same
        result -- zeros, or NaN when a loss-scaling optimizer decides on the step
        (:attr:`nonfinite_result`), so that every rank skips the step and lowers its loss scale."""
        import warnings

        if self.nonfinite_result == "zeros":
            warnings.warn(f"tfsparse: the gradient of round {index} is not finite (NaN/Inf) on rank(s) {ranks}; "
                          f"bucket {b.spec.index} is skipped on every rank (a zero gradient), residuals unchanged",
                          RuntimeWarning, stacklevel=2)
        b.memory.drop_nonfinite()
        fill = np.nan if self.nonfinite_result == "nan" else 0.0
        return _Outcome(self.space.full(b.spec.size, fill), 0, 0, seconds, 0.0, skipped=True)

    def _finish_bucket(self, b: _BucketState, index: int) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            out = b.futures[index].result()
        except BaseException as e:
            self._failed = e
            raise
        waited = time.perf_counter() - t0
        del b.futures[index]
        last = b.spec.index == len(self._buckets) - 1
        with self._stats_lock:
            t0 = self._round_t0.pop(index, None) if last else None
            for s in (self.stats, self.total):
                s.bytes_sent += out.bytes
                s.sent_elements += out.sent
                s.total_elements += b.spec.size
                s.comm_seconds += out.comm_s
                s.decode_seconds += out.decode_s
                s.wait_seconds += waited
                s.skipped_buckets += int(out.skipped)
                if last:
                    s.steps += 1
                    if t0 is not None:
                        s.seconds += time.perf_counter() - t0
            if last:
                self._round += 1
        return out.dense

    def run_collective(self, fn):
        """Runs ``fn(comm)`` on the communication thread, after the buckets already started,
        over the exchange's communicator, and returns its result (e.g. the per-step metric
        averaging, so that it never interleaves with the gradient collectives).  Pipelined
        (``pipeline=2``) over a transport that allows concurrent collectives, ``fn`` runs at once
        on the caller's thread over a communicator of its own, so that it does not wait for the
        round in flight."""
        if self._runner is None:
            return fn(self.comm)
        if self._side is not None:
            return fn(self._side)
        return self._runner.run(fn, self._xcomm)

    # -- explicit state ---------------------------------------------------
    @property
    def residual(self) -> np.ndarray | None:
        """This rank's residual over the whole layout (a copy; zeros where no memory is kept),
        None when none is kept (or none exists yet)."""
        if not self._buckets:
            pending = (self._pending_state or {}).get("residual")
            return None if pending is None else np.array(pending, np.float32).reshape(-1)
        return self._over_layout(lambda b: b.residual) if self.uses_memory else None

    def _over_layout(self, part) -> np.ndarray:
        """``part(bucket)`` of every bucket placed over the whole layout (zeros where it is None)."""
        out = np.zeros(self.layout.n, np.float32)
        for b in self._buckets:
            value = part(b)
            if value is not None:
                out[b.spec.start:b.spec.stop] = self.space.to_host(value)
        return out

    def _memory_state(self) -> dict:
        """The memories' state (e.g. the momentum ``velocity``), each key over the whole layout
        (zeros in buckets whose memory keeps none)."""
        out: dict = {}
        for b in self._buckets:
            for key, value in b.memory.get_state().items():
                full = out.setdefault(key, np.zeros(self.layout.n, np.float32))
                full[b.spec.start:b.spec.stop] = value
        return out

    def _check_idle(self, what: str) -> None:
        busy = sorted(b.spec.index for b in self._buckets if b.futures)
        if busy:
            raise RuntimeError(f"{what} while a round is in flight (buckets {busy}); wait() for it first: the "
                               f"state must not mix two rounds")

    @_in_space
    def get_state(self) -> dict:
        """``{name: numpy array}``: ``round`` (rounds done), ``sizes`` (the layout), ``buckets``
        (the plan's element ranges), ``residual`` (when kept), the memory's state over the layout
        (``velocity`` for ``memory="momentum"``), ``pending`` (pipelined: the finished result the
        next step applies, over the layout) and ``bucket<i>.<key>`` for every bucket aggregator's
        state.  A pipelined round owed to the next step is finished first (:meth:`flush`); not
        while a synchronous round is in flight."""
        if not self._buckets:
            return dict(self._pending_state or {})
        self.flush()
        self._check_idle("get_state()")
        state = {"round": np.array([self._round], np.int64), "sizes": self.layout.sizes.copy(),
                 "buckets": np.array([[b.spec.start, b.spec.stop] for b in self._buckets], np.int64)}
        residual = self.residual
        if residual is not None:
            state["residual"] = residual
        state.update(self._memory_state())
        if any(b.held is not None for b in self._buckets):
            state["pending"] = self._over_layout(lambda b: b.held)
        for b in self._buckets:
            for key, value in b.aggregator.get_state().items():
                state[f"bucket{b.spec.index}.{key}"] = np.asarray(value).copy()
        return state

    @_in_space
    def set_state(self, state: dict) -> None:
        """Restores :meth:`get_state`'s output (before :meth:`build`, it is applied at build)."""
        state = {k: np.asarray(v) for k, v in state.items()}
        if not self._buckets:
            self._pending_state = state
            return
        self.flush()
        self._check_idle("set_state()")
        sizes = state.get("sizes")
        if sizes is not None and not np.array_equal(np.asarray(sizes, np.int64).reshape(-1), self.layout.sizes):
            raise ValueError(f"the saved exchange state belongs to gradients of sizes {np.asarray(sizes).tolist()}, "
                             f"this model's are {self.layout.sizes.tolist()}")
        buckets = state.get("buckets")
        mine = [[b.spec.start, b.spec.stop] for b in self._buckets]
        if buckets is not None and np.asarray(buckets).reshape(-1, 2).tolist() != mine:
            raise ValueError(f"the saved exchange state belongs to buckets {np.asarray(buckets).tolist()}, this "
                             f"exchange's plan ({self.plan!r}) makes {mine}; use the plan it was saved with")
        if "round" in state:
            self._round = self._next_round = int(state["round"].reshape(-1)[0])
        residual, pending = state.get("residual"), state.get("pending")
        for b in self._buckets:
            b.held = None if pending is None else self.space.from_host(pending.reshape(-1)[b.spec.start:b.spec.stop])
            if b.residual is not None:
                self.space.load(b.residual, None if residual is None else residual.reshape(-1)[b.spec.start:b.spec.stop])
            b.memory.set_state({key: state[key].reshape(-1)[b.spec.start:b.spec.stop]
                                for key in b.memory.get_state() if key in state})
            prefix = f"bucket{b.spec.index}."
            b.aggregator.set_state({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    def gather_state(self) -> dict:
        """Collective: every rank's :meth:`get_state`, stacked along a new first axis (rank
        order).  Rank 0 keeps it for its next checkpoint (:meth:`checkpoint_entries`)."""
        state = self.get_state()
        keys = sorted(state)
        mine = np.concatenate([np.ascontiguousarray(state[k]).reshape(-1).view(np.uint8) for k in keys]) \
            if keys else np.empty(0, np.uint8)
        self._check_idle("gather_state()")
        parts = self.run_collective(lambda c: c.allgather(mine))
        if any(p.size != mine.size for p in parts):
            raise RuntimeError(f"ranks hold exchange states of different sizes ({[p.size for p in parts]} bytes)")
        stacked, off = {}, 0
        for k in keys:
            v = np.ascontiguousarray(state[k])
            nb = v.nbytes
            stacked[k] = np.stack([p[off:off + nb].view(v.dtype).reshape(v.shape) for p in parts])
            off += nb
        if self.comm.rank == 0:
            self._gathered = (self._round, stacked)
        return stacked

    def checkpoint_entries(self) -> dict:
        """What a Keras checkpoint stores: the states gathered from every rank (when
        :meth:`gather_state` ran since the last round), else this rank's own; ``tfsparse.ranks``
        says whose rows these are."""
        gathered, self._gathered = self._gathered, None
        if gathered is not None and gathered[0] == self._round:
            rows = gathered[1]
            ranks = np.arange(self.comm.size, dtype=np.int64)
        elif not self._buckets and not self._pending_state:
            return {}  # never used: nothing to save
        else:
            rows = {k: v[None] for k, v in self.get_state().items()}
            ranks = np.array([self.comm.rank], np.int64)
        entries = {CHECKPOINT_PREFIX + k: v for k, v in rows.items()}
        entries[CHECKPOINT_PREFIX + "ranks"] = ranks
        return entries

    def restore_checkpoint(self, entries) -> bool:
        """Restores :meth:`checkpoint_entries` (a mapping, e.g. a Keras weights store); returns
        whether there was anything to restore.  Each rank takes its own row.  A file without
        every rank's row (another number of ranks, or saved without
        ``tfsparse.keras.callbacks.ModelCheckpoint``'s gather): the saved residuals are summed and
        spread evenly over the ranks (the pending update they hold is kept) and every rank takes
        the first row's aggregator state (so that all ranks keep one schedule); a warning says so."""
        keys = [k for k in entries.keys() if k.startswith(CHECKPOINT_PREFIX)]
        if CHECKPOINT_PREFIX + "ranks" not in keys:
            return False
        ranks = np.asarray(entries[CHECKPOINT_PREFIX + "ranks"]).reshape(-1).tolist()
        rows = {k[len(CHECKPOINT_PREFIX):]: np.asarray(entries[k]) for k in keys if k != CHECKPOINT_PREFIX + "ranks"}
        size, rank = self.comm.size, self.comm.rank
        if ranks == list(range(size)):
            state = {k: v[rank] for k, v in rows.items()}
        else:
            import warnings

            warnings.warn(f"the checkpoint holds the exchange state of ranks {ranks}, this job has {size} ranks: "
                          f"the saved residuals are spread evenly and rank {ranks[0]}'s aggregator state is used on "
                          f"every rank (save with tfsparse.keras.callbacks.ModelCheckpoint to keep every rank's)",
                          RuntimeWarning, stacklevel=2)
            state = {k: v[0] for k, v in rows.items()}
            if "residual" in rows:
                state["residual"] = (rows["residual"].astype(np.float64).sum(axis=0) / size).astype(np.float32)
        self.set_state(state)
        return True

    # -- TensorFlow glue --------------------------------------------------
    def __call__(self, grads, names=None):
        """Exchanges a list of gradient tensors inside a TF graph; returns the summed tensors.

        Per bucket, one op starts the bucket (error feedback, selection, encoding; then the
        communication thread takes over) as soon as its gradients exist, and one finishes it
        (waits for the result).  Like :meth:`step`, it honours ``pipeline``: pipelined, the
        tensors returned are the previous round's.  ``names``: the gradients' names (the
        variables' paths; default ``gradient_<i>``).

        Where the gradients live picks the path (:func:`tfsparse.ops.tf.exchange_device`):

        * on the host -- ``tf.numpy_function`` ops; TF hands over its host buffers;
        * on a GPU (TensorFlow sees one and ``numba.cuda`` works: the ``"cuda"`` path of
          :mod:`tfsparse.ops.tf`) -- ``tf.py_function`` ops placed on that GPU.  The fused
          gradient never leaves it: the ops view TF's device buffers through DLPack, the
          exchange's vectors live there (:class:`tfsparse.space.CudaSpace` of that GPU), the
          algorithms that select on the device do (``topk``, ``gtopk``, ``dragonn``), only the
          payload is copied to the host for the transport, and the result is decoded on the
          device and copied device-to-device into a tensor TF allocates (gtopk-ssgd-shi2019
          §III-F, dragonn-wang2022 §4.3).  The path is fixed when the exchange is built."""
        import tensorflow as tf

        from ._tf_private import reject_xla
        from .ops import tf as ops_tf
        from .space import cuda_space

        reject_xla("the gradient exchange")
        grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
        if not grads:
            return []
        for g in grads:
            if not g.shape.is_fully_defined():
                raise ValueError(f"gradient of shape {g.shape} is not fully defined; tfsparse needs static "
                                 f"variable shapes")
        names = list(names) if names is not None else [f"gradient_{i}" for i in range(len(grads))]
        device = ops_tf.exchange_device(grads)
        with tf.init_scope():  # the first build's collectives run now, eagerly (Horovod's need it)
            space = None if device is None or self.layout is not None else cuda_space(ops_tf.device_ordinal(device))
            self.build(Layout(TensorSpec(str(nm), tuple(g.shape.as_list()), g.dtype.name)
                              for nm, g in zip(names, grads)), space)
        as_f32 = [g if g.dtype == tf.float32 else tf.cast(g, tf.float32) for g in grads]
        if self.clip_norm is not None:  # DGC's local clipping, over all of this rank's gradients
            as_f32 = tf.clip_by_global_norm(as_f32, self.local_clip_norm)[0]
        if self.space.on_device:
            as_f32 = [tf.reshape(g, [-1]) for g in as_f32]  # flat views (the kernels take 1-D arrays)

            def op(fn, inputs, dtype, name):
                with tf.device(device) if device else contextlib.nullcontext():
                    return tf.py_function(fn, inputs, dtype, name=name)
            start, finish = self._tf_start_device, self._tf_finish_device
        else:
            def op(fn, inputs, dtype, name):
                return tf.numpy_function(fn, inputs, dtype, stateful=True, name=name)
            start, finish = self._tf_start, self._tf_finish
        tokens = [op(functools.partial(start, b.spec.index), as_f32[b.spec.first:b.spec.last], tf.int64,
                     f"tfsparse_start_{b.spec.index}") for b in self._buckets]
        out = [None] * len(grads)
        for b, token in zip(self._buckets, tokens):
            summed = op(functools.partial(finish, b.spec.index), [token], tf.float32, f"tfsparse_finish_{b.spec.index}")
            summed.set_shape([b.spec.size])
            sizes = [int(s) for s in self.layout.sizes[b.spec.first:b.spec.last]]
            parts = tf.split(summed, sizes) if len(sizes) > 1 else [summed]
            for i, part in zip(range(b.spec.first, b.spec.last), parts):
                out[i] = tf.cast(tf.reshape(part, grads[i].shape), grads[i].dtype)
        return out

    def loss_scaled(self, grads, scale, names=None):
        """:meth:`__call__` for a loss-scaling optimizer that decides on the exchanged gradient:
        ``grads / scale`` go through the exchange on every rank, whatever they hold, and a bucket
        that is not finite on some rank comes back NaN on every rank (:attr:`nonfinite_result`),
        so that every rank's finite test fails together."""
        import tensorflow as tf

        self.nonfinite_result = "nan"
        return self([g / tf.cast(scale, g.dtype) for g in grads], names=names)

    def _tf_start(self, bucket: int, *arrays):
        return np.int64(self._begin(self._buckets[bucket], arrays))

    def _tf_finish(self, bucket: int, index):
        return self._finish(self._buckets[bucket], int(index))

    @_in_space
    def _tf_start_device(self, bucket: int, *tensors):
        """``tf.py_function`` body: the bucket's gradients (TF tensors on the exchange's GPU) viewed
        in place and the bucket started from them."""
        from .ops import tf as ops_tf

        return np.int64(self._begin(self._buckets[bucket], ops_tf.device_views(tensors)))

    @_in_space
    def _tf_finish_device(self, bucket: int, index):
        """``tf.py_function`` body: the bucket's result, copied on the device into a TF tensor."""
        import tensorflow as tf

        from .ops import tf as ops_tf

        return ops_tf.to_tensor(self._finish(self._buckets[bucket], int(index)), tf.float32, index.device)

    def __repr__(self):
        return (f"GradientExchange(algorithm={self.algorithm!r}, density={self.density}, "
                f"wire_dtype={self.wire.name!r}, plan={self.plan!r}, pipeline={self.pipeline})")
