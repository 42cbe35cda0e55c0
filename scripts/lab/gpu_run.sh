#!/usr/bin/env bash
# The one script the GPU call runs: GPU tests, register report, benchmarks; results under $OUT.
#   scripts/lab/gpu_run.sh [quick] # GPU tests + the --quick cells (kernel, XLA, decompressed) + gather grid
#   scripts/lab/gpu_run.sh tests   # every GPU test (kernels, engine, MoE) + ptxas register report
#   scripts/lab/gpu_run.sh grid    # the full mla_decode grid (kernel + XLA, no decompressed)
#   scripts/lab/gpu_run.sh variants # kernel GPU tests (boundaries, B=256), ptxas report, then
#                              #   the FlashMLA cells with the $VARIANTS configs (XLA autotuner off)
#   scripts/lab/gpu_run.sh fairxla  # the FlashMLA cells, default config, XLA autotuner ON (fair baseline)
#   scripts/lab/gpu_run.sh flash   # the flash attention GPU tests, its ptxas report, then
#                              #   scripts/lab/probe_flash_attention.py (--sweep at 16x4096x16)
#   scripts/lab/gpu_run.sh pending # what CPU sessions built since the last GPU call: the gather's fp8/fp4
#                              #   bodies, the flash attention (tests, ptxas), gather fp4/fp8 cells, flash probe
#   scripts/lab/gpu_run.sh train   # engine/MoE/training GPU tests, then issue 16's 16 x 4096 step with our flash
#                              #   attention beside cuDNN's, and the 50-step loss curves (scripts/lab/loss_curve_equality.py)
#   scripts/lab/gpu_run.sh peers   # the MoE/training/scan GPU tests while FlashMLA builds, then mla_decode beside
#                              #   FlashMLA and vLLM's Triton kernel (.peers carried; docs/BENCHMARKS.md), both schedules
#   scripts/lab/gpu_run.sh scorer  # mla_decode GPU tests (TESTS_K: a -k filter; EXTRA_TESTS: more test paths),
#                              #   ptxas (FlashMLA building meanwhile), then the peers stage with VARIANTS
#                              #   (default: balanced)
#   scripts/lab/gpu_run.sh gather  # the engine's quantized-pages GPU tests, then the fp8 gather's config sweep
#   scripts/lab/gpu_run.sh fp8     # the fp8 decode GPU tests, the fp8 bodies' ptxas report, the profile
#                              #   (below), then scripts/lab/probe_fp8_decode.py (bf16 / fp8 transposed / shared)
#   scripts/lab/gpu_run.sh fp8rows  # fp8 bodies' ptxas report, probe_fp8_decode, the profile, then (with $FP8_BEFORE, a
#                              #   copy of an earlier fp8.py) the probe again on its cells $ONLY (default 0,1,4,7);
#                              #   with $FP8_TESTS, the fp8 decode GPU tests last
#   scripts/lab/gpu_run.sh session17 # probe_fp8_decode on cells $ONLY, now and with $FP8_BEFORE, then kvpages with
#                              #   GATHER=1
#   scripts/lab/gpu_run.sh session18 # the engine's GPU tests on pieces / auto, mla_decode beside the peers with
#                              #   $VARIANTS (pieces,auto) on $CELLS, then e2e V2-Lite on a ragged batch, default and auto
#   scripts/lab/gpu_run.sh session19a # every fp8 decode GPU test, mla_decode on fp8 pages ($FP8_CELLS), the ncu128 stage
#   scripts/lab/gpu_run.sh session19b # scorer / pieces / large-batch GPU tests, fp8 ones with row blocks, the peers on
#                              #   $CELLS with $VARIANTS (auto), then the ncu stage
#   scripts/lab/gpu_run.sh fp8scorer # the fp8 scorer's GPU tests, the fp8 ptxas report, mla_decode on bf16 then fp8
#                              #   pages ($FP8_CELLS) with $VARIANTS (fp8_scorer)
#   scripts/lab/gpu_run.sh session20a # ptxas reports (bf16 and fp8 bodies), the three-warpgroup / staged-output / fp8
#                              #   scorer GPU tests
#   scripts/lab/gpu_run.sh session20b # mla_decode on fp8 pages with fp8_scorer, then beside the peers with scorer3,
#                              #   out_smem, auto, auto_scorer3 (carry .peers)
#   scripts/lab/gpu_run.sh session19c # mla_decode on bf16 then fp8 pages ($FP8_CELLS), then the kvpages stage
#   scripts/lab/gpu_run.sh session18b # fp8 decode GPU tests, bf16 scorer pieces ones, mla_decode beside the peers on
#                              #   $CELLS, then on fp8 pages ($FP8_CELLS), both with $VARIANTS (pieces,auto)
#   scripts/lab/gpu_run.sh kvpages # mla-bench e2e on bf16 then fp8 pages ($KV_DTYPES) over $CELLS (V2-Lite 128 x 1024,
#                              #   16 x 16384), $NEW_TOKENS new tokens; with $GATHER the fp8 gather's --quick cells
#   scripts/lab/gpu_run.sh profile8 # scripts/lab/profile_fp8_decode.py (Mosaic GPU profiler phases of the
#                              #   fp8 decode body)
#   scripts/lab/gpu_run.sh decode  # the engine / scan / decode-kernel GPU tests, then mla-bench e2e --kernels on
#                              #   V2-Lite (1024-token prompts; B=1, 32, 128 at decode_steps 8, B=1 at 1; no HF)
#   scripts/lab/gpu_run.sh gemv    # scripts/lab/probe_gemv.py: batch-1..32 projections over stacked layers (and again
#                              #   with XLA's dynamic-slice fusion); probe_decode_variants.py (rows padded, dynamic-
#                              #   slice fusion); e2e --kernels with command buffers (WHILE, unrolled)
#   scripts/lab/gpu_run.sh hlo     # decode-kernel and scan GPU tests, then the optimized HLO of V2-Lite's decode
#                              #   program in the $VARIANTS of probe_decode_variants.py (default: pad, B=1)
#   scripts/lab/gpu_run.sh stacked # stacked_matmul + scan GPU tests; V2-Lite decode with projections sliced by the
#                              #   scan and read whole by stacked_matmul (B=1, 32, 128); fp8_gemm GPU tests + probe
#   scripts/lab/gpu_run.sh prefill # the flash prefill's GPU tests (offset kernel, layer, engine), its ptxas report,
#                              #   then scripts/lab/probe_flash_prefill.py (V2-Lite chunks after prefixes)
#   scripts/lab/gpu_run.sh prefill_e2e # mla-bench e2e, V2-Lite, 8192-token prompts at B=1 and 8: the engine's
#                              #   chunk rule (flash prefill), then --prefill-chunk 512 (the old chunking)
#   scripts/lab/gpu_run.sh fp8w    # FP8 weights at decode: fp8_matvec / moe_decode_fp8 / fp8_gemm GPU tests, then
#                              #   scripts/lab/probe_fp8_decode_gemv.py --sweep
#   scripts/lab/gpu_run.sh fp8e2e  # mla-bench e2e on the V3 cut, --weights $WEIGHTS (default fp8; bf16 in another
#                              #   call), B = $BATCHES (1,32), 1024-token prompts, 64 new tokens, no HF
#   scripts/lab/gpu_run.sh session13a # moe_decode / fp8_matvec fp8 GPU tests, then fp8e2e (WEIGHTS=fp8)
#   scripts/lab/gpu_run.sh session15 # moe_decode fp8 GPU tests, the wo/experts probe, V3-cut e2e fp8 / bf16 / fp8 with
#                              #   moe_decode_fp8's f16 products
#   scripts/lab/gpu_run.sh ncu128  # Nsight Compute on mla_decode's main kernel only ($NCU_CELLS, default H = 128 and
#                              #   the H = 64 cell beside it; $VARIANT a --variants name): .ncu-rep, details CSV
#   scripts/lab/gpu_run.sh session15b # moe_decode_fp8's config sweep (64 experts), then V3-cut e2e fp8 with the fastest
#   scripts/lab/gpu_run.sh session16 # fp8_matvec's f16 configs at M = 32 (FlashMLA building meanwhile), then the
#                              #   peers stage with $VARIANTS on $CELLS
#   scripts/lab/gpu_run.sh session14 # the rest of the fp8_matvec GPU tests, ncu of fp8_matvec vs bf16 on wo, the M=1 sweep
#   scripts/lab/gpu_run.sh sweep   # the --quick cells with config sweeps, then the rest of the grid
#                              #   (XLA autotuner off: kernel-vs-kernel comparisons; XLA pessimistic)
#                              #   + ptxas register/spill report
# Benchmark stages write their CSV after every cell, so a stage stopped by its time limit still
# returns what it measured.
# The GPU tests run with XLA's GEMM autotuner off (--xla_gpu_autotune_level=0): it spent ~15 s
# per new shape of the fp32 reference. The benchmarks keep it ON: with it off, XLA's bf16
# 8192^3 matmul fell from 807 to 11 TFLOP/s, which would make every XLA baseline meaningless.
# Every stage has its own time limit so a hang cannot eat the whole call. Run from the repo root.
set -u
MODE=${1:-quick}
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

bench() {   # $1: benchmark name, $2: time limit (s), rest: its options
  local name=$1 limit=$2; shift 2
  stage "benchmark $name $*"
  timeout "$limit" $PY -m benchmarks "$name" --out "$R" "$@" 2>&1 | tr '\r' '\n' \
    | grep -v "it/s\]\|s/it\]" | tee -a "$LOG"
}

ptxas_report() {
  stage "ptxas registers/spills"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 $PY - <<'PY' > "$R/ptxas.txt" 2>&1
import jax, jax.numpy as jnp
from pallas_kernels import mla_decode, MlaDecodeConfig
for B, s_q, H, causal, splits, split_qk, scorer, schedule in [
    (4, 1, 64, False, 1, False, False, "per_sequence"), (4, 1, 64, False, 1, True, False, "per_sequence"),
    (4, 2, 128, True, 1, True, False, "per_sequence"), (2, 1, 16, False, 4, False, False, "per_sequence"),
    (4, 1, 64, False, 1, False, True, "per_sequence"), (4, 2, 128, True, 4, False, True, "per_sequence"),
    (4, 1, 64, False, 1, False, True, "balanced"), (4, 2, 128, True, 1, False, True, "balanced"),
    (4, 1, 64, False, 1, False, True, "pieces"), (4, 2, 128, True, 1, False, True, "pieces"),
    (4, 1, 128, False, 1, False, "out_smem", "per_sequence"), (4, 1, 128, False, 1, False, "out_smem", "pieces"),
    (4, 1, 128, False, 1, False, "three", "per_sequence"), (4, 2, 128, True, 1, False, "three", "pieces")]:
  print(f"### B={B} s_q={s_q} H={H} causal={causal} splits={splits} split_qk={split_qk} scorer={scorer} "
        f"schedule={schedule}", flush=True)
  a = (jnp.ones((B, s_q, H, 576), jnp.bfloat16), jnp.ones((B * 8, 64, 576), jnp.bfloat16),
       jnp.arange(B * 8, dtype=jnp.int32).reshape(B, 8), jnp.full((B,), 500, jnp.int32))
  jax.block_until_ready(mla_decode(*a, softmax_scale=0.1, causal=causal,
                                   config=MlaDecodeConfig(num_splits=splits, split_qk=split_qk,
                                                          scorer=bool(scorer), schedule=schedule,
                                                          scorer_out_smem=scorer == "out_smem",
                                                          scorer_pv_cols=0 if scorer == "three" else 128),
                                   impl="kernel"))
PY
  grep -E "###|registers|spill" "$R/ptxas.txt" | head -60 | tee -a "$LOG"
}

flash_ptxas_report() {
  stage "ptxas registers/spills: flash attention (forward, dK/dV, dQ)"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 90 $PY - <<'PY' > "$R/ptxas_flash.txt" 2>&1
import jax, jax.numpy as jnp
from pallas_kernels import flash_attention
q = jnp.ones((1, 256, 2, 192), jnp.bfloat16); v = jnp.ones((1, 256, 2, 128), jnp.bfloat16)
f = lambda q, k, v: flash_attention(q, k, v, softmax_scale=0.1, impl="kernel").astype(jnp.float32).sum()
jax.block_until_ready(jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, q, v))
PY
  grep -E "Compiling|registers|spill" "$R/ptxas_flash.txt" | head -40 | tee -a "$LOG"
}

prefill_ptxas_report() {
  stage "ptxas registers/spills: flash attention forward with offsets"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 90 $PY - <<'PY' > "$R/ptxas_prefill.txt" 2>&1
import jax, jax.numpy as jnp
from pallas_kernels import flash_attention_prefill
q = jnp.ones((1, 256, 2, 192), jnp.bfloat16); k = jnp.ones((1, 768, 2, 192), jnp.bfloat16)
v = jnp.ones((1, 768, 2, 128), jnp.bfloat16); off = jnp.array([500], jnp.int32); n = jnp.array([756], jnp.int32)
jax.block_until_ready(flash_attention_prefill(q, k, v, off, n, softmax_scale=0.1, impl="kernel"))
PY
  grep -E "Compiling|registers|spill" "$R/ptxas_prefill.txt" | head -20 | tee -a "$LOG"
}

fp8_ptxas_report() {
  stage "ptxas registers/spills: mla_decode on fp8 pages (transposed R=16, 32; shared R=64; the fp8 scorer R=64, 128)"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 90 $PY - <<'PY' > "$R/ptxas_fp8.txt" 2>&1
import jax, jax.numpy as jnp
from pallas_kernels import mla_decode, MlaDecodeConfig
for H, fp8_scorer in ((16, False), (32, False), (64, False), (64, True), (128, True)):
  print(f"### H={H} fp8_scorer={fp8_scorer}", flush=True)
  a = (jnp.ones((4, 1, H, 576), jnp.bfloat16), jnp.zeros((32, 64, 656), jnp.uint8),
       jnp.arange(32, dtype=jnp.int32).reshape(4, 8), jnp.full((4,), 500, jnp.int32))
  jax.block_until_ready(mla_decode(*a, softmax_scale=0.1, config=MlaDecodeConfig(num_splits=1, fp8_scorer=fp8_scorer),
                                   impl="kernel"))
PY
  grep -E "###|registers|spill" "$R/ptxas_fp8.txt" | head -40 | tee -a "$LOG"
}

kvpages_stage() {  # the engine on bf16 against fp8 pages, the same cells; the fp8 gather's --quick cells
  for kv in ${KV_DTYPES:-bf16 fp8}; do  # the engine on bf16 against fp8 pages, the same cells
    bench e2e "${E2E_LIMIT:-200}" --cells "${CELLS:-v2-lite:128x1024,16x16384}" --new-tokens "${NEW_TOKENS:-64}" \
      --kv-dtype "$kv" --no-hf --out "$R/e2e_$kv"
  done
  [ -n "${GATHER:-}" ] && bench paged_gather 120 --quick --kv-dtype fp8
}

ncu_stage() {  # Nsight Compute on mla_decode's main kernel at each of $NCU_CELLS
  for cell in ${NCU_CELLS:-128,1,4096,128 128,1,8192,64}; do  # ours at H = 128 and where it matches FlashMLA
    stage "ncu: mla_decode's main kernel at $cell (${VARIANT:-default})"
    n="$R/ncu_mla_decode_${cell//,/_}"
    timeout "${NCU_LIMIT:-200}" ncu --profile-from-start off --kernel-name regex:mla_decode_partials --launch-count 1 \
      --set full --import-source yes -o "$n" \
      $PY scripts/lab/ncu_mla_decode.py --cell "$cell" ${VARIANT:+--variant $VARIANT} > "$n.log" 2>&1
    tail -3 "$n.log" | tee -a "$LOG"
    timeout 60 ncu --import "$n.ncu-rep" --page details --csv > "$n.csv" 2>&1
    # every metric (the warp stall reasons among them), and the SASS lines with their stall samples
    timeout 60 ncu --import "$n.ncu-rep" --page raw --csv > "${n}_raw.csv" 2>&1
    timeout 60 ncu --import "$n.ncu-rep" --page source --print-source sass --csv > "${n}_sass.csv" 2>&1
    # the SASS lines that hold the stall samples and the samples by region (the export itself is ~1 MB)
    $PY scripts/lab/ncu_sass_summary.py "${n}_sass.csv" > "${n}_sass_top.txt" 2>&1 && rm -f "${n}_sass.csv" "$n.ncu-rep"
    grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots|Stall|Bank Conflicts|Tensor|Throughput" \
      "$n.csv" | head -60 | tee -a "$LOG"
  done
}

gpu_tests() {  # $1: time limit (s), rest: test paths
  local limit=$1; shift
  stage "GPU tests $*"
  # The whole output goes to a file first: a stage stopped by its limit still shows which tests ran.
  local f="$R/gpu_tests_$(date -u +%H%M%S).txt"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout "$limit" $PY -m pytest -m gpu -v -rfs -p no:cacheprovider --timeout=120 --durations=8 \
    "$@" > "$f" 2>&1
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|s call" "$f" | tail -40 | tee -a "$LOG"
}

case "$MODE" in
  quick) gpu_tests 150 tests/test_mla_decode.py tests/test_paged_gather.py ;;
  tests) gpu_tests 200 tests/test_mla_decode.py tests/test_paged_gather.py
         gpu_tests 200 tests/test_engine.py tests/test_moe.py
         ptxas_report ;;
  variants) gpu_tests 130 tests/test_mla_decode.py -k "page_boundaries or large_batch"
         ptxas_report ;;
  pending) gpu_tests 200 tests/test_paged_gather.py tests/test_flash_attention.py tests/test_attention.py
         flash_ptxas_report ;;
  peers) ( cd .peers/flashmla && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 NVCC_THREADS=4 \
             $PY setup.py build_ext --inplace > "$R/flashmla_prebuild_log.txt" 2>&1 ) &
         BUILD=$!
         gpu_tests 200 tests/test_moe.py tests/test_moe_decode.py tests/test_training.py tests/test_scan.py
         stage "waiting for the FlashMLA build"; wait $BUILD; tail -3 "$R/flashmla_prebuild_log.txt" | tee -a "$LOG" ;;
  gather) gpu_tests 130 tests/test_engine.py -k quantized ;;
  hlo) gpu_tests 170 tests/test_mla_decode.py tests/test_scan.py -k "gpu_kernel_matches_reference or large_batch or scan" ;;
  decode) gpu_tests 230 tests/test_engine.py tests/test_scan.py tests/test_mla_decode.py ${TESTS_K:+-k "$TESTS_K"} ;;
  session16) ( cd .peers/flashmla && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 NVCC_THREADS=4 \
             $PY setup.py build_ext --inplace > "$R/flashmla_prebuild_log.txt" 2>&1 ) &
         BUILD=$!
         stage "probe_fp8_decode_gemv: fp8_matvec's f16 configs at M = 32, V3's 8 projections"
         timeout 300 $PY scripts/lab/probe_fp8_decode_gemv.py --out "$R/fp8_matvec_m32.json" --rows 32 --no-experts \
           --iters 20 --budget-s 250 --configs "${FP8_CONFIGS:-f16 block_n=128,f16 warps=8,f16 block_n=128 warps=8,\
f16 stages=6,f16 block_n=32,f16 block_k=64,e4m3}" 2>&1 | tail -80 | tee -a "$LOG"
         stage "waiting for the FlashMLA build"; wait $BUILD; tail -3 "$R/flashmla_prebuild_log.txt" | tee -a "$LOG" ;;
  scorer) ( cd .peers/flashmla && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 NVCC_THREADS=4 \
             $PY setup.py build_ext --inplace > "$R/flashmla_prebuild_log.txt" 2>&1 ) &
         BUILD=$!
         gpu_tests 200 tests/test_mla_decode.py ${TESTS_K:+-k "$TESTS_K"}
         [ -n "${EXTRA_TESTS:-}" ] && gpu_tests 100 $EXTRA_TESTS
         ptxas_report
         stage "waiting for the FlashMLA build"; wait $BUILD; tail -3 "$R/flashmla_prebuild_log.txt" | tee -a "$LOG" ;;
  fp8) gpu_tests 150 tests/test_mla_decode_fp8.py
       fp8_ptxas_report
       stage "profile_fp8_decode"
       timeout 120 $PY scripts/lab/profile_fp8_decode.py --out "$R/profile" 2>&1 | tee -a "$LOG" ;;
  train) gpu_tests 200 tests/test_engine.py tests/test_moe.py tests/test_moe_decode.py tests/test_training.py tests/test_scan.py ;;
  stacked) gpu_tests 130 tests/test_stacked_matmul.py tests/test_scan.py ;;
  fp8w) gpu_tests 240 tests/test_fp8_matvec.py tests/test_moe_decode.py tests/test_fp8_gemm.py ;;
  prefill) gpu_tests 200 tests/test_flash_attention.py tests/test_attention.py tests/test_engine.py \
           -k "prefill or cached"
         prefill_ptxas_report
         stage "probe_flash_prefill"
         timeout 240 $PY scripts/lab/probe_flash_prefill.py --out "$R/flash_prefill" 2>&1 | tee -a "$LOG" ;;
  flash) gpu_tests 200 tests/test_flash_attention.py tests/test_attention.py
         flash_ptxas_report
         stage "probe_flash_attention --sweep"
         timeout 280 $PY scripts/lab/probe_flash_attention.py --out "$R/flash" --sweep 2>&1 | tee -a "$LOG" ;;
esac
case "$MODE" in
  quick) bench mla_decode 330 --quick
         bench paged_gather 60 ;;
  grid)  bench mla_decode 560 --no-decompressed ;;
  gemv) stage "probe_gemv"
        timeout 90 $PY scripts/lab/probe_gemv.py --out "$R/gemv" --no-hlo 2>&1 | tee -a "$LOG"
        stage "probe_gemv, dynamic-slice fusion on"
        XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" timeout 90 \
          $PY scripts/lab/probe_gemv.py --out "$R/gemv" --no-hlo 2>&1 | tee -a "$LOG"
        stage "probe_decode_variants"
        timeout 300 $PY scripts/lab/probe_decode_variants.py --out "$R/variants" --batches "${BATCHES:-1,32}" 2>&1 \
          | grep -v "it/s\]" | tee -a "$LOG"
        XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE \
          --xla_gpu_command_buffer_unroll_loops=true --xla_gpu_graph_min_graph_size=1" bench e2e 100 --model v2-lite \
          --batch 1 --prompt 1024 --new-tokens 128 --kernels --no-hf --out "$R/cmdbuf" ;;
  hlo) stage "probe_decode_variants --hlo"
       timeout 200 $PY scripts/lab/probe_decode_variants.py --out "$R/hlo" --batches "${BATCHES:-1}" \
         --variants "${VARIANTS:-pad}" --hlo --no-kernels 2>&1 | tee -a "$LOG" ;;
  decode) bench e2e "${E2E_LIMIT:-250}" --model v2-lite --batch "${BATCHES:-1,32,128}" --prompt 1024 --new-tokens 128 \
            --kernels --no-hf ${E2E_EXTRA:-}
          bench e2e 110 --model v2-lite --batch 1 --prompt 1024 --new-tokens 128 --kernels --no-hf --decode-steps 1 --out "$R/k1" ;;
  gather) bench paged_gather 170 --quick --sweep --kv-dtype fp8 ;;
  session11c) gpu_tests 80 tests/test_fp8_gemm.py
         stage "probe_fp8_gemm"
         timeout 150 $PY scripts/lab/probe_fp8_gemm.py --out "$R/fp8_gemm.json" --budget-s 100 2>&1 | tail -45 \
           | tee -a "$LOG"
         bench e2e "${E2E_LIMIT:-260}" --model v2-lite --batch "${BATCHES:-1,32,128}" --prompt 1024 --new-tokens 128 \
           --kernels --no-hf ;;
  session11d) stage "probe_fp8_gemm_errors"
         timeout 130 $PY scripts/lab/probe_fp8_gemm_errors.py --out "$R/fp8_errors.json" 2>&1 | tail -12 | tee -a "$LOG"
         stage "mla-bench serve"
         timeout "${SERVE_LIMIT:-380}" $PY -m benchmarks serve --out "$R/serve" --rates "${RATES:-2,8}" \
           --requests "${REQUESTS:-24}" 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -40 | tee -a "$LOG" ;;
  session11b) stage "fp8_gemm under compute-sanitizer (q_a at M = 32), SASS dumped"
         XLA_PYTHON_CLIENT_PREALLOCATE=false MOSAIC_GPU_DUMP_SASS=1 timeout 120 compute-sanitizer --tool memcheck \
           --show-backtrace no $PY - > "$R/sanitizer_fp8.txt" 2>&1 <<'PY'
import jax, jax.numpy as jnp
from pallas_kernels.fp8_gemm import fp8_matmul
M, N, K = 32, 1536, 7168
x, w = jnp.ones((M, K), jnp.bfloat16), jnp.ones((N, K), jnp.float8_e4m3fn)
s = jnp.ones((N // 128, K // 128), jnp.float32)
print("sum", float(jax.block_until_ready(fp8_matmul(x, w, s, impl="kernel")).astype(jnp.float32).sum()))
PY
         grep -n -B2 -A12 "Invalid\|misaligned\|ERROR SUMMARY" "$R/sanitizer_fp8.txt" | head -60 | tee -a "$LOG"
         gpu_tests 170 tests/test_flash_attention.py tests/test_attention.py tests/test_engine.py -k "prefill or cached"
         stage "probe_flash_prefill"
         timeout 110 $PY scripts/lab/probe_flash_prefill.py --out "$R/flash_prefill" --time-budget 80 2>&1 | tail -30 \
           | tee -a "$LOG"
         bench e2e 200 --cells "v2-lite:1x8192,8x8192" --new-tokens 16 --no-hf ;;
  session12a) stage "fp8_gemm GPU tests (reference behind an optimization barrier) and probe"
         gpu_tests 90 tests/test_fp8_gemm.py
         timeout 130 $PY scripts/lab/probe_fp8_gemm.py --out "$R/fp8_gemm.json" --budget-s 100 2>&1 | tail -40 \
           | tee -a "$LOG"
         bench e2e "${E2E_LIMIT:-320}" --cells "v2-lite:1x8192,8x8192" --new-tokens 16 --hf-reserve 150 ;;
  session12b) gpu_tests 150 tests/test_engine.py tests/test_serve.py -k "gpu_kernels_match_reference or gpu_quantized or gpu_flash"
         for v in mixed alt; do
           stage "mla-bench serve ($v steps, one decode step a call)"
           timeout "${SERVE_LIMIT:-200}" $PY -m benchmarks serve --out "$R/serve_${v}_ds1" --rates "${RATES:-2,8}" \
             --requests "${REQUESTS:-24}" --decode-steps 1 --check 8 $([ $v = alt ] && echo --no-mixed) 2>&1 \
             | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -12 | tee -a "$LOG"
         done
         stage "soak: 10 000 engine steps, V2-Lite widths cut to 4 layers, bf16, kernels"
         timeout "${SOAK_LIMIT:-200}" $PY -m benchmarks serve --out "$R/soak" --layers 4 --rates 8 --requests 24 \
           --decode-steps 1 --check 16 --soak-steps 10000 --soak-arrivals 0.15 2>&1 | tr '\r' '\n' \
           | grep -v "it/s\]\|s/it\]" | tail -8 | tee -a "$LOG" ;;
  session12c) stage "soak: 10 000 engine steps, V2-Lite widths cut to 4 layers, fp32 (tokens comparable alone)"
         timeout "${SOAK_LIMIT:-230}" $PY -m benchmarks serve --out "$R/soak" --layers 4 --dtype fp32 --kv-dtype fp32 \
           --rates 8 --requests 12 --decode-steps 1 --check 4 --soak-check 16 --soak-steps 10000 --soak-arrivals 0.15 \
           --prompt-max 2048 --output-max 256 2>&1 \
           | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -8 | tee -a "$LOG"
         stage "mla-bench serve (mixed steps of 256 prompt tokens, one decode step a call)"
         timeout "${SERVE_LIMIT:-200}" $PY -m benchmarks serve --out "$R/serve_mixed256_ds1" --rates "${RATES:-2,8}" \
           --requests 24 --decode-steps 1 --check 4 --prefill-budget 256 2>&1 \
           | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -12 | tee -a "$LOG" ;;
  session12d) stage "soak: 10 000 engine steps, V2-Lite widths cut to 4 layers, fp32 (tokens comparable alone)"
         timeout "${SOAK_LIMIT:-210}" $PY -m benchmarks serve --out "$R/soak" --layers 4 --dtype fp32 --kv-dtype fp32 \
           --rates 8 --requests 12 --decode-steps 1 --check 4 --soak-check 16 --soak-steps 10000 --soak-arrivals 0.15 \
           --prompt-max 2048 --output-max 256 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -8 | tee -a "$LOG"
         gpu_tests 110 tests/test_fp8_matvec.py
         stage "probe_fp8_decode_gemv (no sweep)"
         timeout 80 $PY scripts/lab/probe_fp8_decode_gemv.py --out "$R/fp8_decode_gemv.json" --budget-s 60 2>&1 \
           | tail -30 | tee -a "$LOG" ;;
  session12e) stage "soak: 10 000 engine steps, V2-Lite widths cut to 4 layers, fp32, B=8 (tokens comparable alone)"
         timeout "${SOAK_LIMIT:-200}" $PY -m benchmarks serve --out "$R/soak" --layers 4 --dtype fp32 --kv-dtype fp32 \
           --max-batch 8 --prefill-chunk 256 --prefill-budget 256 --rates 8 --requests 8 --decode-steps 1 --check 2 \
           --soak-check 16 --soak-steps 10000 --soak-arrivals 0.04 --prompt-max 2048 --output-max 256 2>&1 \
           | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -8 | tee -a "$LOG" ;;
  stacked) stage "probe_decode_variants: sliced / stacked projections"
           timeout "${VARIANTS_LIMIT:-280}" $PY scripts/lab/probe_decode_variants.py --out "$R/variants" \
             --batches "${BATCHES:-1,32,128}" --variants "${VARIANTS:-sliced,base}" --no-kernels 2>&1 \
             | grep -v "it/s\]" | tee -a "$LOG"
           stage "fp8_gemm GPU tests and probe"
           gpu_tests 60 tests/test_fp8_gemm.py
           timeout 120 $PY scripts/lab/probe_fp8_gemm.py --out "$R/fp8_gemm.json" --budget-s 90 2>&1 | tail -40 \
             | tee -a "$LOG" ;;
  fp8w) stage "probe_fp8_decode_gemv"
        timeout 280 $PY scripts/lab/probe_fp8_decode_gemv.py --out "$R/fp8_decode_gemv.json" --sweep --budget-s 220 \
          2>&1 | tee -a "$LOG" ;;
  fp8e2e) bench e2e "${E2E_LIMIT:-540}" --model v3-cut --batch "${BATCHES:-1,32}" --prompt 1024 --new-tokens 64 \
            --no-hf --weights "${WEIGHTS:-fp8}" ${E2E_EXTRA:-} ;;
  session13a) gpu_tests 150 tests/test_moe_decode.py tests/test_fp8_matvec.py -k "fp8 or offset"
         bench e2e "${E2E_LIMIT:-330}" --model v3-cut --batch "${BATCHES:-1,32}" --prompt 1024 --new-tokens 64 \
           --no-hf --weights fp8 --out "$R/v3cut_fp8" ;;
  session14) gpu_tests 150 tests/test_fp8_matvec.py -k "gate_up or down or shared or stack or cached"
         stage "ncu: fp8_matvec (default, then block_n=128) beside bf16 stacked_matmul, wo at M = 1"
         for bn in 64 128; do
           timeout 150 ncu --profile-from-start off --set full --csv --page details \
             $PY scripts/lab/ncu_fp8_matvec.py --shape wo --block-n $bn > "$R/ncu_wo_bn$bn.csv" 2> "$R/ncu_wo_bn$bn.err"
           grep -E "Kernel Name|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Duration" \
             "$R/ncu_wo_bn$bn.csv" | head -40 | tee -a "$LOG"
         done
         stage "probe_fp8_decode_gemv --sweep (M = 1, no experts)"
         timeout 200 $PY scripts/lab/probe_fp8_decode_gemv.py --out "$R/fp8_decode_gemv.json" --sweep --rows 1 \
           --no-experts --budget-s 170 2>&1 | tail -60 | tee -a "$LOG" ;;
  session15) gpu_tests 150 tests/test_moe_decode.py -k fp8
         stage "probe_fp8_decode_gemv: wo and the experts, M / tokens 1 and 32"
         timeout 150 $PY scripts/lab/probe_fp8_decode_gemv.py --out "$R/fp8_decode_gemv.json" --rows 1,32 --shapes wo \
           --tokens 1,32 --budget-s 120 2>&1 | tail -40 | tee -a "$LOG"
         for w in fp8 bf16; do
           bench e2e "${E2E_LIMIT:-170}" --model v3-cut --batch 1,32 --prompt 1024 --new-tokens 64 --no-hf --weights $w \
             --out "$R/v3cut_$w"
         done
         stage "e2e fp8, moe_decode_fp8's products in f16 (scripts/lab/run_with_moe_config.py)"
         MOE_CONFIG=fp8_f16=1 timeout "${E2E_LIMIT:-170}" $PY scripts/lab/run_with_moe_config.py e2e --model v3-cut --batch 1,32 --prompt 1024 \
           --new-tokens 64 --no-hf --weights fp8 --out "$R/v3cut_fp8_moef16" 2>&1 | tr '\r' '\n' \
           | grep -v "it/s\]\|s/it\]" | tee -a "$LOG" ;;
  session15b) stage "probe_fp8_decode_gemv: moe_decode_fp8's configs (64 experts, top-8, V3 widths), tokens 1 and 32"
         timeout 240 $PY scripts/lab/probe_fp8_decode_gemv.py --out "$R/moe_sweep.json" --rows 1 --shapes wo \
           --tokens 1,32 --experts 64 --moe-sweep --budget-s 200 2>&1 | tail -30 | tee -a "$LOG"
         stage "e2e fp8 with the fastest of them (scripts/lab/run_with_moe_config.py)"
         MOE_CONFIG="best:$R/moe_sweep.json" timeout "${E2E_LIMIT:-200}" $PY scripts/lab/run_with_moe_config.py e2e \
           --model v3-cut --batch 1,32 --prompt 1024 --new-tokens 64 --no-hf --weights fp8 --out "$R/v3cut_fp8_best" \
           2>&1 | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tee -a "$LOG" ;;
  ncu128) ncu_stage ;;
  prefill_e2e) bench e2e "${E2E_LIMIT:-280}" --cells "v2-lite:1x8192,8x8192" --new-tokens 16 --no-hf
         bench e2e "${E2E_LIMIT:-280}" --cells "v2-lite:1x8192,8x8192" --new-tokens 16 --no-hf --prefill-chunk 512 \
           --out "$R/chunk512" ;;
  fp8rows) fp8_ptxas_report
       stage "probe_fp8_decode (conversion in row runs)"
       timeout 260 $PY scripts/lab/probe_fp8_decode.py --out "$R/fp8" 2>&1 | tee -a "$LOG"
       stage "profile_fp8_decode"
       timeout 120 $PY scripts/lab/profile_fp8_decode.py --out "$R/profile" 2>&1 | tee -a "$LOG"
       if [ -n "${FP8_BEFORE:-}" ]; then  # the same probe on the body as it was (a copy of the module), cells $ONLY
         cp pallas_kernels/mla_decode/fp8.py "$OUT/fp8_now.py"; cp "$FP8_BEFORE" pallas_kernels/mla_decode/fp8.py
         stage "probe_fp8_decode (before: $FP8_BEFORE)"
         timeout 160 $PY scripts/lab/probe_fp8_decode.py --out "$R/fp8_before" --only "${ONLY:-0,1,4,7}" 2>&1 | tee -a "$LOG"
         cp "$OUT/fp8_now.py" pallas_kernels/mla_decode/fp8.py; rm "$OUT/fp8_now.py"
       fi
       [ -n "${FP8_TESTS:-}" ] && gpu_tests 150 tests/test_mla_decode_fp8.py ;;
  session17) stage "probe_fp8_decode, cells ${ONLY:-0,1,7} (now, then $FP8_BEFORE)"
       timeout 90 $PY scripts/lab/probe_fp8_decode.py --out "$R/fp8" --only "${ONLY:-0,1,7}" 2>&1 | tee -a "$LOG"
       cp pallas_kernels/mla_decode/fp8.py "$OUT/fp8_now.py"; cp "$FP8_BEFORE" pallas_kernels/mla_decode/fp8.py
       timeout 90 $PY scripts/lab/probe_fp8_decode.py --out "$R/fp8_before" --only "${ONLY:-0,1,7}" 2>&1 | tee -a "$LOG"
       cp "$OUT/fp8_now.py" pallas_kernels/mla_decode/fp8.py; rm "$OUT/fp8_now.py"
       E2E_LIMIT=150 GATHER=1 kvpages_stage ;;
  kvpages) kvpages_stage ;;
  session18b) ( cd .peers/flashmla && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 NVCC_THREADS=4 \
             $PY setup.py build_ext --inplace > "$R/flashmla_prebuild_log.txt" 2>&1 ) &
       BUILD=$!
       gpu_tests 150 tests/test_mla_decode_fp8.py  # every fp8 GPU test: the split combine and the pieces one
       gpu_tests 100 tests/test_mla_decode.py -k "gpu_pieces and scorer"
       stage "waiting for the FlashMLA build"; wait $BUILD; tail -3 "$R/flashmla_prebuild_log.txt" | tee -a "$LOG"
       XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode "${BENCH_LIMIT:-200}" --peers .peers \
         --no-decompressed --variants "${VARIANTS:-pieces,auto}" --cell-list "${CELLS:-8,1,4096,128}"
       XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode "${FP8_LIMIT:-120}" --kv-dtype fp8 \
         --no-decompressed --variants "${VARIANTS:-pieces,auto}" --cell-list "${FP8_CELLS:-128,1,256-16384,16}" \
         --out "$R/fp8" ;;
  session19a) gpu_tests 130 tests/test_mla_decode_fp8.py  # the combine over transposed partials, on the GPU
       XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode "${FP8_LIMIT:-110}" --kv-dtype fp8 \
         --no-decompressed --variants "${VARIANTS:-pieces,auto}" --cell-list "${FP8_CELLS:-128,1,256-16384,16}" \
         --out "$R/fp8"
       ncu_stage ;;
  session19b) ( cd .peers/flashmla && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 NVCC_THREADS=4 \
             $PY setup.py build_ext --inplace > "$R/flashmla_prebuild_log.txt" 2>&1 ) &
       BUILD=$!
       gpu_tests 150 tests/test_mla_decode.py -k "scorer_matches or (pieces and scorer) or large_batch"
       gpu_tests 80 tests/test_mla_decode_fp8.py -k "kernel_matches and (128 or 64-4)"
       stage "waiting for the FlashMLA build"; wait $BUILD; tail -3 "$R/flashmla_prebuild_log.txt" | tee -a "$LOG"
       XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode "${BENCH_LIMIT:-220}" --peers .peers \
         --no-decompressed --variants "${VARIANTS:-auto}" --cell-list "${CELLS:-128,1,4096,128}"
       ncu_stage ;;
  session19c) for kv in bf16 fp8; do  # the kernel on both page formats, the same cells, then e2e on both
         XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode "${FP8_LIMIT:-70}" --kv-dtype $kv \
           --no-decompressed --cell-list "${FP8_CELLS:-128,1,4096,128}" --out "$R/kernel_$kv"
       done
       kvpages_stage ;;
  fp8scorer) gpu_tests 150 tests/test_mla_decode_fp8.py -k "fp8_scorer"
       fp8_ptxas_report
       for kv in bf16 fp8; do  # the same cells on both page formats, one process each, the fp8 scorer beside
         XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode "${FP8_LIMIT:-110}" --kv-dtype $kv \
           --no-decompressed --variants "${VARIANTS:-fp8_scorer}" \
           --cell-list "${FP8_CELLS:-128,1,4096,128;128,1,8192,64;128,2,8192,128;128,1,256-16384,64}" \
           --out "$R/kernel_$kv"
       done ;;
  session20a) ptxas_report  # the nineteenth session's CPU-built bodies: registers and spills first, then their tests
       fp8_ptxas_report
       gpu_tests 200 tests/test_mla_decode.py -k "${TESTS_K:-three_warpgroup or out_through_smem}"
       gpu_tests 90 tests/test_mla_decode_fp8.py -k "fp8_scorer" ;;
  session20b) ( cd .peers/flashmla && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 NVCC_THREADS=4 \
             $PY setup.py build_ext --inplace > "$R/flashmla_prebuild_log.txt" 2>&1 ) &
       BUILD=$!
       XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode "${FP8_LIMIT:-100}" --kv-dtype fp8 \
         --no-decompressed --variants "${FP8_VARIANTS:-fp8_scorer}" \
         --cell-list "${FP8_CELLS:-128,1,4096,128;128,1,8192,64;128,2,8192,128;128,1,256-16384,64}" --out "$R/fp8"
       stage "waiting for the FlashMLA build"; wait $BUILD; tail -3 "$R/flashmla_prebuild_log.txt" | tee -a "$LOG"
       XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode "${BENCH_LIMIT:-330}" --peers .peers \
         --no-decompressed --variants "${VARIANTS:-scorer3,out_smem,auto,auto_scorer3}" --cell-list "${CELLS:-\
128,1,4096,128;256,1,2048,128;128,1,256-16384,128;64,2,256-8192,128;128,2,8192,128;4,4,16384,128;8,1,4096,128;\
128,1,8192,64;128,1,256-16384,64;32,1,1-32768,64;128,1,4096,64}" ;;
  session18) ( cd .peers/flashmla && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 NVCC_THREADS=4 \
             $PY setup.py build_ext --inplace > "$R/flashmla_prebuild_log.txt" 2>&1 ) &
       BUILD=$!
       gpu_tests 120 tests/test_engine.py -k "gpu_balanced_schedule and (pieces or auto)"
       stage "waiting for the FlashMLA build"; wait $BUILD; tail -3 "$R/flashmla_prebuild_log.txt" | tee -a "$LOG"
       XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode "${BENCH_LIMIT:-330}" --peers .peers \
         --no-decompressed --variants "${VARIANTS:-pieces,auto}" --cell-list "${CELLS:-128,1,16384,64}"
       for dc in "" auto; do  # the engine's decode on a ragged batch: the kernel's default, then "auto" (pieces)
         bench e2e "${E2E_LIMIT:-150}" --model v2-lite --batch "${E2E_BATCH:-64}" --prompt "${E2E_PROMPT:-4096}" \
           --ragged --new-tokens "${NEW_TOKENS:-32}" --no-hf ${dc:+--decode-config $dc} --out "$R/e2e_ragged_${dc:-default}"
       done ;;
  profile8) stage "profile_fp8_decode"
       timeout 300 $PY scripts/lab/profile_fp8_decode.py --out "$R/profile" ${CELLS:+--cells $CELLS} ${CONFIGS:+--configs $CONFIGS} 2>&1 | tee -a "$LOG" ;;
  fp8) stage "probe_fp8_decode"
       timeout 300 $PY scripts/lab/probe_fp8_decode.py --out "$R/fp8" 2>&1 | tee -a "$LOG" ;;
  peers|scorer|session16) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode "${BENCH_LIMIT:-330}" --peers .peers --no-decompressed \
           --variants "${VARIANTS:-balanced}" --cell-list "${CELLS:-128,1,8192,16;128,1,8192,32;128,1,8192,64;128,1,32768,64;\
128,1,4096,128;128,1,8192,128;128,2,8192,128;64,1,8192,128;32,2,4096,128;128,1,256-16384,64;1,1,4096,128;8,1,4096,128}" ;;
  train) for a in mgpu cudnn; do
           bench train 120 --batch 16 --seq 4096 --ce-chunk 2048 --remat dots_with_no_batch_dims_saveable --attn-impl $a
         done
         stage "loss_curve_equality (50 steps)"
         timeout 220 $PY scripts/lab/loss_curve_equality.py --out "$R/curve" --paths reference,xla_ragged,ours,fast \
           2>&1 | tee -a "$LOG" ;;
  pending) bench paged_gather 60 --quick --kv-dtype fp4
         bench paged_gather 60 --quick --kv-dtype fp8
         stage "probe_flash_attention --sweep"
         timeout 200 $PY scripts/lab/probe_flash_attention.py --out "$R/flash" --sweep 2>&1 | tee -a "$LOG" ;;
  variants) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
         bench mla_decode 300 --only-flashmla --quick --no-decompressed \
           --variants "${VARIANTS:-plain,split_qk}" ;;
  fairxla) bench mla_decode 330 --only-flashmla --quick --no-decompressed ;;
  sweep) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" bench mla_decode 320 --quick --sweep --then-grid
         ptxas_report ;;
esac

stage "pack"
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
ls -la "$OUT" | tee -a "$LOG"
