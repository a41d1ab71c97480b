"""One registry for every family of named stages (aggregators, memories, wires, compressors):
modules register their classes with a decorator, users name them in an argument.  Imports nothing
from the package but :mod:`tfsparse._checks`, so every module may use it."""
from __future__ import annotations

from . import _checks


class Registry:
    """Named entries of one ``kind`` (``"aggregator"``) that the argument ``argument``
    (``"algorithm"``) names.

    * :meth:`register` -- a class decorator: ``@REGISTRY.register`` registers the class under its
      ``name`` attribute, ``@REGISTRY.register("gtopk")`` under the name given (and sets the
      class's ``name``); a name registered twice is an error.  What is kept is ``make(cls)``
      (default: the class itself; the wires keep one instance each).
    * :meth:`names` -- sorted, or in registration order (``ordered=True``).
    * :meth:`get` -- the entry named; a ``ValueError`` naming the argument, the value and the
      names otherwise (:func:`tfsparse._checks.choice`)."""

    def __init__(self, kind: str, argument: str, *, ordered: bool = False, make=None):
        self.kind, self.argument, self.ordered = kind, argument, ordered
        self._make = make or (lambda cls: cls)
        self._entries: dict = {}

    def register(self, cls_or_name=None):
        if isinstance(cls_or_name, str):
            name = cls_or_name

            def named(cls):
                cls.name = name
                return self._add(name, cls)

            return named
        return self._add(cls_or_name.name, cls_or_name)

    def _add(self, name: str, cls):
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = self._make(cls)
        return cls

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries) if self.ordered else tuple(sorted(self._entries))

    def get(self, name, accepted: str | None = None):
        """``accepted``: what the error lists as accepted (default: the names)."""
        return self._entries[_checks.choice(self.argument, name, self.names(), accepted=accepted)]

    def items(self):
        """``(name, entry)`` pairs in :meth:`names` order."""
        return [(n, self._entries[n]) for n in self.names()]
