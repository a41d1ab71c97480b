"""Building a :class:`~tfsparse.exchange.GradientExchange` at its first round: every rank's
agreement on settings, layout and buckets, the kernels warmed, the buckets made, the
communication thread (and the side channel a pipelined exchange asks for) started, the two-level
groups formed, and rank 0's start-up line."""
from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from concurrent.futures import Future

import numpy as np

from . import _checks, auto
from .bucket import agreement, assemble, make_bucket
from .collectives.agreement import check_agreement
from .collectives.hosts import host_ids
from .collectives.thread import CommThread
from .hierarchy import TwoLevel
from .memory import keeps_velocity
from .plan import Layout, Plan
from .settings import Settings
from .space import HOST, space_for
from .wire import get_wire

#: seconds between the tests of a quiet wait on a communication thread that runs ahead
#: (:attr:`GradientExchange.comm_ahead`): at 1 Gbit/s about 6 KB arrive meanwhile, far less than
#: a socket's buffer, while busy polling would take a core from the computation (where ranks
#: share cores, as Pipe-SGD's communication thread does when it runs ahead)
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


class Building:
    """:class:`~tfsparse.exchange.GradientExchange`'s build and the communicators it makes (a base
    of it: it sets the exchange's layout, buckets, communicators and runner)."""

    # -- the gradients as given, and the result in their form ------------------
    def space_of(self, grads):
        """Where a round's vectors live.

        Args:
          grads: one flat array or a list of arrays (numpy or device).

        Returns:
          The exchange's space once built; before, the space where ``grads`` live
          (:mod:`tfsparse.space`).
        """
        if self.layout is not None:
            return self.space
        return space_for(grads if not isinstance(grads, (list, tuple)) else (grads[0] if grads else None))

    def arrays(self, grads) -> tuple[bool, list]:
        """The gradients as the buckets take them; builds the plan the first time (in the space
        where the gradients live), and afterwards checks the shapes.

        Args:
          grads: one flat array or a list of arrays (numpy or device).

        Returns:
          ``(flat, arrays)``: whether ``grads`` was one flat array, and the arrays (clipped by
          ``clip_norm`` where set).
        """
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
        """The buckets' results in the form the gradients were given.

        Args:
          dense: ``{bucket index: flat array}``.
          flat: one flat array (True) or one array per tensor.

        Returns:
          One flat array, or a list of arrays in layout order.
        """
        return assemble(self.layout, self.bucket_states, dense, flat, self.space)

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
            prepared = self.plan.prepare(comm, self, layout)
            if not isinstance(prepared, Plan):
                raise TypeError(f"{type(self.plan).__name__}.prepare(comm, exchange, layout) returned {prepared!r}; "
                                f"a plan's prepare returns the plan to use (itself, or a prepared copy)")
            self.plan = prepared
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
            memory = st.sparse_capable or self.wire.lossy or keeps_velocity(st.memory)
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
        return [make_bucket(spec, self.settings, self.space, None if replacing is None else replacing[spec.index],
                            layout) for spec in specs]

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

    # -- its communicators ------------------------------------------------
    @property
    def side_channel(self) -> bool:
        """Whether the caller's own collectives (:meth:`run_collective`) take a communicator of
        their own: asked for by :meth:`run_ahead` or :meth:`request_side_channel`."""
        return self._side_channel

    @property
    def comm_ahead(self) -> bool:
        """Whether the communication thread runs ahead of the training's threads, waiting
        quietly: asked for by :meth:`run_ahead`."""
        return self._comm_ahead

    def run_ahead(self) -> None:
        """Readies this exchange for rounds that run while the next step computes (a pipelined
        wrapper, :class:`~tfsparse.pipelined.Pipelined` with ``depth=2``, calls it): when built,
        its communication thread waits quietly and runs ahead of the training's threads
        (:attr:`comm_ahead`), and :meth:`run_collective` takes a communicator of its own where
        the transport allows two collectives at once (:attr:`side_channel`), so that neither
        waits for the round in flight.

        Raises:
          RuntimeError: the exchange is built already (its communication thread exists).
        """
        if self.layout is not None:
            raise RuntimeError("run_ahead() after the exchange was built: wrap a GradientExchange in Pipelined "
                               "before its first round")
        self._side_channel = self._comm_ahead = True

    @property
    def nonfinite_result(self) -> str:
        """What a round whose gradient is not finite on some rank returns on every rank:
        ``"zeros"`` (with a warning) or ``"nan"`` (:meth:`on_nonfinite`)."""
        return self._nonfinite_result

    def on_nonfinite(self, result: str) -> None:
        """Sets what a round whose gradient is not finite on some rank (NaN or Inf) returns from
        now on; such a round is skipped on every rank alike.

        Args:
          result: ``"zeros"`` (the default: the step applies nothing, and a warning says so) or
            ``"nan"`` (for Keras' ``LossScaleOptimizer``, which decides on the exchanged
            gradient: every rank then skips the step and lowers its loss scale).

        Raises:
          ValueError: ``result`` is neither.
        """
        self._nonfinite_result = _checks.choice("result", result, ("zeros", "nan"))

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
        self._side_channel = True
        if self._runner is not None and self._side is None and isinstance(self._runner, CommThread):
            self._side = comm.duplicate()

    def run_collective(self, fn):
        """Runs ``fn(comm)`` in order with the rounds: after the buckets already started.

        On the communication thread, over the exchange's communicator (e.g. the per-step metric
        averaging, so that it never interleaves with the gradient collectives); before the build
        or without a communication thread, at once on the caller's thread.  With a side channel (:attr:`side_channel`, asked
        for by a pipelined wrapper) over a transport that allows concurrent collectives, ``fn`` runs
        at once on the caller's thread over a communicator of its own, so that it does not wait for
        the round in flight.

        Args:
          fn: a callable of the communicator.

        Returns:
          What ``fn`` returned.
        """
        if self._runner is None:
            return fn(self.comm)
        if self._side is not None:
            return fn(self._side)
        return self._runner.run(fn, self._xcomm)
