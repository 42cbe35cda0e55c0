"""Run an `mla-bench` benchmark with every default `MoeDecodeConfig` (the model passes none) replaced, to time
a moe_decode_fp8 config end to end before choosing the default. The patch lives in this process only: `mla-bench
e2e` runs its cells in worker processes unless given ``--in-process`` (the fifteenth session's three runs without it
timed the default):

    MOE_CONFIG="block_k=128,block_o=128,fp8_f16=1" PYTHONPATH=. \
        python scripts/lab/run_with_moe_config.py e2e --in-process ...
    MOE_CONFIG="best:$OUT/r/fp8_decode_gemv.json" ...   # the fastest fp8 config of probe_fp8_decode_gemv's
                                                       # experts cells (summed over their token counts)
"""

import collections
import json
import os
import sys

import probe_fp8_decode_gemv as probe  # scripts/lab/, the script's own directory

from pallas_kernels import moe_decode as _  # noqa: F401  (the module object below, not the function)

md = sys.modules["pallas_kernels.moe_decode"]
Config = md.MoeDecodeConfig
NAMED = {"default": Config(), "f16": Config(fp8_f16=True), **probe.MOE_SWEEP}


def parse(spec: str):
    if spec.startswith("best:"):
        with open(spec[5:]) as f:
            rows = json.load(f)["experts"]
        total = collections.Counter()
        for r in rows:
            if r["impl"].startswith("moe_decode_fp8"):
                name = r["impl"][len("moe_decode_fp8") :].strip("[]") or "default"
                total[name] += r["us"]
        best = min(total, key=total.get)
        print(f"# MOE_CONFIG: {best} ({total[best]:.1f} us summed; default {total.get('default', 0):.1f})")
        return NAMED[best]
    kw = {}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        kw[k] = bool(int(v)) if k == "fp8_f16" else (v if k == "fp8_convert" else int(v))
    return Config(**kw)


if __name__ == "__main__":
    chosen = parse(os.environ.get("MOE_CONFIG", ""))
    print(f"# MoeDecodeConfig for every default: {chosen}", flush=True)
    md.MoeDecodeConfig = lambda *a, **k: Config(*a, **k) if a or k else chosen
    from benchmarks.__main__ import main

    sys.exit(main(sys.argv[1:]))
