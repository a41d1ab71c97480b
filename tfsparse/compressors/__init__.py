"""Compressors decide *what* a rank sends: a sparse (indices, values) payload of its
accumulated gradient (GRACE's "compressor" part).

Each compressor maps ``acc`` (float32, 1-D: gradient + residual) and a budget ``k``
to ``(indices, values)`` with ``indices`` int64 and ascending, and says how many entries it
expects to send (:meth:`Compressor.expected_count`: what the α-β schedule of an aggregator that
sends its payload prices, :mod:`tfsparse.timing`).  Every aggregator that selects locally
selects through one (``aggregator.compressor``).

The compressors by paper: :mod:`~tfsparse.compressors.base` (the interface, the registry, the
shared selection helpers), :mod:`~tfsparse.compressors.topk` (exact top-k, identity),
:mod:`~tfsparse.compressors.dgc`, :mod:`~tfsparse.compressors.dragonn`,
:mod:`~tfsparse.compressors.gaussiank` and :mod:`~tfsparse.compressors.oktopk`; every name is
importable from here.
"""
from .base import (COMPRESSORS, Candidates, Compressor, Prefilter, check_compressor, check_small_density,  # noqa: F401
                   compressors_by_name, magnitudes, sample_sizes, sampled_count, threshold_select)
# each module registers its compressors as it is imported
from .topk import Identity, TopK, topk_indices, topk_of, topk_prefilter, topk_with_values  # noqa: F401
from .dgc import DGCSampledThreshold  # noqa: F401
from .dragonn import HashedThreshold  # noqa: F401
from .gaussiank import GaussianKThreshold  # noqa: F401
from .oktopk import ReusedThreshold, adjusted_threshold, check_factor, kth_largest_magnitude, select_local  # noqa: F401
