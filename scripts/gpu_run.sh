#!/usr/bin/env bash
# GPU checks and measurements of the kernels, one mode a call; results and a log under $OUT (default runs/gpu).
#   scripts/gpu_run.sh tests [PYTEST ARGS]  # the GPU tests (-m gpu) of the kernels, engine and MoE, or of the
#                                           #   given paths / -k filter
#   scripts/gpu_run.sh suite [PYTEST ARGS]  # the full GPU suite as the README runs it (-m gpu --full -n 4; the
#                                           #   quick tier with QUICK=1), each test's end and time logged as it
#                                           #   comes (suite_log.txt): a run cut by its limit ($LIMIT, 560 s) still
#                                           #   says what it covered
#   scripts/gpu_run.sh ptxas                # ptxas register / spill report of mla_decode's bodies (bf16 plain,
#                                           #   split-QK and scorer, per sequence and in pieces; fp8 transposed and
#                                           #   padded)
#   scripts/gpu_run.sh quick                # mla-bench mla_decode --quick and paged_gather (default mode)
#   scripts/gpu_run.sh grid                 # the full mla_decode grid (kernel and XLA)
#   scripts/gpu_run.sh peers                # mla_decode beside FlashMLA and vLLM's Triton kernel (the peer bundle
#                                           #   in .peers/, `benchmarks.peers`; XLA autotuner off: kernel vs kernel)
#   scripts/gpu_run.sh moe                  # mla-bench moe at V2-Lite's widths, the decode kernel at 16- and 32-row
#                                           #   tiles beside the grouped GEMMs ($TOKENS: 1,32,86,128,512)
#   scripts/gpu_run.sh ncu                  # Nsight Compute on mla_decode's main kernel at each of $NCU_CELLS
#                                           #   ($VARIANT: a name of `mla-bench mla_decode --variants`)
# $CELLS (a --cell-list) and $VARIANTS (a --variants list) narrow the benchmark modes. Benchmarks write their CSV
# after every cell, so a stage stopped by its time limit still returns what it measured. The GPU tests run with
# XLA's GEMM autotuner off (it spends ~15 s per new shape of the fp32 reference); the benchmarks keep it on (with
# it off XLA's matmul baselines are meaningless). Every stage has its own time limit. Run from the repo root.
set -u
MODE=${1:-quick}
[ $# -gt 0 ] && shift
OUT=${OUT:-runs/gpu}
R="$OUT/r"
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
LOG="$OUT/log.txt"
stage() { echo "=== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

stage "env"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c 'import jax; print("jax", jax.__version__, jax.devices())'; } 2>&1 | tee -a "$LOG"

bench() {  # $1: benchmark name, $2: time limit (s), rest: its options
  local name=$1 limit=$2; shift 2
  stage "benchmark $name $*"
  timeout "$limit" $PY -m benchmarks "$name" --out "$R" "$@" 2>&1 | tr '\r' '\n' \
    | grep -v "it/s\]\|s/it\]" | tee -a "$LOG"
}

gpu_tests() {  # $1: time limit (s), rest: pytest arguments
  local limit=$1; shift
  stage "GPU tests $*"
  # The whole output goes to a file first: a stage stopped by its limit still shows which tests ran.
  local f="$R/gpu_tests_$(date -u +%H%M%S).txt"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout "$limit" $PY -m pytest -m gpu -v -rfs \
    -p no:cacheprovider --timeout=120 --durations=8 "$@" > "$f" 2>&1
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|s call" "$f" | tail -40 | tee -a "$LOG"
}

suite() {  # the full GPU suite in parallel, as the README says to run it; rest: pytest arguments (files, -k)
  local tier=--full
  [ "${QUICK:-0}" = 1 ] && tier=""
  stage "GPU suite (-m gpu $tier -n 4) $*"
  local t0=$(date +%s)
  : > "$R/suite_log.txt"
  timeout "${LIMIT:-560}" $PY -m pytest -m gpu $tier -n 4 -q -rfEs -p no:cacheprovider \
    --test-log "$R/suite_log.txt" "$@" > "$R/suite.txt" 2>&1
  local rc=$?
  echo "exit $rc after $(( $(date +%s) - t0 )) s; tests ended: $(wc -l < "$R/suite_log.txt")" | tee -a "$LOG"
  tail -5 "$R/suite.txt" | tee -a "$LOG"
  sort -k2 -n -r "$R/suite_log.txt" | head -10 | tee -a "$LOG"  # the longest tests
}

ptxas_report() {
  stage "ptxas registers/spills: mla_decode"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 $PY - <<'PY' > "$R/ptxas.txt" 2>&1
import jax, jax.numpy as jnp
from pallas_kernels import mla_decode, MlaDecodeConfig
bf16 = [(1, 64, False, 1, dict(scorer=False, split_qk=False)), (1, 64, False, 1, dict(scorer=False, split_qk=True)),
        (2, 128, True, 4, dict(scorer=False, split_qk=True)), (1, 64, False, 1, {}), (2, 128, True, 4, {}),
        (1, 64, False, None, dict(schedule="pieces")), (2, 128, True, None, dict(schedule="pieces"))]
for fmt, cases in (("bf16", bf16), ("fp8", [(1, 16, False, 1, {}), (1, 32, False, 1, {}), (1, 64, False, 1, {})])):
  for s_q, H, causal, splits, kw in cases:
    print(f"### {fmt} s_q={s_q} H={H} causal={causal} splits={splits} {kw}", flush=True)
    pages = jnp.ones((32, 64, 576), jnp.bfloat16) if fmt == "bf16" else jnp.zeros((32, 64, 656), jnp.uint8)
    a = (jnp.ones((4, s_q, H, 576), jnp.bfloat16), pages, jnp.arange(32, dtype=jnp.int32).reshape(4, 8),
         jnp.full((4,), 500, jnp.int32))
    jax.block_until_ready(mla_decode(*a, softmax_scale=0.1, causal=causal, impl="kernel",
                                     config=MlaDecodeConfig(num_splits=splits, **kw)))
PY
  grep -E "###|registers|spill" "$R/ptxas.txt" | head -80 | tee -a "$LOG"
}

ncu_stage() {  # Nsight Compute on mla_decode's main kernel at each of $NCU_CELLS (B,s_q,seq,H)
  for cell in ${NCU_CELLS:-128,1,4096,128 128,1,8192,64}; do
    stage "ncu: mla_decode's main kernel at $cell (${VARIANT:-default})"
    n="$R/ncu_mla_decode_${cell//,/_}"
    timeout "${NCU_LIMIT:-200}" ncu --profile-from-start off --kernel-name regex:mla_decode_partials --launch-count 1 \
      --set full --import-source yes -o "$n" \
      $PY scripts/ncu_mla_decode.py --cell "$cell" ${VARIANT:+--variant $VARIANT} > "$n.log" 2>&1
    tail -3 "$n.log" | tee -a "$LOG"
    timeout 60 ncu --import "$n.ncu-rep" --page details --csv > "$n.csv" 2>&1
    timeout 60 ncu --import "$n.ncu-rep" --page raw --csv > "${n}_raw.csv" 2>&1  # every metric, stall reasons too
    timeout 60 ncu --import "$n.ncu-rep" --page source --print-source sass --csv > "${n}_sass.csv" 2>&1
    # the SASS lines that hold the stall samples, and the samples by region (the export itself is ~1 MB)
    $PY scripts/ncu_sass_summary.py "${n}_sass.csv" > "${n}_sass_top.txt" 2>&1 && rm -f "${n}_sass.csv" "$n.ncu-rep"
    grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots|Stall|Bank Conflicts|Tensor|Throughput" \
      "$n.csv" | head -60 | tee -a "$LOG"
  done
}

decode_bench() {  # $1: time limit (s), rest: mla-bench mla_decode options, narrowed by $CELLS and $VARIANTS
  local limit=$1; shift
  bench mla_decode "$limit" "$@" ${CELLS:+--cell-list "$CELLS"} ${VARIANTS:+--variants "$VARIANTS"}
}

case "$MODE" in
  tests) if [ $# -gt 0 ]; then gpu_tests 550 "$@"
         else
           gpu_tests 250 tests/test_mla_decode.py tests/test_mla_decode_fp8.py tests/test_paged_gather.py
           gpu_tests 250 tests/test_engine.py tests/test_moe.py tests/test_moe_decode.py
         fi ;;
  suite) suite "$@" ;;
  ptxas) ptxas_report ;;
  quick) decode_bench 330 --quick
         bench paged_gather 60 ;;
  grid)  decode_bench 560 --no-decompressed ;;
  peers) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" decode_bench 560 --no-decompressed --peers .peers ;;
  moe)   bench moe 300 --tokens "${TOKENS:-1,32,86,128,512}" --row-tiles 16,32 ;;
  ncu)   ncu_stage ;;
  *) echo "unknown mode $MODE (tests, suite, ptxas, quick, grid, peers, moe, ncu)" >&2; exit 2 ;;
esac
