"""The replica check's kernel (:func:`tfsparse.ops.cpu.word_sums`, behind
:func:`tfsparse.keras.replicas.digest`): the two sums of a variable's 32-bit words in one pass,
with no temporaries -- the numpy expression of the same sums makes arrays of 64-bit words the
size of the variable, page-faulted in afresh each time (both timed by tools/bench_choices.py:
``digest`` in docs/engine_choices.json)."""
from __future__ import annotations

import numpy as np
from numba import njit

#: the position weights run 1..WEIGHT_MOD (the largest prime below 2**16), then start again
WEIGHT_MOD = 65521


@njit(cache=True, nogil=True)
def _word_sums(words, out):
    """``out[0]``: the sum of ``words`` (uint32) and ``out[1]``: the sum of each word times its
    position mod :data:`WEIGHT_MOD` plus one, both modulo 2**64 (uint64 arithmetic wraps)."""
    total = np.uint64(0)
    weighted = np.uint64(0)
    n = words.size
    start = 0
    while start < n:
        end = min(start + WEIGHT_MOD, n)
        for j in range(start, end):
            v = np.uint64(words[j])
            total += v
            weighted += v * np.uint64(j - start + 1)
        start = end
    out[0] = total
    out[1] = weighted
