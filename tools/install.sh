#!/usr/bin/env bash
# One install script for tfsparse: system MPI, Python dependencies, the package itself
# and (optionally) Horovod 0.28.1 built from source against the installed TensorFlow.
#
#   bash tools/install.sh            # MPI + TF + tfsparse[test]
#   bash tools/install.sh --horovod  # ... and Horovod (about 5-10 min on 2 cores)
#
# Idempotent: every step checks whether it is already done, so CI re-runs are cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WITH_HOROVOD=0
for a in "$@"; do
  case "$a" in
    --horovod) WITH_HOROVOD=1 ;;
    *) echo "install.sh: unknown argument '$a' (accepted: --horovod)" >&2; exit 2 ;;
  esac
done

if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
  echo "== installing OpenMPI (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

pipi() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$PY" -c "import tensorflow, keras, mpi4py, numba, sklearn, matplotlib, pytest, pytest_timeout" 2>/dev/null; then
  echo "== installing Python dependencies"
  pipi "tensorflow-cpu==2.21.*" "keras>=3.10" "numpy" "mpi4py>=4" "numba>=0.60" \
       "scikit-learn" "matplotlib" "pytest" "pytest-timeout"
fi
if ! "$PY" -c "import numba.cuda; from numba.cuda.cudadrv import nvvm" 2>/dev/null \
   || ! "$PY" -c "import importlib.metadata as m; m.version('numba-cuda')" 2>/dev/null; then
  echo "== installing numba-cuda (PTX compilation in CI, no GPU needed)"
  pipi "numba-cuda[cu13]" || echo "warning: numba-cuda could not be installed; CUDA kernel tests will be skipped"
fi

echo "== installing tfsparse (editable)"
pipi --no-deps -e .

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
    pipi cloudpickle psutil pyyaml packaging cffi
    pipi --no-build-isolation --no-cache-dir --no-deps "horovod==0.28.1"
    rm -rf "$SHIM"
    "$PY" -c "import horovod.tensorflow as h; assert h.mpi_built(); print('horovod', h.__version__ if hasattr(h,'__version__') else 'ok', 'mpi_built')"
  fi
fi
echo "== install done"
