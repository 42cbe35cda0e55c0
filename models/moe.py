"""Mixture of experts: DeepSeek-V2/V3 routers and the MoE layer (routed experts, `models.experts`, + shared experts).

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

The routed experts and their computation (the grouped GEMM's implementations and the choice among them) are
`models.experts`. On "decode" the routing after the logits (scores, top-k, the sort by expert) is one kernel,
`pallas_kernels.moe_route`, where it serves the call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from mla_jax import fp8_weights, initializers
from mla_jax.config import ModelConfig
from mla_jax.linear import Stacked
from models.experts import (
    MOE_IMPLS,
    Experts,
    MgpuTuning,
    moe_dense_reference,
    moe_grouped,
    resolve_moe_impl,
)
from models.fp8_experts import Fp8Experts, dequantize_experts
from models.mlp import MLP
from pallas_kernels import (
    DecodeRoute,
    RouteSpec,
    moe_decode_problems,
    moe_route,
    moe_route_problems,
    route_reference,
    route_scores,
)
from pallas_kernels.moe_decode import SHARED_MAX_ROWS, SharedExperts
from pallas_kernels.moe_gate import moe_gate_problems
from pallas_kernels.moe_route import moe_route_is_fast

_F32 = jnp.float32


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


ROUTER_REDUCE_ROWS = 4  # `Router.logits` of 2 up to this many rows: a sum of products; of others, a dot


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
        """[T, D] -> fp32 [T, E]. From 2 to `ROUTER_REDUCE_ROWS` rows, a product and a sum over D rather than a
        dot: XLA makes it a reduction that reads the layer's router out of a scanned stack in place, where a dot
        of two rows became a GEMM fusion behind a copy of that layer's [D, E] (an MTP verify step's two rows, a
        decode step of two to four); one row's dot is already such a reduction."""
        x, w = x_TD.astype(_F32), self.kernel[...]
        if 1 < x.shape[0] <= ROUTER_REDUCE_ROWS:
            return jnp.sum(x[:, :, None] * w[None], axis=1)
        return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)

    def bias(self) -> jax.Array | None:
        """The correction bias fp32 [E] (`noaux_tc`), else None."""
        return None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]

    def __call__(self, x_TD: jax.Array, logits_TE: jax.Array | None = None) -> RouterOutput:
        """`logits_TE`: x's logits when the caller has them (`pallas_kernels.moe_gate`'s), else computed here."""
        return route(self.logits(x_TD) if logits_TE is None else logits_TE, self.bias(), self.cfg)

    def decode(self, x_TD: jax.Array, impl: str | None = None, logits_TE=None) -> tuple[RouterOutput, DecodeRoute]:
        """`__call__`'s routing through `pallas_kernels.moe_route` (`impl`: its backend), with the assignments
        sorted by expert for `moe_grouped`'s decode impls. Forward only."""
        logits_TE = self.logits(x_TD) if logits_TE is None else logits_TE
        spec = RouteSpec.from_config(self.cfg)
        r = moe_route(logits_TE, self.bias(), spec=spec, impl=impl)
        return RouterOutput(r.weights_TK, r.indices_TK, route_scores(logits_TE, spec)), r


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

    def routes_by_kernel(self, num_tokens: int, whole: bool) -> bool:
        """Whether a call over `num_tokens` tokens routes and sorts them by `pallas_kernels.moe_route`: the decode
        kernel's impl, a tile the route kernel takes faster than XLA's sorts, and not under `parallel`'s shard_map
        (which renumbers each rank's experts) unless the experts' stack goes in whole (`whole`: `stack_index`)."""
        E = self.cfg.n_routed_experts
        return (
            self.resolved_impl(num_tokens) == "decode"
            and (self.parallel is None or whole)
            and not moe_route_problems(num_tokens, E, RouteSpec.from_config(self.cfg))
            and moe_route_is_fast(num_tokens, E)
        )

    def gates_by_kernel(self, num_tokens: int) -> bool:
        """Whether a scanned decode layer of `num_tokens` tokens enters this MoE through `pallas_kernels.moe_gate`
        (its residual add, norm and router logits in one launch; the layer's norm weight and router passed whole):
        where the routing is the kernel's (`routes_by_kernel`) and `moe_gate` serves the rows."""
        cfg = self.cfg
        return self.routes_by_kernel(num_tokens, True) and not moe_gate_problems(
            num_tokens, cfg.hidden_size, cfg.n_routed_experts
        )

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

    def __call__(
        self,
        x: jax.Array,
        *,
        return_router: bool = False,
        stack_index=None,
        expert_offset=None,
        stacked: Stacked | None = None,
        logits=None,
    ):
        """`stack_index` (a scalar, may be traced): the routed experts' variables are a whole scanned
        stack, [L, E, ...], and this call is layer `stack_index` of it (see `models.deepseek`); `expert_offset`:
        stack_index · E when the caller has it (a scanned stack slices it with its other per-layer scalars: the
        product computed here is a kernel launch of its own in each layer), else computed here.
        `stacked`: the shared experts' projections may be whole too (`mla_jax.linear`), and its `impl` runs
        the decode kernel of the routed experts (the step's backend; None: "auto"). `logits`: the router's logits
        of x's tokens when the caller has them (`moe_gate`'s)."""
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
            off = stack_index * E if expert_offset is None else expert_offset
        decode_impl = None if stacked is None else stacked.impl
        # the shared experts inside the decode kernel's launches, where it serves them (not under the expert
        # ranks' shard_map, whose ranks would each add them)
        shared = self._decode_shared(impl, stacked, x_TD.shape[0]) if self.parallel is None or off is not None else None
        # The decode kernel's routing and sort in one kernel (not under `parallel`'s shard_map, which renumbers
        # the experts of each rank).
        sort = None
        if self.routes_by_kernel(x_TD.shape[0], off is not None):
            r, sort = self.gate.decode(x_TD, decode_impl, logits)
        else:
            r = self.gate(x_TD, logits)

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
