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

FP8 experts (`moe_decode_fp8`): DeepSeek-V3's release layout, gate/up [E, I, D] and down [E, D, I] e4m3 (torch's
[out, in]) with fp32 scales per 128x128 block. The same grid and row tiles; each weight tile is loaded as e4m3
(half of bf16's bytes), converted in registers (`pallas_kernels.fp8_matvec.to_compute`; optionally to f16 with
rows scaled into f16's range, `MoeDecodeConfig.fp8_f16`), and the block's scale multiplies the tile's fp32
partial product (the blocks divide 128, so a tile lies in one scale block).
`moe_decode_fp8_reference` dequantizes the group's experts and calls `moe_decode_reference`.
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
from pallas_kernels.fp8_gemm.config import QUANT_BLOCK
from pallas_kernels.fp8_gemm.reference import dequantize_blocks
from pallas_kernels.fp8_matvec import CONVERTS, FP8_DTYPE, prepare_rows, to_compute

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
      fp8_convert: how `moe_decode_fp8` converts its e4m3 tiles to the rows' dtype
        (`pallas_kernels.fp8_matvec.CONVERTS`).
      fp8_f16: `moe_decode_fp8`'s products in float16, as `fp8_matvec`'s default for bf16 rows: e4m3 -> f16 is
        one instruction for two values on Hopper, where e4m3 -> bf16 goes through f32. Gate/up: each row of x
        scaled by a power of two into f16's range, undone on the fp32 products before the SiLU; h then kept in
        fp32 between the kernels and its rows scaled the same way for the down products (undone on y). None or
        False: off (`fp8_default_config`, the config `moe_decode_fp8` takes when given none, sets it); float32
        rows never (exact).
    """

    block_i: int = 64
    block_d: int = 128
    block_o: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    fp8_convert: str = "cast"
    fp8_f16: bool | None = None

    def __post_init__(self):
        for f in ("block_i", "block_d", "block_o", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoeDecodeConfig.{f} must be a power of two >= 16, got {v}")
        if self.fp8_convert not in CONVERTS:
            raise ValueError(f"MoeDecodeConfig.fp8_convert must be one of {CONVERTS}, got {self.fp8_convert!r}")
        if self.fp8_f16 and self.fp8_convert != "cast":
            raise ValueError(f"MoeDecodeConfig.fp8_f16 converts e4m3 -> f16 by cast, not {self.fp8_convert!r}")

    def f16(self, x_dtype) -> bool:
        """Whether `moe_decode_fp8`'s products run in float16 for rows of `x_dtype`."""
        return bool(self.fp8_f16) and jnp.dtype(x_dtype) != jnp.float32


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


def fp8_default_config(D: int, I: int) -> MoeDecodeConfig:
    """`moe_decode_fp8`'s config when none is given: the down kernel's tiles 128 wide where the widths allow (its
    e4m3 tile at bf16's 64 x 64 holds 4 KB, a quarter of bf16's bytes in flight), 4 pipeline stages and f16
    products for bf16 rows (0.6x bf16's time: docs/PERFORMANCE.md, "FP8 weights")."""
    wide = lambda n: QUANT_BLOCK if n % QUANT_BLOCK == 0 else 64  # noqa: E731
    return MoeDecodeConfig(block_o=wide(D), block_k=wide(I), num_stages=4, fp8_f16=True)


def moe_decode_fp8_problems(D: int, I: int, config: MoeDecodeConfig | None = None) -> list[str]:
    """Why `moe_decode_fp8` cannot take these widths (empty when it can): `moe_decode_problems`, and every
    block at most 128 wide (a weight tile must lie in one 128x128 scale block). config None: `fp8_default_config`."""
    config = fp8_default_config(D, I) if config is None else config
    out = moe_decode_problems(D, I, config)
    for f in ("block_i", "block_d", "block_o", "block_k"):
        if (v := getattr(config, f)) > QUANT_BLOCK:
            out.append(f"{f} = {v} spans more than one {QUANT_BLOCK}-wide scale block")
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


def _product(x, w_ref, s_ref, e, k0, block_k, c0, block_c, convert):
    """x [R, block_k] · W_e[k0 : k0 + block_k, c0 : c0 + block_c] in fp32. bf16 experts (`s_ref` None) are stored
    [E, K, N]; FP8 experts [E, N, K] e4m3 with scales [E, nb, kb]: the tile is converted in registers and its
    block's scale multiplies the product."""
    if s_ref is None:
        return plt.dot(x, plt.load(w_ref.at[e, pl.ds(k0, block_k), pl.ds(c0, block_c)]))
    w = to_compute(plt.load(w_ref.at[e, pl.ds(c0, block_c), pl.ds(k0, block_k)]), x.dtype, convert)
    return plt.dot(x, w, trans_b=True) * s_ref[e, c0 // QUANT_BLOCK, k0 // QUANT_BLOCK]


def _gate_up_kernel(start_ref, size_ref, off_ref, x_ref, *refs, block_i, block_d, D, convert, row_scaled):
    """``row_scaled``: x holds rows scaled into f16 and the next ref their factors [rows, 1], which multiply the
    fp32 products before the SiLU."""
    rf_ref = None
    if row_scaled:
        rf_ref, *refs = refs
    if convert is None:  # bf16 experts
        (wg_ref, wu_ref, h_ref), sg_ref, su_ref = refs, None, None
    else:
        wg_ref, wu_ref, sg_ref, su_ref, h_ref = refs
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
            acc_g += _product(x, wg_ref, sg_ref, e, k * block_d, block_d, j * block_i, block_i, convert)
            acc_u += _product(x, wu_ref, su_ref, e, k * block_d, block_d, j * block_i, block_i, convert)
            return acc_g, acc_u

        zero = jnp.zeros((ROW_TILE, block_i), jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, D // block_d, chunk, (zero, zero))
        if rf_ref is not None:
            rf = plt.load(rf_ref.at[pl.ds(r0, ROW_TILE), pl.ds(0, 1)], mask=rmask, other=1.0)  # [R, 1]
            acc_g, acc_u = acc_g * rf, acc_u * rf
        h = jax.nn.silu(acc_g) * acc_u
        plt.store(h_ref.at[pl.ds(r0, ROW_TILE), cols], h.astype(h_ref.dtype), mask=rmask)
        return carry

    lax.fori_loop(0, pl.cdiv(n, ROW_TILE), row_tile, 0)


def _down_kernel(start_ref, size_ref, off_ref, h_ref, *refs, block_o, block_k, I, convert):
    if convert is None:
        (wd_ref, y_ref), sd_ref = refs, None
    else:
        wd_ref, sd_ref, y_ref = refs
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
            return acc + _product(h, wd_ref, sd_ref, e, k * block_k, block_k, j * block_o, block_o, convert)

        acc = lax.fori_loop(0, I // block_k, chunk, jnp.zeros((ROW_TILE, block_o), jnp.float32))
        plt.store(y_ref.at[pl.ds(r0, ROW_TILE), cols], acc, mask=rmask)
        return carry

    lax.fori_loop(0, pl.cdiv(n, ROW_TILE), row_tile, 0)


def _moe_decode_kernel(
    x_MD, group_sizes_E, gate, up, down, scales, expert_offset, *, config, interpret, group_starts_E=None
):
    """The two pallas_calls. bf16 experts: gate/up [E', D, I], down [E', I, D], `scales` None; FP8 experts:
    gate/up [E', I, D], down [E', D, I] e4m3 and `scales` (gate, up, down)."""
    M, D = x_MD.shape
    E = group_sizes_E.shape[0]
    fp8 = scales is not None
    I = gate.shape[1] if fp8 else gate.shape[2]
    dt = x_MD.dtype
    sizes = group_sizes_E.astype(jnp.int32)
    if group_starts_E is not None and group_starts_E.shape != sizes.shape:
        raise ValueError(f"group_starts must be [E={E}] like group_sizes, got shape {group_starts_E.shape}")
    starts = jnp.cumsum(sizes) - sizes if group_starts_E is None else group_starts_E.astype(jnp.int32)
    off = jnp.reshape(jnp.asarray(expert_offset, jnp.int32), (1,))
    params = plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    convert = config.fp8_convert if fp8 else None
    if fp8:
        gate_up, down_w = (gate, up, scales[0], scales[1]), (down, scales[2])
    else:
        gate_up, down_w = (gate.astype(dt), up.astype(dt)), (down.astype(dt),)
    row_scaled = fp8 and config.f16(dt)
    h_dtype = jnp.float32 if row_scaled else dt  # f16 products: h stays fp32 until its rows are scaled
    x = x_MD
    if row_scaled:  # f16 rows scaled by powers of two, their factors beside them
        x, _, factors = prepare_rows(x_MD, "f16")
        gate_up = (jnp.pad(factors, ((0, ROW_TILE), (0, 0)), constant_values=1.0), *gate_up)
    # The row tiles may read past M (masked); pad so that no address leaves the buffers.
    x = jnp.pad(x, ((0, ROW_TILE), (0, 0)))
    name = "moe_decode_fp8" if fp8 else "moe_decode"
    h = pl.pallas_call(
        functools.partial(
            _gate_up_kernel,
            block_i=config.block_i,
            block_d=config.block_d,
            D=D,
            convert=convert,
            row_scaled=row_scaled,
        ),
        out_shape=jax.ShapeDtypeStruct((M + ROW_TILE, I), h_dtype),
        grid=(E, I // config.block_i),
        compiler_params=params,
        interpret=interpret,
        name=name + "_gate_up",
    )(starts, sizes, off, x, *gate_up)
    h_factors = None
    if row_scaled:  # h's rows into f16 the same way; y's rows are multiplied back below
        h, _, h_factors = prepare_rows(h, "f16")
    y = pl.pallas_call(
        functools.partial(_down_kernel, block_o=config.block_o, block_k=config.block_k, I=I, convert=convert),
        out_shape=jax.ShapeDtypeStruct((M + ROW_TILE, D), jnp.float32),
        grid=(E, D // config.block_o),
        compiler_params=params,
        interpret=interpret,
        name=name + "_down",
    )(starts, sizes, off, h, *down_w)
    y = y[:M] if h_factors is None else y[:M] * h_factors[:M]
    rows = jnp.arange(M)[:, None]
    return jnp.where(rows < jnp.sum(sizes), y, 0.0)  # rows past the groups were never written


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
    group_starts_E=None,
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
      group_starts_E: None, or int [E] the first row of each group (the exclusive cumsum of `group_sizes_E`, which
        the kernel computes when not given).
    Fast while every expert has at most 16 rows (weights read once); correct for any sizes.
    """
    config = MoeDecodeConfig() if config is None else config
    _validate(x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, config)
    impl = backend.resolve(impl)
    if impl == "reference":
        return moe_decode_reference(x_MD, group_sizes_E, gate_EDI, up_EDI, down_EID, expert_offset)
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
        group_starts_E=group_starts_E,
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
    """`moe_decode` on FP8 experts as DeepSeek-V3 releases them -> f32 [M, D].

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
    Each touched expert's e4m3 bytes are read once while every expert has at most 16 rows. "auto" takes the
    reference for expert stacks the Triton lowering cannot index (`backend.triton_offset_problems`), "kernel"
    refuses them.
    """
    config = fp8_default_config(x_MD.shape[-1], gate_EID.shape[1]) if config is None else config
    scales = (gate_scale, up_scale, down_scale)
    _validate_fp8(x_MD, group_sizes_E, gate_EID, up_EID, down_EDI, scales, config)
    too_large = [
        p
        for n, w in (("gate", gate_EID), ("down", down_EDI))
        for p in backend.triton_offset_problems(n, w.shape, w.dtype)
    ]
    impl = backend.choose(impl, too_large, name="moe_decode_fp8 impl")
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
