"""Decode-shaped routed experts: a grouped GEMM over few rows per expert (Pallas, Triton backend).

Dimension letters: M assignment rows (token, chosen expert) sorted by expert, E experts,
D model width, I expert width, R rows a tile (`MoeDecodeConfig.row_tile`: 16, the smallest tensor-core M, or 32).

A decode step routes T·K rows (B = 1: 6 rows for V2-Lite) over E experts. A grouped GEMM tiled for
prefill pads each expert's rows to 128-row tiles and schedules tiles for experts that got none;
this one gives every expert its own programs and lets those of untouched experts return at once:

  gate_up: grid (E, I / block_i). Program (e, j) loops over expert e's rows R at a time and, for
           each row tile, over D in `block_d` chunks: h = silu(x·W_gate[e][:, j]) * (x·W_up[e][:, j]).
  down:    grid (E, D / block_o): y = h·W_down[e][:, j] over I in `block_k` chunks.

A program reads its expert's weights once a row tile, so with at most R rows per expert every expert's weights are
read exactly once, which is the floor of a decode step's MoE: Σ over touched experts of 3·D·I weights. An expert
routed more rows than a tile reads them again per tile, from HBM (the programs of a step stream more weights than
the L2 holds): at R = 16, V2-Lite at B = 128 (768 rows over 64 experts, 12 an expert on average) has about one
expert in eleven above 16 rows, which 32-row tiles would read once (`MoeDecodeConfig(row_tile=32)`; the default is
16, the smallest tile: where experts get few rows a taller one idles; 32 is not yet timed on a card).
Rows are the assignments sorted by expert (`group_sizes` [E] rows each, in expert order); rows past
sum(group_sizes) are not written (the caller masks them). Accumulation in fp32, inputs bf16.

Shared experts (`SharedExperts`, optional): DeepSeek's n_shared experts are one SwiGLU MLP of width
S = n_shared · I over every token, stored as a model keeps an `nnx.Linear` stack (gate/up [L, D, S], down
[L, S, D], read in place at a layer index). They run inside the same two launches as S / I pseudo-experts of
width I after the E routed ones (grids (E + S/I, ...)): program h reads columns (gate/up) or rows (down)
[h·I, (h+1)·I) of the shared weights and all T token rows, R at a time. The gate/up launch writes their h
[T, S] as a second output, the down launch their partial products f32 [S/I, T, D] (summed after). A decode
step's MoE layer is then two launches, routed and shared experts together.

`moe_decode_reference` is the same function through `jax.lax.ragged_dot` (plain XLA).

FP8 experts (`moe_decode_fp8`): DeepSeek-V3's release layout, gate/up [E, I, D] and down [E, D, I] e4m3 (torch's
[out, in]) with fp32 scales per 128x128 block. The same grid and row tiles; each weight tile is loaded as e4m3
(half of bf16's bytes), converted in registers (`pallas_kernels.fp8_matvec.to_compute`; optionally to f16 with
rows scaled into f16's range, `MoeDecodeConfig.fp8_f16`), and the block's scale multiplies the tile's fp32
partial product (the blocks divide 128, so a tile lies in one scale block).
`moe_decode_fp8_reference` dequantizes the group's experts and calls `moe_decode_reference`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import backend
from pallas_kernels.fp8_gemm.config import QUANT_BLOCK
from pallas_kernels.fp8_matvec import CONVERTS, FP8_DTYPE
from pallas_kernels.moe_decode.kernel import ROW_TILE, _moe_decode_kernel
from pallas_kernels.moe_decode.reference import (
    moe_decode_fp8_reference,
    moe_decode_reference,
    shared_experts_reference,
)

__all__ = [
    "ROW_TILE",
    "SHARED_MAX_ROWS",
    "MoeDecodeConfig",
    "SharedExperts",
    "default_config",
    "fp8_default_config",
    "moe_decode",
    "moe_decode_fp8",
    "moe_decode_fp8_problems",
    "moe_decode_fp8_reference",
    "moe_decode_problems",
    "moe_decode_reference",
    "shared_experts_reference",
]

# Tokens up to which the shared experts ride in the routed launches: their programs read the weights once a row
# tile, so past one tile they outlast the routed programs (V2-Lite on an H200, gate/up of a step: 5.2 / 7.9 ms at
# B = 32 / 128 with them against 4.6 / 5.6 ms without, 16-row tiles; docs/PERFORMANCE.md, "Tried and rejected").
# The smallest tile's height: the tokens fit one tile at any `MoeDecodeConfig.row_tile`.
SHARED_MAX_ROWS = ROW_TILE


@dataclasses.dataclass(frozen=True)
class MoeDecodeConfig:
    """Static tuning knobs of `moe_decode`.

    Attributes:
      block_i: expert-width columns a gate/up program computes (divides I).
      block_d: contraction chunk of the gate/up loop (divides D).
      block_o: model-width columns a down program computes (divides D).
      block_k: contraction chunk of the down loop (divides I).
      num_warps, num_stages: Triton's launch knobs (warps a program; software-pipeline depth).
      fp8_convert: how `moe_decode_fp8` converts its e4m3 tiles to the rows' dtype
        (`pallas_kernels.fp8_matvec.CONVERTS`).
      fp8_f16: `moe_decode_fp8`'s products in float16, as `fp8_matvec`'s default for bf16 rows: e4m3 -> f16 is
        one instruction for two values on Hopper, where e4m3 -> bf16 goes through f32. Gate/up: each row of x
        scaled by a power of two into f16's range, undone on the fp32 products before the SiLU; h then kept in
        fp32 between the kernels and its rows scaled the same way for the down products (undone on y). None or
        False: off (`fp8_default_config`, the config `moe_decode_fp8` takes when given none, sets it); float32
        rows never (exact).
      row_tile: rows a program computes at a time (routed and shared), a power of two from 16 (`ROW_TILE`, the
        smallest M of a tensor-core dot) to 64. A program reads its expert's weights once a tile, so once while
        the expert has at most `row_tile` rows; a taller tile costs registers and idle rows where experts have
        few. 16 unless given.
    """

    block_i: int = 64
    block_d: int = 128
    block_o: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    fp8_convert: str = "cast"
    fp8_f16: bool | None = None
    row_tile: int = ROW_TILE

    def __post_init__(self):
        for f in ("block_i", "block_d", "block_o", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoeDecodeConfig.{f} must be a power of two >= 16, got {v}")
        rt = self.row_tile
        if not ROW_TILE <= rt <= 4 * ROW_TILE or rt & (rt - 1):  # 64 at most: two fp32 [rt, block_i] accumulators
            raise ValueError(f"MoeDecodeConfig.row_tile must be a power of two from {ROW_TILE} to 64, got {rt}")
        if self.fp8_convert not in CONVERTS:
            raise ValueError(f"MoeDecodeConfig.fp8_convert must be one of {CONVERTS}, got {self.fp8_convert!r}")
        if self.fp8_f16 and self.fp8_convert != "cast":
            raise ValueError(f"MoeDecodeConfig.fp8_f16 converts e4m3 -> f16 by cast, not {self.fp8_convert!r}")

    def f16(self, x_dtype) -> bool:
        """Whether `moe_decode_fp8`'s products run in float16 for rows of `x_dtype`."""
        return bool(self.fp8_f16) and jnp.dtype(x_dtype) != jnp.float32


class SharedExperts(NamedTuple):
    """The shared experts `moe_decode` runs with the routed ones: one SwiGLU MLP of width S (n_shared · I).

    gate_LDS, up_LDS: [L, D, S] (a scanned stack of `nnx.Linear` kernels, [in, out]) or [D, S] (one layer);
    down_LSD: [L, S, D] or [S, D]; all read in place at `layer` (an int scalar, may be traced; 0 <= layer < L,
    not checked when traced; ignored for 2-D weights). Cast to the rows' dtype.
    """

    gate_LDS: Any
    up_LDS: Any
    down_LSD: Any
    layer: Any = 0


def moe_decode_problems(D: int, I: int, config: MoeDecodeConfig = MoeDecodeConfig(), S: int | None = None) -> list[str]:
    """Why `moe_decode` cannot take these widths (empty when it can). `S`: the shared experts' width, when
    they run in the kernel too: a multiple of I (they run as S / I pseudo-experts of width I; S = n_shared · I
    for DeepSeek, 2816 = 2 · 1408 for V2-Lite), hence of the blocks that divide I."""
    out = []
    for name, dim, blocks in (
        ("D (hidden_size)", D, (config.block_d, config.block_o)),
        ("I (moe_intermediate_size)", I, (config.block_i, config.block_k)),
    ):
        for b in sorted(set(blocks)):
            if dim % b:
                out.append(f"{name} = {dim} is not a multiple of the block {b}")
    if S is not None and (S < I or S % I):
        out.append(f"S (the shared experts' width) = {S} is not a multiple of I = {I}")
    return out


def default_config(D: int, I: int) -> MoeDecodeConfig:
    """`moe_decode`'s config when none is given: the down kernel's contraction chunk 128 wide where I allows
    (V2-Lite B = 1: 14.0 against 16.1 us a layer; B = 32 unchanged, at the copy rate: docs/PERFORMANCE.md,
    "End-to-end decode against the weight + KV floor"), the rest `MoeDecodeConfig`'s defaults."""
    return MoeDecodeConfig(block_k=QUANT_BLOCK if I % QUANT_BLOCK == 0 else 64)


def fp8_default_config(D: int, I: int) -> MoeDecodeConfig:
    """`moe_decode_fp8`'s config when none is given: the down kernel's tiles 128 wide where the widths allow (its
    e4m3 tile at bf16's 64 x 64 holds 4 KB, a quarter of bf16's bytes in flight), 4 pipeline stages and f16
    products for bf16 rows (0.6x bf16's time: docs/PERFORMANCE.md, "FP8 weights")."""
    wide = lambda n: QUANT_BLOCK if n % QUANT_BLOCK == 0 else 64  # noqa: E731
    return MoeDecodeConfig(block_o=wide(D), block_k=wide(I), num_stages=4, fp8_f16=True)


def moe_decode_fp8_problems(
    D: int, I: int, config: MoeDecodeConfig | None = None, *, experts: int | None = None
) -> list[str]:
    """Why `moe_decode_fp8` cannot take these widths (empty when it can): `moe_decode_problems`, and every
    block at most 128 wide (a weight tile must lie in one 128x128 scale block). config None: `fp8_default_config`.
    `experts`: the experts of the (flattened) stack it would read; its arrays must be ones the Triton lowering
    indexes (`_stack_problems`; "auto" takes the reference for the others)."""
    config = fp8_default_config(D, I) if config is None else config
    out = moe_decode_problems(D, I, config)
    for f in ("block_i", "block_d", "block_o", "block_k"):
        if (v := getattr(config, f)) > QUANT_BLOCK:
            out.append(f"{f} = {v} spans more than one {QUANT_BLOCK}-wide scale block")
    return out + ([] if experts is None else _stack_problems((experts, I, D), (experts, D, I)))


def _stack_problems(gate_shape, down_shape) -> list[str]:
    """The e4m3 expert arrays (gate / up, down) the Triton lowering cannot index (`backend.triton_offset_problems`)."""
    pairs = (("gate", gate_shape), ("down", down_shape))
    return [p for n, shape in pairs for p in backend.triton_offset_problems(n, shape, FP8_DTYPE)]


def _validate(x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, config, shared=None, x_shared_TD=None):
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
    S = None
    if (shared is None) != (x_shared_TD is None):
        raise ValueError("moe_decode: shared experts need both `shared` and `x_shared_TD`, got only one")
    if shared is not None:
        if not isinstance(shared, SharedExperts):
            raise ValueError(f"moe_decode: shared must be a SharedExperts, got {type(shared).__name__}")
        g, u, d = shared.gate_LDS, shared.up_LDS, shared.down_LSD
        if g.ndim not in (2, 3) or g.shape[-2] != D or u.shape != g.shape:
            raise ValueError(
                f"shared gate/up weights must both be [L, D={D}, S] or [D={D}, S], got {g.shape} and {u.shape}"
            )
        S = g.shape[-1]
        if d.shape != g.shape[:-2] + (S, D):
            raise ValueError(f"shared down weights must be {g.shape[:-2] + (S, D)}, got {d.shape}")
        if x_shared_TD.ndim != 2 or x_shared_TD.shape[1] != D or x_shared_TD.dtype != x_MD.dtype:
            raise ValueError(
                f"x_shared must be {x_MD.dtype} [T, D={D}], got {x_shared_TD.dtype} {tuple(x_shared_TD.shape)}"
            )
        if jnp.ndim(shared.layer) != 0:
            raise ValueError(f"shared.layer must be an int scalar, got shape {jnp.shape(shared.layer)}")
    problems = moe_decode_problems(D, I, config, S)
    if problems:
        raise ValueError("moe_decode: " + "; ".join(problems))


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
    shared: SharedExperts | None = None,
    x_shared_TD=None,
    group_starts_E=None,
    expert_programs=None,
    row_tokens=None,
):
    """The routed experts of sorted assignment rows -> f32 [M, D]; with `shared`, also the shared experts of the
    tokens -> (f32 [M, D], f32 [T, D]).

    Args:
      x_MD: [M, D] bf16 (or f32) rows, sorted by expert: the first group_sizes[0] use expert 0, ...
      group_sizes_E: int [E] rows per expert (sum <= M; rows past the sum come back as 0).
      gate_EDI, up_EDI: [E', D, I]; down_EID: [E', I, D] (cast to x's dtype), E' >= E: the weights
        may hold the experts of every layer of a stack, flattened ([L·E, ...], a free reshape of a
        scanned stack's [L, E, ...]); group e then uses weights `expert_offset + e` (an int scalar,
        may be traced: layer · E). The kernel reads them in place: no per-layer copy.
      config: `MoeDecodeConfig`; D and I must be multiples of its blocks (`moe_decode_problems`). None:
        `default_config(D, I)`.
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU, else the reference).
      shared: `SharedExperts` or None. Given, the shared experts (width S, a multiple of I:
        `moe_decode_problems(D, I, config, S)`) run in the same two launches over `x_shared_TD`, and the call
        returns (y_MD, y_shared_TD): y_shared = silu(x_shared·W_gate) * (x_shared·W_up) · W_down in fp32, h
        rounded to x's dtype between the two products (`shared_experts_reference`). Not added to anything.
      x_shared_TD: [T, D] the tokens (any order; x's dtype), with `shared` only.
      group_starts_E: int [E] the groups' first rows (the exclusive cumsum of group_sizes), when the caller has
        it; None: computed here. Not checked: a wrong one reads and writes other groups' rows.
      expert_programs: (experts, starts, sizes), int [A] each: the routed programs' experts (group ids; one of
        size 0 may name any id, its weights are not read) and their rows, e.g. only the experts that got rows
        (`pallas_kernels.moe_route`'s): A · (I / block_i) gate/up programs instead of E · (I / block_i), none
        of them idle at B = 1 (a program of size 0 returns). None: one program per expert, its rows from
        group_sizes / group_starts. Not checked against group_sizes.
      row_tokens: int [M] or None. Given, x_MD holds the T tokens [T, D] and row r is token row_tokens[r] (the
        kernel gathers it as it loads it: no [M, D] rows are made), and the shared experts read the T tokens
        (`x_shared_TD` then None). Tokens past the rows the groups cover may be anything in [0, T).
    A program reads its expert's weights once per row tile (`config.row_tile` rows) of the expert's rows: once
    while every expert has at most a tile's rows; correct for any sizes. The shared programs read their weights once
    per row tile of tokens. (`moe_decode_fp8` takes no shared experts.)
    """
    x_rows = x_MD
    if row_tokens is not None:
        if jnp.ndim(row_tokens) != 1 or not jnp.issubdtype(jnp.result_type(row_tokens), jnp.integer):
            raise ValueError(f"row_tokens must be int [M], got {jnp.result_type(row_tokens)} {jnp.shape(row_tokens)}")
        if x_shared_TD is not None:
            raise ValueError("moe_decode: with row_tokens the shared experts read x's tokens; x_shared_TD must be None")
        x_rows = jax.ShapeDtypeStruct((jnp.shape(row_tokens)[0], x_MD.shape[-1]), x_MD.dtype)  # what is checked
        x_shared_TD = x_MD if shared is not None else None
    config = default_config(x_MD.shape[-1], gate_EDI.shape[-1]) if config is None else config
    _validate(x_rows, group_sizes_E, gate_EDI, up_EDI, down_EID, config, shared, x_shared_TD)
    if expert_programs is not None:
        A = jnp.shape(expert_programs[0])[0]
        if len(expert_programs) != 3 or any(jnp.shape(a) != (A,) for a in expert_programs):
            raise ValueError(
                f"expert_programs must be three int [A] arrays (experts, starts, sizes), got shapes "
                f"{[jnp.shape(a) for a in expert_programs]}"
            )
    impl = backend.resolve(impl)
    if impl == "reference":
        x_rows = x_MD if row_tokens is None else x_MD[row_tokens]
        return moe_decode_reference(
            x_rows, group_sizes_E, gate_EDI, up_EDI, down_EID, expert_offset, shared=shared, x_shared_TD=x_shared_TD
        )
    return _moe_decode_kernel(
        x_MD,
        group_sizes_E,
        gate_EDI,
        up_EDI,
        down_EID,
        None,
        expert_offset,
        config=config,
        interpret=impl == "interpret",
        shared=shared,
        x_shared_TD=x_shared_TD,
        group_starts_E=group_starts_E,
        expert_programs=expert_programs,
        row_tokens=row_tokens,
    )


def _validate_fp8(x_MD, group_sizes_E, gate_EID, up_EID, down_EDI, scales, config):
    if x_MD.ndim != 2 or x_MD.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bfloat16 or float32 [M, D], got {x_MD.dtype} {x_MD.shape}")
    M, D = x_MD.shape
    for name, w in (("gate", gate_EID), ("up", up_EID), ("down", down_EDI)):
        if w.dtype != FP8_DTYPE or w.ndim != 3:
            raise ValueError(f"{name} weights must be float8_e4m3fn [E, out, in], got {w.dtype} {w.shape}")
    if gate_EID.shape[2] != D or up_EID.shape != gate_EID.shape:
        raise ValueError(f"gate/up weights must both be [E, I, D={D}], got {gate_EID.shape} and {up_EID.shape}")
    Ew, I, _ = gate_EID.shape
    if down_EDI.shape != (Ew, D, I):
        raise ValueError(f"down weights must be [E={Ew}, D={D}, I={I}], got {down_EDI.shape}")
    for name, w, s in zip(("gate", "up", "down"), (gate_EID, up_EID, down_EDI), scales):
        want = (Ew, -(-w.shape[1] // QUANT_BLOCK), -(-w.shape[2] // QUANT_BLOCK))
        if tuple(s.shape) != want or s.dtype != jnp.float32:
            raise ValueError(f"{name} scales must be float32 {want} (one per 128x128 block), got {s.dtype} {s.shape}")
    if group_sizes_E.ndim != 1 or not 1 <= group_sizes_E.shape[0] <= Ew or Ew % group_sizes_E.shape[0]:
        raise ValueError(
            f"group_sizes must be [E] with E dividing the {Ew} experts of the weights, got {group_sizes_E.shape}"
        )
    problems = moe_decode_fp8_problems(D, I, config)
    if problems:
        raise ValueError("moe_decode_fp8: " + "; ".join(problems))


def moe_decode_fp8(
    x_MD,
    group_sizes_E,
    gate_EID,
    up_EID,
    down_EDI,
    gate_scale,
    up_scale,
    down_scale,
    *,
    expert_offset=0,
    config: MoeDecodeConfig | None = None,
    impl: str | None = "auto",
    group_starts_E=None,
):
    """`moe_decode` on FP8 experts as DeepSeek-V3 releases them -> f32 [M, D]. Routed experts only: no shared
    experts (`SharedExperts`) here; a caller runs those apart.

    Args:
      x_MD, group_sizes_E: as `moe_decode` (x bf16, or f32).
      gate_EID, up_EID: float8_e4m3fn [E', I, D]; down_EDI: float8_e4m3fn [E', D, I] (torch's [out, in] per
        expert), E' >= E: a stack's experts flattened, group e using `expert_offset + e`, read in place.
      gate_scale, up_scale, down_scale: fp32 [E', ceil(out/128), ceil(in/128)]; W = w · scale per 128x128 block.
      config: `MoeDecodeConfig` (`moe_decode_fp8_problems`: D and I multiples of its blocks, blocks <= 128);
        None: `fp8_default_config(D, I)`.
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU, else
        `moe_decode_fp8_reference`).
      group_starts_E: as `moe_decode`.
    Each touched expert's e4m3 bytes are read once while every expert has at most `config.row_tile` rows
    (`fp8_default_config`: 16). "auto" takes the reference for expert stacks the Triton lowering cannot index
    (`backend.triton_offset_problems`), "kernel" refuses them.
    """
    config = fp8_default_config(x_MD.shape[-1], gate_EID.shape[1]) if config is None else config
    scales = (gate_scale, up_scale, down_scale)
    _validate_fp8(x_MD, group_sizes_E, gate_EID, up_EID, down_EDI, scales, config)
    impl = backend.choose(impl, _stack_problems(gate_EID.shape, down_EDI.shape), name="moe_decode_fp8 impl")
    if impl == "reference":
        return moe_decode_fp8_reference(x_MD, group_sizes_E, gate_EID, up_EID, down_EDI, *scales, expert_offset)
    return _moe_decode_kernel(
        x_MD,
        group_sizes_E,
        gate_EID,
        up_EID,
        down_EDI,
        scales,
        expert_offset,
        config=config,
        interpret=impl == "interpret",
        group_starts_E=group_starts_E,
    )
