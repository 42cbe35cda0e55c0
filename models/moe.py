"""Mixture of experts: DeepSeek-V2/V3 routers, stacked routed experts run as a grouped GEMM, shared experts.

Dimension letters: B batch, T tokens (B·T flattened where noted), D hidden_size,
E routed experts, G expert groups, K experts per token (top-k), I moe_intermediate_size,
M = T·K (token, expert) assignment rows, sorted by expert for the grouped GEMM.

Routing (DEEPSEEK_SEMANTICS.md §2), always in fp32:
- V3 `noaux_tc`: s = sigmoid(x·Wᵀ). The correction bias b is added ONLY to choose experts:
  group score = sum of the top-2 of (s + b) in the group, the best `topk_group` groups are kept
  (the others −inf), top-k of (s + b). The weights are the UNBIASED s of the chosen experts,
  divided by (their sum + 1e-20) when `norm_topk_prob`, times `routed_scaling_factor`.
- V2 `greedy` / `group_limited_greedy`: s = softmax(x·Wᵀ); top-k (after keeping the groups with the
  largest max score); times `routed_scaling_factor`; never renormalised (HF ignores
  `norm_topk_prob` for V2).

Routed experts are stored stacked (`gate_proj`/`up_proj` [E, D, I], `down_proj` [E, I, D]) and run
over the assignments sorted by expert with no token dropping. `impl` picks the grouped GEMM:
"ragged_dot" (`jax.lax.ragged_dot`, portable, differentiable), "mgpu" (the Pallas Mosaic GPU
kernel `ragged_dot_mgpu`, tiled for prefill and training: its gradient runs through Mosaic GPU
grouped GEMMs too, the weights' through jax's `transposed_ragged_dot`), "decode"
(`pallas_kernels.moe_decode`: few rows per expert, each chosen expert's weights read once; forward
only, its gradient `lax.ragged_dot`'s; its `ragged_dot` reference off a Hopper GPU; FP8 experts through
`moe_decode_fp8`, their e4m3 bytes read in place and converted in registers), "dense"
(`moe_dense_reference`: every expert on every token, the oracle), or "auto": on a Hopper GPU with
bf16 compute, "decode" when a call has at most `DECODE_ROWS_PER_EXPERT` assignment rows per expert
on average (decode steps) and "mgpu" otherwise; elsewhere "ragged_dot". On "decode" the routing after the
logits (scores, top-k, the sort by expert) is one kernel, `pallas_kernels.moe_route`, where it serves the call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as jax_ragged_dot_mgpu
from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
from jax.sharding import PartitionSpec

from mla_jax import fp8_weights, initializers
from mla_jax.config import ModelConfig
from mla_jax.linear import Stacked
from models.fp8_experts import Fp8Experts, dequantize_experts, fp8_grouped
from models.mlp import MLP
from pallas_kernels import (
    DecodeRoute,
    RouteSpec,
    backend,
    moe_decode,
    moe_decode_fp8,
    moe_decode_fp8_problems,
    moe_decode_problems,
    moe_decode_reference,
    moe_route,
    moe_route_problems,
    route_reference,
    route_scores,
)
from pallas_kernels.moe_decode import SHARED_MAX_ROWS, SharedExperts
from pallas_kernels.moe_route import moe_route_is_fast

_F32 = jnp.float32
MOE_IMPLS = ("auto", "ragged_dot", "mgpu", "decode", "dense")
MOE_TRAINING_IMPLS = tuple(i for i in MOE_IMPLS if i != "decode")  # "decode" is a forward kernel for few rows
DECODE_ROWS_PER_EXPERT = 16  # `pallas_kernels.moe_decode` reads each expert once up to 16 rows


class RouterBias(nnx.Variable):
    """The aux-loss-free load-balancing bias (HF `e_score_correction_bias`), fp32 [E].

    Not an `nnx.Param`: it only enters a top-k, so no gradient reaches it; it is changed by
    `models.training.step.router_bias_update` outside the optimizer.
    """


class RouterOutput(NamedTuple):
    """What a router decided for T tokens.

    weights [T, K] fp32: the gate values that multiply the chosen experts' outputs.
    indices [T, K] int32: the chosen experts (order: descending biased score).
    scores  [T, E] fp32: the unbiased affinities (sigmoid for V3, softmax for V2), what the
            sequence-wise balance loss normalises into P.
    """

    weights: jax.Array
    indices: jax.Array
    scores: jax.Array


# ------------------------------------------------------------------------------------------
# Routing functions (pure): the rules live in `pallas_kernels.moe_route`
# ------------------------------------------------------------------------------------------
def route(logits_TE: jax.Array, bias_E: jax.Array | None, cfg: ModelConfig) -> RouterOutput:
    """Pick K experts per token from router logits [T, E] (fp32); see the module docstring for the rules
    (`pallas_kernels.moe_route.route_reference`).

    `bias_E` (fp32 [E]) is used by `noaux_tc` only and must be None for the V2 methods.
    """
    return RouterOutput(*route_reference(logits_TE, bias_E, spec=RouteSpec.from_config(cfg)))


class Router(nnx.Module):
    """The gate: `router(x [T, D]) -> RouterOutput`. Logits x·Wᵀ in fp32.

    `kernel` [D, E] fp32 (HF `mlp.gate.weight` [E, D], transposed); `e_score_correction_bias`
    (a `RouterBias`, fp32 [E], zeros at init) exists only for `noaux_tc`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        E, D = cfg.n_routed_experts, cfg.hidden_size
        # HF keeps gate.weight and the bias in fp32 whatever the model dtype (_keep_in_fp32_modules_strict).
        self.kernel = nnx.Param(initializers.normal(cfg.initializer_range)(rngs.params(), (D, E), _F32))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = RouterBias(jnp.zeros((E,), _F32))
        else:
            self.e_score_correction_bias = None

    def logits(self, x_TD: jax.Array) -> jax.Array:
        """[T, D] -> fp32 [T, E]."""
        return jnp.dot(x_TD.astype(_F32), self.kernel[...], precision=jax.lax.Precision.HIGHEST)

    def bias(self) -> jax.Array | None:
        """The correction bias fp32 [E] (`noaux_tc`), else None."""
        return None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]

    def __call__(self, x_TD: jax.Array) -> RouterOutput:
        return route(self.logits(x_TD), self.bias(), self.cfg)

    def decode(self, x_TD: jax.Array, impl: str | None = None) -> tuple[RouterOutput, DecodeRoute]:
        """`__call__`'s routing through `pallas_kernels.moe_route` (`impl`: its backend), with the assignments
        sorted by expert for `moe_grouped`'s decode impls. Forward only."""
        logits_TE = self.logits(x_TD)
        spec = RouteSpec.from_config(self.cfg)
        r = moe_route(logits_TE, self.bias(), spec=spec, impl=impl)
        return RouterOutput(r.weights_TK, r.indices_TK, route_scores(logits_TE, spec)), r


# ------------------------------------------------------------------------------------------
# Expert computation: the dense reference and the grouped GEMM
# ------------------------------------------------------------------------------------------
def moe_dense_reference(
    x_TD: jax.Array,
    weights_TK: jax.Array,
    indices_TK: jax.Array,
    gate_EDI: jax.Array,
    up_EDI: jax.Array,
    down_EID: jax.Array,
) -> jax.Array:
    """Σ_k w_k · expert_{idx_k}(x), computing every expert on every token (one-hot einsum). -> [T, D] in x's dtype.

    O(T·E) work: the oracle for `moe_grouped`, and fine for tiny models.
    """
    E = gate_EDI.shape[0]
    combine_TE = jnp.sum(jax.nn.one_hot(indices_TK, E, dtype=_F32) * weights_TK.astype(_F32)[..., None], axis=1)
    g_TEI = jnp.einsum("td,edi->tei", x_TD, gate_EDI.astype(x_TD.dtype))
    u_TEI = jnp.einsum("td,edi->tei", x_TD, up_EDI.astype(x_TD.dtype))
    y_TED = jnp.einsum("tei,eid->ted", jax.nn.silu(g_TEI) * u_TEI, down_EID.astype(x_TD.dtype))
    return jnp.einsum("te,ted->td", combine_TE, y_TED.astype(_F32)).astype(x_TD.dtype)


@dataclasses.dataclass(frozen=True)
class MgpuTuning:
    """Tile sizes of `ragged_dot_mgpu` (PALLAS_MGPU.md §10: 128/128/64/4/4 is near the best on H200)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 4


def _mgpu_forward(
    lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, tuning: MgpuTuning, transpose_rhs: bool = False
) -> jax.Array:
    """lhs [M, K] @ rhs[g] per row group -> [M, N]; with ``transpose_rhs`` rhs is [G, N, K] and read
    transposed (the gradient with respect to lhs)."""
    M, Kd = lhs_MK.shape
    N = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[-1]
    dt = lhs_MK.dtype
    rhs_GKN = rhs_GKN.astype(dt)  # the kernel needs lhs.dtype == rhs.dtype
    # Pad the contraction to a multiple of block_k (zeros add nothing), N to block_n, M to block_m.
    pk = -Kd % tuning.block_k
    pn = -N % tuning.block_n
    pm = -M % tuning.block_m
    lhs = jnp.pad(lhs_MK, ((0, pm), (0, pk)))
    rhs = jnp.pad(rhs_GKN, ((0, 0), (0, pn), (0, pk)) if transpose_rhs else ((0, 0), (0, pk), (0, pn)))
    out = jax_ragged_dot_mgpu.ragged_dot(
        lhs,
        rhs,
        group_sizes=group_sizes_G.astype(jnp.int32),
        block_m=tuning.block_m,
        block_n=tuning.block_n,
        block_k=tuning.block_k,
        max_concurrent_steps=tuning.max_concurrent_steps,
        grid_block_n=tuning.grid_block_n,
        transpose_rhs=transpose_rhs,
    )
    # Rows past sum(group_sizes) are never written by the kernel (garbage): mask them.
    rows = jnp.arange(out.shape[0])[:, None]
    out = jnp.where(rows < jnp.sum(group_sizes_G), out, jnp.zeros((), out.dtype))
    return out[:M, :N]


def _mgpu_weight_gradient(
    lhs_MK: jax.Array, g_MN: jax.Array, group_sizes_G: jax.Array, tuning: MgpuTuning
) -> jax.Array:
    """[G, K, N]: lhs[rows of g]ᵀ · g[rows of g] for each row group g (the gradient of `ragged_dot`
    with respect to its stacked weights), through jax's Mosaic GPU `transposed_ragged_dot`. Groups
    with no rows give zeros (the kernel skips them and leaves their output unwritten)."""
    M, Kd = lhs_MK.shape
    N = g_MN.shape[1]
    # The row (contraction) axis is cut in block_k blocks at the groups' edges, masked inside the
    # kernel; K and N pad to its output tiles.
    pr = -M % tuning.block_k
    pk = -Kd % tuning.block_m
    pn = -N % tuning.block_n
    lhs = jnp.pad(lhs_MK, ((0, pr), (0, pk)))
    g = jnp.pad(g_MN.astype(lhs_MK.dtype), ((0, pr), (0, pn)))
    out = transposed_ragged_dot_mgpu.transposed_ragged_dot(
        lhs,
        g,
        group_sizes=group_sizes_G.astype(jnp.int32),
        block_m=tuning.block_m,
        block_n=tuning.block_n,
        block_k=tuning.block_k,
        max_concurrent_steps=tuning.max_concurrent_steps,
        grid_block_n=tuning.grid_block_n,
    )
    out = jnp.where((group_sizes_G > 0)[:, None, None], out, jnp.zeros((), out.dtype))
    return out[:, :Kd, :N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def ragged_dot_mgpu(
    lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, tuning: MgpuTuning = MgpuTuning()
) -> jax.Array:
    """`lax.ragged_dot` semantics through the Mosaic GPU kernel: lhs [M, K], rhs [G, K, N] -> [M, N] in lhs's dtype.

    Rows at or past sum(group_sizes) come back as zeros. The gradient runs through Mosaic GPU
    kernels too: d lhs = g · rhs[group]ᵀ (`ragged_dot` with the weights read transposed) and
    d rhs = jax's `transposed_ragged_dot` (lhsᵀ · g per group), both in lhs's dtype with fp32
    accumulation. (`lax.ragged_dot`'s own gradient lowers on XLA:GPU to a dense masked
    [G, rows, K] operand: 64x the weight gradient's work, and the 96 GiB buffer that kept 16 x 4096
    tokens of V2-Lite from fitting an H200.)
    """
    return _mgpu_forward(lhs_MK, rhs_GKN, group_sizes_G, tuning)


def _mgpu_fwd(lhs, rhs, gs, tuning):
    return _mgpu_forward(lhs, rhs, gs, tuning), (lhs, rhs, gs)


def _mgpu_bwd(tuning, res, g):
    lhs, rhs, gs = res
    g = g.astype(lhs.dtype)
    d_lhs = _mgpu_forward(g, rhs, gs, tuning, transpose_rhs=True)
    d_rhs = _mgpu_weight_gradient(lhs, g, gs, tuning)
    return d_lhs, d_rhs.astype(rhs.dtype), None


ragged_dot_mgpu.defvjp(_mgpu_fwd, _mgpu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _experts_decode(
    x_MD, gate_EDI, up_EDI, down_EID, group_sizes_E, expert_offset, kernel_impl, shared=None, layout=None
):
    """silu(x W_g) * (x W_u) W_d per row's expert through `pallas_kernels.moe_decode` -> f32 [M, D]; the
    gradient is `lax.ragged_dot`'s (the kernel is forward only). `shared` (x_TD, `SharedExperts`): the shared
    experts too, in the same launches -> (f32 [M, D], f32 [T, D]). `layout` (None, or (group_starts_E,
    expert_programs) of a `pallas_kernels.moe_route.DecodeRoute`): the rows' layout, already computed."""
    xs, sh = (None, None) if shared is None else shared
    starts, programs = (None, None) if layout is None else layout
    return moe_decode(
        x_MD,
        group_sizes_E,
        gate_EDI,
        up_EDI,
        down_EID,
        expert_offset=expert_offset,
        impl=kernel_impl,
        shared=sh,
        x_shared_TD=xs,
        group_starts_E=starts,
        expert_programs=programs,
    )


def _experts_decode_fwd(x, g, u, d, gs, off, kernel_impl, shared=None, layout=None):
    return _experts_decode(x, g, u, d, gs, off, kernel_impl, shared, layout), (x, g, u, d, gs, off, shared)


def _experts_decode_bwd(kernel_impl, res, ct):
    x, g, u, d, gs, off, shared = res
    if shared is None:
        _, vjp = jax.vjp(lambda *w: moe_decode_reference(w[0], gs, *w[1:], expert_offset=off), x, g, u, d)
        return (*vjp(ct.astype(jnp.float32)), None, None, None, None)
    xs, sh = shared

    def ref(x, g, u, d, xs, sg, su, sd):
        s = sh._replace(gate_LDS=sg, up_LDS=su, down_LSD=sd)
        return moe_decode_reference(x, gs, g, u, d, expert_offset=off, shared=s, x_shared_TD=xs)

    _, vjp = jax.vjp(ref, x, g, u, d, xs, sh.gate_LDS, sh.up_LDS, sh.down_LSD)
    dx, dg, du, dd, dxs, dsg, dsu, dsd = vjp(tuple(c.astype(jnp.float32) for c in ct))
    shared_ct = (dxs, sh._replace(gate_LDS=dsg, up_LDS=dsu, down_LSD=dsd, layer=None))
    return dx, dg, du, dd, None, None, shared_ct, None


_experts_decode.defvjp(_experts_decode_fwd, _experts_decode_bwd)


def resolve_moe_impl(
    impl: str,
    dtype,
    rows: int | None = None,
    num_experts: int | None = None,
    widths: tuple[int, int] | None = None,
    *,
    training: bool = False,
    fp8: bool = False,
    stack_experts: int | None = None,
) -> str:
    """Map `impl` ("auto" included) to "ragged_dot" | "mgpu" | "decode" | "dense"; ValueError on an unknown
    name. `rows` (assignments, T·K), `num_experts` and `widths` (D, I) let "auto" pick the decode kernel
    (`moe_decode_fp8`'s limits for FP8 experts, `fp8=True`, with `stack_experts` the experts of the stack it would
    read: one it cannot index goes to the chunked grouped GEMM, not to its reference, which dequantizes the
    layer whole).

    "auto": on a Hopper GPU with bf16 compute, "decode" for calls of at most `DECODE_ROWS_PER_EXPERT` rows
    an expert on average that `moe_decode` serves, else "mgpu"; elsewhere "ragged_dot", except for training
    (`training=True`, the names of `MOE_TRAINING_IMPLS`) on a CPU: "dense", whose gradient XLA:CPU runs
    faster than `ragged_dot`'s at the small expert counts trained there."""
    names = MOE_TRAINING_IMPLS if training else MOE_IMPLS
    if impl not in names:
        raise ValueError(f"MoE impl must be one of {names}, got {impl!r}")
    if impl != "auto":
        return impl
    if training and jax.default_backend() == "cpu":
        return "dense"
    if not (jnp.dtype(dtype) == jnp.bfloat16 and backend.on_hopper()):
        return "ragged_dot"
    if not training and rows is not None and num_experts and rows <= DECODE_ROWS_PER_EXPERT * num_experts:
        if widths is None:
            return "decode"
        if not (moe_decode_fp8_problems(*widths, experts=stack_experts) if fp8 else moe_decode_problems(*widths)):
            return "decode"
    return "mgpu"


def moe_grouped(
    x_TD: jax.Array,
    weights_TK: jax.Array,
    indices_TK: jax.Array,
    gate_EDI: jax.Array,
    up_EDI: jax.Array,
    down_EID: jax.Array,
    *,
    impl: str = "ragged_dot",
    tuning: MgpuTuning = MgpuTuning(),
    num_experts: int | None = None,
    expert_offset=None,
    scales=None,
    decode_impl: str | None = None,
    shared: SharedExperts | None = None,
    route: DecodeRoute | None = None,
) -> jax.Array:
    """Σ_k w_k · expert_{idx_k}(x) as a grouped GEMM over the T·K assignments sorted by expert. -> [T, D].

    No token dropping: every assignment is computed. `impl` is "ragged_dot", "mgpu", "decode" or
    "decode_interpret" (the decode kernel in the Pallas interpreter); the result equals
    `moe_dense_reference` up to rounding.

    The weights may hold several layers' experts, flattened ([L·E, D, I]): then `num_experts` = E
    and this call uses experts [expert_offset, expert_offset + E) (a traced layer · E). The decode
    kernel and FP8 experts read them in place; the other impls take that slice first.

    An assignment to an expert id >= E contributes nothing (its rows sort last, past every group):
    an expert-parallel rank passes E = its own experts and the others' ids as E.

    `scales` (gate, up, down; fp32 [E, nb, kb]): the experts are FP8 as released (`Fp8Experts.blocks`: gate/up
    [E, I, D], down [E, D, I] e4m3; no gradient), run by `pallas_kernels.moe_decode_fp8` on the decode impls, read
    in place, and by `models.fp8_experts.fp8_grouped` on the others, dequantized a chunk of columns at a time
    (never a whole layer's experts, nor a stack's: the stack is read at `expert_offset` in place).
    `decode_impl`: the decode kernel's `pallas_kernels.backend` impl (None: "auto"; "decode_interpret" is
    "interpret").
    `shared` (`pallas_kernels.moe_decode.SharedExperts`; decode impls and bf16 experts only): the shared experts
    run inside the decode kernel's two launches, and the result is routed + shared (summed in fp32, rounded once).
    `route` (decode impls only): these assignments already sorted by expert (`pallas_kernels.moe_route`, of
    `weights_TK` and `indices_TK` over the E experts), used instead of sorting them here.
    """
    T, D = x_TD.shape
    K = indices_TK.shape[1]
    E = gate_EDI.shape[0] if num_experts is None else num_experts
    off = 0 if expert_offset is None else expert_offset
    decode = impl in ("decode", "decode_interpret")
    if shared is not None and (not decode or scales is not None):
        raise ValueError(f"moe_grouped: shared experts run in the bf16 decode kernel only, got impl={impl!r}")
    if not decode and scales is None and gate_EDI.shape[0] != E:
        gate_EDI, up_EDI, down_EID = (
            jax.lax.dynamic_slice_in_dim(w, off, E, axis=0) for w in (gate_EDI, up_EDI, down_EID)
        )
    if route is not None and (not decode or route.group_sizes_E.shape != (E,)):
        raise ValueError(
            f"moe_grouped: a precomputed route serves the decode impls over its E experts, got impl={impl!r} and "
            f"{route.group_sizes_E.shape[0]} experts for E = {E}"
        )
    dt = x_TD.dtype
    group_starts_E = None
    if route is None:
        flat_M = indices_TK.reshape(-1)
        order_M = jnp.argsort(flat_M, stable=True)  # assignment rows grouped by expert
        token_M = order_M // K
        group_sizes_E = jnp.bincount(flat_M, length=E).astype(jnp.int32)
        # rows of experts >= E (none unless a caller passes them) sort last, past every group: masked below
        valid_M = (flat_M[order_M] < E)[:, None]
        w_M = weights_TK.reshape(-1)[order_M].astype(_F32)
        inv_M = jnp.argsort(order_M)
    else:  # every row is of an expert < E
        token_M, group_sizes_E, group_starts_E = route.token_M, route.group_sizes_E, route.group_starts_E
        valid_M, w_M, inv_M = True, route.weight_M, route.row_TK.reshape(-1)
    x_MD = x_TD[token_M]
    if decode:
        # "decode": the kernel on a Hopper GPU, its reference elsewhere (pallas_kernels' rule)
        kernel_impl = "interpret" if impl == "decode_interpret" else decode_impl
        off = jnp.asarray(off, jnp.int32)
        if scales is not None:
            y_MD = moe_decode_fp8(
                x_MD,
                group_sizes_E,
                gate_EDI,
                up_EDI,
                down_EID,
                *scales,
                expert_offset=off,
                impl=kernel_impl,
                group_starts_E=group_starts_E,
            )
        else:
            fused = None if shared is None else (x_TD, shared)
            layout = None if route is None else (group_starts_E, route.expert_programs)
            y_MD = _experts_decode(x_MD, gate_EDI, up_EDI, down_EID, group_sizes_E, off, kernel_impl, fused, layout)
        y_shared_TD = 0.0
        if shared is not None:
            y_MD, y_shared_TD = y_MD
        y_MD = jnp.where(valid_M, y_MD * w_M[:, None], 0.0)
        return (y_MD[inv_M].reshape(T, K, D).sum(axis=1) + y_shared_TD).astype(dt)
    if impl == "mgpu":
        gdot = functools.partial(ragged_dot_mgpu, group_sizes_G=group_sizes_E, tuning=tuning)
    elif impl == "ragged_dot":
        gdot = lambda a, b: jax.lax.ragged_dot(a, b.astype(a.dtype), group_sizes_E)  # noqa: E731
    else:
        raise ValueError(f"moe_grouped impl must be 'ragged_dot', 'mgpu' or 'decode', got {impl!r}")
    if scales is not None:
        blocks = (gate_EDI, up_EDI, down_EID, *scales)
        y_MD = fp8_grouped(x_MD, blocks, gdot, num_experts=E, expert_offset=expert_offset)
    else:
        h_MI = jax.nn.silu(gdot(x_MD, gate_EDI)) * gdot(x_MD, up_EDI)
        y_MD = gdot(h_MI, down_EID)
    y_MD = jnp.where(valid_M, y_MD.astype(_F32) * w_M[:, None], 0.0)  # rows past the groups may hold anything
    # Un-sort (a gather, deterministic, unlike a scatter-add) and sum each token's K rows.
    return y_MD[inv_M].reshape(T, K, D).sum(axis=1).astype(dt)


class Experts(nnx.Module):
    """The E routed experts, stacked: `gate_proj`, `up_proj` [E, D, I], `down_proj` [E, I, D] (nnx.Param)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = initializers.normal(cfg.initializer_range)
        self.gate_proj = nnx.Param(init(rngs.params(), (E, D, I), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (E, D, I), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (E, I, D), param_dtype))

    def stacked(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate [E, D, I], up [E, D, I], down [E, I, D]) as stored."""
        return self.gate_proj[...], self.up_proj[...], self.down_proj[...]


class MoE(nnx.Module):
    """Routed experts + shared experts: `moe(x [..., D]) -> [..., D]` in `dtype`.

    Attributes: `gate` (Router), `experts` (Experts; `Fp8Experts` with `weights="fp8"`), `shared_experts`
    (an MLP of width n_shared·I, or None when n_shared_experts == 0). `weights`
    (`mla_jax.fp8_weights.WEIGHT_FORMATS`): "fp8" keeps the routed and shared experts in FP8; the router
    stays fp32. FP8 experts run by the decode kernel read in place as stored (`moe_decode_fp8`); the other
    impls dequantize them a chunk of columns at a time (`models.fp8_experts.fp8_grouped`). `impl` selects the
    expert computation (see the module docstring); `return_router=True` also returns the RouterOutput over the
    flattened tokens (leading axes of x flattened into T).

    `parallel` (None by default): (mesh, mesh axes of the batch, mesh axes of the experts), set by
    `mla_jax.sharding.shard_model`. The routed experts then run under `jax.shard_map`, manual over
    those axes alone (the others, e.g. `tensor` on the experts' width, stay GSPMD's): each data rank
    sorts its own tokens, each expert rank computes only the assignments to its own experts, and
    GSPMD sums the expert ranks' partial outputs (one all-reduce of [T, D]). Under GSPMD alone one sort over
    every token made each rank gather the whole batch's routing and compute every token's experts,
    and the expert split cost three all-reduces of [T·K, ·] a layer. The result is the same either
    way (no token is dropped). Not used for the whole-stack decode path (`stack_index`); a batch
    split the token count does not allow is skipped.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        impl: str = "auto",
        tuning: MgpuTuning = MgpuTuning(),
        weights=None,
    ):
        if cfg.n_routed_experts <= 0:
            raise ValueError(f"MoE needs n_routed_experts > 0, got {cfg.n_routed_experts}")
        if impl not in MOE_IMPLS:
            raise ValueError(f"MoE impl must be one of {MOE_IMPLS}, got {impl!r}")
        self.cfg = cfg
        self.dtype = dtype
        self.impl = impl
        self.tuning = tuning
        self.parallel = None
        self.gate = Router(cfg, rngs=rngs)
        fp8_weights.check_weights(weights)
        if weights == "fp8":
            self.experts = Fp8Experts(cfg, rngs=rngs)
        else:
            self.experts = Experts(cfg, rngs=rngs, param_dtype=param_dtype)
        if cfg.n_shared_experts > 0:
            self.shared_experts = MLP(
                cfg.hidden_size,
                cfg.n_shared_experts * cfg.moe_intermediate_size,
                rngs=rngs,
                dtype=dtype,
                param_dtype=param_dtype,
                init_std=cfg.initializer_range,
                weights=weights,
            )
        else:
            self.shared_experts = None

    def _parallel(self, routed, num_tokens: int):
        """`routed` under shard_map over the batch's and the experts' mesh axes (see `parallel`)."""
        mesh, batch_axes, expert_axes = self.parallel
        size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
        batch_axes = batch_axes if size(batch_axes) > 1 and num_tokens % size(batch_axes) == 0 else ()
        expert_axes = expert_axes if size(expert_axes) > 1 else ()
        if not batch_axes and not expert_axes:
            return routed

        def local(x_TD, w_TK, idx_TK, ws):
            if not expert_axes:
                return routed(x_TD, w_TK, idx_TK, ws, None)
            E_local = ws[0].shape[0]
            first = jax.lax.axis_index(expert_axes) * E_local
            mine = (idx_TK >= first) & (idx_TK < first + E_local)
            # the other ranks' experts get id E_local: moe_grouped drops them
            y_TD = routed(x_TD, w_TK, jnp.where(mine, idx_TK - first, E_local), ws, None)
            return y_TD[None]  # [1, T, D]: this rank's part, summed outside

        rows, experts = PartitionSpec(batch_axes or None), PartitionSpec(expert_axes or None)
        # The expert ranks' parts come out stacked ([ranks, T, D], split over the expert axes) and
        # GSPMD sums them (one all-reduce of [T, D]); no collective inside, so check_vma can be off.
        # With it on (jax 0.11) the gradient through the sort and gathers below came out wrong
        # (x's cotangent off by about its own size; caught by the sharded training step of
        # tests/test_sharding.py).
        out = PartitionSpec(expert_axes or None, batch_axes or None) if expert_axes else rows
        # Under jax.jit even when called eagerly (the MTP layer's MoE is not inside the layers' scan): jax
        # 0.11's eager path of a shard_map manual over only some axes, with check_vma off, raised
        # "out_specs argument must refer to an axis marked as manual" (tests/test_sharding.py, eager MTP).
        # Inside a traced caller the jit is inlined.
        mapped = jax.jit(
            jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(rows, rows, rows, experts),  # `experts` for every array of the experts' tuple
                out_specs=out,
                axis_names=set(batch_axes) | set(expert_axes),
                check_vma=False,
            )
        )
        if not expert_axes:
            return lambda x_TD, w_TK, idx_TK, ws, off: mapped(x_TD, w_TK, idx_TK, ws)
        return lambda x_TD, w_TK, idx_TK, ws, off: mapped(x_TD, w_TK, idx_TK, ws).sum(0)

    def reads_whole_stack(self, num_tokens: int, cached: bool) -> bool:
        """Whether a scanned stack of these routed experts should go into the layers' scan whole, each layer's call
        reading its experts at `stack_index` in place, rather than sliced by the scan (a slice that feeds a kernel
        or a loop is a copy of the layer's experts): FP8 experts always, unless expert-parallel (`parallel`, whose
        shard_map takes one layer's), and bf16 ones when a cached call runs the decode kernel."""
        if isinstance(self.experts, Fp8Experts):
            return self.parallel is None
        return cached and self.resolved_impl(num_tokens) in ("decode", "decode_interpret")

    def resolved_impl(self, num_tokens: int) -> str:
        """The expert implementation a call over `num_tokens` tokens runs (`impl` with "auto" resolved)."""
        cfg = self.cfg
        fp8 = isinstance(self.experts, Fp8Experts)
        return resolve_moe_impl(
            self.impl,
            self.dtype,
            rows=num_tokens * cfg.num_experts_per_tok,
            num_experts=cfg.n_routed_experts,
            widths=(cfg.hidden_size, cfg.moe_intermediate_size),
            fp8=fp8,
            stack_experts=math.prod(self.experts.gate_proj_fp8.shape[:-2]) if fp8 else None,
        )

    def _decode_shared(self, impl: str, stacked: Stacked | None, rows: int) -> SharedExperts | None:
        """The shared experts as the decode kernel takes them, when it runs them with the routed ones (bf16
        experts on a decode impl, at most `SHARED_MAX_ROWS` tokens, `nnx.Linear` projections computing in the MoE's
        dtype whose kernels are a whole stack [L, D, S] read at `stacked.index` or one layer's [D, S], widths
        `moe_decode_problems` allows); else None (the shared experts run apart, as `self.shared_experts`)."""
        mlp = self.shared_experts
        if mlp is None or impl not in ("decode", "decode_interpret") or isinstance(self.experts, Fp8Experts):
            return None
        if rows > SHARED_MAX_ROWS:
            return None
        lins = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)

        def served(lin) -> bool:
            return (
                type(lin) is nnx.Linear
                and lin.bias is None
                and lin.dtype is not None
                and jnp.dtype(lin.dtype) == jnp.dtype(self.dtype)
            )

        if not all(served(lin) for lin in lins):
            return None
        ks = tuple(lin.kernel[...] for lin in lins)
        stack = ks[0].ndim == 3
        if any(k.ndim != ks[0].ndim for k in ks) or ks[0].ndim not in (2, 3) or (stack and stacked is None):
            return None
        D, S = ks[0].shape[-2:]
        if moe_decode_problems(D, self.cfg.moe_intermediate_size, S=S):
            return None
        return SharedExperts(*ks, stacked.index if stack else 0)

    def __call__(self, x: jax.Array, *, return_router: bool = False, stack_index=None, stacked: Stacked | None = None):
        """`stack_index` (a scalar, may be traced): the routed experts' variables are a whole scanned
        stack, [L, E, ...], and this call is layer `stack_index` of it (see `models.deepseek`).
        `stacked`: the shared experts' projections may be whole too (`mla_jax.linear`), and its `impl` runs
        the decode kernel of the routed experts (the step's backend; None: "auto")."""
        lead, D = x.shape[:-1], x.shape[-1]
        x_TD = x.reshape(-1, D).astype(self.dtype)
        ex = self.experts
        impl = self.resolved_impl(x_TD.shape[0])
        E = self.cfg.n_routed_experts
        fp8 = isinstance(ex, Fp8Experts)
        # FP8 experts go as stored: the decode kernel reads the e4m3 blocks in place, the other grouped GEMMs
        # dequantize them a chunk at a time (`moe_grouped`)
        ws = ex.blocks() if fp8 else ex.stacked()
        off = None
        if stack_index is not None:  # [L, E, ...] -> [L·E, ...]: a free reshape, no copy
            ws = tuple(w.reshape((-1,) + w.shape[2:]) for w in ws)
            off = stack_index * E
        decode_impl = None if stacked is None else stacked.impl
        # the shared experts inside the decode kernel's launches, where it serves them (not under the expert
        # ranks' shard_map, whose ranks would each add them)
        shared = self._decode_shared(impl, stacked, x_TD.shape[0]) if self.parallel is None or off is not None else None
        # The decode kernel's routing and sort in one kernel (not under `parallel`'s shard_map, which renumbers
        # the experts of each rank).
        sort = None
        if (
            impl == "decode"
            and (self.parallel is None or off is not None)
            and not moe_route_problems(x_TD.shape[0], E, RouteSpec.from_config(self.cfg))
            and moe_route_is_fast(x_TD.shape[0], E)
        ):
            r, sort = self.gate.decode(x_TD, decode_impl)
        else:
            r = self.gate(x_TD)

        def routed(x_TD, w_TK, idx_TK, ws, off):
            if impl == "dense":
                if off is not None:
                    ws = tuple(jax.lax.dynamic_slice_in_dim(w, off, E, axis=0) for w in ws)
                return moe_dense_reference(x_TD, w_TK, idx_TK, *(dequantize_experts(ws, self.dtype) if fp8 else ws))
            return moe_grouped(
                x_TD,
                w_TK,
                idx_TK,
                *ws[:3],
                impl=impl,
                tuning=self.tuning,
                num_experts=E if off is not None else ws[0].shape[0],
                expert_offset=off,
                scales=ws[3:] or None,
                decode_impl=decode_impl,
                shared=shared,
                route=sort,
            )

        if self.parallel is not None and off is None:
            routed = self._parallel(routed, x_TD.shape[0])
        y_TD = routed(x_TD, r.weights, r.indices, ws, off)
        if self.shared_experts is not None and shared is None:
            y_TD = y_TD + self.shared_experts(x_TD, stacked)
        y = y_TD.reshape(lead + (D,))
        return (y, r) if return_router else y
