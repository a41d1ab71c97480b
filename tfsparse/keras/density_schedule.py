"""Density warm-up: a Keras callback that sets the gradient exchange's density -- per epoch
(gtopk-ssgd-shi2019 §IV-B), or per step for a dense warm-up (gradientflow-sun2019 §3.2, DGC).

>>> model.fit(..., callbacks=[tfsparse.keras.callbacks.DensitySchedule()])       # gTop-k's warm-up
>>> DensitySchedule([0.1, 0.05])                                                 # 2 epochs, then the target
>>> DensitySchedule(lambda epoch: 0.01 if epoch < 3 else 0.001)                  # any schedule
>>> DensitySchedule(tfsparse.schedules.WarmUp(epochs=2))                         # dense, ramping per step
"""
from __future__ import annotations

import keras

from ..schedules import WarmUp, check_density
from .ownership import require_exchange

#: gtopk-ssgd-shi2019 §IV-B: "the first 4 epochs use the dynamic densities of
#: [0.25, 0.0725, 0.015, 0.004] ... the remaining epochs adopt a density of 0.001 or 0.005".
GTOPK_WARMUP = (0.25, 0.0725, 0.015, 0.004)


class DensitySchedule(keras.callbacks.Callback):
    """Sets the density of the model's exchange (:mod:`tfsparse.keras.ownership`) at each epoch's
    beginning.

    Args:
      schedule: ``None`` (default) -- gTop-k's warm-up: epochs 1-4 (Keras epochs 0-3) at
        densities 0.25, 0.0725, 0.015, 0.004, then ``target``; a warm-up density below the
        target is raised to the target (the warm-up never sends *less* than the target).
        A sequence -- epoch ``i`` (0-based) uses ``schedule[i]``, later epochs ``target``.
        A callable ``schedule(epoch) -> density`` (0-based epoch) -- used as is.
        A :class:`tfsparse.schedules.WarmUp` -- a per-*step* dense warm-up: step 0 is a true
        dense allreduce and the density ramps to ``target`` (GradientFlow's linear ramp or
        DGC's exponential one).  The exchange evaluates it at every round, counting rounds
        from the start of training (a resumed run continues it).
      target: the density after the warm-up; default: the exchange's density when training
        starts (what ``SparseStrategy``/``DistributedOptimizer`` was built with).
      verbose: 1 prints the density on rank 0 whenever it changes.

    Every rank runs the callback at the same epoch, so all ranks switch together.  The
    aggregators see the new ``k`` at the next step (Ok-Topk then re-evaluates its cached
    thresholds).
    """

    def __init__(self, schedule=None, target: float | None = None, verbose: int = 0):
        super().__init__()
        self.warmup = schedule if isinstance(schedule, WarmUp) else None
        if schedule is None:
            self._sequence, self._fn, self._clamp = tuple(GTOPK_WARMUP), None, True
        elif self.warmup is not None:
            self._sequence, self._fn, self._clamp = None, None, False
        elif callable(schedule):
            self._sequence, self._fn, self._clamp = None, schedule, False
        elif isinstance(schedule, (list, tuple)):
            self._sequence = tuple(check_density(d, f"schedule[{i}]") for i, d in enumerate(schedule))
            self._fn, self._clamp = None, False
        else:
            raise ValueError(f"schedule={schedule!r} must be None (gTop-k warm-up), a sequence of densities, "
                             f"a callable epoch -> density or a tfsparse.schedules.WarmUp")
        self.target = None if target is None else check_density(target, "target")
        self.verbose = int(verbose)
        self.history: list[float] = []

    def _exchange(self):
        return require_exchange(self.model, "DensitySchedule")

    def density_at(self, epoch: int) -> float:
        """The density scheduled for 0-based ``epoch`` (needs ``target`` set or training begun).

        Args:
          epoch: the epoch, from 0.

        Returns:
          A density in ``(0, 1]``.

        Raises:
          ValueError: a per-step warm-up (it has no density per epoch), a schedule function's value
            outside ``(0, 1]``, or ``target`` unknown before training.
        """
        if self.warmup is not None:
            raise ValueError(f"{self.warmup!r} sets the density per step, not per epoch (the exchange's "
                             f"schedule(round) gives it)")
        if self._fn is not None:
            return check_density(self._fn(int(epoch)), f"schedule({epoch})")
        if self.target is None:
            raise ValueError("DensitySchedule.target is unknown before training starts; pass target=")
        if epoch < len(self._sequence):
            d = self._sequence[epoch]
            return max(d, self.target) if self._clamp else d
        return self.target

    def on_train_begin(self, logs=None):
        """Takes the exchange's density as ``target`` when none was given; a :class:`~tfsparse.schedules.WarmUp` is
        converted to steps (this ``fit``'s steps per epoch), given the target when it has none, and set as the
        exchange's per-round schedule."""
        ex = self._exchange()
        if self.target is None:
            self.target = float(ex.density)
        if self.warmup is not None:
            warm = self.warmup.with_steps_per_epoch((self.params or {}).get("steps"))
            ex.schedule = warm if warm.target is not None else warm.with_target(self.target)

    def on_epoch_begin(self, epoch, logs=None):
        """Sets the exchange's density to :meth:`density_at` the epoch and records it in ``history`` (with
        ``verbose``, rank 0 prints a change); with a ``WarmUp``, only records the density of the coming round."""
        ex = self._exchange()
        if self.warmup is not None:  # the exchange sets the density per step
            self.history.append(ex.schedule(ex.rounds_started))
            return
        d = self.density_at(epoch)
        if self.verbose and d != ex.density and getattr(ex.comm, "rank", 0) == 0:
            print(f"DensitySchedule: epoch {epoch + 1}: density {d}")
        ex.density = d
        self.history.append(d)
