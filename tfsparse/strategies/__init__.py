from .sparse_strategy import SparseStrategy, StepCountMismatch, check_step_counts

__all__ = ["SparseStrategy", "StepCountMismatch", "check_step_counts"]
