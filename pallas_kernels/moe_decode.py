"""Decode-shaped routed experts: a grouped GEMM over few rows per expert (Pallas, Triton backend).

Dimension letters: M assignment rows (token, chosen expert) sorted by expert, E experts,
D model width, I expert width, R = 16 rows a tile (the smallest tensor-core M).

A decode step routes T·K rows (B = 1: 6 rows for V2-Lite) over E experts. A grouped GEMM tiled for
prefill pads each expert's rows to 128-row tiles and schedules tiles for experts that got none;
this one gives every expert its own programs and lets those of untouched experts return at once:

  gate_up: grid (E, I / block_i). Program (e, j) loops over expert e's rows 16 at a time and, for
           each row tile, over D in `block_d` chunks: h = silu(x·W_gate[e][:, j]) * (x·W_up[e][:, j]).
  down:    grid (E, D / block_o): y = h·W_down[e][:, j] over I in `block_k` chunks.

With at most 16 rows per expert (decode up to B ≈ 128 on V2-Lite) every expert's weights are read
exactly once, which is the floor of a decode step's MoE: Σ over touched experts of 3·D·I weights.
Rows are the assignments sorted by expert (`group_sizes` [E] rows each, in expert order); rows past
sum(group_sizes) are not written (the caller masks them). Accumulation in fp32, inputs bf16.

`moe_decode_reference` is the same function through `jax.lax.ragged_dot` (plain XLA).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend

ROW_TILE = 16  # rows a tile: the smallest M of a tensor-core dot


@dataclasses.dataclass(frozen=True)
class MoeDecodeConfig:
    """Static tuning knobs of `moe_decode`.

    Attributes:
      block_i: expert-width columns a gate/up program computes (divides I).
      block_d: contraction chunk of the gate/up loop (divides D).
      block_o: model-width columns a down program computes (divides D).
      block_k: contraction chunk of the down loop (divides I).
      num_warps, num_stages: Triton's launch knobs (warps a program; software-pipeline depth).
    """

    block_i: int = 64
    block_d: int = 128
    block_o: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for f in ("block_i", "block_d", "block_o", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoeDecodeConfig.{f} must be a power of two >= 16, got {v}")


def moe_decode_problems(D: int, I: int, config: MoeDecodeConfig = MoeDecodeConfig()) -> list[str]:
    """Why `moe_decode` cannot take these widths (empty when it can)."""
    out = []
    for name, dim, blocks in (
        ("D (hidden_size)", D, (config.block_d, config.block_o)),
        ("I (moe_intermediate_size)", I, (config.block_i, config.block_k)),
    ):
        for b in sorted(set(blocks)):
            if dim % b:
                out.append(f"{name} = {dim} is not a multiple of the block {b}")
    return out


def _expert_slice(w, expert_offset, E):
    """Experts [offset, offset + E) of a weight array holding more (a stack of layers, flattened)."""
    if w.shape[0] == E:
        return w
    return lax.dynamic_slice_in_dim(w, jnp.asarray(expert_offset, jnp.int32), E, axis=0)


def moe_decode_reference(x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, expert_offset=0):
    """silu(x·W_gate) * (x·W_up) · W_down per row's expert -> f32 [M, D] (rows past the groups: 0)."""
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


def _validate(x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, config):
    if x_MD.ndim != 2:
        raise ValueError(f"x must be [M, D], got shape {x_MD.shape}")
    M, D = x_MD.shape
    if gate_EDI.ndim != 3 or gate_EDI.shape[1] != D or up_EDI.shape != gate_EDI.shape:
        raise ValueError(f"gate/up weights must both be [E, D={D}, I], got {gate_EDI.shape} and {up_EDI.shape}")
    Ew, _, I = gate_EDI.shape
    if down_EID.shape != (Ew, I, D):
        raise ValueError(f"down weights must be [E={Ew}, I={I}, D={D}], got {down_EID.shape}")
    if group_sizes_E.ndim != 1 or not 1 <= group_sizes_E.shape[0] <= Ew or Ew % group_sizes_E.shape[0]:
        raise ValueError(
            f"group_sizes must be [E] with E dividing the {Ew} experts of the weights, got {group_sizes_E.shape}"
        )
    problems = moe_decode_problems(D, I, config)
    if problems:
        raise ValueError("moe_decode: " + "; ".join(problems))


def _gate_up_kernel(start_ref, size_ref, off_ref, x_ref, wg_ref, wu_ref, h_ref, *, block_i, block_d, D):
    j = pl.program_id(1)
    start, n = start_ref[pl.program_id(0)], size_ref[pl.program_id(0)]
    e = off_ref[0] + pl.program_id(0)  # the expert's index in the weights (a layer stack, flattened)
    cols = pl.ds(j * block_i, block_i)

    def row_tile(t, carry):
        r0 = start + t * ROW_TILE
        rmask = (r0 + jnp.arange(ROW_TILE) < start + n)[:, None]

        def chunk(k, accs):
            acc_g, acc_u = accs
            d = pl.ds(k * block_d, block_d)
            x = plt.load(x_ref.at[pl.ds(r0, ROW_TILE), d], mask=rmask, other=0.0)  # [R, block_d]
            acc_g += plt.dot(x, plt.load(wg_ref.at[e, d, cols]))  # [R, block_i]
            acc_u += plt.dot(x, plt.load(wu_ref.at[e, d, cols]))
            return acc_g, acc_u

        zero = jnp.zeros((ROW_TILE, block_i), jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, D // block_d, chunk, (zero, zero))
        h = jax.nn.silu(acc_g) * acc_u
        plt.store(h_ref.at[pl.ds(r0, ROW_TILE), cols], h.astype(h_ref.dtype), mask=rmask)
        return carry

    lax.fori_loop(0, pl.cdiv(n, ROW_TILE), row_tile, 0)


def _down_kernel(start_ref, size_ref, off_ref, h_ref, wd_ref, y_ref, *, block_o, block_k, I):
    j = pl.program_id(1)
    start, n = start_ref[pl.program_id(0)], size_ref[pl.program_id(0)]
    e = off_ref[0] + pl.program_id(0)
    cols = pl.ds(j * block_o, block_o)

    def row_tile(t, carry):
        r0 = start + t * ROW_TILE
        rmask = (r0 + jnp.arange(ROW_TILE) < start + n)[:, None]

        def chunk(k, acc):
            i = pl.ds(k * block_k, block_k)
            h = plt.load(h_ref.at[pl.ds(r0, ROW_TILE), i], mask=rmask, other=0.0)  # [R, block_k]
            return acc + plt.dot(h, plt.load(wd_ref.at[e, i, cols]))  # [R, block_o]

        acc = lax.fori_loop(0, I // block_k, chunk, jnp.zeros((ROW_TILE, block_o), jnp.float32))
        plt.store(y_ref.at[pl.ds(r0, ROW_TILE), cols], acc, mask=rmask)
        return carry

    lax.fori_loop(0, pl.cdiv(n, ROW_TILE), row_tile, 0)


def _moe_decode_kernel(x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, expert_offset, *, config, interpret):
    M, D = x_MD.shape
    E, I = group_sizes_E.shape[0], gate_EDI.shape[2]
    dt = x_MD.dtype
    sizes = group_sizes_E.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    off = jnp.reshape(jnp.asarray(expert_offset, jnp.int32), (1,))
    params = plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    # The row tiles may read past M (masked); pad so that no address leaves the buffers.
    x = jnp.pad(x_MD, ((0, ROW_TILE), (0, 0)))
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, block_i=config.block_i, block_d=config.block_d, D=D),
        out_shape=jax.ShapeDtypeStruct((M + ROW_TILE, I), dt),
        grid=(E, I // config.block_i),
        compiler_params=params,
        interpret=interpret,
        name="moe_decode_gate_up",
    )(starts, sizes, off, x, gate_EDI.astype(dt), up_EDI.astype(dt))
    y = pl.pallas_call(
        functools.partial(_down_kernel, block_o=config.block_o, block_k=config.block_k, I=I),
        out_shape=jax.ShapeDtypeStruct((M + ROW_TILE, D), jnp.float32),
        grid=(E, D // config.block_o),
        compiler_params=params,
        interpret=interpret,
        name="moe_decode_down",
    )(starts, sizes, off, h, down_EID.astype(dt))
    rows = jnp.arange(M)[:, None]
    return jnp.where(rows < jnp.sum(sizes), y[:M], 0.0)  # rows past the groups were never written


def moe_decode(
    x_MD,
    group_sizes_E,
    gate_EDI,
    up_EDI,
    down_EID,
    *,
    expert_offset=0,
    config: MoeDecodeConfig | None = None,
    impl: str | None = "auto",
):
    """The routed experts of sorted assignment rows -> f32 [M, D].

    Args:
      x_MD: [M, D] bf16 (or f32) rows, sorted by expert: the first group_sizes[0] use expert 0, ...
      group_sizes_E: int [E] rows per expert (sum <= M; rows past the sum come back as 0).
      gate_EDI, up_EDI: [E', D, I]; down_EID: [E', I, D] (cast to x's dtype), E' >= E: the weights
        may hold the experts of every layer of a stack, flattened ([L·E, ...], a free reshape of a
        scanned stack's [L, E, ...]); group e then uses weights `expert_offset + e` (an int scalar,
        may be traced: layer · E). The kernel reads them in place: no per-layer copy.
      config: `MoeDecodeConfig`; D and I must be multiples of its blocks (`moe_decode_problems`).
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU, else the reference).
    Fast while every expert has at most 16 rows (weights read once); correct for any sizes.
    """
    config = MoeDecodeConfig() if config is None else config
    _validate(x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, config)
    impl = backend.resolve(impl)
    if impl == "reference":
        return moe_decode_reference(x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, expert_offset)
    return _moe_decode_kernel(
        x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, expert_offset, config=config, interpret=impl == "interpret"
    )
