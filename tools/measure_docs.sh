#!/usr/bin/env bash
# Re-runs the measurements behind the documentation's tables and figures, one job at a time
# (each takes the tests' MPI lock), with the code as it is.  Writes results/docs/<name>.{json,png,log};
# the pages say which step made each table.  Usage:
#
#   bash tools/measure_docs.sh                 # every step, in this order (about an hour on 2 cores)
#   bash tools/measure_docs.sh fit17m_1gbit gf_1gbit   # some steps
#   bash tools/measure_docs.sh --list          # the steps and their commands
#
# Needs what `make test` installs (TensorFlow, mpi4py, Open MPI); the --net steps need root (or
# CAP_NET_ADMIN) and tc.  Nothing else may run on the machine meanwhile: these are timings.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=results/docs
mkdir -p "$OUT"
LOCK="$($PYTHON -c 'import tempfile; print(tempfile.gettempdir())')/tfsparse-mpi.lock"
RUN="flock $LOCK $PYTHON -m tfsparse.run"  # the tools that launch mpirun themselves take the lock
NET1G="--net 1gbit"

HOROVOD='{"label":"horovod none","algorithm":"horovod","compression":"none"},
 {"label":"horovod fp16","algorithm":"horovod","compression":"fp16"},'
FIT17M='[{"label":"compute, a barrier per step","algorithm":"compute","barrier":true},
 {"label":"dense f32","algorithm":"dense"},
 {"label":"dense f32, 4 MB buckets","algorithm":"dense","plan":4194304},
 {"label":"dense f16","algorithm":"dense","wire_dtype":"float16"},
 {"label":"dense f16, 4 MB buckets","algorithm":"dense","wire_dtype":"float16","plan":4194304},
 {"label":"dense int8","algorithm":"dense","wire_dtype":"int8"},
 {"label":"dense int8, 4 MB buckets","algorithm":"dense","wire_dtype":"int8","plan":4194304},
 {"label":"dense int8 pipeline=2","algorithm":"dense","wire_dtype":"int8","pipeline":2},
 {"label":"dense int8 pipeline=2, 4 MB buckets","algorithm":"dense","wire_dtype":"int8","pipeline":2,"plan":4194304},
 {"label":"gtopk 0.01","algorithm":"gtopk","density":0.01},{"label":"oktopk 0.01","algorithm":"oktopk","density":0.01},
 {"label":"topk 0.01","algorithm":"topk","density":0.01},{"label":"dragonn 0.01","algorithm":"dragonn","density":0.01},
 {"label":"gtopk 1e-5: nothing on the wire","algorithm":"gtopk","density":0.00001}]'
SPARSE25M='[{"label":"compute, a barrier per step","algorithm":"compute","barrier":true},
 {"label":"gtopk","algorithm":"gtopk","density":0.001},{"label":"oktopk","algorithm":"oktopk","density":0.001},
 {"label":"topk","algorithm":"topk","density":0.001},{"label":"dragonn","algorithm":"dragonn","density":0.001},
 {"label":"gtopk 1e-6: nothing on the wire","algorithm":"gtopk","density":0.000001}]'
SHM17M='[{"label":"dense f32","algorithm":"dense"},{"label":"gtopk","algorithm":"gtopk","density":0.01},
 {"label":"oktopk","algorithm":"oktopk","density":0.01},{"label":"topk","algorithm":"topk","density":0.01},
 {"label":"dragonn","algorithm":"dragonn","density":0.01}]'
GF='[{"label":"dense f32 fused","algorithm":"dense"},
 {"label":"dense f32, 4 MB buckets","algorithm":"dense","plan":4194304},
 {"label":"dense f16 fused","algorithm":"dense","wire_dtype":"float16"},
 {"label":"dense f16, 4 MB buckets","algorithm":"dense","wire_dtype":"float16","plan":4194304},
 {"label":"csc 0.15 f32 fused","algorithm":"csc","density":0.15},
 {"label":"csc 0.15 f16, 4 MB buckets","algorithm":"csc","density":0.15,"wire_dtype":"float16","plan":4194304}]'
PIPE='[{"label":"D-Sync f32","algorithm":"dense"},
 {"label":"D-Sync bf16 (T)","algorithm":"dense","wire_dtype":"bfloat16"},
 {"label":"D-Sync int8 (Q)","algorithm":"dense","wire_dtype":"int8"},
 {"label":"Pipe-SGD f32","algorithm":"dense","pipeline":2},
 {"label":"Pipe-SGD bf16 (T)","algorithm":"dense","wire_dtype":"bfloat16","pipeline":2},
 {"label":"Pipe-SGD int8 (Q)","algorithm":"dense","wire_dtype":"int8","pipeline":2}]'
DRAGONN='[{"label":"dense","algorithm":"dense"},{"label":"topk","algorithm":"topk","density":0.001},
 {"label":"dgc","algorithm":"dgc","density":0.001},{"label":"dragonn","algorithm":"dragonn","density":0.001},
 {"label":"dragonn, plan=cost_model","algorithm":"dragonn","density":0.001,"plan":"cost_model"},
 {"label":"gtopk","algorithm":"gtopk","density":0.001},{"label":"oktopk","algorithm":"oktopk","density":0.001}]'
HVD_R50='[{"label":"Horovod 0.28.1, hvd.allreduce, fp32","algorithm":"horovod","compression":"none"},
 {"label":"Horovod 0.28.1, hvd.allreduce, fp16","algorithm":"horovod","compression":"fp16"},
 {"label":"tfsparse.horovod DistributedOptimizer, fp32","algorithm":"tfsparse.horovod","compression":"none"},
 {"label":"tfsparse.horovod DistributedOptimizer, fp16","algorithm":"tfsparse.horovod","compression":"fp16"},
 {"label":"SparseStrategy dense f16","algorithm":"dense","wire_dtype":"float16"}]'

TTA='[{"label":"dense f32","algorithm":"dense"},{"label":"dense f16","algorithm":"dense","wire_dtype":"float16"},
 {"label":"gtopk 0.01, memory=residual","algorithm":"gtopk","density":0.01,"memory":"residual"},
 {"label":"gtopk 0.01","algorithm":"gtopk","density":0.01},{"label":"topk 0.01","algorithm":"topk","density":0.01},
 {"label":"auto","algorithm":"auto"}]'
TTA_CONV='[{"label":"dense f32","algorithm":"dense"},
 {"label":"dense f16, 4 MB buckets","algorithm":"dense","wire_dtype":"float16","plan":4194304},
 {"label":"gtopk 0.01","algorithm":"gtopk","density":0.01},{"label":"oktopk 0.01","algorithm":"oktopk","density":0.01},
 {"label":"topk 0.01","algorithm":"topk","density":0.01}]'

# auto against the dense rows: on fast networks it must not lose (issue: within 5 % of the best); at 1 Gbit/s
# (tta_1gbit_auto) the same three rows alone re-measure auto where tta_1gbit (over an hour) is not re-run;
# tta_conv_auto, tta_transformer_auto: the same rows on the convolutional model, the Transformer, at 1 Gbit/s;
# tta_transformer_100mbit: the Transformer at 100 Mbit/s
TTA_FAST='[{"label":"dense f32","algorithm":"dense"},{"label":"dense f16","algorithm":"dense","wire_dtype":"float16"},
 {"label":"auto","algorithm":"auto"}]'

# conv schedules: gTop-k on the convolutional model at two densities, and sparse for 3 epochs then dense (density 1)
# (docs/choosing.md, "The convolutional model"), on shared memory: the epochs matter here, not the step
CONV_SCHEDULES='[{"label":"dense f32","algorithm":"dense"},{"label":"gtopk 0.01","algorithm":"gtopk","density":0.01},
 {"label":"gtopk 0.05","algorithm":"gtopk","density":0.05},
 {"label":"gtopk 0.01 for 3 epochs, then density 1","algorithm":"gtopk","density":1.0,"densities":[0.01,0.01,0.01]}]'

# conv small dense: gTop-k on the convolutional model with its tensors of fewer than 65,536 elements sent
# dense (its conv kernels, biases and output layer: 0.5 % of its elements), at 1 Gbit/s (docs/choosing.md)
CONV_SMALL_DENSE='[{"label":"dense f32","algorithm":"dense"},{"label":"dense f16","algorithm":"dense","wire_dtype":"float16"},
 {"label":"gtopk 0.01","algorithm":"gtopk","density":0.01},
 {"label":"gtopk 0.01, tensors under 65536 dense","algorithm":"gtopk","density":0.01,"dense_below":65536}]'

# the same rule on the 17.1M MLP and the Transformer, on shared memory (the epochs matter here, not the step)
SMALL_DENSE_SHM='[{"label":"dense f32","algorithm":"dense"},{"label":"gtopk 0.01","algorithm":"gtopk","density":0.01},
 {"label":"gtopk 0.01, tensors under 65536 dense","algorithm":"gtopk","density":0.01,"dense_below":65536}]'

# the target rule's own noise (docs/choosing.md, "How far the target is from noise"): dense float32 started from
# two other initial weights (and batch orders), same data, beside what auto runs on the convolutional model
# (gTop-k 0.01 and dense over int8, each with momentum correction), on shared memory (the epochs matter here)
NOISE='[{"label":"dense f32","algorithm":"dense"},
 {"label":"dense f32, initial weights of seed 100","algorithm":"dense","init_seed":100},
 {"label":"dense f32, initial weights of seed 200","algorithm":"dense","init_seed":200},
 {"label":"dense int8, memory=momentum_rows","algorithm":"dense","wire_dtype":"int8","memory":"momentum_rows","momentum":0.9},
 {"label":"gtopk 0.01, memory=momentum_rows","algorithm":"gtopk","density":0.01,"memory":"momentum_rows","momentum":0.9}]'

# dense over int8: dense float32 and float16 beside dense over the int8 wire (per-chunk scales, error feedback),
# synchronous (with the optimizer's momentum, and with momentum correction: what auto runs under an SGD with
# momentum) and pipelined (pipeline=2: Pipe-SGD), on the convolutional model and the 17.1M MLP at 1 Gbit/s
# (docs/choosing.md, "The convolutional model" and "Time to dense's accuracy")
INT8_ROWS='[{"label":"dense f32","algorithm":"dense"},{"label":"dense f16","algorithm":"dense","wire_dtype":"float16"},
 {"label":"dense int8","algorithm":"dense","wire_dtype":"int8"},
 {"label":"dense int8, memory=momentum_rows","algorithm":"dense","wire_dtype":"int8","memory":"momentum_rows"},
 {"label":"dense int8 pipeline=2","algorithm":"dense","wire_dtype":"int8","pipeline":2}]'

# dense over int4: half of int8's bytes (15 levels per chunk of 512, error feedback keeping what it rounds off),
# beside dense float32, float16 and int8, with momentum correction (the SGD's momentum applied in the exchange) and
# with the optimizer's own momentum (docs/choosing.md, "Dense over int4")
INT4_ROWS='[{"label":"dense f32","algorithm":"dense"},{"label":"dense f16","algorithm":"dense","wire_dtype":"float16"},
 {"label":"dense int8, memory=momentum_rows","algorithm":"dense","wire_dtype":"int8","memory":"momentum_rows"},
 {"label":"dense int4, memory=momentum_rows","algorithm":"dense","wire_dtype":"int4","memory":"momentum_rows"},
 {"label":"dense int4","algorithm":"dense","wire_dtype":"int4"}]'

# masking: momentum correction's masking on the Transformer (docs/choosing.md, "Masking and embeddings"):
# DGC's masking everywhere, against memory="momentum_rows" (what memory="auto" runs), at two densities
MASKING='[{"label":"dense f16","algorithm":"dense","wire_dtype":"float16"},
 {"label":"gtopk 0.01, memory=momentum","algorithm":"gtopk","density":0.01,"memory":"momentum"},
 {"label":"gtopk 0.01, memory=momentum_rows","algorithm":"gtopk","density":0.01,"memory":"momentum_rows"},
 {"label":"gtopk 0.01, memory=residual","algorithm":"gtopk","density":0.01,"memory":"residual"},
 {"label":"gtopk 0.05, memory=momentum","algorithm":"gtopk","density":0.05,"memory":"momentum"},
 {"label":"gtopk 0.05, memory=momentum_rows","algorithm":"gtopk","density":0.05,"memory":"momentum_rows"}]'

TWO_LEVEL='[{"label":"dense f16 flat","algorithm":"dense","wire_dtype":"float16"},
 {"label":"dense f16 two-level","algorithm":"dense","wire_dtype":"float16","hierarchical":true},
 {"label":"gtopk 0.01 flat","algorithm":"gtopk","density":0.01},
 {"label":"gtopk 0.01 two-level","algorithm":"gtopk","density":0.01,"hierarchical":true},
 {"label":"oktopk 0.01 flat","algorithm":"oktopk","density":0.01},
 {"label":"oktopk 0.01 two-level","algorithm":"oktopk","density":0.01,"hierarchical":true},
 {"label":"topk 0.01 flat","algorithm":"topk","density":0.01},
 {"label":"topk 0.01 two-level","algorithm":"topk","density":0.01,"hierarchical":true}]'

# three seeds of tools/bench_time_to_accuracy.py on 4 ranks, 10 epochs, and their summary:
# tta_seeds NAME ROWS RUN_FLAGS NETWORK [TOOL_FLAGS] writes $OUT/NAME_s{0,1,2}.json and $OUT/NAME.{json,png}
tta_seeds() {
    local name=$1 rows=$2 flags=$3 network=$4 tool=${5:-}
    echo "for seed in 0 1 2; do $RUN -np 4 ${flags:+$flags }$PYTHON tools/bench_time_to_accuracy.py '$rows' ${tool:+$tool }--epochs 10" \
         "--seed \$seed --network '$network' --out $OUT/${name}_s\$seed || exit 1; done &&" \
         "$PYTHON tools/time_to_accuracy_summary.py $OUT/$name $OUT/${name}_s0.json $OUT/${name}_s1.json $OUT/${name}_s2.json"
}

declare -A STEP
STEP[fit17m_1gbit]="$RUN -np 4 $NET1G $PYTHON tools/bench_fit_step.py '[${HOROVOD}${FIT17M#[}' --model mlp17m --network '1 Gbit/s (tfsparse-run --net 1gbit)' --out $OUT/fit_step_mlp17m_1gbit"
STEP[fit25m_1gbit]="$RUN -np 4 $NET1G $PYTHON tools/bench_fit_step.py '$SPARSE25M' --model mlp25m --network '1 Gbit/s (tfsparse-run --net 1gbit)' --out $OUT/fit_step_mlp25m_1gbit"
STEP[fit17m_shm]="$RUN -np 4 $PYTHON tools/bench_fit_step.py '$SHM17M' --model mlp17m --network 'shared memory' --out $OUT/fit_step_mlp17m_shm"
STEP[gf_1gbit]="$RUN -np 4 $NET1G $PYTHON tools/bench_fit_step.py '$GF' --model mlp25m --network '1 Gbit/s (tfsparse-run --net 1gbit)' --out $OUT/gf_1gbit"
STEP[pipe_1gbit]="$RUN -np 4 $NET1G $PYTHON tools/bench_fit_step.py '$PIPE' --model mlp25m --network '1 Gbit/s (tfsparse-run --net 1gbit)' --out $OUT/pipe_1gbit && $PYTHON tools/pipe_sgd_timing.py $OUT/pipe_1gbit.json --bandwidth 1gbit --latency 0 --out $OUT/pipe_timing"
STEP[dragonn_1gbit]="$RUN -np 4 $NET1G $PYTHON tools/bench_fit_step.py '$DRAGONN' --model mlp25m --network '1 Gbit/s (tfsparse-run --net 1gbit)' --out $OUT/dragonn_1gbit"
STEP[tta_conv]="$RUN -np 4 $NET1G $PYTHON tools/bench_time_to_accuracy.py '$TTA_CONV' --model conv --epochs 8 --network '1 Gbit/s (tfsparse-run --net 1gbit)' --out $OUT/time_to_accuracy_conv_1gbit"
STEP[tta_1gbit]=$(tta_seeds time_to_accuracy_1gbit "$TTA" "$NET1G" '1 Gbit/s (tfsparse-run --net 1gbit)')
STEP[tta_1gbit_auto]=$(tta_seeds time_to_accuracy_1gbit_auto "$TTA_FAST" "$NET1G" '1 Gbit/s (tfsparse-run --net 1gbit)')
STEP[tta_conv_auto]=$(tta_seeds time_to_accuracy_conv_1gbit_auto "$TTA_FAST" "$NET1G" '1 Gbit/s (tfsparse-run --net 1gbit)' "--model conv")
STEP[tta_transformer_auto]=$(tta_seeds time_to_accuracy_transformer_1gbit_auto "$TTA_FAST" "$NET1G" '1 Gbit/s (tfsparse-run --net 1gbit)' "--model transformer")
STEP[tta_transformer_100mbit]=$(tta_seeds time_to_accuracy_transformer_100mbit "$TTA_FAST" "--net 100mbit" '100 Mbit/s (tfsparse-run --net 100mbit)' "--model transformer")
STEP[tta_conv_schedules]=$(tta_seeds time_to_accuracy_conv_schedules "$CONV_SCHEDULES" "" 'shared memory' "--model conv")
STEP[tta_conv_small_dense]=$(tta_seeds time_to_accuracy_conv_small_dense "$CONV_SMALL_DENSE" "$NET1G" '1 Gbit/s (tfsparse-run --net 1gbit)' "--model conv")
STEP[tta_int8_conv]=$(tta_seeds time_to_accuracy_int8_conv_1gbit "$INT8_ROWS" "$NET1G" '1 Gbit/s (tfsparse-run --net 1gbit)' "--model conv")
STEP[tta_int8_mlp]=$(tta_seeds time_to_accuracy_int8_mlp_1gbit "$INT8_ROWS" "$NET1G" '1 Gbit/s (tfsparse-run --net 1gbit)')
STEP[tta_int4_conv]=$(tta_seeds time_to_accuracy_int4_conv_1gbit "$INT4_ROWS" "$NET1G" '1 Gbit/s (tfsparse-run --net 1gbit)' "--model conv")
STEP[tta_int4_mlp]=$(tta_seeds time_to_accuracy_int4_mlp_1gbit "$INT4_ROWS" "$NET1G" '1 Gbit/s (tfsparse-run --net 1gbit)')
STEP[tta_int4_transformer]=$(tta_seeds time_to_accuracy_int4_transformer_1gbit "$INT4_ROWS" "$NET1G" '1 Gbit/s (tfsparse-run --net 1gbit)' "--model transformer")
STEP[tta_small_dense_mlp_shm]=$(tta_seeds time_to_accuracy_small_dense_mlp_shm "$SMALL_DENSE_SHM" "" 'shared memory')
STEP[tta_small_dense_transformer_shm]=$(tta_seeds time_to_accuracy_small_dense_transformer_shm "$SMALL_DENSE_SHM" "" 'shared memory' "--model transformer")
STEP[tta_shm]=$(tta_seeds time_to_accuracy_shm "$TTA_FAST" "" 'shared memory')
STEP[tta_conv_noise]=$(tta_seeds time_to_accuracy_conv_noise_shm "$NOISE" "" 'shared memory' "--model conv")
STEP[tta_10gbit]=$(tta_seeds time_to_accuracy_10gbit "$TTA_FAST" "--net 10gbit" '10 Gbit/s (tfsparse-run --net 10gbit)')
STEP[horovod_resnet50]="$RUN -np 4 $NET1G $PYTHON tools/bench_fit_step.py '$HVD_R50' --model resnet50 --network '1 Gbit/s (emulated)' --out $OUT/horovod_resnet50_1gbit"
STEP[two_level_fit]="$RUN -np 4 --emulate-hosts 2 --net 1gbit $PYTHON tools/bench_fit_step.py '$TWO_LEVEL' --model mlp17m --network '1 Gbit/s between 2 emulated hosts' --out $OUT/two_level_fit_1gbit"
STEP[two_level_exchange]="$RUN -np 4 --emulate-hosts 2 --net 1gbit $PYTHON tools/bench_two_level.py --out $OUT/two_level_exchange_1gbit"
STEP[demo]="flock $LOCK make demo"  # writes results/demo.{json,png}
STEP[encode]="$PYTHON tools/bench_encode.py --out $OUT/bench_encode"
STEP[exchange]="$PYTHON tools/bench_exchange.py --wires float32,float16,bfloat16,int8 --label 'shared memory' --out $OUT/bench_exchange.json"
STEP[traffic]="$PYTHON tools/bench_exchange.py --algorithms dense,topk,gtopk,oktopk,dragonn,gaussiank,dgc,csc --wires float32,float16,int8 --plans fused --np 4 --steps 3 --warmup 1 --out $OUT/traffic.json"
# masking's target: dense float32's best in tta_transformer_auto's seed 1 (0.9512) less 0.5 point
STEP[masking]="$RUN -np 4 $NET1G $PYTHON tools/bench_time_to_accuracy.py '$MASKING' --model transformer --epochs 10 --seed 1 --target 0.9462 --network '1 Gbit/s (tfsparse-run --net 1gbit)' --out $OUT/masking_transformer_1gbit"
STEP[kernels]="$PYTHON tools/bench_kernels.py --sizes 1M,4M,16M,64M,128M --out $OUT"
STEP[choices]="$PYTHON tools/bench_choices.py --out $OUT/engine_choices"
STEP[concentration]="flock $LOCK $PYTHON tools/gradient_concentration.py --out $OUT/gradient_concentration"
STEP[collectives]="$PYTHON tools/bench_collectives.py --out $OUT/bench_collectives.json"
STEP[convergence]="flock $LOCK $PYTHON tools/bench_convergence.py --out $OUT/bench_convergence"
STEP[convergence_dragonn]="flock $LOCK $PYTHON tools/bench_convergence.py --suite dragonn --out $OUT/bench_dragonn"
STEP[convergence_pipesgd]="flock $LOCK $PYTHON tools/bench_convergence.py --suite pipesgd --seeds 0 1 2 3 --out $OUT/bench_pipesgd"
STEP[accuracy]="$PYTHON -m pytest -s -q tests/test_algorithms_fit.py -k 'accuracy_within_two_points or half_precision_wire'"  # the tests take the lock
STEP[simulate]="$PYTHON tools/simulate_network.py --sweep --out $OUT/simulate_network"
STEP[validate_100mbit]="$PYTHON tools/validate_network_model.py --rates 100mbit --n 4000000 --density 0.01 --repeats 3 --out $OUT/validate_network_model_100mbit.json"
STEP[validate_1gbit]="$PYTHON tools/validate_network_model.py --repeats 3 --out $OUT/validate_network_model.json"
ORDER="fit17m_1gbit fit25m_1gbit fit17m_shm gf_1gbit pipe_1gbit dragonn_1gbit horovod_resnet50 two_level_fit
 two_level_exchange tta_conv encode exchange traffic
 kernels choices collectives convergence convergence_dragonn convergence_pipesgd accuracy simulate validate_100mbit validate_1gbit
 tta_1gbit tta_1gbit_auto tta_conv_auto tta_conv_schedules tta_conv_small_dense tta_int8_conv tta_int8_mlp tta_int4_conv tta_int4_mlp tta_int4_transformer tta_small_dense_mlp_shm tta_small_dense_transformer_shm
 tta_transformer_auto tta_transformer_100mbit masking tta_shm tta_10gbit tta_conv_noise concentration demo"

if [[ "${1:-}" == "--list" ]]; then
    for name in $ORDER; do printf '%s:\n  %s\n' "$name" "${STEP[$name]}"; done
    exit 0
fi
if (($#)); then names=("$@"); else read -ra names <<< "$(echo $ORDER)"; fi
for name in "${names[@]}"; do
    [[ -n "${STEP[$name]:-}" ]] || { echo "unknown step '$name'; accepted: $(echo $ORDER)" >&2; exit 2; }
done
# the kernels compiled (or loaded) once before any step, so that no timed epoch pays for a compile
# (a launch after an edit of the kernels otherwise compiles them inside its first setting's first epoch)
$PYTHON -c "from tfsparse.cli import warmup; print(f'kernels ready in {warmup():.1f} s')" || exit 1
for name in "${names[@]}"; do
    echo "== $name ($(date -u +%H:%M:%S)): ${STEP[$name]}"
    start=$SECONDS
    bash -c "${STEP[$name]}" > "$OUT/$name.log" 2>&1 || { echo "   $name FAILED, see $OUT/$name.log"; continue; }
    echo "   $name done in $((SECONDS - start)) s"
done
