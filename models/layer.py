"""One DeepSeek decoder layer: RMSNorm -> MLA -> residual -> RMSNorm -> dense MLP or MoE -> residual.

Dimension letters: B batch, T tokens, D hidden_size. The model (`models.deepseek`) stacks and scans these;
an MTP module (`models.mtp`) holds one as its block.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.attention import MLA
from mla_jax.config import ModelConfig
from mla_jax.linear import Normed, Stacked
from mla_jax.norm import RMSNorm
from models.mlp import MLP
from models.moe import MoE
from pallas_kernels.moe_gate import moe_gate
from pallas_kernels.stacked_matmul import NORM_ROWS


class DecoderLayer(nnx.Module):
    """x -> x + attn(input_layernorm(x)) -> h + mlp(post_attention_layernorm(h)).

    `mlp` is a dense `MLP` (width F) for layers < first_k_dense_replace, else a `MoE`.
    `layer(x, positions)` -> out [B,T,D] (`return_router=True`: (out, RouterOutput or None));
    `layer(x, positions, cache=cache)` -> (out, cache): the attention writes and reads the latent
    cache (pool `cache.layer`, see `mla_jax.attention.MLA`). `forward` is the one body both use.
    `weights` (`mla_jax.fp8_weights.WEIGHT_FORMATS`): the projections' and experts' format.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int = 0,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        moe: bool | None = None,
        moe_impl: str = "auto",
        weights=None,
    ):
        self.is_moe = cfg.is_moe_layer(layer_idx) if moe is None else bool(moe)
        norm = partial(RMSNorm, cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.input_layernorm = norm()
        self.self_attn = MLA(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, weights=weights)
        self.post_attention_layernorm = norm()
        if self.is_moe:
            self.mlp = MoE(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, impl=moe_impl, weights=weights)
        else:
            self.mlp = MLP(
                cfg.hidden_size,
                cfg.intermediate_size,
                rngs=rngs,
                dtype=dtype,
                param_dtype=param_dtype,
                init_std=cfg.initializer_range,
                weights=weights,
            )

    def forward(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        cache=None,
        *,
        absorbed: bool = False,
        stack_index=None,
        expert_offset=None,
        q_block: int | None = None,
        attn_impl: str = "xla",
        stacked: Stacked | None = None,
    ):
        """-> (out [B,T,D], RouterOutput or None for a dense layer, cache or None). `stack_index`: the
        routed experts' variables are the whole stack's and this is its layer `stack_index` (`expert_offset`:
        stack_index · E, when the caller has it; see `MoE`). `stacked`:
        projections may hold the whole stack's kernels (`mla_jax.linear`)."""
        # a decode step of up to NORM_ROWS rows (one, or a B = 1 MTP verify step's): the projections read the layer
        # input and apply its norm in their kernel (`Normed`)
        if stacked is not None and x_BTD.shape[0] * x_BTD.shape[1] <= NORM_ROWS:
            attn_in = Normed(x_BTD, self.input_layernorm, stacked.index)
        else:
            attn_in = self.input_layernorm(x_BTD)
        # a decode step the MoE's route kernel serves: the residual add, the norm and the router's logits in one
        # kernel (`moe_gate`), which sums the attention's split-K partials as it loads them
        gate = stacked is not None and self.is_moe and self.mlp.gates_by_kernel(x_BTD.shape[0] * x_BTD.shape[1])
        a = self.self_attn(
            attn_in,
            positions_BT,
            absorbed=absorbed,
            cache=cache,
            q_block=q_block,
            attn_impl=attn_impl,
            stacked=stacked,
            keep_splits=gate,
        )
        if cache is not None:
            a, cache = a
        logits = None
        if gate:
            norm, D = self.post_attention_layernorm, x_BTD.shape[-1]
            h, y, logits = moe_gate(
                x_BTD.reshape(-1, D),
                a,
                norm.weight[...],
                self.mlp.gate.kernel[...],
                stacked.index,
                eps=norm.eps,
                dtype=self.mlp.dtype,
                impl=stacked.impl,
            )
            h, y = h.reshape(x_BTD.shape), y.reshape(x_BTD.shape)
        else:
            h = x_BTD + a.astype(x_BTD.dtype)
            y = self.post_attention_layernorm(h, weight_apart=stacked is not None)
        r = None
        if self.is_moe:
            y, r = self.mlp(
                y,
                return_router=True,
                stack_index=stack_index,
                expert_offset=expert_offset,
                stacked=stacked,
                logits=logits,
            )
        else:
            y = self.mlp(y, stacked)
        return h + y.astype(h.dtype), r, cache

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        *,
        absorbed: bool = False,
        return_router: bool = False,
        cache=None,
    ):
        out, r, cache_out = self.forward(x_BTD, positions_BT, cache, absorbed=absorbed)
        if cache is not None:
            return out, cache_out
        return (out, r) if return_router else out
