#!/usr/bin/env python
"""Benchmark of the tfsparse.ops kernels against what a user has otherwise (a benchmark, not a test).

For every size n it times, on the same float32 Gaussian gradient and density k/n:

* exact top-k           -- ops.topk_abs  vs tf.math.top_k(tf.abs(x), k) and
                           np.argpartition(np.abs(x)) + np.sort (the original numpy compressor)
* exact threshold       -- ops.kth_largest_abs vs np.partition
* DGC sampled threshold -- ops.sample_threshold vs numpy random sample + np.partition
* threshold select      -- ops.select_threshold vs np.nonzero(np.abs(x) >= t) (DGC, dragonn Alg. 3)
* DRAGONN hash select   -- ops.hash_select (capacity k) vs the same threshold + nonzero
* sparse decoding       -- ops.scatter_add of P concatenated payloads vs P dense decodes + adds
                           (dragonn-wang2022 §4.3), P = 1 ... 64
* 8-bit quantization, 16-bit truncation, CSC chunk L1 norms -- vs their numpy one-liners
* the memory-bandwidth limit -- a one-pass copy of the same array, numpy (one thread) and
  Numba prange (all threads); the faster one is the bound the goals use.

Every timing is the minimum over at least ``--repeats`` runs after one warm-up, and over as
many runs as fit in a quarter second for short kernels (the machine may be shared).
Writes ``<out>/bench_kernels.json`` and ``<out>/bench_kernels.png``.  With ``--cuda`` (and
a GPU) it also times the CUDA kernels on device arrays with CUDA events, including the
512 MB (n = 128M) encode goal.

    python tools/bench_kernels.py --sizes 1M,4M,16M          # CPU, a few minutes
    python tools/bench_kernels.py --sizes 1M,4M,16M,64M,128M --cuda  # full run on a GPU machine
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfsparse import files  # noqa: E402
import bench_host  # noqa: E402  (run as a script: tools/ is on the path)

GOALS = {
    "topk_vs_tf_top_k": ("exact top-k speed-up over tf.math.top_k at density 0.001", 10.0),
    "select_vs_copy_bandwidth": ("threshold select bandwidth / one-pass copy bandwidth", 0.8),
    "hash_vs_threshold_nonzero": ("hash_select speed-up over threshold + np.nonzero", 1.5),
    "decode_flatness": ("sparse decode time(64 payloads) / time(1 payload) (dense: ~64)", None),
    "decode_marginal_vs_dense": ("extra time per payload, sparse / dense decoding", None),
    "cuda_512MB_encode_ms": ("CUDA hash_select of a 512 MB gradient, ms (H100 goal <= 1)", 1.0),
    "cuda_512MB_dragonn_encode_ms": ("CUDA sampled threshold + hash_select, 512 MB, ms (H100 goal <= 1)", 1.0),
    "cuda_512MB_dragonn_survivors_ms": ("CUDA sampled threshold + hash + survivors in index order, 512 MB, ms", None),
    "cuda_<op>_vs_copy": ("CUDA encode op time / the faster device-to-device copy, Numba's or torch's clone "
                          "(goal <= 1.5, exact top-k <= 3)", 1.5),
    "cuda_decode_vs_index_add": ("CUDA scatter_add of P payloads / torch zeros + index_add_, worst P (goal <= 1)", 1.0),
    "cuda_<op>_vs_best_peer": ("CUDA op time / fastest torch or CuPy equivalent (goal <= 1)", 1.0),
}
#: CUDA encode ops held to the copy-bandwidth goal (GOALS["cuda_<op>_vs_copy"]): (op, tfsparse impl)
CUDA_ENCODE = (("topk", "tfsparse.ops cuda"), ("select_threshold", "tfsparse.ops cuda"),
               ("hash_select", "tfsparse.ops cuda (capacity k)"), ("hash_select", "cuda sample_threshold + hash"),
               ("truncate_fp16", "tfsparse.ops cuda"), ("quantize_int8", "tfsparse.ops cuda"))


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def best_of(fn, repeats: int, min_time: float = 0.25, max_repeats: int = 500) -> float:
    """Minimum over at least ``repeats`` runs, and over as many as fit in ``min_time`` seconds
    (short kernels get many runs: on a shared machine the minimum is the stable statistic)."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    runs = 0
    while runs < repeats or (time.perf_counter() - start < min_time and runs < max_repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


def machine_info() -> dict:
    import numba

    info = {"python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
            "cpu_count": os.cpu_count(),
            "numba_threads": numba.get_num_threads()}
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    info["cpu"] = bench_host.cpu_model()
    return info


def _parallel_copy():
    from numba import njit, prange

    @njit(parallel=True, cache=True)
    def pcopy(dst, src):
        for i in prange(src.size):
            dst[i] = src[i]

    return pcopy


# ----------------------------------------------------------------------------- CPU

def bench_cpu(n: int, density: float, repeats: int, payloads: list[int], with_tf: bool) -> list[dict]:
    import tfsparse.ops as ops

    rng = np.random.default_rng(n)
    x = rng.standard_normal(n, dtype=np.float32)
    k = max(1, int(n * density))
    t = ops.kth_largest_abs(x, k)
    nbytes = x.nbytes
    rows = []

    def add(op, impl, seconds, **extra):
        rows.append({"n": n, "k": k, "op": op, "impl": impl, "seconds": seconds,
                     "gbps": nbytes / seconds / 1e9, **extra})
        print(f"  n={n:>11,} {op:<18} {impl:<34} {seconds * 1e3:10.3f} ms  {nbytes / seconds / 1e9:7.2f} GB/s",
              flush=True)

    dst = np.empty_like(x)
    dst[:] = 0
    pcopy = _parallel_copy()
    add("copy", "numpy (1 thread)", best_of(lambda: np.copyto(dst, x), repeats))
    add("copy", "numba prange", best_of(lambda: pcopy(dst, x), repeats))

    add("topk", "tfsparse.ops", best_of(lambda: ops.topk_abs(x, k), repeats))
    def np_topk():
        idx = np.sort(np.argpartition(np.abs(x), n - k)[n - k:])
        return idx, x[idx]

    add("topk", "np.argpartition", best_of(np_topk, repeats))
    if with_tf:
        import tensorflow as tf

        xt = tf.constant(x)
        add("topk", "tf.math.top_k", best_of(lambda: tf.math.top_k(tf.abs(xt), k), max(1, repeats // 2)))
        del xt

    add("kth_largest", "tfsparse.ops", best_of(lambda: ops.kth_largest_abs(x, k), repeats))
    add("kth_largest", "np.partition", best_of(lambda: np.partition(np.abs(x), n - k)[n - k], repeats))

    s = max(1, int(0.01 * n))
    ks = max(1, -(-k * s // n))
    add("sample_threshold", "tfsparse.ops", best_of(lambda: ops.sample_threshold(x, k, ratio=0.01), repeats))
    add("sample_threshold", "numpy sample + partition",
        best_of(lambda: np.partition(np.abs(x[rng.integers(0, n, s)]), s - ks)[s - ks], repeats))

    def np_select():
        idx = np.nonzero(np.abs(x) >= t)[0]
        return idx, x[idx]

    add("select_threshold", "tfsparse.ops", best_of(lambda: ops.select_threshold(x, t), repeats))
    add("select_threshold", "np threshold + nonzero", best_of(np_select, repeats))
    add("hash_select", "tfsparse.ops (capacity k)", best_of(lambda: ops.hash_select(x, t, k), repeats))

    def np_quant():
        scale = np.abs(x).max() / np.float32(127)
        return np.rint(x / scale).astype(np.int8), scale

    q, scale = ops.quantize_int8(x)
    add("quantize_int8", "tfsparse.ops", best_of(lambda: ops.quantize_int8(x), repeats))
    add("quantize_int8", "numpy", best_of(np_quant, repeats))
    add("dequantize_int8", "tfsparse.ops", best_of(lambda: ops.dequantize_int8(q, scale), repeats))
    add("dequantize_int8", "numpy", best_of(lambda: q.astype(np.float32) * scale, repeats))
    add("truncate_fp16", "tfsparse.ops", best_of(lambda: ops.truncate_fp16(x), repeats))
    add("truncate_fp16", "numpy astype(float16)", best_of(lambda: x.astype(np.float16), repeats))
    starts = np.arange(0, n, 32768)
    add("chunk_l1_norms", "tfsparse.ops", best_of(lambda: ops.chunk_l1_norms(x, 32768), repeats))
    add("chunk_l1_norms", "np.add.reduceat", best_of(lambda: np.add.reduceat(np.abs(x), starts), repeats))

    # sparse decoding of P payloads of k entries each (different random supports)
    for p in payloads:
        idx = np.concatenate([np.sort(rng.choice(n, k, replace=False)) for _ in range(p)]).astype(np.int64)
        val = rng.standard_normal(idx.size, dtype=np.float32)
        parts = np.split(np.arange(idx.size), p)

        def dense_decode():
            acc = np.zeros(n, np.float32)
            for part in parts:
                d = np.zeros(n, np.float32)
                d[idx[part]] = val[part]
                acc += d
            return acc

        add("decode", "tfsparse.ops scatter_add", best_of(lambda: ops.scatter_add(n, idx, val), repeats), payloads=p)
        dense_repeats = repeats if p * n <= (1 << 26) else 1
        add("decode", "dense decode + add", best_of(dense_decode, dense_repeats), payloads=p)
    return rows


# ----------------------------------------------------------------------------- CUDA

def cuda_best_of(fn, repeats: int) -> float:
    """Seconds of GPU time between two CUDA events around ``fn()``, the minimum of ``repeats``
    runs after one warm-up (the host's work in ``fn`` counts where the GPU waits for it)."""
    from numba import cuda

    fn()
    cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, stop = cuda.event(), cuda.event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        ms = cuda.event_elapsed_time(start, stop) if hasattr(cuda, "event_elapsed_time") else start.elapsed_time(stop)
        best = min(best, ms / 1e3)
    return best


def bench_cuda(n: int, density: float, repeats: int, payloads: list[int], exchange: bool = True) -> list[dict]:
    """The CUDA kernels, their PyTorch/CuPy equivalents and one exchange round, on one GPU."""
    from numba import cuda

    import tfsparse.ops as ops

    rng = np.random.default_rng(n)
    x = rng.standard_normal(n, dtype=np.float32)
    k = max(1, int(n * density))
    d = cuda.to_device(x)
    t = ops.kth_largest_abs(d, k)
    nbytes = x.nbytes
    rows = []

    def timed(fn):
        return cuda_best_of(fn, repeats)

    def add(op, impl, seconds, **extra):
        gbps = nbytes / seconds / 1e9 if seconds > 0 else float("nan")
        rows.append({"n": n, "k": k, "op": op, "impl": impl, "device": "cuda", "seconds": seconds, "gbps": gbps,
                     **extra})
        print(f"  n={n:>11,} {op:<18} {impl:<34} {seconds * 1e3:10.4f} ms  {gbps:7.1f} GB/s", flush=True)

    dst = cuda.device_array_like(d)
    add("copy", "device-to-device copy", timed(lambda: dst.copy_to_device(d)))
    add("topk", "tfsparse.ops cuda", timed(lambda: ops.topk_abs(d, k)))
    add("kth_largest", "tfsparse.ops cuda", timed(lambda: ops.kth_largest_abs(d, k)))
    add("sample_threshold", "tfsparse.ops cuda", timed(lambda: ops.sample_threshold(d, k)))
    add("select_threshold", "tfsparse.ops cuda", timed(lambda: ops.select_threshold(d, t)))
    add("hash_select", "tfsparse.ops cuda (capacity k)", timed(lambda: ops.hash_select(d, t, k)))
    add("hash_select", "cuda sample_threshold + hash", timed(lambda: ops.hash_select(d, ops.sample_threshold(d, k), k)))
    survivors = getattr(ops.backend("cuda"), "hash_survivors", None)  # None: code before 2026-11-26
    if survivors is not None:
        add("hash_survivors", "cuda sample_threshold + hash survivors (DRAGONN's device encode)",
            timed(lambda: survivors(d, ops.sample_threshold(d, k), 4 * k)))
    add("quantize_int8", "tfsparse.ops cuda", timed(lambda: ops.quantize_int8(d)))
    add("truncate_fp16", "tfsparse.ops cuda", timed(lambda: ops.truncate_fp16(d)))
    add("chunk_l1_norms", "tfsparse.ops cuda", timed(lambda: ops.chunk_l1_norms(d, 32768)))
    for name, impls in _gpu_peers(d, x, n, k, t).items():
        for impl, fn in impls:
            add(name, impl, timed(fn))
    for alg in ("topk", "dragonn") if exchange else ():
        step_dev, step_host = _exchange_steps(d, alg, density)
        add("exchange_step", f"{alg}: device-resident exchange", timed(step_dev))
        add("exchange_step", f"{alg}: copy to host + host exchange", timed(step_host))
    try:
        import tensorflow as tf

        if tf.config.list_logical_devices("GPU"):
            with tf.device("GPU:0"):
                xt = tf.constant(x)
                add("topk", "tf.math.top_k (GPU)", timed(lambda: tf.math.top_k(tf.abs(xt), k).indices.numpy()))
    except ImportError:
        pass
    try:
        import torch
    except ImportError:
        torch = None
    for p in payloads:
        idx = cuda.to_device(np.concatenate([rng.choice(n, k, replace=False) for _ in range(p)]).astype(np.int64))
        val = cuda.to_device(rng.standard_normal(p * k, dtype=np.float32))
        add("decode", "tfsparse.ops cuda scatter_add", timed(lambda: ops.scatter_add(n, idx, val)), payloads=p)
        if torch is not None:
            it, vt = torch.as_tensor(idx, device="cuda"), torch.as_tensor(val, device="cuda")
            add("decode", "torch zeros(n).index_add_", timed(lambda: torch.zeros(n, device="cuda").index_add_(0, it, vt)),
                payloads=p)
    return rows


def _gpu_peers(d, x, n: int, k: int, t) -> dict:
    """What a GPU user has otherwise, on the same device array (zero-copy views): PyTorch and
    CuPy, where installed.  ``{op: [(impl, fn), ...]}``; the names match the tfsparse rows."""
    peers: dict = {}

    def put(op, impl, fn):
        peers.setdefault(op, []).append((impl, fn))

    s = max(1, n // 100)  # DGC's 1% sample
    rank = max(1, -(-k * s // n))
    try:
        import torch

        xt = torch.as_tensor(d, device="cuda")
        pos = torch.randint(0, n, (s,), device="cuda")
        q_scale = 127.0
        put("topk", "torch.topk(x.abs(), k)", lambda: torch.topk(xt.abs(), k))
        put("select_threshold", "torch.nonzero(x.abs() >= t)", lambda: torch.nonzero(xt.abs() >= float(t)))
        put("hash_select", "torch sampled threshold + nonzero",
            lambda: torch.nonzero(xt.abs() >= torch.topk(xt[pos].abs(), rank).values[-1]))
        put("quantize_int8", "torch max-scaled int8",
            lambda: (xt * (q_scale / xt.abs().max())).round_().clamp_(-127, 127).to(torch.int8))
        put("truncate_fp16", "x.half()", lambda: xt.half())
        if n % 32768 == 0:
            put("chunk_l1_norms", "x.view(-1, 32768).abs().sum(1)", lambda: xt.view(-1, 32768).abs().sum(1))
        put("copy", "torch clone", lambda: xt.clone())
    except ImportError:
        pass
    try:
        import cupy

        xc = cupy.asarray(d)
        put("topk", "cupy.argpartition(|x|)", lambda: cupy.argpartition(cupy.abs(xc), n - k)[n - k:])
        put("select_threshold", "cupy.nonzero(|x| >= t)", lambda: cupy.nonzero(cupy.abs(xc) >= float(t)))
        put("truncate_fp16", "x.astype(float16) (cupy)", lambda: xc.astype(cupy.float16))
    except ImportError:
        pass
    return peers


def _exchange_steps(d, algorithm: str, density: float):
    """One exchange round of one rank on the device gradient ``d``: device-resident (encode and
    decode on the GPU, tfsparse.space.CudaSpace) vs the gradient copied to the host first."""
    from tfsparse.collectives.inprocess import InProcessCommunicator, InProcessWorld
    from tfsparse.exchange import GradientExchange

    dev = GradientExchange(algorithm, density, communicator=InProcessCommunicator(InProcessWorld(1), 0))
    host = GradientExchange(algorithm, density, communicator=InProcessCommunicator(InProcessWorld(1), 0))
    return (lambda: dev.exchange_numpy(d)), (lambda: host.exchange_numpy(d.copy_to_host()))


# ----------------------------------------------------------------------------- report

def _seconds(rows, op, impl, n, device=None, **match):
    for r in rows:
        if (r["op"], r["impl"], r["n"]) == (op, impl, n) and r.get("device") == device and \
                all(r.get(key) == v for key, v in match.items()):
            return r["seconds"]
    return None


def evaluate_goals(rows, sizes, payloads) -> dict:
    goals = {}
    for n in sizes:
        g = {}
        tf_t, ours = _seconds(rows, "topk", "tf.math.top_k", n), _seconds(rows, "topk", "tfsparse.ops", n)
        if tf_t and ours:
            g["topk_vs_tf_top_k"] = tf_t / ours
        copies = [s for s in (_seconds(rows, "copy", "numpy (1 thread)", n), _seconds(rows, "copy", "numba prange", n))
                  if s]
        sel, np_sel = _seconds(rows, "select_threshold", "tfsparse.ops", n), \
            _seconds(rows, "select_threshold", "np threshold + nonzero", n)
        if copies and sel:
            g["select_vs_copy_bandwidth"] = min(copies) / sel
            g["numpy_select_vs_copy_bandwidth"] = min(copies) / np_sel
        hs = _seconds(rows, "hash_select", "tfsparse.ops (capacity k)", n)
        if hs and np_sel:
            g["hash_vs_threshold_nonzero"] = np_sel / hs
        if payloads:
            lo, hi = min(payloads), max(payloads)
            a = _seconds(rows, "decode", "tfsparse.ops scatter_add", n, payloads=lo)
            b = _seconds(rows, "decode", "tfsparse.ops scatter_add", n, payloads=hi)
            c = _seconds(rows, "decode", "dense decode + add", n, payloads=lo)
            e = _seconds(rows, "decode", "dense decode + add", n, payloads=hi)
            if a and b:
                g["decode_flatness"] = b / a
                g["decode_dense_growth"] = e / c if c and e else None
                if c and e and hi > lo:  # cost of one more payload, sparse vs dense decoding
                    g["decode_marginal_vs_dense"] = (b - a) / (e - c)
        enc = _seconds(rows, "hash_select", "tfsparse.ops cuda (capacity k)", n, device="cuda")
        if enc is not None and n * 4 >= 512 * 2**20:
            g["cuda_512MB_encode_ms"] = enc * 1e3
            full = _seconds(rows, "hash_select", "cuda sample_threshold + hash", n, device="cuda")
            g["cuda_512MB_dragonn_encode_ms"] = full * 1e3 if full else None
        # the bound: the faster of Numba's device-to-device copy and torch's clone
        copies = [s for s in (_seconds(rows, "copy", "device-to-device copy", n, device="cuda"),
                              _seconds(rows, "copy", "torch clone", n, device="cuda")) if s]
        copy = min(copies) if copies else None
        decode = [(_seconds(rows, "decode", "tfsparse.ops cuda scatter_add", n, device="cuda", payloads=p),
                   _seconds(rows, "decode", "torch zeros(n).index_add_", n, device="cuda", payloads=p))
                  for p in payloads]
        decode = [ours / peer for ours, peer in decode if ours and peer]
        if decode:
            g["cuda_decode_vs_index_add"] = max(decode)
        full = _seconds(rows, "hash_survivors", "cuda sample_threshold + hash survivors (DRAGONN's device encode)",
                        n, device="cuda")
        if full and n * 4 >= 512 * 2**20:
            g["cuda_512MB_dragonn_survivors_ms"] = full * 1e3
        for op, impl in CUDA_ENCODE:
            ours = _seconds(rows, op, impl, n, device="cuda")
            name = op + ("_sampled" if "sample" in impl else "")
            if ours and copy and copy > 0:
                g[f"cuda_{name}_vs_copy"] = ours / copy
            peers = [r["seconds"] for r in rows if r["op"] == op and r["n"] == n and r.get("device") == "cuda"
                     and "tfsparse" not in r["impl"] and not r["impl"].startswith("cuda ") and r["seconds"] > 0]
            if ours and peers and "sample" not in impl:
                g[f"cuda_{op}_vs_best_peer"] = ours / min(peers)
        goals[str(n)] = g
    return goals


def plot(rows, out_png: Path, payloads):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops_order = ["copy", "topk", "kth_largest", "sample_threshold", "select_threshold", "hash_select",
                 "quantize_int8", "truncate_fp16", "chunk_l1_norms"]
    devices = sorted({r.get("device") or "cpu" for r in rows})
    fig, axes = plt.subplots(len(devices), 2, figsize=(15, 5.5 * len(devices)), squeeze=False)
    for row_axes, dev in zip(axes, devices):
        ax, ax2 = row_axes
        sel = [r for r in rows if (r.get("device") or "cpu") == dev]
        for op in ops_order:
            for impl in sorted({r["impl"] for r in sel if r["op"] == op}):
                pts = sorted((r["n"], r["seconds"]) for r in sel if r["op"] == op and r["impl"] == impl)
                if pts:
                    style = "-" if "tfsparse" in impl else "--"
                    ax.loglog(*zip(*pts), style, marker="o", ms=3, label=f"{op}: {impl}")
        ax.set_xlabel("n (float32 elements)")
        ax.set_ylabel("seconds (best of repeats)")
        ax.set_title(f"{dev}: kernels vs alternatives")
        ax.legend(fontsize=6, ncol=2)
        ax.grid(True, which="both", alpha=0.3)
        for impl in sorted({r["impl"] for r in sel if r["op"] == "decode"}):
            for n in sorted({r["n"] for r in sel if r["op"] == "decode"}):
                pts = sorted((r["payloads"], r["seconds"]) for r in sel
                             if r["op"] == "decode" and r["impl"] == impl and r["n"] == n)
                ax2.loglog(*zip(*pts), "-" if "tfsparse" in impl else "--", marker="o", ms=3,
                           label=f"{impl}, n={n:,}")
        ax2.set_xlabel("payloads decoded (k = density * n each)")
        ax2.set_ylabel("seconds")
        ax2.set_title(f"{dev}: sparse vs dense decoding")
        ax2.legend(fontsize=6)
        ax2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    files.save_figure(fig, out_png, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,4M,16M,64M,128M", help="comma-separated n (suffixes K, M, G)")
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--payloads", default="1,4,16,64", help="payload counts for the decoding benchmark")
    ap.add_argument("--threads", type=int, default=None, help="Numba threads (default: all)")
    ap.add_argument("--no-tf", action="store_true", help="skip tf.math.top_k")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU benchmark")
    ap.add_argument("--cuda", action="store_true", help="also benchmark the CUDA kernels (needs a GPU)")
    ap.add_argument("--no-exchange", action="store_true", help="skip the CUDA exchange rounds")
    ap.add_argument("--cuda-shape", default=None, metavar="TPB,ITEMS,MAX_BLOCKS",
                    help="CUDA launch shape (tfsparse.ops.cuda.set_block_shape), e.g. 256,8,65536")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)

    import numba

    if args.threads:
        numba.set_num_threads(args.threads)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    payloads = [int(p) for p in args.payloads.split(",") if p.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from tfsparse.ops import cpu

    cpu.warmup()
    rows = []
    t0 = time.time()
    if not args.no_cpu:
        print(f"CPU: {numba.get_num_threads()} Numba threads ({numba.threading_layer()} threading layer)")
        for n in sizes:
            rows += bench_cpu(n, args.density, args.repeats, payloads, with_tf=not args.no_tf)
    cuda_info = None
    if args.cuda:
        from numba import cuda

        if getattr(cuda, "is_available", lambda: True)():
            if args.cuda_shape:
                from tfsparse.ops import cuda as cuda_ops

                cuda_ops.set_block_shape(*(int(v) for v in args.cuda_shape.split(",")))
            dev = cuda.get_current_device()
            cuda_info = {"name": str(getattr(dev, "name", dev)),
                         "compute_capability": list(getattr(dev, "compute_capability", ()))}
            print(f"CUDA: {cuda_info}")
            for n in sizes:
                rows += bench_cuda(n, args.density, args.repeats, payloads, exchange=not args.no_exchange)
        else:
            print("CUDA: no GPU available, skipped")
    goals = evaluate_goals(rows, sizes, payloads)
    report = {"machine": machine_info(), "cuda": cuda_info, "threading_layer": numba.threading_layer(),
              "config": {"sizes": sizes, "density": args.density, "repeats": args.repeats, "payloads": payloads},
              "goal_definitions": {key: {"what": what, "target": target} for key, (what, target) in GOALS.items()},
              "goals": goals, "results": rows, "wall_seconds": time.time() - t0}
    files.write_text(out / "bench_kernels.json", json.dumps(report, indent=1, default=float))
    plot(rows, out / "bench_kernels.png", payloads)
    print("\ngoals (per n):")
    for n, g in goals.items():
        print(f"  n={int(n):>11,}: " + ", ".join(f"{key}={v:.3g}" for key, v in g.items() if v is not None))
    print(f"wrote {out / 'bench_kernels.json'} and {out / 'bench_kernels.png'}")


if __name__ == "__main__":
    main()
