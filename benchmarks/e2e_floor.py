"""The arithmetic behind `mla-bench e2e`'s ratio columns: parameter counts, the decode step's weight + KV read
floor, prefill FLOPs and MFU (pure functions of the `ModelConfig`), and `derive`, which adds those columns to a
measured row; `cpu_ceilings` stands in for the GPU's copy and matmul ceilings (`benchmarks.measure_ceilings`) on
a CPU. The formulas are spelt out in `benchmarks.bench_e2e`'s docstring (the command's ``--help``)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from mla_jax.capacity import latent_bytes_per_token_layer

FP8_BYTES = 1 + 4 / 128**2  # an e4m3 weight and its share of its block's fp32 scale


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
    """Useful FLOPs of prefilling B prompts of T tokens (spelt out in `benchmarks.bench_e2e`'s docstring).

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
# Ceilings on a CPU
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
