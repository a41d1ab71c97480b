"""tfsparse.ops CUDA kernels without a GPU.

* Every kernel compiles to PTX for sm_90 (``numba.cuda.compile_ptx``; NVVM comes from
  ``numba-cuda[cu13]``, no driver or device needed).
* Every kernel's results match the numpy reference under Numba's CUDA simulator.  The
  simulator must be enabled (``NUMBA_ENABLE_CUDASIM=1``) before numba is imported, so the
  checks run in a subprocess: tests/ops_cuda_workers/sim_check.py, with small blocks
  (32 threads x 8 items, 2 blocks per launch, so the grid-stride loops run) plus one
  check at the production block shape.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ops_cuda_workers.sim_check import CHECK_NAMES, repo_env, run_in_simulator

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "ops_cuda_workers" / "sim_check.py"
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.fixture(scope="module")
def sim_results():
    return run_in_simulator(WORKER)


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_cuda_kernel_matches_reference_in_simulator(sim_results, name):
    assert sim_results.get(name) == "ok", sim_results.get(name, f"check {name} did not run")


@pytest.fixture(scope="module")
def cuda_ops():
    if SIMULATED:
        pytest.skip("PTX compilation needs the real numba.cuda target (this process runs the simulator)")
    pytest.importorskip("numba_cuda", reason="install numba-cuda[cu13] (setup.cfg extra 'cuda')")
    from tfsparse.ops import cuda

    return cuda


def test_cuda_kernels_compile_to_ptx_for_sm90(cuda_ops):
    kernels = cuda_ops.Kernels()  # the production block shape
    ptx = kernels.compile_ptx(cc=(9, 0))
    expected = {f"{name}/{i}" for name, sigs in cuda_ops.SIGNATURES.items() for i in range(len(sigs))}
    assert set(ptx) == expected
    assert set(cuda_ops.SIGNATURES) == set(kernels.python)  # no kernel without a PTX signature
    for name, text in ptx.items():
        assert re.search(r"^\.target sm_90\b", text, re.M), name
        assert len(re.findall(r"^\.visible \.entry ", text, re.M)) == 1, name
        assert ".local" not in text, f"{name} spills to local memory"
    assert "atom.global.max.s64" in ptx["hash/0"]  # DRAGONN slot write: atomic max, largest index wins
    assert "atom.global.add.f32" in ptx["scatter/0"]


def test_cuda_module_imports_without_gpu(cuda_ops):
    assert not cuda_ops.SIMULATOR
    assert cuda_ops.Kernels(32, 8, 2).tile == 256
    with pytest.raises(ValueError):
        cuda_ops.Kernels(48, 8)


def test_numpy_without_row_stack_gives_a_clear_import_error():
    """numba-cuda 0.30 fails at kernel compile time with numpy 2.5 ("no attribute 'row_stack'"):
    importing the CUDA backend says which versions to install instead."""
    pytest.importorskip("numba_cuda", reason="install numba-cuda[cu13]")
    code = ("import numpy as np\ndel np.row_stack\n"
            "try:\n    import tfsparse.ops.cuda\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=repo_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=300).stdout
    assert "ImportError:" in out and "numpy<2.5" in out and "numba-cuda 0.30" in out, out


def test_cuda_extra_pins_the_tested_versions():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    extra = cfg["options.extras_require"]["cuda"].split()
    assert "numba-cuda[cu13]==0.30.*" in extra and "numpy<2.5" in extra
    assert '"numba-cuda[cu13]==0.30.*" "numpy<2.5"' in (REPO / "tools" / "install.sh").read_text()
