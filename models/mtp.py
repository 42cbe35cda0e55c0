"""Multi-Token Prediction (DeepSeek-V3 §2.2, D = num_mtp_layers modules; the release has D = 1).

Dimension letters: B batch, T positions (T-1-k for the module of depth k), D hidden_size, V vocab.

Module k combines the main model's hidden h_i with the embedding of token i+1+k:
    h'_i = eh_proj([enorm(Emb(t_{i+1+k})) ; hnorm(h_i)])       # embedding FIRST (the released weights)
    o_i  = block(h'_i)                                           # a full decoder layer (MLA + MoE), causal
    logits_i = lm_head(shared_head_norm(o_i))                    # predicts t_{i+2+k}
Embedding and LM head are the main model's (shared). For depth k > 0, h is the previous module's
block output o (before its shared_head_norm), as in the paper.

`hidden_source` says which main hidden feeds depth 0: "post_norm" (after the model's final norm:
what HF, vLLM and SGLang use with the released weights, the default) or "pre_norm" (MaxText).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import initializers
from mla_jax.config import ModelConfig
from mla_jax.norm import RMSNorm
from models.layer import DecoderLayer

HIDDEN_SOURCES = ("post_norm", "pre_norm")


class MTP(nnx.Module):
    """One MTP module: `mtp(h [B,T,D], emb [B,T,D], positions int32 [B,T]) -> block output o [B,T,D]`.

    Attributes (HF names in brackets): `enorm`, `hnorm` (RMSNorm), `eh_proj` (Linear 2D -> D,
    kernel [2D, D]), `block` (a `models.layer.DecoderLayer`, MoE kind when the model has
    routed experts; HF keys `model.layers.{L+k}.self_attn...`), `shared_head_norm`
    [`shared_head.norm`]. `head_hidden(o)` applies `shared_head_norm`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        depth: int = 0,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        moe_impl: str = "auto",
        hidden_source: str = "post_norm",
        weights=None,
    ):
        if hidden_source not in HIDDEN_SOURCES:
            raise ValueError(f"MTP hidden_source must be one of {HIDDEN_SOURCES}, got {hidden_source!r}")
        D = cfg.hidden_size
        self.cfg = cfg
        self.depth = depth
        self.hidden_source = hidden_source
        norm = partial(RMSNorm, D, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = nnx.Linear(
            2 * D,
            D,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=initializers.normal(cfg.initializer_range),
            rngs=rngs,
        )
        self.block = DecoderLayer(
            cfg,
            cfg.num_hidden_layers + depth,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            moe=cfg.n_routed_experts > 0,
            moe_impl=moe_impl,
            weights=weights,
        )
        self.shared_head_norm = norm()

    @property
    def cache_layer(self) -> int:
        """The latent-cache pool of this module: after the main model's layers."""
        return self.cfg.num_hidden_layers + self.depth

    def __call__(
        self,
        h_BTD: jax.Array,
        emb_BTD: jax.Array,
        positions_BT: jax.Array,
        *,
        absorbed: bool = False,
        return_router: bool = False,
        cache=None,
    ):
        """-> o [B,T,D] (`return_router`: (o, RouterOutput or None)); with a cache: (o, cache), the
        block's latents written to pool `cache_layer`."""
        x = self.block_input(h_BTD, emb_BTD)
        if cache is not None:
            return self.block(x, positions_BT, cache=cache.at_layer(self.cache_layer))
        return self.block(x, positions_BT, absorbed=absorbed, return_router=return_router)

    def block_input(self, h_BTD: jax.Array, emb_BTD: jax.Array) -> jax.Array:
        """eh_proj([enorm(emb) ; hnorm(h)]): what `block` reads [B,T,D]."""
        if h_BTD.shape != emb_BTD.shape:
            raise ValueError(f"MTP: hidden {h_BTD.shape} and embedding {emb_BTD.shape} must have the same shape")
        return self.eh_proj(jnp.concatenate([self.enorm(emb_BTD), self.hnorm(h_BTD).astype(emb_BTD.dtype)], axis=-1))

    def head_hidden(self, o_BTD: jax.Array) -> jax.Array:
        """shared_head_norm(o): the hidden the shared LM head reads."""
        return self.shared_head_norm(o_BTD)
