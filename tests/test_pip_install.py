"""The second way in: ``pip install ".[cpu,mpi]"`` into a fresh virtual environment -- no
``make``, no Debian MPI: TensorFlow, Keras, Numba, mpi4py and Open MPI's wheel from PyPI -- and
``tfsparse-run -np 2 python keras_examples/digits_demo.py`` with that environment alone (the
repository is not on ``PYTHONPATH``; ``PATH`` starts with the environment's ``bin/``).  Needs
PyPI (or its cache); one MPI job, under the tests' MPI lock."""
import os
import subprocess
import sys
import venv

import pytest

from mpi_harness import REPO
from mpi_jobs import mpi_lock

pytestmark = pytest.mark.mpi


def _index_reachable(folder) -> bool:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                           "-d", str(folder), "six"], capture_output=True, timeout=120)
    return done.returncode == 0


def test_pip_install_cpu_mpi_runs_the_digits_demo_on_two_ranks(tmp_path):
    if not _index_reachable(tmp_path / "probe"):
        pytest.skip("no package index reachable (PyPI or its mirror): the pip route cannot be installed here")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
             and not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    # --no-compile: pip would byte-compile every module it installs (TensorFlow's thousands);
    # what the test runs compiles what it imports
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                           f"{REPO}[cpu,mpi]"], env=clean, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    env = {**clean, "PATH": f"{env_dir / 'bin'}:{clean['PATH']}", "VIRTUAL_ENV": str(env_dir),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    # the installed package, not the checkout (run from outside the repository)
    where = subprocess.run([str(python), "-c", "import tfsparse, mpi4py.MPI as M; print(tfsparse.__file__); "
                            "print(M.Get_library_version())"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert where.returncode == 0, where.stderr[-3000:]
    assert str(env_dir) in where.stdout and "Open MPI" in where.stdout, where.stdout
    with mpi_lock():
        run = subprocess.run([str(env_dir / "bin" / "tfsparse-run"), "-np", "2", "python",
                              str(REPO / "keras_examples" / "digits_demo.py"), "--algorithms", "topk", "--epochs", "1"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-3000:]
    assert "2 processes, digits" in text and "topk" in text, text[-3000:]
