#!/usr/bin/env python
"""Where a CUDA op's time goes (a diagnostic for a machine with a GPU, not a test).

Prints, for the Numba CUDA backend of :mod:`tfsparse.ops`:

* the fixed costs around kernels, host wall-clock per call: an empty kernel launch, a launch
  through the kernel table, ``cuda.device_array`` and ``cuda.to_device`` of two int64, a
  one-element ``copy_to_host``;
* per size, with CUDA events (best of ``--repeats``): each op next to the kernels it launches,
  run alone on prepared buffers -- the difference is allocation, host copies and launches.

    python tools/probe_cuda.py                    # 64 MB and 512 MB float32
    python tools/probe_cuda.py --sizes 16M --density 0.01

docs/gpus.md ("Where the time goes") quotes its figures from an H100.  Under Numba's CUDA
simulator it runs (tiny sizes) but times nothing meaningful.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_kernels import cuda_best_of, parse_size  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16M,128M", help="comma-separated float32 element counts (K, M, G)")
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--repeats", type=int, default=20, help="CUDA-event timings: best of this many")
    ap.add_argument("--calls", type=int, default=2000, help="host wall-clock timings: mean over this many")
    args = ap.parse_args(argv)

    from numba import cuda

    import tfsparse.ops as ops
    from tfsparse.ops import _common as C
    from tfsparse.ops import cuda as kc

    if kc.SIMULATOR:
        kc.set_block_shape(32, 8, 2)  # the simulator runs one Python thread per CUDA thread
    K = kc._K
    sms = getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", 2)

    def wall_us(fn):
        fn()
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        cuda.synchronize()
        return (time.perf_counter() - t0) / args.calls * 1e6

    def event_us(fn):
        return cuda_best_of(fn, args.repeats) * 1e6

    def show(what, us):
        print(f"  {what:<46} {us:10.1f} us", flush=True)

    @cuda.jit
    def empty(a):
        pass

    tiny = cuda.device_array(2, np.int64)
    print("fixed costs (host wall-clock per call)")
    show("empty kernel launch", wall_us(lambda: empty[1, 32](tiny)))
    show("launch through the kernel table (fill_i64)", wall_us(lambda: K["fill_i64"][1, 32](tiny, 0)))
    show("cuda.device_array(2, int64)", wall_us(lambda: cuda.device_array(2, np.int64)))
    show("cuda.to_device(2 int64)", wall_us(lambda: cuda.to_device(np.zeros(2, np.int64))))
    show("copy_to_host of one int64", wall_us(lambda: tiny[:1].copy_to_host()))

    rng = np.random.default_rng(0)
    for n in (parse_size(s) for s in args.sizes.split(",") if s.strip()):
        x = cuda.to_device(rng.standard_normal(n, dtype=np.float32))
        xu = x.view(np.uint32)
        k = max(1, int(n * args.density))
        t = ops.kth_largest_abs(x, k)
        print(f"n = {n:,} ({n * 4 / 2**20:.0f} MB), k = {k:,} (CUDA events, best of {args.repeats})")
        dst = cuda.device_array_like(x)
        show("device-to-device copy (Numba)", event_us(lambda: dst.copy_to_device(x)))
        show(f"device_array of {n:,} uint16", event_us(lambda: cuda.device_array(n, np.uint16)))

        out16 = cuda.device_array(n, np.uint16)
        show("truncate_fp16", event_us(lambda: ops.truncate_fp16(x)))
        show("  trunc16 kernel alone", event_us(lambda: K["trunc16"][K.grid(n), K.tpb](xu, out16)))
        show(f"  trunc16 kernel, {sms * 32} blocks", event_us(lambda: K["trunc16"][sms * 32, K.tpb](xu, out16)))

        amax = cuda.device_array(1, np.uint32)
        q = cuda.device_array(n, np.int8)
        show("quantize_int8", event_us(lambda: ops.quantize_int8(x)))
        show("  max_key kernel alone", event_us(lambda: K["max_key"][K.grid(n), K.tpb](xu, amax)))
        show("  quantize kernel alone", event_us(lambda: K["quantize"][K.grid(n), K.tpb](x, amax.view(np.float32), q)))

        show("kth_largest_abs (radix select + read-back)", event_us(lambda: ops.kth_largest_abs(x, k)))
        hist = cuda.device_array(kc._NB_MAX, np.int64)
        K["fill_i64"][K.grid(hist.size), K.tpb](hist, 0)
        state = kc._params(0, k, "probe_state")
        nb = min(K.tiles(n), K.hist_blocks)
        show("  hist kernel alone (first level)", event_us(lambda: K["hist"][nb, K.tpb](xu, state, 19, 12, hist)))
        show("  find kernel alone", event_us(lambda: K["find"][1, K.tpb](hist, 12, state)))

        params = kc._params(int(C.threshold_key(t)) - 1, 0, "probe_params")
        nt_, nbk = K.ntiles(n), K.tiles(n)
        cnt, offs = cuda.device_array(nt_, np.int64), cuda.device_array(nt_, np.int64)
        total = cuda.device_array(1, np.int64)
        K["count"][nbk, K.tpb](xu, params, cnt)
        K["scan"][1, K.tpb](cnt, params, offs, total)
        size = int(total.copy_to_host()[0])
        oi, ov = cuda.device_array(max(size, 1), np.int64), cuda.device_array(max(size, 1), np.float32)
        show("topk_abs", event_us(lambda: ops.topk_abs(x, k)))
        show("select_threshold", event_us(lambda: ops.select_threshold(x, t)))
        show("  count kernel alone", event_us(lambda: K["count"][nbk, K.tpb](xu, params, cnt)))
        show(f"  scan kernel alone ({nt_:,} tiles, one block)", event_us(lambda: K["scan"][1, K.tpb](cnt, params, offs, total)))
        show("  write kernel alone", event_us(lambda: K["write"][nbk, K.tpb](xu, x, params, offs, oi, ov)))

        s = C.sample_count(n, 0.01)
        samples = cuda.device_array(s, np.uint32)
        ha, hb = C.hash_params(0, C.SALT_SAMPLE)
        show("sample_threshold", event_us(lambda: ops.sample_threshold(x, k)))
        show(f"  sample kernel alone ({s:,} samples)",
             event_us(lambda: K["sample"][K.grid(s), K.tpb](xu, s, C.sample_step(n, s), ha, hb, samples)))

        table = cuda.device_array(k, np.int64)
        hh = C.hash_params(0, C.SALT_HASH)
        show("hash_select (capacity k)", event_us(lambda: ops.hash_select(x, t, k)))
        show("  hash kernel alone", event_us(lambda: K["hash"][K.grid(n), K.tpb](xu, C.threshold_key(t), hh[0], hh[1], k, table)))
        show("hash_survivors (capacity 4k)", event_us(lambda: kc.hash_survivors(x, t, 4 * k)))

        idx = cuda.to_device(np.concatenate([np.random.default_rng(p).choice(n, k, replace=False)
                                             for p in range(16)]).astype(np.int64))
        val = cuda.to_device(np.ones(16 * k, np.float32))
        dense = cuda.device_array(n, np.float32)
        bad = cuda.device_array(1, np.int64)
        show("scatter_add, 16 payloads", event_us(lambda: ops.scatter_add(n, idx, val)))
        show("  fill_f32 kernel alone (the zeros)", event_us(lambda: K["fill_f32"][K.grid(n), K.tpb](dense, np.float32(0))))
        show("  scatter kernel alone", event_us(lambda: K["scatter"][K.grid(idx.size), K.tpb](idx, val, dense, bad)))
        try:
            import torch
        except ImportError:
            continue
        it, vt = torch.as_tensor(idx, device="cuda"), torch.as_tensor(val, device="cuda")
        show("torch zeros(n).index_add_, 16 payloads", event_us(lambda: torch.zeros(n, device="cuda").index_add_(0, it, vt)))
        show("torch.empty(n) (caching allocator)", event_us(lambda: torch.empty(n, device="cuda")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
