"""CPU atomics for Numba ``@njit`` code (LLVM ``atomicrmw``), which Numba itself does not expose.

Used by the parallel DRAGONN hash select (dragonn-wang2022 §3.2: "memory writing is an
atomic operation"): ``atomic_max_i64`` makes concurrent writers to one slot agree on the
largest index, which is exactly what the sequential loop of Alg. 1 leaves there
(the last writer wins and indices are visited in ascending order).
"""
from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def atomic_max_i64(typingctx, arr, index, value):
    """``old = arr[index]; arr[index] = max(old, value); return old`` atomically (int64 arrays)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None
    sig = types.int64(arr, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        ary = context.make_array(arrty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arrty, ary, [args[1]], wraparound=False)
        return builder.atomic_rmw("max", ptr, args[2], "monotonic")

    return sig, codegen
