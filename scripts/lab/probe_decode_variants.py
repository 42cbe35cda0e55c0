"""Decode-step variants of V2-Lite on the GPU, side by side in one process (issue 28): the engine as it is, then
with the batch-1 projections' rows padded to 2 (so XLA's matrix-vector strength reduction, a weight-sized
multiply fusion plus a reduce, cannot apply), with XLA's dynamic-slice fusion (GEMMs read a scanned layer's
weights in place instead of copying them), and both. Per variant and batch: decode ms/step from a warm 128-token
generation, and the per-step kernel table of `mla-bench e2e --kernels`. "sliced" is the step before
`pallas_kernels.stacked_matmul` (every projection sliced out of its stack by the scan, as XLA computes it);
the other variants keep the stacked projections (the engine as it is).

    PYTHONPATH=. python scripts/lab/probe_decode_variants.py --out $OUT/variants [--batches 1,32]
"""

import argparse
import contextlib
import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import benchmarks as bm
from benchmarks.bench_e2e import build_model, decode_floor_bytes, kernel_profile, kv_pages, make_prompts, model_config
from mla_jax import attention
from mla_jax.kv_cache import KVCache
from models import Engine, SamplingParams, deepseek, steps
from models.sampling import SamplingArrays
from models.steps import StepInputs

DSF = {"xla_gpu_enable_dynamic_slice_fusion": True}
# cuBLAS GEMMs instead of Triton gemm fusions: dynamic-slice fusion reads a scanned layer's weights in place
# only for cuBLAS calls (the Triton fusions took a copy of each layer's weights, an async dynamic-slice)
CUBLAS_DSF = {"xla_gpu_enable_triton_gemm": False, **DSF}
NO_KERNELS = False


def _pad_rows(call, x, *args, rows=2, **kw):
    """call(x padded to `rows` rows along the flattened leading dims) sliced back."""
    lead = x.shape[:-1]
    n = int(np.prod(lead))
    if n >= rows:
        return call(x, *args, **kw)
    flat = jnp.pad(x.reshape(n, x.shape[-1]), ((0, rows - n), (0, 0)))
    return call(flat, *args, **kw)[:n].reshape(lead + (-1,))


@contextlib.contextmanager
def padded_projections():
    """nnx.Linear and the absorbed query / output einsums see at least 2 rows."""
    lin, absorb, out = nnx.Linear.__call__, attention.MLA.absorb_query, attention.MLA.output_from_latent

    def linear(self, x):
        return _pad_rows(lambda x: lin(self, x), x)

    def absorb_query(self, q_nope, q_pe):  # [B,T,H,N]: pad T
        if q_nope.shape[0] * q_nope.shape[1] >= 2:
            return absorb(self, q_nope, q_pe)
        pad = ((0, 0), (0, 1), (0, 0), (0, 0))
        return absorb(self, jnp.pad(q_nope, pad), jnp.pad(q_pe, pad))[:, :1]

    def output_from_latent(self, o):  # [B,T,H,L]
        if o.shape[0] * o.shape[1] >= 2:
            return out(self, o)
        return out(self, jnp.pad(o, ((0, 0), (0, 1), (0, 0), (0, 0))))[:, :1]

    nnx.Linear.__call__, attention.MLA.absorb_query, attention.MLA.output_from_latent = (
        linear,
        absorb_query,
        output_from_latent,
    )
    try:
        yield
    finally:
        nnx.Linear.__call__, attention.MLA.absorb_query, attention.MLA.output_from_latent = lin, absorb, out


def dump_hlo(e, batch: int, prompt: int, path: str) -> None:
    """The optimized HLO of the engine's 8-step decode program at this batch and prompt, gzipped."""
    P = e.cache.max_pages_per_seq
    inp = StepInputs(
        np.zeros((batch, 1), np.int32),
        np.full((batch, 1), prompt, np.int32),
        np.zeros((batch, P), np.int32),
        np.full((batch,), prompt + 1, np.int32),
        np.zeros((batch,), np.int32),
        np.zeros((batch, 2), np.uint32),
        SamplingArrays.from_params([SamplingParams(temperature=0.0)] * batch),
    )
    cache = KVCache.create(e.cache.pages, inp.block_table, inp.lengths, impl=e.backend, page_format=e.cache.page_format)
    steps_B, stops = np.full((batch,), 8, np.int32), np.full((batch, 1), -1, np.int32)
    lowered = e.steps.decode_loop.lower(e.state, cache, inp, steps_B, stops, sampler="greedy", num_steps=8)
    with gzip.open(path, "wt") as f:
        f.write(lowered.compile().as_text())


@contextlib.contextmanager
def sliced_projections():
    """The scan slices every projection (no `stacked_matmul`): the decode step before it."""
    keep = deepseek.stacked_impl
    deepseek.stacked_impl = lambda *a: None
    try:
        yield
    finally:
        deepseek.stacked_impl = keep


def run(model, cfg, batch, name, options, pad, out_dir, new_tokens=128, prompt=1024, hlo=False, sliced=False):
    steps.GPU_COMPILER_OPTIONS.clear()
    steps.GPU_COMPILER_OPTIONS.update(options)
    steps.compiled_steps.cache_clear()
    prompts = make_prompts(cfg.vocab_size, batch, prompt)
    kw = dict(max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0.0))
    with (
        padded_projections() if pad else contextlib.nullcontext(),
        sliced_projections() if sliced else contextlib.nullcontext(),
    ):
        e = Engine(model, page_size=64, num_pages=kv_pages(cfg, batch, prompt, new_tokens), max_batch=batch)
        cold = e.generate(prompts, **kw)
        warm = e.generate(prompts, **kw)
        st = warm.stats
        row = dict(variant=name, B=batch, decode_ms_step=1e3 * st["decode_s"] / st["decode_steps"])
        row["same_tokens"] = warm.tokens == cold.tokens
        if jax.default_backend() == "gpu" and not NO_KERNELS:
            row.update(kernel_profile(e, prompts, kw, out_dir, f"{name}_B{batch}"))
        row["floor_ms"] = decode_floor_bytes(cfg, batch, prompt + new_tokens // 2) / 4.1e12 * 1e3
        row["tokens"] = warm.tokens
        if hlo:
            dump_hlo(e, batch, prompt, os.path.join(out_dir, f"decode_loop_{name}_B{batch}.hlo.txt.gz"))
    del e
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/variants")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--variants", default="base,pad,dsf,pad+dsf")
    p.add_argument("--config", default="full", help="tiny: a CPU smoke run")
    p.add_argument("--hlo", action="store_true", help="also write each variant's optimized decode program")
    p.add_argument("--no-kernels", action="store_true", help="no CUPTI tables (faster)")
    args = p.parse_args()
    global NO_KERNELS
    NO_KERNELS = args.no_kernels
    os.makedirs(args.out, exist_ok=True)
    cfg = model_config("v2-lite", config=args.config)
    prompt = 1024 if args.config == "full" else 64
    model, _ = build_model(cfg, jnp.bfloat16)
    table = {
        "base": ({}, False),
        "sliced": ({}, False),
        "pad": ({}, True),
        "dsf": (DSF, False),
        "pad+dsf": (DSF, True),
        "cublas+dsf": (CUBLAS_DSF, False),
        "pad+cublas+dsf": (CUBLAS_DSF, True),
    }
    rows, ref = [], {}
    for batch in (int(b) for b in args.batches.split(",")):
        for name in args.variants.split(","):
            options, pad = table[name]
            try:
                row = run(
                    model,
                    cfg,
                    batch,
                    name,
                    options,
                    pad,
                    args.out,
                    prompt=prompt,
                    hlo=args.hlo,
                    sliced=name == "sliced",
                )
            except Exception as e:  # noqa: BLE001 - a variant that fails is a row
                row = dict(variant=name, B=batch, error=f"{type(e).__name__}: {str(e)[:300]}")
            toks = row.pop("tokens", None)
            if toks is not None:
                ref.setdefault(batch, toks)
                row["tokens_equal_base"] = toks == ref[batch]
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "variants.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
    bm.log("done")


if __name__ == "__main__":
    main()
