"""The SwiGLU feed-forward block shared by dense layers and shared experts.

Dimension letters: B batch, T tokens, D hidden_size, F the block's intermediate width.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import fp8_weights, initializers
from mla_jax.linear import Stacked, project


class MLP(nnx.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)): [..., D] -> [..., D] in `dtype`.

    HF names `gate_proj`/`up_proj`/`down_proj` (official `w1`/`w3`/`w2`); kernels are [in, out].
    `weights` (`mla_jax.fp8_weights.WEIGHT_FORMATS`): "fp8" makes each projection an `Fp8Linear`.
    """

    def __init__(
        self,
        dim: int,
        inter_dim: int,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        init_std: float = 0.02,
        weights=None,
    ):
        lin = partial(
            fp8_weights.linear,
            weights=weights,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=initializers.normal(init_std),
            rngs=rngs,
        )
        self.gate_proj = lin(dim, inter_dim)
        self.up_proj = lin(dim, inter_dim)
        self.down_proj = lin(inter_dim, dim)

    def __call__(self, x: jax.Array, stacked: Stacked | None = None) -> jax.Array:
        """`stacked`: see `mla_jax.linear`."""
        h = jax.nn.silu(project(self.gate_proj, x, stacked)) * project(self.up_proj, x, stacked)
        return project(self.down_proj, h, stacked)
