"""The median over seeds of ``tools/bench_time_to_accuracy.py`` launches: one table and one figure.

    python tools/time_to_accuracy_summary.py OUT RUN_S0.json RUN_S1.json RUN_S2.json

Each input is one launch (one ``--seed``), every setting side by side against dense float32's own
target in that launch (its best test accuracy less 0.5 point).  Per setting: the median time to
that target over the seeds (a seed that never reached it counts as not reached: the median is
"not reached" when half the seeds or more did not), the median of the per-seed ratios against
dense float32 and against the fastest 16-bit dense setting of the same launch (a seed that did
not reach the target counts as a ratio of 0), the median final
and best accuracy against dense float32's, and the median step.  Writes ``OUT.json``,
``OUT.png`` (time to target per seed and the median; final accuracy) and prints the Markdown
table.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfsparse import files  # noqa: E402


def _is(run, algorithm, wires):
    c = run["config"] or {}
    return c.get("algorithm") == algorithm and c.get("wire_dtype", "float32") in wires


def _median(values):
    """The median, with None (not reached) as +inf; None when the median is not reached."""
    finite = [math.inf if v is None else v for v in values]
    m = float(np.median(finite))
    return None if math.isinf(m) else m


def summarize(launches: list[dict]) -> dict:
    labels = [r["label"] for r in launches[0]["runs"] if r["config"] is not None]
    # without a dense 16-bit row there is nothing to compare with: no ratio (None), not 0
    with16 = any(_is(r, "dense", ("float16", "bfloat16")) for launch in launches for r in launch["runs"])
    rows = []
    for label in labels:
        per_seed = []
        for launch in launches:
            runs = {r["label"]: r for r in launch["runs"]}
            run = runs[label]
            f32 = next(r for r in launch["runs"] if _is(r, "dense", ("float32",)))
            half = [r for r in launch["runs"] if _is(r, "dense", ("float16", "bfloat16"))]
            best16 = min((r["time_to_target_s"] for r in half if r["time_to_target_s"]), default=None)
            t = run["time_to_target_s"]
            per_seed.append({"seed": launch.get("seed"), "time_to_target_s": t,
                             "vs_f32": f32["time_to_target_s"] / t if t and f32["time_to_target_s"] else None,
                             "vs_f16": best16 / t if t and best16 else None,
                             "final_vs_f32": run["final_accuracy"] - f32["final_accuracy"],
                             "best_vs_f32": run["best_accuracy"] - f32["best_accuracy"],
                             "final_accuracy": run["final_accuracy"], "step_ms": run["step_ms_median"],
                             "epochs_to_target": run["epochs_to_target"], "run_s": run["epoch_end_s"][-1],
                             "setting": run.get("setting")})
        reached = sum(s["time_to_target_s"] is not None for s in per_seed)
        # a speedup: a seed that did not reach the target counts as none (0)
        ratio = lambda key: (float(np.median([s[key] or 0.0 for s in per_seed]))  # noqa: E731
                             if reached * 2 > len(per_seed) else None)
        rows.append({"label": label, "seeds": per_seed, "reached": reached,
                     "time_to_target_s": _median([s["time_to_target_s"] for s in per_seed]),
                     "vs_f32": ratio("vs_f32"), "vs_f16": ratio("vs_f16") if with16 else None,
                     "final_vs_f32": float(np.median([s["final_vs_f32"] for s in per_seed])),
                     "final_accuracy": float(np.median([s["final_accuracy"] for s in per_seed])),
                     "step_ms": float(np.median([s["step_ms"] for s in per_seed]))})
    first = launches[0]
    return {"model": first["model"], "processes": first["processes"], "epochs": first["epochs"],
            "network": first["network"], "machine": first["machine"], "date": first["date"],
            "target_rule": first.get("target_rule"), "targets": [launch["target"] for launch in launches],
            "seeds": [launch.get("seed") for launch in launches], "rows": rows}


def table(summary: dict) -> str:
    n = len(summary["seeds"])
    lines = [f"| setting | median time to target (s) | vs dense f32 | vs dense 16-bit | reached (of {n}) | "
             "final accuracy, vs dense f32 (points) | median step (ms) |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "—" if v is None else f.format(v)  # noqa: E731
    for r in summary["rows"]:
        lines.append(f"| {r['label']} | {fmt(r['time_to_target_s'], '{:.1f}') if r['time_to_target_s'] else 'not reached'} "
                     f"| {fmt(r['vs_f32'], '{:.2f}×')} | {fmt(r['vs_f16'], '{:.2f}×')} | {r['reached']} | "
                     f"{r['final_accuracy']:.4f}, {100 * r['final_vs_f32']:+.2f} | {r['step_ms']:.0f} |")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.5 * len(rows) + 2.5))
    y = np.arange(len(rows))
    for i, r in enumerate(rows):
        med = r["time_to_target_s"]
        ax1.barh(i, med if med else float(np.median([s["run_s"] for s in r["seeds"]])),
                 color="tab:blue" if med else "tab:red", alpha=0.5)
        for s in r["seeds"]:
            t = s["time_to_target_s"]
            ax1.plot(t if t else s["run_s"], i, "kx" if t is None else "ko", ms=4)
        ax2.barh(i, 100 * r["final_vs_f32"], color="tab:green" if r["final_vs_f32"] >= -0.005 else "tab:orange")
    for ax in (ax1, ax2):
        ax.set_yticks(y, [r["label"] for r in rows])
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    ax1.set_xlabel("seconds to dense f32's best accuracy - 0.5 point (bar: median; dots: seeds; red/x: not reached, the whole run)")
    ax2.axvline(-0.5, color="k", lw=0.6, ls=":")
    ax2.set_xlabel("final accuracy - dense f32's (points, median over seeds)")
    fig.suptitle(f"{summary['model']}, {summary['processes']} processes, {summary['network']}, "
                 f"seeds {summary['seeds']}, {summary['machine']}")
    fig.tight_layout()
    files.save_figure(fig, path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("launches", nargs="+", help="bench_time_to_accuracy.py JSON files, one per seed")
    args = parser.parse_args(argv)
    launches = [json.loads(Path(p).read_text()) for p in args.launches]
    labels = [[r["label"] for r in launch["runs"]] for launch in launches]
    if any(lab != labels[0] for lab in labels):
        raise ValueError(f"launches={args.launches!r}: every launch must run the same settings, got {labels}")
    summary = summarize(launches)
    files.write_text(args.out + ".json", json.dumps(summary, indent=1))
    plot(summary, args.out + ".png")
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
