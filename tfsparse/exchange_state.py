"""The explicit state of a :class:`~tfsparse.exchange.GradientExchange`: the memories' residuals and
velocities over the layout, every bucket aggregator's state and the round counter, saved
(:meth:`~ExchangeState.get_state`), restored (:meth:`~ExchangeState.set_state`) and carried to the
exchange of a changed trainable set (:meth:`~ExchangeState.carry_memory`)."""
from __future__ import annotations

import numpy as np

from .bucket import check_saved_layout
from .space import in_space


class ExchangeState:
    """:class:`~tfsparse.exchange.GradientExchange`'s state methods (a base of it: they read its
    layout, buckets, space, round counter and pending state)."""

    @property
    def residual(self) -> np.ndarray | None:
        """This rank's residual over the whole layout (a copy; zeros where no memory is kept),
        None when none is kept (or none exists yet)."""
        if not self.bucket_states:
            pending = (self._pending_state or {}).get("residual")
            return None if pending is None else np.array(pending, np.float32).reshape(-1)
        return self.over_layout(lambda b: b.memory.residual, lambda b: b.memory.space) if self.uses_memory else None

    def over_layout(self, part, space_of=None) -> np.ndarray:
        """A vector of every bucket placed over the whole layout.

        Args:
          part: ``part(bucket)``: the bucket's vector, or None (zeros there).
          space_of: ``space_of(bucket)``: where that vector lives; None: the exchange's space.

        Returns:
          A float32 host vector of the layout's elements.
        """
        out = np.zeros(self.layout.n, np.float32)
        for b in self.bucket_states:
            value = part(b)
            if value is not None:
                out[b.spec.start:b.spec.stop] = (space_of(b) if space_of else self.space).to_host(value)
        return out

    def check_idle(self, what: str) -> None:
        """Raises when a round is in flight: the state must not mix two rounds.

        Args:
          what: the operation that needs none (named in the error).

        Raises:
          RuntimeError: naming ``what`` and the busy buckets.
        """
        busy = sorted(b.spec.index for b in self.bucket_states if b.futures)
        if busy:
            raise RuntimeError(f"{what} while a round is in flight (buckets {busy}); wait() for it first: the "
                               f"state must not mix two rounds")

    @in_space
    def get_state(self) -> dict:
        """The exchange's explicit state, as numpy arrays.  Not while a round is in flight.

        Returns:
          ``{name: numpy array}``: ``round`` (rounds done), ``sizes`` (the layout), ``buckets`` (the
          plan's element ranges), the memories' state over the layout (``residual`` when kept,
          ``velocity`` for momentum correction), auto's choice where it runs, and ``bucket<i>.<key>``
          for every bucket aggregator's state.
        """
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
        """Restores :meth:`get_state`'s output (before :meth:`build`, it is applied at build).

        Args:
          state: what :meth:`get_state` returned (on this rank, or a checkpoint's row).

        Raises:
          ValueError: the state was saved for another layout or plan.
          RuntimeError: a round is in flight (once built).
        """
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

    def carry_memory(self, other: "ExchangeState") -> list[str]:
        """Takes ``other``'s memory of every tensor both layouts share -- the same name and shape.

        Keeps its own elsewhere.  For a model whose trainable set changed (layers frozen or unfrozen:
        a new exchange for the new set, built already) so that what the old set had not sent yet is
        still sent.  The aggregators' own state (thresholds, Ok-Topk's reused boundaries) and the
        round counter start afresh.  Neither exchange may have a round in flight.

        Args:
          other: the exchange of the previous trainable set.

        Returns:
          The names of the tensors carried.
        """
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
