"""The CPU kernels' shared pieces (:mod:`tfsparse.ops.cpu`): chunk and block sizes, the
magnitude key, the block skip tests and the LLVM intrinsics (16-bit conversions, non-temporal
stores, AVX-512 compressing stores) the selection and quantization kernels inline."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

from . import _common as C

_ABS = C.ABS_MASK
_NANK = C.NAN_KEY
_INFK = C.INF_KEY
_CH = 1 << 16        # elements per parallel chunk
_STG = 4096          # staging slots per chunk (a chunk with more hits is rescanned)
_BLK = 64            # elements per skip test
_SUB = 8             # elements per second-level test inside a hit block
_U1 = np.uint32(1)


# ----------------------------------------------------------------------------- conversions

@intrinsic
def _to_half(typingctx, x):
    """float32 -> IEEE binary16 bits, round to nearest even: LLVM's ``fptrunc`` to ``half``, one
    instruction where the CPU has it (x86 F16C ``vcvtps2ph``, vectorised)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def _from_half(typingctx, h):
    """IEEE binary16 bits -> float32 (exact): LLVM's ``fpext`` (``vcvtph2ps``)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _add_stream16(typingctx, dst, i, a, b):
    """``dst[i:i + 16] = a[i:i + 16] + b[i:i + 16]`` (float32) with one non-temporal vector store:
    the 64-byte line goes to memory without being read first (a plain store reads every line it
    writes into the cache -- "read for ownership", a fourth stream for ``acc = g + r``).
    ``dst[i]`` must be 64-byte aligned; the stores are ordered only by :func:`_store_fence`."""
    def codegen(context, builder, signature, args):
        darr, di, aarr, barr = args
        vt = ir.VectorType(ir.FloatType(), 16)

        def at(arr, aty):
            data = context.make_array(aty)(context, builder, arr).data
            return builder.bitcast(builder.gep(data, [di]), vt.as_pointer())
        total = builder.fadd(builder.load(at(aarr, signature.args[2]), align=4),
                             builder.load(at(barr, signature.args[3]), align=4))
        store = builder.store(total, at(darr, signature.args[0]), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return types.void(dst, i, a, b), codegen


@intrinsic
def _copy_stream16(typingctx, dst, i, src, j):
    """``dst[i:i + 16] = src[j:j + 16]`` (float32) with one non-temporal vector store, as
    :func:`_add_stream16` stores (``dst[i]`` 64-byte aligned; ordered by :func:`_store_fence`)."""
    def codegen(context, builder, signature, args):
        darr, di, sarr, sj = args
        vt = ir.VectorType(ir.FloatType(), 16)

        def at(arr, aty, k):
            data = context.make_array(aty)(context, builder, arr).data
            return builder.bitcast(builder.gep(data, [k]), vt.as_pointer())
        value = builder.load(at(sarr, signature.args[2], sj), align=4)
        store = builder.store(value, at(darr, signature.args[0], di), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return types.void(dst, i, src, j), codegen


def _compress_store_fast() -> bool:
    """Whether the host CPU compresses a vector into memory in one cheap instruction: AVX-512F's
    ``vpcompressd/q`` on Intel.  Elsewhere LLVM expands :func:`_compress16` into a branch per
    lane (AVX2), or the store form is reported slow (AMD Zen 4; not measured here), so the
    sub-block tests stay."""
    from llvmlite import binding

    avx512 = bool(binding.get_host_cpu_features().get("avx512f"))
    return avx512 and not binding.get_host_cpu_name().startswith("znver")


#: :func:`_stage_hits` stages a hit block 16 elements at a time by :func:`_compress16` (read when
#: a kernel compiles: Numba freezes it into the machine code it caches for this CPU)
_COMPRESS = _compress_store_fast()


@intrinsic
def _compress16(typingctx, xu, x, i, kmin, st_idx, st_val, at, first):
    """Stages the elements of ``x[i:i + 16]`` whose magnitude bits ``xu & 0x7FFFFFFF`` are at
    least ``kmin`` (uint32; ``key >= klo`` for ``kmin = klo <= NAN_KEY``) at
    ``st_idx/st_val[at:]`` -- their indices numbered from ``first`` -- in order, with two
    compressing stores (``llvm.masked.compressstore``: AVX-512's ``vpcompressd/q``, no branch per
    element), and returns how many (the mask's population count).  ``st_idx/st_val[at:at + 16]``
    must exist."""
    def codegen(context, builder, signature, args):
        from numba.core import cgutils

        axu, ax, ai, akmin, aidx, aval, aat, afirst = args
        i1, i16, i32, i64 = (ir.IntType(b) for b in (1, 16, 32, 64))
        v32, v64, vf, vm = (ir.VectorType(t, 16) for t in (i32, i64, ir.FloatType(), i1))

        def at(arr, aty, k, vt=None):
            p = builder.gep(context.make_array(aty)(context, builder, arr).data, [k])
            return p if vt is None else builder.bitcast(p, vt.as_pointer())

        def splat(value, vt):
            v = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(i32, 0))
            return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(v32, [0] * 16))
        bits = builder.and_(builder.load(at(axu, signature.args[0], ai, v32), align=4),
                            ir.Constant(v32, [0x7FFFFFFF] * 16))
        mask = builder.icmp_unsigned(">=", bits, splat(builder.trunc(akmin, i32), v32))
        module = builder.module
        values = builder.load(at(ax, signature.args[1], ai, vf), align=4)
        indices = builder.add(splat(afirst, v64), ir.Constant(v64, list(range(16))))
        for value, arr, aty, vt, name in ((values, aval, signature.args[5], vf, "v16f32"),
                                          (indices, aidx, signature.args[4], v64, "v16i64")):
            fnty = ir.FunctionType(ir.VoidType(), [vt, vt.element.as_pointer(), vm])
            store = cgutils.get_or_insert_function(module, fnty, "llvm.masked.compressstore." + name)
            builder.call(store, [value, at(arr, aty, aat), mask])
        ctpop = cgutils.get_or_insert_function(module, ir.FunctionType(i16, [i16]), "llvm.ctpop.i16")
        return builder.zext(builder.call(ctpop, [builder.bitcast(mask, i16)]), i64)
    return types.int64(xu, x, i, kmin, st_idx, st_val, at, first), codegen


@intrinsic
def _store_fence(typingctx):
    """A fence after :func:`_add_stream16`'s stores (``mfence`` on x86), before others read them."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _float_bits(typingctx, x):
    """float32 -> its uint32 bits (a bit cast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _as_float(typingctx, u):
    """uint32 bits -> the float32 they encode (a bit cast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


# ----------------------------------------------------------------------------- helpers

@njit(cache=True, inline="always")
def _key(u):
    """Magnitude key of float32 bits ``u`` (see :mod:`._common`), as int64."""
    return min(np.int64(u) & _ABS, _NANK)


@njit(cache=True, inline="always")
def _shifted_max(xu, b0, b1):
    """max of ``bits << 1`` (uint32: the sign bit falls off) over ``xu[b0:b1]``; vectorises
    to 8 lanes, and is ``>= key << 1`` iff some key in the range is ``>= key`` (any NaN
    shifts above every ``key << 1``, ``key <= NAN_KEY``)."""
    y = xu[b0:b1]  # a slice from 0: LLVM vectorises it (``range(b0, b1)`` stays scalar)
    m = np.uint32(0)
    for i in range(y.size):
        m = max(m, np.uint32(y[i] << _U1))
    return m


@njit(cache=True, inline="always")
def _block_hit(xu, b0, t2):
    """Whether the full block ``xu[b0:b0+_BLK]`` holds a key ``>= t2 >> 1`` (fixed trip count,
    over a slice from 0: LLVM vectorises that, not ``xu[b0 + j]``)."""
    y = xu[b0:b0 + _BLK]
    m = np.uint32(0)
    for j in range(_BLK):
        m = max(m, np.uint32(y[j] << _U1))
    return m >= t2


@njit(cache=True, inline="always")
def _sub_hit(xu, b0, t2):
    """The same test for the ``_SUB`` elements from ``b0`` (second level, inside a hit block)."""
    y = xu[b0:b0 + _SUB]
    m = np.uint32(0)
    for j in range(_SUB):
        m = max(m, np.uint32(y[j] << _U1))
    return m >= t2


@njit(cache=True, inline="always")
def _slot(i, a, b, m64):
    h = (a * np.uint64(i) + b) >> np.uint64(32)
    return np.int64((h * m64) >> np.uint64(32))


def as_f32(x) -> np.ndarray:
    """Contiguous 1-D float32 view (or copy, if ``x`` is not already one)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    C.check_n(x.size)
    return x
