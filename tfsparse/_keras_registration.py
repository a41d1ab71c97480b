"""Registers tfsparse's Keras objects with Keras' serialization as soon as Keras is imported,
so that ``keras.models.load_model`` finds ``tfsparse>DistributedOptimizer`` after a plain
``import tfsparse``, without TensorFlow or Keras being imported by ``import tfsparse`` itself.

Keras 3 only finds custom classes that are registered (``@keras.saving.register_keras_serializable``
runs when :mod:`tfsparse.keras.optimizer` is imported); it never imports a module named in a
model file outside its own packages.  Importing :mod:`tfsparse.keras` from ``import tfsparse``
would import Keras and TensorFlow (seconds) for every numpy-only user of
:mod:`tfsparse.collectives`.  So :func:`install`, called by ``import tfsparse``:

* imports :mod:`tfsparse.keras` at once when Keras is already imported (it then costs only
  tfsparse's own modules, tens of milliseconds);
* otherwise puts a finder at the front of ``sys.meta_path`` that answers for the top-level
  ``keras`` module only: it lets the other finders find it, and once Keras' own ``__init__`` has
  run, imports :mod:`tfsparse.keras` and takes itself off ``sys.meta_path``.  Keras itself is not
  changed, and the module's loader is the normal one while and after it runs.

A failure to register (a Keras without TensorFlow, say) becomes a ``RuntimeWarning``, never an
error in the user's ``import keras``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
import warnings

_TARGET = "keras"
_lock = threading.Lock()


def register() -> None:
    """Imports :mod:`tfsparse.keras`, whose classes register themselves with Keras."""
    if "tfsparse.keras" in sys.modules:  # imported (or being imported: it registers when it ends)
        return
    try:
        importlib.import_module("tfsparse.keras")
    except Exception as e:  # never break the user's `import keras`
        warnings.warn(f"tfsparse could not register its Keras objects ({type(e).__name__}: {e}); "
                      "import tfsparse.keras before keras.models.load_model of a model that uses them",
                      RuntimeWarning, stacklevel=2)


def _fully_imported(name: str) -> bool:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class _RegisterAfterKeras(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the top-level ``keras`` module that the other
    finders return, so that :func:`register` runs right after Keras' ``__init__``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _ThenRegister(loader, spec, self)
        return spec


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader, spec, finder):
        self._loader, self._spec, self._finder = loader, spec, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # Keras runs with its own loader in place; only afterwards are tfsparse's classes imported
        self._spec.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        _uninstall(self._finder)
        register()


_finder: _RegisterAfterKeras | None = None


def _uninstall(finder) -> None:
    global _finder
    with _lock:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        if _finder is finder:
            _finder = None


def install() -> None:
    """Registers now when Keras is imported, else as soon as it is; idempotent."""
    global _finder
    if _fully_imported(_TARGET):
        register()
        return
    with _lock:
        if _finder is None:
            _finder = _RegisterAfterKeras()
            sys.meta_path.insert(0, _finder)
