"""The examples in keras_examples/: each one's --help and an argparse error (in-process, fast: the
examples parse their arguments before importing TensorFlow), and each one run at its tiny size by
a real launcher -- mpirun -np 2 or 3, horovodrun, tfsparse-run --max-restarts -- one job per
example, under the MPI lock and a timeout."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "keras_examples"
NEW = ["digits_demo", "conv_digits", "text_embedding", "custom_loop", "horovodrun_launch", "gradientflow_recipe",
       "pipesgd_recipe", "checkpoint_resume", "time_to_accuracy"]


def test_the_examples_readme_lists_every_example():
    readme = (EXAMPLES / "README.md").read_text()
    for script in EXAMPLES.glob("*.py"):
        assert f"keras_examples/{script.name}" in readme, script.name


@pytest.mark.parametrize("name", NEW)
def test_help_and_a_bad_argument(name):
    """--help prints the docstring with the launch command; --epochs 0 is an argparse error (exit 2)."""
    script = EXAMPLES / f"{name}.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"keras_examples/{name}.py" in done.stdout and "--tiny" in done.stdout
    assert "tensorflow" not in done.stderr.lower()       # nothing imported TensorFlow for --help
    bad = subprocess.run([sys.executable, str(script), "--epochs", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "error: argument --epochs: 0 is not an integer >= 1" in bad.stderr, bad.stderr


def _accuracy(text):
    found = re.findall(r"test accuracy: ([0-9.]+)", text)   # horovodrun prefixes its lines
    assert found, text[-3000:]
    return float(found[-1])


def _run(nproc, name, *args, timeout=240):
    from mpi_harness import mpirun

    _, text = mpirun(nproc, EXAMPLES / f"{name}.py", *args, timeout=timeout)
    return text


@pytest.mark.mpi
def test_conv_digits_at_p3():
    text = _run(3, "conv_digits", "--tiny")
    sent, dense = map(int, re.search(r"(\d+) bytes sent per step and rank \(a dense float32 allreduce: (\d+)\)",
                                     text).groups())
    assert 0 < sent < dense / 5                           # gtopk at density 0.02
    assert _accuracy(text) > 0.2                          # one epoch; chance is 0.1


@pytest.mark.mpi
def test_text_embedding():
    text = _run(2, "text_embedding", "--tiny")
    assert re.search(r"topk at density 0.05, vocabulary 500, \d+ parameters, [1-9]\d* bytes sent", text), text[-2000:]
    assert _accuracy(text) > 0.5                          # chance is 0.25


@pytest.mark.mpi
def test_custom_loop():
    text = _run(2, "custom_loop", "--tiny")
    assert "epoch 1: rank 0's mean loss" in text and "2 moving statistics averaged over 2 ranks" in text
    assert "largest difference of any weight between ranks: 0.0\n" in text   # moving statistics included
    assert _accuracy(text) > 0.5


@pytest.mark.mpi
@pytest.mark.horovod
def test_horovodrun_launch():
    from test_foundation_mpi import _horovod_or_skip
    from mpi_harness import launcher, run_locked

    _horovod_or_skip()
    text = run_locked([launcher("horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable,
                       str(EXAMPLES / "horovodrun_launch.py"), "--tiny"], timeout=300)
    assert "backend: horovod, 2 processes, topk at density 0.01" in text, text[-3000:]
    assert _accuracy(text) > 0.5


@pytest.mark.mpi
def test_gradientflow_recipe():
    text = _run(2, "gradientflow_recipe", "--tiny")
    warm, sparse = (float(d) for d in re.findall(r"^epoch \d: density ([0-9.]+)", text, re.M))
    assert warm > 0.3 and 0.14 <= sparse <= 0.2           # the warm-up's ramp, then CSC's 15 % of the chunks
    assert _accuracy(text) > 0.5


@pytest.mark.mpi
def test_pipesgd_recipe():
    text = _run(2, "pipesgd_recipe", "--tiny")
    (f32,), (int8,) = (re.findall(rf"{mode}, (\d+) bytes", text) for mode in ("D-Sync float32", "pipelined int8"))
    assert int(int8) < int(f32) / 3                       # a quarter, plus the scales
    assert _accuracy(text) > 0.5


@pytest.mark.mpi
def test_checkpoint_resume(tmp_path):
    text = _run(2, "checkpoint_resume", "--tiny", "--dir", tmp_path)
    assert "first fit: epochs [1] trained in this launch" in text and "resumed from" in text
    assert "epochs [2]\n" in text and (tmp_path / "model.keras").exists()
    assert not (tmp_path / "backup" / "latest.weights.h5").exists()   # a completed fit deletes its backup
    assert _accuracy(text) > 0.5


@pytest.mark.mpi
def test_checkpoint_resume_after_a_failure_relaunched_by_tfsparse_run(tmp_path):
    """Rank 1 fails at the end of epoch 1; tfsparse-run --max-restarts 1 relaunches the job, whose
    first fit resumes from the backup at epoch 2."""
    from mpi_harness import run_locked

    text = run_locked([sys.executable, "-m", "tfsparse.run", "-np", "2", "--max-restarts", "1", sys.executable,
                       str(EXAMPLES / "checkpoint_resume.py"), "--epochs", "4", "--fail-at-epoch", "1",
                       "--dir", str(tmp_path)], timeout=300)
    assert "simulated failure at the end of epoch 1" in text and "restart 1 of 1" in text, text[-3000:]
    assert "first fit: epochs [2] trained in this launch" in text and "epochs [3, 4]\n" in text, text[-3000:]


@pytest.mark.mpi
def test_time_to_accuracy(tmp_path):
    out = tmp_path / "tta"
    text = _run(2, "time_to_accuracy", "--tiny", "--out", out, timeout=300)
    result = json.loads(out.with_suffix(".json").read_text())
    assert [r["label"] for r in result["runs"]] == ["compute only", "topk 0.05"]
    assert result["model"] == "conv" and result["processes"] == 2 and len(result["runs"][1]["val_accuracy"]) == 2
    assert "| topk 0.05 |" in text and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
