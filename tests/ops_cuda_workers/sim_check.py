"""Runs the CUDA kernels of tfsparse.ops under Numba's CUDA simulator and compares them
with the numpy reference.  Usage: ``NUMBA_ENABLE_CUDASIM=1 python sim_check.py [names...]``;
on a machine with a GPU, ``python sim_check.py --gpu [names...]`` runs the same checks on it
(tools/gpu_check.sh).

Prints one JSON object ``{check name: "ok" | traceback}`` as the last line of stdout.
``NUMBA_ENABLE_CUDASIM`` must be set before numba is first imported, which is why this
runs in its own process (tests/test_ops_cuda.py starts it).  Numba is only imported
inside the checks, so ``CHECK_NAMES`` can be imported anywhere.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import numpy as np

SMALL_SHAPE = (32, 8, 2)     # tpb, items, max_blocks: few Python threads per simulated launch
DEFAULT_SHAPE = (256, 8, 2)  # the production block shape (capped grid: still grid-stride)


def _setup(shape=SMALL_SHAPE):
    from tfsparse.ops import cuda as kc

    kc.set_block_shape(*shape)
    return kc


def _dev(a):
    from numba import cuda

    return cuda.to_device(np.ascontiguousarray(a))


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def _same_bits(a, b):
    a, b = _host(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.kind == "f":
        assert np.array_equal(np.isnan(a), np.isnan(b)), "NaN positions differ"
        ok = ~np.isnan(a)
        view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        assert np.array_equal(a[ok].view(view), b[ok].view(view)), "values differ"
    else:
        assert np.array_equal(a, b), "arrays differ"


def _same_scalar(a, b):
    a, b = np.float32(a), np.float32(b)
    assert (np.isnan(a) and np.isnan(b)) or a == b, (a, b)


def _mixed(n, seed=0):
    """Gaussian with NaN (two payloads), +-Inf, -0.0, and ties at several magnitudes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if n >= 50:
        pos = rng.permutation(n)
        x[pos[0]] = np.nan
        x[pos[1]] = -np.float32(np.nan)
        x[pos[2]] = np.inf
        x[pos[3]] = -np.inf
        x[pos[4:8]] = -0.0
        x[pos[8:30]] = 1.25
        x[pos[30:40]] = -1.25
    return x


# ----------------------------------------------------------------------------- checks

def check_topk():
    import tfsparse.ops as ops
    from tfsparse.ops import reference as R

    _setup()
    for n, seed, ks in ((1500, 0, (0, 1, 4, 31, 750, 1500)), (777, 1, (3, 100, 776))):
        x = _mixed(n, seed)
        d = _dev(x)
        for k in ks:
            idx, val = ops.topk_abs(d, k)
            ridx, rval = R.topk_abs(x, k)
            _same_bits(idx, ridx)
            _same_bits(val, rval)


def check_topk_ties_and_empty():
    import tfsparse.ops as ops
    from tfsparse.ops import reference as R

    _setup()
    x = np.ones(700, np.float32)
    x[::3] = -1.0
    idx, val = ops.topk_abs(_dev(x), 300)
    _same_bits(idx, np.arange(300))  # all tie: lowest indices
    _same_bits(val, x[:300])
    z = np.zeros(300, np.float32)
    z[1::2] = -0.0
    for k in (0, 5, 300):
        _same_bits(ops.topk_abs(_dev(z), k)[0], R.topk_abs(z, k)[0])
    e = np.zeros(0, np.float32)
    idx, val = ops.topk_abs(_dev(e), 0)
    assert _host(idx).shape == (0,) and _host(val).shape == (0,)
    try:
        ops.topk_abs(_dev(e), 1)
    except ValueError:
        pass
    else:
        raise AssertionError("k > n must raise")


def check_kth_and_sample():
    import tfsparse.ops as ops
    from tfsparse.ops import reference as R

    _setup()
    x = _mixed(1200, 2)
    d = _dev(x)
    for k in (0, 1, 3, 50, 1200):
        _same_scalar(ops.kth_largest_abs(d, k), R.kth_largest_abs(x, k))
    for ratio, seed in ((0.1, 0), (1.0, 1)):
        for k in (0, 1, 10, 1200):
            _same_scalar(ops.sample_threshold(d, k, ratio=ratio, seed=seed), R.sample_threshold(x, k, ratio, seed))


def check_select_threshold():
    import tfsparse.ops as ops
    from tfsparse.ops import reference as R

    _setup()
    x = _mixed(1300, 3)
    d = _dev(x)
    for t in (0.0, -1.0, 1.25, 2.0, np.inf, np.nan):
        idx, val = ops.select_threshold(d, t)
        ridx, rval = R.select_threshold(x, t)
        _same_bits(idx, ridx)
        _same_bits(val, rval)
    idx, val = ops.select_threshold(_dev(np.zeros(0, np.float32)), 0.0)
    assert _host(idx).size == 0


def check_hash_select():
    import tfsparse.ops as ops
    from tfsparse.ops import reference as R

    _setup()
    x = _mixed(1100, 4)
    d = _dev(x)
    for t in (0.0, 1.0, 1.25, np.inf, np.nan):
        for cap in (0, 1, 13, 64, 3000):
            for seed in (0, 5):
                idx, val = ops.hash_select(d, t, cap, seed=seed)
                ridx, rval = R.hash_select(x, t, cap, seed)
                _same_bits(idx, ridx)
                _same_bits(val, rval)
    idx, val = ops.hash_select(_dev(np.zeros(0, np.float32)), 0.0, 8)
    _same_bits(idx, np.full(8, -1, np.int64))


def check_hash_survivors():
    """The table's occupied slots in index order, packed on the device (DRAGONN's payload)."""
    from tfsparse.ops import cuda as kc
    from tfsparse.ops import reference as R

    _setup()
    x = _mixed(1100, 4)
    d = _dev(x)
    for t in (0.0, 1.25, np.inf, np.nan):
        for cap in (0, 1, 64, 3000):
            idx, val = kc.hash_survivors(d, t, cap, seed=3)
            ridx, rval = R.hash_select(x, t, cap, 3)
            order = np.argsort(ridx[ridx >= 0])
            _same_bits(idx, ridx[ridx >= 0][order])
            _same_bits(val, rval[ridx >= 0][order])
    idx, val = kc.hash_survivors(_dev(np.zeros(0, np.float32)), 0.0, 8)
    assert idx.size == 0 and val.size == 0


def check_scratch_reused_and_per_thread():
    """The wrappers' small scratch arrays: reused by one thread's calls, never shared between
    threads, and reset by kernels (a call after another gives the same result)."""
    import threading

    import tfsparse.ops as ops
    from tfsparse.ops import cuda as kc
    from tfsparse.ops import reference as R

    _setup()
    x = _mixed(700, 9)
    d = _dev(x)
    for k in (5, 300, 5):
        _same_bits(ops.topk_abs(d, k)[0], R.topk_abs(x, k)[0])
    mine = dict(kc._SCRATCH.arrays)
    assert {name for _, name in mine} >= {"state", "hist", "cnt", "offs", "total"}
    other = {}
    thread = threading.Thread(target=lambda: (ops.topk_abs(d, 5), other.update(kc._SCRATCH.arrays)))
    thread.start()
    thread.join()
    assert other and all(other[key] is not mine.get(key) for key in other)
    assert all(kc._SCRATCH.arrays[key] is mine[key] for key in mine)


def check_simulator_gives_a_block_one_shared_array():
    """The simulator's ``cuda.shared.array``, as tfsparse.ops.cuda leaves it: every thread of a block
    that reaches the call at once gets the same array (unlocked, 16 threads whose allocation is
    slowed got ~11 arrays: the rare IndexError of the compaction's write kernel in CI)."""
    import threading
    import time

    if not simulated():
        raise Skipped("a check of the CUDA simulator")
    from numba.cuda.simulator import kernelapi

    from tfsparse.ops import _cuda_kernels

    _setup()
    assert getattr(kernelapi.FakeCUDAShared.array, "_tfsparse_locked", False)
    assert _cuda_kernels.lock_simulator_shared_arrays() is False  # installed once

    class SlowShape:  # widens the window between the lookup and the store
        def __index__(self):
            time.sleep(0.002)
            return 4

    shared = kernelapi.FakeCUDAShared(0)
    start = threading.Barrier(16)
    got = []

    def thread():
        start.wait()
        got.append(shared.array(SlowShape(), np.int64))

    threads = [threading.Thread(target=thread) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 16 and len({id(a) for a in got}) == 1, len({id(a) for a in got})
    other = shared.array(4, np.int64)  # another line: another array, as on a device
    assert other is not got[0] and other.dtype == np.int64 and other.shape == (4,)


def check_simulator_polls_yield_the_interpreter():
    """The simulator's block manager, as tfsparse.ops.cuda leaves it: each poll of a block's thread
    gives up the interpreter (it spun without, the threads it waits for starved), installed once;
    a block of 32 threads that meet at ``syncthreads`` still runs to the same sums."""
    if not simulated():
        raise Skipped("a check of the CUDA simulator")
    global _cuda  # the simulator swaps a kernel's module-level name for numba.cuda, not a local one
    from numba import cuda as _cuda
    from numba.cuda.simulator import kernel

    from tfsparse.ops import _cuda_kernels

    _setup()
    assert getattr(kernel.BlockThread.is_alive, "_tfsparse_yields", False)
    assert _cuda_kernels.yield_simulator_polls() is False  # installed once

    @_cuda.jit
    def block_sums(x, out):
        sh = _cuda.shared.array(32, np.int64)
        t = _cuda.threadIdx.x
        sh[t] = x[_cuda.blockIdx.x * 32 + t]
        _cuda.syncthreads()
        if t == 0:
            s = 0
            for i in range(32):
                s += sh[i]
            out[_cuda.blockIdx.x] = s

    x = np.arange(96, dtype=np.int64)
    out = _cuda.device_array(3, np.int64)
    block_sums[3, 32](_cuda.to_device(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), x.reshape(3, 32).sum(axis=1))


def check_scatter_add():
    import tfsparse.ops as ops
    from tfsparse.ops import reference as R

    _setup()
    rng = np.random.default_rng(5)
    n = 900
    idx = rng.integers(-1, n, 2500)
    val = rng.integers(-8, 9, 2500).astype(np.float32)  # integer values: atomic order cannot matter
    for dt in (np.int64, np.int32):
        _same_bits(ops.scatter_add(n, _dev(idx.astype(dt)), _dev(val)), R.scatter_add(n, idx, val))
    base = rng.integers(-4, 5, n).astype(np.float32)
    out = _dev(base)
    res = ops.scatter_add(n, idx, val, out=out)  # host payload, device output: dispatch by out
    _same_bits(res, R.scatter_add(n, idx, val, out=base.copy()))
    _same_bits(out, R.scatter_add(n, idx, val, out=base.copy()))  # in place
    assert ops.device_kind(res) == "cuda"
    _same_bits(ops.scatter_add(n, _dev(np.zeros(0, np.int64)), _dev(np.zeros(0, np.float32))), np.zeros(n, np.float32))
    try:
        ops.scatter_add(10, _dev(np.array([3, 10])), _dev(np.ones(2, np.float32)))
    except IndexError:
        pass
    else:
        raise AssertionError("index >= n must raise")
    nan_val = np.array([np.nan, 1.0, np.inf], np.float32)
    got = _host(ops.scatter_add(4, _dev(np.array([0, 0, 2])), _dev(nan_val)))
    assert np.isnan(got[0]) and got[2] == np.inf and got[1] == 0


def check_quantize():
    import tfsparse.ops as ops
    from tfsparse.ops import reference as R

    _setup()
    rng = np.random.default_rng(6)
    x = (rng.standard_normal(1000) * 3).astype(np.float32)
    x[:4] = [0.5, -0.5, 1.5, -2.5]  # halves: round half to even after scaling below
    for arr in (x, np.array([127.0, 0.5, 1.5, -2.5, 2.5], np.float32), np.zeros(50, np.float32),
                np.zeros(0, np.float32)):
        q, s = ops.quantize_int8(_dev(arr))
        rq, rs = R.quantize_int8(arr)
        _same_bits(q, rq)
        _same_scalar(s, rs)
        _same_bits(ops.dequantize_int8(q, s), R.dequantize_int8(rq, rs))
    for bad, want in ((np.nan, np.nan), (np.inf, np.inf)):
        y = x.copy()
        y[7] = bad
        q, s = ops.quantize_int8(_dev(y))
        assert (np.isnan(s) if np.isnan(want) else s == want), s
        assert not _host(q).any()
        assert np.isnan(_host(ops.dequantize_int8(q, s))).all()


def check_truncate_fp16():
    import tfsparse.ops as ops
    from tfsparse.ops import reference as R

    _setup()
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 3000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).copy()
    x[:12] = [65504.0, 65519.0, 65520.0, 1e9, -1e9, 2.0**-24, 2.0**-25, 3e-8, -0.0, np.inf, -np.inf, 1.0 + 2**-11]
    _same_bits(ops.truncate_fp16(_dev(x)), R.truncate_fp16(x))


def check_chunk_l1():
    import tfsparse.ops as ops
    from tfsparse.ops import reference as R

    _setup()
    x = np.random.default_rng(8).standard_normal(1000).astype(np.float32)
    d = _dev(x)
    for chunk in (100, 256, 5000):
        np.testing.assert_allclose(_host(ops.chunk_l1_norms(d, chunk)), R.chunk_l1_norms(x, chunk), rtol=1e-6)
    np.testing.assert_allclose(_host(ops.chunk_l1_norms(_dev(x[:10]), 1)), np.abs(x[:10]), rtol=1e-6)
    y = x.copy()
    y[5] = np.nan
    y[300] = -np.inf
    got = _host(ops.chunk_l1_norms(_dev(y), 256))
    assert np.isnan(got[0]) and got[1] == np.inf and np.isfinite(got[2:]).all()
    assert _host(ops.chunk_l1_norms(_dev(np.zeros(0, np.float32)), 8)).shape == (0,)


def check_dispatch_and_inputs():
    import tfsparse.ops as ops
    from numba import cuda

    kc = _setup()
    x = _mixed(400, 9)
    d2 = cuda.to_device(x.reshape(20, 20))
    assert ops.device_kind(d2) == "cuda" and ops.device_kind(x) == "cpu"
    assert ops.backend("cuda") is kc
    _same_bits(ops.topk_abs(d2, 9)[0], ops.topk_abs(x, 9)[0])  # 2-D device input is flattened
    try:
        ops.topk_abs(cuda.to_device(x.astype(np.float64)), 3)
    except TypeError:
        pass
    else:
        raise AssertionError("float64 device arrays must be rejected")


def check_default_block_shape():
    import tfsparse.ops as ops
    from tfsparse.ops import reference as R

    _setup(DEFAULT_SHAPE)
    x = _mixed(5000, 10)  # 3 tiles of 2048 on a grid of 2 blocks: the grid-stride loops run
    d = _dev(x)
    _same_bits(ops.topk_abs(d, 77)[0], R.topk_abs(x, 77)[0])
    _same_bits(ops.select_threshold(d, 1.25)[0], R.select_threshold(x, 1.25)[0])


def check_exchange_buffer_kernels():
    """The kernels of a device-resident exchange (tfsparse.space.CudaSpace) against numpy."""
    kc = _setup()
    rng = np.random.default_rng(5)
    n = 1000
    a, b, r = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    u = rng.standard_normal(n).astype(np.float32)
    out = _dev(np.zeros(n, np.float32))
    kc.add(_dev(a), _dev(b), out)
    _same_bits(out, a + b)
    du = _dev(u)
    kc.momentum_step(du, np.float32(0.9), _dev(a), _dev(r), out)
    want_u = u * np.float32(0.9) + a
    _same_bits(du, want_u)
    _same_bits(out, want_u + r)
    kc.scale(_dev(a), 0.3, out)
    _same_bits(out, a * np.float32(0.3))
    assert kc.all_finite(_dev(a))
    bad = a.copy()
    bad[[3, 500, 999]] = [np.nan, np.inf, -np.inf]
    assert not kc.all_finite(_dev(bad)) and kc.all_finite(_dev(np.zeros(0, np.float32)))
    d = _dev(bad)
    kc.zero_nonfinite(d)
    _same_bits(d, np.nan_to_num(bad, nan=0.0, posinf=0.0, neginf=0.0))
    d = _dev(a)
    kc.zero_at(d, np.array([0, 7, 999]))
    want = a.copy()
    want[[0, 7, 999]] = 0.0
    _same_bits(d, want)
    kc.set_at(d, np.array([1, 2]), np.array([-0.0, 5.0], np.float32))
    want[[1, 2]] = [-0.0, 5.0]
    _same_bits(d, want)
    assert abs(kc.sum_squares(_dev(a)) - float(np.dot(a.astype(np.float64), a.astype(np.float64)))) < 1e-9 * n
    kc.fill(d, 2.5)
    _same_bits(d, np.full(n, 2.5, np.float32))


CHECKS = {name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")}
CHECK_NAMES = tuple(CHECKS)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def repo_env(**extra) -> dict:
    """This environment with the repository first on ``PYTHONPATH`` (for a child process)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
                **extra)


def run_in_simulator(worker, timeout: float = 900) -> dict:
    """Runs a worker of this folder in its own process under the CUDA simulator (from a test);
    returns its ``{check name: "ok" | traceback}``."""
    import subprocess

    env = repo_env(NUMBA_ENABLE_CUDASIM="1", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, str(worker)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"simulator worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Skipped(Exception):
    """A check that cannot run where it runs (on a real GPU: a second GPU, TensorFlow)."""


def simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def main(argv, checks=None):
    """Runs the named checks (all by default) and prints ``{name: "ok" | "skipped: ..." |
    traceback}``; ``--gpu`` runs them on a real GPU instead of the simulator."""
    gpu = "--gpu" in argv
    argv = [a for a in argv if a != "--gpu"]
    if simulated() == gpu:
        raise SystemExit("run with NUMBA_ENABLE_CUDASIM=1, or with --gpu (and without it) on a machine with a GPU")
    sys.setswitchinterval(5e-4)  # the simulator's block manager polls its threads: hand the GIL over often
    # simulated threads do numpy scalar arithmetic: uint64 hashing wraps on purpose, and
    # 0 * Inf in the non-finite quantization checks is the documented NaN result
    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
    warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
    checks = CHECKS if checks is None else checks
    names = argv or list(checks)
    results = {}
    for name in names:
        try:
            checks[name]()
            results[name] = "ok"
        except Skipped as e:
            results[name] = f"skipped: {e}"
        except ModuleNotFoundError as e:  # on a GPU machine without TensorFlow
            results[name] = traceback.format_exc() if simulated() else f"skipped: {e}"
        except Exception:  # noqa: BLE001 -- reported to the test
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
