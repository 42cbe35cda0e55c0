"""The routed experts of a MoE layer (`models.moe`): their stacked weights (`Experts`) and their computation over the
(token, expert) assignments sorted by expert, the grouped GEMM (`moe_grouped`), with its dense oracle
(`moe_dense_reference`) and the choice of implementation (`resolve_moe_impl`).

Dimension letters: T tokens, D hidden_size, E routed experts, K experts per token (top-k), I moe_intermediate_size,
M = T·K (token, expert) assignment rows, sorted by expert for the grouped GEMM, G row groups (experts).

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
on average (decode steps) and "mgpu" otherwise; elsewhere "ragged_dot".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as jax_ragged_dot_mgpu
from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

from mla_jax import initializers
from mla_jax.config import ModelConfig
from models.fp8_experts import fp8_grouped
from pallas_kernels import (
    DecodeRoute,
    backend,
    moe_decode,
    moe_decode_fp8,
    moe_decode_fp8_problems,
    moe_decode_problems,
    moe_decode_reference,
)
from pallas_kernels.moe_decode import SharedExperts

_F32 = jnp.float32
MOE_IMPLS = ("auto", "ragged_dot", "mgpu", "decode", "dense")
MOE_TRAINING_IMPLS = tuple(i for i in MOE_IMPLS if i != "decode")  # "decode" is a forward kernel for few rows
DECODE_ROWS_PER_EXPERT = 16  # `pallas_kernels.moe_decode` reads each expert once up to 16 rows


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 10))
def _experts_decode(
    x_TD,
    gate_EDI,
    up_EDI,
    down_EID,
    group_sizes_E,
    expert_offset,
    kernel_impl,
    token_M,
    shared=None,
    layout=None,
    config=None,
):
    """silu(x W_g) * (x W_u) W_d per row's expert through `pallas_kernels.moe_decode` -> f32 [M, D], row r of
    token `token_M[r]` (the kernel gathers the tokens' rows in its loads); the gradient is `lax.ragged_dot`'s (the
    kernel is forward only). `shared` (`SharedExperts`): the shared experts of the tokens too, in the same launches
    -> (f32 [M, D], f32 [T, D]). `layout` (None, or (group_starts_E, expert_programs) of a
    `pallas_kernels.moe_route.DecodeRoute`): the rows' layout, already computed. `config`: the kernel's
    `MoeDecodeConfig` (None: its default)."""
    starts, programs = (None, None) if layout is None else layout
    return moe_decode(
        x_TD,
        group_sizes_E,
        gate_EDI,
        up_EDI,
        down_EID,
        expert_offset=expert_offset,
        impl=kernel_impl,
        shared=shared,
        group_starts_E=starts,
        expert_programs=programs,
        row_tokens=token_M,
        config=config,
    )


def _experts_decode_fwd(x, g, u, d, gs, off, kernel_impl, tok, shared=None, layout=None, config=None):
    y = _experts_decode(x, g, u, d, gs, off, kernel_impl, tok, shared, layout, config)
    return y, (x, g, u, d, gs, off, tok, shared)


def _experts_decode_bwd(kernel_impl, config, res, ct):
    x, g, u, d, gs, off, tok, shared = res
    if shared is None:
        _, vjp = jax.vjp(lambda *w: moe_decode_reference(w[0][tok], gs, *w[1:], expert_offset=off), x, g, u, d)
        return (*vjp(ct.astype(jnp.float32)), None, None, None, None, None)

    def ref(x, g, u, d, sg, su, sd):
        s = shared._replace(gate_LDS=sg, up_LDS=su, down_LSD=sd)
        return moe_decode_reference(x[tok], gs, g, u, d, expert_offset=off, shared=s, x_shared_TD=x)

    _, vjp = jax.vjp(ref, x, g, u, d, shared.gate_LDS, shared.up_LDS, shared.down_LSD)
    dx, dg, du, dd, dsg, dsu, dsd = vjp(tuple(c.astype(jnp.float32) for c in ct))
    shared_ct = shared._replace(gate_LDS=dsg, up_LDS=dsu, down_LSD=dsd, layer=None)
    return dx, dg, du, dd, None, None, None, shared_ct, None


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
    decode_config=None,
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
    `decode_config` (decode impls only): the decode kernel's `MoeDecodeConfig` (None: `moe_decode`'s or
    `moe_decode_fp8`'s default), e.g. its `row_tile` (`mla-bench moe --row-tiles`).
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
                config=decode_config,
            )
        else:
            layout = None if route is None else (group_starts_E, route.expert_programs)
            # the route kernel's buffer of the rows' tokens as it is (rows past M: not read, and y's are 0)
            rows = token_M if route is None or route.token_rows is None else route.token_rows
            y_MD = _experts_decode(
                x_TD, gate_EDI, up_EDI, down_EID, group_sizes_E, off, kernel_impl, rows, shared, layout, decode_config
            )
        y_shared_TD = 0.0
        if shared is not None:
            y_MD, y_shared_TD = y_MD
        return (_combine(y_MD, valid_M, w_M, inv_M, T, K) + y_shared_TD).astype(dt)
    if impl == "mgpu":
        gdot = functools.partial(ragged_dot_mgpu, group_sizes_G=group_sizes_E, tuning=tuning)
        # the kernel reads [E, N, K] weights transposed: an FP8 stack's chunks as stored, so that XLA has no
        # transpose to move onto the stack (it transposed the V3 cut's whole FP8 stacks, 7 GiB each, before the scan)
        gdot_nk = lambda a, b: _mgpu_forward(a, b, group_sizes_E, tuning, transpose_rhs=True)  # noqa: E731
    elif impl == "ragged_dot":
        gdot = lambda a, b: jax.lax.ragged_dot(a, b.astype(a.dtype), group_sizes_E)  # noqa: E731
        gdot_nk = lambda a, b: gdot(a, b.swapaxes(1, 2))  # noqa: E731
    else:
        raise ValueError(f"moe_grouped impl must be 'ragged_dot', 'mgpu' or 'decode', got {impl!r}")
    if scales is not None:
        blocks = (gate_EDI, up_EDI, down_EID, *scales)
        y_MD = fp8_grouped(x_MD, blocks, gdot_nk, num_experts=E, expert_offset=expert_offset)
    else:
        h_MI = jax.nn.silu(gdot(x_MD, gate_EDI)) * gdot(x_MD, up_EDI)
        y_MD = gdot(h_MI, down_EID)
    return _combine(y_MD, valid_M, w_M, inv_M, T, K).astype(dt)


def _combine(y_MD, valid_M, w_M, inv_M, T: int, K: int) -> jax.Array:
    """Σ_k w_k · y_k per token -> fp32 [T, D]: the expert rows `y_MD` (sorted by expert; rows not `valid_M` may hold
    anything, NaN included) un-sorted by `inv_M` (a gather, deterministic, unlike a scatter-add) in their own dtype,
    then weighted and summed in fp32 (the weights un-sorted alongside), so that no fp32 copy of the T·K rows is made
    (3.5 GiB at 16K tokens of DeepSeek-V3)."""
    y_TKD = jnp.where(valid_M, y_MD, 0)[inv_M].reshape(T, K, -1)
    w_TK = jnp.where(jnp.reshape(valid_M, (-1,)), w_M, 0.0)[inv_M].reshape(T, K).astype(_F32)
    return jnp.sum(y_TKD.astype(_F32) * w_TK[..., None], axis=1)


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
