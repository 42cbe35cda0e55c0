"""Paged gather: copy each sequence's cache pages, in block-table order, into a contiguous buffer.

Dimension letters: B batch, P pages, T tokens gathered per sequence, K = 576 (512 latent ; 64 rope).

The prefill path attends with decompressed K/V over the cached prefix, which wants the prefix as a
dense [B, T, 576] array. The kernel streams pages through SMEM with TMA (one bulk load and one bulk store
per page, several pages in flight per CTA); its aim is the device-to-device copy rate (docs/PERFORMANCE.md,
"Paged gather", has what it reaches).

The pages' format is a `PageFormat` (given, or read from the pages' dtype and width); the kernel serves
`KERNEL_FORMATS` (`paged_gather_problems` says why not), the reference every format. Three bodies:

* bf16 pages: a copy. Each page goes GMEM -> SMEM -> GMEM untouched.
* fp8 pages (`FP8_PAGES`, uint8 [N, 64, 656]: 512 e4m3 | 4 fp32 scales | 64 bf16 rope a token):
  the TMA engine splits each page into its parts on the way in, reading the same buffer through
  three free views (the uint8 pages, the pages as fp32 [N, 64, 164] and as bf16 [N, 64, 328]):
  the e4m3 latent as two 64 x 256-byte boxes, the scales as one 64 x 4 fp32 box (words 128..131
  of a token), the rope as one 64 x 64 bf16 box (elements 264..327). Registers dequantise
  (e4m3 -> f16 -> f32, times the block's scale broadcast along the row, -> bf16, rounded to
  nearest: the reference's arithmetic, so the result is bit-exact), write the bf16 page into
  an SMEM staging buffer, and one bulk store per page writes it out; a staging buffer is rewritten
  once the store of the page before has read it.
* fp4 pages (`FP4_PAGES`, uint8 [N, 64, 416]: 256 bytes of e2m1 pairs | 32 e4m3 scales | 64 bf16
  rope a token): the same pipeline with three boxes (the packed codes 64 x 256 bytes at byte 0, the
  scales 64 x 32 bytes at byte 256, the rope 64 x 64 bf16 at element 144 of the pages as bf16
  [N, 64, 208]). Registers split each byte into its two nibbles (value j low, j + 256 high, so no
  interleave), turn a code into its value with integer ops and one f16 multiply (sm_90 has no e2m1
  conversion), multiply by the block's e4m3 scale (-> f32, broadcast along the row) and round to bf16
  (exact: 2 x 4 significant bits).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic.gpu.fragmented_array import Tiling

from pallas_kernels import _fp8_tiles as _fp8
from pallas_kernels import backend
from pallas_kernels._page_table import check_page_table
from pallas_kernels.page_format import PageFormat, check_pages

PAGE_SIZE = 64
KEY_DIM = 576
ROPE_DIM = 64
LATENT_DIM = KEY_DIM - ROPE_DIM
KERNEL_FORMATS = ("bf16", "fp8", "fp4")  # the page formats the kernel has a body for (at 512 + 64 values)


def paged_gather_problems(page_format: PageFormat, page_size: int = PAGE_SIZE) -> list[str]:
    """Why the gather kernel cannot read pages of ``page_format`` and ``page_size`` tokens: [] when it can,
    else one line per broken limit (the reference reads every format at 512 + 64 values)."""
    problems = []
    if page_format.name not in KERNEL_FORMATS:
        problems.append(f"page format {page_format.name} (the gather kernel reads {', '.join(KERNEL_FORMATS)} pages)")
    if (page_format.latent_dim, page_format.rope_dim) != (KEY_DIM - ROPE_DIM, ROPE_DIM):
        problems.append(
            f"{page_format.latent_dim} latent + {page_format.rope_dim} rope values a token (the gather kernel "
            f"reads {KEY_DIM - ROPE_DIM} + {ROPE_DIM})"
        )
    if page_size != PAGE_SIZE:
        problems.append(f"page_size = {page_size} (the gather kernel reads {PAGE_SIZE}-token pages)")
    return problems


@dataclasses.dataclass(frozen=True)
class PagedGatherConfig:
    """Static tuning knobs of `paged_gather`.

    Attributes:
      chunks: CTAs per sequence (each copies a contiguous run of pages); None = enough for
        ``target_ctas`` CTAs in total.
      target_ctas: CTAs the heuristic aims for (2 per SM of a 132-SM H100/H200).
      max_concurrent_steps: pages in flight per CTA (bf16: 73.7 KB of SMEM each, at most 3 fit;
        fp8: 41 KB each; fp4: 26 KB each). None = 3, or 2 for fp8 / fp4 pages with two staging buffers.
      staging_buffers: fp8 / fp4 pages only: bf16 staging buffers (72 KB each) the dequantised pages are
        stored from. With 2, a page is dequantised into one while the previous page's store still
        reads the other; they and the 41 KB input stages must fit the 227 KB of SMEM, so 2 buffers
        take at most 2 steps in flight. None = 2 (the faster on an H200: docs/PERFORMANCE.md, "Paged gather").
    """

    chunks: int | None = None
    target_ctas: int = 264
    max_concurrent_steps: int | None = None
    staging_buffers: int | None = None

    def __post_init__(self):
        if self.chunks is not None and self.chunks < 1:
            raise ValueError(f"chunks must be None or >= 1, got {self.chunks}")
        if self.target_ctas < 1:
            raise ValueError(f"target_ctas must be >= 1, got {self.target_ctas}")
        if self.max_concurrent_steps is not None and not 2 <= self.max_concurrent_steps <= 3:
            raise ValueError(
                f"max_concurrent_steps must be None, 2 or 3 (73.7 KB of SMEM per page), got {self.max_concurrent_steps}"
            )
        if self.staging_buffers not in (None, 1, 2):
            raise ValueError(f"staging_buffers must be None, 1 or 2, got {self.staging_buffers}")
        if self.staging_buffers == 2 and (self.max_concurrent_steps or 2) > 2:
            raise ValueError(
                "staging_buffers=2 (2 x 72 KB of SMEM) leaves room for max_concurrent_steps <= 2 "
                f"fp8 stages of 41 KB, got {self.max_concurrent_steps}"
            )

    def for_format(self, page_format: PageFormat) -> "PagedGatherConfig":
        """This config with the defaults of ``page_format`` filled in (every field concrete)."""
        if not page_format.quantized:
            return dataclasses.replace(
                self, max_concurrent_steps=self.max_concurrent_steps or 3, staging_buffers=self.staging_buffers or 1
            )
        buffers = self.staging_buffers or (1 if self.max_concurrent_steps == 3 else 2)
        return dataclasses.replace(
            self, staging_buffers=buffers, max_concurrent_steps=self.max_concurrent_steps or (3 if buffers == 1 else 2)
        )


def _validate(kv_pages, block_table, num_tokens, page_format, checked=False) -> PageFormat:
    """Checks every argument; -> the pages' `PageFormat`."""
    fmt = check_pages(kv_pages, page_format, page_size=PAGE_SIZE)
    if (fmt.latent_dim, fmt.rope_dim) != (KEY_DIM - ROPE_DIM, ROPE_DIM):
        raise ValueError(
            f"paged_gather reads tokens of {KEY_DIM - ROPE_DIM} latent + {ROPE_DIM} rope values, "
            f"got {fmt.latent_dim} + {fmt.rope_dim} ({fmt.name} pages)"
        )
    if block_table.ndim != 2 or min(block_table.shape) < 1:
        raise ValueError(f"block_table must be [B >= 1, max_pages >= 1], got {block_table.shape}")
    if block_table.dtype != jnp.int32:
        raise ValueError(f"block_table must be int32, got {block_table.dtype}")
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
        raise ValueError(f"num_tokens must be a Python int (it fixes the output shape), got {num_tokens!r}")
    max_tokens = block_table.shape[1] * PAGE_SIZE
    if not 1 <= num_tokens <= max_tokens:
        raise ValueError(
            f"num_tokens must be in [1, {max_tokens}] (max_pages={block_table.shape[1]} x {PAGE_SIZE}), "
            f"got {num_tokens}"
        )
    check_page_table(
        block_table,
        num_tokens,
        num_pages=kv_pages.shape[0],
        page_size=PAGE_SIZE,
        lengths_name="num_tokens",
        checked=checked,
    )
    return fmt


def paged_gather_reference(
    kv_pages, block_table, *, num_tokens, page_format=None, config=None, impl=None, checked=False
):
    """Plain-jnp paged gather; same contract (and checks) as `paged_gather`."""
    del config, impl
    fmt = _validate(kv_pages, block_table, num_tokens, page_format, checked)
    B = block_table.shape[0]
    n_pages = pl.cdiv(num_tokens, PAGE_SIZE)
    pages_BPtK = fmt.dequantize_reference(kv_pages[block_table[:, :n_pages]])
    return pages_BPtK.reshape(B, n_pages * PAGE_SIZE, KEY_DIM)[:, :num_tokens]


def plan_chunks(batch: int, n_pages: int, config: PagedGatherConfig) -> tuple[int, int]:
    """(chunks per sequence, pages per chunk) for this shape; chunks never left empty."""
    chunks = config.chunks if config.chunks is not None else pl.cdiv(config.target_ctas, batch)
    chunks = max(1, min(chunks, n_pages))
    per_chunk = pl.cdiv(n_pages, chunks)
    return pl.cdiv(n_pages, per_chunk), per_chunk


def _store_page(page_smem, out_seq_ref, page, n_pages: int, tail: int):
    """Bulk-stores one gathered page (SMEM [64, 576]) as tokens [64·page, 64·page + 64) of a sequence's
    output. The last page is cut at num_tokens: a store of exactly `tail` rows, so nothing is written
    past the output (the untiled bulk store does not clip)."""
    if tail == PAGE_SIZE:
        plgpu.copy_smem_to_gmem(page_smem, out_seq_ref.at[pl.ds(page * PAGE_SIZE, PAGE_SIZE)])
        return

    @pl.when(page != n_pages - 1)
    def _():
        plgpu.copy_smem_to_gmem(page_smem, out_seq_ref.at[pl.ds(page * PAGE_SIZE, PAGE_SIZE)])

    @pl.when(page == n_pages - 1)
    def _():
        plgpu.copy_smem_to_gmem(page_smem.at[pl.ds(0, tail)], out_seq_ref.at[pl.ds(page * PAGE_SIZE, tail)])


@functools.partial(jax.jit, static_argnames=("num_tokens", "config", "interpret"))
def _paged_gather_kernel(kv_pages, block_table, *, num_tokens, config, interpret):
    B = block_table.shape[0]
    n_pages = pl.cdiv(num_tokens, PAGE_SIZE)
    chunks, per_chunk = plan_chunks(B, n_pages, config)
    tail = num_tokens - (n_pages - 1) * PAGE_SIZE  # tokens of the last page that are copied
    # TMA needs 16-byte GMEM strides: pad the table to a multiple of 4 int32 columns.
    pad = -block_table.shape[1] % 4
    if pad:
        block_table = jnp.pad(block_table, ((0, 0), (0, pad)))

    @functools.partial(
        plgpu.kernel,
        out_type=jax.ShapeDtypeStruct((B, num_tokens, KEY_DIM), kv_pages.dtype),
        grid=(chunks, B),
        grid_names=("c", "b"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    def kernel(kv_ref, bt_ref, out_ref):
        c, b = lax.axis_index("c"), lax.axis_index("b")
        base = c * per_chunk
        count = jnp.clip(n_pages - base, 0, per_chunk)
        table = bt_ref.at[b]

        def body(idx, page_smem):
            (i,) = idx
            page = base + i
            _store_page(page_smem, out_ref.at[b], page, n_pages, tail)
            # With delay_release=1 the pipeline refills the slot of the previous step after this
            # body: that store must have finished reading SMEM, this one may stay in flight.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)

        plgpu.emit_pipeline(
            body,
            grid=(count,),
            max_concurrent_steps=config.max_concurrent_steps,
            in_specs=[
                plgpu.BlockSpec(
                    (None, PAGE_SIZE, KEY_DIM),
                    lambda i: (table[base + i], 0, 0),
                    delay_release=1,
                    # Untiled whole-page loads take the contiguous bulk-copy path.
                    oob_fill_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
                )
            ],
        )(kv_ref)
        plgpu.wait_smem_to_gmem(0)

    return kernel(kv_pages, block_table)


def _dequant_gather(views, boxes, dequantize_page, block_table, *, num_tokens, config, interpret):
    """The body shared by the quantized formats: per page, the TMA engine cuts the page's parts out of
    ``views`` (free bitcast views of the uint8 pages [N, 64, W]) as the SMEM boxes ``boxes`` (one
    (view index, block shape, block index of the page's part) each), ``dequantize_page(out_smem,
    *part_smems)`` writes the bf16 page [64, 576] into a staging buffer, and one bulk store writes it
    out. Grid (chunks, B) as the bf16 copy's."""
    B = block_table.shape[0]
    n_pages = pl.cdiv(num_tokens, PAGE_SIZE)
    chunks, per_chunk = plan_chunks(B, n_pages, config)
    tail = num_tokens - (n_pages - 1) * PAGE_SIZE
    pad = -block_table.shape[1] % 4
    if pad:
        block_table = jnp.pad(block_table, ((0, 0), (0, pad)))

    @functools.partial(
        plgpu.kernel,
        out_type=jax.ShapeDtypeStruct((B, num_tokens, KEY_DIM), jnp.bfloat16),
        grid=(chunks, B),
        grid_names=("c", "b"),
        scratch_types=dict(staging=plgpu.SMEM((config.staging_buffers, PAGE_SIZE, KEY_DIM), jnp.bfloat16)),
        # Lane semantics: the strided SMEM views the bodies read (a column block of a row, a scale
        # column) have no swizzled layout for the warpgroup layout inference to pick.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    def kernel(*refs, staging):
        *view_refs, bt_ref, out_ref = refs
        c, b = lax.axis_index("c"), lax.axis_index("b")
        base = c * per_chunk
        count = jnp.clip(n_pages - base, 0, per_chunk)
        table = bt_ref.at[b]

        def body(idx, *parts):
            (i,) = idx
            page = base + i
            # This page's staging buffer fed the store of page i - staging_buffers; stores complete in
            # order, so with at most staging_buffers - 1 of them still reading SMEM that one is done
            # (the wait ends with a warpgroup barrier, so no thread writes before).
            nbuf = config.staging_buffers
            out_smem = staging.at[lax.rem(i, nbuf) if nbuf > 1 else 0]
            plgpu.wait_smem_to_gmem(nbuf - 1, wait_read_only=True)
            dequantize_page(out_smem, *parts)
            plgpu.commit_smem()
            _store_page(out_smem, out_ref.at[b], page, n_pages, tail)

        in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS
        spec = lambda shape, index: plgpu.BlockSpec(  # noqa: E731
            (None, PAGE_SIZE, shape), lambda i: (table[base + i], 0, index), oob_fill_mode=in_bounds
        )
        plgpu.emit_pipeline(
            body,
            grid=(count,),
            max_concurrent_steps=config.max_concurrent_steps,
            in_specs=[spec(shape, index) for _, shape, index in boxes],
        )(*(view_refs[v] for v, _, _ in boxes))
        plgpu.wait_smem_to_gmem(0)

    return kernel(*views, block_table)


def _byte_views(kv_pages, *dtypes):
    """The uint8 pages [N, 64, W] as [N, 64, W / itemsize] arrays of each dtype: bitcasts, no copy."""
    N, _, width = kv_pages.shape
    views = [kv_pages]
    for dt in dtypes:
        k = jnp.dtype(dt).itemsize
        views.append(lax.bitcast_convert_type(kv_pages.reshape(N, PAGE_SIZE, width // k, k), dt))
    return views


def _store_rope(out_smem, rope):
    """The 64 bf16 rope values of every token, as they are, into columns 512.. of the staged page."""
    out_smem[:, pl.ds(_fp8.LATENT, KEY_DIM - _fp8.LATENT)] = plgpu.load(rope, layout=_fp8.ROPE_LAYOUT)


@functools.partial(jax.jit, static_argnames=("num_tokens", "config", "interpret"))
def _paged_gather_fp8_kernel(kv_pages, block_table, *, num_tokens, config, interpret):
    # The same bytes as fp32 words and as bf16 halves (656 = 4 * 164 = 2 * 328).
    views = _byte_views(kv_pages, jnp.float32, jnp.bfloat16)
    row_layout = _fp8.BLOCK_LAYOUT.reduce(1)
    half = _fp8.LATENT // 2

    def dequantize_page(out_smem, lat_lo, lat_hi, scales, rope):
        for k in range(_fp8.LATENT // _fp8.BLOCK):
            src = (lat_lo if k * _fp8.BLOCK < half else lat_hi).at[:, pl.ds(k * _fp8.BLOCK % half, _fp8.BLOCK)]
            q = plgpu.load(src, layout=_fp8.BLOCK_LAYOUT)  # uint8 [64, 128]
            x = lax.bitcast_convert_type(q, jnp.float8_e4m3fn).astype(jnp.float32)
            s = plgpu.load(scales.at[:, k], layout=row_layout, optimized=False)  # f32 [64]
            # (the broadcast's layout is named: it has more than one)
            s_rows = plgpu.layout_cast(lax.broadcast_in_dim(s, x.shape, [0]), _fp8.BLOCK_LAYOUT)
            out_smem[:, pl.ds(k * _fp8.BLOCK, _fp8.BLOCK)] = (x * s_rows).astype(jnp.bfloat16)
        _store_rope(out_smem, rope)

    n_scales = _fp8.LATENT // _fp8.BLOCK
    boxes = [
        (0, half, 0),
        (0, half, 1),  # the e4m3 latent, two 256-byte boxes
        (1, n_scales, _fp8.SCALE_WORD // n_scales),  # 4 fp32 scales (words 128..131)
        (2, pl.Element(KEY_DIM - _fp8.LATENT), _fp8.ROPE_HALF),
    ]  # 64 bf16 rope (halves 264..327)
    return _dequant_gather(
        views, boxes, dequantize_page, block_table, num_tokens=num_tokens, config=config, interpret=interpret
    )


# fp4 page geometry (FP4_PAGES: L=512, R=64): a token's 416 bytes are 256 packed e2m1 bytes (byte j:
# value j low nibble, value j + 256 high nibble), 32 e4m3 scales (byte 256: one per 16 values), 64
# bf16 rope values (byte 288 = bf16 element 144 of a 208-element row).
_FP4_PACKED = 256
_FP4_BLOCK = 16
_FP4_SCALES = LATENT_DIM // _FP4_BLOCK
_FP4_ROPE_HALF = (_FP4_PACKED + _FP4_SCALES) // 2
# A (64, 16) tile of bytes (16 values of one scale block, every token): a warp covers 16 rows x 2
# lanes of 8 consecutive bytes. (Its 16 rows sit 256 bytes apart in SMEM, so the load conflicts
# 16 ways on the banks: simple and correct; a wider tile needs the scales broadcast along 16
# columns of a row, which the Lane-semantics broadcast does not express.)
_NIBBLE_LAYOUT = plgpu.Layout.TILED(
    Tiling(((64, _FP4_BLOCK), (16, _FP4_BLOCK), (8,))), warp_dims=(-5,), lane_dims=(-3, -2), vector_dim=-1
)


def _e2m1_to_f32(n):
    """uint16 e2m1 codes (0..15) -> float32, with integer ops and one f16 multiply (sm_90 has no e2m1
    conversion): sign to f16 bit 15, the 3 exponent/mantissa bits to bits 11..9; times 2^14 that f16 is
    exactly the e2m1 value (normals and the 0.5 subnormal)."""
    bits = ((n & 8) << 12) | ((n & 7) << 9)
    return (lax.bitcast_convert_type(bits, jnp.float16) * jnp.float16(2.0**14)).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("num_tokens", "config", "interpret"))
def _paged_gather_fp4_kernel(kv_pages, block_table, *, num_tokens, config, interpret):
    views = _byte_views(kv_pages, jnp.bfloat16)  # 416 = 2 * 208
    row_layout = _NIBBLE_LAYOUT.reduce(1)

    def dequantize_page(out_smem, packed, scales, rope):
        for g in range(_FP4_PACKED // _FP4_BLOCK):
            q = plgpu.load(
                packed.at[:, pl.ds(g * _FP4_BLOCK, _FP4_BLOCK)], layout=_NIBBLE_LAYOUT, optimized=False
            )  # uint8 [64, 16]
            # low nibbles: values 16g.. (block g); high nibbles: values 256 + 16g.. (block 16 + g). Mosaic GPU
            # shifts no 8-bit type: the nibbles are split in 16 bits.
            n = q.astype(jnp.uint16)
            for codes, k in ((n & 0xF, g), (n >> 4, g + _FP4_SCALES // 2)):
                s = plgpu.load(scales.at[:, k], layout=row_layout, optimized=False)  # e4m3 bytes [64]
                s = lax.bitcast_convert_type(s, jnp.float8_e4m3fn).astype(jnp.float32)
                s_rows = plgpu.layout_cast(lax.broadcast_in_dim(s, q.shape, [0]), _NIBBLE_LAYOUT)
                out_smem[:, pl.ds(k * _FP4_BLOCK, _FP4_BLOCK)] = (_e2m1_to_f32(codes) * s_rows).astype(jnp.bfloat16)
        _store_rope(out_smem, rope)

    boxes = [
        (0, _FP4_PACKED, 0),  # packed codes, bytes 0..255
        (0, pl.Element(_FP4_SCALES), _FP4_PACKED),  # 32 e4m3 scales, bytes 256..287
        (1, pl.Element(KEY_DIM - LATENT_DIM), _FP4_ROPE_HALF),
    ]  # 64 bf16 rope (halves 144..207)
    return _dequant_gather(
        views, boxes, dequantize_page, block_table, num_tokens=num_tokens, config=config, interpret=interpret
    )


def paged_gather(kv_pages, block_table, *, num_tokens, page_format=None, config=None, impl="auto", checked=False):
    """Gathers the first ``num_tokens`` cached tokens of every sequence into a dense buffer.

    Args:
      kv_pages: [num_pages, 64, W] cache pages in ``page_format`` (bf16: [num_pages, 64, 576]).
      block_table: int32 [B, max_pages]: page ids of each sequence in token order; the first
        cdiv(num_tokens, 64) entries of every row must be page ids in [0, num_pages), the rest are
        never read.
      num_tokens: Python int in [1, 64 * max_pages]: tokens gathered per sequence. Tokens past a
        sequence's length are copied as they are in the page (the caller masks them).
      page_format: the pages' `PageFormat`, checked against their dtype and width; None reads it from them
        (`page_format_of`: bf16 [.., 576], fp8 uint8 [.., 656], fp4 uint8 [.., 416]). Quantized pages are
        dequantised to bf16 as `PageFormat.dequantize_reference` does, bit for bit. The kernel reads
        `KERNEL_FORMATS` (`paged_gather_problems`).
      config: `PagedGatherConfig` (static); None = defaults.
      impl: one of `pallas_kernels.backend.IMPLS`: "auto" (the kernel on a Hopper GPU where it serves the
        format, else the reference), "kernel", "interpret" or "reference".
      checked: also check a traced block table, with `jax.experimental.checkify` (the caller wraps
        the jitted function in `checkify.checkify`); a concrete one is always checked.

    Returns:
      bf16 [B, num_tokens, 576]: row t of sequence b is token t of that sequence.

    Raises:
      ValueError naming the argument and the limit, for a bad shape or dtype, num_tokens outside
      [1, 64 * max_pages], or a concrete block-table entry it reads outside [0, num_pages).
    """
    fmt = _validate(kv_pages, block_table, num_tokens, page_format, checked)
    if config is None:
        config = PagedGatherConfig()
    if not isinstance(config, PagedGatherConfig):
        raise ValueError(f"config must be a PagedGatherConfig or None, got {type(config).__name__}")
    impl = backend.choose(impl, paged_gather_problems(fmt))
    if impl == "reference":
        return paged_gather_reference(kv_pages, block_table, num_tokens=num_tokens, page_format=fmt, checked=checked)
    kernel = {"fp8": _paged_gather_fp8_kernel, "fp4": _paged_gather_fp4_kernel}.get(fmt.name, _paged_gather_kernel)
    return kernel(
        kv_pages,
        block_table,
        num_tokens=num_tokens,
        config=config.for_format(fmt),
        interpret=impl == "interpret",
    )
