"""GradientExchange: the numpy round engine -- error feedback + sparse allreduce over a typed
wire, bucket by bucket, for one model.

It knows the gradients' :class:`~tfsparse.plan.Layout` (names, shapes, sizes; captured at
the first round), and the settings' :mod:`plan <tfsparse.plan>` splits the layout into
buckets (:class:`~tfsparse.bucket.Bucket`), each with its own memory, aggregator, ``k`` and
wire.  One round runs, for every bucket in bucket order, the bucket's stages:

1. **compensate, select, encode** (the caller's thread, :meth:`begin`): ``acc = grad +
   residual`` in one pass (:mod:`tfsparse.memory`), the finite check, then the aggregator's
   local phase -- selection through its compressor and encoding on the wire
   (:meth:`Aggregator.encode <tfsparse.aggregators.Aggregator.encode>`);
2. **exchange** (the communication thread, :class:`~tfsparse.collectives.CommThread`): the
   aggregator's collectives over a duplicate of the world communicator, strictly in bucket
   order;
3. **decode, update** (the thread that finishes the bucket, :meth:`finish`): the dense result
   and the memory's new residual (what was not contributed, plus what the wire lost).

So while bucket ``i`` is on the wire, bucket ``i + 1`` is being selected and encoded, and
while bucket ``i`` is decoded, bucket ``i + 1`` is on the wire; and in a
TensorFlow step (:mod:`tfsparse.tf_glue`) each bucket starts as soon as back-propagation has
produced its gradients (bucket 0 holds the last layers).  :meth:`GradientExchange.start`
returns a :class:`Round` whose :meth:`~Round.wait` may come later.  Pipe-SGD's pipelining is a
wrapper around this engine (:class:`tfsparse.pipelined.Pipelined`); the Keras checkpoint
format lives in :mod:`tfsparse.checkpoint`.

The result is the **sum** over ranks; callers divide by P (or rely on Keras scaling the loss
by ``1/num_replicas_in_sync`` under :class:`SparseStrategy`).

**Device arrays** (CuPy, Numba, PyTorch CUDA tensors: anything with
``__cuda_array_interface__``): when the first round's gradients live on a CUDA device, the
exchange keeps its vectors there (:class:`tfsparse.space.CudaSpace`) -- error feedback, the
finite check and the residual on the device, the selection too for the algorithms that select
there (``topk``, ``gtopk``, ``dragonn``; the others are handed a host copy of the bucket), only
the payload crosses to the host for the transport, and the result is decoded on the device and
returned as Numba device arrays (float32).  Every later round's input is taken to where the
first one lived.

State -- every bucket memory's (residual, velocity) and aggregator's state and the round
counter -- is explicit: :meth:`~GradientExchange.get_state` / :meth:`~GradientExchange.set_state`.
"""
from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from concurrent.futures import Future

import numpy as np

from . import auto
from .bucket import Bucket, ExchangeStats, Outcome, agreement, assemble, check_saved_layout, make_bucket
from .collectives.agreement import check_agreement
from .collectives.hosts import host_ids
from .collectives.thread import CommThread
from .collectives.watchdog import note_round
from .exchange_auto import AutoState, AutoSwitching
from .hierarchy import TwoLevel
from .plan import Layout
from .schedules import check_density
from .settings import AUTO, Settings
from .space import HOST, space_for
from .wire import get_wire

#: seconds between the tests of a quiet wait on a communication thread that runs ahead
#: (:attr:`GradientExchange.comm_ahead`): at 1 Gbit/s about 6 KB arrive meanwhile, far less than
#: a socket's buffer.  Measured with Pipe-SGD (``pipeline=2``, int8, the 17.1M MLP, P = 4 on the
#: 2-core VM, ``--net 1gbit``): a step 501.5 -> 471.7 ms with quiet waits and precedence, 499.6 with
#: quiet waits alone, 483.3 with precedence alone (busy polling then takes the cores)
QUIET_PAUSE = 50e-6

_AGREE_HINT = "Every rank must build the same model and the same SparseStrategy / DistributedOptimizer settings."


#: seconds the kernels' warm-up may take, silently, before rank 0 says that it compiles them
COMPILE_NOTICE_S = 2.0


@functools.lru_cache(maxsize=None)
def _warm_kernels(announce: bool = False) -> None:
    """Once per process, before the first step: every Numba CPU kernel compiled, or loaded from
    its on-disk cache (< 1 s when ``tools/install.sh`` or ``tfsparse warmup`` filled it; ~30 s to
    compile on 2 cores otherwise), so that no step stalls on a compile half-way.  ``announce``
    (rank 0): where loading takes longer than :data:`COMPILE_NOTICE_S`, one line says that the
    kernels are being compiled, and one how long it took."""
    from .ops import cpu

    if not announce:
        cpu.warmup()
        return
    t0 = time.perf_counter()
    done: Future = Future()
    worker = threading.Thread(target=lambda: _settle(done, cpu.warmup), name="tfsparse-warmup", daemon=True)
    worker.start()
    worker.join(COMPILE_NOTICE_S)
    if worker.is_alive():
        print("tfsparse: compiling the Numba kernels (once per machine and version; `tfsparse warmup` "
              "does it ahead of time) ...", flush=True)
        worker.join()
        print(f"tfsparse: kernels compiled in {time.perf_counter() - t0:.0f} s and cached", flush=True)
    done.result()


def _settle(future: Future, fn) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:
        future.set_exception(e)


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


def in_space(method):
    """An exchange method run with the exchange's space active (its GPU current in the calling
    thread, :meth:`tfsparse.space.CudaSpace.active`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.space.active():
            return method(self, *args, **kwargs)

    return run


class _Sent:
    """A two-level round's job on a rank that is not its host's leader: its gradient went to the
    leader; the result is the leader's (:meth:`GradientExchange.finish` receives it)."""

    def result(self):
        return self


_SENT = _Sent()


class Round:
    """One round of an exchange, started by :meth:`GradientExchange.start`."""

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
                self._result = ex.assemble({b.spec.index: ex.finish(b, self.index) for b in ex.bucket_states},
                                           self._flat)
        return self._result


class GradientExchange(AutoSwitching):
    """The round engine of one model: error feedback + sparse allreduce over a typed wire.

    Args:
      settings: a :class:`tfsparse.settings.Settings`; or, instead, its keyword arguments
        (``algorithm``, ``density``, ``wire_dtype``, ``plan``, ``memory``, ``momentum``,
        ``pipeline``, ``clip_norm`` and the algorithm's options; see :mod:`tfsparse.settings`).
        Every argument is validated here, before any communication.
      communicator: a :class:`~tfsparse.collectives.Communicator`; default: the world's.

    :attr:`density` is mutable (``exchange.density = ...``, e.g. by ``DensitySchedule``), and
    :attr:`schedule` (``round -> density``) sets the density of every round.  A round whose
    density is 1 (a dense warm-up step, :class:`tfsparse.schedules.WarmUp`) runs a true dense
    allreduce (:class:`~tfsparse.aggregators.dense.DenseAllreduce`), not the sparse algorithm at
    ``k = n``; it flushes the residual.  ``settings.pipeline`` is honoured by the
    :class:`~tfsparse.pipelined.Pipelined` wrapper, not here: this engine's rounds are
    synchronous.
    """

    def __init__(self, algorithm: str | None = None, density: float | None = None, *, settings: Settings | None = None,
                 communicator=None, **kwargs):
        positional = {k: v for k, v in (("algorithm", algorithm), ("density", density)) if v is not None}
        #: the settings as given (``memory="auto"`` undecided); :attr:`settings` as they run
        self.requested = Settings.of(settings, **positional, **kwargs)
        self.settings = self.requested
        self._density = self.settings.density
        self.plan = self.settings.plan
        self.wire = get_wire(self.settings.wire_dtype)
        self.schedule = None  # callable round -> density, or None (the density as set)
        self.side_channel = False  # a second communicator for run_collective (Pipelined asks for it)
        #: whether the communication thread runs ahead of the training's threads, waiting quietly
        #: (Pipelined asks for it: its rounds move while the next step computes)
        self.comm_ahead = False
        self._comm = communicator
        self._xcomm = self._side = self._runner = None
        self._two = None  # hierarchical=True over several ranks: this rank's groups (tfsparse.hierarchy)
        self.layout: Layout | None = None
        self.bucket_states: list[Bucket] = []
        self._next_round = 0  # the round the next start of bucket 0 begins
        self._round = 0  # rounds completed
        self._pending_state: dict | None = None
        self._stats_lock = threading.Lock()
        self._round_t0: dict = {}
        self._failed: BaseException | None = None
        # a round whose gradient is not finite on some rank is skipped on every rank; it returns
        # zeros ("zeros", with a warning), or NaN ("nan": set when Keras' LossScaleOptimizer decides
        # on the exchanged gradient, so that every rank skips the step and halves its loss scale)
        self.nonfinite_result = "zeros"
        self.stats = ExchangeStats()
        self.total = ExchangeStats()  # never reset: whole-run totals
        #: ``algorithm="auto"``: its measurements and decision (:class:`~tfsparse.exchange_auto.AutoState`), else None
        self._auto = AutoState() if self.requested.algorithm == AUTO else None
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

    algorithm = property(lambda self: self.settings.algorithm)
    options = property(lambda self: self.settings.options)
    memory = property(lambda self: self.settings.memory)
    memory_options = property(lambda self: self.settings.memory_options)
    momentum = property(lambda self: self.settings.momentum, doc="The factor of memory='momentum' (else None).")
    pipeline = property(lambda self: self.settings.pipeline)
    clip_norm = property(lambda self: self.settings.clip_norm)
    wire_dtype = property(lambda self: self.wire.name)

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
    def rounds_done(self) -> int:
        return self._round

    @property
    def uses_memory(self) -> bool:
        """Whether the exchange keeps a residual (:attr:`Settings.keeps_residual` before the build)."""
        if self.bucket_states:
            return any(b.memory.residual is not None for b in self.bucket_states)
        return self.settings.keeps_residual

    @property
    def buckets(self):
        """The plan's buckets (after :meth:`build`)."""
        return [b.spec for b in self.bucket_states]

    @property
    def aggregators(self):
        """Every bucket's aggregator instance, in bucket order (after :meth:`build`)."""
        return [b.aggregator for b in self.bucket_states]

    def config(self) -> dict:
        """Every setting as given, as plain values (:meth:`Settings.config` of :attr:`requested`,
        with the current density -- auto's own choice excepted): what makes this exchange again."""
        return {**self.requested.config(), **({} if self._auto is not None else {"density": self.density})}

    def decide_memory(self, momentum: float | None) -> None:
        """Decides ``memory="auto"`` (:meth:`Settings.resolved`) for an optimizer whose momentum
        factor ``momentum`` the exchange may take over (None: none to take).  Once built, the
        memory is decided: nothing changes."""
        if self.layout is None:
            self.settings = self.requested.resolved(momentum)

    @property
    def takes_momentum(self) -> bool:
        """Whether the exchange applies the optimizer's momentum: ``memory="auto"`` decided for
        momentum correction (the optimizer then applies its update without momentum)."""
        return self.requested.memory == AUTO and self.settings.memory == "momentum"

    @property
    def local_clip_norm(self) -> float | None:
        """The norm each rank clips its gradient to (:meth:`Settings.local_clip_norm`)."""
        return self.settings.local_clip_norm(self.comm.size)

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
        self.settings = self.settings.resolved()  # "auto" undecided (no optimizer known): error feedback
        self._start_measuring(layout.n)
        if self.plan.prepares:  # collectives of its own: only once every rank is known to agree
            _warm_kernels(comm.rank == 0)
            self._agree(layout, [])
            self.plan.prepare(comm, self)
        buckets = self._make_buckets(layout)
        _warm_kernels(comm.rank == 0)
        self._agree(layout, buckets)
        self._xcomm = comm.duplicate() if comm.size > 1 else comm
        if self.settings.hierarchical and comm.size > 1:
            if self.space.on_device:
                raise ValueError("hierarchical=True sums a host's gradients in host memory; these gradients live on "
                                 "a device -- use hierarchical=False there")
            self._two = TwoLevel.of(comm)
        # a thread of its own only where the transport allows calls from several threads
        # (MPI_THREAD_MULTIPLE); otherwise the collectives run inline, without overlap
        threaded = comm.size > 1 and comm.thread_safe
        ahead = self.comm_ahead and threaded and self._xcomm.wait_quietly(QUIET_PAUSE)
        self._runner = CommThread(ahead=ahead) if threaded else _Inline()
        # pipelined, the caller's own collectives (metric averaging) must not queue behind the round
        # in flight: they get a communicator of their own, used from the caller's thread -- where the
        # transport allows two collectives in flight at once (not Horovod's: there they queue)
        side = self.side_channel and threaded and comm.concurrent_collectives
        self._side = comm.duplicate() if side else None
        if ahead and not self._runner.take_precedence():
            self._xcomm.wait_quietly(None)  # no precedence: waiting quietly alone changes nothing
        weakref.finalize(self, self._runner.close)
        self.layout = layout
        self.bucket_states = buckets
        self._take_inherited()
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.set_state(state)
        self._announce()

    def _announce(self) -> None:
        """Rank 0's start-up line: what this exchange runs and where (collective: one allgather
        of 8 bytes for the hosts, on every rank).  ``TFSPARSE_ANNOUNCE=0`` on rank 0 turns it off."""
        hosts = len(set(host_ids(self.comm)))  # on every rank, whatever its environment says
        if self.comm.rank != 0 or os.environ.get("TFSPARSE_ANNOUNCE", "1") == "0":
            return
        from ._version import __version__

        transport = {"MPICommunicator": "mpi", "HorovodCommunicator": "horovod"}.get(type(self.comm).__name__,
                                                                                  type(self.comm).__name__)
        if self._auto is not None:
            algorithm = f"algorithm='auto' (measures {auto.MEASURE_ROUNDS} rounds, then chooses)"
        else:  # the density where something is left out, the memory where it could keep something
            st = self.settings
            memory = st.sparse_capable or self.wire.lossy or st.memory == "momentum"
            algorithm = " ".join([f"algorithm={self.algorithm!r}"] + [f"density={self.density:g}"] * st.sparse_capable +
                                 [f"wire={self.wire.name}"] + [f"memory={st.memory}"] * memory)
        buckets = len(self.bucket_states)
        two_level = "" if self._two is None else \
            f", two-level (inside each host, then across {self._two.hosts} host{'s' * (self._two.hosts != 1)})"
        print(f"tfsparse {__version__}: {self.comm.size} rank{'s' * (self.comm.size != 1)} on {hosts} "
              f"host{'s' * (hosts != 1)} ({transport}), {algorithm}, plan={self.plan.name} "
              f"({buckets} bucket{'s' * (buckets != 1)}, {self.layout.n:,} gradient elements), "
              f"pipeline={self.pipeline}{two_level}", flush=True)

    def _make_buckets(self, layout: Layout, replacing=None) -> list:
        """The plan's buckets for ``layout`` with the stages of :attr:`settings`; ``replacing``:
        the buckets they take over from (:func:`~tfsparse.bucket.make_bucket`'s ``replaces``)."""
        specs = self.plan.buckets(layout)
        return [make_bucket(spec, self.settings, self.space, None if replacing is None else replacing[spec.index])
                for spec in specs]

    def _use(self, settings: Settings) -> None:
        """Runs ``settings`` from now on (before the buckets are made)."""
        self.settings = settings
        self.wire = get_wire(settings.wire_dtype)
        self._density = settings.density

    def _agree(self, layout: Layout, buckets) -> None:
        """Every rank has the same settings, transport, layout and buckets (:func:`agreement`),
        or every rank raises the same ``ConfigurationMismatch``."""
        decided = {"memory in use": self.settings.memory, "momentum in use": self.settings.momentum}
        what = agreement({**self.config(), **decided}, self.plan, self.comm, layout, buckets)
        check_agreement(self.comm, "the gradient exchange", what, _AGREE_HINT)

    def agree_on_settings(self) -> None:
        """Collective, on the caller's thread: every rank has the same settings and transport, or
        every rank raises the same ``ConfigurationMismatch`` -- as the first round's agreement
        does (which also compares the gradients and buckets), but where the caller catches it as
        itself (``SparseStrategy`` calls it as ``fit`` or ``evaluate`` starts)."""
        what = {"settings": self.config(), "transport": type(self.comm).__name__}
        self.run_collective(lambda c: check_agreement(c, "the gradient exchange", what, _AGREE_HINT))

    def close(self) -> None:
        """Stops the communication thread (after the jobs already submitted)."""
        if self._runner is not None:
            self._runner.close()

    # -- rounds -----------------------------------------------------------
    def exchange_numpy(self, grads):
        """One round on numpy data: ``grads`` is one flat array or a list of arrays; returns
        the summed gradients in the same form.  The residuals stay in the exchange.  Device
        arrays (anything with ``__cuda_array_interface__``): see the module docstring."""
        return self.start(grads).wait()

    def start(self, grads) -> Round:
        """Starts a round: every bucket is encoded here and handed to the communication
        thread; :meth:`Round.wait` returns the result."""
        with self.space_of(grads).active():
            flat, arrays = self.arrays(grads)
            self.prepare_round()
            index = None
            for b in self.bucket_states:
                index = self.begin(b, arrays[b.spec.first:b.spec.last])
        return Round(self, index, flat)

    def space_of(self, grads):
        """The exchange's space once built; before, the space where ``grads`` live."""
        if self.layout is not None:
            return self.space
        return space_for(grads if not isinstance(grads, (list, tuple)) else (grads[0] if grads else None))

    def arrays(self, grads) -> tuple[bool, list]:
        """``(flat, arrays)`` for numpy or device input (one flat array, or a list of arrays);
        builds the plan the first time (in the space where the gradients live), and afterwards
        checks the shapes."""
        single = not isinstance(grads, (list, tuple))
        space = self.space_of(grads)
        # one array is flat (a 2-D numpy array: a list of rows, as always); a list: one per tensor
        flat = single and not (isinstance(grads, np.ndarray) and grads.ndim > 1)
        arrays = [space.accept(grads).reshape(-1)] if flat else [space.accept(g) for g in grads]
        self.build(Layout.of(arrays), space)
        if self.clip_norm is not None:
            arrays = space.clip_by_global_norm(arrays, self.local_clip_norm)
        return flat, arrays

    def assemble(self, dense: dict, flat: bool):
        """Bucket results (``{bucket index: flat array}``) as one flat array or per tensor."""
        return assemble(self.layout, self.bucket_states, dense, flat, self.space)

    def begin(self, b: Bucket, arrays, dsync: bool = False) -> int:
        """Starts bucket ``b``'s next round from its gradients ``arrays`` (the caller's-thread
        stages, then the communication job); returns the round's index, for :meth:`finish`.
        ``dsync``: over a float32 wire whatever the settings say (Pipe-SGD's D-Sync warm-up)."""
        if self._failed is not None:
            raise RuntimeError(f"this exchange failed in an earlier round ({type(self._failed).__name__}: "
                               f"{self._failed}); the ranks are out of step, restart training") from self._failed
        if b.spec.index == 0 and self._auto is not None:
            self.prepare_round()  # the glue's path: it looks its buckets up by index
            b = self.bucket_states[0]
        t0 = time.perf_counter()
        index = b.check_start(self.bucket_states[b.spec.index - 1] if b.spec.index else None)
        if b.spec.index == 0:
            note_round(self._next_round)  # what a stall report names
            self._round_t0[index] = t0
            if self.schedule is not None:
                self._density = check_density(self.schedule(self._next_round), f"schedule({self._next_round})")
            self._next_round += 1
        density = self.density if b.density is None else b.density
        if self._two is not None:
            total = self._two.host_sum(self.space, arrays, b.spec.index)
            if total is None:  # not its host's leader: the leader exchanges the host's sum
                b.rounds += 1
                b.expect_settlement(index)
                b.settled.add(index)
                b.settlements[index].set()
                b.futures[index] = _SENT
                return index
            arrays = [total]
        aggregator, payload, finite = b.encode(self._algorithm_comm, self.space, arrays, density, dsync)
        dt = time.perf_counter() - t0
        with self._stats_lock:
            for s in (self.stats, self.total):
                s.encode_seconds += dt
        b.rounds += 1
        b.expect_settlement(index)
        b.futures[index] = self._runner.submit(self._communicate, b, aggregator, payload, finite, index)
        return index

    @property
    def two_level(self):
        """The two-level exchange's groups of this rank (:class:`tfsparse.hierarchy.TwoLevel`:
        ``leader``, ``hosts``, ``local_size``, ``sum_seconds``, ``share_seconds``), None while the
        exchange is flat."""
        return self._two

    @property
    def _algorithm_comm(self):
        """Over which the buckets' algorithm runs: the leaders' of the hosts (two-level), else
        the exchange's own duplicate of the world."""
        return self._xcomm if self._two is None else self._two.cross

    @in_space
    def _communicate(self, b: Bucket, aggregator, payload, finite: bool, index: int):
        """The communication thread's job for one bucket (:meth:`Bucket.communicate`); however it
        ends, the round's settlement event is set (:meth:`Bucket.wait_settled`)."""
        try:
            return b.communicate(self._algorithm_comm, self.space, aggregator, payload, finite, index,
                                 self.nonfinite_result)
        finally:
            b.settlements[index].set()

    def finish(self, b: Bucket, index: int):
        """Bucket ``b``'s result of round ``index``: waits for its communication job, then decodes
        it and updates the memory on this thread (:meth:`Bucket.complete`)."""
        t0 = time.perf_counter()
        try:
            received = b.futures[index].result()
            waited = time.perf_counter() - t0
            del b.futures[index]
            b.forget(index)
            if isinstance(received, _Sent):  # the host's leader exchanged it: its result, shared
                dense = self._two.share(None, b.spec.size, b.outputs.take() if b.outputs is not None else None)
                out = Outcome(dense, 0, 0, time.perf_counter() - t0, 0.0)
            else:
                with self.space.active():
                    out = b.complete(self.space, received)
                if self._two is not None:
                    self._two.share(out.dense, b.spec.size)
        except BaseException as e:
            self._failed = e
            raise
        last = b.spec.index == len(self.bucket_states) - 1
        with self._stats_lock:
            t0 = self._round_t0.pop(index, None) if last else None
            if last and t0 is not None and self._auto is not None:
                self._auto.last_round_s = time.perf_counter() - t0
            for s in (self.stats, self.total):
                s.add(out, b.spec.size, waited)
                if last:
                    s.steps += 1
                    if t0 is not None:
                        s.seconds += time.perf_counter() - t0
            if last:
                self._round += 1
        if last and self._auto is not None:
            self._probe_between_rounds()
        return out.dense

    def request_side_channel(self) -> None:
        """Asks for :attr:`side_channel` from now on (collective when the exchange is built
        already: every rank calls it at the same point).  For callers whose own collectives may
        be issued before this step's buckets on one rank and after them on another -- Keras'
        gradient accumulation exchanges inside a ``tf.cond``, which TensorFlow does not order
        against the step's metric averaging.  Raises ``ValueError`` where the transport cannot
        run two collectives at once from two threads (Horovod's, or no ``MPI_THREAD_MULTIPLE``)."""
        comm = self.comm
        if comm.size == 1:
            return
        if not (comm.thread_safe and comm.concurrent_collectives):
            raise ValueError(f"this exchange's transport ({type(comm).__name__}) cannot run the step's metric "
                             f"averaging beside its gradient rounds, which Keras' gradient_accumulation_steps needs "
                             f"under SparseStrategy; use tfsparse.init(backend='mpi') with MPI_THREAD_MULTIPLE, or "
                             f"accumulate without the optimizer's gradient_accumulation_steps")
        self.side_channel = True
        if self._runner is not None and self._side is None and isinstance(self._runner, CommThread):
            self._side = comm.duplicate()

    def run_collective(self, fn):
        """Runs ``fn(comm)`` on the communication thread, after the buckets already started,
        over the exchange's communicator, and returns its result (e.g. the per-step metric
        averaging, so that it never interleaves with the gradient collectives).  With a side
        channel (:attr:`side_channel`, asked for by a pipelined wrapper) over a transport that
        allows concurrent collectives, ``fn`` runs at once on the caller's thread over a
        communicator of its own, so that it does not wait for the round in flight."""
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
        if not self.bucket_states:
            pending = (self._pending_state or {}).get("residual")
            return None if pending is None else np.array(pending, np.float32).reshape(-1)
        return self.over_layout(lambda b: b.memory.residual, lambda b: b.memory.space) if self.uses_memory else None

    def over_layout(self, part, space_of=None) -> np.ndarray:
        """``part(bucket)`` of every bucket placed over the whole layout (zeros where it is None);
        ``space_of(bucket)``: where that vector lives (default: the exchange's space)."""
        out = np.zeros(self.layout.n, np.float32)
        for b in self.bucket_states:
            value = part(b)
            if value is not None:
                out[b.spec.start:b.spec.stop] = (space_of(b) if space_of else self.space).to_host(value)
        return out

    def check_idle(self, what: str) -> None:
        busy = sorted(b.spec.index for b in self.bucket_states if b.futures)
        if busy:
            raise RuntimeError(f"{what} while a round is in flight (buckets {busy}); wait() for it first: the "
                               f"state must not mix two rounds")

    @in_space
    def get_state(self) -> dict:
        """``{name: numpy array}``: ``round`` (rounds done), ``sizes`` (the layout), ``buckets``
        (the plan's element ranges), the memories' state over the layout (``residual`` when
        kept, ``velocity`` for ``memory="momentum"``) and ``bucket<i>.<key>`` for every bucket
        aggregator's state.  Not while a round is in flight."""
        if not self.bucket_states:
            return dict(self._pending_state or {})
        self.check_idle("get_state()")
        state = {"round": np.array([self._round], np.int64), "sizes": self.layout.sizes.copy(),
                 **({} if self._auto is None else self._auto_state()),
                 "buckets": np.array([[b.spec.start, b.spec.stop] for b in self.bucket_states], np.int64)}
        for b in self.bucket_states:
            for key, value in b.memory.get_state().items():
                state.setdefault(key, np.zeros(self.layout.n, np.float32))[b.spec.start:b.spec.stop] = value
        for b in self.bucket_states:
            state.update(b.aggregator_state())
        return state

    @in_space
    def set_state(self, state: dict) -> None:
        """Restores :meth:`get_state`'s output (before :meth:`build`, it is applied at build)."""
        state = {k: np.asarray(v) for k, v in state.items()}
        if not self.bucket_states:
            self._pending_state = state
            return
        self.check_idle("set_state()")
        check_saved_layout(state, self.layout, self.bucket_states, self.plan)
        if "round" in state:
            self._round = self._next_round = int(state["round"].reshape(-1)[0])
        self._restore_auto(state)
        for b in self.bucket_states:
            b.set_state(state)

    def carry_memory(self, other: "GradientExchange") -> list[str]:
        """Takes ``other``'s memory (residual; velocity for ``memory="momentum"``) of every tensor
        this exchange's layout shares with ``other``'s -- the same name and shape -- and keeps
        its own elsewhere; returns the names carried.  For a model whose trainable set changed
        (layers frozen or unfrozen: a new exchange for the new set, built already) so that what
        the old set had not sent yet is still sent.  The aggregators' own state (thresholds,
        Ok-Topk's reused boundaries) and the round counter start afresh.  Neither exchange may
        have a round in flight."""
        if not self.bucket_states or not other.bucket_states:
            return []
        theirs, mine = other.get_state(), self.get_state()
        keys = [k for k in ("residual", "velocity") if k in theirs and k in mine]
        where = {s.name: (s.shape, int(lo), int(hi))
                 for s, lo, hi in zip(other.layout.specs, other.layout.offsets[:-1], other.layout.offsets[1:])}
        carried = []
        for spec, lo, hi in zip(self.layout.specs, self.layout.offsets[:-1], self.layout.offsets[1:]):
            found = where.get(spec.name)
            if found is None or tuple(found[0]) != tuple(spec.shape):
                continue
            for k in keys:
                mine[k][int(lo):int(hi)] = theirs[k][found[1]:found[2]]
            carried.append(spec.name)
        if carried and keys:
            self.set_state({k: mine[k] for k in ("sizes", "buckets", *keys)})
        return carried

    def __repr__(self):
        return (f"GradientExchange(algorithm={self.algorithm!r}, density={self.density}, "
                f"wire_dtype={self.wire.name!r}, plan={self.plan!r}, pipeline={self.pipeline})")
