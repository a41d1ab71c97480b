"""Compression kernels (Numba CPU + CUDA) used by the aggregators and compressors.

>>> import tfsparse.ops as ops
>>> idx, val = ops.topk_abs(x, k)          # numpy in -> numpy out; device arrays -> CUDA

Each function dispatches on where its input lives (:mod:`._dispatch`): numpy arrays
run the ``@njit`` kernels of :mod:`.cpu`, device arrays (``__cuda_array_interface__``
or CUDA DLPack) run the ``numba.cuda`` kernels of :mod:`.cuda`.  :mod:`.reference`
holds the numpy definitions the tests compare against; :mod:`.tf` is the TensorFlow side
(where a gradient exchange inside a TF graph runs: host or GPU).  NaN policy everywhere:
NaN ranks above +-Inf above every number, so non-finite gradients are always selected
(see :mod:`._common`).
"""
from ._dispatch import (backend, chunk_l1_norms, dequantize_int8, device_kind, hash_select, kth_largest_abs,
                        quantize_int8, sample_threshold, scatter_add, select_threshold, topk_abs, truncate_fp16)

__all__ = ["topk_abs", "kth_largest_abs", "sample_threshold", "select_threshold", "hash_select", "scatter_add",
           "quantize_int8", "dequantize_int8", "truncate_fp16", "chunk_l1_norms", "device_kind", "backend"]
