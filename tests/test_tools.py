"""The benchmark tools: offline paths (redrawing from a JSON record), and short real launches of the
Keras-level ones under mpirun."""
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _step(step_ms):
    return {"step_ms": step_ms, "mb_per_step": 1.0, "encode_ms": 0.2 * step_ms, "comm_ms": 0.3 * step_ms,
            "decode_ms": 0.1 * step_ms, "wait_ms": 0.35 * step_ms, "other_ms": 0.4 * step_ms, "parameters": 100}


def _tta(seconds):
    return {"time_to_target_s": seconds, "train_to_target_s": seconds,
            "epochs_to_target": None if seconds is None else 3,
            "total_s": 12.0, "best_accuracy": 0.96 if seconds else 0.9, "test_accuracy": 0.9, "step_ms": 5.0,
            "comm_bytes": 1000.0, "density": 0.01, "val_accuracy": [0.5, 0.9, 0.96], "epoch_end_s": [4.0, 8.0, 12.0],
            "train_s": [3.0, 6.0, 9.0]}


def test_bench_training_plot_only(tmp_path):
    algorithms = ["dense", "topk"]
    cells = [{"link": link, "procs": p,
              "step": {"launch_s": 60.0, "runs": {"dense": _step(700.0 * f), "topk": _step(300.0 * f)}},
              "tta": {"launch_s": 30.0, "runs": {"dense": _tta(8.0 * f), "topk": _tta(None)}}}
             for link, f in (("shm", 1.0), ("1gbit", 3.0)) for p in (2, 3)]
    cells.append({"link": "shm", "procs": 4, "step": {"error": "timed out after 1 s"},
                  "tta": {"launch_s": 30.0, "runs": {"dense": _tta(9.0)}}})
    record = {"tool": "tools/bench_training.py",
              "machine": {"cpu_count": 2, "kernel": "test", "date": "2024-01-01T00:00:00+00:00"},
              "settings": {"algorithms": algorithms, "procs": [2, 3, 4], "links": ["shm", "1gbit"],
                           "step": {"density": 0.001}, "tta": {"density": 0.01, "target": 0.95, "epochs": 3}},
              "cells": cells}
    out = tmp_path / "bench"
    (tmp_path / "bench.json").write_text(json.dumps(record))
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench_training.py"), "--plot-only", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    png = tmp_path / "bench.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "| shm | 2 | 700 (140 / 210 / 70) | 300 (60 / 90 / 30) |" in done.stdout
    assert "| 1gbit | 3 | 24.0 (3) | — (0.900) |" in done.stdout
    assert "shm P=4 step: timed out after 1 s" in done.stdout


def _tool(name: str):
    """The module ``tools/<name>.py``, imported with tools/ on the path for the import only."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _cpu_model() -> str:
    """The CPU model, as the tools name it in their records (tools/bench_host.py)."""
    model = _tool("bench_host").cpu_model()
    assert model
    return model


def test_the_transformer_task_is_labelled_by_the_topic_mentioned_most():
    """tools/bench_time_to_accuracy.py --model transformer: its synthetic rows (nothing downloaded)
    are labelled by the topic whose words they hold most, the same for a seed, and the model is
    the small Transformer of its docstring (2.7M parameters, an Embedding and attention)."""
    tool = _tool("bench_time_to_accuracy")
    x, y, xt, yt = tool.topics(3)
    assert x.shape == (1536, tool.SEQ) and xt.shape == (512, tool.SEQ) and x.dtype == "int32"
    for rows, labels in ((x, y), (xt, yt)):
        words = np.where(rows < tool.TOPICS * tool.TOPIC_WORDS, rows // tool.TOPIC_WORDS, -1)
        counts = np.stack([(words == c).sum(axis=1) for c in range(tool.TOPICS)], axis=1)
        assert (counts.argmax(axis=1) == labels).all() and (np.sort(counts, axis=1)[:, -2] < counts.max(axis=1)).all()
        assert np.bincount(labels, minlength=tool.TOPICS).min() > len(labels) // 8  # every topic present
    assert np.array_equal(tool.topics(3)[0], x) and not np.array_equal(tool.topics(4)[0], x)
    model = tool.build("transformer")
    assert 2.6e6 < model.count_params() < 2.8e6
    assert {"Embedding", "MultiHeadAttention"} <= {type(layer).__name__ for layer in model.layers}


def test_bench_encode_writes_json_and_png(tmp_path):
    """tools/bench_encode.py on a small gradient: every case timed, the summary, both files."""
    out = tmp_path / "enc"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench_encode.py"), "--sizes", "200K",
                           "--densities", "0.01", "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert {r["case"] for r in result["rows"]} == {"dragonn", "dgc", "dgc (Alg. 3 only)", "topk"}
    assert all(r["encode_ms"] > 0 and r["decode_ms"] > 0 for r in result["rows"])
    assert "n=200000,density=0.01" in result["summary"] and out.with_suffix(".png").stat().st_size > 0
    assert _cpu_model() in result["machine"]


def test_bench_kernels_cuda_path_runs_in_the_simulator(tmp_path):
    """tools/bench_kernels.py --cuda end to end under the CUDA simulator (no timings there: the
    simulator's events measure nothing): every CUDA row is produced, the device-resident exchange
    round included, and the report is written."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench_kernels.py"), "--cuda", "--cuda-shape", "32,8,2",
                           "--sizes", "4K", "--repeats", "1", "--payloads", "1,2", "--no-tf", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_kernels.json").read_text())["results"]
    cuda_ops = {(r["op"], r["impl"]) for r in rows if r.get("device") == "cuda"}
    for op in ("copy", "topk", "select_threshold", "hash_select", "quantize_int8", "truncate_fp16", "decode"):
        assert any(o == op for o, _ in cuda_ops), op
    assert ("exchange_step", "dragonn: device-resident exchange") in cuda_ops
    assert ("exchange_step", "topk: copy to host + host exchange") in cuda_ops


def test_bench_choices_times_every_choice_and_refuses_bad_arguments(tmp_path):
    """tools/bench_choices.py at a thousandth of its sizes: a row for each implementation of every
    choice, the record and its figure written; an unknown choice or a scale of 0 refused by name."""
    done = subprocess.run([sys.executable, "tools/bench_choices.py", "--scale", "0.001", "--repeats", "1",
                           "--out", str(tmp_path / "choices")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "choices.json").read_text())["rows"]
    counts = {}
    for row in rows:
        assert row["ms"] >= 0 and row["n"] >= 64
        counts[row["choice"]] = counts.get(row["choice"], 0) + 1
    assert counts == {"stream": 16, "dense_select": 4, "half_encode": 4, "half_decode": 2, "message_buffer": 3,
                      "digest": 2, "all_finite": 2}
    assert (tmp_path / "choices.png").stat().st_size > 0
    for bad, said in ((["--choices", "stream,nope"], "--choices: 'nope' is not valid; accepted: stream, dense_select"),
                      (["--scale", "0"], "--scale=0.0 is not valid; accepted: a number above 0")):
        refused = subprocess.run([sys.executable, "tools/bench_choices.py", *bad, "--out", str(tmp_path / "x")],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr[-2000:]
        assert not (tmp_path / "x.json").exists()


def test_bench_time_to_accuracy_sends_the_tensors_below_dense_below_dense():
    """tools/bench_time_to_accuracy.py's ``"dense_below": N``: a bucket per tensor, those of fewer
    than N elements dense, the others with the row's own algorithm and density; refused with a
    plan of the row's own, or a count that is not a positive whole number, before anything runs --
    as is ``--target dense`` (the default) without a dense float32 row, which once failed only after
    every setting had trained."""
    from tfsparse.plan import Layout, TensorSpec

    plan = _tool("bench_time_to_accuracy").small_dense(4096)
    layout = Layout([TensorSpec("conv/kernel", (3, 3, 1, 32)), TensorSpec("dense/kernel", (4096, 2048)),
                     TensorSpec("dense/bias", (2048,))])
    chosen = {layout.specs[b.first].name: b.algorithm for b in plan.buckets(layout)}
    assert chosen == {"conv/kernel": "dense", "dense/kernel": None, "dense/bias": "dense"}
    for bad in ({"dense_below": 0}, {"dense_below": 4096, "plan": "fused"}, {"dense_below": "4096"},
                {"init_seed": -1}, {"init_seed": "7"}):
        done = subprocess.run([sys.executable, "tools/bench_time_to_accuracy.py",
                               json.dumps([{"label": "x", "algorithm": "gtopk", **bad}])], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        key, why = (("\"init_seed\"", "accepted: a whole number >= 0") if "init_seed" in bad else
                    ("\"dense_below\"", "not both" if "plan" in bad else "accepted: a positive whole number"))
        assert done.returncode != 0 and key in done.stderr and why in done.stderr, bad
    done = subprocess.run([sys.executable, "tools/bench_time_to_accuracy.py",
                           json.dumps([{"label": "x", "algorithm": "gtopk"}, {"label": "d16", "algorithm": "dense",
                                                                              "wire_dtype": "float16"}])],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--target dense needs" in done.stderr and "['x', 'd16']" in done.stderr
    assert "accuracy" not in done.stdout  # refused before any setting trained (each prints its accuracies)
    done = subprocess.run([sys.executable, "tools/bench_time_to_accuracy.py", json.dumps([{"algorithm": "dense"}]),
                           "--target", "high"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--target 'high' is not valid; accepted: 'dense' or a number" in done.stderr


@pytest.mark.mpi
def test_bench_time_to_accuracy_records_curves_gaps_and_the_compute_run(tmp_path):
    """tools/bench_time_to_accuracy.py at P = 3 on the small convolutional model, 2 epochs: the
    compute-only run first, then the setting; per epoch its end, accuracy and time outside steps;
    every gap between steps; the table; the figure."""
    from mpi_harness import mpirun

    out = tmp_path / "tta"
    configs = json.dumps([{"label": "topk", "algorithm": "topk", "density": 0.05}])
    _, text = mpirun(3, REPO / "tools" / "bench_time_to_accuracy.py", configs, "--model", "conv", "--epochs", "2",
                     "--target", "0.3", "--out", str(out), timeout=300)
    result = json.loads(out.with_suffix(".json").read_text())
    compute, topk = result["runs"]
    assert compute["config"] is None and topk["config"]["algorithm"] == "topk"
    for run in (compute, topk):
        steps = sum(len(ep) for ep in run["step_s"])
        assert len(run["epoch_end_s"]) == len(run["val_accuracy"]) == len(run["outside_s"]) == 2
        assert len(run["gaps_s"]) == steps - 1 and steps == 2 * (1536 // 3 // 32)
        assert run["step_ms_median"] > 0 and run["stall_s"] >= 0
        assert run["longest_step_s"] >= 1e-3 * run["step_ms_median"]  # the slowest rank's, after the first
    assert topk["comm_bytes"] > 0 and topk["time_to_target_s"] is not None
    assert "| topk |" in text and out.with_suffix(".png").stat().st_size > 10_000
    assert result["machine"].endswith(f"cores, {_cpu_model()}")  # names the host's CPU


@pytest.mark.mpi
def test_bench_fit_step_reports_the_floor_and_phase_medians_of_the_timed_steps(tmp_path):
    """tools/bench_fit_step.py at P = 3 on the 17.1M MLP: the compute floor first, the compute in
    lockstep, then a setting given without a label (labelled by its algorithm and density); its phases are medians over the
    timed steps, each at most the step (an epoch's mean would fold in the first rounds' compilation
    and first touch of fresh memory, which alone took 400 ms)."""
    from mpi_harness import mpirun

    out = tmp_path / "fit"
    configs = json.dumps([{"algorithm": "compute", "barrier": True}, {"algorithm": "topk", "density": 0.01}])
    _, text = mpirun(3, REPO / "tools" / "bench_fit_step.py", configs, "--model", "mlp17m", "--out", str(out),
                     timeout=300)
    compute, lockstep, topk = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert compute["algorithm"] == "compute" and compute["x_compute"] == 1.0
    assert lockstep["label"] == "compute barrier=True" and lockstep["step_ms"] > 0 and "passes" not in lockstep
    assert topk["label"] == "topk 0.01" and topk["x_compute"] == round(topk["step_ms"] / compute["step_ms"], 2)
    for phase in ("encode", "comm", "decode", "wait"):
        assert 0.0 <= topk[f"{phase}_ms"] <= topk["step_ms"], phase
    assert topk["encode_ms"] > 0 and topk["comm_ms"] > 0 and topk["passes"]["total"] > 3
    assert "| topk 0.01 |" in text


def test_bench_fit_step_refuses_a_config_without_an_algorithm_before_anything_runs():
    done = subprocess.run([sys.executable, "tools/bench_fit_step.py", '[{"density": 0.01}]'], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ValueError: config {'density': 0.01} has no 'algorithm'" in done.stderr


def test_measure_docs_lists_its_steps_and_refuses_an_unknown_one():
    """tools/measure_docs.sh: ``--list`` names every step with the command it runs (each a tool of
    tools/, make demo, or a launch of one under tfsparse-run); an unknown step is refused before
    anything runs, naming the accepted ones."""
    listed = subprocess.run(["bash", "tools/measure_docs.sh", "--list"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    steps = [line[:-1] for line in listed.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert {"fit17m_1gbit", "gf_1gbit", "pipe_1gbit", "dragonn_1gbit", "tta_1gbit", "tta_conv", "demo"} <= set(steps)
    for tool in ("bench_fit_step", "bench_time_to_accuracy", "bench_exchange", "bench_convergence", "bench_encode",
                 "bench_kernels", "bench_choices", "bench_collectives", "validate_network_model",
                 "simulate_network"):
        assert f"tools/{tool}.py" in listed.stdout and (REPO / "tools" / f"{tool}.py").exists()
    refused = subprocess.run(["bash", "tools/measure_docs.sh", "fit17m_1gbit", "nope"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "unknown step 'nope'; accepted: fit17m_1gbit" in refused.stderr


def test_gradient_concentration_shares_and_refusals():
    """tools/gradient_concentration.py: the top-k share of a vector's energy, and its arguments
    refused before any model is built, naming the argument and the accepted values."""
    tool = _tool("gradient_concentration")
    squares = np.array([9.0, 1.0, 0.0, 4.0, 1.0, 1.0])
    assert tool.top_share(squares, 1) == 9.0 / 16.0 and tool.top_share(squares, 2) == 13.0 / 16.0
    assert tool.top_share(np.zeros(4), 1) == 0.0
    per = {"share": [], "sent": [], "captured": [], "residual_ratio": []}  # two tensors: 3 and 2 elements
    g, residual = np.array([3.0, 0.0, 1.0, 2.0, 2.0], np.float32), np.array([0.0, 0.0, 1.0, 0.0, 0.0], np.float32)
    acc = g + residual
    tool.per_tensor_step(per, g, residual, acc * acc, np.array([0, 3]), np.array([0, 3]), 5)
    np.testing.assert_allclose(per["share"][0], [10 / 18, 8 / 18])
    np.testing.assert_allclose(per["sent"][0], [1 / 3, 1 / 2])
    np.testing.assert_allclose(per["captured"][0], [9 / 13, 4 / 8])
    np.testing.assert_allclose(per["residual_ratio"][0], [1 / np.sqrt(10), 0.0])
    for args, why in ((["--steps", "10"], "--steps 10 is not valid; accepted: 50 or more"),
                      (["--density", "1.5"], "--density 1.5 is not valid; accepted: a number in (0, 1)"),
                      (["--models", "vgg"], "--models 'vgg' is not valid; accepted: mlp17m, conv, transformer")):
        done = subprocess.run([sys.executable, "tools/gradient_concentration.py", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and why in done.stderr, done.stderr[-500:]


def test_pipe_sgd_timing_models_the_dense_runs_of_a_bench_fit_step_record(tmp_path):
    """tools/pipe_sgd_timing.py reads bench_fit_step.py's JSON as it is written now (the compute
    floor first, then the settings): Eq. 2 for D-Sync, Eq. 4 for pipeline=2, the floor left out."""
    def run(label, pipeline, step, encode, comm, wait, mb, wire="float32"):
        return {"label": label, "algorithm": "dense", "pipeline": pipeline, "step_ms": step, "encode_ms": encode,
                "comm_ms": comm, "decode_ms": 0.0, "wait_ms": wait, "mb_per_step": mb, "wire_dtype": wire}
    record = {"processes": 4, "network": "test", "runs": [
        {"label": "compute only (no exchange)", "algorithm": "compute", "step_ms": 190.0, "mb_per_step": 0.0},
        run("D-Sync f32", 1, 2000.0, 20.0, 1800.0, 1780.0, 150.0),
        run("Pipe-SGD f32", 2, 1900.0, 20.0, 1850.0, 1700.0, 150.0),
        run("Pipe-SGD int8", 2, 600.0, 150.0, 500.0, 300.0, 37.5, "int8"),
        run("Pipe-SGD bf16", 2, 700.0, 300.0, 500.0, 200.0, 75.0, "bfloat16")]}
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(record))
    out = tmp_path / "timing"
    done = subprocess.run([sys.executable, "tools/pipe_sgd_timing.py", str(path), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    model = json.loads(out.with_suffix(".json").read_text())
    assert model["l_compute_ms"] == 200.0
    assert [r["label"] for r in model["runs"]] == ["D-Sync f32", "Pipe-SGD f32", "Pipe-SGD int8", "Pipe-SGD bf16"]
    dsync, pipe32, pipe, pipe16 = model["runs"]
    assert dsync["model_measured_comm_ms"] == 200.0 + 20.0 + 1800.0  # Eq. 2
    assert pipe32["model_measured_comm_ms"] == 1850.0 and not pipe32["error_feedback"]  # Eq. 4: max(200 + 20, 1850)
    # a residual: step t+1's encoding waits for round t's reduce-scatter, the allgather overlaps it
    assert pipe["model_measured_comm_ms"] == 500.0 and pipe["error_feedback"]  # max(200 + 150, 500 + max(0, 150 - 250))
    assert pipe16["model_measured_comm_ms"] == 550.0  # an encoding longer than the allgather: 500 + (300 - 250)
    assert out.with_suffix(".png").stat().st_size > 0


def test_probe_cuda_runs_in_the_simulator():
    """tools/probe_cuda.py (docs/gpus.md, "Where the time goes") end to end under the CUDA
    simulator at a tiny size: every fixed cost and every op/kernel line is printed."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "probe_cuda.py"), "--sizes", "2000", "--repeats", "1",
                           "--calls", "2", "--density", "0.01"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("cuda.to_device(2 int64)", "topk_abs", "count kernel alone", "hash_survivors (capacity 4k)",
                 "scatter kernel alone"):
        assert line in done.stdout, line


def test_time_to_accuracy_summary_takes_the_median_over_seeds(tmp_path):
    """tools/time_to_accuracy_summary.py: per setting, the median over the launches (seeds) of the
    time to dense float32's own target, of the per-seed ratios against dense float32 and the fastest
    16-bit dense setting, and of the final accuracy against dense float32's; a setting that missed
    the target in most seeds is "not reached"; a launch with other settings is refused."""
    def run(label, config, t, final, best=None):
        return {"label": label, "config": config, "time_to_target_s": t, "final_accuracy": final,
                "best_accuracy": best or final, "step_ms_median": 10.0, "epochs_to_target": 3 if t else None,
                "epoch_end_s": [50.0, 100.0, 150.0]}

    def launch(seed, f32, f16, sparse, sparse_final, never):
        return {"model": "mlp17m", "processes": 4, "epochs": 3, "network": "1 Gbit/s", "machine": "vm, 2 cores",
                "date": "2026-11-28", "target": 0.98, "target_rule": "dense f32 best - 0.005", "seed": seed,
                "runs": [run("compute only", None, None, 0.9),
                         run("dense f32", {"algorithm": "dense"}, f32, 0.99),
                         run("dense f16", {"algorithm": "dense", "wire_dtype": "float16"}, f16, 0.99),
                         run("gtopk", {"algorithm": "gtopk", "density": 0.01}, sparse, sparse_final),
                         run("topk", {"algorithm": "topk", "density": 0.01}, never, 0.95)]}
    paths = []
    for i, args in enumerate([(0, 100.0, 60.0, 20.0, 0.985, None), (1, 120.0, 80.0, 40.0, 0.99, None),
                              (2, 90.0, 50.0, None, 0.97, 30.0)]):
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(launch(*args)))
    out = tmp_path / "summary"
    done = subprocess.run([sys.executable, "tools/time_to_accuracy_summary.py", str(out), *map(str, paths)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {r["label"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["dense f32"]["time_to_target_s"] == 100.0 and rows["dense f32"]["vs_f32"] == 1.0
    assert rows["gtopk"]["time_to_target_s"] == 40.0 and rows["gtopk"]["reached"] == 2  # 20, 40, never
    assert rows["gtopk"]["vs_f32"] == pytest.approx(3.0) and rows["gtopk"]["vs_f16"] == pytest.approx(2.0)
    assert rows["gtopk"]["final_vs_f32"] == pytest.approx(-0.005)
    assert rows["topk"]["time_to_target_s"] is None and rows["topk"]["vs_f32"] is None and rows["topk"]["reached"] == 1
    assert "| gtopk | 40.0 | 3.00× | 2.00× | 2 | 0.9850, -0.50 |" in done.stdout
    assert "| topk | not reached | — | — | 1 |" in done.stdout and out.with_suffix(".png").stat().st_size > 10_000
    bad = launch(3, 1.0, 1.0, 1.0, 0.9, None)
    bad["runs"].pop()
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    refused = subprocess.run([sys.executable, "tools/time_to_accuracy_summary.py", str(out), str(paths[0]),
                              str(tmp_path / "bad.json")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "every launch must run the same settings" in refused.stderr
    # launches without a dense 16-bit row: no ratio to one (None, printed "—"), not 0
    for p in paths:
        seed = json.loads(p.read_text())
        seed["runs"] = [r for r in seed["runs"] if r["label"] != "dense f16"]
        p.write_text(json.dumps(seed))
    done = subprocess.run([sys.executable, "tools/time_to_accuracy_summary.py", str(out), *map(str, paths)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {r["label"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["gtopk"]["vs_f16"] is None and rows["gtopk"]["vs_f32"] == pytest.approx(3.0)
    assert "| gtopk | 40.0 | 3.00× | — | 2 |" in done.stdout
