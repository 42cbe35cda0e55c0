"""Dump the Mosaic GPU modules our kernels lower to (sm_90, cross-lowered on any host), without debug info.

A refactor that moves kernel code (a file split, a formatter) must leave these modules byte-identical:
`python scripts/lowered_modules.py OUT_DIR` before and after, then `diff -r` the two folders.
Each kernel call of a case is one file `<case>.<n>.mlir` (locations stripped, so line moves do not show).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.mosaic.gpu import core as mgpu_core  # noqa: E402

from pallas_kernels import (  # noqa: E402
    FP4_PAGES,
    FP8_PAGES,
    MlaDecodeConfig,
    flash_attention,
    flash_attention_prefill,
    mla_decode,
    paged_gather,
)

CAPTURED: list[str] = []
_serde = mgpu_core._run_serde_pass


def _capture(module, **kw):
    CAPTURED.append(module.operation.get_asm(enable_debug_info=False))
    return _serde(module, **kw)


mgpu_core._run_serde_pass = _capture


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def lower(fn, *shapes):
    jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))


def decode_case(B, s_q, H, P, fmt="bf16", config=None, causal=True):
    W = {"bf16": 576, "fp8": 656}[fmt]
    dt = jnp.bfloat16 if fmt == "bf16" else jnp.uint8

    def fn(q, kv, bt, sl):
        return mla_decode(q, kv, bt, sl, softmax_scale=0.1, causal=causal, config=config, impl="kernel")

    lower(
        fn, sds((B, s_q, H, 576), jnp.bfloat16), sds((B * P, 64, W), dt), sds((B, P), jnp.int32), sds((B,), jnp.int32)
    )


def gather_case(B, P, fmt):
    W, dt = {"bf16": (576, jnp.bfloat16), "fp8": (656, jnp.uint8), "fp4": (416, jnp.uint8)}[fmt]
    pf = {"fp8": FP8_PAGES, "fp4": FP4_PAGES}.get(fmt)
    kw = {} if pf is None else {"page_format": pf}

    def fn(kv, bt):
        return paged_gather(kv, bt, num_tokens=P * 64 - 5, impl="kernel", **kw)

    lower(fn, sds((B * P, 64, W), dt), sds((B, P), jnp.int32))


CASES = {
    "decode_h16_sq1": lambda: decode_case(8, 1, 16, 130),
    "decode_h64_sq2": lambda: decode_case(1, 2, 64, 1024, causal=False),
    "decode_h128_sq1": lambda: decode_case(256, 1, 128, 32),
    "decode_h128_sq4": lambda: decode_case(8, 4, 128, 130),
    "decode_plain": lambda: decode_case(8, 1, 64, 130, config=MlaDecodeConfig(scorer=False, split_qk=False)),
    "decode_splitqk": lambda: decode_case(8, 1, 64, 130, config=MlaDecodeConfig(scorer=False, split_qk=True)),
    "decode_pieces": lambda: decode_case(8, 2, 64, 130, config=MlaDecodeConfig(schedule="pieces")),
    "decode_fp8_t": lambda: decode_case(8, 1, 16, 130, fmt="fp8"),
    "decode_fp8_padded": lambda: decode_case(8, 1, 64, 130, fmt="fp8"),
    "decode_fp8_pieces": lambda: decode_case(8, 1, 64, 130, fmt="fp8", config=MlaDecodeConfig(schedule="pieces")),
    "gather_bf16": lambda: gather_case(8, 33, "bf16"),
    "gather_fp8": lambda: gather_case(8, 33, "fp8"),
    "gather_fp4": lambda: gather_case(8, 33, "fp4"),
    "flash_fwd_bwd": lambda: lower(
        lambda q, k, v: jax.grad(
            lambda q: flash_attention(q, k, v, softmax_scale=0.1, causal=True, impl="kernel").astype(jnp.float32).sum()
        )(q),
        *(sds((1, 256, 2, 192), jnp.bfloat16),) * 2,
        sds((1, 256, 2, 128), jnp.bfloat16),
    ),
    "flash_prefill": lambda: lower(
        lambda q, k, v, off, lens: flash_attention_prefill(q, k, v, off, lens, softmax_scale=0.1, impl="kernel"),
        sds((2, 256, 2, 192), jnp.bfloat16),
        *(sds((2, 768, 2, w), jnp.bfloat16) for w in (192, 128)),
        *(sds((2,), jnp.int32),) * 2,
    ),
}


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for name, case in CASES.items():
        CAPTURED.clear()
        try:
            case()
        except Exception as e:  # a case this version cannot lower is recorded, not fatal
            with open(os.path.join(out_dir, f"{name}.error"), "w") as f:
                f.write(f"{type(e).__name__}: {e}\n")
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        for i, text in enumerate(CAPTURED):
            with open(os.path.join(out_dir, f"{name}.{i}.mlir"), "w") as f:
                f.write(text)
        print(f"{name}: {len(CAPTURED)} module(s)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lowered")
