"""End-to-end generation benchmark: a DeepSeek-V2-Lite-shaped and a DeepSeek-V3-shaped model (random bf16
weights) through the public engine, against its weight-read floor, with Hugging Face transformers as a peer.

Usage: ``python -m benchmarks e2e [--quick] [--model v2-lite,v3-cut] [--batch 1,8] [--prompt 1024] [--out DIR]``
(``--help`` for every option; ``--config tiny`` runs the whole path on a CPU in under a minute: its cells are
`tiny_cells`, from the tiny models' context, unless ``--batch`` / ``--prompt`` / ``--cells`` name others).

Models (no download; `DeepSeekModel` with its default init, std 0.02, so routing is roughly uniform):
* ``v2-lite``: `ModelConfig.deepseek_v2_lite()` (27 layers, 64 experts top-6, 15.7B parameters, 31 GB bf16).
* ``v3-cut``: `ModelConfig.deepseek_v3()` cut to ``--layers`` layers (default 5: 3 dense + 2 MoE) with its
  MTP layer; a V3 MoE layer is ~22.5 GB of experts, so 5 layers + MTP are ~76 GB.
``--weights fp8``: the projections and routed experts in FP8 as DeepSeek-V3 releases them (e4m3 + 128x128 block
scales, `mla_jax.fp8_weights`; random e4m3 values of the init's spread), the rest in ``--dtype``; the decode
floor then counts those weights at 1 byte (+ their scales). One device only (no FP8 placement on a mesh yet).

Per cell (model, batch B, prompt T; random prompt ids, ``--new-tokens`` N = 128 greedy tokens) through
``Engine(model, page_size=64, num_pages=B * ceil((T + N + draft room) / 64), max_batch=B).generate``:
* cold: the first generate of these shapes in this process = tracing + compilation + one run. Reported:
  ``cold_compile_s`` = cold wall - warm wall, the engine's ``compile_s`` (wall of the steps that compiled)
  and, when the engine keeps one, its ``compile_log`` (seconds per compiled step bucket);
* warm: a second, identical generate: ``ttft_s`` (generate start -> the first streamed token; with B rows
  prefilled together that is the whole batch's prefill), prefill and decode seconds from the engine's stats
  (warm steps; host-driven, so wall clock), ``decode_ms_step`` = decode seconds / decode steps;
* prefill MFU = prefill FLOPs / prefill seconds / the bf16 matmul rate measured in the same run, with
    FLOPs = 2 * (matmul parameters a token passes through) * B * T  + 2 * D * V * B  + attention,
    parameters a token passes through = attention projections, dense MLPs, shared experts, its top-K routed
    experts and the routers (the LM head is counted once per sequence: generation needs only the last
    position's logits, and that is what the engine computes);
    attention = 2 * layers * H * (qk_head_dim + v_head_dim) * B * T(T+1)/2 (causal, decompressed path);
* decode x floor = decode ms/step / floor ms, floor = `decode_floor_bytes` / the copy bandwidth measured in
  the same run: every weight the step must read (attention, dense MLPs, shared experts, routers, norms,
  LM head, the B embedding rows) plus the routed experts the batch is expected to touch,
  E * (1 - (1 - K/E)^B) per MoE layer, plus the latent cache read, sum(seq_lens) * layers * the planner's
  bytes a token of ``--kv-dtype`` (`mla_jax.capacity.latent_bytes_per_token_layer`: 576 * 2 B in bf16,
  656 B in fp8).
  The context is the mean over the decode steps, T + N/2.
* ``--ragged``: each cell's B prompts have lengths drawn uniformly from [T // 16, T] (`prompt_lengths`, seeded
  by the cell), the mix continuous batching decodes; the row's ``lengths`` and ``prompt_mean`` say so, prefill
  FLOPs and tok/s count the rows' own lengths, the floor's context is their mean + N/2; no HF peer.
Other columns: ``compiles`` (step compilations of the cold generate), ``ttft_stats_s`` (the engine's own
TTFT when its stats carry one), ``same_tokens`` (the warm generate reproduced the cold one's tokens),
``experts_touched`` (the expected distinct experts per MoE layer of a decode step), ``peak_mem_gb`` (the
process's peak device memory so far: JAX never resets it, so it is the cell's own only in a run of growing
cells), ``build_s`` / ``weights_gb`` (the model's construction). ``e2e.jsonl`` holds every row with the
engine's full compile log.
HF peer (``--no-hf`` to skip): `transformers`' DeepseekV2ForCausalLM (V3: DeepseekV3ForCausalLM, with
``--hf-models``) from `cfg.to_hf_dict()`, bf16 random weights on the GPU, same prompts: one forward over the
prompt (logits of the last position only, as ours) timed as prefill, then N-1 cached greedy steps timed as
decode. A cell that would not fit (estimated) or whose prefill is estimated above ``--hf-cell-limit`` seconds
is "skipped (reason)"; the decode loop stops at that limit and reports the steps it ran.

On a device mesh (``--mesh SPEC``, repeatable; ``1`` is one device): each mesh in turn builds the model
straight into its shardings (`mla_jax.sharding.model_shardings`; the same random weights as one device) and
runs the cells through ``Engine(..., mesh=...)``: tensor parallelism over heads, expert parallelism over the
routed experts, ``data`` = D > 1 a page pool a data rank (data-parallel attention). Its rows are
``impl`` = ``ours@SPEC`` with ``devices`` and ``pool_devices`` (the devices holding the engine's page
pool); ``agree_one_device`` is the fraction of greedy tokens equal to the one-device run of the same cell
(earlier in the same run), counted per request up to its first difference (random models' logits are
nearly flat, so a reduction order may flip one; a wrong layout flips them all). The floor columns stay
one device's: on a mesh ``x_floor`` < 1 is possible, and ``decode_ms_step`` beside the one-device row's is
the comparison. A cell whose B the data ranks do not divide is a "skipped" row.

Processes: the driver never touches the GPU. Our cells run in one fresh worker process per run of
consecutive same-model cells (clean memory, cold compiles), then the HF peer in its own process, so JAX's
preallocation and torch never share the GPU. Every finished cell is appended to ``e2e.csv`` at once (a
killed run keeps its rows); a failing cell becomes a row with the error's first line. ``--time-budget``
stops starting cells (ours stop ``--hf-reserve`` seconds early so the peer gets its turn).
``--ttft-subprocess`` instead runs the first cell twice in fresh processes with JAX's persistent compilation
cache on (``--compile-cache DIR``, default a fresh temporary folder) and reports, per process, the
time from generate to the first token, from process launch to the first token, and the process wall time.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from flax import nnx

import benchmarks as bm
from benchmarks.bench_mla_decode import decode_config
from mla_jax import ModelConfig, fp8_weights
from mla_jax.capacity import latent_bytes_per_token_layer, plan_kv_cache
from mla_jax.sharding import make_mesh, model_shardings, parse_mesh, shard_model
from models import DeepSeekModel, Engine, SamplingParams, compile_cache
from models.engine import trace_counts
from pallas_kernels.page_format import NAMES as PAGE_FORMAT_NAMES

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PAGE = 64
MODELS = ("v2-lite", "v3-cut")
CSV_NAME, JSONL_NAME, META_NAME = "e2e.csv", "e2e.jsonl", "e2e_meta.json"
TTFT_CSV = "e2e_ttft.csv"
EXIT_NO_GPU = 3

# The reference run (about 8 minutes on an H200): V2-Lite at 1K context over the batches, the V3 cut, then
# V2-Lite at 8K. In this order so that a cut-short run still has a bit of each.
DEFAULT_BATCHES, DEFAULT_PROMPTS = "1,8,32,128", "1024,8192"  # the full grid (--batch / --prompt)
QUICK_CELLS = [
    ("v2-lite", 1, 1024),
    ("v2-lite", 8, 1024),
    ("v2-lite", 32, 1024),
    ("v2-lite", 128, 1024),
    ("v3-cut", 1, 1024),
    ("v3-cut", 8, 1024),
    ("v2-lite", 1, 8192),
    ("v2-lite", 8, 8192),
]

# --config tiny's cells (`tiny_cells`): (model, B, prompt as a fraction of the model's context). Three cells, each
# compiling its own prefill and decode steps (~5 s each on a busy 2-core CPU), so that the run stays under a minute.
TINY_CELLS = [
    ("v2-lite", 1, 1 / 8),
    ("v2-lite", 4, 1 / 2),
    ("v3-cut", 1, 1 / 8),
]
TINY_CELLS_TEXT = "v2-lite B=1 at 1/8 of the context, v2-lite B=4 at 1/2, v3-cut B=1 at 1/8 (256, 1024, 256 tokens)"

# Columns of e2e.csv, in order (a row may leave any of them empty).
COLUMNS = [
    "model",
    "impl",
    "B",
    "prompt",
    "lengths",
    "prompt_mean",
    "new_tokens",
    "mtp",
    "layers",
    "kv_dtype",
    "weights",
    "cold_wall_s",
    "warm_wall_s",
    "cold_compile_s",
    "compile_s",
    "compiles",
    "compile_buckets",
    "ttft_s",
    "ttft_stats_s",
    "prefill_s",
    "prefill_tok_s",
    "prefill_gflop",
    "prefill_tflops",
    "prefill_mfu",
    "prefill_chunk",
    "decode_steps",
    "decode_ms_step",
    "decode_tok_s",
    "mtp_acceptance",
    "decode_calls",
    "steps_per_call",
    "kernels_step",
    "device_ms_step",
    "host_gap_ms_step",
    "top_kernels",
    "floor_gb",
    "floor_ms",
    "x_floor",
    "experts_touched",
    "pages_used_peak",
    "peak_mem_gb",
    "build_s",
    "weights_gb",
    "same_tokens",
    "mesh",
    "devices",
    "pool_devices",
    "agree_one_device",
    "note",
    "error",
]


# ------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------
def model_config(name: str, *, config: str = "full", layers: int | None = None, kv_dtype: str = "bf16"):
    """The ModelConfig of a benchmark model.

    ``config="tiny"`` keeps each model's kind at `ModelConfig.tiny()` sizes (v2-lite: one query projection,
    softmax greedy routing, no MTP; v3-cut: tiny() itself), for a CPU run; with ``kv_dtype="fp8"`` its latent
    is 128 wide (fp8 pages scale the latent in blocks of 128; tiny()'s is 64). ``layers`` cuts any model to
    that many main layers (the V3 cut defaults to 5); its first dense layers stay (at most layers - 1, so that
    at least one MoE layer remains).
    """
    if config == "tiny":
        cfg = ModelConfig.tiny()
        if kv_dtype == "fp8":
            cfg = cfg.replace(kv_lora_rank=128)
        if name == "v2-lite":
            cfg = cfg.replace(
                q_lora_rank=None,
                n_group=1,
                topk_group=1,
                scoring_func="softmax",
                topk_method="greedy",
                norm_topk_prob=False,
                routed_scaling_factor=1.0,
                num_mtp_layers=0,
                model_type="deepseek_v2",
            )
        if layers:
            cfg = cfg.replace(
                num_hidden_layers=layers, first_k_dense_replace=min(cfg.first_k_dense_replace, layers - 1)
            )
        return cfg
    if name == "v2-lite":
        cfg = ModelConfig.deepseek_v2_lite()
        if layers:
            cfg = cfg.replace(
                num_hidden_layers=layers, first_k_dense_replace=min(cfg.first_k_dense_replace, layers - 1)
            )
        return cfg
    if name == "v3-cut":
        n = layers or 5
        return ModelConfig.deepseek_v3().replace(num_hidden_layers=n, first_k_dense_replace=min(3, max(n - 1, 0)))
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def build_model(cfg, dtype, mesh=None, weights=None):
    """`DeepSeekModel` with random weights, built on the default device (the GPU) -> (model, seconds).

    Eager construction: every initializer is one device op, compiled once per distinct shape, so the cost
    does not grow with depth (a jitted init compiles a program as deep as the model) and no weight passes
    through the host.

    With a `mesh`, the model is built straight into its shardings (`mla_jax.sharding.model_shardings`: one
    jitted init whose outputs are placed, so a model that fits the mesh but not one device can be built)
    and then `shard_model` sets the MoE's parallel attributes. The values are the eager build's (the
    same keys), so the mesh's tokens can be compared with one device's.

    `weights="fp8"` (one device): `random_fp8_model`.
    """
    t0 = time.perf_counter()
    make = lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, weights=weights)  # noqa: E731
    if weights == "fp8":
        if mesh is not None:
            raise ValueError("--weights fp8 runs on one device (shard_model does not place FP8 variables yet)")
        with jax.default_device(jax.devices()[0]):
            model = random_fp8_model(make, cfg.initializer_range)
    elif mesh is None:
        with jax.default_device(jax.devices()[0]):
            model = make()
    else:
        abstract = nnx.eval_shape(make)
        graphdef, _ = nnx.split(abstract)
        state = jax.jit(lambda: nnx.state(make()), out_shardings=model_shardings(abstract, mesh))()
        model = shard_model(nnx.merge(graphdef, state), mesh)  # placed already: sets MoE.parallel only
    jax.block_until_ready(nnx.state(model))
    return model, time.perf_counter() - t0


FP8_SPREAD = 16.0  # random e4m3 values are N(0, 16^2): well inside e4m3's range (448), few subnormals


def random_fp8_model(make, std: float):
    """The FP8 model `make()` builds, without its init's fp32 copy of every weight (a V3 MoE layer's experts
    are 45 GB in fp32 before quantization): the dense variables from one jitted init that leaves the FP8 ones
    out (XLA drops their quantization), every `Fp8Weight` drawn directly as e4m3 (N(0, FP8_SPREAD²), one
    fused program a weight) and every `Fp8Scale` = std / FP8_SPREAD, so W = q · s has the init's spread."""
    fp8_kinds = (fp8_weights.Fp8Weight, fp8_weights.Fp8Scale)
    abstract = nnx.eval_shape(make)
    graphdef, fp8_state, _ = nnx.split(abstract, fp8_kinds, ...)
    rest = jax.jit(lambda: nnx.split(make(), fp8_kinds, ...)[2])()
    draw = jax.jit(
        lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * FP8_SPREAD).astype(fp8_weights.FP8_DTYPE),
        static_argnums=1,
    )
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(fp8_state))))

    def fill(v):
        if isinstance(v, fp8_weights.Fp8Weight):
            return v.replace(draw(next(keys), v.shape))
        return v.replace(jnp.full(v.shape, std / FP8_SPREAD, jnp.float32))

    fp8_state = jax.tree.map(fill, fp8_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, fp8_state, rest)


def model_weights(args):
    """`--weights` -> `DeepSeekModel`'s `weights=` (None: dense in --dtype)."""
    return "fp8" if args.weights == "fp8" else None


def weights_label(args) -> str:
    """The `weights` column: --weights, with a --fp8-impl other than auto after a slash."""
    return args.weights + (f"/{args.fp8_impl}" if args.weights == "fp8" and args.fp8_impl != "auto" else "")


def set_fp8_impl(model, impl: str) -> None:
    """Every `Fp8Linear` of `model` computes by `impl` (`mla_jax.fp8_weights.FP8_GEMM_IMPLS`) where it is called
    as a module: prefill-sized calls and projections the scan slices. The whole-stack decode path runs by the
    step's backend whatever this says."""
    for _, m in nnx.iter_modules(model):
        if isinstance(m, fp8_weights.Fp8Linear):
            m.impl = impl


def parse_meshes(specs) -> list:
    """`--mesh` values -> [None (one device) | {axis: size}], in order; "1" is one device. ValueError (one
    line, `mla_jax.sharding.parse_mesh`'s) for a bad spec or a spec given twice."""
    out, seen = [], set()
    for spec in specs or ["1"]:
        sizes = None if spec.strip() == "1" else parse_mesh(spec)
        key = mesh_label(sizes)
        if key in seen:
            raise ValueError(f"mesh {spec!r} is given twice")
        seen.add(key)
        out.append(sizes)
    return out


def mesh_label(sizes) -> str:
    """The `impl` column of our rows: "ours" on one device, e.g. "ours@data=2,tensor=2" on a mesh."""
    return "ours@" + ",".join(f"{a}={n}" for a, n in sizes.items()) if sizes else "ours"


def weights_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))


RAGGED_SHORTEST = 16  # --ragged: prompt lengths uniform in [T // 16, T]


def prompt_lengths(batch: int, prompt: int, *, ragged: bool = False, seed: int = 0) -> list[int]:
    """The B prompts' lengths: T each, or with ``ragged`` drawn uniformly from [max(1, T // RAGGED_SHORTEST), T]
    (the same draw for a cell wherever it runs: seeded by the seed and the cell)."""
    if not ragged:
        return [prompt] * batch
    rng = np.random.default_rng((seed, batch, prompt, RAGGED_SHORTEST))
    return rng.integers(max(1, prompt // RAGGED_SHORTEST), prompt + 1, batch).tolist()


def lengths_label(prompt: int, ragged: bool) -> str:
    return f"uniform {max(1, prompt // RAGGED_SHORTEST)}-{prompt}" if ragged else "fixed"


def make_prompts(vocab: int, batch: int, prompt: int, seed: int = 0, *, ragged: bool = False) -> list[list[int]]:
    """B random prompts of T token ids (with ``ragged``, row b cut to `prompt_lengths`' b-th length), the same
    for ours and the HF peer."""
    rng = np.random.default_rng((seed, batch, prompt))
    ids = rng.integers(0, vocab, (batch, prompt)).tolist()
    return [row[:n] for row, n in zip(ids, prompt_lengths(batch, prompt, ragged=ragged, seed=seed))]


# ------------------------------------------------------------------------------------------
# Counting: parameters, the decode floor, prefill FLOPs (pure functions of the config)
# ------------------------------------------------------------------------------------------
def param_counts(cfg) -> dict[str, int]:
    """Parameters of each part of the model, per layer where the part repeats.

    attention    one MLA layer's projections: wq (or wq_a + wq_b), wkv_a, wkv_b, wo
    layer_norms  one layer's RMSNorm weights: input + post-attention (2D), kv_norm (L), q_norm (Q or 0)
    dense_mlp    one dense SwiGLU MLP, 3 * D * F
    shared       one MoE layer's shared experts, 3 * D * (n_shared * I)
    expert       one routed expert, 3 * D * I
    router       one MoE layer's gate, D * E (stored in fp32)
    embedding, lm_head (0 when tied), final_norm
    mtp_extra    one MTP module beyond its decoder layer: eh_proj (2D * D) + enorm, hnorm, shared_head_norm (3D)
    """
    D, H, V = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
    L, R, N, Vd = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    Q = cfg.q_lora_rank
    q_proj = D * H * cfg.qk_head_dim if Q is None else D * Q + Q * H * cfg.qk_head_dim
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    return dict(
        attention=q_proj + D * (L + R) + L * H * (N + Vd) + H * Vd * D,
        layer_norms=2 * D + L + (Q or 0),
        dense_mlp=3 * D * cfg.intermediate_size,
        shared=3 * D * cfg.n_shared_experts * I if E else 0,
        expert=3 * D * I if E else 0,
        router=D * E,
        embedding=V * D,
        lm_head=0 if cfg.tie_word_embeddings else V * D,
        final_norm=D,
        mtp_extra=2 * D * D + 3 * D,
    )


def layer_counts(cfg) -> tuple[int, int]:
    """(dense layers, MoE layers) of the main stack."""
    moe = cfg.num_moe_layers
    return cfg.num_hidden_layers - moe, moe


def expected_experts_touched(cfg, tokens: float) -> float:
    """Distinct routed experts that `tokens` tokens choose in one MoE layer, in expectation: E * (1 - (1 - K/E)^n).

    Assumes each token picks a uniformly random set of K of the E experts, independently of the others (what a
    random router gives): a given expert escapes one token with probability 1 - K/E.
    """
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    if E == 0:
        return 0.0
    return E * (1.0 - (1.0 - K / E) ** tokens)


def total_params(cfg, *, with_mtp: bool = True) -> int:
    """Every parameter of `DeepSeekModel(cfg)` (the MTP modules unless ``with_mtp=False``)."""
    c = param_counts(cfg)
    dense, moe = layer_counts(cfg)
    per_layer = c["attention"] + c["layer_norms"]
    moe_layer = per_layer + c["shared"] + c["router"] + cfg.n_routed_experts * c["expert"]
    n = dense * (per_layer + c["dense_mlp"]) + moe * moe_layer
    n += c["embedding"] + c["lm_head"] + c["final_norm"]
    if with_mtp:
        mtp_layer = moe_layer if cfg.n_routed_experts else per_layer + c["dense_mlp"]
        n += cfg.num_mtp_layers * (mtp_layer + c["mtp_extra"])
    return n


FP8_BYTES = 1 + 4 / 128**2  # an e4m3 weight and its share of its block's fp32 scale


def decode_floor_bytes(
    cfg,
    batch: int,
    context: float,
    *,
    dtype_bytes: int = 2,
    kv_dtype: str = "bf16",
    queries: int = 1,
    mtp: bool = False,
    weights: str = "bf16",
) -> float:
    """Bytes one decode step must read at least: weights it touches + the latent cache it attends over.

    Weights (`dtype_bytes` each; routers fp32): per layer the attention projections and norms, then the dense
    MLP or, for an MoE layer, the shared experts, the router and the `expected_experts_touched` routed experts
    of the step's B * queries tokens (3 * D * I each); the final norm, the LM head and the B * queries
    embedding rows. KV: B * context tokens per layer, at `mla_jax.capacity.latent_bytes_per_token_layer` bytes
    a token (576 * 2 for bf16). ``mtp=True`` (a verify step with MTP drafting) adds each MTP module (its
    eh_proj, norms and decoder layer, its cache) and a second LM-head read. Writes (B new latents a layer)
    are left out: they are ~1e-3 of the reads.

    ``context`` is the mean cached length of a row (after the step's write), so B * context = sum(seq_lens).

    ``weights="fp8"``: the projections of the attention, dense MLPs and shared and routed experts are e4m3, 1 byte
    each plus their fp32 scale per 128x128 block (`FP8_BYTES`); norms, routers, embedding, LM head and the MTP
    eh_proj stay `dtype_bytes`.
    """
    c = param_counts(cfg)
    qb = FP8_BYTES if weights == "fp8" else dtype_bytes  # bytes of a quantized projection's weight
    tokens = batch * queries
    touched = expected_experts_touched(cfg, tokens)
    dense, moe = layer_counts(cfg)

    def layer(is_moe: bool) -> float:
        b = c["attention"] * qb + c["layer_norms"] * dtype_bytes
        if is_moe:
            return b + (c["shared"] + touched * c["expert"]) * qb + c["router"] * 4
        return b + c["dense_mlp"] * qb

    head = (c["lm_head"] or c["embedding"]) * dtype_bytes
    weights = (
        dense * layer(False) + moe * layer(True) + head + (c["final_norm"] + tokens * cfg.hidden_size) * dtype_bytes
    )
    kv_layers = cfg.num_hidden_layers
    if mtp and cfg.num_mtp_layers:
        weights += cfg.num_mtp_layers * (layer(cfg.n_routed_experts > 0) + c["mtp_extra"] * dtype_bytes) + head
        kv_layers += cfg.num_mtp_layers
    kv = batch * context * latent_bytes_per_token_layer(cfg.kv_lora_rank, cfg.qk_rope_head_dim, kv_dtype) * kv_layers
    return weights + kv


def prefill_flops(cfg, batch: int, prompt: int) -> float:
    """Useful FLOPs of prefilling B prompts of T tokens (see the module docstring).

    2 * (attention + dense MLP or shared experts + router + K routed experts, summed over the layers) * B * T
    + 2 * D * V * B (the LM head at each sequence's last position)
    + 2 * layers * H * (qk_head_dim + v_head_dim) * B * T(T+1)/2 (causal scores and weighted values).
    """
    c = param_counts(cfg)
    dense, moe = layer_counts(cfg)
    K = cfg.num_experts_per_tok
    per_token = dense * (c["attention"] + c["dense_mlp"]) + moe * (
        c["attention"] + c["shared"] + c["router"] + K * c["expert"]
    )
    head = c["lm_head"] or c["embedding"]
    pairs = prompt * (prompt + 1) / 2
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * batch * pairs
    return 2.0 * per_token * batch * prompt + 2.0 * head * batch + attn


def kv_pages(cfg, batch: int, prompt: int, new_tokens: int) -> int:
    """Pages of a pool that holds every row's prompt + new tokens (+ the engine's draft room with an MTP head)."""
    draft = 3 if cfg.num_mtp_layers else 0  # models.engine.MAX_DRAFT_TOKENS: room the engine keeps
    plan = plan_kv_cache(cfg, context_len=prompt + new_tokens, num_sequences=batch, page_size=PAGE, draft_tokens=draft)
    return batch * plan.pages_per_sequence


def derive(
    row: dict,
    cfg,
    ceil: dict | None,
    *,
    dtype_bytes: int = 2,
    kv_dtype: str = "bf16",
    mtp: bool = False,
    weights: str = "bf16",
) -> dict:
    """Adds the counted and the ratio columns (FLOPs, MFU, floor, x floor) from B, prompt (or a ragged cell's
    ``prompt_lens``), new_tokens and the measured prefill_s / decode_ms_step of a row; the same arithmetic for ours
    and the peer."""
    B, T, N = row["B"], row["prompt"], row["new_tokens"]
    lens = row.get("prompt_lens") or [T] * B  # a ragged cell's lengths (`prompt_lengths`)
    if len(set(lens)) == 1:
        flops = prefill_flops(cfg, B, lens[0])
    else:  # rows of their own lengths: the counted FLOPs add up row by row
        flops = sum(prefill_flops(cfg, 1, t) for t in lens)
    row["prefill_gflop"] = flops / 1e9
    if row.get("prefill_s"):
        row["prefill_tok_s"] = sum(lens) / row["prefill_s"]
        row["prefill_tflops"] = flops / row["prefill_s"] / 1e12
        if ceil and ceil.get("matmul_tflops"):
            row["prefill_mfu"] = row["prefill_tflops"] / ceil["matmul_tflops"]
    queries = 2 if mtp else 1
    floor = decode_floor_bytes(
        cfg,
        B,
        sum(lens) / B + N / 2,
        dtype_bytes=dtype_bytes,
        kv_dtype=kv_dtype,
        queries=queries,
        mtp=mtp,
        weights=weights,
    )
    row["floor_gb"] = floor / 1e9
    row["experts_touched"] = expected_experts_touched(cfg, B * queries)
    if ceil and ceil.get("bandwidth_gbps"):
        row["floor_ms"] = floor / (ceil["bandwidth_gbps"] * 1e9) * 1e3
        if row.get("decode_ms_step"):
            row["x_floor"] = row["decode_ms_step"] / row["floor_ms"]
    return row


# ------------------------------------------------------------------------------------------
# Cells and output files
# ------------------------------------------------------------------------------------------
def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_cells(spec: str) -> list[tuple[str, int, int]]:
    """ "v2-lite:1x1024,8x1024;v3-cut:1x1024" -> [(model, B, T), ...] in the order given."""
    cells = []
    for group in spec.split(";"):
        if not group.strip():
            continue
        name, _, items = group.partition(":")
        if name.strip() not in MODELS or not items:
            raise ValueError(f"--cells group {group!r}: expected MODEL:BxT[,BxT...] with MODEL in {MODELS}")
        for item in items.split(","):
            b, _, t = item.strip().partition("x")
            cells.append((name.strip(), int(b), int(t)))
    return cells


def format_cells(cells) -> str:
    return ";".join(
        f"{m}:" + ",".join(f"{b}x{t}" for _, b, t in grp) for m, grp in itertools.groupby(cells, key=lambda c: c[0])
    )


def tiny_cells(models, *, layers=None, kv_dtype: str = "bf16", new_tokens: int = 128) -> list[tuple[str, int, int]]:
    """--config tiny's cells of `models`: TINY_CELLS with each prompt a fraction of that tiny model's context C
    (`max_position_embeddings`, 2048), at most C - new_tokens - 3 (the engine's draft room), so that every
    cell's prompt and new tokens fit the model (the full grid's 8192-token prompts do not)."""
    cells = []
    for name, b, frac in TINY_CELLS:
        if name in models:
            C = model_config(name, config="tiny", layers=layers, kv_dtype=kv_dtype).max_position_embeddings
            cells.append((name, b, max(1, min(int(C * frac), C - new_tokens - 3))))
    return cells


def grid(args) -> list[tuple[str, int, int]]:
    """The cells of this run: --cells, else (--config tiny without --batch / --prompt) `tiny_cells`, else
    --quick, else models x --batch x --prompt."""
    if args.cells:
        return parse_cells(args.cells)
    models = args.model.split(",")
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"e2e: error: unknown model {m!r}; known: {', '.join(MODELS)}")
    if args.config == "tiny" and args.batch is None and args.prompt is None:
        return tiny_cells(models, layers=args.layers, kv_dtype=args.kv_dtype, new_tokens=args.new_tokens)
    if args.quick:
        return [c for c in QUICK_CELLS if c[0] in models]
    prompts, batches = parse_ints(args.prompt or DEFAULT_PROMPTS), parse_ints(args.batch or DEFAULT_BATCHES)
    return [(m, b, t) for m in models for t in prompts for b in batches]


def segments(cells):
    """Runs of consecutive cells of one model: each runs in one worker process."""
    return [list(g) for _, g in itertools.groupby(cells, key=lambda c: c[0])]


def append_row(out_dir: str, row: dict) -> None:
    """Adds `row` to e2e.csv (rewritten through a temporary file, so a kill never leaves half a file) and to
    e2e.jsonl (every field, lists included)."""
    path = os.path.join(out_dir, CSV_NAME)
    rows = bm.read_csv(path) if os.path.exists(path) else []
    flat = {k: row.get(k, "") for k in COLUMNS}
    flat.update({k: v for k, v in row.items() if k not in flat and not isinstance(v, (list, dict))})
    rows.append(flat)
    bm.write_csv(path + ".tmp", rows)
    os.replace(path + ".tmp", path)
    with open(os.path.join(out_dir, JSONL_NAME), "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def read_meta(out_dir: str) -> dict:
    path = os.path.join(out_dir, META_NAME)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_meta(out_dir: str, meta: dict) -> None:
    bm.write_json(os.path.join(out_dir, META_NAME), meta)


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:240]


def stat(stats, key):
    """stats["key"] of a dict or of a dataclass that supports [] (or has the attribute); None when absent."""
    try:
        return stats[key]
    except (KeyError, TypeError, IndexError, AttributeError):
        return getattr(stats, key, None)


def warm_seconds(stats, kind: str):
    """Warm wall seconds of the prefill / decode steps: stats[kind_s] when the engine reports it, else
    tokens / the warm rate."""
    s = stat(stats, f"{kind}_s")
    if s:
        return float(s)
    rate, n = stat(stats, f"{kind}_tok_s"), stat(stats, f"{kind}_tokens")
    return n / rate if rate and n else None


def warm_prefill_seconds(stats):
    """The warm seconds a cell's prompt tokens took: the prefill steps', plus the mixed steps' when there were
    warm prefill steps to time. A ragged batch's long prompts finish in mixed steps beside the short ones'
    decode rows, and their tokens count in the cell's prompt tokens; without their steps' time the rate credited
    them for free (a ragged V2-Lite cell showed 203 % prefill MFU on the H200)."""
    seconds = warm_seconds(stats, "prefill")
    if stat(stats, "prefill_s") and stat(stats, "mixed_s"):
        seconds += stat(stats, "mixed_s")
    return seconds


# ------------------------------------------------------------------------------------------
# Ceilings
# ------------------------------------------------------------------------------------------
def cpu_ceilings(iterations: int = 5) -> dict:
    """Rough wall-clock stand-ins for the GPU ceilings on a CPU (x * 2 over 32 MiB, a 512^3 matmul), so the
    ratio columns of a CPU run are filled; their figures mean nothing beyond that."""

    def wall(fn, *a):
        jax.block_until_ready(fn(*a))
        ts = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    x = jnp.ones((2048, 4096), jnp.float32)
    copy = 2 * x.nbytes / wall(jax.jit(lambda a: a * 2), x) / 1e9
    a = jnp.ones((512, 512), jnp.float32)
    mm = 2 * 512**3 / wall(jax.jit(lambda p, q: p @ q), a, a) / 1e12
    return dict(
        xla_copy_gbps=copy,
        torch_copy_gbps=None,
        xla_matmul_tflops=mm,
        bandwidth_gbps=copy,
        matmul_tflops=mm,
        method="CPU wall clock (rough)",
    )


def worker_ceilings(args, tiny: bool) -> tuple[dict, dict]:
    """(header, ceilings): measured now (and stored in e2e_meta.json), or the ones an earlier worker of this run
    stored there (``--reuse-ceilings``)."""
    meta = read_meta(args.out)
    if args.reuse_ceilings and meta.get("ceilings"):
        return meta, meta["ceilings"]
    if tiny:
        header = bm.run_header()
        print(f"# e2e benchmark on {header['device']}, jax {header['jax']}, {header['date']}")
        ceil = cpu_ceilings()
    else:
        header, ceil = bm.begin_run("e2e", args.out, args.ceiling_iters)
    header["command"] = args.header_command or header["command"]
    # With the persistent cache on, a "cold" generate may load its executables from disk instead of compiling.
    header["compile_cache"] = jax.config.jax_compilation_cache_dir or ""
    meta.update(header, ceilings=ceil)
    write_meta(args.out, meta)
    return meta, ceil


# ------------------------------------------------------------------------------------------
# Our engine
# ------------------------------------------------------------------------------------------
KV_DTYPES = PAGE_FORMAT_NAMES  # what the engine's cache allocates


def kv_dtype_arg(name: str):
    """--kv-dtype -> the Engine's kv_dtype (a jnp dtype for the plain formats; "fp8" / "fp4" pass through as names)."""
    return {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}.get(name, name)


def enable_compile_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path`, for every compilation, as the CLIs turn it on."""
    compile_cache.enable(path)


def _trace_total():
    return sum(trace_counts().values())


def _sync(engine) -> None:
    pages = getattr(getattr(engine, "cache", None), "pages", None)
    if pages is not None:
        jax.block_until_ready(pages)


def _peak_mem_gb():
    try:
        s = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        return None
    peak = s.get("peak_bytes_in_use")
    return peak / 1e9 if peak else None


def _check_result(res, batch: int, new_tokens: int) -> None:
    errors = [e for e in (getattr(res, "errors", None) or []) if e]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]}")
    short = [len(t) for t in res.tokens if len(t) != new_tokens]
    if len(res.tokens) != batch or short:
        raise RuntimeError(f"expected {batch} x {new_tokens} new tokens, got lengths {short[:4]}")


def _compile_buckets(entries) -> str:
    return "; ".join(f"{e.get('step')}[{e.get('bucket')}] {float(e.get('seconds', 0)):.2f}s" for e in entries)


# --kernels: two generations of the warm cell, of KERNEL_TOKENS[0] and KERNEL_TOKENS[1] new tokens, recorded with
# CUPTI; their difference is decode steps alone (the same prompts, prefill and first token in both).
KERNEL_TOKENS = (17, 81)
TOP_KERNELS = 8


def kernel_profile(engine, prompts, kw, out_dir: str, label: str) -> dict:
    """Per decode step of a warm engine: kernels launched, their device time (CUPTI sum), the host gap (wall
    time less device time) and the kernels that take the most device time, from the difference of two
    generations (`KERNEL_TOKENS`); the whole table goes to `<out_dir>/kernels_<label>.json`."""
    runs = []
    for n in KERNEL_TOKENS:
        box = {}

        def call(n=n, box=box):
            box["res"] = engine.generate(prompts, **{**kw, "max_new_tokens": n})

        timings = bm.cupti_kernels(call, sync=lambda: _sync(engine))
        st = box["res"].stats
        runs.append((timings, stat(st, "decode_steps"), stat(st, "decode_s"), stat(st, "decode_calls")))
    (k1, s1, w1, c1), (k2, s2, w2, c2) = runs
    steps = s2 - s1
    if steps <= 0:
        return dict(note="--kernels: no decode steps between the two generations")
    per = {}
    for sign, timings in ((-1, k1), (1, k2)):
        for name, ms in timings:
            n_ms = per.setdefault(name, [0, 0.0])
            n_ms[0] += sign
            n_ms[1] += sign * ms
    device_ms = (sum(ms for _, ms in k2) - sum(ms for _, ms in k1)) / steps
    table = sorted(
        ({"kernel": k, "count_step": c / steps, "us_step": 1e3 * ms / steps} for k, (c, ms) in per.items()),
        key=lambda r: -r["us_step"],
    )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"kernels_{label}.json"), "w") as f:
        json.dump(dict(steps=steps, calls=c2 - c1, device_ms_step=device_ms, kernels=table), f, indent=1)
    top = "; ".join(f"{r['kernel'][:48]} {r['us_step']:.1f}us x{r['count_step']:.1f}" for r in table[:TOP_KERNELS])
    return dict(
        kernels_step=(len(k2) - len(k1)) / steps,
        device_ms_step=device_ms,
        host_gap_ms_step=1e3 * (w2 - w1) / steps - device_ms,
        top_kernels=top,
    )


def run_cell(model, cfg, name: str, batch: int, prompt: int, args, ceil, *, mtp: bool, mesh=None, sizes=None) -> dict:
    """One cell through the public engine API: a cold then a warm generate -> a row (see COLUMNS); on
    `mesh` (`sizes` its {axis: size}) when given. The row keeps the warm tokens under "tokens"."""
    N = args.new_tokens
    row = dict(
        model=name,
        impl=mesh_label(sizes),
        B=batch,
        prompt=prompt,
        new_tokens=N,
        mtp="on" if mtp else "off",
        layers=cfg.num_hidden_layers,
        kv_dtype=args.kv_dtype,
        weights=weights_label(args),
        mesh=mesh_label(sizes)[5:] or "one device",
        devices=mesh.size if mesh is not None else 1,
    )
    ragged = getattr(args, "ragged", False)
    prompts = make_prompts(cfg.vocab_size, batch, prompt, args.seed, ragged=ragged)
    row["lengths"] = lengths_label(prompt, ragged)
    if ragged:
        row["prompt_lens"] = [len(p) for p in prompts]
        row["prompt_mean"] = sum(row["prompt_lens"]) / batch
    # A pool per data rank splits the pages too: each rank gets num_pages / D (kv_pages counts whole sequences).
    engine = Engine(
        model,
        page_size=PAGE,
        num_pages=kv_pages(cfg, batch, prompt, N),
        max_batch=batch,
        prefill_chunk=args.prefill_chunk or None,
        attention_impl=args.attention_impl,
        kv_dtype=kv_dtype_arg(args.kv_dtype),
        mesh=mesh,
        decode_steps=args.decode_steps,
        decode_config=decode_config(getattr(args, "decode_config", "")),
    )
    kw = dict(max_new_tokens=N, sampling=SamplingParams(temperature=0.0))
    if mtp:
        kw["use_mtp"] = True
    log = getattr(engine, "compile_log", None)
    log0 = len(log) if log is not None else 0
    traces0 = _trace_total()

    bm.log(f"  {name} B={batch} T={prompt} ({row['lengths']}): cold generate (compiles) ...")
    t0 = time.perf_counter()
    cold = engine.generate(prompts, **kw)
    _sync(engine)
    row["cold_wall_s"] = time.perf_counter() - t0
    _check_result(cold, batch, N)
    row["compile_s"] = stat(cold.stats, "compile_s")
    traces1 = _trace_total()
    row["compiles"] = traces1 - traces0
    log = getattr(engine, "compile_log", None)
    if log is not None:
        row["compile_log"] = [dict(e) for e in log[log0:]]
        row["compile_buckets"] = _compile_buckets(row["compile_log"])
        row["compiles"] = len(row["compile_log"])

    bm.log(f"  {name} B={batch} T={prompt}: warm generate ...")
    first = []

    def stream(_request, _token):
        if not first:
            first.append(time.perf_counter())

    t0 = time.perf_counter()
    warm = engine.generate(prompts, stream=stream, **kw)
    _sync(engine)
    row["warm_wall_s"] = time.perf_counter() - t0
    _check_result(warm, batch, N)
    row["cold_compile_s"] = row["cold_wall_s"] - row["warm_wall_s"]
    row["ttft_s"] = first[0] - t0 if first else None
    row["ttft_stats_s"] = stat(warm.stats, "ttft_s")
    if _trace_total() != traces1:
        row["note"] = "the warm generate compiled again"
    row["same_tokens"] = warm.tokens == cold.tokens
    st = warm.stats
    row["prefill_s"] = warm_prefill_seconds(st)
    row["prefill_chunk"] = engine.prefill_chunk
    decode_s = warm_seconds(st, "decode")
    steps = stat(st, "decode_steps")
    row["decode_steps"] = steps
    row["decode_calls"] = stat(st, "decode_calls")
    row["steps_per_call"] = args.decode_steps
    if decode_s and steps:
        row["decode_ms_step"] = decode_s / steps * 1e3
        row["decode_tok_s"] = stat(st, "decode_tokens") / decode_s
    if mtp:
        row["mtp_acceptance"] = stat(st, "mtp_acceptance")
    row["pages_used_peak"] = stat(st, "pages_used_peak")
    row["peak_mem_gb"] = _peak_mem_gb()
    row["tokens"] = warm.tokens
    row["pool_devices"] = len(engine.cache.pages.sharding.device_set)
    if args.kernels:
        if jax.default_backend() != "gpu":
            row["note"] = "--kernels: CUPTI needs a CUDA GPU"
        else:
            bm.log(f"  {name} B={batch} T={prompt}: --kernels: two recorded generations ...")
            label = f"{name}_B{batch}_T{prompt}{'_ragged' if ragged else ''}_{mesh_label(sizes)}_{args.kv_dtype}"
            label += f"_k{args.decode_steps}"
            row.update(kernel_profile(engine, prompts, kw, args.out, label.replace("=", "").replace(",", "-")))
    del engine
    dtype_bytes = 4 if args.dtype == "fp32" else 2
    return derive(row, cfg, ceil, dtype_bytes=dtype_bytes, kv_dtype=args.kv_dtype, mtp=mtp, weights=args.weights)


def run_ours_worker(args) -> None:
    """Our cells (one model's run of cells, usually) in this process; rows appended as they finish."""
    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    tiny = args.config == "tiny"
    if not tiny:
        try:
            bm.require_gpu("e2e")
        except SystemExit as e:
            print(e, file=sys.stderr)
            raise SystemExit(EXIT_NO_GPU) from None
    _, ceil = worker_ceilings(args, tiny)
    dtype = jnp.float32 if args.dtype == "fp32" else jnp.bfloat16
    deadline = args.deadline
    for name, group in itertools.groupby(grid(args), key=lambda c: c[0]):
        group = list(group)
        cfg = model_config(name, config=args.config, layers=args.layers, kv_dtype=args.kv_dtype)
        variants = {"off": [False], "on": [True], "both": [False, True]}[args.mtp]
        variants = [v for v in variants if not v or cfg.num_mtp_layers] or [False]  # no MTP head: plain decode
        base = dict(
            model=name,
            impl="ours",
            new_tokens=args.new_tokens,
            layers=cfg.num_hidden_layers,
            kv_dtype=args.kv_dtype,
            weights=weights_label(args),
        )
        if deadline and time.time() > deadline:
            for _, b, t in group:
                append_row(args.out, dict(base, B=b, prompt=t, note="skipped (time budget)"))
            continue
        one_device_tokens = {}  # (B, prompt, mtp) -> the one-device run's warm tokens, for agree_one_device
        for sizes in parse_meshes(args.mesh):
            mesh = None
            if sizes:
                mesh = make_mesh(**sizes)
            base = dict(base, impl=mesh_label(sizes))
            where = f" on {mesh_label(sizes)[5:]}" if sizes else ""
            what = args.dtype if args.weights == "bf16" else f"fp8 weights, {args.dtype} compute"
            bm.log(f"# {name}: building {total_params(cfg) / 1e9:.2f}B parameters ({what}){where} ...")
            try:
                model, build_s = build_model(cfg, dtype, mesh, weights=model_weights(args))
            except Exception as e:  # noqa: BLE001 - an OOM while building must not end the run
                for _, b, t in group:
                    append_row(args.out, dict(base, B=b, prompt=t, error=f"model build failed: {one_line(e)}"))
                continue
            if args.weights == "fp8":
                set_fp8_impl(model, args.fp8_impl)
            wgb = weights_bytes(model) / 1e9
            bm.log(f"# {name}: built in {build_s:.1f} s, {wgb:.1f} GB of weights{where}")
            for _, b, t in bm.progress(group, desc=f"e2e {name}{where}"):
                for mtp in variants:
                    data = (sizes or {}).get("data", 1)
                    if deadline and time.time() > deadline:
                        row = dict(base, B=b, prompt=t, mtp="on" if mtp else "off", note="skipped (time budget)")
                    elif b % data:
                        row = dict(
                            base,
                            B=b,
                            prompt=t,
                            mtp="on" if mtp else "off",
                            note=f"skipped (B={b} is not divisible by data={data}: "
                            "the slots are split over the data ranks)",
                        )
                    else:
                        try:
                            row = run_cell(model, cfg, name, b, t, args, ceil, mtp=mtp, mesh=mesh, sizes=sizes)
                        except Exception as e:  # noqa: BLE001 - one cell's OOM must not cost the others
                            row = dict(base, B=b, prompt=t, mtp="on" if mtp else "off", error=one_line(e))
                        row.update(build_s=build_s, weights_gb=wgb)
                        tokens = row.pop("tokens", None)
                        if tokens is not None and not sizes:
                            one_device_tokens[b, t, mtp] = tokens
                        elif tokens is not None and (b, t, mtp) in one_device_tokens:
                            row["agree_one_device"] = token_agreement(tokens, one_device_tokens[b, t, mtp])
                    append_row(args.out, row)
                    bm.log("  " + summary(row))
                    gc.collect()
            del model
            gc.collect()
            if not tiny:  # the tiny models' runs keep the eager build's compiled initializers
                jax.clear_caches()


def token_agreement(tokens, reference) -> float:
    """The fraction of generated positions where `tokens` equal `reference` (per request, up to the first
    difference: after it the two continue from different contexts, so later positions do not count as
    agreeing)."""
    same = total = 0
    for a, b in zip(tokens, reference):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        same, total = same + n, total + max(len(a), len(b))
    return same / total if total else 1.0


def summary(row: dict) -> str:
    keys = (
        "model",
        "impl",
        "B",
        "prompt",
        "mtp",
        "cold_compile_s",
        "ttft_s",
        "prefill_tok_s",
        "prefill_mfu",
        "decode_ms_step",
        "decode_tok_s",
        "floor_ms",
        "x_floor",
        "agree_one_device",
        "note",
        "error",
    )
    return ", ".join(
        f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row[k]}"
        for k in keys
        if row.get(k) not in (None, "")
    )


# ------------------------------------------------------------------------------------------
# The Hugging Face transformers peer (its own process)
# ------------------------------------------------------------------------------------------
def hf_memory_bytes(cfg, batch: int, prompt: int, new_tokens: int, attn: str) -> float:
    """A generous estimate of what HF's eager model needs for a cell: bf16 weights (no MTP: HF does not build
    it) + its decompressed cache (per token and layer H * (qk_head_dim + v_head_dim) bf16 values) + the
    prefill's activations (MLP intermediates of every prompt token; with eager attention the [B, H, T, T]
    scores in bf16 and fp32)."""
    S = prompt + new_tokens
    weights = total_params(cfg, with_mtp=False) * 2
    kv = cfg.num_hidden_layers * batch * S * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 2
    widest = max(cfg.intermediate_size, cfg.n_shared_experts * cfg.moe_intermediate_size)
    act = batch * prompt * (4 * cfg.hidden_size + 3 * widest) * 2
    if attn == "eager":
        act += batch * cfg.num_attention_heads * prompt * prompt * (2 + 4 + 2)
    return weights + kv + act + batch * cfg.vocab_size * 4


def _hf_class_name(cfg) -> str:
    return "DeepseekV2ForCausalLM" if cfg.model_type == "deepseek_v2" else "DeepseekV3ForCausalLM"


def build_hf_model(cfg, attn: str):
    """transformers' DeepSeek model for `cfg` (same sizes), bf16, random init, on the GPU.

    The config goes the way of a real checkpoint: `cfg.to_hf_dict()` written as config.json and read by
    `AutoConfig.from_pretrained` (what the project's HF fixtures are loaded through, legacy rope keys included).
    """
    import torch  # noqa: PLC0415 (optional: the HF peer's, not a dependency)
    import transformers  # noqa: PLC0415 (optional: the HF peer's, not a dependency)

    d = cfg.to_hf_dict()
    d.pop("torch_dtype", None)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(d, f)
        config = transformers.AutoConfig.from_pretrained(tmp)
    err = None
    for dtype_kw in ("dtype", "torch_dtype"):  # transformers 5 / 4 spelling
        try:
            with torch.device("cuda"):
                model = transformers.AutoModelForCausalLM.from_config(
                    config, attn_implementation=attn, **{dtype_kw: torch.bfloat16}
                )
            return model.to(device="cuda", dtype=torch.bfloat16).eval()
        except TypeError as e:
            err = e
    raise err


def hf_timed_generate(model, ids, new_tokens: int, limit_s: float):
    """Greedy generation with HF's cache: one forward over the prompt (last-position logits), then cached steps
    until `new_tokens` tokens or `limit_s` seconds -> (prefill s, decode s, decode steps)."""
    import torch  # noqa: PLC0415 (optional: the HF peer's, not a dependency)

    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.model(input_ids=ids, use_cache=True)
        nxt = model.lm_head(out.last_hidden_state[:, -1]).argmax(-1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        pkv, steps = out.past_key_values, 0
        for _ in range(new_tokens - 1):
            out = model.model(input_ids=nxt[:, None], past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            nxt = model.lm_head(out.last_hidden_state[:, -1]).argmax(-1)
            steps += 1
            if time.perf_counter() - t0 > limit_s:
                break
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    del out, pkv
    return t1 - t0, t2 - t1, steps


def run_hf_worker(args) -> None:
    """The HF peer over this run's cells of one model, smallest first; a row per cell."""
    cells = sorted(grid(args), key=lambda c: (c[1] * c[2], c[2]))
    if not cells:
        return
    name = cells[0][0]
    cfg = model_config(name, config=args.config, layers=args.layers, kv_dtype=args.kv_dtype)
    meta = read_meta(args.out)
    ceil = meta.get("ceilings")
    base = dict(
        model=name, impl="hf", new_tokens=args.new_tokens, mtp="off", layers=cfg.num_hidden_layers, kv_dtype="bf16"
    )

    def skip_all(reason):
        for _, b, t in cells:
            append_row(args.out, dict(base, B=b, prompt=t, note=f"skipped ({reason})"))
        bm.log(f"# HF peer {name}: skipped ({reason})")

    try:
        import torch  # noqa: PLC0415 (optional: the HF peer's, not a dependency; skipped without it)
        import transformers  # noqa: PLC0415 (optional: as torch)
    except ImportError as e:
        return skip_all(f"not importable: {e}")
    if not torch.cuda.is_available():
        return skip_all("no CUDA device for torch")
    kind = _hf_class_name(cfg)
    if not hasattr(transformers, kind):
        return skip_all(f"transformers {transformers.__version__} has no {kind}")
    bm.log(f"# HF peer {name}: building {kind} (transformers {transformers.__version__}, attention {args.hf_attn}) ...")
    t0 = time.perf_counter()
    try:
        model = build_hf_model(cfg, args.hf_attn)
    except ValueError as e:  # an attention implementation this model or install does not support
        bm.log(f"# HF peer {name}: attention {args.hf_attn!r} refused ({one_line(e)}); using eager")
        model = None
    except Exception as e:  # noqa: BLE001
        return skip_all(f"build failed: {one_line(e)}")
    try:
        model = model or build_hf_model(cfg, "eager")
    except Exception as e:  # noqa: BLE001
        return skip_all(f"build failed: {one_line(e)}")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    attn = getattr(model.config, "_attn_implementation", args.hf_attn)
    base.update(
        build_s=build_s,
        weights_gb=sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
        note=f"transformers {transformers.__version__}, attention {attn}",
    )
    bm.log(f"# HF peer {name}: built in {build_s:.1f} s")
    warm_ids = torch.randint(0, cfg.vocab_size, (1, 16), device="cuda")
    hf_timed_generate(model, warm_ids, 3, args.hf_cell_limit)  # loads kernels, cuBLAS handles
    prev = None  # (B, T, prefill s) of the last timed cell
    for _, b, t in bm.progress(cells, desc=f"e2e HF {name}"):
        row = dict(base, B=b, prompt=t)
        need = hf_memory_bytes(cfg, b, t, args.new_tokens, attn)
        free = torch.cuda.mem_get_info()[0]
        est = prev[2] * prefill_flops(cfg, b, t) / prefill_flops(cfg, prev[0], prev[1]) if prev else None
        if args.deadline and time.time() > args.deadline:
            row["note"] = "skipped (time budget)"
        elif need > 0.92 * free:
            row["note"] = f"skipped (needs ~{need / 1e9:.0f} GB, {free / 1e9:.0f} GB free)"
        elif est and est > args.hf_cell_limit:
            row["note"] = f"skipped (prefill estimated {est:.0f} s > {args.hf_cell_limit:.0f} s)"
        else:
            try:
                torch.cuda.reset_peak_memory_stats()
                ids = torch.tensor(make_prompts(cfg.vocab_size, b, t, args.seed), device="cuda")
                hf_timed_generate(model, ids[:, :16], 2, args.hf_cell_limit)
                prefill_s, decode_s, steps = hf_timed_generate(model, ids, args.new_tokens, args.hf_cell_limit)
                row.update(
                    prefill_s=prefill_s,
                    ttft_s=prefill_s,
                    decode_steps=steps,
                    peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9,
                )
                if steps:
                    row.update(decode_ms_step=decode_s / steps * 1e3, decode_tok_s=b * steps / decode_s)
                if steps < args.new_tokens - 1:
                    row["note"] += f"; decode cut at {steps}/{args.new_tokens - 1} steps (time limit)"
                prev = (b, t, prefill_s)
                derive(row, cfg, ceil)
            except Exception as e:  # noqa: BLE001 - torch.cuda.OutOfMemoryError and friends
                row["error"] = one_line(e)
            ids = None
            torch.cuda.empty_cache()
        append_row(args.out, row)
        bm.log("  " + summary(row))


# ------------------------------------------------------------------------------------------
# Time to first token of fresh processes with the persistent compilation cache
# ------------------------------------------------------------------------------------------
def run_ttft_worker(args) -> None:
    """One fresh process: build the model, one generate of the first cell; the epochs of its milestones go to
    --result-file as JSON."""
    t_start = time.time()
    enable_compile_cache(args.compile_cache)
    name, b, t = grid(args)[0]
    cfg = model_config(name, config=args.config, layers=args.layers, kv_dtype=args.kv_dtype)
    model, build_s = build_model(
        cfg, jnp.float32 if args.dtype == "fp32" else jnp.bfloat16, weights=model_weights(args)
    )
    engine = Engine(
        model,
        page_size=PAGE,
        num_pages=kv_pages(cfg, b, t, args.new_tokens),
        max_batch=b,
        prefill_chunk=args.prefill_chunk or None,
        attention_impl=args.attention_impl,
        kv_dtype=kv_dtype_arg(args.kv_dtype),
    )
    first = []

    def stream(_request, _token):
        if not first:
            first.append(time.time())

    t_gen = time.time()
    res = engine.generate(
        make_prompts(cfg.vocab_size, b, t, args.seed),
        max_new_tokens=args.new_tokens,
        sampling=SamplingParams(temperature=0.0),
        stream=stream,
    )
    _check_result(res, b, args.new_tokens)
    out = dict(
        t_start=t_start,
        t_generate=t_gen,
        t_first_token=first[0],
        t_end=time.time(),
        build_s=build_s,
        compile_s=stat(res.stats, "compile_s"),
    )
    with open(args.result_file, "w") as f:
        json.dump(out, f)


def _cache_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path)) if os.path.isdir(path) else 0


def run_ttft(args, argv) -> list[dict]:
    """--ttft-subprocess: the first cell twice, each in a fresh process with the persistent cache on."""
    os.makedirs(args.out, exist_ok=True)
    # Not under --out by default: a GPU run's $OUT comes back to the caller, and the cache can be large.
    cache = args.compile_cache or tempfile.mkdtemp(prefix="mla_e2e_jax_cache_")
    name, b, t = grid(args)[0]
    rows = []
    for run in (1, 2):
        files0 = _cache_files(cache)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result = f.name
        cmd = worker_command(
            argv, "ttft", cells=f"{name}:{b}x{t}", extra=["--compile-cache", cache, "--result-file", result]
        )
        bm.log(f"# TTFT run {run}: fresh process, compilation cache {files0} files")
        t_launch = time.time()
        rc = subprocess.run(cmd, env=worker_env(args)).returncode
        t_exit = time.time()
        row = dict(
            model=name,
            B=b,
            prompt=t,
            new_tokens=args.new_tokens,
            run=run,
            cache_files_before=files0,
            cache_files_after=_cache_files(cache),
            process_wall_s=t_exit - t_launch,
        )
        try:
            with open(result) as f:
                r = json.load(f)
            row.update(
                ttft_s=r["t_first_token"] - r["t_generate"],
                launch_to_first_token_s=r["t_first_token"] - t_launch,
                startup_s=r["t_start"] - t_launch,
                build_s=r["build_s"],
                compile_s=r["compile_s"],
            )
        except (OSError, ValueError, KeyError) as e:
            row["error"] = f"worker exited with code {rc}: {one_line(e)}"
        finally:
            if os.path.exists(result):
                os.remove(result)
        rows.append(row)
        bm.log("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    bm.write_csv(os.path.join(args.out, TTFT_CSV), rows)
    print()
    bm.print_table(
        rows,
        [
            ("model", "model", "{}"),
            ("B", "B", "{}"),
            ("prompt", "prompt", "{}"),
            ("run", "run", "{}"),
            ("cache_files_before", "cache files", "{}"),
            ("ttft_s", "generate->1st tok s", "{:.2f}"),
            ("launch_to_first_token_s", "launch->1st tok s", "{:.2f}"),
            ("process_wall_s", "process s", "{:.2f}"),
            ("error", "error", "{}"),
        ],
    )
    print(f"# compilation cache: {cache}")
    return rows


# ------------------------------------------------------------------------------------------
# The driver: workers in order, then the report
# ------------------------------------------------------------------------------------------
def worker_env(args) -> dict:
    """The workers' environment: the project importable; JAX may take most of the GPU (the V3 cut needs
    ~76 GB of weights; more than 0.9 leaves too little to cuBLAS and the torch copy ceiling) unless the
    caller chose otherwise."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    return env


def portable_command(argv) -> str:
    """This run's command line, with the GPU machine's $OUT spelt as $OUT (as `benchmarks.run_header`)."""
    cmd = shlex.join(["python", "-m", "benchmarks", "e2e", *argv])
    out = os.environ.get("OUT")
    return cmd.replace(out, "$OUT") if out else cmd


def worker_command(argv, kind: str, *, cells: str, extra=()) -> list[str]:
    """This command line again, as a worker of `kind` over `cells` (later flags override earlier ones)."""
    return [
        sys.executable,
        "-m",
        "benchmarks",
        "e2e",
        *argv,
        "--worker",
        kind,
        "--cells",
        cells,
        "--header-command",
        portable_command(argv),
        *extra,
    ]


def _cells_with_rows(out_dir: str) -> set:
    path = os.path.join(out_dir, CSV_NAME)
    return {(r["model"], r["impl"], r["B"], r["prompt"]) for r in (bm.read_csv(path) if os.path.exists(path) else [])}


def drive(args, argv) -> list[dict]:
    """Our cells (a worker process per run of same-model cells), then the HF peer (a process per model), then
    the report."""
    os.makedirs(args.out, exist_ok=True)
    for f in (CSV_NAME, JSONL_NAME, META_NAME):  # this run's rows only
        if os.path.exists(os.path.join(args.out, f)):
            os.remove(os.path.join(args.out, f))
    cells = grid(args)
    # the HF peer runs equal-length batches only (its generate pads nothing here)
    hf_models = (
        [] if args.no_hf or args.ragged else [m for m in args.hf_models.split(",") if any(c[0] == m for c in cells)]
    )
    deadline = time.time() + args.time_budget if args.time_budget else None
    ours_deadline = deadline - (args.hf_reserve if hf_models else 0) if deadline else None
    print(f"# e2e: {len(cells)} cells ({format_cells(cells)}); HF peer: {', '.join(hf_models) or 'off'}", flush=True)
    # A worker per run of same-model cells (clean GPU memory); the tiny models share one (each start costs seconds).
    for i, seg in enumerate([cells] if args.config == "tiny" else segments(cells)):
        extra = ["--reuse-ceilings"] if i else []
        rc = run_worker(args, argv, "ours", format_cells(seg), extra, ours_deadline)
        if rc == EXIT_NO_GPU:
            raise SystemExit(EXIT_NO_GPU)
        have = _cells_with_rows(args.out)
        for m, b, t in seg:  # a worker that died leaves its cells without a row
            for label in map(mesh_label, parse_meshes(args.mesh)):
                if (m, label, b, t) not in have:
                    append_row(
                        args.out,
                        dict(
                            model=m,
                            impl=label,
                            B=b,
                            prompt=t,
                            new_tokens=args.new_tokens,
                            error=f"worker exited with code {rc} before this cell",
                        ),
                    )
    for m in hf_models:
        rc = run_worker(args, argv, "hf", format_cells([c for c in cells if c[0] == m]), [], deadline)
        if rc != 0:
            bm.log(f"# HF peer {m}: worker exited with code {rc}")
    return report(os.path.join(args.out, CSV_NAME), args.out)


def run_worker(args, argv, kind: str, cells: str, extra, deadline) -> int:
    """Runs a worker in a fresh process (in this one with --in-process) -> its exit code. With a deadline, the
    worker starts no cell after it and is killed --cell-grace seconds after it."""
    extra = list(extra) + (["--deadline", repr(deadline)] if deadline else [])
    cmd = worker_command(argv, kind, cells=cells, extra=extra)
    if args.in_process:
        try:
            main(cmd[4:])
            return 0
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
    timeout = max(60.0, deadline - time.time() + args.cell_grace) if deadline else None
    try:
        return subprocess.run(cmd, env=worker_env(args), timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        bm.log(f"# {kind} worker ({cells}) killed after {timeout:.0f} s")
        return 124


# ------------------------------------------------------------------------------------------
# Report: table, CSV, plot
# ------------------------------------------------------------------------------------------
TABLE = [
    ("model", "model", "{}"),
    ("impl", "impl", "{}"),
    ("B", "B", "{}"),
    ("prompt", "prompt", "{}"),
    ("lengths", "lengths", "{}"),
    ("mtp", "mtp", "{}"),
    ("cold_compile_s", "cold compile s", "{:.1f}"),
    ("ttft_s", "warm TTFT s", "{:.3f}"),
    ("prefill_tok_s", "prefill tok/s", "{:.0f}"),
    ("prefill_mfu", "prefill MFU", "{:.1%}"),
    ("decode_ms_step", "decode ms/step", "{:.2f}"),
    ("decode_tok_s", "decode tok/s", "{:.0f}"),
    ("floor_ms", "floor ms", "{:.2f}"),
    ("x_floor", "x floor", "{:.2f}"),
    ("agree_one_device", "agree 1 dev", "{:.0%}"),
    ("note", "note", "{}"),
    ("error", "error", "{}"),
]


def report(csv_path: str, out_dir: str) -> list[dict]:
    """Prints the header (from the e2e_meta.json beside the CSV) and the table of the CSV; draws out_dir/e2e.png."""
    rows = bm.read_csv(csv_path) if os.path.exists(csv_path) else []
    meta = read_meta(os.path.dirname(os.path.abspath(csv_path)))
    ceil = meta.get("ceilings") or {}
    print()
    print(f"# e2e on {meta.get('device', '?')}, jax {meta.get('jax', '?')}, {meta.get('date', '?')}")
    print(f"# command: {meta.get('command', '?')}")
    if meta.get("compile_cache"):
        print(f"# persistent compilation cache on ({meta['compile_cache']}): cold compiles may be cache loads")
    if ceil:
        print(
            f"# ceilings: copy {ceil.get('bandwidth_gbps', float('nan')):.0f} GB/s, bf16 matmul "
            f"{ceil.get('matmul_tflops', float('nan')):.0f} TFLOP/s"
            + (f" ({ceil['method']})" if "method" in ceil else "")
        )
    clip = lambda v: v if not isinstance(v, str) or len(v) <= 70 else v[:67] + "..."  # noqa: E731
    bm.print_table([{k: clip(v) for k, v in r.items()} for r in rows], TABLE)
    if rows:
        os.makedirs(out_dir, exist_ok=True)
        plot(rows, os.path.join(out_dir, "e2e.png"), meta)
    return rows


def plot(rows, path, meta):
    fig, (ax_d, ax_p) = plt.subplots(1, 2, figsize=(13, 5))
    num = lambda r, k: isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)  # noqa: E731
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"ours": ("-", "o"), "hf": ("--", "s")}
    for i, (model, prompt) in enumerate(sorted({(r["model"], r["prompt"]) for r in rows})):
        c = colors[i % len(colors)]
        series = {(r["impl"], r.get("mtp") or "off") for r in rows if (r["model"], r["prompt"]) == (model, prompt)}
        for impl, mtp in sorted(series):
            pts = sorted(
                (
                    r
                    for r in rows
                    if (r["model"], r["prompt"], r["impl"], r.get("mtp") or "off") == (model, prompt, impl, mtp)
                ),
                key=lambda r: r["B"],
            )
            style, marker = styles.get(impl, ("-.", "^"))
            label = f"{model} T={prompt} {impl}" + (" MTP" if mtp == "on" else "")
            if mtp == "on":
                style, marker = "-.", "^"
            for ax, key in ((ax_d, "decode_ms_step"), (ax_p, "prefill_tok_s")):
                xy = [(r["B"], r[key]) for r in pts if num(r, key)]
                if xy:
                    ax.plot(*zip(*xy), style, marker=marker, color=c, label=label)
            if impl == "ours" and mtp == "off":
                xy = [(r["B"], r["floor_ms"]) for r in pts if num(r, "floor_ms")]
                if xy:
                    ax_d.plot(*zip(*xy), ":", color=c, label=f"{model} T={prompt} floor")
    for ax, ylabel, title in (
        (ax_d, "decode ms / step", "Decode step vs its weight+KV read floor"),
        (ax_p, "prefill tokens / s", "Prefill throughput"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"End to end, random weights, greedy, {meta.get('device', '?')}, jax {meta.get('jax', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# wrote {path}")


# ------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = bm.OneLineParser(
        prog="python -m benchmarks e2e", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="v2-lite,v3-cut", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument(
        "--batch", help=f"comma-separated batch sizes (default: {DEFAULT_BATCHES}; --config tiny: its cells)"
    )
    p.add_argument(
        "--prompt",
        help=f"comma-separated prompt lengths in tokens (default: {DEFAULT_PROMPTS}; --config tiny: its cells)",
    )
    p.add_argument(
        "--cells",
        default="",
        help='explicit cells in order, e.g. "v2-lite:1x1024,8x1024;v3-cut:1x1024" (overrides --batch/--prompt/--quick)',
    )
    p.add_argument("--quick", action="store_true", help="the reference cells: " + format_cells(QUICK_CELLS))
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (greedy)")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="main layers of every model (the V3 cut's default 5: 3 dense + 2 MoE; V2-Lite's 27)",
    )
    p.add_argument(
        "--config",
        choices=("full", "tiny"),
        default="full",
        help="tiny: ModelConfig.tiny()-sized models on a CPU (no GPU ceilings), in one worker process; without "
        f"--batch / --prompt / --cells its cells are {TINY_CELLS_TEXT}",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights and compute")
    p.add_argument(
        "--weights",
        choices=("bf16", "fp8"),
        default="bf16",
        help="bf16: every weight dense in --dtype; fp8: the projections and routed experts in FP8 as DeepSeek-V3 "
        "releases them (e4m3 + 128x128 block scales), compute in --dtype; one device",
    )
    p.add_argument(
        "--fp8-impl",
        choices=fp8_weights.FP8_GEMM_IMPLS,
        default="auto",
        help="--weights fp8: how FP8 projections called as modules compute (prefill-sized calls; auto: the Mosaic "
        "GPU FP8 GEMM on a Hopper GPU; reference: dequantize + XLA dot); decode reads the stacks by the kernels",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="bf16",
        help="the engine's page format; fp8: 656-byte tokens, fp4: 416-byte tokens, and the decode floor "
        "reads the planner's bytes a token of that format (default: bf16)",
    )
    p.add_argument(
        "--mtp",
        choices=("off", "on", "both"),
        default="off",
        help="speculative decoding with the MTP head, for models that have one",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        help="prompt tokens a row prefills per step (0: the engine's default, models.engine.default_prefill_chunk)",
    )
    p.add_argument(
        "--decode-steps", type=int, default=8, help="the engine's decode_steps: plain decode steps a device call runs"
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help=f"per decode step: kernels, CUPTI device time, host gap and the top kernels (a GPU; two more "
        f"generations of {KERNEL_TOKENS[0]} and {KERNEL_TOKENS[1]} new tokens a cell; kernels_<cell>.json)",
    )
    p.add_argument("--attention-impl", default="auto", help="the engine's attention_impl")
    p.add_argument(
        "--decode-config",
        default="",
        help="the engine's decode-kernel config, by a name of `mla-bench mla_decode --variants` (e.g. pieces, "
        "auto; default: the engine's, per sequence or in pieces chosen each step from the rows' lengths)",
    )
    p.add_argument(
        "--mesh",
        action="append",
        metavar="SPEC",
        help="run our cells on this device mesh (mla_jax.sharding.parse_mesh: e.g. tensor=2, expert=2, "
        "data=2 (a page pool a data rank), data=2,tensor=2), or 1 for one device; repeat it to run "
        "several in order, each with the model built straight into its shardings. Rows: impl "
        "ours@SPEC, agree_one_device = the greedy tokens' agreement with a one-device run of the "
        "same cell given before it (default: one device only)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    p.add_argument("--out", default="runs/bench_e2e", help="directory for e2e.csv / e2e.png / e2e_meta.json")
    p.add_argument("--ceiling-iters", type=int, default=30, help="CUPTI iterations of the ceiling measurements")
    p.add_argument("--time-budget", type=float, default=0, help="seconds after which no new cell starts (0: none)")
    p.add_argument("--hf-reserve", type=float, default=120, help="seconds of the budget kept for the HF peer")
    p.add_argument(
        "--cell-grace", type=float, default=300, help="seconds past the budget before a worker still running is killed"
    )
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers peer")
    p.add_argument(
        "--ragged",
        action="store_true",
        help=f"each cell's B prompts of lengths uniform in [T // {RAGGED_SHORTEST}, T] (a continuous-batching "
        "step's mix; the floor counts their mean; no HF peer)",
    )
    p.add_argument("--hf-models", default="v2-lite", help="models the HF peer runs (v3-cut: DeepseekV3ForCausalLM)")
    p.add_argument("--hf-attn", default="sdpa", help="HF attn_implementation (sdpa, eager, ...)")
    p.add_argument("--hf-cell-limit", type=float, default=60, help="seconds an HF cell may take")
    p.add_argument("--compile-cache", default="", help="enable JAX's persistent compilation cache in DIR")
    p.add_argument(
        "--ttft-subprocess",
        action="store_true",
        help="run the first cell twice in fresh processes with the persistent cache; report TTFT",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the workers in this process (debugging; JAX and torch then share the GPU)",
    )
    p.add_argument("--from-csv", help="no run: re-report an e2e.csv (with the e2e_meta.json beside it) into --out")
    # Set by the driver for its workers.
    for flag, kw in (
        ("--worker", dict(choices=("ours", "hf", "ttft"))),
        ("--deadline", dict(type=float)),
        ("--reuse-ceilings", dict(action="store_true")),
        ("--header-command", dict(default="")),
        ("--result-file", dict(default="")),
    ):
        p.add_argument(flag, help=argparse.SUPPRESS, **kw)
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.new_tokens < 2:
        raise SystemExit("e2e: error: --new-tokens must be >= 2 (one prefill token and at least one decode step)")
    try:
        parse_meshes(args.mesh)
    except ValueError as e:
        raise SystemExit(f"e2e: error: --mesh: {e}") from None
    if args.worker == "ours":
        return run_ours_worker(args)
    if args.worker == "hf":
        return run_hf_worker(args)
    if args.worker == "ttft":
        return run_ttft_worker(args)
    if args.from_csv:
        return report(args.from_csv, args.out)
    if args.ttft_subprocess:
        return run_ttft(args, argv)
    return drive(args, argv)


if __name__ == "__main__":
    main()
