"""Name -> Aggregator class registry (no if/elif factories: modules register themselves)."""
from __future__ import annotations

import inspect

from .. import _checks

_REGISTRY: dict = {}


def register(name: str):
    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"aggregator {name!r} is registered twice")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def available_aggregators() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def aggregator_options(name: str) -> tuple[str, ...]:
    """The option names the aggregator registered as ``name`` takes (its constructor's named
    keyword arguments), in the constructor's order."""
    params = inspect.signature(_REGISTRY[name]).parameters.values()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def get_aggregator(name: str, **options):
    """Instantiates the aggregator registered as ``name`` with ``options``."""
    cls = _REGISTRY[_checks.choice("algorithm", name, available_aggregators())]
    try:
        return cls(**options)
    except TypeError as e:
        accepted = ", ".join(aggregator_options(name)) or "none"
        raise ValueError(f"invalid options for algorithm={name!r}: {e}; accepted options: {accepted}") from None
