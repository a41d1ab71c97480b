#!/usr/bin/env python
"""The measurements behind the engine's implementation choices (a benchmark, not a test).

The kernels and the host space make a few choices for speed that their source explains; the
figures that justify them live here, re-measured on the machine at hand, not in the source.
Each choice is timed against the alternative it replaced, where that alternative is still a
call away, on one thread (the choices were made per core; BLAS limited to one thread too), the
minimum of several runs:

* ``stream``         -- error feedback's pass (:func:`tfsparse.ops.cpu.add_select`, collecting
                        nothing) with non-temporal stores against plain ones, alone and followed
                        by a read of the sums: where :data:`tfsparse.ops.cpu.STREAM_MIN` sits
* ``dense_select``   -- the k-th largest of the magnitudes' keys for a dense ``k``
                        (:func:`tfsparse.ops.cpu.kth_key`) against numpy's introselect
                        (``np.partition``): gTop-k's merge (2k keys, k of them) and a quarter
* ``half_encode``    -- float32 -> float16 codes and the rounding loss
                        (:func:`tfsparse.ops.cpu.half_encode`) against numpy's ``astype``
* ``half_decode``    -- float16 codes -> float32 (:func:`tfsparse.ops.cpu.decode16_into`) without
                        a NaN among them (a loop without a test) and with one (a test per code,
                        the table for the Inf and NaN codes)
* ``message_buffer`` -- an encoding into a reused message buffer (:mod:`tfsparse.buffers`)
                        against one from ``np.empty`` each time (which the C allocator may hand
                        back from the last call's) and against new pages each time
* ``digest``         -- the replica check's sums (:func:`tfsparse.ops.cpu.word_sums`) against
                        the numpy expression of the same sums
* ``all_finite``     -- the host space's finite check, one BLAS dot product
                        (:meth:`tfsparse.space.HostSpace.all_finite`), against ``np.isfinite``

Writes ``<out>.json`` (rows of choice, size, implementation, ms) and ``<out>.png``.

    python tools/bench_choices.py --out results/engine_choices     # about 20 seconds
"""
from __future__ import annotations

import argparse
import json
import mmap
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfsparse import files  # noqa: E402
from bench_kernels import best_of, machine_info  # noqa: E402  (run as a script: tools/ is on the path)

M = 1 << 20
#: the sizes each choice is timed at, in elements (``--scale`` multiplies them)
SIZES = {
    "stream": (1 << 22, 1 << 23, 17_088_522, 25_165_824),
    "dense_select": (341_772, 17_088_522),
    "half_encode": (4_325_376, 17_088_522),
    "half_decode": (17_088_522,),
    "message_buffer": (4_325_376,),
    "digest": (17_088_522,),
    "all_finite": (25_165_824,),
}


def _gradient(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


def stream(n, repeats):
    """Error feedback's pass, streamed against plain stores, alone and with a read of ``acc``."""
    from tfsparse.ops import cpu
    from tfsparse.ops._common import threshold_key

    g, r, acc = _gradient(n, 1), _gradient(n, 2), np.empty(n, np.float32)
    nothing = threshold_key(np.float32(np.finfo(np.float32).max))  # no finite sum selected
    for streamed, impl in ((True, "non-temporal stores"), (False, "plain stores")):
        yield impl, best_of(lambda: cpu.add_select(g, r, acc, nothing, stream=streamed), repeats)
        yield impl + ", then a read of acc", best_of(
            lambda: (cpu.add_select(g, r, acc, nothing, stream=streamed), acc.max()), repeats)


def dense_select(n, repeats):
    """The k-th largest key for ``k = n / 2`` (a merge) or ``n / 4``, ours against numpy's."""
    from tfsparse.ops import cpu

    keys = cpu.keys_of(_gradient(n, 3))
    k = n // 2 if n < 4 * M else n // 4
    yield f"tfsparse kth_key (k = {k:,})", best_of(lambda: cpu.kth_key(keys, k), repeats)
    yield f"np.partition (k = {k:,})", best_of(lambda: np.partition(keys, n - k)[n - k], repeats)


def half_encode(n, repeats):
    """float16 codes and the loss, ours against numpy's conversion and subtraction."""
    from tfsparse.ops import cpu

    x = _gradient(n, 4)
    codes, loss = np.empty(n, np.uint16), np.empty(n, np.float32)
    yield "tfsparse half_encode", best_of(lambda: cpu.half_encode(x, loss=loss, out=codes), repeats)
    half = np.empty(n, np.float16)

    def numpy_encode():
        np.copyto(half, x, casting="same_kind")
        np.subtract(x, half, out=loss)

    yield "numpy astype + subtract", best_of(numpy_encode, repeats)


def half_decode(n, repeats):
    """float16 codes decoded, without a NaN (a loop without a test) and with one (a test per
    code, the table for Inf and NaN)."""
    from tfsparse.ops import cpu

    codes = cpu.half_encode(_gradient(n, 5))[0]
    with_nan = codes.copy()
    with_nan[n // 2] = 0x7E00
    out = np.empty(n, np.float32)
    yield "no NaN: the loop without a test", best_of(lambda: cpu.decode16_into(codes, cpu.HALF_TABLE, out), repeats)
    yield "one NaN: a test per code (table for Inf/NaN)", best_of(
        lambda: cpu.decode16_into(with_nan, cpu.HALF_TABLE, out), repeats)


def message_buffer(n, repeats):
    """A float16 encoding into one reused message buffer against a fresh one each time."""
    from tfsparse.ops import cpu

    x, loss, codes = _gradient(n, 6), np.empty(n, np.float32), np.empty(n, np.uint16)
    yield "reused buffer", best_of(lambda: cpu.half_encode(x, loss=loss, out=codes), repeats)
    yield "np.empty each time", best_of(lambda: cpu.half_encode(x, loss=loss, out=np.empty(n, np.uint16)), repeats)

    def fresh_pages():  # what a buffer costs where the allocator maps new memory for it
        with mmap.mmap(-1, 2 * n) as pages:
            cpu.half_encode(x, loss=loss, out=np.frombuffer(pages, np.uint16))

    yield "fresh pages each time", best_of(fresh_pages, repeats)


def digest(n, repeats):
    """The replica digest's two sums in one pass against numpy's expression of them."""
    from tfsparse.ops import cpu
    from tfsparse.ops._cpu_digest import WEIGHT_MOD

    words = _gradient(n, 7).view(np.uint32)

    def numpy_sums():
        wide = words.astype(np.uint64)
        weights = np.arange(n, dtype=np.uint64) % np.uint64(WEIGHT_MOD) + np.uint64(1)
        return np.array([wide.sum(), (wide * weights).sum()], np.uint64)

    assert np.array_equal(numpy_sums(), cpu.word_sums(words))
    yield "tfsparse word_sums", best_of(lambda: cpu.word_sums(words), repeats)
    yield "numpy expression", best_of(numpy_sums, repeats)


def all_finite(n, repeats):
    """The host's finite check (a dot product) against ``np.isfinite(x).all()``."""
    from tfsparse.space import HOST

    x = _gradient(n, 8)
    yield "np.dot(x, x)", best_of(lambda: HOST.all_finite(x), repeats)
    yield "np.isfinite(x).all()", best_of(lambda: np.isfinite(x).all(), repeats)


CHOICES = {"stream": stream, "dense_select": dense_select, "half_encode": half_encode,
           "half_decode": half_decode, "message_buffer": message_buffer, "digest": digest,
           "all_finite": all_finite}


def plot(rows, path: Path) -> None:
    """One bar per row: its time relative to the first row of its choice and size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = {}
    labels, ratios = [], []
    for row in rows:
        key = (row["choice"], row["n"])
        first.setdefault(key, row["ms"])
        labels.append(f"{row['choice']} {row['n'] / M:.1f}M: {row['impl']}")
        ratios.append(row["ms"] / first[key])
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(rows) + 1))
    ax.barh(range(len(rows)), ratios, color=["C0" if r == 1.0 else "C1" for r in ratios])
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.5)
    ax.set_xlabel("time relative to the first row of its choice and size")
    fig.tight_layout()
    files.save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--choices", default=",".join(CHOICES), help=f"comma-separated, of: {', '.join(CHOICES)}")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every size (a smoke run: 0.001)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "results" / "engine_choices"), help="path without suffix")
    args = ap.parse_args(argv)
    chosen = [c for c in args.choices.split(",") if c]
    for name in chosen:
        if name not in CHOICES:
            ap.error(f"--choices: {name!r} is not valid; accepted: {', '.join(CHOICES)}")
    if not args.scale > 0:
        ap.error(f"--scale={args.scale} is not valid; accepted: a number above 0")
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats} is not valid; accepted: a whole number of at least 1")

    import numba

    from tfsparse.ops import cpu

    from threadpoolctl import threadpool_limits

    numba.set_num_threads(1)
    cpu.set_thread_limit(1)
    threadpool_limits(1)  # the BLAS dot of the finite check, too
    start = time.perf_counter()
    rows = []
    for name in chosen:
        for size in SIZES[name]:
            n = max(64, int(size * args.scale))
            for impl, seconds in CHOICES[name](n, args.repeats):
                rows.append({"choice": name, "n": n, "impl": impl, "ms": round(seconds * 1e3, 3)})
                print(f"{name:<15} n={n:>11,} {impl:<40} {seconds * 1e3:9.3f} ms", flush=True)
    out = Path(args.out)
    report = {"machine": machine_info(), "threads": 1, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python tools/bench_choices.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": rows, "wall_seconds": round(time.perf_counter() - start, 1)}
    files.write_text(out.with_suffix(".json"), json.dumps(report, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
