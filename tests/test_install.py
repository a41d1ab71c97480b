"""The set-up commands' choice of interpreter: an externally managed Python (PEP 668, Debian's own
python3) gets the project virtualenv .venv, which the Makefile then runs everything with; any
other interpreter (a virtualenv, activated or not, or pyenv's) is used as it is.  Nothing is
installed here: ``tools/install.sh --print-python`` and ``make -n`` only tell."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_PY = str(REPO / ".venv" / "bin" / "python")


def print_python(python):
    done = subprocess.run(["bash", "tools/install.sh", "--print-python"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHON": str(python)})
    return done.returncode, done.stdout.strip(), done.stderr


def externally_managed(python) -> bool:
    code = ("import os, sys, sysconfig\nprint(sys.prefix == sys.base_prefix and os.path.isfile("
            "os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip() == "True"


def make_dry_run(target, python):
    # --no-print-directory: under a parent make (make test runs this suite) MAKEFLAGS would add
    # "make[1]: Entering directory" lines
    done = subprocess.run(["make", "--no-print-directory", "-n", target, f"PYTHON={python}"], cwd=REPO,
                          capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def test_an_interpreter_that_is_not_externally_managed_is_used_as_it_is():
    if externally_managed(sys.executable):
        pytest.skip("needs a Python that is not externally managed (PEP 668); the tests run on one that is")
    assert print_python(sys.executable)[:2] == (0, sys.executable)


def test_a_virtualenv_is_never_externally_managed_even_when_its_base_is(tmp_path):
    """PEP 668: the marker of the base interpreter does not apply inside a virtual environment
    (``make test PYTHON=venv/bin/python`` with the venv not activated)."""
    base = "/usr/bin/python3" if externally_managed("/usr/bin/python3") else sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    venv_python = str(tmp_path / "venv" / "bin" / "python")
    assert print_python(venv_python)[:2] == (0, venv_python)


@pytest.mark.skipif(not (os.path.exists("/usr/bin/python3") and externally_managed("/usr/bin/python3")),
                    reason="no externally managed /usr/bin/python3 on this machine")
def test_an_externally_managed_python_gets_the_project_venv():
    marker = Path(subprocess.run(["/usr/bin/python3", "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
                                 capture_output=True, text=True, timeout=60).stdout.strip()) / "EXTERNALLY-MANAGED"
    assert marker.is_file()
    assert print_python("/usr/bin/python3")[:2] == (0, VENV_PY)


@needs_make
@pytest.mark.skipif(not (os.path.exists("/usr/bin/python3") and externally_managed("/usr/bin/python3")),
                    reason="no externally managed /usr/bin/python3 on this machine")
def test_make_runs_the_demo_and_the_tests_with_the_project_venv():
    demo = make_dry_run("demo", "/usr/bin/python3")
    assert demo[0] == "PYTHON='/usr/bin/python3' bash tools/install.sh"  # installs into .venv (it decides)
    assert f"{VENV_PY} -m tfsparse.run -np 4 --net 1gbit {VENV_PY} keras_examples/time_to_accuracy.py --demo" in \
        "\n".join(demo)
    assert make_dry_run("test", "/usr/bin/python3")[-1].startswith(f"{VENV_PY} -m pytest")
    done = subprocess.run(["git", "check-ignore", "-q", ".venv/bin/python"], cwd=REPO, timeout=60)
    assert done.returncode == 0, ".venv must be ignored by git"


@needs_make
def test_make_uses_a_plain_interpreter_directly():
    if externally_managed(sys.executable):
        pytest.skip("needs a Python that is not externally managed (PEP 668); the tests run on one that is")
    assert make_dry_run("test", sys.executable)[-1].startswith(f"{sys.executable} -m pytest")
    demo = "\n".join(make_dry_run("demo", sys.executable))  # an emulated network where it can, else shared memory
    assert f"{sys.executable} -m tfsparse.run -np 4 --net 1gbit {sys.executable} keras_examples/time_to_accuracy.py" in demo
    assert f"{sys.executable} -m tfsparse.run -np 4 {sys.executable} keras_examples/time_to_accuracy.py" in demo


def test_bad_arguments_and_interpreters_are_refused():
    done = subprocess.run(["bash", "tools/install.sh", "--bogus"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "'--bogus'" in done.stderr and "--horovod, --print-python" in done.stderr
    code, out, err = print_python("/nonexistent/python3")
    assert code == 2 and out == "" and "PYTHON='/nonexistent/python3'" in err and "accepted" in err


def test_tensorboard_is_installed_for_keras_tensorboard_callbacks(tmp_path):
    """tensorflow-cpu 2.21 does not pull TensorBoard in (tf.summary.scalar then raises
    TBNotInstalledError); the set-up installs the matching release."""
    import importlib.metadata as metadata

    import tensorflow as tf

    assert metadata.version("tensorboard").split(".")[:2] == tf.__version__.split(".")[:2]
    with tf.summary.create_file_writer(str(tmp_path)).as_default():
        assert tf.summary.scalar("x", 1.0, step=0)
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
