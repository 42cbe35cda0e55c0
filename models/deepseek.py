"""The DeepSeek-V2/V3 decoder: embedding -> L x (MLA + dense MLP / MoE) -> final norm -> LM head, plus MTP.

Dimension letters:
  B batch            T tokens (query positions)     D hidden_size       V vocab_size
  E routed experts   K experts per token            F intermediate_size (dense MLP)
Parameter names follow HF transformers' checkpoint (`input_layernorm`, `self_attn`,
`post_attention_layernorm`, `mlp`, `embed_tokens`, `norm`, `lm_head`); the attention's inner
names are the official code's (see `mla_jax.attention`), mapped one to one by `models.checkpoint`.

Numerics follow HF: RMSNorm in fp32, router in fp32, everything else in `dtype`.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.attention import MLA
from mla_jax.config import ModelConfig
from mla_jax.norm import RMSNorm
from models.mlp import MLP
from models.moe import MoE, RouterOutput
from models.mtp import MTP


class ModelOutput(NamedTuple):
    """Everything a trainer needs from one forward pass.

    logits     [B, T, V]
    mtp_logits tuple over MTP depth k of [B, T-1-k, V] (position i predicts token i+2+k)
    hidden     [B, T, D] post-final-norm hidden
    routers    tuple of RouterOutput over tokens flattened to B·T: main MoE layers in order, then
               the MTP blocks' (when with_mtp)
    """

    logits: jax.Array
    mtp_logits: tuple
    hidden: jax.Array
    routers: tuple


class DecoderLayer(nnx.Module):
    """x -> x + attn(input_layernorm(x)) -> h + mlp(post_attention_layernorm(h)).

    `mlp` is a dense `MLP` (width F) for layers < first_k_dense_replace, else a `MoE`.
    `attention(x, positions)` and `ffn(h)` are the two residual halves, public so that a
    cached engine can run attention itself and then call `ffn`.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, moe: bool | None = None, moe_impl: str = "auto"):
        self.layer_idx = layer_idx
        self.is_moe = cfg.is_moe_layer(layer_idx) if moe is None else bool(moe)
        norm = partial(RMSNorm, cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.input_layernorm = norm()
        self.self_attn = MLA(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.post_attention_layernorm = norm()
        if self.is_moe:
            self.mlp = MoE(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, impl=moe_impl)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                           init_std=cfg.initializer_range)

    def attention(self, x_BTD: jax.Array, positions_BT: jax.Array, *, absorbed: bool = False) -> jax.Array:
        """x + self_attn(input_layernorm(x)) -> [B,T,D]."""
        return x_BTD + self.self_attn(self.input_layernorm(x_BTD), positions_BT, absorbed=absorbed).astype(x_BTD.dtype)

    def ffn(self, h_BTD: jax.Array, *, return_router: bool = False):
        """h + mlp(post_attention_layernorm(h)) -> [B,T,D] (and the RouterOutput, None for a dense layer)."""
        x = self.post_attention_layernorm(h_BTD)
        r = None
        if self.is_moe:
            y, r = self.mlp(x, return_router=True)
        else:
            y = self.mlp(x)
        out = h_BTD + y.astype(h_BTD.dtype)
        return (out, r) if return_router else out

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, *, absorbed: bool = False,
                 return_router: bool = False):
        return self.ffn(self.attention(x_BTD, positions_BT, absorbed=absorbed), return_router=return_router)


class DeepSeekModel(nnx.Module):
    """DeepSeek-V2/V2-Lite/V3 causal LM with optional MTP modules.

    `model(input_ids int32 [B,T]) -> logits [B,T,V]`;
    `model(input_ids, with_mtp=True) -> (logits, mtp_logits [B,T-1,V])`, where mtp position i
    combines hidden i with token i+1 and predicts token i+2 (with num_mtp_layers > 1:
    a tuple over depths k of [B,T-1-k,V]).
    `positions` int32 [B,T] defaults to arange(T); negative positions mark padding (such a
    query sees no key and no query sees it). `absorbed` passes through to MLA.

    Attributes: `embed_tokens` (nnx.Embed), `layers` (list of DecoderLayer), `norm`,
    `lm_head` (nnx.Linear D -> V, no bias; None when tie_word_embeddings), `mtp` (list of
    `cfg.num_mtp_layers` MTP modules). `dtype` is the compute dtype, `param_dtype` the storage
    dtype (the router kernel and bias are fp32 always). `moe_impl` is `models.moe.MOE_IMPLS`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 moe_impl: str = "auto", mtp_hidden_source: str = "post_norm"):
        self.cfg = cfg
        self.dtype = dtype
        init = nnx.initializers.normal(cfg.initializer_range)
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype,
                                      embedding_init=init, rngs=rngs)
        self.layers = nnx.List([
            DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, param_dtype=param_dtype, moe_impl=moe_impl)
            for i in range(cfg.num_hidden_layers)
        ])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype,
                                      param_dtype=param_dtype, kernel_init=init, rngs=rngs)
        self.mtp = nnx.List([
            MTP(cfg, k, rngs=rngs, dtype=dtype, param_dtype=param_dtype, moe_impl=moe_impl,
                hidden_source=mtp_hidden_source)
            for k in range(cfg.num_mtp_layers)
        ])

    # --- building blocks (the engine and the trainer call these) -------------------------
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

    def _trunk(self, ids_BT, positions_BT, absorbed: bool):
        """-> (pre-final-norm hidden [B,T,D], RouterOutputs of the MoE layers)."""
        h = self.embed(ids_BT)
        routers = []
        for layer in self.layers:
            h, r = layer(h, positions_BT, absorbed=absorbed, return_router=True)
            if r is not None:
                routers.append(r)
        return h, routers

    def hidden_states(self, ids_BT: jax.Array, positions_BT: jax.Array | None = None, *, absorbed: bool = False,
                      pre_norm: bool = False) -> jax.Array:
        """The last layer's hidden [B,T,D]: after the final norm (default) or before it (`pre_norm=True`)."""
        positions_BT = self._check_ids(ids_BT, positions_BT)
        h, _ = self._trunk(ids_BT, positions_BT, absorbed)
        return h if pre_norm else self.norm(h)

    def logits_from_hidden(self, h_BTD: jax.Array) -> jax.Array:
        """LM head over a post-norm hidden: [..., D] -> [..., V]."""
        if self.lm_head is None:
            return self.embed_tokens.attend(h_BTD)
        return self.lm_head(h_BTD)

    def mtp_logits(self, h_BTD: jax.Array, next_ids_BT: jax.Array, positions_BT: jax.Array | None = None, *,
                   absorbed: bool = False) -> jax.Array:
        """Depth-0 MTP for arbitrary pairs: hidden h_i [B,T,D] (per `mtp[0].hidden_source`) and token t_{i+1}
        [B,T] -> logits [B,T,V] for t_{i+2}. Positions default to arange(T) (RoPE is shift invariant)."""
        if len(self.mtp) == 0:
            raise ValueError("this model has no MTP module (cfg.num_mtp_layers == 0)")
        positions_BT = self._check_ids(next_ids_BT, positions_BT)
        o = self.mtp[0](h_BTD, self.embed(next_ids_BT), positions_BT, absorbed=absorbed)
        return self.logits_from_hidden(self.mtp[0].head_hidden(o))

    def forward(self, ids_BT: jax.Array, positions_BT: jax.Array | None = None, *, absorbed: bool = False,
                with_mtp: bool = True) -> ModelOutput:
        """The full pass with what training needs (router decisions included); see `ModelOutput`."""
        positions_BT = self._check_ids(ids_BT, positions_BT)
        h_pre, routers = self._trunk(ids_BT, positions_BT, absorbed)
        h_post = self.norm(h_pre)
        logits = self.logits_from_hidden(h_post)
        mtp_out = []
        if with_mtp and len(self.mtp):
            T = ids_BT.shape[1]
            if T < 2:
                raise ValueError(f"with_mtp needs at least 2 tokens, got T={T}")
            h = h_post if self.mtp[0].hidden_source == "post_norm" else h_pre
            for k, mod in enumerate(self.mtp):
                n = T - 1 - k  # positions i whose token i+1+k exists
                if n < 1:
                    break
                o, r = mod(h[:, :n], self.embed(ids_BT[:, 1 + k:]), positions_BT[:, :n], absorbed=absorbed,
                           return_router=True)
                if r is not None:
                    routers.append(r)
                mtp_out.append(self.logits_from_hidden(mod.head_hidden(o)))
                h = o
        return ModelOutput(logits, tuple(mtp_out), h_post, tuple(routers))

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None, *, with_mtp: bool = False,
                 absorbed: bool = False):
        if not with_mtp:
            positions = self._check_ids(input_ids, positions)
            h, _ = self._trunk(input_ids, positions, absorbed)
            return self.logits_from_hidden(self.norm(h))
        if len(self.mtp) == 0:
            raise ValueError("with_mtp=True but this model has no MTP module (cfg.num_mtp_layers == 0)")
        out = self.forward(input_ids, positions, absorbed=absorbed, with_mtp=True)
        return out.logits, (out.mtp_logits[0] if len(self.mtp) == 1 else out.mtp_logits)
