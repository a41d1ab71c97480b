"""Which exchange trains a model -- decided once, when the strategy or the optimizer is built,
and stored.

* A :class:`~tfsparse.SparseStrategy` builds its exchange (a
  :class:`~tfsparse.pipelined.Pipelined` round engine) from its settings; every model built in
  its scope trains through it.
* A :class:`~tfsparse.keras.DistributedOptimizer` built inside a SparseStrategy scope without
  settings of its own takes the strategy's exchange; with settings of its own, the strategy
  adopts the optimizer's exchange (:meth:`SparseStrategy.adopt_exchange`).  Either way the
  optimizer then *owns* it: the optimizer's variables carry the exchange's state in checkpoints
  and the strategy saves none.  Built outside any SparseStrategy, the optimizer runs its own
  exchange.

Each owner holds the exchange as ``exchange`` and its :class:`~tfsparse.checkpoint.Checkpointer`
as ``checkpointer``.  The Keras callbacks find both from the model here, by its attributes
(``model.optimizer``, looking through wrappers with ``inner_optimizer``, then
``model.distribute_strategy``).
"""
from __future__ import annotations

import numbers


def owner_of(model):
    """The object that owns ``model``'s exchange: its optimizer (or one it wraps) holding an
    exchange, else its strategy when that holds one; None when the model trains without tfsparse."""
    opt = getattr(model, "optimizer", None)
    while opt is not None:
        if getattr(opt, "exchange", None) is not None:
            return opt
        opt = getattr(opt, "inner_optimizer", None)
    strategy = getattr(model, "distribute_strategy", None)
    return strategy if getattr(strategy, "exchange", None) is not None else None


def exchange_of(model):
    """The exchange (:class:`~tfsparse.pipelined.Pipelined`) that trains ``model``, or None."""
    owner = owner_of(model)
    return None if owner is None else owner.exchange


def checkpointer_of(model):
    """The :class:`~tfsparse.checkpoint.Checkpointer` of ``model``'s exchange, or None."""
    owner = owner_of(model)
    return None if owner is None else owner.checkpointer


def require_exchange(model, who: str):
    """:func:`exchange_of`, or a ValueError saying that ``who`` needs a tfsparse-trained model."""
    exchange = exchange_of(model)
    if exchange is None:
        raise ValueError(f"{who} needs a model trained through tfsparse.SparseStrategy or "
                         f"tfsparse.keras.DistributedOptimizer (no gradient exchange found)")
    return exchange


def check_optimizer(exchange, optimizer) -> None:
    """``memory="momentum"`` applies the momentum in the exchange (momentum correction): an
    optimizer (or a wrapped ``inner_optimizer``) with ``momentum`` or ``beta_1`` > 0 would apply
    it twice -- ValueError, raised before any step."""
    opt = optimizer if exchange.memory == "momentum" else None
    while opt is not None:
        for attr in ("momentum", "beta_1"):
            value = getattr(opt, attr, None)
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0:
                name = type(opt).__name__
                raise ValueError(
                    f"memory='momentum' applies momentum {exchange.momentum} in the gradient exchange (momentum "
                    f"correction), and the optimizer {name} has {attr}={value}: momentum would be applied "
                    f"twice; use {name}({attr}=0.0) (e.g. keras.optimizers.SGD(learning_rate)), or "
                    f"memory='residual' to keep the optimizer's momentum")
        opt = getattr(opt, "inner_optimizer", None)
