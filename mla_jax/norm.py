"""RMSNorm as HF transformers' DeepSeek: normalise in fp32, cast to the input dtype, scale by `weight`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.stacked_matmul import rms_norm


class RMSNorm(nnx.Module):
    """y = weight * (x / sqrt(mean(x², -1) + eps)); `weight` [dim] is the HF checkpoint's `*.weight`."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array, *, weight_apart: bool = False) -> jax.Array:
        """``weight_apart``: see `rms_norm` (a scanned layer's norm in a decode step: its weight is a slice)."""
        return rms_norm(x, self.weight[...], self.eps, weight_apart=weight_apart)
