from .sparse_strategy import SparseStrategy, StepCountMismatch, check_step_counts

# tfsparse's Keras classes register with Keras' serialization at import of tfsparse.keras: a model
# file saved with a DistributedOptimizer loads wherever a SparseStrategy is used, too
from .. import keras as _keras  # noqa: E402,F401

__all__ = ["SparseStrategy", "StepCountMismatch", "check_step_counts"]
