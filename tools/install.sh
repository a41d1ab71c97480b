#!/usr/bin/env bash
# One install script for tfsparse: system MPI, Python dependencies, the package itself
# and (optionally) Horovod 0.28.1 built from source against the installed TensorFlow.
#
#   bash tools/install.sh                 # MPI + TF + TensorBoard + tfsparse[test] + the doc tools
#   bash tools/install.sh --horovod       # ... and Horovod (about 5-10 min on 2 cores)
#   bash tools/install.sh --print-python  # only print the interpreter it installs into
#
# PYTHON (default python3) is the interpreter to install into.  When it is externally managed
# (PEP 668: an EXTERNALLY-MANAGED file in its stdlib directory, as Debian's own python3 has) and
# not a virtualenv, pip may not install into it: the script then creates the project virtualenv
# .venv from it and installs everything there; the Makefile runs everything with the
# interpreter --print-python names.
#
# Idempotent: every step checks whether it is already done, so CI re-runs are cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WITH_HOROVOD=0
PRINT_PYTHON=0
for a in "$@"; do
  case "$a" in
    --horovod) WITH_HOROVOD=1 ;;
    --print-python) PRINT_PYTHON=1 ;;
    *) echo "install.sh: unknown argument '$a' (accepted: --horovod, --print-python)" >&2; exit 2 ;;
  esac
done
if ! command -v "$PY" >/dev/null; then
  echo "install.sh: PYTHON='$PY' is not an interpreter on this machine (accepted: a python3 command or path)" >&2
  exit 2
fi

VENV="$PWD/.venv"
externally_managed() {
  "$PY" -c 'import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if sys.prefix == sys.base_prefix and os.path.isfile(marker) else 1)'
}
USE_VENV=0
if externally_managed; then USE_VENV=1; fi
if [ "$PRINT_PYTHON" = 1 ]; then
  if [ "$USE_VENV" = 1 ]; then echo "$VENV/bin/python"; else echo "$PY"; fi
  exit 0
fi

APT_UPDATED=0
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  if [ "$APT_UPDATED" = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  apt-get install -y -qq "$@" >/dev/null
}
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
  echo "== installing OpenMPI (Debian packages)"
  apt_install openmpi-bin libopenmpi-dev
fi

# the emulated hosts (tfsparse-run --emulate-hosts, tests/test_hosts_mpi.py): an sshd per host
# (Debian's package would start and enable the system's ssh service: a policy-rc.d that refuses,
# for the length of the install, keeps it stopped; tfsparse-run starts its own sshds)
if ! [ -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "== installing openssh-server for the emulated hosts (Debian packages; its service is not started)"
  HOLD=0
  if ! [ -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d; HOLD=1; fi
  apt_install openssh-server || { [ "$HOLD" = 1 ] && rm -f /usr/sbin/policy-rc.d; exit 1; }
  if [ "$HOLD" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi

if [ "$USE_VENV" = 1 ]; then
  if ! [ -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    if ! "$PY" -c "import ensurepip, venv" 2>/dev/null; then
      echo "== installing venv support for $PY (Debian packages)"
      apt_install "python$PYVER-venv"
    fi
    echo "== $PY is externally managed (PEP 668): creating the project virtualenv .venv"
    "$PY" -m venv --clear "$VENV"
  fi
  PY="$VENV/bin/python"
fi
# Python's C headers: mpi4py builds from source where no wheel fits, Horovod always does
if ! "$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
  echo "== installing the C headers of Python $PYVER (Debian packages)"
  apt_install "python$PYVER-dev"
fi

pipi() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

# tensorflow-cpu 2.21 does not depend on TensorBoard; keras.callbacks.TensorBoard needs it
if ! "$PY" -c "import tensorflow, keras, mpi4py, numba, sklearn, matplotlib, pytest, pytest_timeout, tensorboard" 2>/dev/null; then
  echo "== installing Python dependencies"
  pipi "tensorflow-cpu==2.21.*" "tensorboard==2.21.*" "keras>=3.10" "numpy" "mpi4py>=4" "numba>=0.60" \
       "scikit-learn" "matplotlib" "pytest" "pytest-timeout"
fi
# the documentation site's tools: make docs, and tests/test_docs.py (make test) builds the site strictly
if ! "$PY" -c "import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python" 2>/dev/null; then
  echo "== installing the documentation tools (MkDocs, Material for MkDocs, mkdocstrings)"
  pipi "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings[python]>=1.0,<2" "mkdocstrings-python>=2.0,<3"
fi
if ! "$PY" -c "import numba.cuda; from numba.cuda.cudadrv import nvvm" 2>/dev/null \
   || ! "$PY" -c "import importlib.metadata as m; m.version('numba-cuda')" 2>/dev/null; then
  echo "== installing numba-cuda (PTX compilation in CI, no GPU needed)"
  pipi "numba-cuda[cu13]==0.30.*" "numpy<2.5" || echo "warning: numba-cuda could not be installed; CUDA kernel tests will be skipped"
fi

echo "== installing tfsparse (editable)"
pipi --no-deps -e .

# compile the Numba CPU kernels once per machine (on-disk cache, ~30 s on 2 cores): the first
# training step then loads them (< 1 s) instead of compiling them on every rank at once
echo "== compiling the Numba kernels into their cache"
"$PY" -m tfsparse.cli warmup

if [ "$WITH_HOROVOD" = 1 ]; then
  if "$PY" -c "import horovod.tensorflow as h; assert h.mpi_built()" 2>/dev/null; then
    echo "== Horovod already built"
  else
    echo "== building Horovod 0.28.1 against $("$PY" -c 'import tensorflow as tf; print(tf.__version__)')"
    TFINC=$("$PY" -c "import tensorflow as tf; print(tf.sysconfig.get_include())")
    SHIM=$(mktemp -d)
    # TF >= 2.18 moved xla_builder.h; Horovod 0.28.1 still includes the old path.
    mkdir -p "$SHIM/tensorflow/compiler/xla/client"
    echo '#include "xla/hlo/builder/xla_builder.h"' > "$SHIM/tensorflow/compiler/xla/client/xla_builder.h"
    export CXXFLAGS="${CXXFLAGS:-} -I$TFINC/external/highwayhash -I$TFINC/external/farmhash_archive/src -I$SHIM"
    export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
           HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI \
           MAKEFLAGS="-j$(nproc)"
    if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
      echo "== installing cmake and g++ (Debian packages)"
      apt_install cmake g++
    fi
    pipi cloudpickle psutil pyyaml packaging cffi
    # built without isolation: setuptools and wheel must be in the environment (a fresh venv of
    # Python >= 3.12 has neither)
    "$PY" -c "import setuptools, wheel" 2>/dev/null || pipi setuptools wheel
    pipi --no-build-isolation --no-cache-dir --no-deps "horovod==0.28.1"
    rm -rf "$SHIM"
    "$PY" -c "import horovod.tensorflow as h; assert h.mpi_built(); print('horovod', h.__version__ if hasattr(h,'__version__') else 'ok', 'mpi_built')"
  fi
fi
echo "== install done"
