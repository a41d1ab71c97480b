"""Name -> Aggregator class registry (no if/elif factories: modules register themselves)."""
from __future__ import annotations

import inspect

from .._registry import Registry

AGGREGATORS = Registry("aggregator", "algorithm")
register = AGGREGATORS.register  # @register("gtopk"): the class under that name


def available_aggregators() -> tuple[str, ...]:
    """The names ``algorithm=`` accepts besides ``"auto"`` (:func:`get_aggregator`), sorted.

    Returns:
      A tuple of the registered aggregators' names (``"csc"``, ``"dense"``, ``"dgc"``, ...).
    """
    return AGGREGATORS.names()


def aggregator_options(name: str) -> tuple[str, ...]:
    """The option names the aggregator registered as ``name`` takes (its constructor's named
    keyword arguments), in the constructor's order.

    Args:
      name: a registered aggregator's name.

    Returns:
      A tuple of option names.

    Raises:
      ValueError: ``name`` is not registered.
    """
    params = inspect.signature(AGGREGATORS.get(name)).parameters.values()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def get_aggregator(name: str, **options):
    """Instantiates the aggregator registered as ``name`` with ``options``.

    Args:
      name: a registered aggregator's name (:func:`available_aggregators`).
      **options: its options.

    Returns:
      A new :class:`~tfsparse.aggregators.Aggregator`.

    Raises:
      ValueError: an unknown name or option, or an option's bad value.
    """
    cls = AGGREGATORS.get(name)
    try:
        return cls(**options)
    except TypeError as e:
        accepted = ", ".join(aggregator_options(name)) or "none"
        raise ValueError(f"invalid options for algorithm={name!r}: {e}; accepted options: {accepted}") from None
