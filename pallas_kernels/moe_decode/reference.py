"""`moe_decode`'s plain-XLA references: the routed experts through `lax.ragged_dot`, the shared experts as one
SwiGLU MLP, FP8 experts dequantized first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8_gemm.reference import dequantize_blocks


def _expert_slice(w, expert_offset, E):
    """Experts [offset, offset + E) of a weight array holding more (a stack of layers, flattened)."""
    if w.shape[0] == E:
        return w
    return lax.dynamic_slice_in_dim(w, jnp.asarray(expert_offset, jnp.int32), E, axis=0)


def _shared_layer(shared):
    """The shared experts' (gate [D, S], up [D, S], down [S, D]) of `shared.layer` (2-D weights as given)."""
    ws = (shared.gate_LDS, shared.up_LDS, shared.down_LSD)
    if ws[0].ndim == 2:
        return ws
    return tuple(lax.dynamic_index_in_dim(w, jnp.asarray(shared.layer, jnp.int32), 0, keepdims=False) for w in ws)


def shared_experts_reference(x_TD, shared):
    """silu(x·W_gate) * (x·W_up) · W_down of the shared experts over every row -> f32 [T, D]: the products in
    fp32, h rounded to x's dtype (as the routed experts' h), the weights cast to x's dtype."""
    dt = x_TD.dtype
    g, u, d = (w.astype(dt) for w in _shared_layer(shared))
    gs = jnp.dot(x_TD, g, preferred_element_type=jnp.float32)
    us = jnp.dot(x_TD, u, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gs) * us).astype(dt)
    return jnp.dot(h, d, preferred_element_type=jnp.float32)


def moe_decode_reference(
    x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, expert_offset=0, *, shared=None, x_shared_TD=None
):
    """silu(x·W_gate) * (x·W_up) · W_down per row's expert -> f32 [M, D] (rows past the groups: 0); with
    `shared` (`SharedExperts`) also the shared experts over `x_shared_TD` -> (f32 [M, D], f32 [T, D])
    (`shared_experts_reference`)."""
    if shared is not None:
        y = moe_decode_reference(x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, expert_offset)
        return y, shared_experts_reference(x_shared_TD, shared)
    E = group_sizes_E.shape[0]
    gate_EDI, up_EDI, down_EID = (_expert_slice(w, expert_offset, E) for w in (gate_EDI, up_EDI, down_EID))
    gs = group_sizes_E.astype(jnp.int32)
    dt = x_MD.dtype
    g = lax.ragged_dot(x_MD, gate_EDI.astype(dt), gs, preferred_element_type=jnp.float32)
    u = lax.ragged_dot(x_MD, up_EDI.astype(dt), gs, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(dt)
    y = lax.ragged_dot(h, down_EID.astype(dt), gs, preferred_element_type=jnp.float32)
    rows = jnp.arange(x_MD.shape[0])[:, None]
    return jnp.where(rows < jnp.sum(gs), y, 0.0)


def moe_decode_fp8_reference(
    x_MD, group_sizes_E, gate_EID, up_EID, down_EDI, gate_scale, up_scale, down_scale, expert_offset=0
):
    """`moe_decode_reference` on FP8 experts: the group's E experts (and their scales) taken at `expert_offset`,
    dequantized to x's dtype (fp32 products, rounded once) and transposed to [E, D, I] / [E, I, D]."""
    E = group_sizes_E.shape[0]
    ws = (_expert_slice(a, expert_offset, E) for a in (gate_EID, up_EID, down_EDI, gate_scale, up_scale, down_scale))
    g, u, d, sg, su, sd = ws
    gate, up, down = (
        dequantize_blocks(w, s).astype(x_MD.dtype).swapaxes(-1, -2) for w, s in ((g, sg), (u, su), (d, sd))
    )
    return moe_decode_reference(x_MD, group_sizes_E, gate, up, down)
