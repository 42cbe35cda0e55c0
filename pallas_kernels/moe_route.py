"""A decode step's MoE routing after the router's logits, in one kernel (Pallas, Triton backend).

Dimension letters: T tokens, E routed experts, G expert groups, K experts per token (top-k),
M = T·K assignment rows (token, chosen expert) sorted by expert.

The rules (DeepSeek V2/V3, DEEPSEEK_SEMANTICS.md §2), all in fp32, are `route_reference`'s:
- V3 `noaux_tc`: s = sigmoid(logits) (softmax with scoring_func="softmax"). The correction bias b enters
  only the choice: group score = sum of the top-2 of (s + b) in the group, the `topk_group` best groups
  kept (the others −inf), top-k of (s + b). The weights are the UNBIASED s of the chosen experts, divided
  by (their sum + 1e-20) when `norm_topk_prob`, times `routed_scaling_factor`.
- V2 `greedy` / `group_limited_greedy`: s = softmax(logits) (sigmoid with scoring_func="sigmoid"); top-k
  (after keeping the `topk_group` groups with the largest max score); times `routed_scaling_factor`; never
  renormalised.
Top-k order is `lax.top_k`'s: descending choice score, ties to the lower index (groups alike).

`moe_route` also sorts the T·K assignments by expert for the grouped GEMM of the routed experts (what
`jnp.argsort(indices.reshape(-1), stable=True)` gives: rows grouped by expert, in token order inside a
group) and returns a `DecodeRoute`. The kernel is one program over every token: its [T, E] tiles are
held whole (T and E padded to powers of two), the top-k is K rounds of (max, lowest index attaining it),
the group scores a static loop over the G groups, and the sort a counting sort (sizes = column sums of
the chosen experts, starts = their exclusive cumsum, a row = its expert's start + the number of earlier
tokens that chose that expert), whose token and weight of each sorted row are stored at that row.
`moe_route_reference` is the same in plain jnp (`route_reference`, then argsort and bincount).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
MAX_TILE = 16384  # elements of the kernel's [T, E] tiles (T, E padded to powers of two): 64 tokens of 256 experts
# The tiles up to which one program's routing beat XLA's sorts in a whole decode step on an H200 (V2-Lite, 64 experts:
# 3.7 us a layer at T = 1 against ~13 small kernels; T = 32 10.85 against 11.05 ms a step; T = 128, 28.7 us a layer,
# 14.46 against 14.23 ms): `models.moe` takes the kernel up to here (32 tokens of 64 experts, 8 of 256).
FAST_TILE = 2048


def moe_route_is_fast(T: int, E: int) -> bool:
    """Whether the kernel routes T tokens over E experts faster than XLA's sorts (`FAST_TILE`, measured)."""
    return _pow2(T) * _pow2(E) <= FAST_TILE


_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RouteSpec:
    """The routing rules of a model (the fields of `mla_jax.config.ModelConfig` of the same names).

    Attributes:
      num_experts_per_tok: K, experts chosen per token.
      topk_method: one of `TOPK_METHODS`.
      scoring_func: one of `SCORING_FUNCS`.
      n_group: G, expert groups (1: no grouping); divides E.
      topk_group: groups kept per token (group-limited methods).
      norm_topk_prob: renormalise the chosen weights (`noaux_tc` only).
      routed_scaling_factor: multiplies the weights.
    """

    num_experts_per_tok: int
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"RouteSpec.topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"RouteSpec.scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.num_experts_per_tok < 1:
            raise ValueError(f"RouteSpec.num_experts_per_tok must be >= 1, got {self.num_experts_per_tok}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"RouteSpec.topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")

    @classmethod
    def from_config(cls, cfg) -> RouteSpec:
        """The spec of any object with these fields (e.g. `mla_jax.config.ModelConfig`)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    @property
    def grouped(self) -> bool:
        """Whether the choice is limited to each token's best groups (G > 1 and a group-limited method)."""
        return self.topk_method != "greedy" and self.n_group > 1


class DecodeRoute(NamedTuple):
    """The routing of T tokens and their T·K assignments sorted by expert.

    weights_TK  f32 [T, K]: the gate values (scaled), in top-k order.
    indices_TK  int32 [T, K]: the chosen experts (descending choice score, ties to the lower index).
    group_sizes_E  int32 [E]: assignments per expert.
    group_starts_E int32 [E]: the first sorted row of each expert (exclusive cumsum of the sizes).
    row_TK  int32 [T, K]: the sorted row of assignment (t, k).
    token_M  int32 [M]: the token of sorted row r (M = T·K).
    weight_M f32 [M]: the gate value of sorted row r.
    expert_programs (experts, starts, sizes) int32 [A] each, A = `num_programs(T·K, E)`: the experts that got rows
      (ascending), then the others (ascending) as far as A goes, with their starts and sizes: the programs
      `pallas_kernels.moe_decode`'s `expert_programs` runs (at most min(E, T·K) of them do any work).
    token_rows int32 [R >= M] or None: `token_M` as the kernel wrote it, in its buffer of R (a power of two past M;
      the rows past M unspecified), for a consumer that reads only the rows the groups cover (`moe_decode`'s
      ``row_tokens``): a slice of it to [M] would be a kernel launch of its own. None from the reference.
    The sorted order is `jnp.argsort(indices_TK.reshape(-1), stable=True)`: rows grouped by expert, in token
    order inside a group.
    """

    weights_TK: jax.Array
    indices_TK: jax.Array
    group_sizes_E: jax.Array
    group_starts_E: jax.Array
    row_TK: jax.Array
    token_M: jax.Array
    weight_M: jax.Array
    expert_programs: tuple
    token_rows: jax.Array | None = None


def num_programs(M: int, E: int) -> int:
    """The routed programs a `DecodeRoute` of M assignments over E experts lists: min(E, M), to a power of two
    (the kernel's block)."""
    return _pow2(min(_pow2(E), M))


# ------------------------------------------------------------------------------------------
# The rules in plain jnp
# ------------------------------------------------------------------------------------------
def route_scores(logits_TE: jax.Array, spec: RouteSpec) -> jax.Array:
    """The unbiased affinities f32 [T, E]: sigmoid or softmax (over E) of the logits, by `spec.scoring_func`."""
    logits_TE = logits_TE.astype(_F32)
    return jax.nn.sigmoid(logits_TE) if spec.scoring_func == "sigmoid" else jax.nn.softmax(logits_TE, axis=-1)


def _keep_top_groups(choice_TE: jax.Array, group_score_TG: jax.Array, topk_group: int) -> jax.Array:
    """Set to −inf the experts of every group outside each token's `topk_group` best groups."""
    T, E = choice_TE.shape
    G = group_score_TG.shape[-1]
    _, keep_TK = jax.lax.top_k(group_score_TG, topk_group)
    keep_TG = jnp.any(jax.nn.one_hot(keep_TK, G, dtype=jnp.bool_), axis=1)
    keep_TE = jnp.repeat(keep_TG, E // G, axis=1)
    # −inf, not 0: a negative bias can push kept scores below 0 (flashinfer #2168).
    return jnp.where(keep_TE, choice_TE, -jnp.inf)


def _check(logits_TE, bias_E, spec: RouteSpec) -> None:
    if logits_TE.ndim != 2:
        raise ValueError(f"router logits must be [T, E], got shape {logits_TE.shape}")
    E = logits_TE.shape[1]
    if spec.num_experts_per_tok > E:
        raise ValueError(f"num_experts_per_tok = {spec.num_experts_per_tok} is more than the E = {E} experts")
    if E % spec.n_group:
        raise ValueError(f"n_group = {spec.n_group} must divide the E = {E} experts")
    if spec.topk_method == "noaux_tc":
        if bias_E is None:
            raise ValueError("topk_method='noaux_tc' needs the e_score_correction_bias, got None")
        if bias_E.shape != (E,):
            raise ValueError(f"the correction bias must be [E={E}], got shape {bias_E.shape}")
    elif bias_E is not None:
        raise ValueError(f"topk_method={spec.topk_method!r} takes no correction bias")


def route_reference(logits_TE: jax.Array, bias_E: jax.Array | None, *, spec: RouteSpec):
    """Pick K experts per token from router logits [T, E] by the rules of `spec` (module docstring).

    `bias_E` (fp32 [E]) is used by `noaux_tc` only and must be None for the V2 methods.
    Returns (weights f32 [T, K] (scaled), indices int32 [T, K] (top-k order), scores f32 [T, E] (unbiased)).
    """
    _check(logits_TE, bias_E, spec)
    logits_TE = logits_TE.astype(_F32)
    T, E = logits_TE.shape
    G, K = spec.n_group, spec.num_experts_per_tok
    scores_TE = route_scores(logits_TE, spec)
    if spec.topk_method == "noaux_tc":
        choice_TE = scores_TE + bias_E.astype(_F32)[None, :]
        top2, _ = jax.lax.top_k(choice_TE.reshape(T, G, E // G), 2)
        choice_TE = _keep_top_groups(choice_TE, top2.sum(-1), spec.topk_group)
        _, idx_TK = jax.lax.top_k(choice_TE, K)
        # Gather the UNBIASED scores: never recover them as (s + b) − b (vLLM #12002, HF #41647).
        w_TK = jnp.take_along_axis(scores_TE, idx_TK, axis=-1)
        if spec.norm_topk_prob:
            w_TK = w_TK / (jnp.sum(w_TK, axis=-1, keepdims=True) + 1e-20)
    else:
        choice_TE = scores_TE
        if spec.topk_method == "group_limited_greedy":
            choice_TE = _keep_top_groups(scores_TE, scores_TE.reshape(T, G, E // G).max(-1), spec.topk_group)
        w_TK, idx_TK = jax.lax.top_k(choice_TE, K)
    return w_TK * spec.routed_scaling_factor, idx_TK.astype(jnp.int32), scores_TE


def sort_by_expert(weights_TK: jax.Array, indices_TK: jax.Array, num_experts: int) -> DecodeRoute:
    """The `DecodeRoute` of a routing (weights, indices [T, K], experts < `num_experts`) in plain jnp: a stable
    argsort of the flattened indices, its inverse and a bincount."""
    T, K = indices_TK.shape
    flat_M = indices_TK.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)
    sizes_E = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
    starts_E = jnp.cumsum(sizes_E) - sizes_E
    # the programs over the experts padded to a power of two, as the kernel holds them (padded ones: no rows)
    sizes_P = jnp.pad(sizes_E, (0, _pow2(num_experts) - num_experts))
    A = num_programs(T * K, num_experts)
    programs = tuple(
        jnp.zeros((A,), jnp.int32).at[_program_slots(sizes_P)].set(v.astype(jnp.int32), mode="drop")
        for v in (jnp.arange(sizes_P.shape[0]), jnp.cumsum(sizes_P) - sizes_P, sizes_P)
    )
    return DecodeRoute(
        weights_TK=weights_TK.astype(_F32),
        indices_TK=indices_TK.astype(jnp.int32),
        group_sizes_E=sizes_E,
        group_starts_E=starts_E,
        row_TK=jnp.argsort(order_M).astype(jnp.int32).reshape(T, K),
        token_M=(order_M // K).astype(jnp.int32),
        weight_M=weights_TK.reshape(-1)[order_M].astype(_F32),
        expert_programs=programs,
    )


def _program_slots(sizes_E):
    """Each expert's place in `DecodeRoute.expert_programs`: the experts with rows first, then the others, each in
    ascending order (a permutation of [0, E))."""
    active = (sizes_E > 0).astype(jnp.int32)
    idle = 1 - active
    return jnp.where(active > 0, jnp.cumsum(active) - active, jnp.sum(active) + jnp.cumsum(idle) - idle)


def moe_route_reference(logits_TE: jax.Array, bias_E: jax.Array | None, *, spec: RouteSpec) -> DecodeRoute:
    """`moe_route` in plain jnp: `route_reference`, then `sort_by_expert`."""
    w_TK, idx_TK, _ = route_reference(logits_TE, bias_E, spec=spec)
    return sort_by_expert(w_TK, idx_TK, logits_TE.shape[1])


# ------------------------------------------------------------------------------------------
# The kernel
# ------------------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def moe_route_problems(T: int, E: int, spec: RouteSpec) -> list[str]:
    """Why `moe_route`'s kernel cannot route T tokens over E experts (empty when it can).

    One program holds the [T, E] tiles (each padded to a power of two) whole in registers: at most `MAX_TILE`
    elements (64 KiB of fp32 a tile); a larger call is a prefill's, whose routing XLA's sort serves."""
    out = []
    if T < 1:
        out.append(f"T = {T} tokens: the kernel routes at least 1")
    tile = _pow2(T) * _pow2(E)
    if tile > MAX_TILE:
        out.append(
            f"T·E = {_pow2(T)}·{_pow2(E)} = {tile} (each padded to a power of two) is more than the {MAX_TILE} "
            "elements of one program's [T, E] tile"
        )
    if spec.num_experts_per_tok > E:
        out.append(f"K = {spec.num_experts_per_tok} experts a token is more than the E = {E} experts")
    return out


def _route_kernel(
    logits_ref,
    *refs,
    spec,
    T,
    E,
):
    """Refs: logits [Tp, Ep] (padded columns −inf, padded rows 0), the bias [Ep] when the spec has one (`noaux_tc`);
    out weights, indices, rows [Tp, Kp], sizes and starts [Ep], token_M and weight_M [> M] (written at the sorted
    rows of the real assignments only), the routed programs' experts, starts and sizes. The experts' groups are
    computed here, not passed: a constant operand of a kernel inside a scanned layer is materialised by a kernel
    launch of its own at every layer."""
    bias_ref = refs[0] if spec.topk_method == "noaux_tc" else None
    _route_body(logits_ref, bias_ref, *refs[bias_ref is not None :], spec=spec, T=T, E=E)


def _route_body(
    logits_ref,
    bias_ref,
    w_ref,
    idx_ref,
    row_ref,
    sizes_ref,
    starts_ref,
    tok_ref,
    wm_ref,
    pe_ref,
    ps_ref,
    pn_ref,
    *,
    spec,
    T,
    E,
):
    x = logits_ref[...].astype(_F32)
    Tp, Ep = x.shape
    Kp = w_ref.shape[1]
    K, G = spec.num_experts_per_tok, spec.n_group
    neg = jnp.float32(-jnp.inf)
    col = lax.broadcasted_iota(jnp.int32, (Tp, Ep), 1)
    real_col = col < E
    gid = jnp.where(real_col, jnp.minimum(col // (E // G), G), G)  # each column's group; G for padded columns
    real_row = lax.broadcasted_iota(jnp.int32, (Tp, 1), 0) < T

    if spec.scoring_func == "sigmoid":
        scores = jax.nn.sigmoid(x)
    else:  # jax.nn.softmax's arithmetic: exp(x − max) / sum
        e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
        scores = e / jnp.sum(e, axis=1, keepdims=True)
    choice = scores + bias_ref[...][None, :] if spec.topk_method == "noaux_tc" else scores

    if spec.grouped:
        group_score = []  # G of [Tp, 1]
        for g in range(G):
            v = jnp.where(gid == g, choice, neg)
            m1 = jnp.max(v, axis=1, keepdims=True)
            if spec.topk_method == "noaux_tc":  # the sum of the group's top 2 (a repeated max counts twice)
                first = jnp.min(jnp.where(v == m1, col, Ep), axis=1, keepdims=True)
                m1 = m1 + jnp.max(jnp.where(col == first, neg, v), axis=1, keepdims=True)
            group_score.append(m1)
        kept = [jnp.zeros((Tp, 1), jnp.bool_) for _ in range(G)]
        for _ in range(spec.topk_group):  # the best group not kept yet, ties to the lower group
            best = functools.reduce(jnp.maximum, [jnp.where(k, neg, s) for k, s in zip(kept, group_score)])
            pick = jnp.full((Tp, 1), G, jnp.int32)
            for g in reversed(range(G)):
                pick = jnp.where(~kept[g] & (group_score[g] == best), g, pick)
            kept = [k | (pick == g) for g, k in enumerate(kept)]
        keep = functools.reduce(jnp.logical_or, [k & (gid == g) for g, k in enumerate(kept)])
        choice = jnp.where(keep, choice, neg)

    kcol = lax.broadcasted_iota(jnp.int32, (Tp, Kp), 1)
    taken = ~real_col
    picks = []  # K of [Tp, 1]
    w_TK = jnp.zeros((Tp, Kp), _F32)
    idx_TK = jnp.zeros((Tp, Kp), jnp.int32)
    for k in range(K):  # lax.top_k: the largest not taken yet, ties to the lower index
        c = jnp.where(taken, neg, choice)
        best = jnp.max(c, axis=1, keepdims=True)
        pick = jnp.min(jnp.where(~taken & (c == best), col, Ep), axis=1, keepdims=True)
        hit = col == pick
        w = jnp.sum(jnp.where(hit, scores, 0.0), axis=1, keepdims=True)  # the unbiased score
        taken = taken | hit
        picks.append(pick)
        w_TK = jnp.where(kcol == k, w, w_TK)
        idx_TK = jnp.where(kcol == k, pick, idx_TK)
    if spec.topk_method == "noaux_tc" and spec.norm_topk_prob:
        w_TK = w_TK / (jnp.sum(w_TK, axis=1, keepdims=True) + 1e-20)
    w_TK = w_TK * spec.routed_scaling_factor

    # Counting sort: a row's place is its expert's start + the earlier tokens that chose that expert (a token's
    # K experts are distinct, so (t, expert) names one assignment).
    chosen = (taken & real_col & real_row).astype(jnp.int32)  # [Tp, Ep]
    sizes = jnp.sum(chosen, axis=0)  # [Ep]
    starts = jnp.cumsum(sizes) - sizes
    place = jnp.cumsum(chosen, axis=0) - chosen + starts[None, :]  # [Tp, Ep]
    row_TK = jnp.zeros((Tp, Kp), jnp.int32)
    for k, pick in enumerate(picks):
        row_TK = jnp.where(kcol == k, jnp.sum(jnp.where(col == pick, place, 0), axis=1, keepdims=True), row_TK)

    w_ref[...] = w_TK
    idx_ref[...] = idx_TK
    row_ref[...] = row_TK
    sizes_ref[...] = sizes
    starts_ref[...] = starts
    real = real_row & (kcol < K)
    dest = jnp.where(real, row_TK, T * K)  # padded entries aim at the spare slot past M (and are masked)
    plt.store(tok_ref.at[dest], lax.broadcasted_iota(jnp.int32, (Tp, Kp), 0), mask=real)
    plt.store(wm_ref.at[dest], w_TK, mask=real)
    # the routed programs: a permutation of the (padded) experts, the first A of it stored (each slot once)
    slot = _program_slots(sizes)
    first = slot < pe_ref.shape[0]
    plt.store(pe_ref.at[slot], lax.broadcasted_iota(jnp.int32, sizes.shape, 0), mask=first)
    plt.store(ps_ref.at[slot], starts, mask=first)
    plt.store(pn_ref.at[slot], sizes, mask=first)


def _moe_route_kernel(logits_TE, bias_E, *, spec: RouteSpec, interpret: bool) -> DecodeRoute:
    T, E = logits_TE.shape
    K = spec.num_experts_per_tok
    Tp, Ep, Kp = _pow2(T), _pow2(E), _pow2(K)
    M = T * K
    logits = jnp.pad(logits_TE.astype(_F32), ((0, 0), (0, Ep - E)), constant_values=-jnp.inf)
    logits = jnp.pad(logits, ((0, Tp - T), (0, 0)))  # padded rows: finite, routed, and never stored
    bias = () if spec.topk_method != "noaux_tc" else (jnp.pad(bias_E.astype(_F32), (0, Ep - E)),)
    Mo = _pow2(M + 1)  # the sorted rows and a spare slot
    out_shape = (
        jax.ShapeDtypeStruct((Tp, Kp), _F32),
        jax.ShapeDtypeStruct((Tp, Kp), jnp.int32),
        jax.ShapeDtypeStruct((Tp, Kp), jnp.int32),
        jax.ShapeDtypeStruct((Ep,), jnp.int32),
        jax.ShapeDtypeStruct((Ep,), jnp.int32),
        jax.ShapeDtypeStruct((Mo,), jnp.int32),
        jax.ShapeDtypeStruct((Mo,), _F32),
        *[jax.ShapeDtypeStruct((num_programs(M, E),), jnp.int32)] * 3,
    )
    w, idx, row, sizes, starts, tok, wm, *programs = pl.pallas_call(
        functools.partial(_route_kernel, spec=spec, T=T, E=E),
        out_shape=out_shape,
        grid=(1,),
        compiler_params=plt.CompilerParams(num_warps=4 if Tp * Ep <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="moe_route",
    )(logits, *bias)
    return DecodeRoute(
        w[:T, :K], idx[:T, :K], sizes[:E], starts[:E], row[:T, :K], tok[:M], wm[:M], tuple(programs), token_rows=tok
    )


def moe_route(logits_TE: jax.Array, bias_E: jax.Array | None, *, spec: RouteSpec, impl: str | None = "auto"):
    """Route T tokens by router logits [T, E] and sort their T·K assignments by expert -> `DecodeRoute`.

    Args:
      logits_TE: [T, E] router logits (computed in fp32).
      bias_E: fp32 [E], the correction bias of `noaux_tc`; None for the V2 methods.
      spec: `RouteSpec`, the model's rules (`RouteSpec.from_config(cfg)`).
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU where
        `moe_route_problems` is empty, else `moe_route_reference`; "kernel" and "interpret" refuse what the
        kernel cannot serve).
    The indices equal `route_reference`'s; the weights to fp32 rounding (the renormalising sum's order).
    Not differentiable (a decode step's routing).
    """
    _check(logits_TE, bias_E, spec)
    impl = backend.choose(impl, moe_route_problems(*logits_TE.shape, spec), name="moe_route impl")
    if impl == "reference":
        return moe_route_reference(logits_TE, bias_E, spec=spec)
    return _moe_route_kernel(logits_TE, bias_E, spec=spec, interpret=impl == "interpret")
