"""The exchange's part of a Keras checkpoint: every rank's state in rank 0's file.

Error feedback is per rank (each rank's residual holds what *it* has not sent), so a file that
resumes training exactly must hold every rank's exchange state, while only rank 0 writes it.
:class:`Checkpointer` (one per exchange, held by its Keras owner -- the strategy or the
``DistributedOptimizer``, :mod:`tfsparse.keras.ownership`) does both halves:

* :meth:`Checkpointer.gather` (collective, every rank, at a save point): every rank's
  ``get_state()`` stacked along a new first axis, kept on rank 0 for its next save;
* :meth:`Checkpointer.entries` -- what the Keras store receives: ``tfsparse.<key>`` for every
  state key (a row per rank) and ``tfsparse.ranks`` (whose rows these are);
* :meth:`Checkpointer.restore` -- each rank takes its own row; a file saved by another number
  of ranks (or without the gather) spreads the saved residuals evenly, with a warning.

The exchange is anything with ``get_state``/``set_state``, ``comm``, ``rounds_done``,
``check_idle`` and ``run_collective``: a :class:`~tfsparse.exchange.GradientExchange` or its
:class:`~tfsparse.pipelined.Pipelined` wrapper.
"""
from __future__ import annotations

import warnings

import numpy as np

PREFIX = "tfsparse."


def is_entry(key) -> bool:
    """Whether a Keras store key belongs to the exchange's state.

    Args:
      key: a key of a Keras weights store.

    Returns:
      True where it starts with :data:`PREFIX`.
    """
    return str(key).startswith(PREFIX)


class Checkpointer:
    """Gathers, saves and restores one exchange's state in Keras checkpoints.

    Args:
      exchange: the :class:`~tfsparse.exchange.GradientExchange`.
    """

    def __init__(self, exchange):
        self.exchange = exchange
        self._gathered: tuple | None = None  # (round, every rank's state), on rank 0

    def gather(self) -> dict:
        """Collective: every rank's ``get_state()``, stacked along a new first axis (rank order).

        Rank 0 keeps it for its next checkpoint (:meth:`entries`).

        Returns:
          ``{name: array}``, each with one row per rank.

        Raises:
          RuntimeError: the ranks hold states of different sizes, or a round is in flight.
        """
        ex = self.exchange
        state = ex.get_state()
        keys = sorted(state)
        mine = np.concatenate([np.ascontiguousarray(state[k]).reshape(-1).view(np.uint8) for k in keys]) \
            if keys else np.empty(0, np.uint8)
        ex.check_idle("gather_state()")
        parts = ex.run_collective(lambda c: c.allgather(mine))
        if any(p.size != mine.size for p in parts):
            raise RuntimeError(f"ranks hold exchange states of different sizes ({[p.size for p in parts]} bytes)")
        stacked, off = {}, 0
        for k in keys:
            v = np.ascontiguousarray(state[k])
            nb = v.nbytes
            stacked[k] = np.stack([p[off:off + nb].view(v.dtype).reshape(v.shape) for p in parts])
            off += nb
        if ex.comm.rank == 0:
            self._gathered = (ex.rounds_done, stacked)
        return stacked

    def entries(self) -> dict:
        """What a Keras checkpoint stores.

        The states gathered from every rank (when :meth:`gather` ran since the last round), else this
        rank's own; ``tfsparse.ranks`` says whose rows these are.

        Returns:
          ``{"tfsparse.<name>": array}``; empty for an exchange never used.
        """
        ex = self.exchange
        gathered, self._gathered = self._gathered, None
        if gathered is not None and gathered[0] == ex.rounds_done:
            rows = gathered[1]
            ranks = np.arange(ex.comm.size, dtype=np.int64)
        else:
            state = ex.get_state()
            if not state:
                return {}  # never used: nothing to save
            rows = {k: v[None] for k, v in state.items()}
            ranks = np.array([ex.comm.rank], np.int64)
        entries = {PREFIX + k: v for k, v in rows.items()}
        entries[PREFIX + "ranks"] = ranks
        return entries

    def restore(self, entries) -> bool:
        """Restores :meth:`entries`; each rank takes its own row.

        A file without every rank's row (another number of ranks, or saved without
        ``tfsparse.keras.callbacks.ModelCheckpoint``'s gather): the saved residuals, and momentum
        correction's velocities, are summed and spread evenly over the ranks (the pending update
        they hold is kept: each rank's velocity adds its share to every later round) and every rank
        takes the first row's aggregator state (so that all ranks keep one schedule); a warning
        says so.

        Args:
          entries: a mapping, e.g. a Keras weights store.

        Returns:
          Whether there was anything to restore.
        """
        keys = [k for k in entries.keys() if is_entry(k)]
        if PREFIX + "ranks" not in keys:
            return False
        ranks = np.asarray(entries[PREFIX + "ranks"]).reshape(-1).tolist()
        rows = {k[len(PREFIX):]: np.asarray(entries[k]) for k in keys if k != PREFIX + "ranks"}
        size, rank = self.exchange.comm.size, self.exchange.comm.rank
        if ranks == list(range(size)):
            state = {k: v[rank] for k, v in rows.items()}
        else:
            warnings.warn(f"the checkpoint holds the exchange state of ranks {ranks}, this job has {size} ranks: "
                          f"the saved residuals (and velocities) are spread evenly and rank {ranks[0]}'s aggregator "
                          f"state is used on every rank (save with tfsparse.keras.callbacks.ModelCheckpoint to keep "
                          f"every rank's)",
                          RuntimeWarning, stacklevel=2)
            state = {k: v[0] for k, v in rows.items()}
            for key in ("residual", "velocity"):  # each rank's pending update: summed, then shared out
                if key in rows:
                    state[key] = (rows[key].astype(np.float64).sum(axis=0) / size).astype(np.float32)
        self.exchange.set_state(state)
        return True
