"""The CUDA kernels (``numba.cuda``) of :mod:`tfsparse.ops.cuda`, device side: the tile kernels
built per block shape (compaction, radix select, chunk norms), the elementwise kernels (hashing,
scatter, quantization, the exchange buffers' arithmetic), their ahead-of-time signatures and
:class:`Kernels`, the set for one launch shape.  The host wrappers, what callers use, are in
:mod:`tfsparse.ops.cuda`."""
from __future__ import annotations

import sys
import threading
import time

import numba
import numpy as np
from numba import config as _numba_config
from numba import cuda
from numba import types as nt
from numba.cuda import libdevice

from . import _common as C

#: what the kernels are tested with (the ``cuda`` extra and tools/install.sh pin it)
SUPPORTED = "numba-cuda 0.30.x with numpy < 2.5"


def check_versions() -> None:
    """ImportError, saying what to install, where this numba-cuda cannot compile kernels with this
    numpy: numba-cuda 0.30 registers ``numpy.row_stack``, which numpy 2.5 removed, so every kernel
    compile fails with "module 'numpy' has no attribute 'row_stack'"."""
    if hasattr(np, "row_stack"):
        return
    try:
        import numba.cuda.np.arrayobj  # noqa: F401 -- where numba-cuda registers numpy.row_stack
    except AttributeError as e:
        if "row_stack" not in str(e):
            raise
        from importlib import metadata

        try:
            version = metadata.version("numba-cuda")
        except metadata.PackageNotFoundError:
            version = "?"
        raise ImportError(f"numba-cuda {version} cannot compile CUDA kernels with numpy {np.__version__} (it "
                          f"uses numpy.row_stack, removed in numpy 2.5); tfsparse's CUDA kernels need "
                          f"{SUPPORTED}: pip install 'numpy<2.5' (or pip install 'tfsparse[cuda]', which pins "
                          f"both)") from e


check_versions()  # before any kernel is compiled


def lock_simulator_shared_arrays() -> bool:
    """Under ``NUMBA_ENABLE_CUDASIM=1``: makes the simulator hand every thread of a block the same
    ``cuda.shared.array``; returns whether it changed the simulator.

    numba-cuda's simulator (0.30) creates a block's shared array when the first of its threads
    (each a Python thread) reaches the call, keyed by the caller's file and line, without a lock:
    two threads that reach it together, the interpreter switching between them after the lookup
    and before the store, each get an array of their own, and the block's "shared" memory is split
    -- a scan then sums over half the block.  Seen as a rare ``IndexError`` in the compaction's
    ``write`` kernel (more keys counted above the threshold than k) in CI under load.  The
    replacement makes the lookup and the store one step; it keys by the caller's frame as the
    simulator does (without building a whole stack trace per call)."""
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator import kernelapi

    shared = kernelapi.FakeCUDAShared
    if getattr(shared.array, "_tfsparse_locked", False):
        return False
    simulator_array = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        allocations = getattr(self, "_allocations", None)
        if shape == 0 or alignment is not None or allocations is None:
            return simulator_array(self, shape, dtype, alignment)  # dynamic shared memory; errors
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, nt.Type) else np.dtype(dtype)
        with lock:
            a = allocations.get(key)
            if a is None:
                a = allocations[key] = np.empty(shape, dtype)
        return a

    array._tfsparse_locked = True
    shared.array = array
    return True


def yield_simulator_polls() -> bool:
    """Under ``NUMBA_ENABLE_CUDASIM=1``: makes the simulator's block manager give up the interpreter
    each time it polls a thread; returns whether it changed the simulator.

    numba-cuda's simulator (0.30) runs a block's threads as Python threads while the launching
    thread spins over them (``is_alive``, ``syncthreads`` flags) without ever blocking: it holds the
    interpreter for whole switch intervals while the threads it waits for cannot run (a profile of
    ``tools/bench_kernels.py --cuda`` under the simulator: about 100 s of its 168 s in those polls).
    A top-k of 4,096 values at 32 threads a block took 15 s; yielding at each poll
    (``time.sleep(0)`` releases the interpreter) takes 2 s -- the same kernels, the same
    results, the tests' simulator runs several times sooner."""
    from numba.cuda.simulator import kernel

    thread = kernel.BlockThread
    if getattr(thread.is_alive, "_tfsparse_yields", False):
        return False
    simulator_is_alive = thread.is_alive

    def is_alive(self):
        time.sleep(0)
        return simulator_is_alive(self)

    is_alive._tfsparse_yields = True
    thread.is_alive = is_alive
    return True


if _numba_config.ENABLE_CUDASIM:
    lock_simulator_shared_arrays()
    yield_simulator_polls()

DEFAULT_TPB = 256          # threads per block
DEFAULT_ITEMS = 8          # consecutive elements per thread in the compaction kernels
DEFAULT_MAX_BLOCKS = 1 << 16   # blocks per launch; kernels loop grid-stride beyond it
_ABS = C.ABS_MASK
_NANK = C.NAN_KEY
_INFK = C.INF_KEY
_DIGITS = ((12, 19), (10, 9), (9, 0))   # (bits, shift) of the three radix-select levels
_NB_MAX = 1 << 12
_LO32 = 0xFFFFFFFF


@cuda.jit(device=True, inline="always")
def _dkey(u):
    return min(np.int64(u) & _ABS, _NANK)


# ----------------------------------------------------------------------------- block-shaped kernels

def _build_block_kernels(tpb: int, items: int) -> dict:
    """Kernels whose shared-memory layout depends on the block shape (``tpb`` threads,
    ``items`` elements each); returns ``{name: python function}`` (closures over the shape)."""
    tile = tpb * items
    pad = tile + tile // 32  # one pad word per 32: the blocked reads below are bank-conflict free

    @cuda.jit(device=True, inline="always")
    def block_scan(sh, t, v):
        """Inclusive scan of ``v`` over the block (Hillis-Steele in shared ``sh[tpb]``)."""
        sh[t] = v
        cuda.syncthreads()
        off = 1
        while off < tpb:
            add = sh[t - off] if t >= off else 0
            cuda.syncthreads()
            sh[t] += add
            cuda.syncthreads()
            off *= 2
        r = sh[t]
        cuda.syncthreads()
        return r

    @cuda.jit(device=True, inline="always")
    def load_tile(xu, tl, base, n, t):
        """Coalesced load of ``tile`` keys from ``base`` into padded shared ``tl`` (-1 past the end)."""
        for j in range(items):
            p = j * tpb + t
            i = base + p
            tl[p + (p >> 5)] = _dkey(xu[i]) if i < n else -1
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def tile_key(tl, t, j):
        p = t * items + j
        return tl[p + (p >> 5)]

    @cuda.jit(device=True, inline="always")
    def thread_counts(tl, t, thr):
        """(#key > thr) | (#key == thr) << 32 over this thread's ``items`` consecutive keys."""
        v = 0
        for j in range(items):
            kk = tile_key(tl, t, j)
            if kk > thr:
                v += 1
            elif kk == thr:
                v += 1 << 32
        return v

    def k_count(xu, params, cnt):
        """cnt[b] = (#key > T) | (#key == T) << 32 over block b's tile; params = [T, r]."""
        tl = cuda.shared.array(pad, numba.int64)
        sh = cuda.shared.array(tpb, numba.int64)
        t = cuda.threadIdx.x
        for b in range(cuda.blockIdx.x, cnt.size, cuda.gridDim.x):
            load_tile(xu, tl, b * tile, xu.size, t)
            tot = block_scan(sh, t, thread_counts(tl, t, params[0]))
            if t == tpb - 1:
                cnt[b] = tot

    def k_scan(cnt, params, offs, total):
        """Exclusive scan of the packed block counts (one block); total[0] = selected count."""
        sh = cuda.shared.array(tpb, numba.int64)
        t = cuda.threadIdx.x
        nb = cnt.size
        per = (nb + tpb - 1) // tpb
        lo = min(t * per, nb)
        hi = min(lo + per, nb)
        gt = 0
        eq = 0
        for b in range(lo, hi):
            gt += cnt[b] & _LO32
            eq += cnt[b] >> 32
        # gt and eq are < 2**32 each (n < 2**32): scan them packed, then split
        incl = block_scan(sh, t, gt | (eq << 32))
        g = (incl & _LO32) - gt
        e = (incl >> 32) - eq
        for b in range(lo, hi):
            offs[b] = g | (e << 32)
            g += cnt[b] & _LO32
            e += cnt[b] >> 32
        if t == tpb - 1:
            total[0] = g + min(e, params[1])

    def k_write(xu, x, params, offs, out_idx, out_val):
        """Writes the selected elements of block b's tile at their global, index-ordered positions:
        all keys > T, and the ties (key == T) whose rank among all ties is < r."""
        tl = cuda.shared.array(pad, numba.int64)
        sh = cuda.shared.array(tpb, numba.int64)
        t = cuda.threadIdx.x
        thr = params[0]
        r = params[1]
        for b in range(cuda.blockIdx.x, offs.size, cuda.gridDim.x):
            base = b * tile
            load_tile(xu, tl, base, xu.size, t)
            v = thread_counts(tl, t, thr)
            incl = block_scan(sh, t, v)
            g = (offs[b] & _LO32) + (incl & _LO32) - (v & _LO32)   # keys > T before this thread
            e = (offs[b] >> 32) + (incl >> 32) - (v >> 32)         # ties before this thread
            for j in range(items):
                kk = tile_key(tl, t, j)
                i = base + t * items + j
                if kk > thr:
                    p = g + min(e, r)
                    out_idx[p] = i
                    out_val[p] = x[i]
                    g += 1
                elif kk == thr:
                    if e < r:
                        out_idx[g + e] = i
                        out_val[g + e] = x[i]
                    e += 1
            cuda.syncthreads()  # the next tile overwrites tl

    def k_hist(xu, state, shift, nbits, hist):
        """hist[(key >> shift) & mask] += 1 for keys whose higher bits equal the prefix state[0]."""
        sh = cuda.shared.array(_NB_MAX, numba.int32)
        t = cuda.threadIdx.x
        nbins = 1 << nbits
        for j in range(t, nbins, tpb):
            sh[j] = 0
        cuda.syncthreads()
        prefix = state[0]
        pshift = shift + nbits
        mask = nbins - 1
        n = xu.size
        for base in range(cuda.blockIdx.x * tile, n, cuda.gridDim.x * tile):
            for j in range(items):
                i = base + j * tpb + t
                if i < n:
                    kk = _dkey(xu[i])
                    if (kk >> pshift) == prefix:
                        cuda.atomic.add(sh, (kk >> shift) & mask, 1)
        cuda.syncthreads()
        for j in range(t, nbins, tpb):
            c = sh[j]
            if c != 0:
                cuda.atomic.add(hist, j, np.int64(c))

    def k_find(hist, nbits, state):
        """One block: the bin holding the state[1]-th largest key; extends the prefix state[0],
        updates the rank state[1], and zeroes ``hist`` for the next level."""
        sh = cuda.shared.array(tpb, numba.int64)
        t = cuda.threadIdx.x
        nbins = 1 << nbits
        per = nbins // tpb
        top = nbins - t * per  # this thread owns bins [top - per, top), scanned downwards
        own = 0
        for j in range(per):
            own += hist[top - 1 - j]
        need = state[1]
        prefix = state[0]
        incl = block_scan(sh, t, own)
        cum = incl - own
        if cum < need and need <= incl:
            for j in range(per):
                c = hist[top - 1 - j]
                if cum + c >= need:
                    state[0] = (prefix << nbits) | (top - 1 - j)
                    state[1] = need - cum
                    break
                cum += c
        cuda.syncthreads()
        for j in range(per):
            hist[top - 1 - j] = 0

    def k_max_key(xu, res):
        """res[0] = max key (atomic over blocks); its float32 view is max|x| (NaN if any NaN)."""
        sh = cuda.shared.array(tpb, numba.int64)
        t = cuda.threadIdx.x
        m = 0
        for i in range(cuda.blockIdx.x * tpb + t, xu.size, cuda.gridDim.x * tpb):
            m = max(m, _dkey(xu[i]))
        sh[t] = m
        cuda.syncthreads()
        w = tpb // 2
        while w > 0:
            if t < w:
                sh[t] = max(sh[t], sh[t + w])
            cuda.syncthreads()
            w //= 2
        if t == 0:
            cuda.atomic.max(res, 0, np.uint32(sh[0]))

    def k_chunk_l1(x, chunk, out):
        """out[c] = sum |x| over chunk c (one block per chunk, float64 accumulation)."""
        sh = cuda.shared.array(tpb, numba.float64)
        t = cuda.threadIdx.x
        for c in range(cuda.blockIdx.x, out.size, cuda.gridDim.x):
            lo = c * chunk
            hi = min(lo + chunk, x.size)
            s = 0.0
            for i in range(lo + t, hi, tpb):
                s += abs(np.float64(x[i]))
            sh[t] = s
            cuda.syncthreads()
            w = tpb // 2
            while w > 0:
                if t < w:
                    sh[t] += sh[t + w]
                cuda.syncthreads()
                w //= 2
            if t == 0:
                out[c] = np.float32(sh[0])
            cuda.syncthreads()

    return {"count": k_count, "scan": k_scan, "write": k_write, "hist": k_hist, "find": k_find,
            "max_key": k_max_key, "chunk_l1": k_chunk_l1}


# ----------------------------------------------------------------------------- elementwise kernels

# grid-stride loops: any grid size covers any n (the host caps the grid, see Kernels.grid)

def _k_fill_i64(a, v):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = v


def _k_fill_f32(a, v):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = v


def _k_set2_i64(a, v0, v1):
    """a[0], a[1] = v0, v1 (one thread): small device state set without a host copy."""
    if cuda.grid(1) == 0:
        a[0] = v0
        a[1] = v1


def _k_iota(a):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = i


@cuda.jit(device=True, inline="always")
def _slot(i, ha, hb, m):
    """The table slot of index ``i`` (the universal hash of tfsparse.ops._common)."""
    h = (ha * np.uint64(i) + hb) >> np.uint64(32)
    return np.int64((h * np.uint64(m)) >> np.uint64(32))


def _k_hash(xu, tkey, ha, hb, m, table):
    """DRAGONN Alg. 1 lines 4-8: compare, hash, write (atomic max: the largest index wins)."""
    for i in range(cuda.grid(1), xu.size, cuda.gridsize(1)):
        if _dkey(xu[i]) >= tkey:
            cuda.atomic.max(table, _slot(i, ha, hb, m), np.int64(i))


def _k_winners(xu, tkey, ha, hb, m, table, flags):
    """flags[i] = 1 where element i holds its slot of the DRAGONN table (it passed the threshold
    and no larger index hashed to the slot), else 0: the table's entries, marked in index order."""
    for i in range(cuda.grid(1), xu.size, cuda.gridsize(1)):
        w = np.uint32(0)
        if _dkey(xu[i]) >= tkey and table[_slot(i, ha, hb, m)] == i:
            w = np.uint32(1)
        flags[i] = w


def _k_gather(table, x, val):
    """DRAGONN Alg. 1 line 10, G_c = G[I], with 0 for empty (-1) slots."""
    for j in range(cuda.grid(1), table.size, cuda.gridsize(1)):
        i = table[j]
        val[j] = x[i] if i >= 0 else np.float32(0.0)


def _k_scatter(idx, val, out, bad):
    for j in range(cuda.grid(1), idx.size, cuda.gridsize(1)):
        i = np.int64(idx[j])
        if i >= 0:
            if i < out.size:
                cuda.atomic.add(out, i, val[j])
            else:
                cuda.atomic.add(bad, 0, 1)


def _k_sample(xu, s, step, ha, hb, out):
    """out[j] = bits at the j-th stratified sample position (see reference.sample_positions)."""
    n64 = np.uint64(xu.size)
    for j in range(cuda.grid(1), s, cuda.gridsize(1)):
        j64 = np.uint64(j)
        lo = (j64 * step) >> np.uint64(32)
        hi = ((j64 + np.uint64(1)) * step) >> np.uint64(32) if j + 1 < s else n64
        h = (ha * j64 + hb) >> np.uint64(32)
        out[j] = xu[lo + ((h * (hi - lo)) >> np.uint64(32))]


# ----------------------------------------------------------------------------- exchange buffers

# what a device-resident exchange does to its bucket vectors (tfsparse.space.CudaSpace): error
# feedback, the finite check, residual bookkeeping, clipping; float32 arithmetic in the order numpy
# does it on the host (products through fmul_rn, so that NVVM never contracts them into an FMA;
# the simulator's libdevice has no body for it, and a numpy float32 product rounds the same)
_mul_rn = libdevice.fmul_rn if not _numba_config.ENABLE_CUDASIM else (lambda a, b: a * b)


def _k_add(a, b, out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] + b[i]


def _k_momentum(u, m, g, r, out):
    """u = m*u + g; out = u + r (DGC momentum correction, tfsparse.memory.MomentumMemory)."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        v = _mul_rn(u[i], m) + g[i]
        u[i] = v
        out[i] = v + r[i]


def _k_scale(x, s, out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = _mul_rn(x[i], s)


def _k_nonfinite(xu, flag):
    """flag[0] += 1 once per thread that saw a NaN/Inf (key >= Inf's)."""
    seen = False
    for i in range(cuda.grid(1), xu.size, cuda.gridsize(1)):
        if _dkey(xu[i]) >= _INFK:
            seen = True
    if seen:
        cuda.atomic.add(flag, 0, 1)


def _k_zero_nonfinite(xu):
    for i in range(cuda.grid(1), xu.size, cuda.gridsize(1)):
        if _dkey(xu[i]) >= _INFK:
            xu[i] = np.uint32(0)


def _k_zero_at(idx, out):
    for j in range(cuda.grid(1), idx.size, cuda.gridsize(1)):
        out[idx[j]] = np.float32(0.0)


def _k_set_at(idx, val, out):
    for j in range(cuda.grid(1), idx.size, cuda.gridsize(1)):
        out[idx[j]] = val[j]


def _k_sum_squares(x, out):
    """out[0] += sum(float64(x)**2) (one atomic add per thread)."""
    acc = np.float64(0.0)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = np.float64(x[i])
        acc += v * v
    cuda.atomic.add(out, 0, acc)


# ----------------------------------------------------------------------------- quantization

def _k_quantize(x, amax, q):
    """q = clip(rint(x * 127/amax)); all zero when amax is 0, Inf or NaN (see quantize_int8)."""
    a = amax[0]
    ok = a > np.float32(0.0) and a < np.float32(np.inf)
    inv = np.float32(127.0) / a if ok else np.float32(0.0)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        q[i] = np.int8(max(-127, min(127, round(x[i] * inv)))) if ok else 0


def _k_dequantize(q, scale, out):
    for i in range(cuda.grid(1), q.size, cuda.gridsize(1)):
        out[i] = np.float32(q[i]) * scale


def _k_trunc16(xu, out):
    """float32 bits -> IEEE binary16 bits rounded toward zero (see truncate_fp16)."""
    for i in range(cuda.grid(1), xu.size, cuda.gridsize(1)):
        u = np.int64(xu[i])
        sign = (u >> 16) & 0x8000
        a = u & _ABS
        e = a >> 23
        if a > _INFK:
            h = 0x7E00 | ((a >> 13) & 0x3FF)
        elif a == _INFK:
            h = 0x7C00
        elif e >= 143:
            h = 0x7BFF
        elif e >= 113:
            h = (a >> 13) - (112 << 10)
        elif e >= 102:
            h = ((a & 0x7FFFFF) | 0x800000) >> (126 - e)
        else:
            h = 0
        out[i] = np.uint16(sign | h)


# ----------------------------------------------------------------------------- registry

_u32, _i64, _i32, _f32, _i8, _u16 = (nt.uint32[::1], nt.int64[::1], nt.int32[::1], nt.float32[::1], nt.int8[::1],
                                     nt.uint16[::1])
#: kernel name -> signatures compiled ahead of time by :func:`compile_ptx_all`
SIGNATURES = {
    "count": [(_u32, _i64, _i64)],
    "scan": [(_i64, _i64, _i64, _i64)],
    "write": [(_u32, _f32, _i64, _i64, _i64, _f32)],
    "hist": [(_u32, _i64, nt.int64, nt.int64, _i64)],
    "find": [(_i64, nt.int64, _i64)],
    "max_key": [(_u32, nt.uint32[::1])],
    "chunk_l1": [(_f32, nt.int64, _f32)],
    "fill_i64": [(_i64, nt.int64)],
    "fill_f32": [(_f32, nt.float32)],
    "set2_i64": [(_i64, nt.int64, nt.int64)],
    "iota": [(_i64,)],
    "hash": [(_u32, nt.int64, nt.uint64, nt.uint64, nt.int64, _i64)],
    "winners": [(_u32, nt.int64, nt.uint64, nt.uint64, nt.int64, _i64, _u32)],
    "gather": [(_i64, _f32, _f32)],
    "scatter": [(_i64, _f32, _f32, _i64), (_i32, _f32, _f32, _i64)],
    "sample": [(_u32, nt.int64, nt.uint64, nt.uint64, nt.uint64, _u32)],
    "quantize": [(_f32, _f32, _i8)],
    "dequantize": [(_i8, nt.float32, _f32)],
    "trunc16": [(_u32, _u16)],
    "add": [(_f32, _f32, _f32)],
    "momentum": [(_f32, nt.float32, _f32, _f32, _f32)],
    "scale": [(_f32, nt.float32, _f32)],
    "nonfinite": [(_u32, _i64)],
    "zero_nonfinite": [(_u32,)],
    "zero_at": [(_i64, _f32)],
    "set_at": [(_i64, _f32, _f32)],
    "sum_squares": [(_f32, nt.float64[::1])],
}
_ELEMENTWISE = {"fill_i64": _k_fill_i64, "fill_f32": _k_fill_f32, "set2_i64": _k_set2_i64, "iota": _k_iota,
                "hash": _k_hash, "winners": _k_winners, "gather": _k_gather, "scatter": _k_scatter,
                "sample": _k_sample, "quantize": _k_quantize, "dequantize": _k_dequantize, "trunc16": _k_trunc16,
                "add": _k_add, "momentum": _k_momentum, "scale": _k_scale, "nonfinite": _k_nonfinite, "zero_nonfinite": _k_zero_nonfinite,
                "zero_at": _k_zero_at, "set_at": _k_set_at, "sum_squares": _k_sum_squares}
_ELEMENTWISE_JIT = {name: cuda.jit(fn) for name, fn in _ELEMENTWISE.items()}


class Kernels:
    """The kernel set for one block shape: ``tpb`` threads per block (a power of two in
    [32, 512]), ``items`` consecutive elements per thread in the tile kernels, and at
    most ``max_blocks`` blocks per launch (every kernel loops over its work grid-stride)."""

    def __init__(self, tpb: int = DEFAULT_TPB, items: int = DEFAULT_ITEMS, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if tpb not in (32, 64, 128, 256, 512) or not 1 <= items <= 64 or max_blocks < 1:
            raise ValueError(f"unsupported block shape tpb={tpb}, items={items}, max_blocks={max_blocks}")
        self.tpb, self.items, self.tile, self.max_blocks = tpb, items, tpb * items, max_blocks
        # histogram blocks zero and flush _NB_MAX shared bins each: few blocks, many tiles per block
        self.hist_blocks = min(max_blocks, 1024)
        self.python = {**_build_block_kernels(tpb, items), **_ELEMENTWISE}
        self.jit = {**{name: cuda.jit(fn) for name, fn in self.python.items() if name not in _ELEMENTWISE},
                    **_ELEMENTWISE_JIT}
        self._stream_blocks = None

    def __getitem__(self, name):
        return self.jit[name]

    def ntiles(self, n: int) -> int:
        """Tiles of ``tpb * items`` elements covering ``n``."""
        return max(1, -(-n // self.tile))

    def grid(self, n: int) -> int:
        """Blocks for one thread per element, capped at ``max_blocks`` and at four waves of
        resident threads (8192 threads per multiprocessor): the grid-stride kernels then loop
        instead of launching blocks that each touch a few elements (on an H100, 16.8M-element
        truncation: 78 instead of 152 us)."""
        if self._stream_blocks is None:
            sms = getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", None)  # None: simulator
            self._stream_blocks = sms * (8192 // self.tpb) if sms else self.max_blocks
        return max(1, min(-(-n // self.tpb), self.max_blocks, self._stream_blocks))

    def tiles(self, n: int) -> int:
        """Blocks for one tile per block (capped)."""
        return min(self.ntiles(n), self.max_blocks)

    def compile_ptx(self, cc=(9, 0)) -> dict:
        """PTX of every kernel for compute capability ``cc`` (needs NVVM, not a GPU)."""
        return {f"{name}/{i}": cuda.compile_ptx(self.python[name], sig, cc=cc)[0]
                for name, sigs in SIGNATURES.items() for i, sig in enumerate(sigs)}
