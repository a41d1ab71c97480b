"""Loading what :class:`tfsparse.keras.callbacks.ModelCheckpoint` wrote, with a clear error for
an incomplete file (Keras reports a truncated ``.keras`` file as "File not found")."""
from __future__ import annotations

import keras

from .. import files
from . import optimizer  # noqa: F401  (registers DistributedOptimizer with Keras' serialization)


def load_model(filepath, *args, **kwargs):
    """``keras.models.load_model(filepath, ...)`` after :func:`tfsparse.files.check_saved_file`:
    a missing file raises ``FileNotFoundError``, an incomplete one
    :class:`tfsparse.files.TruncatedFile` naming its size -- instead of Keras' "File not found"
    for both.  Like Horovod's ``hvd.load_model``; a file with a ``DistributedOptimizer`` loads as
    one (load a SparseStrategy's model inside that strategy's scope, so each rank takes its own
    exchange state).

    Args:
      filepath: the ``.keras`` file.
      *args: Keras' own arguments (``custom_objects``, ``compile``, ``safe_mode``).
      **kwargs: Keras' own arguments (``custom_objects``, ``compile``, ``safe_mode``).

    Returns:
      The Keras model.

    Raises:
      FileNotFoundError: no file at ``filepath``.
      tfsparse.files.TruncatedFile: the file is incomplete (a save that did not finish).
    """
    files.check_saved_file(filepath)
    return keras.models.load_model(filepath, *args, **kwargs)


def load_weights(model, filepath, *args, **kwargs):
    """``model.load_weights(filepath, ...)`` after :func:`tfsparse.files.check_saved_file`.

    Args:
      model: the Keras model whose weights are set.
      filepath: the ``.weights.h5`` (or ``.keras``) file.
      *args: Keras' own arguments (``skip_mismatch``).
      **kwargs: Keras' own arguments (``skip_mismatch``).

    Returns:
      What ``model.load_weights`` returns (None in Keras 3).

    Raises:
      FileNotFoundError: no file at ``filepath``.
      tfsparse.files.TruncatedFile: the file is incomplete.
    """
    files.check_saved_file(filepath)
    return model.load_weights(filepath, *args, **kwargs)
