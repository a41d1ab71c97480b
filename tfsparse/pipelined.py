"""Pipelined: Pipe-SGD's pipelining (pipe-sgd-li2018 §3.1, Alg. 1) as a wrapper around the
round engine.

``Pipelined(engine, depth=2)``: a training step calls :meth:`Pipelined.step`, which starts this
step's round and returns the *previous* round's result -- so the communication of step ``t``'s
gradient runs on the communication thread while step ``t + 1`` computes, and the update applied
at step ``t + 1`` is the aggregated gradient of step ``t`` (``w[t] = w[t-1] - lr * g[t-2]`` in
the paper's indexing, iteration dependency K = 2).  The first pipelined step applies a zero
gradient (Alg. 1 initialises ``g_sum`` of iterations ``1-K .. 0`` to zero).  ``depth=1`` is the
synchronous exchange.

Its engine's communication thread runs ahead of the training's threads
(:meth:`GradientExchange.run_ahead <tfsparse.exchange_build.Building.run_ahead>`): over MPI,
where ``tfsparse.init(thread_priority=...)`` allows it (under ``tfsparse-run``), it waits
quietly and the process's other threads run five nice levels below it
(:meth:`~tfsparse.collectives.thread.CommThread.take_precedence`), so that the round in flight
moves while the next step's compute keeps the cores busy.

The wrapper owns the pipelining state, per bucket: the round whose result the next step takes
(*in flight*), or that result once finished (*held*), and what each started round's step returns
instead of its own result (*owed*).  The held result is explicit state (``pending`` in
:meth:`get_state`), so a checkpoint keeps it and a resumed run applies it.

The Keras layer tells it, by explicit calls, what it cannot see:

* :meth:`use_dsync` -- Pipe-SGD's D-Sync warm-up (pipe-sgd-li2018 §4): while on, rounds run
  synchronous over a float32 wire (``tfsparse.keras.callbacks.DSyncWarmUp`` calls it per epoch);
* :meth:`flush` -- finish the round in flight and hold its result: before evaluation, before a
  checkpoint's state is read, at the end of ``fit``;
* :meth:`mark_epochs` -- the steps per epoch, from the next round on (the strategy calls it): an
  epoch's last pipelined round is finished in its own step, so that nothing is in flight while
  the epoch's callbacks run.

Its interface is explicit: the pipelining above; :attr:`density` and :attr:`schedule`, which
set the engine's; the engine's settings, statistics and decisions, read-only (``settings``,
``stats``, ``total``, ``residual``, ``auto_choice``, ... -- :data:`ENGINE_VIEWS`); and the few
engine calls a caller of the wrapper makes (:meth:`config`, :meth:`run_collective`,
:meth:`agree_on_settings`, :meth:`check_idle`, :meth:`close`).  Anything else of the engine
(its rounds, its stages) is reached through :attr:`engine`.
"""
from __future__ import annotations

import numpy as np

from . import _checks
from .exchange import GradientExchange, in_space

#: the engine's attributes a :class:`Pipelined` shows, read-only (what its callers read of the
#: exchange: settings, statistics, decisions); set them on :attr:`Pipelined.engine`
ENGINE_VIEWS = ("settings", "requested", "algorithm", "options", "memory", "momentum", "clip_norm", "pipeline",
                "wire", "wire_dtype", "plan", "comm", "space", "layout", "buckets", "bucket_states", "stats",
                "total", "residual", "uses_memory", "takes_momentum", "rounds_started", "rounds_done",
                "two_level", "auto_choice", "auto_decision", "auto_verdict")


def _engine_view(name: str) -> property:
    return property(lambda self: getattr(self.engine, name),
                    doc=f"The engine's :attr:`~tfsparse.exchange.GradientExchange.{name}` (read-only).")


class Pipelined:
    """Pipe-SGD's iteration dependency ``depth`` (1 or 2) around a :class:`GradientExchange`.

    Args:
      engine: the round engine whose rounds it pipelines (a :class:`GradientExchange`, not yet
        used or used only through this wrapper).
      depth: 1 (synchronous: each step applies its own round's result) or 2 (each step applies
        the previous step's; pipe-sgd-li2018's K = 2); None (default): the engine's
        ``pipeline`` setting.

    Raises:
      ValueError: ``engine`` is not a :class:`GradientExchange`, ``depth`` is neither 1 nor 2,
        or ``depth=2`` with ``algorithm="auto"`` (auto chooses among synchronous settings).
    """

    def __init__(self, engine: GradientExchange, depth: int | None = None):
        if not isinstance(engine, GradientExchange):
            raise ValueError(f"engine={engine!r} is not valid; accepted: a tfsparse.exchange.GradientExchange")
        self.engine = engine
        self.depth = _checks.choice("depth", engine.pipeline if depth is None else depth, (1, 2),
                                    accepted="1 (synchronous) or 2 (Pipe-SGD)")
        if self.depth > 1 and engine.requested.algorithm == "auto":
            raise ValueError(f"depth={self.depth} with algorithm='auto': auto chooses among synchronous settings; "
                             f"pin the algorithm for Pipe-SGD (e.g. algorithm='dense', wire_dtype='int8', pipeline=2)")
        if self.depth > 1:
            engine.run_ahead()  # its rounds move while the next step computes
        self._dsync = False  # D-Sync warm-up: synchronous float32 rounds (use_dsync)
        # (first round, steps): a pipelined round that ends an epoch is waited for in its own step
        self._sync_points: tuple | None = None  # (mark_epochs)
        self._pipelined = False  # the mode of the round being started
        self._owed: dict = {}       # bucket -> {round index: (carry, pipelined)}
        self._next_owed: dict = {}  # bucket -> the round in flight whose result the next step takes
        self._held: dict = {}       # bucket -> that result, finished
        self._restored = None       # a restored ``pending`` not yet placed in the buckets (before the build)

    @property
    def dsync(self) -> bool:
        """Whether the rounds started now are D-Sync's (synchronous, float32): :meth:`use_dsync`."""
        return self._dsync

    def use_dsync(self, on: bool) -> None:
        """D-Sync warm-up (pipe-sgd-li2018 §4), switched for the rounds started from now on.

        :class:`~tfsparse.keras.callbacks.DSyncWarmUp` calls it at each epoch's beginning, alike on
        every rank.  The first pipelined step after the warm-up applies zeros.

        Args:
          on: True: synchronous rounds over float32; False: the configured pipelined, compressed mode.
        """
        self._dsync = bool(on)

    @property
    def sync_points(self) -> tuple | None:
        """``(first round, steps)`` as :meth:`mark_epochs` set them, or None."""
        return self._sync_points

    def mark_epochs(self, steps: int | None) -> None:
        """Epochs of ``steps`` rounds start at the next round (the strategy calls it when Keras distributes a ``fit`` dataset).

        A pipelined round that ends an epoch is waited for in its own step, so that nothing is in
        flight between epochs (a callback, a checkpoint or the validation then sees every gradient
        applied but the one held for the next step).

        Args:
          steps: the rounds of an epoch; None (an epoch of unknown length): no such points.
        """
        self._sync_points = (self.engine.rounds_started, int(steps)) if steps else None

    def config(self) -> dict:
        """The engine's settings as plain values (:meth:`GradientExchange.config`).

        Returns:
          A dict.
        """
        return self.engine.config()

    def run_collective(self, fn):
        """Runs ``fn(comm)`` beside the engine's rounds, in their order (:meth:`GradientExchange.run_collective`).

        Args:
          fn: a callable of the communicator, run in order with the rounds (where and over which
            communicator: :meth:`GradientExchange.run_collective`).

        Returns:
          What ``fn`` returned.
        """
        return self.engine.run_collective(fn)

    def agree_on_settings(self) -> None:
        """Collective: every rank runs the same settings (:meth:`GradientExchange.agree_on_settings`)."""
        self.engine.agree_on_settings()

    def check_idle(self, what: str) -> None:
        """Raises when a round is in flight (:meth:`GradientExchange.check_idle`).

        Args:
          what: the operation that needs none (named in the error).
        """
        self.engine.check_idle(what)

    def close(self) -> None:
        """Stops the engine's communication thread (:meth:`GradientExchange.close`)."""
        self.engine.close()

    @property
    def density(self) -> float:
        """The engine's :attr:`~tfsparse.exchange.GradientExchange.density`; setting it sets the engine's."""
        return self.engine.density

    @density.setter
    def density(self, value) -> None:
        """Sets the engine's density (checked there)."""
        self.engine.density = value

    @property
    def schedule(self):
        """The engine's density schedule (a callable round -> density, or None); setting it sets the
        engine's."""
        return self.engine.schedule

    @schedule.setter
    def schedule(self, value) -> None:
        """Sets the engine's density schedule."""
        self.engine.schedule = value

    # -- steps ------------------------------------------------------------
    def step(self, grads):
        """One training step's exchange: starts this step's round and returns the gradient to apply now.

        Args:
          grads: this rank's gradients: one flat array or a list of arrays.

        Returns:
          This round's result (synchronous), or the previous round's (pipelined; zeros when there is
          none, e.g. at the first step), in the form of ``grads``.
        """
        engine = self.engine
        with engine.space_of(grads).active():
            flat, arrays = engine.arrays(grads)
            engine.prepare_round()  # algorithm="auto" may switch the buckets now
            buckets = engine.bucket_states
            tokens = [self.begin(b, arrays[b.spec.first:b.spec.last]) for b in buckets]
            return engine.assemble({b.spec.index: self.finish(b, t) for b, t in zip(buckets, tokens)}, flat)

    def begin(self, b, arrays) -> int:
        """Starts bucket ``b``'s next round in the round's mode (decided at bucket 0).

        Args:
          b: the :class:`~tfsparse.bucket.Bucket`.
          arrays: its gradients.

        Returns:
          The round's index, for :meth:`finish`.
        """
        i = b.spec.index
        if i == 0:
            self._place_restored()
            self._pipelined = self.depth > 1 and not self._dsync
        carry = None
        previous = self._next_owed.get(i)
        # (not in two levels: there a host's ranks must finish and start alike, and only its leader
        # has the memory whose settlement would decide it)
        if self._pipelined and previous is not None and self.engine.two_level is None and b.wait_settled(previous):
            # the previous round's memory is updated already (a dense exchange over a lossy wire,
            # once its residual was whole): this round's error feedback starts while that round's
            # last messages travel; its result, still owed, is taken after
            index = self.engine.begin(b, arrays)
            self._owed.setdefault(i, {})[index] = (self._take(b), True)
            return index
        if self._pipelined or previous is not None or self._held.get(i) is not None:
            # pipelined: the previous round's result (the residual the new round starts from is
            # then complete, too); synchronous after pipelined rounds: added to this round's,
            # so that no gradient is lost
            carry = self._take(b)
        index = self.engine.begin(b, arrays, dsync=self._dsync)
        if carry is not None:
            self._owed.setdefault(i, {})[index] = (carry, self._pipelined)
        return index

    def finish(self, b, index: int):
        """The gradient the step of round ``index`` applies (see :meth:`step`).

        Args:
          b: the :class:`~tfsparse.bucket.Bucket`.
          index: what :meth:`begin` returned.

        Returns:
          The bucket's vector to apply (zeros or the previous result where pipelined).
        """
        engine = self.engine
        carry, pipelined = self._owed.get(b.spec.index, {}).pop(index, (None, False))
        if not pipelined:
            out = engine.finish(b, index)
            return out if carry is None else engine.space.plus(out, carry)
        first, steps = self._sync_points or (0, 0)
        if steps and index >= first and (index - first + 1) % steps == 0:
            self._held[b.spec.index] = engine.finish(b, index)  # an epoch's last step: nothing stays in flight
        else:
            self._next_owed[b.spec.index] = index
        return carry

    def _take(self, b):
        """What the bucket owes the step being started: the previous round's result (waiting for
        its communication), or zeros when nothing is owed."""
        self._hold_owed(b)
        out = self._held.pop(b.spec.index, None)
        return self.engine.space.zeros(b.spec.size) if out is None else out

    def _hold_owed(self, b) -> None:
        index = self._next_owed.pop(b.spec.index, None)
        if index is not None:
            self._held[b.spec.index] = self.engine.finish(b, index)

    @property
    def pending(self) -> bool:
        """Whether a pipelined round's result is owed to the next step (in flight or held)."""
        return any(v is not None for v in (*self._held.values(), *self._next_owed.values()))

    @property
    def in_flight(self) -> bool:
        """Whether a pipelined round owed to the next step is still on the wire."""
        return any(v is not None for v in self._next_owed.values())

    @in_space
    def flush(self) -> None:
        """Finishes the communication of the pipelined round owed to the next step and holds its
        result (the next :meth:`step` applies it; :meth:`get_state` saves it).  Call it on every
        rank at the same point; it waits for the communication thread, nothing else."""
        self._place_restored()
        for b in self.engine.bucket_states:
            self._hold_owed(b)

    # -- explicit state ---------------------------------------------------
    @in_space
    def get_state(self) -> dict:
        """The engine's state (:meth:`GradientExchange.get_state`) and the result the next step applies.

        A pipelined round owed to the next step is finished first (:meth:`flush`); not while a
        synchronous round is in flight.

        Returns:
          A dict; with ``pending`` (over the layout) when a finished result is held.
        """
        engine = self.engine
        if not engine.bucket_states:
            return engine.get_state()
        self.flush()
        state = engine.get_state()
        if any(self._held.get(b.spec.index) is not None for b in engine.bucket_states):
            state["pending"] = engine.over_layout(lambda b: self._held.get(b.spec.index))
        return state

    @in_space
    def set_state(self, state: dict) -> None:
        """Restores :meth:`get_state`'s output (before the engine is built, at its build).

        Args:
          state: what :meth:`get_state` returned.
        """
        engine = self.engine
        if engine.bucket_states:
            self.flush()
        engine.set_state(state)  # before the build, kept whole (``pending`` included) until it
        pending = state.get("pending")
        self._restored = (None if pending is None else np.asarray(pending),)
        self._place_restored()

    def _place_restored(self) -> None:
        """A restored ``pending`` placed in the buckets' held results, once they exist."""
        engine = self.engine
        if self._restored is None or not engine.bucket_states:
            return
        (pending,), self._restored = self._restored, None
        for b in engine.bucket_states:
            self._held[b.spec.index] = None if pending is None else \
                engine.space.from_host(pending.reshape(-1)[b.spec.start:b.spec.stop])

    def __repr__(self):
        return f"Pipelined({self.engine!r}, depth={self.depth})"


for _name in ENGINE_VIEWS:
    setattr(Pipelined, _name, _engine_view(_name))
del _name
