"""Training benchmark on shared memory and emulated links: step time with its phase breakdown, and
time-to-accuracy, per algorithm, P and link.

    python tools/bench_training.py [--algorithms dense,topk,gtopk,oktopk] [--procs 2,3,4]
        [--links shm,1gbit,10gbit] [--density 0.001] [--target 0.95] [--tta-density 0.01]
        [--tta-epochs 20] [--no-recipe] [--parts step,tta] [--timeout 1800] [--out results/bench_training]
    python tools/bench_training.py --quick                 # smoke test: P = 2, 3; shm, 1gbit; 4 epochs
                                                           # -> results/bench_training_quick.{json,png}
    python tools/bench_training.py --plot-only [--out results/bench_training]   # redraw from the JSON

Every (link, P) cell is measured by two launches, one after the other, each
``python -m tfsparse.run -np P [--net LINK] python ...`` (``shm``: plain shared-memory mpirun;
anything else, e.g. ``1gbit``, is given to ``--net``: every rank in its own network namespace
behind a token-bucket-shaped link, which needs root):

* **step time** -- ``tools/bench_fit_step.py`` (launched, not copied): ``model.fit`` of the
  25.2M-parameter MLP 1024-4096-4096-1024 under ``SparseStrategy`` (batch 16 per rank, SGD
  momentum, density ``--density``; dense ignores it), 12 steps per algorithm, the median of steps
  4-12 of the slowest rank; rank 0's exchange phases per step from ``CommunicationStats``
  (``encode_ms``, ``comm_ms``, ``decode_ms``, ``wait_ms``, averaged over the 12 steps).
  ``other_ms`` = step - encode - comm - decode (forward/backward, optimizer, Keras), at least 0.
* **time-to-accuracy** -- ``keras_examples/digits_demo.py --json`` (all algorithms in one launch;
  the demo's 64-256-128-10 MLP, SGD lr 0.05, batch 32 per rank, density ``--tta-density``,
  ``--tta-epochs`` epochs): rank 0's wall seconds from the start of ``fit`` to the end of the first
  epoch whose test accuracy reaches ``--target`` (validation and the first epoch's tracing
  included; ``null`` if never reached). By default every algorithm runs with the recipe that makes
  1 % density converge (README, "Convergence"): momentum correction (``--memory momentum``, for
  dense exactly momentum SGD) and 2 epochs of dense warm-up for the sparse ones; ``--no-recipe``
  runs plain error feedback with SGD momentum 0.9.

Each launch holds the MPI lock ``/tmp/tfsparse-mpi.lock`` (one MPI job at a time on this machine)
and runs under ``--timeout`` seconds (counted once the lock is held); a failed or timed-out launch
is recorded in its cell (``"error"``) and the grid goes on. ``<out>.json`` is rewritten after every
cell; ``<out>.png``: per link, stacked bars (encode / comm / decode / other) per algorithm and P,
the measured step time as a tick, and below them the time to ``--target`` accuracy (a hatched bar:
not reached, the bar is the whole run, a lower bound). Markdown tables are printed at the end.

``--quick``: P = 2, 3, links shm and 1gbit, 4 digits epochs and a target of 0.85 unless given
(``bench_fit_step``'s 12 steps are fixed); 8 launches, about 10 minutes on the 2-core development
machine; its default ``--out`` is ``results/bench_training_quick``, so it does not overwrite the full grid.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIT_STEP = REPO / "tools" / "bench_fit_step.py"
DIGITS = REPO / "keras_examples" / "digits_demo.py"
sys.path.insert(0, str(REPO))

from tfsparse import files  # noqa: E402
import bench_host  # noqa: E402  (run as a script: tools/ is on the path)

PHASES = ("encode", "comm", "decode", "other")
COLORS = {"encode": "tab:orange", "comm": "tab:blue", "decode": "tab:green", "other": "tab:gray"}
DIGITS_BATCH, DIGITS_LR, WARMUP_EPOCHS = 32, 0.05, 2


# -- launching ---------------------------------------------------------------------------

def launch(procs: int, link: str, program: list[str], timeout: float, log: Path) -> float:
    """``tfsparse-run -np procs [--net link] program`` under the MPI lock; returns its wall seconds.
    Raises RuntimeError (with the output's tail) on failure or timeout."""
    sys.path.insert(0, str(REPO))
    from tests.mpi_jobs import kill_session, mpi_lock

    cmd = [sys.executable, "-m", "tfsparse.run", "-np", str(procs)]
    if link != "shm":
        cmd += ["--net", link]
    cmd += program
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    shown = ["python" if a == sys.executable else os.path.relpath(a, REPO) if a.startswith(str(REPO)) else a
             for a in program]
    print(f"$ tfsparse-run -np {procs}{'' if link == 'shm' else ' --net ' + link} {' '.join(shown)}", flush=True)
    with mpi_lock(announce=True):
        t0 = time.perf_counter()
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # SIGTERM first: the --net launcher passes it to mpirun and removes its namespaces
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
                kill_session(proc.pid)  # the ranks too: each has a process group of its own
                proc.wait()
                raise RuntimeError(f"timed out after {timeout:g} s\n{tail(log)}") from None
            except KeyboardInterrupt:
                proc.send_signal(signal.SIGINT)
                proc.wait()
                raise
        seconds = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"exit status {code}\n{tail(log)}")
    return seconds


def tail(log: Path, n: int = 3000) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return text if len(text) <= n else "..." + text[-n:]


def measure_steps(procs, link, args, tmp: Path) -> dict:
    configs = [{"label": a, "algorithm": a, **({} if a == "dense" else {"density": args.density})}
               for a in args.algorithms]
    out = tmp / f"step_{link}_{procs}"
    seconds = launch(procs, link, [sys.executable, str(FIT_STEP), json.dumps(configs), "--network", link,
                                   "--out", str(out)], args.timeout, tmp / "launch.log")
    got = json.loads(out.with_suffix(".json").read_text())
    runs = {}
    for run in got["runs"]:
        keep = {k: run[k] for k in ("step_ms", "mb_per_step", "encode_ms", "comm_ms", "decode_ms", "wait_ms",
                                    "parameters")}
        keep["other_ms"] = max(0.0, run["step_ms"] - run["encode_ms"] - run["comm_ms"] - run["decode_ms"])
        runs[run["algorithm"]] = keep
    return {"launch_s": round(seconds, 1), "runs": runs}


def digits_args(args) -> list[str]:
    demo = ["--algorithms", ",".join(args.algorithms), "--density", str(args.tta_density),
            "--epochs", str(args.tta_epochs), "--batch-size", str(DIGITS_BATCH), "--lr", str(DIGITS_LR)]
    if args.recipe:
        demo += ["--memory", "momentum", "--warmup-epochs", str(WARMUP_EPOCHS)]
    return demo


def time_to_target(run: dict, target: float) -> dict:
    acc, ends, train = run["val_accuracy"], run["epoch_end_s"], run["train_s"]
    hit = next((i for i, a in enumerate(acc) if a >= target), None)
    return {"time_to_target_s": None if hit is None else round(ends[hit], 3),
            "train_to_target_s": None if hit is None else round(train[hit], 3),
            "epochs_to_target": None if hit is None else hit + 1,
            "total_s": round(ends[-1], 3), "best_accuracy": max(acc), "test_accuracy": run["test_accuracy"],
            "step_ms": run["step_ms"], "comm_bytes": run["comm_bytes"][-1], "density": run["density"][-1],
            "val_accuracy": acc, "epoch_end_s": ends, "train_s": train}


def measure_tta(procs, link, args, tmp: Path) -> dict:
    out = tmp / f"tta_{link}_{procs}.json"
    seconds = launch(procs, link, [sys.executable, str(DIGITS), *digits_args(args), "--json", str(out)],
                     args.timeout, tmp / "launch.log")
    got = json.loads(out.read_text())
    return {"launch_s": round(seconds, 1),
            "runs": {alg: time_to_target(run, args.target) for alg, run in got["runs"].items()}}


# -- the record ----------------------------------------------------------------------------

def machine() -> dict:
    def first_line(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO)).stdout.strip().split("\n")[0]
        except OSError:
            return None

    from importlib import metadata

    versions = {}
    for pkg in ("tensorflow", "keras", "numpy", "mpi4py"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    dirty = bool(first_line(["git", "status", "--porcelain", "--untracked-files=no"]))
    return {"cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpu_model": bench_host.cpu_model(), "kernel": platform.release(), "machine": platform.machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "versions": versions, "mpirun": first_line(["mpirun", "--version"]),
            "git": (first_line(["git", "rev-parse", "--short", "HEAD"]) or "") + ("+dirty" if dirty else "")}


def settings(args) -> dict:
    return {"algorithms": args.algorithms, "procs": args.procs, "links": args.links, "parts": args.parts,
            "quick": args.quick, "timeout_s": args.timeout,
            "step": {"program": "tools/bench_fit_step.py", "model": "MLP 1024-4096-4096-1024 (25.2M parameters)",
                     "density": args.density, "batch_per_rank": 16, "steps": 12, "median_of_steps": "4-12",
                     "optimizer": "SGD(0.01, momentum=0.9)"},
            "tta": {"program": "keras_examples/digits_demo.py", "dataset": "digits (1500 train / 297 test)",
                    "model": "MLP 64-256-128-10 (50,826 parameters)", "density": args.tta_density,
                    "target": args.target, "epochs": args.tta_epochs, "batch_per_rank": DIGITS_BATCH,
                    "lr": DIGITS_LR, "recipe": args.recipe, "demo_args": digits_args(args)}}


# -- the figure and the tables ---------------------------------------------------------------

def _grid(results):
    s = results.get("settings", {})
    cells = {(c["link"], c["procs"]): c for c in results["cells"]}
    links = [l for l in s.get("links", []) if any(k[0] == l for k in cells)] or list(dict.fromkeys(k[0] for k in cells))
    procs = [p for p in s.get("procs", []) if any(k[1] == p for k in cells)] or sorted({k[1] for k in cells})
    algorithms = s.get("algorithms") or list(dict.fromkeys(
        a for c in results["cells"] for part in ("step", "tta") for a in ((c.get(part) or {}).get("runs") or {})))
    return algorithms, links, procs, cells


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    algorithms, links, procs, cells = _grid(results)
    n = max(1, len(links))
    fig, axes = plt.subplots(2, n, figsize=(1.1 + 0.42 * len(algorithms) * len(procs) * n + 1.2 * n, 8.5),
                             squeeze=False, sharey="row")
    width, gap = 0.8, 1.0
    algo_colors = {a: plt.cm.tab10(i) for i, a in enumerate(algorithms)}
    tta = results.get("settings", {}).get("tta", {})
    for col, link in enumerate(links):
        top, bottom = axes[0][col], axes[1][col]
        xs, names, centers = [], [], []
        x = 0.0
        for p in procs:
            start = x
            cell = cells.get((link, p), {})
            step_runs = (cell.get("step") or {}).get("runs", {})
            tta_runs = (cell.get("tta") or {}).get("runs", {})
            for a in algorithms:
                xs.append(x)
                names.append(a)
                run = step_runs.get(a)
                if run:
                    base = 0.0
                    for phase in PHASES:
                        h = run.get(f"{phase}_ms", 0.0) or 0.0
                        top.bar(x, h, width, bottom=base, color=COLORS[phase])
                        base += h
                    top.plot([x - width / 2, x + width / 2], [run["step_ms"]] * 2, color="black", lw=1.2)
                else:
                    top.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
                run = tta_runs.get(a)
                if run and run.get("time_to_target_s") is not None:
                    bottom.bar(x, run["time_to_target_s"], width, color=algo_colors[a])
                    bottom.text(x, run["time_to_target_s"], f"{run['epochs_to_target']}", ha="center",
                                va="bottom", fontsize=6)
                elif run:
                    bottom.bar(x, run["total_s"], width, color="white", edgecolor=algo_colors[a], hatch="//")
                    bottom.text(x, run["total_s"], ">", ha="center", va="bottom", fontsize=7)
                else:
                    bottom.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
                x += 1.0
            centers.append((start + x - 1.0) / 2)
            x += gap
        for ax in (top, bottom):
            ax.set_xticks(xs, labels=names, minor=True)
            ax.set_xticks(centers, labels=[f"P = {p}" for p in procs])
            ax.tick_params(axis="x", which="minor", labelrotation=90, labelsize=7)
            ax.tick_params(axis="x", which="major", length=0, pad=max(len(a) for a in algorithms) * 4.5 + 6)
            ax.grid(axis="y", alpha=0.3)
        top.set_title("shared memory" if link == "shm" else f"emulated {link} per rank")
    axes[0][0].set_ylabel(f"step time (ms), 25.2M MLP, density "
                          f"{results.get('settings', {}).get('step', {}).get('density', '?')}")
    axes[1][0].set_ylabel(f"seconds to {tta.get('target', '?')} test accuracy (digits)")
    axes[0][-1].legend(handles=[Patch(color=COLORS[p], label=p) for p in reversed(PHASES)] +
                       [plt.Line2D([], [], color="black", label="step (slowest rank)")],
                       fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[1][-1].legend(handles=[Patch(color=algo_colors[a], label=a) for a in algorithms] +
                       [Patch(facecolor="white", edgecolor="black", hatch="//", label="not reached (whole run)")],
                       fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    m = results.get("machine", {})
    fig.suptitle(f"tfsparse training: step time and its phases (top), time to accuracy, number = epochs "
                 f"(bottom, density {tta.get('density', '?')}, {tta.get('epochs', '?')} epochs)\n"
                 f"{m.get('cpu_count', '?')} CPUs, kernel {m.get('kernel', '?')}, {m.get('date', '?')}", fontsize=9)
    fig.tight_layout()
    files.save_figure(fig, path, dpi=110)
    plt.close(fig)


def _markdown(results, part: str, title: str, cell) -> list[str]:
    """One markdown table: a row per (link, P), a column per algorithm, ``cell(run)`` in each
    (``run`` is None where the launch has no result for that algorithm)."""
    algorithms, links, procs, cells = _grid(results)
    lines = [title, "", "| link | P | " + " | ".join(algorithms) + " |", "|---|---|" + "---|" * len(algorithms)]
    for link in links:
        for p in procs:
            runs = ((cells.get((link, p)) or {}).get(part) or {}).get("runs", {})
            lines.append(f"| {link} | {p} | " + " | ".join(cell(runs.get(a)) for a in algorithms) + " |")
    return lines


def _step_cell(r) -> str:
    return "—" if not r else f"{r['step_ms']:.0f} ({r['encode_ms']:.0f} / {r['comm_ms']:.0f} / {r['decode_ms']:.0f})"


def _tta_cell(r) -> str:
    if not r:
        return "n/a"
    if r["time_to_target_s"] is None:
        best = r["best_accuracy"]
        return f"— ({'—' if best is None else format(best, '.3f')})"
    return f"{r['time_to_target_s']:.1f} ({r['epochs_to_target']})"


def tables(results) -> str:
    target = results.get("settings", {}).get("tta", {}).get("target")
    lines = _markdown(results, "step", "step time, ms (encode / comm / decode per step, rank 0):", _step_cell)
    lines += [""] + _markdown(results, "tta", f"time to {target} test accuracy on digits, s (epochs; — not "
                                              f"reached, best accuracy):", _tta_cell)
    errors = [f"{c['link']} P={c['procs']} {part}: {c[part]['error'].splitlines()[0]}"
              for c in results["cells"] for part in ("step", "tta") if (c.get(part) or {}).get("error")]
    if errors:
        lines += ["", "failed launches:"] + [f"  {e}" for e in errors]
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", default="dense,topk,gtopk,oktopk")
    parser.add_argument("--procs", default=None, help="comma-separated process counts (default 2,3,4)")
    parser.add_argument("--links", default=None,
                        help="comma-separated: shm (shared memory) or a --net rate such as 1gbit "
                             "(default shm,1gbit,10gbit)")
    parser.add_argument("--density", type=float, default=0.001, help="step-time part (25.2M MLP)")
    parser.add_argument("--target", type=float, default=None,
                        help="test accuracy to reach (default 0.95; 0.85 with --quick)")
    parser.add_argument("--tta-density", type=float, default=0.01, help="time-to-accuracy part (digits)")
    parser.add_argument("--tta-epochs", type=int, default=None, help="digits epochs (default 20; 4 with --quick)")
    parser.add_argument("--no-recipe", dest="recipe", action="store_false",
                        help="digits without momentum correction and dense warm-up")
    parser.add_argument("--parts", default="step,tta", help="step, tta or both")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch, once the lock is held")
    parser.add_argument("--quick", action="store_true", help="smoke test: P = 2,3; shm,1gbit; 4 epochs; target 0.85")
    parser.add_argument("--out", default=None,
                        help="<out>.json and <out>.png (default results/bench_training, "
                             "results/bench_training_quick with --quick)")
    parser.add_argument("--plot-only", action="store_true", help="redraw <out>.png and the tables from <out>.json")
    args = parser.parse_args(argv)
    out = Path(args.out or REPO / "results" / ("bench_training_quick" if args.quick else "bench_training"))
    json_path, png_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".png")
    if args.plot_only:
        results = json.loads(json_path.read_text())
        plot(results, png_path)
        print(tables(results))
        return 0

    args.algorithms = [a for a in args.algorithms.split(",") if a]
    args.procs = [int(p) for p in (args.procs or ("2,3" if args.quick else "2,3,4")).split(",")]
    args.links = [l for l in (args.links or ("shm,1gbit" if args.quick else "shm,1gbit,10gbit")).split(",") if l]
    args.parts = [p for p in args.parts.split(",") if p]
    if not set(args.parts) <= {"step", "tta"} or not args.parts:
        parser.error(f"--parts {','.join(args.parts)}: accepted: step, tta or step,tta")
    args.target = args.target if args.target is not None else (0.85 if args.quick else 0.95)
    args.tta_epochs = args.tta_epochs or (4 if args.quick else 20)

    results = {"tool": "tools/bench_training.py", "machine": machine(), "settings": settings(args), "cells": []}
    failed = 0
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_training-") as tmp:
        for link in args.links:
            for procs in args.procs:
                cell = {"link": link, "procs": procs}
                for part, measure in (("step", measure_steps), ("tta", measure_tta)):
                    if part not in args.parts:
                        continue
                    try:
                        cell[part] = measure(procs, link, args, Path(tmp))
                        print(f"  {part}: {cell[part]['launch_s']:.0f} s; " + ", ".join(
                            f"{a} {r['step_ms']:.0f} ms" if part == "step" else
                            f"{a} {r['time_to_target_s'] if r['time_to_target_s'] is not None else '—'} s"
                            for a, r in cell[part]["runs"].items()), flush=True)
                    except (RuntimeError, OSError, ValueError, KeyError) as e:
                        failed += 1
                        cell[part] = {"error": str(e)}
                        print(f"  {part} FAILED: {str(e)[-2000:]}", flush=True)
                results["cells"].append(cell)
                results["elapsed_s"] = round(time.perf_counter() - t_start, 1)
                files.write_text(json_path, json.dumps(results, indent=1))
    plot(results, png_path)
    print()
    print(tables(results))
    print(f"\n{json_path}, {png_path}; {results['elapsed_s']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
