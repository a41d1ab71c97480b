"""Density schedules: which fraction of the gradient a step sends.

:class:`WarmUp` is the dense warm-up of gradientflow-sun2019 §3.2 ("Warm-Up Dense Training":
"we start from dense training with zero sparsity ratio and linearly ramping up the sparsity
ratio to the final value") and of DGC (Lin et al. 2018 §3.3, sparsity raised exponentially,
75 %, 93.75 %, 98.4375 %, ..., during the first epochs).  It is a per-*step* schedule,
evaluated by the exchange at the start of every round (``GradientExchange.schedule``), so it
holds with any ``steps_per_execution`` and in custom training loops, and a resumed run
continues it from its saved round.  A step at density 1 is a true dense allreduce.

```python
>>> from tfsparse.schedules import WarmUp
>>> w = WarmUp(steps=4, target=0.01)
>>> [round(w(s), 4) for s in range(6)]
[1.0, 0.7525, 0.505, 0.2575, 0.01, 0.01]
```

Keras users pass it to ``tfsparse.keras.callbacks.DensitySchedule(WarmUp(epochs=2))``, which
fills in ``target`` (the exchange's density) and, for ``epochs=``, the steps per epoch.
"""
from __future__ import annotations

import copy
import math

from . import _checks

RAMPS = ("linear", "exponential")
#: DRAGONN's code and its DGC baseline run every tensor of at most this many elements
#: (``numel <= 1024*128``) at density 0.01, whatever the requested density
SMALL_TENSOR = 1024 * 128


def check_density(density, name: str = "density") -> float:
    """``density`` checked to be a fraction of the gradient: a finite real number in ``(0, 1]``.

    Args:
      density: the value to check.
      name: the argument's name in the error message (default ``"density"``).

    Returns:
      ``density`` as a float.

    Raises:
      ValueError: when it is not a number in ``(0, 1]``.
    """
    return _checks.real(name, density, 0.0, 1.0, lo_open=True,
                        hint=f" (the fraction of gradient elements each rank sends), e.g. {name}=0.01")


def k_from_density(n: int, density: float) -> int:
    """``k = ceil(density · n)``, at least 1 and at most ``n``: the entries a bucket of ``n`` elements sends.

    What the exchange asks of its aggregators, and what the α-β simulator (:mod:`tfsparse.timing`)
    and the cost model (:mod:`tfsparse.selection`) price.

    Args:
      n: the bucket's elements (> 0).
      density: the fraction to send, in ``(0, 1]``.

    Returns:
      ``k``, an int.
    """
    return int(min(n, max(1, math.ceil(density * n))))


def small_tensor_k(n: int, k: int, small_density: float | None) -> int:
    """``k``, or for a tensor of at most :data:`SMALL_TENSOR` elements, ``int(n * small_density)``.

    With ``small_density`` (the authors' 0.01), at least 1.  What the DGC and DRAGONN compressors
    send, and what the α-β simulator prices.

    Args:
      n: the tensor's elements.
      k: the entries its density gives (:func:`k_from_density`).
      small_density: the density of small tensors, or None (``k`` for every tensor).

    Returns:
      The entries to send, an int.
    """
    if small_density is None or n > SMALL_TENSOR or k <= 0:
        return k
    return max(1, int(n * small_density))


class WarmUp:
    """Dense warm-up: step 0 dense, ramping to ``target`` over the first ``steps`` steps.

    Args:
      steps: warm-up length in steps (training rounds of the exchange).
      epochs: or the length in epochs (a float is allowed); needs the steps per epoch,
        which ``DensitySchedule`` supplies (:meth:`with_steps_per_epoch`).
      ramp: ``"linear"`` (default, GradientFlow §3.2): the sparsity ``1 − density`` rises
        linearly from 0 at step 0 to ``1 − target`` at ``steps``;  ``"exponential"`` (DGC):
        the density falls 4× per stage -- 1, 0.25, 0.0625, ... while above ``target`` --
        in stages of equal length that fill ``steps``.
      target: the density after the warm-up; ``None``: the exchange's (filled in by
        ``DensitySchedule``).

    ``warmup(step)`` is the density of 0-based ``step``; ``steps=0`` is no warm-up.
    """

    def __init__(self, steps: int | None = None, *, epochs: float | None = None, ramp: str = "linear",
                 target: float | None = None):
        if (steps is None) == (epochs is None):
            raise ValueError(f"WarmUp takes steps= or epochs= (one of them), got steps={steps!r}, epochs={epochs!r}")
        self.steps = None if steps is None else _checks.integer("steps", steps, 0)
        self.epochs = None if epochs is None else _checks.real("epochs", epochs, 0.0)
        self.ramp = _checks.choice("ramp", ramp, RAMPS)
        self.target = None if target is None else check_density(target, "target")

    def with_steps_per_epoch(self, steps_per_epoch) -> "WarmUp":
        """This warm-up with ``epochs`` converted to steps (itself when given in steps).

        Args:
          steps_per_epoch: the steps of an epoch (``DensitySchedule`` passes ``fit``'s).

        Returns:
          A :class:`WarmUp` in steps.

        Raises:
          ValueError: a warm-up in epochs and an unknown (or non-positive) ``steps_per_epoch``.
        """
        if self.steps is not None:
            return self
        if steps_per_epoch is None or steps_per_epoch <= 0:
            raise ValueError(f"WarmUp(epochs={self.epochs}) needs the number of steps per epoch, which is unknown "
                             f"here (a dataset of unknown length?); give WarmUp(steps=...) instead")
        return WarmUp(math.ceil(self.epochs * steps_per_epoch), ramp=self.ramp, target=self.target)

    def with_target(self, target: float) -> "WarmUp":
        """A copy of this warm-up that ramps to ``target``.

        Args:
          target: the density after the warm-up, in ``(0, 1]``.

        Returns:
          A new :class:`WarmUp`; this one is left as it is.
        """
        w = copy.copy(self)
        w.target = check_density(target, "target")
        return w

    def stages(self) -> list[float]:
        """The exponential ramp's densities (1, 0.25, ... while above ``target``).

        Returns:
          A list of densities, one per stage.
        """
        levels, d = [], 1.0
        while d > self.target:
            levels.append(d)
            d /= 4.0
        return levels

    def __call__(self, step: int) -> float:
        if self.steps is None or self.target is None:
            raise ValueError("WarmUp needs steps and target before use (DensitySchedule fills them in: "
                             "with_steps_per_epoch(), with_target())")
        step = int(step)
        if step >= self.steps:
            return self.target
        if self.ramp == "linear":
            return 1.0 - (1.0 - self.target) * step / self.steps
        levels = self.stages()
        return levels[min(len(levels) - 1, step * len(levels) // self.steps)]

    def __repr__(self):
        length = f"steps={self.steps}" if self.steps is not None else f"epochs={self.epochs}"
        return f"WarmUp({length}, ramp={self.ramp!r}, target={self.target})"
