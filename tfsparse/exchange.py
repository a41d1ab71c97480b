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

import threading
import time

from .bucket import Bucket, ExchangeStats, Outcome
from .collectives.watchdog import note_round
from .exchange_auto import AutoState, AutoSwitching
from .exchange_build import Building
from .exchange_state import ExchangeState
from .memory import keeps_velocity
from .plan import Layout
from .schedules import check_density
from .settings import AUTO, Settings
from .space import HOST, in_space
from .wire import get_wire


class _Sent:
    """A two-level round's job on a rank that is not its host's leader: its gradient went to the
    leader; the result is the leader's (:meth:`GradientExchange.finish` receives it)."""

    def result(self):
        return self


_SENT = _Sent()


class Round:
    """One round of an exchange, started by :meth:`GradientExchange.start`.

    Args:
      exchange: the exchange.
      index: the round's index.
      flat: whether the gradients were given as one flat array.
    """

    def __init__(self, exchange, index: int, flat: bool):
        self._exchange = exchange
        self.index = index
        self._flat = flat
        self._result = None

    def wait(self):
        """Blocks until the round is done.

        Returns:
          The summed gradients, shaped like the input of :meth:`GradientExchange.start` (a flat
          array, or a list of arrays in layout order).
        """
        if self._result is None:
            ex = self._exchange
            with ex.space.active():
                self._result = ex.assemble({b.spec.index: ex.finish(b, self.index) for b in ex.bucket_states},
                                           self._flat)
        return self._result


class GradientExchange(Building, ExchangeState, AutoSwitching):
    """The round engine of one model: error feedback + sparse allreduce over a typed wire.

    Args:
      settings: a :class:`tfsparse.settings.Settings`; or, instead, its keyword arguments
        (``algorithm``, ``density``, ``wire_dtype``, ``plan``, ``memory``, ``momentum``,
        ``pipeline``, ``clip_norm`` and the algorithm's options; see :mod:`tfsparse.settings`).
        Every argument is validated here, before any communication.
      communicator: a :class:`~tfsparse.collectives.Communicator`; default: the world's.
      algorithm: the aggregator, or ``"auto"`` (the default) -- a setting, as ``settings``.
      density: the fraction of elements each rank sends (default 0.01; given without an
        algorithm, it pins ``"topk"``) -- a setting.
      **kwargs: the settings' other keyword arguments and the algorithm's options.

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
        self._side_channel = False  # a second communicator for run_collective: run_ahead, request_side_channel
        self._comm_ahead = False  # the communication thread runs ahead of the training's: run_ahead
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
        self._nonfinite_result = "zeros"  # what a round not finite on some rank returns: on_nonfinite
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
    momentum = property(lambda self: self.settings.momentum, doc="The factor of momentum correction (else None).")
    pipeline = property(lambda self: self.settings.pipeline)
    clip_norm = property(lambda self: self.settings.clip_norm)
    wire_dtype = property(lambda self: self.wire.name)

    @property
    def density(self) -> float:
        """The density of the buckets that set none of their own (``k = ceil(density · size)``); where a
        :attr:`schedule` is set, it replaces the density at the start of every round."""
        return self._density

    @density.setter
    def density(self, value) -> None:
        """Sets it, checked to be a number in ``(0, 1]``."""
        self._density = check_density(value)

    @property
    def rounds_started(self) -> int:
        """Rounds begun since the start of training (restored with the state): the step that
        :attr:`schedule` is asked about next."""
        return self._next_round

    @property
    def rounds_done(self) -> int:
        """Rounds completed: counted when a round's last bucket finishes (restored with the state)."""
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
        """Every setting as given, as plain values: what makes this exchange again.

        Returns:
          :meth:`Settings.config` of :attr:`requested`, with the current density (auto's own choice
          excepted).
        """
        return {**self.requested.config(), **({} if self._auto is not None else {"density": self.density})}

    def decide_memory(self, momentum: float | None) -> None:
        """Decides ``memory="auto"`` (:meth:`Settings.resolved`); once built, the memory is decided and nothing changes.

        Args:
          momentum: the momentum factor of the optimizer that the exchange may take over; None: none.
        """
        if self.layout is None:
            self.settings = self.requested.resolved(momentum)

    @property
    def takes_momentum(self) -> bool:
        """Whether the exchange applies the optimizer's momentum: ``memory="auto"`` decided for
        momentum correction (the optimizer then applies its update without momentum)."""
        return self.requested.memory == AUTO and keeps_velocity(self.settings.memory)

    @property
    def local_clip_norm(self) -> float | None:
        """The norm each rank clips its gradient to (:meth:`Settings.local_clip_norm`)."""
        return self.settings.local_clip_norm(self.comm.size)

    # -- rounds -----------------------------------------------------------
    def exchange_numpy(self, grads):
        """One round on numpy data; the residuals stay in the exchange.

        Device arrays (anything with ``__cuda_array_interface__``): see the module docstring.

        Args:
          grads: one flat array or a list of arrays.

        Returns:
          The summed gradients in the same form.
        """
        return self.start(grads).wait()

    def start(self, grads) -> Round:
        """Starts a round: every bucket is encoded here and handed to the communication thread.

        Args:
          grads: one flat array or a list of arrays.

        Returns:
          A :class:`Round`; its :meth:`Round.wait` returns the result.
        """
        with self.space_of(grads).active():
            flat, arrays = self.arrays(grads)
            self.prepare_round()
            index = None
            for b in self.bucket_states:
                index = self.begin(b, arrays[b.spec.first:b.spec.last])
        return Round(self, index, flat)

    def begin(self, b: Bucket, arrays, dsync: bool = False) -> int:
        """Starts bucket ``b``'s next round from its gradients: the caller's-thread stages, then the communication job.

        Args:
          b: the :class:`~tfsparse.bucket.Bucket`.
          arrays: its gradients.
          dsync: over a float32 wire whatever the settings say (Pipe-SGD's D-Sync warm-up).

        Returns:
          The round's index, for :meth:`finish`.

        Raises:
          RuntimeError: an earlier round failed (the ranks are out of step).
        """
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
        """Bucket ``b``'s result of a round: waits for its communication job, then decodes it and updates the memory on this thread.

        (:meth:`Bucket.complete <tfsparse.bucket.Bucket.complete>`.)

        Args:
          b: the :class:`~tfsparse.bucket.Bucket`.
          index: what :meth:`begin` returned.

        Returns:
          The bucket's summed vector.
        """
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
                    decoded = getattr(received, "result", None)  # (a skipped round: an Outcome, dense)
                    self._two.share(out.dense, b.spec.size, result=decoded,
                                    decoded_into=getattr(received, "out", None) is not None)
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
        if self._auto is not None:
            if last:
                self._probe_between_rounds()
            self._observe_sum(b, index, out.dense)
        return out.dense

    def __repr__(self):
        return (f"GradientExchange(algorithm={self.algorithm!r}, density={self.density}, "
                f"wire_dtype={self.wire.name!r}, plan={self.plan!r}, pipeline={self.pipeline})")
