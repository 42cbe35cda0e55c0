"""Multi-head Latent Attention (MLA), in both forms, with plain-jnp reference functions.

Dimension letters: B batch, T query tokens, S key tokens (cached + new), H heads,
N = qk_nope_head_dim, R = qk_rope_head_dim, V = v_head_dim, L = kv_lora_rank (latent),
D = hidden_size, Q = q_lora_rank.

Per token, MLA caches only the latent [kv_norm(c_kv) ; rope(k_pe)] (L + R values, 576 for V3),
shared by every head. Two ways to attend over it, equal up to rounding:
- decompressed (`absorbed=False`): up-project the latent to per-head K_nope and V with
  `wkv_b`, then ordinary attention with qk width N + R. Compute-friendly; training and long prefill.
- absorbed (`absorbed=True`): fold W_UK (the K half of `wkv_b`) into the query,
  q_lat = q_nope · W_UK (width L), attend over the latent itself (width L + R; V = the first L
  columns), and apply W_UV after attention. Reads only the latent; decode and short chunks.

Parameter names are the official code's (`wq_a`, `q_norm`, `wq_b` | `wq`, `wkv_a`, `kv_norm`,
`wkv_b`, `wo`); `models.checkpoint` maps the HF names onto them one to one. Kernels are
`nnx.Linear` kernels, i.e. the transpose [in, out] of torch's weight; with `weights="fp8"` each projection
is an `mla_jax.fp8_weights.Fp8Linear` (torch's [out, in] e4m3 + block scales; `wkv_b` dequantized where it
is used whole, `MLA.wkv_b_LHK`). Which implementation reads the latent cache and which path a cached call takes
are `mla_jax.cache_paths`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import fp8_weights, initializers
from mla_jax.cache_paths import cached_path, kernel_seq_lens
from mla_jax.config import ModelConfig
from mla_jax.flash_forms import _cudnn_causal_attention, _mgpu_causal_attention, _mgpu_prefill_attention
from mla_jax.kv_cache import UnfinishedLatent
from mla_jax.linear import Normed, Stacked, project, project_many
from mla_jax.norm import RMSNorm
from mla_jax.rope import apply_rope, rope_cos_sin, rope_frequencies
from pallas_kernels import backend, mla_decode
from pallas_kernels.head_matmul import (
    absorbed_query,
    absorbed_query_problems,
    stacked_head_matmul,
    stacked_head_matmul_problems,
)
from pallas_kernels.stacked_matmul import ANY_ROWS, Partials

_F32 = jnp.float32


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, a, b)` accumulated in float32 (`preferred_element_type`), as the tensor cores do
    with bf16 operands.

    XLA:CPU (jax 0.11.2) has no batched dot of bf16 operands into float32: a bf16 engine step with more
    than one query row failed with `UNIMPLEMENTED: ... DotThunk::Execute: BF16 x BF16 = F32`. So when the
    program is lowered for the CPU the operands are widened first: the same products (a product of two
    bf16 values is exact in float32), summed in float32. Other platforms (the GPU, cross-lowering for
    sm_90 included) keep the bf16 dot (`lax.platform_dependent` picks the branch per lowering platform).
    """

    def native(a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=_F32)

    if a.dtype == _F32 and b.dtype == _F32:
        return native(a, b)
    return jax.lax.platform_dependent(a, b, cpu=lambda a, b: native(a.astype(_F32), b.astype(_F32)), default=native)


# ------------------------------------------------------------------------------------------
# Reference functions (plain jnp)
# ------------------------------------------------------------------------------------------
def attention_mask(q_positions: jax.Array, kv_positions: jax.Array) -> jax.Array:
    """bool [B, T, S]: key s is visible to query t iff 0 <= kv_pos[s] <= q_pos[t] (causal; negative = padding)."""
    return (kv_positions[:, None, :] <= q_positions[:, :, None]) & (kv_positions[:, None, :] >= 0)


def _masked_softmax(scores_BHTS: jax.Array, mask_BTS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax over S in fp32 and its natural-log normaliser; rows with no visible key give p = 0, lse = -inf."""
    mask = mask_BTS[:, None]  # (B, 1, T, S)
    s = jnp.where(mask, scores_BHTS, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, jnp.log(jnp.where(denom[..., 0] > 0, denom[..., 0], 1.0)) + m[..., 0], -jnp.inf)
    return p, lse


def mla_decompressed_attention(
    q_nope: jax.Array,
    q_pe: jax.Array,
    kv_latent: jax.Array,
    wkv_b_LHK: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    *,
    softmax_scale: float,
    q_block: int | None = None,
    impl: str = "xla",
    cache_impl: str | None = None,
) -> jax.Array:
    """Decompressed MLA attention.

    q_nope [B,T,H,N], q_pe [B,T,H,R] (roped), kv_latent [B,S,L+R] ([normed c_kv ; roped k_pe]),
    wkv_b_LHK [L, H, N+V], positions int32 [B,T] / [B,S] (negative key positions are padding).
    Returns o [B,T,H,V] in q_nope's dtype. Scores and softmax in fp32.

    q_block (training): attend `q_block` queries at a time (T must be a multiple), each block under
    `jax.checkpoint`, so that neither pass holds more than a [B, H, q_block, S] slice of the fp32
    scores: the backward recomputes each block's scores instead of keeping all of them (at 16 x 4096
    tokens of V2-Lite, 16 GiB a copy). The same values as one block, in another summation order.

    impl: "xla" (the jnp above) or "cudnn" (training on a GPU): cuDNN's fused flash attention, forward and
    backward, which keeps the scores on chip (`q_block` is then moot). It is causal by token index, so it
    serves self-attention over right-padded rows only (positions 0..n-1, then -1; `positions_from_mask` of a
    right-padded mask): any other positions make the output NaN rather than silently wrong. "mgpu": the same
    contract with this project's Mosaic GPU flash attention (`pallas_kernels.flash_attention`, forward and
    backward kernels; a Hopper GPU); its padding queries give 0, as in the jnp form.

    cache_impl (the cached path): None, or the backend ("kernel" | "interpret" | "reference", a
    `pallas_kernels.backend` name) of a row's gathered cache: the keys are the row's cache, positions 0..n-1
    then -1, and the queries a chunk at consecutive positions p0.. then -1 (a prefill chunk after a cached
    prefix). impl="mgpu" then runs `pallas_kernels.flash_attention_prefill` (query offsets p0, key lengths n;
    forward only) with that backend; other positions give NaN; padding queries give 0. "cudnn" is refused
    there (its mask cannot be offset). The rows are attended a group at a time (`cached_rows_per_group`), so
    that no more than `CACHED_GROUP_BYTES` of keys and values are decompressed at once; the output is the one
    all rows at once give.
    """
    if impl not in DECOMPRESSED_IMPLS[1:]:
        raise ValueError(f"impl={impl!r}: must be one of {DECOMPRESSED_IMPLS[1:]} (resolve 'auto' first)")
    if cache_impl is not None and impl == "cudnn":
        raise ValueError("impl='cudnn' cannot attend over a cache (its causal mask has no query offset): use 'mgpu'")
    args = (q_nope, q_pe, kv_latent, q_positions, kv_positions)
    kw = dict(softmax_scale=softmax_scale, q_block=q_block, impl=impl, cache_impl=cache_impl)
    B, S = kv_latent.shape[:2]
    T = q_nope.shape[1] if impl == "xla" else 0  # the jnp form's float32 scores are the group's too
    g = B if cache_impl is None else cached_rows_per_group(B, S, *wkv_b_LHK.shape[1:], kv_latent.dtype.itemsize, T)
    if g == B:
        return _decompressed_attention(*args, wkv_b_LHK, **kw)
    # The cached path a group of rows at a time: a group's keys and values decompressed, attended, let go.
    groups = lambda x: x.reshape(B // g, g, *x.shape[1:])  # noqa: E731
    o = jax.lax.map(lambda a: _decompressed_attention(*a, wkv_b_LHK, **kw), tuple(groups(x) for x in args))
    return o.reshape(B, *o.shape[2:])


# The up-projected keys and values (S·H·(N + V) values a row, in the compute dtype; with the jnp form, its float32
# scores too) that a cached call's group of rows holds at once (`cached_rows_per_group`): a prefill chunk of 32
# rows over 2048-token tables of DeepSeek-V3 held 32 x 128 MiB of them at once, with their key and value copies
# 3.2 GiB of the step's 9.98 GiB of temporaries (compiled for an H100; 8 rows a group: 6.77 GiB).
CACHED_GROUP_BYTES = 1 << 30


def cached_rows_per_group(B: int, S: int, H: int, K: int, itemsize: int = 2, scores_T: int = 0) -> int:
    """Rows of a cached call (B rows over S cached keys, H heads of up-projected width K = N + V) that
    `mla_decompressed_attention` decompresses and attends together: the largest divisor of B whose rows'
    up-projected keys and values (S·H·K values of `itemsize` bytes a row) and float32 scores (H·`scores_T`·S a
    row: the jnp form's, of T queries; 0 for the flash kernels, which keep them on chip) fit `CACHED_GROUP_BYTES`,
    at least 1."""
    fit = max(1, CACHED_GROUP_BYTES // max(1, S * H * (K * itemsize + scores_T * 4)))
    return max(g for g in range(1, min(B, fit) + 1) if B % g == 0)


def _decompressed_attention(
    q_nope, q_pe, kv_latent, q_positions, kv_positions, wkv_b_LHK, *, softmax_scale, q_block, impl, cache_impl
):
    """`mla_decompressed_attention` over all of its rows at once (its arguments, checked)."""
    n = q_nope.shape[-1]
    L = wkv_b_LHK.shape[0]
    c_BSL, k_pe_BSR = kv_latent[..., :L], kv_latent[..., L:]
    kv_BSHK = jnp.einsum("bsl,lhk->bshk", c_BSL, wkv_b_LHK.astype(c_BSL.dtype))
    k_nope_BSHN, v_BSHV = kv_BSHK[..., :n], kv_BSHK[..., n:]
    # One score matmul over [nope ; rope], k_pe broadcast to every head (DeepSeek-V3's reference form):
    # a separate rope matmul, with no head axis on the key side, costs another pass over the [B,H,T,S]
    # scores (the whole layer took 2.5x as long on a CPU at 2048 tokens).
    q_BTHD = jnp.concatenate([q_nope, q_pe], axis=-1)
    k_pe_BSHR = jnp.broadcast_to(k_pe_BSR[:, :, None, :], (*k_nope_BSHN.shape[:3], k_pe_BSR.shape[-1]))
    k_BSHD = jnp.concatenate([k_nope_BSHN, k_pe_BSHR], axis=-1)

    if impl == "cudnn":
        return _cudnn_causal_attention(q_BTHD, k_BSHD, v_BSHV, q_positions, kv_positions, softmax_scale)
    if impl == "mgpu" and cache_impl is not None:
        return _mgpu_prefill_attention(q_BTHD, k_BSHD, v_BSHV, q_positions, kv_positions, softmax_scale, cache_impl)
    if impl == "mgpu":
        return _mgpu_causal_attention(q_BTHD, k_BSHD, v_BSHV, q_positions, kv_positions, softmax_scale)

    def attend(q_BTHD, q_pos_BT):
        scores = einsum_f32("bthd,bshd->bhts", q_BTHD, k_BSHD)
        p, _ = _masked_softmax(scores * softmax_scale, attention_mask(q_pos_BT, kv_positions))
        return einsum_f32("bhts,bshv->bthv", p.astype(v_BSHV.dtype), v_BSHV)

    B, T = q_BTHD.shape[:2]
    if q_block is None or q_block >= T:
        return attend(q_BTHD, q_positions).astype(q_nope.dtype)
    if q_block < 1 or T % q_block:
        raise ValueError(f"q_block={q_block} must be >= 1 and divide the {T} queries")
    nb = T // q_block
    blocks = lambda x: x.reshape(B, nb, q_block, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731
    o = jax.lax.map(jax.checkpoint(lambda a: attend(*a)), (blocks(q_BTHD), blocks(q_positions)))
    return o.swapaxes(0, 1).reshape(B, T, *o.shape[3:]).astype(q_nope.dtype)


# The decompressed (training / long prefill) attention: "auto" (`resolve_decompressed_impl`), the jnp form,
# cuDNN's flash attention, this project's Mosaic GPU flash attention.
DECOMPRESSED_IMPLS = ("auto", "xla", "cudnn", "mgpu")


def resolve_decompressed_impl(impl: str, *, dtype, on_mesh: bool = False, cache_impl: str | None = None) -> str:
    """`impl` of `DECOMPRESSED_IMPLS` -> "xla" | "cudnn" | "mgpu"; ValueError for another name.

    "auto": "mgpu" (`pallas_kernels.flash_attention`) when the compute `dtype` is bf16 on one Hopper GPU and
    no mesh is used (the kernels are not partitioned over a mesh), else "xla" (the jnp attention: fp32
    compute keeps fp32 scores, which the bf16 kernel would not). The flash forms need right-padded rows.

    `cache_impl` (the cached path's long chunks): the backend the cache is read with ("kernel" | "interpret"
    | "reference"). "auto" is then "mgpu" (`flash_attention_prefill`, run by that backend: the kernel, also
    when cross-lowered, or the interpreter) when the backend is a kernel one, the compute `dtype` bf16 and
    the pool not split over data ranks (`on_mesh`), else "xla"."""
    if impl not in DECOMPRESSED_IMPLS:
        raise ValueError(f"attention impl must be one of {DECOMPRESSED_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if cache_impl is not None:
        kernels = cache_impl in ("kernel", "interpret")
        return "mgpu" if kernels and jnp.dtype(dtype) == jnp.bfloat16 and not on_mesh else "xla"
    return "mgpu" if jnp.dtype(dtype) == jnp.bfloat16 and not on_mesh and backend.on_hopper() else "xla"


mla_naive_attention = mla_decompressed_attention  # the earlier name


def mla_absorbed_attention(
    q_abs: jax.Array,
    kv_latent: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    *,
    softmax_scale: float,
    kv_lora_rank: int,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA attention over the latent itself (the dense form of the decode kernel).

    q_abs [B,T,H,L+R] = [q_nope·W_UK ; q_pe], kv_latent [B,S,L+R]. Keys are the whole latent,
    values its first L columns. Returns (o_lat [B,T,H,L] in q's dtype, lse [B,T,H] float32,
    natural log; -inf for a query that sees no key).
    """
    scores = einsum_f32("bthc,bsc->bhts", q_abs, kv_latent) * softmax_scale
    p, lse = _masked_softmax(scores, attention_mask(q_positions, kv_positions))
    v_BSL = kv_latent[..., :kv_lora_rank]
    o = einsum_f32("bhts,bsl->bthl", p.astype(v_BSL.dtype), v_BSL)
    return o.astype(q_abs.dtype), lse.transpose(0, 2, 1)


# ------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------
class MLA(nnx.Module):
    """Multi-head Latent Attention: `mla(x [B,T,D], positions int32 [B,T], *, absorbed=False) -> [B,T,D]`.

    Causal over `positions` (a key is visible when its position is <= the query's; negative positions mark padding).

    With a latent cache (`mla_jax.kv_cache.KVCache`), `mla(x, positions, cache=cache) -> (out, cache)`: the layer
    writes this step's latents into its pages (pool `cache.layer`), then attends over the row's whole cache, prefix
    and itself, by the path `cached_path` picks (as DeepSeek-V3's reference `MLA.forward` does): the decode kernel on
    the pages, or the gathered prefix attended absorbed or decompressed. `absorbed` is ignored with a cache (the
    cache's threshold decides). The pieces are public: `project_q`, `project_kv` (what the cache stores),
    `absorb_query`, `output_from_latent`, `attend`. `weights`: the projections' format (`fp8_weights.WEIGHT_FORMATS`:
    None = `nnx.Linear` in `param_dtype`, "fp8" = `Fp8Linear`); norms stay in `param_dtype`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32, weights=None):
        self.cfg = cfg
        H, D = cfg.num_attention_heads, cfg.hidden_size
        lin = partial(
            fp8_weights.linear,
            weights=weights,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=initializers.normal(cfg.initializer_range),
            rngs=rngs,
        )
        if cfg.q_lora_rank is None:
            self.wq = lin(D, H * cfg.qk_head_dim)
        else:
            self.wq_a = lin(D, cfg.q_lora_rank)
            self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
            self.wq_b = lin(cfg.q_lora_rank, H * cfg.qk_head_dim)
        self.wkv_a = lin(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.wkv_b = lin(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.wo = lin(H * cfg.v_head_dim, D)

    # --- projections --------------------------------------------------------------------
    def project_q(
        self, x_BTD: jax.Array, positions_BT: jax.Array, stacked: Stacked | None = None, *, keep_splits: bool = False
    ) -> tuple[jax.Array | Partials, jax.Array]:
        """-> q_nope [B,T,H,N], q_pe [B,T,H,R] (roped). `stacked`: see `mla_jax.linear`. ``keep_splits``: where the
        last projection's kernel hands its split-K partials on, q_nope is those `Partials` of the whole per-head
        query [B,T,H,N+R] (q_nope its first N columns of each head), for `absorb_query` to sum as it loads them."""
        lin, keep = self._q_first(keep_splits)
        return self._query_from(project(lin, x_BTD, stacked, keep_splits=keep), positions_BT, stacked, keep_splits)

    def _q_first(self, keep_splits: bool):
        """The input's query projection and its keep_splits: `wq` as asked, or `wq_a` (its `Partials` go to wq_b)."""
        return (self.wq, keep_splits) if self.cfg.q_lora_rank is None else (self.wq_a, True)

    def project_q_kv(self, x_BTD, positions_BT, stacked: Stacked | None = None, *, keep_splits=False, unfinished=False):
        """(`project_q`, `project_kv`): wq or wq_a, and wkv_a, in one stacked launch where it serves both; the latent
        an `UnfinishedLatent` (``unfinished``, wkv_a's partials kept) for a cache that `finishes_latents`."""
        lin, keep = self._q_first(keep_splits)
        q, kv = project_many((lin, self.wkv_a), x_BTD, stacked, keep_splits=(keep, unfinished and ANY_ROWS))
        latent = self._latent_from(kv, positions_BT, stacked, unfinished)
        return self._query_from(q, positions_BT, stacked, keep_splits), latent

    def _query_from(self, q, positions_BT, stacked, keep_splits):
        """`project_q` from the first projection's result (`wq`'s, or `wq_a`'s, through q_norm and `wq_b`)."""
        cfg = self.cfg
        if cfg.q_lora_rank is not None:
            q_a = self.q_norm(q) if stacked is None else Normed(q, self.q_norm, stacked.index)
            q = project(self.wq_b, q_a, stacked, keep_splits=keep_splits)  # q_norm in wq_b's kernel where it serves
        shape = q.shape[:2] + (cfg.num_attention_heads, cfg.qk_head_dim)
        q_BTHK = q.total().reshape(shape) if isinstance(q, Partials) else q.reshape(shape)
        q_nope, q_pe = q_BTHK[..., : cfg.qk_nope_head_dim], q_BTHK[..., cfg.qk_nope_head_dim :]
        cos, sin = rope_cos_sin(cfg, positions_BT)
        q_pe = apply_rope(q_pe, cos, sin, interleave=cfg.rope_interleave)
        return (q.reshape(shape) if isinstance(q, Partials) else q_nope), q_pe

    def project_kv(self, x_BTD: jax.Array, positions_BT: jax.Array, stacked: Stacked | None = None) -> jax.Array:
        """-> the cached latent [B,T,L+R] = [kv_norm(c_kv) ; rope(k_pe)]."""
        return self._latent_from(project(self.wkv_a, x_BTD, stacked), positions_BT, stacked)

    def _latent_from(self, kv, positions_BT, stacked: Stacked | None = None, unfinished: bool = False):
        """`project_kv` from `wkv_a`'s result, or (``unfinished``) that result with the norm and RoPE to apply.
        kv_norm's weight is the layer's [K], or (a call whose cache `finishes_latents`) the stack's whole [L, K]."""
        w, rope = self.kv_norm.weight[...], rope_frequencies(self.cfg) + (self.cfg.rope_interleave,)
        latent = UnfinishedLatent(kv, w, None if w.ndim == 1 else stacked.index, self.kv_norm.eps, positions_BT, *rope)
        return latent if unfinished else latent.finish(weight_apart=stacked is not None)

    def _wkv_b_stack(self, stacked: Stacked | None, M: int, K: int, N: int, contract_rows: bool):
        """wkv_b's whole stack [L, R, H·(N+V)] when this call reads it in place with `stacked_head_matmul` (per-head
        products of M rows, K -> N; W_UV's ``contract_rows``), else None."""
        if stacked is None or not isinstance(self.wkv_b, nnx.Linear) or self.wkv_b.kernel[...].ndim != 3:
            return None
        problems = stacked_head_matmul_problems(M, self.cfg.num_attention_heads, K, N, contract_rows=contract_rows)
        return None if problems else self.wkv_b.kernel[...]

    def wkv_b_LHK(self, stacked: Stacked | None = None) -> jax.Array:
        """wkv_b as [L, H, N+V]: per head, the K_nope columns then the V columns (W_UK ; W_UV); an FP8 wkv_b
        dequantized to the compute dtype; a whole stack's (`stacked`) layer `stacked.index`."""
        cfg = self.cfg
        kernel = fp8_weights.dense_kernel(self.wkv_b)
        if kernel.ndim == 3:
            kernel = jax.lax.dynamic_index_in_dim(kernel, stacked.index, axis=0, keepdims=False)
        return kernel.reshape(cfg.kv_lora_rank, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)

    def absorb_query(self, q_nope, q_pe: jax.Array, stacked: Stacked | None = None) -> jax.Array:
        """[q_nope · W_UK ; q_pe] -> [B,T,H,L+R]: the query the absorbed path / decode kernel takes. q_nope
        [B,T,H,N], or `project_q`'s `Partials` of the whole per-head query (its first N columns of each head)."""
        cfg = self.cfg
        N = cfg.qk_nope_head_dim
        B, T, H, _ = q_nope.shape
        whole = self._wkv_b_stack(stacked, B * T, N, cfg.kv_lora_rank, contract_rows=False)
        if whole is not None:  # W_UK of the stack's layer, read in place
            kw = dict(col_offset=0, contract_rows=False, impl=stacked.impl, k_cols=N)
            q_lat = stacked_head_matmul(q_nope.reshape(B * T, H, q_nope.shape[-1]), whole, stacked.index, **kw)
            q_lat = q_lat.reshape(B, T, H, cfg.kv_lora_rank)
            return jnp.concatenate([q_lat.astype(q_pe.dtype), q_pe], axis=-1)
        if isinstance(q_nope, Partials):
            q_nope = q_nope.total()[..., :N]
        if isinstance(self.wkv_b, fp8_weights.Fp8Linear):  # W_UK alone, in the stored layout [H, N, L]
            w_uk_HNL = fp8_weights.dequantize_group_rows(self.wkv_b, cfg.num_attention_heads, 0, N)
            q_lat = einsum_f32("bthn,hnl->bthl", q_nope, w_uk_HNL.astype(q_nope.dtype))
        else:
            w_uk_LHN = self.wkv_b_LHK(stacked)[..., :N]
            q_lat = einsum_f32("bthn,lhn->bthl", q_nope, w_uk_LHN.astype(q_nope.dtype))
        return jnp.concatenate([q_lat.astype(q_pe.dtype), q_pe], axis=-1)

    def _decode_query(self, q_nope, q_pe, positions_BT, stacked: Stacked | None, cache):
        """The decode kernel's query (`absorb_query`'s) in bf16, the pages' own dtype or what fp8 pages dequantise to;
        as `QueryRows` in one launch where `absorbed_query` serves (W_UK read in place, q_pe rotated beside it from
        `project_q`'s `Partials`, the rows padded as the kernel takes them; bf16 pages, one pool)."""
        cfg = self.cfg
        B, T, H, _ = q_nope.shape
        N, R, L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q_dtype = jnp.bfloat16 if cache.quantized else cache.pages.dtype
        whole = self._wkv_b_stack(stacked, B * T, N, L, contract_rows=False)
        serves = cache.data_parallel is None and not absorbed_query_problems(B, T, H, N, R, L)
        if whole is not None and isinstance(q_nope, Partials) and q_dtype == jnp.bfloat16 and serves:
            inv_freq, scale = rope_frequencies(cfg)
            kw = dict(heads=H, nope=N, rope_scale=scale, interleave=cfg.rope_interleave, impl=stacked.impl)
            return absorbed_query(q_nope, whole, stacked.index, positions_BT, inv_freq, **kw)
        return self.absorb_query(q_nope, q_pe, stacked).astype(q_dtype)

    def output_from_latent(self, o_lat_BTHL: jax.Array, stacked: Stacked | None = None, keep_splits=False) -> jax.Array:
        """Un-absorb W_UV and apply the output projection: [B,T,H,L] (or a decode call's `SplitPartials`) -> [B,T,D]
        (``keep_splits``: `wo`'s `Partials` where its kernel has them)."""
        cfg = self.cfg
        N, V = cfg.qk_nope_head_dim, cfg.v_head_dim
        B, T, H, L = o_lat_BTHL.shape
        whole = self._wkv_b_stack(stacked, B * T, L, V, contract_rows=True)
        if whole is not None:  # W_UV of the stack's layer, read in place
            o = stacked_head_matmul(
                o_lat_BTHL.reshape(B * T, H, L),
                whole,
                stacked.index,
                col_offset=N,
                contract_rows=True,
                width=V,
                impl=stacked.impl,
                keep_splits=True,
            )
            o = o.reshape(B, T, H * V)  # its Partials: summed by wo's kernel as it loads them, no launch between
        elif isinstance(self.wkv_b, fp8_weights.Fp8Linear):  # W_UV alone, in the stored layout [H, V, L]
            w_uv_HVL = fp8_weights.dequantize_group_rows(self.wkv_b, H, N, N + V)
            o = einsum_f32("bthl,hvl->bthv", o_lat_BTHL, w_uv_HVL.astype(o_lat_BTHL.dtype))
        else:
            w_uv_LHV = self.wkv_b_LHK(stacked)[..., N:]
            o = einsum_f32("bthl,lhv->bthv", o_lat_BTHL, w_uv_LHV.astype(o_lat_BTHL.dtype))
        if not isinstance(o, Partials):
            o = o.astype(o_lat_BTHL.dtype).reshape(B, T, H * V)
        return project(self.wo, o, stacked, keep_splits=keep_splits)

    # --- attention ----------------------------------------------------------------------
    def attend(
        self,
        q_nope: jax.Array,
        q_pe: jax.Array,
        kv_latent: jax.Array,
        q_positions: jax.Array,
        kv_positions: jax.Array,
        *,
        absorbed: bool,
        q_block: int | None = None,
        attn_impl: str = "xla",
        stacked: Stacked | None = None,
        cache_impl: str | None = None,
    ) -> jax.Array:
        """Attend queries over a latent context (this chunk and/or a cached prefix) -> [B,T,D]; `attn_impl`
        and `cache_impl`: `mla_decompressed_attention`'s `impl` and `cache_impl` (absorbed=False)."""
        cfg = self.cfg
        if absorbed:
            o_lat, _ = mla_absorbed_attention(
                self.absorb_query(q_nope, q_pe, stacked),
                kv_latent,
                q_positions,
                kv_positions,
                softmax_scale=cfg.softmax_scale,
                kv_lora_rank=cfg.kv_lora_rank,
            )
            return self.output_from_latent(o_lat, stacked)
        o_BTHV = mla_decompressed_attention(
            q_nope,
            q_pe,
            kv_latent,
            self.wkv_b_LHK(stacked),
            q_positions,
            kv_positions,
            softmax_scale=cfg.softmax_scale,
            q_block=q_block,
            impl=attn_impl,
            cache_impl=cache_impl,
        )
        return project(self.wo, o_BTHV.reshape(o_BTHV.shape[:2] + (-1,)), stacked)

    def cached_path(self, T: int, cache) -> str:
        """The path a cached call of T query tokens a row takes: `cached_path` for this layer's model."""
        return cached_path(self.cfg, T, cache)

    def cached_attention(self, x_BTD, positions_BT, cache, stacked: Stacked | None = None, keep_splits=False):
        """Write this step's latents into the cache, then attend over it -> (out [B,T,D], cache) (`keep_splits`: see
        `output_from_latent`)."""
        cfg = self.cfg
        rope_pos = jnp.maximum(positions_BT, 0)  # padding rows get any valid rope position; never seen
        path = self.cached_path(x_BTD.shape[1], cache)
        # The decode kernel's query: W_UK reads q_nope from the last projection's partials (`absorb_query`). A decode-
        # sized call of a scanned stack: the latent's norm and RoPE in the page write's kernel, where it serves.
        unfinished = stacked is not None and cache.finishes_latents(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        kw = dict(keep_splits=path == "decode_kernel", unfinished=unfinished)
        (q_nope, q_pe), latent = self.project_q_kv(x_BTD, rope_pos, stacked, **kw)
        cache = cache.write(latent, positions_BT)
        if path == "decode_kernel":
            q_BTHC = self._decode_query(q_nope, q_pe, positions_BT, stacked, cache)
            merged = x_BTD.shape[0] == 1 and cache.data_parallel is None  # W_UV's kernel merges the splits
            merged = merged and self._wkv_b_stack(stacked, 1, cfg.kv_lora_rank, cfg.v_head_dim, True) is not None

            def decode(pages, table, page_offset, q, seq_lens):  # the whole pool, or a data rank's (map_pages)
                return mla_decode(
                    q,
                    pages,
                    table,
                    seq_lens,
                    softmax_scale=cfg.softmax_scale,
                    causal=True,
                    page_format=cache.page_format,
                    impl=cache.impl,
                    config=cache.decode_config,
                    schedule=None if plan is None else plan.schedule,  # None: planned here
                    split_partials=merged,
                    page_offset=page_offset,
                )[0]

            plan = cache.decode_plan  # the call's (`with_decode_plan`), or None: this call's own
            seq_lens = kernel_seq_lens(cache, positions_BT) if plan is None else plan.seq_lens
            o_lat = cache.map_pages(decode, q_BTHC, seq_lens)
            return self.output_from_latent(o_lat.astype(x_BTD.dtype), stacked, keep_splits), cache
        ctx_BSC, kv_pos_BS = cache.gather(dtype=x_BTD.dtype)
        attn_impl = "xla"
        if path == "decompressed":
            on_mesh = cache.data_parallel is not None
            attn_impl = resolve_decompressed_impl("auto", dtype=x_BTD.dtype, on_mesh=on_mesh, cache_impl=cache.impl)
        out = self.attend(
            q_nope,
            q_pe,
            ctx_BSC,
            positions_BT,
            kv_pos_BS,
            absorbed=path == "absorbed",
            attn_impl=attn_impl,
            cache_impl=cache.impl,
            stacked=stacked,
        )
        return out, cache

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        *,
        absorbed: bool = False,
        cache=None,
        q_block: int | None = None,
        attn_impl: str = "xla",
        stacked: Stacked | None = None,
        keep_splits: bool = False,
    ):
        if x_BTD.ndim != 3 or x_BTD.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"MLA expects x [B, T, {self.cfg.hidden_size}], got {x_BTD.shape}")
        if positions_BT.shape != x_BTD.shape[:2]:
            raise ValueError(f"positions must be [B, T] = {x_BTD.shape[:2]}, got {positions_BT.shape}")
        if cache is not None:
            return self.cached_attention(x_BTD, positions_BT, cache, stacked, keep_splits)
        q_nope, q_pe = self.project_q(x_BTD, positions_BT, stacked)
        kv_latent = self.project_kv(x_BTD, positions_BT, stacked)
        return self.attend(
            q_nope,
            q_pe,
            kv_latent,
            positions_BT,
            positions_BT,
            absorbed=absorbed,
            q_block=q_block,
            attn_impl=attn_impl,
            stacked=stacked,
        )
