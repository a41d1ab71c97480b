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
    exchange state)."""
    files.check_saved_file(filepath)
    return keras.models.load_model(filepath, *args, **kwargs)


def load_weights(model, filepath, *args, **kwargs):
    """``model.load_weights(filepath, ...)`` after :func:`tfsparse.files.check_saved_file`."""
    files.check_saved_file(filepath)
    return model.load_weights(filepath, *args, **kwargs)
