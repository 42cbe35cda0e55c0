#!/usr/bin/env bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date -u
echo "=== serve cold, parallel warm-up"
timeout 200 python3 -m benchmarks serve --rates 4 --requests 16 --check 0 --out $OUT/serve_par --compile-cache off 2>&1 | grep -E "warm-up|rate 4|^# serve" | tail -4
date -u
echo "=== e2e v3-cut MTP oracle 0.8"
timeout 300 python3 -m benchmarks e2e --cells "v3-cut:1x1024,32x1024" --mtp both --mtp-oracle 0.8 --new-tokens 128 --no-hf --decode-steps 1 --compile-cache /tmp/cc --out $OUT/e2e_v3_mtp 2>&1 | tail -8
date -u
