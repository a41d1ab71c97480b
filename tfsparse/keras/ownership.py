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

The variables each rank keeps as its own (:func:`keep_own`: Horovod's ``local_variables``) are
recorded here too, by model: the replica checks and the averaging of moving statistics leave them out.
"""
from __future__ import annotations

import numbers
import weakref

from ..memory import keeps_velocity

#: model -> {id(variable): variable}: the variables each rank keeps as its own (:func:`keep_own`)
_OWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def keep_own(model, variables) -> None:
    """``variables`` of ``model`` (or of its optimizer) stay each rank's own: the replica checks
    and the averaging of moving statistics leave them out, for the model's whole life.  Horovod's
    ``BroadcastGlobalVariablesCallback(local_variables=...)`` says so of the variables it does not
    broadcast.  Where Keras made the model's train function already (an earlier ``fit``, or this
    one before its callbacks begin), it is made anew, so that its next call is traced again: a
    ``SparseStrategy`` step averages the moving statistics, and checks the variables, it found
    when it was traced.  A ``tf.function`` of the user's own that runs ``model.train_step`` is
    not made anew: keep the variables before its first call.  Every rank keeps the same
    variables at the same point (the callback checks it at ``fit``'s start).

    Args:
      model: the Keras model.
      variables: its variables (or its optimizer's) that may differ between the ranks.
    """
    own = _OWN.setdefault(model, {})
    new = {id(v): v for v in variables if id(v) not in own}
    own.update(new)  # held: no other variable takes the id
    if new and getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)


def own_variables(model) -> list:
    """The variables each rank keeps as its own in ``model`` (:func:`keep_own`), in the order kept."""
    return list(_OWN.get(model, {}).values())


def own_ids(model) -> set:
    """The ids of the variables each rank keeps as its own in ``model`` (:func:`keep_own`)."""
    return set(_OWN.get(model, ()))


def owner_of(model):
    """The object that owns ``model``'s exchange: its optimizer (or one it wraps) holding an
    exchange, else its strategy when that holds one; None when the model trains without tfsparse."""
    opt = getattr(model, "optimizer", None)
    while opt is not None:
        if getattr(opt, "exchange", None) is not None:
            return opt
        opt = getattr(opt, "inner_optimizer", None)
    return sparse_strategy_of(model)


def sparse_strategy_of(model):
    """``model``'s ``tf.distribute`` strategy where it is a SparseStrategy (it holds an exchange),
    else None."""
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


def _chain(optimizer):
    """``optimizer`` and every optimizer it wraps (``inner_optimizer``), outermost first."""
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


def _innermost(optimizer):
    """The optimizer that ``optimizer`` wraps, through every ``inner_optimizer`` (itself if none)."""
    return list(_chain(optimizer))[-1]


def _momentum_to_take(optimizer) -> float | None:
    """The momentum factor the exchange can take over from ``optimizer``: that of the innermost
    ``keras.optimizers.SGD`` with ``momentum`` > 0 and without Nesterov (heavy-ball momentum is
    what momentum correction applies, DGC §3.2); None for any other optimizer."""
    import keras

    inner = _innermost(optimizer) if optimizer is not None else None
    if type(inner) is keras.optimizers.SGD and not inner.nesterov:
        momentum = inner.momentum
        if isinstance(momentum, numbers.Real) and not isinstance(momentum, bool) and momentum > 0:
            return float(momentum)
    return None


def _apply_without_momentum(sgd, taken: bool) -> None:
    """Whether ``sgd`` (a ``keras.optimizers.SGD``) applies its updates without momentum from now
    on (``taken``: the exchange applies it, momentum correction) or with it again.  Its
    ``momentum`` -- what ``get_config`` saves and the user reads -- and its momentum variables
    (kept at zero meanwhile, so that checkpoints keep their shape) stay as they are;
    ``update_step`` sees a momentum of 0 while it is traced for an exchange that took it."""
    if getattr(sgd, "_tfsparse_momentum_in_exchange", None) is None:
        if not taken:
            return
        update_step = sgd.update_step

        def update_step_without_momentum(gradient, variable, learning_rate):
            if not sgd._tfsparse_momentum_in_exchange:
                return update_step(gradient, variable, learning_rate)
            momentum = sgd.momentum
            sgd.momentum = 0.0
            try:
                return update_step(gradient, variable, learning_rate)
            finally:
                sgd.momentum = momentum

        sgd.update_step = update_step_without_momentum
    sgd._tfsparse_momentum_in_exchange = bool(taken)


def fit_optimizer(exchange, optimizer) -> None:
    """Fits ``exchange`` (a :class:`~tfsparse.pipelined.Pipelined`, not yet built) to
    ``optimizer``, the optimizer that applies its gradients: ``memory="auto"`` is decided (:meth:`~tfsparse.exchange.GradientExchange.decide_memory`)
    and the optimizer applies its updates without its momentum exactly while it trains through an
    exchange that took it over; then :func:`check_optimizer`.  On a built exchange the memory stays
    as decided."""
    if optimizer is None:
        return
    momentum = _momentum_to_take(optimizer)
    exchange.engine.decide_memory(momentum)
    if momentum is not None:
        _apply_without_momentum(_innermost(optimizer), exchange.takes_momentum)
    check_optimizer(exchange, optimizer)


def check_optimizer(exchange, optimizer) -> None:
    """``memory="momentum"`` (or ``"momentum_rows"``) applies the momentum in the exchange
    (momentum correction): an optimizer (or a wrapped ``inner_optimizer``) with ``momentum`` or
    ``beta_1`` > 0 would apply it twice -- ValueError, raised before any step.  (``memory="auto"``
    takes an SGD's momentum over instead, :func:`fit_optimizer`.)"""
    memory = exchange.requested.memory
    for opt in _chain(optimizer if keeps_velocity(memory) else None):
        if getattr(opt, "_tfsparse_momentum_in_exchange", False):
            continue
        for attr in ("momentum", "beta_1"):
            value = getattr(opt, attr, None)
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0:
                name = type(opt).__name__
                raise ValueError(
                    f"memory={memory!r} applies momentum {exchange.momentum} in the gradient exchange (momentum "
                    f"correction), and the optimizer {name} has {attr}={value}: momentum would be applied "
                    f"twice; use {name}({attr}=0.0) (e.g. keras.optimizers.SGD(learning_rate)), memory='auto' "
                    f"(the default: the exchange takes an SGD's momentum over) or memory='residual' to keep the "
                    f"optimizer's momentum")
