"""Lab probe (GPU): a DeepSeek-V2-Lite-shaped model (random bf16 weights) through `Engine`:
compile time per bucket, warm decode ms/step and prefill tok/s, and whether the compiled decode
step copies the page pools. `--ttft` runs the cell twice in fresh processes with the persistent
compilation cache on and prints each one's time to first token.

    python scripts/lab/probe_e2e.py --batch 1 --prompt 1024 --new 64 [--layers 27] [--ttft DIR]
"""

import argparse
import json
import os
import subprocess
import sys
import time

T0 = time.perf_counter()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--ttft", metavar="CACHE_DIR", default=None)
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    if a.ttft and not a.child:
        for i in range(2):
            env = dict(os.environ, MLA_JAX_COMPILE_CACHE=a.ttft)
            t = time.perf_counter()
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    "--batch",
                    str(a.batch),
                    "--prompt",
                    str(a.prompt),
                    "--new",
                    str(a.new),
                    "--layers",
                    str(a.layers),
                    "--ttft",
                    a.ttft,
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            print(
                f"ttft run {i}: process wall {time.perf_counter() - t:.1f} s; {out.stdout.strip()[-600:]}",
                out.stderr[-2000:] if out.returncode else "",
                flush=True,
            )
        return
    from models import compile_cache

    if a.child:
        compile_cache.enable(a.ttft)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mla_jax import ModelConfig
    from models import DeepSeekModel, Engine

    cfg = ModelConfig.deepseek_v2_lite().replace(num_hidden_layers=a.layers)
    t = time.perf_counter()
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    jax.block_until_ready(nnx.state(model))
    t_init = time.perf_counter() - t
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(0, cfg.vocab_size, a.prompt)] for _ in range(a.batch)]
    e = Engine(model, page_size=64, max_batch=a.batch, max_context=a.prompt + a.new + 8)
    first = {}

    def stream(i, tok):
        first.setdefault("t", time.perf_counter())

    t = time.perf_counter()
    r1 = e.generate(prompts, max_new_tokens=a.new, stream=stream)
    cold = time.perf_counter() - t
    if a.child:
        print(
            json.dumps(
                dict(
                    init_s=round(t_init, 1),
                    ttft_from_generate=round(first["t"] - t, 2),
                    ttft_from_process=round(first["t"] - T0, 2),
                    compile_log=e.compile_log,
                )
            )
        )
        return
    t = time.perf_counter()
    r2 = e.generate(prompts, max_new_tokens=a.new)
    warm = time.perf_counter() - t
    st = r2.stats
    print(
        json.dumps(
            dict(
                B=a.batch,
                prompt=a.prompt,
                layers=a.layers,
                backend=e.backend,
                init_s=round(t_init, 1),
                cold_generate_s=round(cold, 1),
                warm_generate_s=round(warm, 2),
                compile_log=e.compile_log,
                prefill_tok_s=round(st["prefill_tok_s"]),
                decode_tok_s=round(st["decode_tok_s"], 1),
                decode_ms_step=round(1e3 * st["decode_s"] / st["decode_steps"], 2),
                ttft_warm=round(st["ttft_s"], 3),
                same_tokens=r1.tokens == r2.tokens,
            )
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
