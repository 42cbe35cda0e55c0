"""FP8 routed experts off the decode kernel (`models.fp8_experts`): dequantized a chunk of columns at a time.

The V3 cut (5 layers, 256 experts) with FP8 weights ran out of memory on an 80 GB H100 in every prefill: each
call dequantized a whole layer's experts to bf16 (22.5 GB), and XLA hoisted that out of the layers' scan into
the whole stack's (42 GiB). Here: the chunked grouped GEMM equals the reference recipe (dequantize, then matmul)
on tiny shapes, and the compiled steps of an FP8 model hold no float array the size of one projection of one
layer's experts (XLA:CPU programs, shapes only: the model is never built).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import ModelConfig, fp8_weights
from mla_jax.kv_cache import KVCache
from models import DeepSeekModel, fp8_experts, moe_dense_reference, moe_grouped
from models.serving.engine import Engine
from models.serving.sampling import SamplingArrays, SamplingParams
from models.serving.steps import StepInputs
from tests import hlo
from tests.xla_opt import optimized


def test_chunk_columns_is_the_widest_divisor_within_the_budget():
    """V3's chunks (bf16, E 256, D 7168, I 2048): gate + up 128 columns, down 1 024 (exactly 1 GiB); a width that
    is not a multiple of 128 takes any divisor; one over the budget keeps 128 columns (or 1). Catches a chunk that
    does not divide the width (the loop would skip or overrun columns) and a budget read in elements."""
    assert fp8_experts.chunk_columns(2048, 2 * 256 * 7168 * 2) == 128
    assert fp8_experts.chunk_columns(7168, 256 * 2048 * 2) == 1024
    assert fp8_experts.chunk_columns(7168, 256 * 2048 * 2, budget=(1 << 30) - 1) == 896  # 7 blocks
    assert fp8_experts.chunk_columns(80, 100, budget=1600) == 16
    assert fp8_experts.chunk_columns(256, 10**9, budget=1) == 128
    assert fp8_experts.chunk_columns(80, 10**9, budget=1) == 1


def _blocks(L, E, D, I, seed=0):
    """FP8 experts of L layers, stacked and flattened [L·E, ...] as the scan passes them (`Fp8Experts.blocks()`):
    each weight row scaled by its own power of two before quantization, so that every 128x128 block gets its own
    scale and a scale read from another block (row or column) changes the result."""
    rng = np.random.default_rng(seed)
    out = []
    for n, k in ((I, D), (I, D), (D, I)):
        w = rng.standard_normal((L * E, n, k)) * np.exp2(rng.integers(-4, 5, (L * E, n, 1)))
        out.append(fp8_weights.quantize_blocks(jnp.asarray(w, jnp.float32)))
    return tuple(q for q, _ in out) + tuple(s for _, s in out)


@pytest.mark.parametrize(
    "D, I, budget",
    [(384, 256, 1), (96, 80, 2 * 4 * 96 * 4 * 16)],  # 128-column chunks (2 x 3); chunks of 16 and 32 columns
)
def test_fp8_grouped_equals_dequantize_then_matmul(monkeypatch, D, I, budget):
    """`moe_grouped` with FP8 experts on "ragged_dot" (several chunks a projection, layer 1 of a 2-layer stack read
    at a traced offset, ragged groups, an expert with no rows, an assignment to an id >= E that must add nothing)
    equals `moe_dense_reference` on the layer's dequantized weights, and the whole-layer path it replaces
    (dequantize every expert, then the grouped GEMM) to rounding. Catches a chunk written at the wrong columns, a
    scale row of another block, the wrong layer's experts, a row of another expert's group."""
    monkeypatch.setattr(fp8_experts, "DEQUANT_BYTES", budget)
    L, E, T, K = 2, 4, 9, 2
    blocks = _blocks(L, E, D, I)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    idx = np.array([[0, 1], [1, 3], [3, 0], [1, 0], [3, 1], [0, 3], [1, 3], [0, 1], [1, E]], np.int32)  # no expert 2
    w = jnp.asarray(rng.uniform(0.5, 1.5, (T, K)), jnp.float32)

    @jax.jit
    def got(x, w, idx, layer, *blocks):
        kw = dict(impl="ragged_dot", num_experts=E, expert_offset=layer * E, scales=blocks[3:])
        return moe_grouped(x, w, idx, *blocks[:3], **kw)

    y = got(x, w, jnp.asarray(idx), jnp.int32(1), *blocks)
    layer = tuple(b[E:] for b in blocks)
    dense = tuple(fp8_weights.dequantize_blocks(q, s).swapaxes(1, 2) for q, s in zip(layer[:3], layer[3:]))
    keep = idx < E  # the id E adds nothing: drop it from the reference
    want = moe_dense_reference(x, jnp.where(keep, w, 0.0), jnp.asarray(np.where(keep, idx, 0)), *dense)
    chex.assert_trees_all_close(y, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    whole = moe_grouped(x, w, jnp.asarray(idx), *dense, impl="ragged_dot", num_experts=E)
    chex.assert_trees_all_close(y, whole, rtol=1e-6, atol=1e-6 * float(jnp.abs(whole).max()))


@pytest.mark.gpu
def test_gpu_fp8_grouped_on_mgpu_equals_dequantize_then_matmul(monkeypatch):
    """The same through the Mosaic GPU grouped GEMM (`ragged_dot_mgpu`) in bf16, 128-column chunks, against the
    reference in fp32."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    monkeypatch.setattr(fp8_experts, "DEQUANT_BYTES", 1)
    L, E, D, I, T, K = 2, 8, 512, 384, 200, 2
    blocks = _blocks(L, E, D, I)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.choice([0, 1, 3, 4, 5, 7], (T, K)), jnp.int32)  # experts 2 and 6 get no row
    w = jnp.asarray(rng.uniform(0.5, 1.5, (T, K)), jnp.float32)
    kw = dict(impl="mgpu", num_experts=E, expert_offset=jnp.int32(E), scales=blocks[3:])
    y = jax.jit(lambda x, *b: moe_grouped(x, w, idx, *b[:3], **kw))(x, *blocks)
    dense = tuple(fp8_weights.dequantize_blocks(q[E:], s[E:]).swapaxes(1, 2) for q, s in zip(blocks[:3], blocks[3:]))
    want = np.asarray(moe_dense_reference(x.astype(jnp.float32), w, idx, *dense))
    got = np.asarray(y, np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


def test_fp8_experts_the_decode_kernel_cannot_index_take_the_chunked_gemm(monkeypatch):
    """On a Hopper GPU a decode-sized call over V3's experts takes `moe_decode_fp8` where it can index the stack
    it reads (2 layers, 7.5e9 bytes: 64-bit offsets; 128 experts), and the chunked grouped GEMM ("mgpu") for one
    layer of 256 (3.76e9 bytes, 32-bit offsets that wrap: the MTP layer's), where the kernel's "auto" took its
    reference, which dequantizes the whole layer (22.5 GB). The MoE module names its own stack."""
    from models.experts import resolve_moe_impl
    from models.moe import MoE

    monkeypatch.setattr("pallas_kernels.backend.on_hopper", lambda: True)
    kw = dict(rows=32 * 8, num_experts=256, widths=(7168, 2048), fp8=True)
    assert resolve_moe_impl("auto", jnp.bfloat16, **kw, stack_experts=2 * 256) == "decode"
    assert resolve_moe_impl("auto", jnp.bfloat16, **kw, stack_experts=128) == "decode"
    assert resolve_moe_impl("auto", jnp.bfloat16, **kw, stack_experts=256) == "mgpu"
    v3 = ModelConfig.deepseek_v3()
    moe = nnx.eval_shape(lambda: MoE(v3, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, weights="fp8"))
    assert moe.resolved_impl(32) == "mgpu"


# ------------------------------------------------------------------------------------------
# The compiled steps of an FP8 model: no dequantized layer of experts, no whole stack
# ------------------------------------------------------------------------------------------
# Wide enough that one projection of one layer's experts (16 x 2048 x 2048, 134 MB in bf16) stands out from every
# other array of the steps; 2 scanned MoE layers and the MTP layer's MoE. Never built: shapes only.
WIDE = ModelConfig.tiny().replace(
    n_routed_experts=16, hidden_size=2048, moe_intermediate_size=2048, intermediate_size=256, num_hidden_layers=3
)


def _wide_engine_and_row(page_size: int, num_pages: int, T: int, P: int):
    """An engine over the FP8 `WIDE` model in bf16 (shapes only) and the inputs of one row of T tokens at positions
    0..T-1 over a table of P pages -> (engine, `StepInputs`)."""
    make = lambda: DeepSeekModel(  # noqa: E731
        WIDE, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, weights="fp8"
    )
    e = Engine(nnx.eval_shape(make), page_size=page_size, num_pages=num_pages, max_batch=1, kv_dtype=jnp.bfloat16)
    inp = StepInputs(
        np.zeros((1, T), np.int32),
        np.arange(T, dtype=np.int32)[None],
        np.arange(P, dtype=np.int32)[None],
        np.full((1,), T, np.int32),
        np.full((1,), T - 1, np.int32),
        np.zeros((1, 2), np.uint32),
        SamplingArrays.from_params([SamplingParams()]),
    )
    return e, inp


def _steps(kind: str, T: int):
    """The compiled program of an engine step of the FP8 `WIDE` model in bf16 (shapes only), one row of T tokens:
    "prefill" (the chunk, then the MTP layer over it and its one-token draft) or "decode" (one token)."""
    e, inp = _wide_engine_and_row(16, 32, T, 24)
    B = 1
    cache = KVCache.create(e.cache.pages, inp.block_table, inp.lengths)
    with optimized():  # what a real run compiles (the suite's CPU default leaves most of XLA's passes out)
        if kind == "decode":
            return e.steps.decode.lower(e.state, cache, inp, sampler="greedy").compile()
        mtp = (np.zeros((B, T), np.int32), np.ones((B,), bool), np.zeros((B, 1), np.int32))
        probs = np.zeros((B, 1, WIDE.vocab_size), np.float32)
        return e.steps.prefill.lower(e.state, cache, inp, *mtp, probs, use_mtp=True, sampler="greedy").compile()


@pytest.mark.parametrize("kind, T", [("prefill", 256), ("decode", 1)])
def test_fp8_steps_hold_no_dequantized_layer_of_experts(monkeypatch, kind, T):
    """The compiled prefill step (256 tokens: the decompressed attention; the MTP layer's MoE over the chunk and
    its decode-sized draft) and decode step ("ragged_dot" experts on a CPU: a decode-sized call on a non-decode
    impl) of the FP8 model hold no float buffer of half a projection of one layer's experts or more (E·D·I bytes),
    with chunks of 4 MB. They held the dequantized layers ([E·I, D] bf16 per projection, in the scan and in the MTP
    layer). No chunked loop may have a trip count unknown to XLA (a host round trip on a GPU). f16 arrays are left
    out: XLA:CPU moves e4m3 arrays (a slice of a stack) through f16 copies of them, which no GPU program has."""
    monkeypatch.setattr(fp8_experts, "DEQUANT_BYTES", 4 << 20)
    E, D, I = WIDE.n_routed_experts, WIDE.hidden_size, WIDE.moe_intermediate_size
    text = _steps(kind, T).as_text()
    assert hlo.buffers(text, E * D * I, dtypes=("bf16", "f32")) == []
    assert hlo.host_round_trips(text) == []


def test_fp8_prefill_on_hopper_transposes_no_expert_weights(monkeypatch):
    """The FP8 `WIDE` model's prefill step (256 tokens, bf16) on a Hopper GPU's paths ("mgpu" experts), cross-lowered
    for sm_90: no transpose of expert weights anywhere (the FP8 stacks nor their dequantized chunks). XLA:GPU moved
    the chunks' transpose onto the whole FP8 stacks before the layers' scan: 21 GiB of copies for the V3 cut
    (its prefill's temporaries 31 GiB at 32 x 512 tokens, 24 GiB at 1 x 8192; 7 and 4 GiB without, compiled for an
    H100). Catches the grouped GEMM fed transposed chunks instead of reading them as stored."""
    import re

    from pallas_kernels import fp8_gemm

    monkeypatch.setattr("pallas_kernels.backend.on_hopper", lambda: True)
    monkeypatch.setattr(fp8_gemm, "_num_sms", lambda: 132)
    e, inp = _wide_engine_and_row(64, 8, 256, 4)
    cache = KVCache.create(e.cache.pages, inp.block_table, inp.lengths, impl=e.backend, page_format=e.cache.page_format)
    traced = e.steps.prefill.trace(e.state, cache, inp, None, None, None, None, use_mtp=False, sampler="greedy")
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text  # the Hopper paths were taken
    E, D, I = WIDE.n_routed_experts, WIDE.hidden_size, WIDE.moe_intermediate_size
    transposed = re.findall(r"stablehlo\.transpose [^\n]*: \(tensor<(?:\d+x)*(\d+)x(\d+)x(\d+)x(\w+)>\)", text)
    experts = [t for t in transposed if int(t[0]) == E and {int(t[1]), int(t[2])} & {D, I}]
    assert experts == [], experts
