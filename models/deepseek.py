"""The DeepSeek-V2/V3 decoder: embedding -> L x (MLA + dense MLP / MoE) -> final norm -> LM head, plus MTP.

Dimension letters:
  B batch            T tokens (query positions)     D hidden_size       V vocab_size
  E routed experts   K experts per token            F intermediate_size (dense MLP)
Parameter names follow HF transformers' checkpoint (`input_layernorm`, `self_attn`,
`post_attention_layernorm`, `mlp`, `embed_tokens`, `norm`, `lm_head`); the attention's inner
names are the official code's (see `mla_jax.attention`), mapped one to one by `models.checkpoint`
(which stacks the per-layer tensors of HF's `model.layers.{i}.*` into the two scanned stacks).

Numerics follow HF: RMSNorm in fp32, router in fp32, everything else in `dtype`.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import fp8_weights, initializers
from mla_jax.cache_paths import with_decode_plan
from mla_jax.config import ModelConfig
from mla_jax.linear import Stacked, stacked_filter, stacked_impl
from mla_jax.norm import RMSNorm
from models.layer import DecoderLayer
from models.mtp import MTP


class ModelOutput(NamedTuple):
    """Everything a trainer needs from one forward pass.

    logits     [B, T, V]
    mtp_logits tuple over MTP depth k of [B, T-1-k, V] (position i predicts token i+2+k)
    hidden     [B, T, D] post-final-norm hidden
    routers    tuple of RouterOutput over tokens flattened to B·T: main MoE layers in order, then
               the MTP blocks' (when with_mtp)
    mtp_hidden tuple over MTP depth k of [B, T-1-k, D]: what the LM head reads for depth k
               (`shared_head_norm` of the block's output)
    With `forward(..., head=False)` logits is None and mtp_logits empty: a loss that applies the LM
    head itself, in chunks of tokens, reads `hidden` and `mtp_hidden` (`models.training.step`).
    """

    logits: jax.Array | None
    mtp_logits: tuple
    hidden: jax.Array
    routers: tuple
    mtp_hidden: tuple = ()


def _stacked_layers(n: int, make, rngs: nnx.Rngs):
    """`n` layers built by `make(rngs)` with their variables stacked along a new leading axis (each
    layer drawn from its own split of the rngs), or None when n == 0."""
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(r):
        return make(r)

    return create(rngs)


# Rematerialisation of a scanned layer (training): what the backward pass keeps of each layer's forward.
#   none            everything the autodiff saves (the fastest backward, the most memory)
#   full            only the layer's input; the whole layer is recomputed in the backward
#   dots_saveable   the outputs of every matmul (jax.checkpoint_policies.dots_saveable)
#   dots_with_no_batch_dims_saveable   only matmuls without batch dimensions (the projections and
#                   experts, not the attention's [B,H,T,S] scores and weighted values)
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")

# Layers an iteration of the scan in a decode-sized call on the kernels (`_scan_layers`), where they divide the
# stack: each iteration costs a launch for its counter and one for its per-layer row besides the layers' kernels
# (V2-Lite B = 1, compiled for an H100: 394 -> 368 launches a step at 2). An odd stack stays at 1 (its remainder
# layer, outside the loop, cost the built-in model's verify step more launches than it saved).
DECODE_UNROLL = 2


def remat_policy(name: str):
    """The `jax.checkpoint` policy of a REMAT_POLICIES name (None: save nothing; "none" has no policy)."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {name!r}")
    return {
        "full": None,
        "dots_saveable": jax.checkpoint_policies.dots_saveable,
        "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }.get(name)


def _stack_of_one(layer):
    """`layer` as a stack of one layer (each parameter with a leading axis of 1: a free reshape), for `_scan_layers`."""
    graphdef, state = nnx.split(layer)
    return nnx.merge(graphdef, jax.tree.map(lambda v: v[None], state))


def _gate_weights(path, value) -> bool:
    """The weights `pallas_kernels.moe_gate` reads: the post-attention norm's and the router's."""
    return tuple(path[-2:]) == ("post_attention_layernorm", "weight") or tuple(path[-3:]) == ("mlp", "gate", "kernel")


def _latent_norm_weight(path, value) -> bool:
    """The weight `pallas_kernels.latent_write` reads: kv_norm's."""
    return tuple(path[-2:]) == ("kv_norm", "weight")


def _scan_layers(
    stack,
    h_BTD,
    positions_BT,
    cache,
    first_layer: int,
    absorbed: bool,
    remat: str = "none",
    q_block: int | None = None,
    attn_impl: str = "xla",
):
    """Run a stacked layer over h with `jax.lax.scan` (one compiled body, whatever the depth).

    The cache (its stacked pools) is the scan's carry, updated in place; each layer is pointed at
    its own pool by index. -> (h, stacked RouterOutput or None, cache).

    With a cache (inference) and a call the MoE decode kernel serves, the routed experts are not
    sliced per layer either: a scan slices its inputs, and a slice that feeds a kernel is a copy
    (1.1 GB a layer for V2-Lite's experts, every decode step). The whole [L, E, ...] stack goes in
    as a constant and the kernel reads its layer's experts in place (`MoE(stack_index=...)`).
    Training keeps them scanned (sliced): the gradient of a whole-stack constant would be
    accumulated at full size in every iteration; so do prefill-sized calls, whose grouped GEMM
    takes one layer's experts. FP8 experts (they do not train) always go in whole: every impl reads them
    in place (the prefill-sized ones a chunk of columns at a time, `models.fp8_experts`), where a slice
    of the layer fed to the chunks' loop may be copied (11 GB of e4m3 a V3 layer). The same holds for
    the layer's projections (`mla_jax.linear`): a decode-sized cached call on a kernel backend passes
    them whole and `pallas_kernels.stacked_matmul` reads each layer's weights in place; and for the
    post-attention norm's weight and the router where `pallas_kernels.moe_gate` reads them (`MoE.gates_by_kernel`), and
    for kv_norm's where `pallas_kernels.latent_write` does (`KVCache.finishes_latents`). Such a call runs
    `DECODE_UNROLL` layers an iteration of the scan where they divide the stack.

    `remat` (REMAT_POLICIES, training only; a cached call must leave it "none") wraps the layer body in
    `jax.checkpoint` with that policy, so the backward of the scan keeps per layer only what the policy
    saves and recomputes the rest. `q_block` and `attn_impl` (training): the decompressed attention's query
    block and implementation (`mla_decompressed_attention`).
    """
    policy = remat_policy(remat)
    if remat != "none" and cache is not None:
        raise ValueError(f"remat={remat!r} is for training; a cached (inference) call takes remat='none'")
    rows = h_BTD.shape[0] * h_BTD.shape[1]
    whole = stack.is_moe and stack.mlp.reads_whole_stack(rows, cache is not None)
    proj_impl = None if cache is None else stacked_impl(cache.impl, rows)
    constant = nnx.Nothing()  # what goes in whole (the rest is sliced by the scan)
    if whole:
        constant = nnx.PathContains("experts")
    if proj_impl is not None:
        constant = nnx.Any(constant, stacked_filter(rows))
        if stack.is_moe and stack.mlp.gates_by_kernel(rows):  # `moe_gate` reads its layer's norm and router in place
            constant = nnx.Any(constant, _gate_weights)
        if cache.finishes_latents(stack.self_attn.cfg.kv_lora_rank, stack.self_attn.cfg.qk_rope_head_dim):
            # `latent_write` reads kv_norm's in place (`MLA.cached_attention`)
            constant = nnx.Any(constant, _latent_norm_weight)
    graphdef, whole_state, state = nnx.split(stack, constant, ...)
    n = jax.tree.leaves((state, whole_state))[0].shape[0]  # every weight is stacked [n, ...] (the state may be empty)
    # The per-layer scalars (the stack index, its experts' offset, the cache's pool) computed here for every layer,
    # one int32 row a layer that the scan slices in one kernel launch: computed in the body, each was a launch of
    # its own (scalar arithmetic that feeds kernels, which XLA cannot fuse into them).
    idx = jnp.arange(n, dtype=jnp.int32)
    E = stack.mlp.cfg.n_routed_experts if whole else 0
    per_layer = jnp.stack([idx, idx * E, first_layer + idx], axis=1)

    def body(carry, xs):
        h, c = carry
        layer_state, at = xs
        layer = nnx.merge(graphdef, whole_state, layer_state)
        h, r, c = layer.forward(
            h,
            positions_BT,
            None if c is None else c.at_layer(at[2]),
            absorbed=absorbed,
            stack_index=at[0] if whole else None,
            expert_offset=at[1] if whole else None,
            stacked=None if proj_impl is None else Stacked(at[0], proj_impl),
            q_block=q_block,
            attn_impl=attn_impl,
        )
        return (h, c), r

    if remat != "none":
        # prevent_cse=False: inside a scan the recomputation cannot be merged with the forward anyway
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    unroll = DECODE_UNROLL if proj_impl is not None and n % DECODE_UNROLL == 0 else 1
    (h_BTD, cache), routers = jax.lax.scan(body, (h_BTD, cache), (state, per_layer), unroll=unroll)
    return h_BTD, routers, cache


def _unstack(tree, n: int) -> list:
    return [jax.tree.map(lambda a, i=i: a[i], tree) for i in range(n)]


class DeepSeekModel(nnx.Module):
    """DeepSeek-V2/V2-Lite/V3 causal LM with optional MTP modules.

    `model(input_ids int32 [B,T]) -> logits [B,T,V]`;
    `model(input_ids, with_mtp=True) -> (logits, mtp_logits [B,T-1,V])`, where mtp position i
    combines hidden i with token i+1 and predicts token i+2 (with num_mtp_layers > 1:
    a tuple over depths k of [B,T-1-k,V]);
    `model(input_ids, positions, cache=cache) -> (logits, cache)`: the cached forward over a
    `mla_jax.kv_cache.KVCache` (each layer writes its latents into its pool, then attends over the
    cache; see `mla_jax.attention.MLA`). The engine's jitted steps use it and the pieces below.
    `positions` int32 [B,T] defaults to arange(T); negative positions mark padding (such a
    query sees no key and no query sees it). `absorbed` passes through to MLA.

    Layers of one kind are stacked and scanned (MaxText's `scan_layers`), so compile time does not
    grow with depth: `dense_layers` (the first `first_k_dense_replace`, dense MLP) and `moe_layers`
    (the rest), each ONE `DecoderLayer` whose variables have a leading layer axis (None when a kind
    has no layer); `layer(i)` returns layer i alone (a copy, for inspection). Cache pools are
    indexed by layer number: main layers 0..L-1, then MTP module k at L + k.

    Attributes: `embed_tokens` (nnx.Embed), `dense_layers`, `moe_layers`, `norm`, `lm_head`
    (nnx.Linear D -> V, no bias; None when tie_word_embeddings), `mtp` (list of
    `cfg.num_mtp_layers` MTP modules). `dtype` is the compute dtype, `param_dtype` the storage
    dtype (the router kernel and bias are fp32 always). `moe_impl` is `models.experts.MOE_IMPLS`.
    `weights` (`mla_jax.fp8_weights.WEIGHT_FORMATS`): None = every weight in `param_dtype`; "fp8" = the
    projections of every decoder layer and MTP block (attention, dense MLP, shared and routed experts) in FP8
    with 128x128 block scales, as DeepSeek-V3 releases them (`mla_jax.fp8_weights`); embeddings, norms,
    router, `eh_proj` and LM head stay in `param_dtype`. An FP8 model serves; it does not train.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        moe_impl: str = "auto",
        mtp_hidden_source: str = "post_norm",
        weights=None,
    ):
        fp8_weights.check_weights(weights)
        self.cfg = cfg
        self.dtype = dtype
        self.weights = weights
        init = initializers.normal(cfg.initializer_range)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype, embedding_init=init, rngs=rngs
        )
        n_moe = cfg.num_moe_layers
        self.num_dense_layers = cfg.num_hidden_layers - n_moe
        layer = partial(DecoderLayer, cfg, dtype=dtype, param_dtype=param_dtype, moe_impl=moe_impl, weights=weights)
        self.dense_layers = _stacked_layers(self.num_dense_layers, lambda r: layer(rngs=r, moe=False), rngs)
        self.moe_layers = _stacked_layers(n_moe, lambda r: layer(rngs=r, moe=True), rngs)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Linear(
                cfg.hidden_size,
                cfg.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=init,
                rngs=rngs,
            )
        self.mtp = nnx.List(
            [
                MTP(
                    cfg,
                    k,
                    rngs=rngs,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    moe_impl=moe_impl,
                    hidden_source=mtp_hidden_source,
                    weights=weights,
                )
                for k in range(cfg.num_mtp_layers)
            ]
        )

    # --- layers -----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.cfg.num_hidden_layers

    def layer_stack(self, i: int) -> tuple[DecoderLayer, int]:
        """(the stack holding main layer i, its index in that stack)."""
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} is outside [0, {self.num_layers})")
        if i < self.num_dense_layers:
            return self.dense_layers, i
        return self.moe_layers, i - self.num_dense_layers

    def layer(self, i: int) -> DecoderLayer:
        """Main layer i as a `DecoderLayer` of its own (a copy of its slice of the stack: reading
        it is fine, writing to it does not change the model)."""
        stack, j = self.layer_stack(i)
        graphdef, state = nnx.split(stack)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[j], state))

    # --- building blocks (the engine's steps and the trainer call these) --------------------
    def _check_ids(self, ids: jax.Array, positions: jax.Array | None) -> jax.Array:
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"input_ids must be an integer array [B, T], got {ids.dtype} {ids.shape}")
        if positions is None:
            return jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        if positions.shape != ids.shape:
            raise ValueError(f"positions must have the shape of input_ids {ids.shape}, got {positions.shape}")
        return positions.astype(jnp.int32)

    def embed(self, ids_BT: jax.Array) -> jax.Array:
        """Token embeddings [B,T,D] in the compute dtype."""
        return self.embed_tokens(ids_BT)

    def _trunk(
        self,
        ids_BT,
        positions_BT,
        absorbed: bool,
        cache=None,
        remat: str = "none",
        q_block: int | None = None,
        attn_impl: str = "xla",
    ):
        """-> (pre-final-norm hidden [B,T,D], RouterOutputs of the main MoE layers (a list), cache).
        With a cache, the decode kernel's work plan is built once here for every main layer (`with_decode_plan`)."""
        h = self.embed(ids_BT)
        routers = []
        if cache is not None:
            cache = with_decode_plan(self.cfg, cache, positions_BT)
        if self.dense_layers is not None:
            h, _, cache = _scan_layers(
                self.dense_layers, h, positions_BT, cache, 0, absorbed, remat, q_block, attn_impl
            )
        if self.moe_layers is not None:
            h, rs, cache = _scan_layers(
                self.moe_layers, h, positions_BT, cache, self.num_dense_layers, absorbed, remat, q_block, attn_impl
            )
            routers = _unstack(rs, self.cfg.num_moe_layers)
        return h, routers, None if cache is None else cache.without_decode_plan()

    def hidden_states(
        self,
        ids_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        *,
        absorbed: bool = False,
        pre_norm: bool = False,
        cache=None,
    ):
        """The last layer's hidden [B,T,D]: after the final norm (default) or before it (`pre_norm=True`).
        With a cache: (hidden, cache)."""
        positions_BT = self._check_ids(ids_BT, positions_BT)
        h, _, cache_out = self._trunk(ids_BT, positions_BT, absorbed, cache)
        h = h if pre_norm else self.norm(h)
        return h if cache is None else (h, cache_out)

    def logits_from_hidden(self, h_BTD: jax.Array) -> jax.Array:
        """LM head over a post-norm hidden: [..., D] -> [..., V]."""
        if self.lm_head is None:
            return self.embed_tokens.attend(h_BTD)
        return self.lm_head(h_BTD)

    def mtp_source(self, h_pre: jax.Array, h_post: jax.Array) -> jax.Array:
        """The main hidden that feeds MTP depth 0 (`mtp[0].hidden_source`): after or before the final norm."""
        return h_post if self.mtp[0].hidden_source == "post_norm" else h_pre

    def mtp_block(
        self, h_BTD: jax.Array, next_ids_BT: jax.Array, positions_BT: jax.Array, *, cache=None, absorbed: bool = False
    ):
        """MTP module 0 on pairs (h_i, t_{i+1}) -> its block output o [B,T,D] (with a cache: (o, cache);
        the module's latents go to pool `num_hidden_layers`)."""
        if len(self.mtp) == 0:
            raise ValueError("this model has no MTP module (cfg.num_mtp_layers == 0)")
        mtp = self.mtp[0]
        if cache is None:
            return mtp(h_BTD, self.embed(next_ids_BT), positions_BT, absorbed=absorbed)
        # As a stack of one, so its projections take the scanned layers' kernels (weights read in place, norms inside)
        x = mtp.block_input(h_BTD, self.embed(next_ids_BT))
        o, _, cache = _scan_layers(_stack_of_one(mtp.block), x, positions_BT, cache, mtp.cache_layer, absorbed)
        return o, cache

    def mtp_head(self, o_BTD: jax.Array) -> jax.Array:
        """Logits of MTP module 0's block output: [..., D] -> [..., V] (the shared LM head)."""
        return self.logits_from_hidden(self.mtp[0].head_hidden(o_BTD))

    def mtp_logits(
        self, h_BTD: jax.Array, next_ids_BT: jax.Array, positions_BT: jax.Array | None = None, *, absorbed: bool = False
    ) -> jax.Array:
        """Depth-0 MTP for arbitrary pairs: hidden h_i [B,T,D] (per `mtp[0].hidden_source`) and token t_{i+1}
        [B,T] -> logits [B,T,V] for t_{i+2}. Positions default to arange(T) (RoPE is shift invariant)."""
        if len(self.mtp) == 0:
            raise ValueError("this model has no MTP module (cfg.num_mtp_layers == 0)")
        positions_BT = self._check_ids(next_ids_BT, positions_BT)
        return self.mtp_head(self.mtp_block(h_BTD, next_ids_BT, positions_BT, absorbed=absorbed))

    def forward(
        self,
        ids_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        *,
        absorbed: bool = False,
        with_mtp: bool = True,
        head: bool = True,
        remat: str = "none",
        q_block: int | None = None,
        attn_impl: str = "xla",
    ) -> ModelOutput:
        """The full pass with what training needs (router decisions included); see `ModelOutput`.

        head=False skips the LM head (logits None, mtp_logits empty; the hiddens it would read are in
        `hidden` and `mtp_hidden`). remat: the scanned layers' rematerialisation (REMAT_POLICIES).
        q_block: the main layers' decompressed attention in blocks of that many queries
        (`mla_decompressed_attention`; the MTP modules attend whole). attn_impl: the main layers'
        decompressed attention, "xla" (jnp), "cudnn" or "mgpu" (`mla_decompressed_attention`'s flash paths;
        right-padded masks only)."""
        positions_BT = self._check_ids(ids_BT, positions_BT)
        h_pre, routers, _ = self._trunk(
            ids_BT, positions_BT, absorbed, remat=remat, q_block=q_block, attn_impl=attn_impl
        )
        h_post = self.norm(h_pre)
        logits = self.logits_from_hidden(h_post) if head else None
        mtp_out, mtp_hidden = [], []
        if with_mtp and len(self.mtp):
            T = ids_BT.shape[1]
            if T < 2:
                raise ValueError(f"with_mtp needs at least 2 tokens, got T={T}")
            h = self.mtp_source(h_pre, h_post)
            for k, mod in enumerate(self.mtp):
                n = T - 1 - k  # positions i whose token i+1+k exists
                if n < 1:
                    break
                o, r = mod(
                    h[:, :n], self.embed(ids_BT[:, 1 + k :]), positions_BT[:, :n], absorbed=absorbed, return_router=True
                )
                if r is not None:
                    routers.append(r)
                mtp_hidden.append(mod.head_hidden(o))
                if head:
                    mtp_out.append(self.logits_from_hidden(mtp_hidden[-1]))
                h = o
        return ModelOutput(logits, tuple(mtp_out), h_post, tuple(routers), tuple(mtp_hidden))

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        *,
        with_mtp: bool = False,
        absorbed: bool = False,
        cache=None,
    ):
        if cache is not None:
            if with_mtp:
                raise ValueError(
                    "with_mtp=True is not available with a cache; the cached MTP module is "
                    "`model.mtp_block(h, next_ids, positions, cache=cache)`"
                )
            h, cache = self.hidden_states(input_ids, positions, cache=cache)
            return self.logits_from_hidden(h), cache
        if not with_mtp:
            positions = self._check_ids(input_ids, positions)
            h, _, _ = self._trunk(input_ids, positions, absorbed)
            return self.logits_from_hidden(self.norm(h))
        if len(self.mtp) == 0:
            raise ValueError("with_mtp=True but this model has no MTP module (cfg.num_mtp_layers == 0)")
        out = self.forward(input_ids, positions, absorbed=absorbed, with_mtp=True)
        return out.logits, (out.mtp_logits[0] if len(self.mtp) == 1 else out.mtp_logits)
