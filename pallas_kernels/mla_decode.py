"""Absorbed Multi-head Latent Attention decode over a paged latent KV cache (Mosaic GPU, sm_90).

Dimension letters: B batch, T query tokens per sequence (s_q), H heads, R = T*H query rows,
P pages, S cached tokens, L latent width 512, K key width 576 = 512 latent + 64 rope.

The absorbed form (DeepSeek-V2 §2.1.2): with q_lat = q_nope·W_UK folded into the query, every head
attends over the same 576-wide cached latents, and V is the first 512 columns of the same rows.
So one KV page tile in shared memory serves Q·Kᵀ (576 wide) and P·V (512 wide), and the kernel is a
flash-decoding loop over pages:

* Query rows: the (T, H) pairs of a sequence are packed row-major into R = T·H rows (row = t·H + h)
  and padded to a multiple of 64, the wgmma M tile. A CTA owns one 64-row block, so H=16, T=1 pads
  16 rows to 64, and H=128 uses two CTAs (row blocks) per sequence and KV split.
* Split-KV: each sequence's pages are cut into ``num_splits`` contiguous ranges so that
  B·row_blocks·num_splits fills about one wave of the GPU's SMs. With one split, the kernel
  writes the final bf16 output and natural-log LSE itself. With more, it writes fp32 partials and a
  second, small Mosaic GPU kernel combines them (still a single jitted call; no XLA math).
* Token-balanced schedule (`MlaDecodeConfig.schedule="balanced"`, FlashMLA's tile scheduler):
  instead of cutting each sequence on its own, the batch's pages (Σ cdiv(seq_len, 64)) are laid
  end to end and cut into equal contiguous runs, one per CTA (and row block). A run may cross
  sequence boundaries: the CTA reloads Q when the sequence changes and writes one fp32 partial per
  sequence piece, into piece slot ``cta + b`` (unique: slots grow along the runs). The combine
  reduces each sequence's pieces (``piece_start[b]``, ``num_pieces[b]``). `balanced_schedule`
  computes the (B-sized) metadata on the device from ``seq_lens``; a page's sequence is a binary
  search of the page prefix sums (`sequence_of_page`).
* Warp specialisation: warpgroup 2 streams pages through the block table with TMA
  (two 73.7 KB stages; with Q resident that is 221 KB of the 227 KB of SMEM); warpgroups 0 and 1
  each own 256 of the 512 output columns (a 64x512 fp32 accumulator in one warpgroup spills).
  Per page, S = Q·Kᵀ, an online softmax in fp32 in the exp2 domain, then O += P·V with P (bf16)
  from registers. Two bodies: the plain one has both warpgroups compute all of S (redundant
  tensor work, no synchronisation); the split-QK one has each compute S for 32 of the 64 tokens
  and exchange row maxima, P halves and row sums through SMEM (two CTA barriers per page).
  `MlaDecodeConfig.split_qk` picks; by default split-QK when all 64 rows of a CTA are real.
* The scorer body (`_decode_partials_scorer`, the default on bf16 pages with the per_sequence
  schedule): four warpgroups with loops of their own. The TMA one streams the pages; warpgroup 0
  computes each page's S = Q·Kᵀ once and the softmax, writes P to SMEM and accumulates P·V over
  128 columns; warpgroups 1 and 2 accumulate P·V over 192 columns each, reading P from SMEM, so
  their P·V of page i runs under the scorer's Q·Kᵀ of page i + 1.
* Ragged lengths: keys at positions >= the row's limit get -inf scores; the V rows of a partial
  last page are zeroed in SMEM first, because P=0 times a garbage (even NaN) V row is still NaN.
* fp8 pages (`pallas_kernels.page_format.FP8_PAGES`): for R = s_q·H <= 32 query rows a transposed
  body (`_decode_partials_fp8_t`: Sᵀ = K·Qᵀ with the page's 64 tokens as the wgmma M and the R rows
  as N, the scales folded into the scores and P), else the padded body above over a bf16 key
  buffer the two warpgroups dequantise into (`_decode_partials_fp8`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _platform
from pallas_kernels._page_table import check_page_table
from pallas_kernels.page_format import BF16_PAGES, FP8_PAGES

PAGE_SIZE = 64  # tokens per KV page (the TMA box and the wgmma N of Q·Kᵀ)
KEY_DIM = 576  # latent 512 ; rope 64
LATENT_DIM = 512  # V width (first 512 columns of each cached row)
ROWS = 64  # query rows per CTA = wgmma M of one warpgroup
SUPPORTED_HEADS = (16, 32, 64, 128)
MAX_QUERY_LEN = 4
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Running max starts finite so that a row whose keys are all masked in a page gives
# exp2(-inf - m) = 0 rather than exp2(-inf + inf) = NaN.
_M_INIT = -1e30
# bf16 tiles as wgmma wants them: 8x64 tiles, 128-byte swizzle. Also splits the 576-wide rows
# into <=256-element TMA boxes.
_BF16_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
SCHEDULES = ("per_sequence", "balanced")


@dataclasses.dataclass(frozen=True)
class MlaDecodeConfig:
    """Static tuning knobs of `mla_decode`.

    Attributes:
      num_splits: KV splits per sequence; None picks ``target_ctas // (B * row_blocks)`` capped so
        every split gets at least ``min_pages_per_split`` pages and at most ``max_splits`` splits.
      target_ctas: CTAs the split heuristic aims for (132 = one wave on an H100/H200 SXM).
      min_pages_per_split: lower bound of pages per split for the heuristic (each CTA pays a
        73.7 KB Q load and a partial write, so tiny splits cost more than they hide).
      max_splits: upper bound of the heuristic (the combine reads every split's partial; on an
        H200, B=1, seq 32768, H=64 took 48.7 µs with 64 splits and 65.8 µs with 128).
      max_concurrent_steps: KV pages in flight per CTA. Each stage is 73.7 KB of SMEM; with Q resident
        only 2 fit.
      memory_registers: registers per thread left to the TMA warpgroup (setmaxnreg) of the plain and
        split-QK bodies (the scorer body's keeps `SCORER_MEMORY_REGISTERS`).
      combine_block_cols: output columns per CTA of the split combine kernel (divides 512).
      split_qk: with ``scorer=False``, each compute warpgroup computes Q·Kᵀ for its own 32 of the
        page's 64 tokens (instead of both computing all 64); the two exchange row maxima, P halves (bf16) and row
        sums through SMEM with two CTA barriers per page. Halves the Q·Kᵀ tensor work. None = on
        when the 64 query rows of a CTA are all real (s_q * H >= 64): on an H200 it was 2-16 %
        faster there, and 2-5 % slower for H=16/32 at s_q=1, where rows are padding and the
        kernel is purely bandwidth-bound.
      interpretable: use constructs the Pallas interpreter can run (P staged through SMEM, P·V
        accumulated with ``run_scoped`` instead of ``run_state``); slower, for interpret mode only.
      schedule: how pages are dealt to CTAs. "per_sequence": each CTA takes one split of one
        sequence (``num_splits`` per sequence, the same for all). "balanced": the batch's pages are
        cut into ``target_ctas // row_blocks`` equal runs (at least ``min_pages_per_split`` pages
        each) that may span sequences, so the longest sequence no longer sets the time for ragged
        lengths; always followed by the combine. ``num_splits`` and ``max_splits`` do not
        apply.
      fp8_transposed: for fp8 pages, the transposed body (`_decode_partials_fp8_t`: scores as
        Sᵀ = K·Qᵀ with the R = s_q * H query rows as the wgmma N, so no tensor work on padding
        rows, and no barrier around a shared key buffer) instead of the padded 64-row body. It
        serves R <= 32 (H=16 and 32 at s_q=1, H=16 at s_q=2) on the per_sequence schedule. None =
        on wherever it serves.
      scorer: for bf16 pages on the per_sequence schedule, the scorer body
        (`_decode_partials_scorer`): one warpgroup computes each page's Q·Kᵀ once, the softmax and
        P·V over 128 columns, two others P·V over 192 columns each, beside the TMA warpgroup.
        None = on there (an H200 measured it 1.1-1.3x faster than the plain and split-QK bodies in
        every cell: docs/BENCHMARKS.md); the balanced schedule runs those two (True with it raises).
        False picks between them by ``split_qk``. fp8 pages have bodies of their own.
    """

    num_splits: int | None = None
    target_ctas: int = 132
    min_pages_per_split: int = 4
    max_splits: int = 64
    max_concurrent_steps: int = 2
    memory_registers: int = 40
    combine_block_cols: int = 128
    split_qk: bool | None = None
    interpretable: bool = False
    schedule: str = "per_sequence"
    fp8_transposed: bool | None = None
    scorer: bool | None = None

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.num_splits is not None and not 1 <= self.num_splits <= 1024:
            raise ValueError(f"num_splits must be None or in [1, 1024], got {self.num_splits}")
        if self.target_ctas < 1:
            raise ValueError(f"target_ctas must be >= 1, got {self.target_ctas}")
        if self.max_splits < 1:
            raise ValueError(f"max_splits must be >= 1, got {self.max_splits}")
        if self.min_pages_per_split < 1:
            raise ValueError(f"min_pages_per_split must be >= 1, got {self.min_pages_per_split}")
        if self.max_concurrent_steps not in (1, 2):
            raise ValueError(
                f"max_concurrent_steps must be 1 or 2 (73.7 KB of SMEM each), got {self.max_concurrent_steps}"
            )
        if not 24 <= self.memory_registers <= 256 or self.memory_registers % 8:
            raise ValueError(f"memory_registers must be a multiple of 8 in [24, 256], got {self.memory_registers}")
        if self.scorer and self.schedule != "per_sequence":
            raise ValueError(
                "scorer=True needs the per_sequence schedule (the scorer body on the balanced "
                f"one measured slower and was removed), got schedule {self.schedule!r}"
            )
        if self.combine_block_cols not in (64, 128, 256):
            raise ValueError(f"combine_block_cols must be one of 64, 128, 256, got {self.combine_block_cols}")


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------


def _key_limits(seq_lens, s_q: int, causal: bool):
    """Exclusive key bound per (sequence, query token): int32 [B, T]."""
    j = jnp.arange(s_q, dtype=jnp.int32)[None, :]
    lens = seq_lens.astype(jnp.int32)[:, None]
    if causal:
        return lens - s_q + 1 + j  # query j sits at position seq_len - s_q + j
    return jnp.broadcast_to(lens, (lens.shape[0], s_q))


def mla_decode_reference(
    q, kv_pages, block_table, seq_lens, *, softmax_scale, causal=False, config=None, impl=None, checked=False
):
    """Plain-jnp absorbed MLA decode with fp32 math; same contract (and checks) as `mla_decode`.

    ``config`` and ``impl`` are accepted (and ignored) so the two functions are interchangeable.
    A query with no visible key (only possible when causal and seq_len < s_q) gets out = 0 and
    lse = -inf, as in the kernel.
    """
    del config, impl
    _validate(q, kv_pages, block_table, seq_lens, softmax_scale, checked=checked)
    B, s_q, H, _ = q.shape
    pages = kv_pages[block_table]
    if is_fp8_pages(kv_pages):  # dequantise (to bf16, what the kernel's tensor cores see), then as bf16
        pages = FP8_PAGES.dequantize_reference(pages)
    kv_BSK = pages.reshape(B, -1, KEY_DIM).astype(jnp.float32)  # (B, S, K)
    keys = jnp.arange(kv_BSK.shape[1], dtype=jnp.int32)
    valid_BS = keys[None, :] < seq_lens.astype(jnp.int32)[:, None]
    # Zero rows past the sequence: unused slots may hold anything (NaN), and 0 * NaN = NaN.
    kv_BSK = jnp.where(valid_BS[..., None], kv_BSK, 0.0)
    scores_BTHS = (
        jnp.einsum("bthk,bsk->bths", q.astype(jnp.float32), kv_BSK, precision=lax.Precision.HIGHEST) * softmax_scale
    )
    visible_BTS = keys[None, None, :] < _key_limits(seq_lens, s_q, causal)[..., None]
    scores_BTHS = jnp.where(visible_BTS[:, :, None, :], scores_BTHS, -jnp.inf)
    m_BTH = scores_BTHS.max(axis=-1)
    m_BTH = jnp.where(jnp.isfinite(m_BTH), m_BTH, 0.0)
    p_BTHS = jnp.exp(scores_BTHS - m_BTH[..., None])
    l_BTH = p_BTHS.sum(axis=-1)
    out_BTHL = jnp.einsum("bths,bsl->bthl", p_BTHS, kv_BSK[..., :LATENT_DIM], precision=lax.Precision.HIGHEST)
    out_BTHL = out_BTHL / jnp.where(l_BTH == 0, 1.0, l_BTH)[..., None]
    lse_BTH = jnp.where(l_BTH == 0, -jnp.inf, m_BTH + jnp.log(l_BTH))
    return out_BTHL.astype(q.dtype), lse_BTH


# ------------------------------------------------------------------------------------------------
# Validation and planning
# ------------------------------------------------------------------------------------------------


def is_fp8_pages(kv_pages) -> bool:
    """Whether ``kv_pages`` are fp8 pages (uint8, last dim 656: `pallas_kernels.page_format`)."""
    return kv_pages.dtype == jnp.uint8 and kv_pages.shape[-1] == FP8_PAGES.width


def mla_decode_problems(heads, latent_dim, page_size, dtype) -> list[str]:
    """Why `mla_decode` cannot serve a model shape: [] when it can, else one line per broken limit.

    Args:
      heads: query heads of one call (H of q; per device under tensor parallelism).
      latent_dim: values cached per token, kv_lora_rank + qk_rope_head_dim.
      page_size: tokens a cache page.
      dtype: the pages' dtype: a jnp / numpy dtype, or a cache format name ("bf16", "fp32", "fp8",
        ...); uint8 and "fp8" name fp8 pages (`pallas_kernels.page_format.FP8_PAGES`).

    The limits are this module's `SUPPORTED_HEADS`, `KEY_DIM` and `PAGE_SIZE`, and bf16 pages, or
    fp8 pages once this module's fp8 body exists (`FP8_KERNEL = True`); the query length (at most
    `MAX_QUERY_LEN`) is a property of a step, not of the model, and is checked per call.
    """
    problems = []
    if heads not in SUPPORTED_HEADS:
        problems.append(f"heads = {heads!r} (the decode kernel supports H in {SUPPORTED_HEADS})")
    if latent_dim != KEY_DIM:
        problems.append(
            f"latent_dim = {latent_dim!r} (the decode kernel needs {KEY_DIM} = {LATENT_DIM} "
            f"latent + {KEY_DIM - LATENT_DIM} rope)"
        )
    if page_size != PAGE_SIZE:
        problems.append(f"page_size = {page_size!r} (the decode kernel needs {PAGE_SIZE})")
    name = (
        {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "uint8"}.get(dtype, dtype)
        if isinstance(dtype, str)
        else dtype
    )
    try:
        shown = jnp.dtype(name).name
    except TypeError:
        shown = repr(dtype)
    if shown == "uint8":  # fp8 pages
        if not globals().get("FP8_KERNEL", False):
            problems.append(
                "dtype = fp8 (the decode kernel has no fp8 body yet, FP8_KERNEL is unset; it reads bfloat16 pages)"
            )
    elif shown != "bfloat16":
        problems.append(f"dtype = {shown} (the decode kernel reads bfloat16 pages)")
    return problems


def _validate(q, kv_pages, block_table, seq_lens, softmax_scale, *, checked=False):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, s_q, H, {KEY_DIM}], got shape {q.shape}")
    B, s_q, H, D = q.shape
    if D != KEY_DIM:
        raise ValueError(f"q's last dim must be {KEY_DIM} (512 latent + 64 rope), got {D}")
    if q.dtype != jnp.bfloat16:
        raise ValueError(f"q must be bfloat16, got {q.dtype}")
    if H not in SUPPORTED_HEADS:
        raise ValueError(f"number of heads H must be one of {SUPPORTED_HEADS}, got {H}")
    if not 1 <= s_q <= MAX_QUERY_LEN:
        raise ValueError(f"s_q (query tokens per sequence) must be in [1, {MAX_QUERY_LEN}], got {s_q}")
    if B < 1:
        raise ValueError(f"batch must be >= 1, got {B}")
    if kv_pages.ndim != 3 or kv_pages.shape[1:] not in ((PAGE_SIZE, KEY_DIM), (PAGE_SIZE, FP8_PAGES.width)):
        raise ValueError(
            f"kv_pages must be bf16 [num_pages, {PAGE_SIZE}, {KEY_DIM}] or fp8 uint8 [num_pages, {PAGE_SIZE}, "
            f"{FP8_PAGES.width}] (page size {PAGE_SIZE}), got {kv_pages.shape}"
        )
    fmt = BF16_PAGES if kv_pages.shape[2] == KEY_DIM else FP8_PAGES
    fmt.validate(kv_pages, PAGE_SIZE)
    if block_table.ndim != 2 or block_table.shape[0] != B or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be [B={B}, max_pages >= 1], got {block_table.shape}")
    if block_table.dtype != jnp.int32:
        raise ValueError(f"block_table must be int32, got {block_table.dtype}")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be [B={B}], got {seq_lens.shape}")
    if seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be int32, got {seq_lens.dtype}")
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise ValueError(f"softmax_scale must be a Python float (it is baked into the kernel), got {softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    check_page_table(block_table, seq_lens, num_pages=kv_pages.shape[0], page_size=PAGE_SIZE, checked=checked)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static launch geometry derived from the shapes and the config."""

    row_blocks: int  # G: 64-row query blocks per sequence
    num_splits: int  # KV splits per sequence (after dropping splits that are always empty)
    pages_per_split: int
    split_qk: bool  # the Q·Kᵀ-split body (see MlaDecodeConfig.split_qk)
    schedule: str = "per_sequence"
    num_ctas: int = 0  # balanced: CTAs (page runs) per row block; 0 for per_sequence
    scorer: bool = False  # the scorer body (see MlaDecodeConfig.scorer; bf16 pages only)

    @property
    def balanced(self) -> bool:
        return self.schedule == "balanced"


def plan(batch: int, s_q: int, heads: int, max_pages: int, config: MlaDecodeConfig) -> _Plan:
    """The launch geometry `mla_decode` uses for these shapes (exposed for the benchmark)."""
    row_blocks = pl.cdiv(s_q * heads, ROWS)
    if config.num_splits is not None:
        splits = config.num_splits
    else:
        splits = max(1, config.target_ctas // (batch * row_blocks))
        splits = min(splits, max(1, max_pages // config.min_pages_per_split), config.max_splits)
    splits = max(1, min(splits, max_pages))
    pages_per_split = pl.cdiv(max_pages, splits)
    split_qk = config.split_qk if config.split_qk is not None else s_q * heads >= ROWS
    scorer = config.scorer is None or config.scorer
    scorer = scorer and config.schedule == "per_sequence"
    split_qk = split_qk and not scorer
    if config.schedule == "balanced":
        return _Plan(
            row_blocks, 1, pages_per_split, split_qk, "balanced", max(1, config.target_ctas // row_blocks), scorer
        )
    return _Plan(row_blocks, pl.cdiv(max_pages, pages_per_split), pages_per_split, split_qk, scorer=scorer)


class BalancedSchedule(NamedTuple):
    """Token-balanced work split (`balanced_schedule`); every field int32.

    The batch's pages in order (sequence 0's, then 1's, ...) are "global pages" g in [0, total);
    CTA c takes the run [min(c * ppc, total), min((c + 1) * ppc, total)). Global page g belongs to
    sequence `sequence_of_page(g, ends, 0, B - 1)`, as its page g - (ends[b] - cdiv(seq_lens[b], 64)).
    """

    scalars: jax.Array  # [2]: (ppc = pages per CTA, total pages)
    ends: jax.Array  # [B]: pages of sequences 0..b (inclusive prefix sum of cdiv(len, 64))
    cta_seqs: jax.Array  # [C, 2]: sequences of run c's first and last page (clipped to
    # [0, B-1]; a run without pages gets the last sequence twice)
    piece_start: jax.Array  # [B]: piece slot of sequence b's first piece (= its first CTA + b)
    num_pieces: jax.Array  # [B]: pieces (CTAs) sequence b's pages fall into; 0 for an empty one


def num_piece_slots(batch: int, num_ctas: int) -> int:
    """Piece slots of the partials buffer: slot = cta + b grows strictly along the runs, and both
    are below their counts."""
    return num_ctas + batch - 1


def balanced_schedule(seq_lens, *, num_ctas: int, min_pages_per_cta: int = 1) -> BalancedSchedule:
    """FlashMLA-style scheduler metadata, on the device (jit-friendly: static shapes, B-sized).

    Args:
      seq_lens: int32 [B] (0 allowed: an idle row gets no pages).
      num_ctas: CTAs to share the pages (static).
      min_pages_per_cta: a run is at least this long (each CTA pays a Q load and a partial write).

    Returns:
      `BalancedSchedule`. Pieces: CTA c's run meets sequence b in at most one contiguous piece,
      written to slot c + b; sequence b's pieces are slots [piece_start[b], piece_start[b] +
      num_pieces[b]), in key order.
    """
    B = seq_lens.shape[0]
    pages = (seq_lens.astype(jnp.int32) + PAGE_SIZE - 1) // PAGE_SIZE  # [B]
    ends = jnp.cumsum(pages).astype(jnp.int32)
    total = ends[-1]
    ppc = jnp.maximum((total + num_ctas - 1) // num_ctas, min_pages_per_cta)
    first_cta = (ends - pages) // ppc
    num_pieces = jnp.where(pages > 0, (ends - 1) // ppc - first_cta + 1, 0)
    piece_start = first_cta + jnp.arange(B, dtype=jnp.int32)
    # Per CTA, the sequences of its run's first and last page: the first b with ends[b] > g.
    run_start = jnp.minimum(jnp.arange(num_ctas, dtype=jnp.int32) * ppc, total)
    run_last = jnp.maximum(jnp.minimum(run_start + ppc, total) - 1, run_start)
    seq_of = lambda g: jnp.minimum((ends[None, :] <= g[:, None]).sum(1, dtype=jnp.int32), B - 1)
    cta_seqs = jnp.stack([seq_of(run_start), seq_of(run_last)], 1)
    return BalancedSchedule(
        jnp.stack([ppc, total]).astype(jnp.int32),
        ends,
        cta_seqs,
        piece_start.astype(jnp.int32),
        num_pieces.astype(jnp.int32),
    )


def sequence_of_page(g, ends, lo, hi):
    """The sequence holding global page g < total, known to be in [lo, hi]: the first b with
    ends[b] > g, by binary search (a while loop: no step when lo == hi). ``ends`` is read as
    ``ends[k]``: a kernel ref or an array."""

    def step(bounds):
        lo, hi = bounds
        mid = lax.shift_right_logical(lo + hi, 1)
        left = ends[mid] > g
        return jnp.where(left, lo, mid + 1), jnp.where(left, mid, hi)

    lo, _ = lax.while_loop(
        lambda bounds: bounds[0] < bounds[1], step, (jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32))
    )
    return lo


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


def _row_limits(seq_len, g, *, heads: int, s_q: int, causal: bool, shape=(ROWS, PAGE_SIZE)):
    """int32 ``shape`` (rows, keys) in the WGMMA layout: exclusive key bound of each query row of
    block g, broadcast along the keys."""
    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    if not causal:
        return jnp.full_like(row, 0) + seq_len
    # Row r of block g is query token j = (g*64 + r) // H; H is a power of two. Padding rows
    # (j >= s_q) get the full length, so they never go empty.
    j = lax.shift_right_logical(row + g * ROWS, int(math.log2(heads)))
    return jnp.minimum(seq_len - s_q + 1 + j, seq_len)


def _online_softmax(sc, acc, m, l, page_start, limit):
    """One page of the online softmax (exp2 domain), for a body whose warpgroup scored all 64 keys:
    scores sc [64 rows, 64 keys] (already times scale·log2 e) masked to keys < `limit` (per row, from
    `_row_limits`), then (P in bf16, acc rescaled, new running max, new running sum)."""
    key = page_start + plgpu.broadcasted_iota(jnp.int32, (ROWS, PAGE_SIZE), 1, layout=plgpu.Layout.WGMMA)
    sc = jnp.where(key < limit, sc, -jnp.inf)
    m_new = jnp.maximum(m, sc.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
    l = l * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p.astype(jnp.bfloat16), acc, m_new, l


def _pv_accumulate(acc, p16, v, p_ref=None):
    """acc + P·V on the tensor cores: P (64 x 64 bf16) in registers, V an SMEM ref [64, cols], acc fp32
    [64, cols] in registers. With `p_ref` (an SMEM [64, 64] bf16 tile: `MlaDecodeConfig.interpretable`)
    P is staged there first, since the interpreter cannot take the wgmma A operand from registers."""
    if p_ref is not None:
        p_ref[...] = p16
        plgpu.commit_smem()
        return _pv_product(acc, p_ref, v, interpretable=True)
    return _pv_product(acc, p16, v, interpretable=False)


def _zero_v_tail(kv, valid, start, ncols):
    """Zero rows >= ``valid`` of columns [start, start + ncols) of a page in SMEM (the tail of a
    sequence's last page is unwritten cache, maybe NaN, and 0 x NaN = NaN in P·V). Only on a
    partial page; ends with `plgpu.commit_smem` so the tensor cores see it."""
    wgmma_layout = plgpu.Layout.WGMMA

    @pl.when(valid < PAGE_SIZE)
    def _():
        tok = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, 64), 0, layout=wgmma_layout)
        for k in range(ncols // 64):
            chunk = kv.at[:, pl.ds(start + k * 64, 64)]
            x = plgpu.load(chunk, layout=wgmma_layout)
            chunk[...] = jnp.where(tok < valid, x, jnp.zeros_like(x))
        plgpu.commit_smem()


def _pv_product(acc, p, v, interpretable):
    """acc + P·V on the tensor cores, waited for: P (64 x 64 bf16) in registers or an SMEM wgmma tile,
    V an SMEM ref [64, cols], acc fp32 [64, cols] in registers. ``interpretable``: accumulate through
    `run_scoped` (the interpreter runs no `run_state` accumulator; P must then be in SMEM)."""
    if interpretable:

        def pv_scoped(acc_ref):
            plgpu.wgmma(acc_ref, p, v)
            return acc_ref[...]

        return acc + pl.run_scoped(pv_scoped, plgpu.ACC(acc.shape, jnp.float32))

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v)

    return pl.run_state(pv)(plgpu.ACC.init(acc))


def _partials_out_type(B, S, Rp, dtype):
    """Outputs of a main kernel: with one split the final (out [B, Rp, 512] in q's dtype, lse
    [B, Rp] f32, natural log); with several, fp32 partials (o [B, S, Rp, 512], lse [B, S, Rp] in
    log2) for `_combine`."""
    if S == 1:
        return (jax.ShapeDtypeStruct((B, Rp, LATENT_DIM), dtype), jax.ShapeDtypeStruct((B, Rp), jnp.float32))
    return (jax.ShapeDtypeStruct((B, S, Rp, LATENT_DIM), jnp.float32), jax.ShapeDtypeStruct((B, S, Rp), jnp.float32))


def _main_out_geometry(B, Rp, plan_: _Plan, dtype):
    """(out_type, grid, grid_names) of a main kernel. per_sequence: `_partials_out_type` over the grid
    (row block g, split s, batch b). balanced: fp32 partials by piece slot (o [NS, Rp, 512], lse
    [NS, Rp] in log2, NS = `num_piece_slots`; slots no piece takes are never written) over the grid
    (row block g, CTA c)."""
    if plan_.schedule == "balanced":
        NS = num_piece_slots(B, plan_.num_ctas)
        return (
            (jax.ShapeDtypeStruct((NS, Rp, LATENT_DIM), jnp.float32), jax.ShapeDtypeStruct((NS, Rp), jnp.float32)),
            (plan_.row_blocks, plan_.num_ctas),
            ("g", "c"),
        )
    return (
        _partials_out_type(B, plan_.num_splits, Rp, dtype),
        (plan_.row_blocks, plan_.num_splits, B),
        ("g", "s", "b"),
    )


def _split_pages(seq_len, first_page, pages_per_split):
    """Pages a split starting at page ``first_page`` of a sequence of seq_len tokens reads (0 for
    a split past the sequence's end)."""
    return jnp.clip(pl.cdiv(seq_len, PAGE_SIZE) - first_page, 0, pages_per_split)


def _kernel_refs(refs, num_inputs, balanced):
    """A main kernel's refs: (its inputs, the `BalancedSchedule` refs or None, (o, lse))."""
    ins, rest = refs[:num_inputs], refs[num_inputs:]
    return ins, (rest[:-2] if balanced else None), rest[-2:]


def _init_carry():
    """Online-softmax state of one compute warpgroup: (acc [64, 256], m [64], l [64]) f32."""
    return (
        plgpu.layout_cast(jnp.zeros((ROWS, LATENT_DIM // 2), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )


def _normalise(acc, m, l):
    """(o = acc / l, lse in log2). l == 0 only for rows that saw no key (an empty split or piece,
    or a query before every key): o = 0 and lse = -inf."""
    l_safe = jnp.where(l == 0.0, 1.0, l)
    return acc / lax.broadcast_in_dim(l_safe, acc.shape, [0]), m + jnp.log2(l)


class _At(NamedTuple):
    """Where a pipeline step is: sequence b, first key of the page, seq_len; balanced only: whether
    the page ends the CTA's piece of b, and the sequence of the run's next page."""

    b: jax.Array
    page_start: jax.Array
    seq_len: jax.Array
    last: jax.Array | None = None
    next_b: jax.Array | None = None


class _Steps(NamedTuple):
    """What a main kernel's page pipeline takes from its schedule (`_schedule_steps`)."""

    n_steps: jax.Array  # pages this CTA reads (its pipeline's dynamic grid)
    page_of: object  # step i -> physical page id (the TMA's index map)
    begin: object  # (i, carry) -> ((acc, m, l), _At): the body's first call
    after_qk: object  # (i, at): called once both warpgroups' Q·Kᵀ of step i is done
    end_step: object  # ((acc, m, l), at) -> the next carry
    compute_context: object  # the pipeline's compute context


def _schedule_steps(
    plan_: _Plan,
    *,
    q_ref,
    o_ref,
    lse_ref,
    bt_ref,
    lens_ref,
    q_smem,
    q_bar,
    q_free_bar,
    rows,
    cols,
    final,
    sched_refs=None,
) -> _Steps:
    """The schedule's side of a main kernel (either body, either page format).

    per_sequence: CTA (g, s, b) reads split s of sequence b; Q is loaded once; the context writes
    the result (final or the split's partial) after the pipeline.
    balanced (``sched_refs`` = a `BalancedSchedule`'s scalars, ends, cta_seqs): CTA (g, c) reads
    run c of the batch's pages, carrying the current sequence b next to (acc, m, l). The TMA
    warpgroup finds each page's sequence by `sequence_of_page` among the run's sequences, the
    compute warpgroups only at a piece's end. On the last page of each piece the body writes the
    piece's partial to slot c + b and restarts the softmax state; after that page's Q·Kᵀ (both
    warpgroups done with Q) warpgroup 0 starts loading the next sequence's Q, which the first page
    of the next piece waits for.
    """
    wg = lax.axis_index("wg")
    if plan_.schedule == "balanced":
        sc_ref, ends_ref, cta_ref = sched_refs
        c = lax.axis_index("c")
        ppc, total = sc_ref[0], sc_ref[1]
        run_start = jnp.minimum(c * ppc, total)
        n_steps = jnp.minimum(run_start + ppc, total) - run_start
        # The run's first and last sequences: every search is between them, so it takes no step
        # while the run stays in one sequence.
        b_first, b_last = cta_ref[c, 0], cta_ref[c, 1]
        seq_start = lambda b, seq_len: ends_ref[b] - pl.cdiv(seq_len, PAGE_SIZE)

        def page_of(i):
            gp = run_start + i
            b = sequence_of_page(gp, ends_ref, b_first, b_last)
            return bt_ref[b, gp - seq_start(b, lens_ref[b])]

        def begin(i, carry):
            *core, b = carry
            gp = run_start + i
            seq_len = lens_ref[b]
            pos = gp - seq_start(b, seq_len)

            @pl.when((i == 0) | (pos == 0))
            def _():
                plgpu.barrier_wait(q_bar)

            last = (i == n_steps - 1) | (gp + 1 >= ends_ref[b])
            next_b = lax.cond(last, lambda: sequence_of_page(gp + 1, ends_ref, b, b_last), lambda: b)
            return tuple(core), _At(b, pos * PAGE_SIZE, seq_len, last, next_b)

        def after_qk(i, at):
            @pl.when(at.last & (i + 1 < n_steps))
            def _():
                plgpu.barrier_arrive(q_free_bar)
                plgpu.barrier_wait(q_free_bar)

                @pl.when(wg == 0)
                def _():
                    plgpu.copy_gmem_to_smem(q_ref.at[at.next_b, rows], q_smem, q_bar)

        def end_step(core, at):
            @pl.when(at.last)
            def _():
                o, lse2 = _normalise(*core)
                o_ref[c + at.b, rows, cols] = o

                @pl.when(wg == 0)
                def _():
                    lse_ref[c + at.b, rows] = lse2

            # (A scalar predicate does not broadcast implicitly under warpgroup semantics.)
            restart = lambda x0, x: jnp.where(jnp.broadcast_to(at.last, x.shape), x0, x)
            return (*map(restart, _init_carry(), core), at.next_b)

        def compute_context(pipeline):
            @pl.when((wg == 0) & (n_steps > 0))
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[b_first, rows], q_smem, q_bar)

            pipeline((*_init_carry(), b_first))  # every piece is written by the body

        return _Steps(n_steps, page_of, begin, after_qk, end_step, compute_context)

    pps = plan_.pages_per_split
    s, b = lax.axis_index("s"), lax.axis_index("b")
    seq_len = lens_ref[b]
    first_page = s * pps
    table = bt_ref.at[b]

    def compute_context(pipeline):
        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows], q_smem, q_bar)

        plgpu.barrier_wait(q_bar)  # one completion releases both compute warpgroups
        o, lse2 = _normalise(*pipeline(_init_carry()))
        if final:
            o_ref[b, rows, cols] = o.astype(o_ref.dtype)
        else:
            o_ref[b, s, rows, cols] = o

        @pl.when(wg == 0)
        def _():
            if final:
                lse_ref[b, rows] = lse2 * _LN2
            else:
                lse_ref[b, s, rows] = lse2

    return _Steps(
        _split_pages(seq_len, first_page, pps),
        lambda i: table[first_page + i],
        lambda i, carry: (carry, _At(b, (first_page + i) * PAGE_SIZE, seq_len)),
        lambda i, at: None,
        lambda core, at: core,
        compute_context,
    )


def _decode_partials(
    q_rows,
    kv_pages,
    block_table,
    seq_lens,
    *,
    s_q,
    heads,
    causal,
    scale,
    plan_: _Plan,
    config: MlaDecodeConfig,
    interpret,
    schedule=None,
):
    """Main kernel. With one split it returns the final (out [B, Rp, 512] bf16, lse [B, Rp] f32 ln);
    with several, fp32 partials (o [B, S, Rp, 512], lse [B, S, Rp] in log2) for `_combine`.
    With ``schedule`` (plan_.schedule == "balanced": a `BalancedSchedule`'s scalars, ends and
    cta_seqs): fp32 partials per piece slot (o [NS, Rp, 512], lse [NS, Rp] in log2, NS =
    `num_piece_slots`); slots no piece takes are never written."""
    B, Rp, _ = q_rows.shape
    balanced = plan_.schedule == "balanced"
    final = plan_.num_splits == 1 and not balanced
    scale_log2 = scale * _LOG2E
    out_type, grid, grid_names = _main_out_geometry(B, Rp, plan_, q_rows.dtype)
    scratch = dict(q_smem=plgpu.SMEM((ROWS, KEY_DIM), jnp.bfloat16, transforms=_BF16_TRANSFORMS), q_bar=plgpu.Barrier())
    if balanced:
        # Both compute warpgroups are done reading Q (their Q·Kᵀ of a piece's last page) before
        # warpgroup 0 reloads it for the next sequence.
        scratch["q_free_bar"] = plgpu.Barrier(num_arrivals=2)
    if plan_.split_qk:
        # P (64 rows x 64 tokens, bf16, untiled so each warpgroup can store its 32-token half and
        # both can load all of it into registers), row maxima and row sums of each warpgroup, and
        # the two per-page rendezvous barriers. 9 KB: what is left of the 227 KB after Q and two KV
        # stages (221 KB) holds it; a 64x64 fp32 S would not fit.
        scratch["p_full_smem"] = plgpu.SMEM((ROWS, PAGE_SIZE), jnp.bfloat16)
        scratch["stat_smem"] = plgpu.SMEM((2, 2, ROWS), jnp.float32)  # [max|sum, wg, row]
        scratch["max_bar"] = plgpu.Barrier(num_arrivals=2)
        scratch["p_bar"] = plgpu.Barrier(num_arrivals=2)
    if config.interpretable:
        scratch["p_smem"] = plgpu.SMEM((2, ROWS, PAGE_SIZE), jnp.bfloat16, transforms=_BF16_TRANSFORMS)
    half = LATENT_DIM // 2
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    # Grid x (fastest) = row block, so the CTAs reading the same pages for different heads run
    # side by side and the second read hits L2; then the split, then the batch.
    @functools.partial(
        plgpu.kernel,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        scratch_types=scratch,
        # The split-QK buffers fill SMEM to the last KB, so give back the cross-warp reduction
        # scratch (2 KB by default); its reductions are all along rows, inside a warp.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, **({"reduction_scratch_bytes": 0} if plan_.split_qk else {})
        ),
        interpret=interpret,
    )
    def mla_decode_partials(
        *refs, q_smem, q_bar, q_free_bar=None, p_smem=None, p_full_smem=None, stat_smem=None, max_bar=None, p_bar=None
    ):
        (q_ref, kv_ref, bt_ref, lens_ref), sched_refs, (o_ref, lse_ref) = _kernel_refs(refs, 4, balanced)
        g = lax.axis_index("g")
        wg = lax.axis_index("wg")
        rows = pl.ds(g * ROWS, ROWS)
        cols = pl.ds(wg * half, half)  # this compute warpgroup's share of the 512 output columns
        steps = _schedule_steps(
            plan_,
            q_ref=q_ref,
            o_ref=o_ref,
            lse_ref=lse_ref,
            q_smem=q_smem,
            q_bar=q_bar,
            q_free_bar=q_free_bar,
            rows=rows,
            cols=cols,
            final=final,
            bt_ref=bt_ref,
            lens_ref=lens_ref,
            sched_refs=sched_refs,
        )

        def zero_v_tail(kv, valid):  # this warpgroup's V columns
            _zero_v_tail(kv, valid, wg * half, half)

        def body_split_qk(idx, kv, carry):
            # Warpgroup w scores tokens [32w, 32w+32) of the page. Rendezvous 1 (max_bar): both halves'
            # row maxima are in SMEM. Rendezvous 2 (p_bar): both P halves and row sums are. The
            # buffers are single: a warpgroup rewrites its maxima only after passing the other's p_bar
            # arrival of the previous page (which follows the other's read of them), and its P half and
            # sums only after the other's max_bar arrival of this page (which follows the other's
            # loads of P and sums for the previous page).
            (i,) = idx
            (acc, m, l), at = steps.begin(i, carry)
            page_start, seq_len = at.page_start, at.seq_len
            zero_v_tail(kv, seq_len - page_start)
            tokens = pl.ds(wg * (PAGE_SIZE // 2), PAGE_SIZE // 2)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, kv.at[tokens].transpose((1, 0)))
                return acc_ref[...]

            sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE // 2), jnp.float32)) * scale_log2
            steps.after_qk(i, at)
            key = (
                page_start
                + wg * (PAGE_SIZE // 2)
                + plgpu.broadcasted_iota(jnp.int32, (ROWS, PAGE_SIZE // 2), 1, layout=wgmma_layout)
            )
            limit = _row_limits(seq_len, g, heads=heads, s_q=s_q, causal=causal, shape=(ROWS, PAGE_SIZE // 2))
            sc = jnp.where(key < limit, sc, -jnp.inf)
            stat_smem[0, wg] = sc.max(axis=1)
            plgpu.barrier_arrive(max_bar)
            plgpu.barrier_wait(max_bar)
            m_new = jnp.maximum(
                m,
                jnp.maximum(
                    plgpu.load(stat_smem.at[0, 0], layout=row_layout), plgpu.load(stat_smem.at[0, 1], layout=row_layout)
                ),
            )
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
            p_full_smem[:, tokens] = p.astype(jnp.bfloat16)
            stat_smem[1, wg] = p.sum(axis=1)
            plgpu.barrier_arrive(p_bar)
            plgpu.barrier_wait(p_bar)
            l = (
                l * alpha
                + plgpu.load(stat_smem.at[1, 0], layout=row_layout)
                + plgpu.load(stat_smem.at[1, 1], layout=row_layout)
            )
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = plgpu.load(p_full_smem, layout=wgmma_layout)
            return steps.end_step((pv_update(acc, p16, kv.at[:, cols]), m_new, l), at)

        def pv_update(acc, p16, v):
            """acc + P·V for this warpgroup's columns; P (64 x 64 bf16) in registers."""
            return _pv_accumulate(acc, p16, v, p_smem.at[wg] if config.interpretable else None)

        def body(idx, kv, carry):
            (i,) = idx
            (acc, m, l), at = steps.begin(i, carry)
            page_start, seq_len = at.page_start, at.seq_len
            zero_v_tail(kv, seq_len - page_start)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, kv.transpose((1, 0)))
                return acc_ref[...]

            sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE), jnp.float32)) * scale_log2
            steps.after_qk(i, at)
            p16, acc, m_new, l = _online_softmax(
                sc, acc, m, l, page_start, _row_limits(seq_len, g, heads=heads, s_q=s_q, causal=causal)
            )
            return steps.end_step((pv_update(acc, p16, kv.at[:, cols]), m_new, l), at)

        plgpu.emit_pipeline_warp_specialized(
            body_split_qk if plan_.split_qk else body,
            grid=(steps.n_steps,),
            memory_registers=config.memory_registers,
            num_compute_wgs=2,
            wg_axis="wg",
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=steps.compute_context,
            in_specs=[
                plgpu.BlockSpec(
                    (None, PAGE_SIZE, KEY_DIM), lambda i: (steps.page_of(i), 0, 0), transforms=_BF16_TRANSFORMS
                )
            ],
        )(kv_ref)

    if balanced:
        return mla_decode_partials(q_rows, kv_pages, block_table, seq_lens, *schedule)
    return mla_decode_partials(q_rows, kv_pages, block_table, seq_lens)


# The scorer body (`MlaDecodeConfig.scorer`): one warpgroup scores each page once, two others
# accumulate P·V, beside the TMA warpgroup; the tensor cores run the scorer's Q·Kᵀ of one page while
# the accumulating warpgroups run P·V of the one before.
_SCORER_COLS = 128  # P·V columns of the scoring warpgroup
_ACC_COLS = (LATENT_DIM - _SCORER_COLS) // 2  # 192 for each of the two accumulating ones
SCORER_MEMORY_REGISTERS = 24  # the TMA warpgroup's registers (setmaxnreg): a loop issuing copies


def _scorer_compute_registers(memory_registers: int = SCORER_MEMORY_REGISTERS) -> int:
    """Registers a thread of each of the three compute warpgroups asks for (setmaxnreg): the 64 K of
    the register file less the TMA warpgroup's share, split three ways, rounded down to a multiple
    of 8."""
    return min(256, (512 - memory_registers) // 3) // 8 * 8


def _decode_partials_scorer(
    q_rows,
    kv_pages,
    block_table,
    seq_lens,
    *,
    s_q,
    heads,
    causal,
    scale,
    plan_: _Plan,
    config: MlaDecodeConfig,
    interpret,
):
    """`_decode_partials` with a dedicated scoring warpgroup (bf16 pages, per_sequence schedule).

    Four warpgroups a CTA (row block g, split s, sequence b), each with its own loop over the
    split's pages:
    * warpgroup 3 (TMA) loads Q, then streams the pages through ``max_concurrent_steps`` slots
      (``kv_ready[slot]``), refilling a slot once all three compute warpgroups have released it
      (``kv_free[slot]``, 3 arrivals);
    * warpgroup 0 (the scorer) zeroes the V tail of a sequence's partial last page, computes
      S = Q·Kᵀ of each page once (64 rows x 64 tokens over 576 columns) and the online softmax
      (running max and sum in its registers; the mask only on pages that need one), writes P
      (bf16, a wgmma tile) with the page's rescale alpha and running sum l to SMEM (``p_ready``),
      then accumulates P·V over columns [0, 128) itself;
    * warpgroups 1 and 2 accumulate P·V over columns [128, 320) and [320, 512): wait ``p_ready``,
      rescale by alpha, P·V with the tensor cores reading P from SMEM, then release P (``p_free``,
      2 arrivals), which the scorer waits for before writing the next page's P.
    So each page's Q·Kᵀ is computed once (8.9 MFLOP a page and CTA, against 13.6 for the plain
    body), and while the accumulating warpgroups run P·V of page i the scorer runs Q·Kᵀ of page
    i + 1. Registers: ptxas refuses an instruction that needs more than the launch's cap, 128 a
    thread for four warpgroups, even after setmaxnreg (on an H200, 256-column accumulators failed
    with "Insufficient registers (128)"), hence the 128 / 192 / 192 split: 64 and 96 accumulator
    registers a thread. The warpgroups still set their registers (24 for the TMA one, 160 for the
    others): the same code without it measured 1-6 % slower, with more spill code.

    Each warpgroup writes its columns of the split's result after its loop (an empty split too:
    out 0, lse -inf). SMEM: Q 72 KB + two 72 KB page slots + P 8 KB + 0.5 KB = 224.5 KB. Outputs
    as `_decode_partials` (per_sequence). (A balanced-schedule form, with a page-by-page walk over
    sequences in every warpgroup, measured slower and was removed: docs/NOTES.md.)"""
    B, Rp, _ = q_rows.shape
    pps = plan_.pages_per_split
    final = plan_.num_splits == 1
    scale_log2 = scale * _LOG2E
    nslots = config.max_concurrent_steps
    c0, acc_cols = _SCORER_COLS, _ACC_COLS
    out_type, grid, grid_names = _main_out_geometry(B, Rp, plan_, q_rows.dtype)
    scratch = dict(
        q_smem=plgpu.SMEM((ROWS, KEY_DIM), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        kv_smem=plgpu.SMEM((nslots, PAGE_SIZE, KEY_DIM), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        p_smem=plgpu.SMEM((ROWS, PAGE_SIZE), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        stat_smem=plgpu.SMEM((2, ROWS), jnp.float32),  # alpha, l of the page's P
        q_bar=plgpu.Barrier(),
        kv_ready=plgpu.Barrier(num_barriers=nslots),
        kv_free=plgpu.Barrier(num_arrivals=3, num_barriers=nslots),
        p_ready=plgpu.Barrier(),
        p_free=plgpu.Barrier(num_arrivals=2),
    )
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    compute_registers = _scorer_compute_registers()
    # Keys every query row of the sequence sees: the first causal query row sees s_q - 1 fewer.
    lag = s_q - 1 if causal else 0

    @functools.partial(
        plgpu.kernel,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=4,
        thread_name="wg",
        scratch_types=scratch,
        # Every reduction is along rows, inside a warp: no cross-warp reduction scratch needed.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret,
    )
    def mla_decode_partials_scorer(
        q_ref,
        kv_ref,
        bt_ref,
        lens_ref,
        o_ref,
        lse_ref,
        *,
        q_smem,
        kv_smem,
        p_smem,
        stat_smem,
        q_bar,
        kv_ready,
        kv_free,
        p_ready,
        p_free,
    ):
        g, s, b = lax.axis_index("g"), lax.axis_index("s"), lax.axis_index("b")
        wg = lax.axis_index("wg")
        rows = pl.ds(g * ROWS, ROWS)
        seq_len = lens_ref[b]
        first_page = s * pps
        n_pages = _split_pages(seq_len, first_page, pps)
        out_index = (b, rows) if final else (b, s, rows)

        def page(i):
            """(slot, first key) of step i, once its page has landed."""
            slot = lax.rem(i, nslots)
            plgpu.barrier_wait(kv_ready.at[slot])
            return slot, (first_page + i) * PAGE_SIZE

        def write_out(cols, acc, l):
            l_safe = jnp.where(l == 0.0, 1.0, l)
            o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            o_ref[(*out_index, cols)] = o.astype(o_ref.dtype)

        @pl.when(wg == 3)
        def _memory():
            plgpu.set_max_registers(SCORER_MEMORY_REGISTERS, action="decrease")

            @pl.loop(0, n_pages)
            def _(i):
                slot = lax.rem(i, nslots)

                @pl.when(i == 0)
                def _():
                    plgpu.copy_gmem_to_smem(q_ref.at[b, rows], q_smem, q_bar)

                @pl.when(i >= nslots)
                def _():
                    plgpu.barrier_wait(kv_free.at[slot])

                plgpu.copy_gmem_to_smem(kv_ref.at[bt_ref[b, first_page + i]], kv_smem.at[slot], kv_ready.at[slot])

            # Observe the last releases too, so that every barrier ends with all its phases waited
            # (the interpreter checks this when the barriers are freed).
            @pl.loop(jnp.maximum(n_pages - nslots, 0), n_pages)
            def _(i):
                plgpu.barrier_wait(kv_free.at[lax.rem(i, nslots)])

        def zeros(cols):
            return plgpu.layout_cast(jnp.zeros((ROWS, cols), jnp.float32), wgmma_layout)

        m0 = plgpu.layout_cast(jnp.full((ROWS,), _M_INIT, jnp.float32), row_layout)
        l0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)

        @pl.when(wg == 0)
        def _scorer():
            plgpu.set_max_registers(compute_registers, action="increase")

            def step(i, carry):
                acc, m, l = carry
                slot, page_start = page(i)
                kv = kv_smem.at[slot]
                _zero_v_tail(kv, seq_len - page_start, 0, LATENT_DIM)  # for every P·V warpgroup

                @pl.when(i == 0)
                def _():
                    plgpu.barrier_wait(q_bar)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, kv.transpose((1, 0)))
                    return acc_ref[...]

                sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE), jnp.float32))

                def masked():
                    key = page_start + plgpu.broadcasted_iota(jnp.int32, (ROWS, PAGE_SIZE), 1, layout=wgmma_layout)
                    limit = _row_limits(seq_len, g, heads=heads, s_q=s_q, causal=causal)
                    return jnp.where(key < limit, sc, -jnp.inf)

                # Only a page reaching past what the first query row sees needs the mask.
                sc = lax.cond(page_start + PAGE_SIZE <= seq_len - lag, lambda: sc, masked)
                # The scale is folded into exp2's argument (scale > 0 keeps the row maxima maxima).
                m_new = jnp.maximum(m, sc.max(axis=1) * scale_log2)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(sc * scale_log2 - lax.broadcast_in_dim(m_new, sc.shape, [0]))
                l = l * alpha + p.sum(axis=1)

                @pl.when(i > 0)
                def _():  # both accumulating warpgroups are done with the previous page's P
                    plgpu.barrier_wait(p_free)

                p_smem[...] = p.astype(jnp.bfloat16)
                stat_smem[0] = alpha
                stat_smem[1] = l
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready)
                acc = _pv_product(
                    acc * lax.broadcast_in_dim(alpha, acc.shape, [0]),
                    p_smem,
                    kv.at[:, pl.ds(0, c0)],
                    config.interpretable,
                )
                plgpu.barrier_arrive(kv_free.at[slot])
                return acc, m_new, l

            acc, m, l = lax.fori_loop(0, n_pages, step, (zeros(c0), m0, l0))

            @pl.when(n_pages > 0)
            def _():  # the last page's P released (see the memory warpgroup's last loop)
                plgpu.barrier_wait(p_free)

            write_out(pl.ds(0, c0), acc, l)
            lse2 = m + jnp.log2(l)
            lse_ref[out_index] = lse2 * _LN2 if final else lse2

        @pl.when((wg == 1) | (wg == 2))
        def _accumulate():
            plgpu.set_max_registers(compute_registers, action="increase")
            cols = pl.ds(c0 + (wg - 1) * acc_cols, acc_cols)

            def step(i, carry):
                acc, _ = carry
                slot, _ = page(i)
                plgpu.barrier_wait(p_ready)
                alpha = plgpu.load(stat_smem.at[0], layout=row_layout)
                l = plgpu.load(stat_smem.at[1], layout=row_layout)
                acc = _pv_product(
                    acc * lax.broadcast_in_dim(alpha, acc.shape, [0]),
                    p_smem,
                    kv_smem.at[slot, :, cols],
                    config.interpretable,
                )
                plgpu.barrier_arrive(p_free)
                plgpu.barrier_arrive(kv_free.at[slot])
                return acc, l

            acc, l = lax.fori_loop(0, n_pages, step, (zeros(acc_cols), l0))
            write_out(cols, acc, l)

    return mla_decode_partials_scorer(q_rows, kv_pages, block_table, seq_lens)


# fp8 pages (`pallas_kernels.page_format`): per token 512 e4m3 bytes, 4 fp32 scales (one per 128
# latent values), 64 bf16 rope values = 656 bytes. The kernel reads each page through three views
# of the same buffer: the latent bytes (uint8), the scales (fp32 words 128..131 of the row) and
# the rope (bf16 elements 264..327 of the row).
_FP8_SCALE_COL = LATENT_DIM // 4  # 128: first scale, in fp32 words
_FP8_ROPE_COL = (LATENT_DIM + 4 * (LATENT_DIM // 128)) // 2  # 264: first rope value, in bf16 elements
# Whether `mla_decode` has a kernel body for fp8 pages (the model's cached path asks).
FP8_KERNEL = True


def _fp8_views(kv_u8):
    """(latent uint8 [N, 64, 656], scales f32 [N, 64, 164], rope bf16 [N, 64, 328]): bitcasts of
    one fp8 pages buffer (no copy)."""
    N, G, W = kv_u8.shape
    as_f32 = lax.bitcast_convert_type(kv_u8.reshape(N, G, W // 4, 4), jnp.float32)
    as_bf16 = lax.bitcast_convert_type(kv_u8.reshape(N, G, W // 2, 2), jnp.bfloat16)
    return kv_u8, as_f32, as_bf16


def _decode_partials_fp8(
    q_rows,
    kv_u8,
    block_table,
    seq_lens,
    *,
    s_q,
    heads,
    causal,
    scale,
    plan_: _Plan,
    config: MlaDecodeConfig,
    interpret,
    schedule=None,
):
    """`_decode_partials` over fp8 pages. Per page the two compute warpgroups first dequantise
    (e4m3 -> f16 -> f32, times the token's block scale, -> bf16; rows past the sequence end zeroed)
    their 256 latent columns into one shared bf16 [64, 576] key buffer in wgmma tiles (warpgroup 0
    adds the rope columns), meet at a barrier, then both run the plain body on that buffer (Q·Kᵀ
    over 576 columns, online softmax, P·V over their 256 columns); a second barrier per page keeps
    the buffer until both have finished P·V. The TMA stages hold the page's bytes as they are in
    HBM (untiled boxes through free bitcast views: latent bytes, fp32 scales, bf16 rope), read
    under Lane semantics (no swizzled layout fits those strided views). SMEM: Q 72 KB + two 41 KB
    stages  + the 72 KB buffer = 226 KB of the 227. Outputs and ``schedule`` as for
    `_decode_partials`."""
    B, Rp, _ = q_rows.shape
    balanced = plan_.schedule == "balanced"
    final = plan_.num_splits == 1 and not balanced
    scale_log2 = scale * _LOG2E
    out_type, grid, grid_names = _main_out_geometry(B, Rp, plan_, q_rows.dtype)
    scratch = dict(
        q_smem=plgpu.SMEM((ROWS, KEY_DIM), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        q_bar=plgpu.Barrier(),
        lat_smem=plgpu.SMEM((PAGE_SIZE, KEY_DIM), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        deq_bar=plgpu.Barrier(num_arrivals=2),
        free_bar=plgpu.Barrier(num_arrivals=2),
    )
    if balanced:  # see `_decode_partials`
        scratch["q_free_bar"] = plgpu.Barrier(num_arrivals=2)
    if config.interpretable:
        scratch["p_smem"] = plgpu.SMEM((2, ROWS, PAGE_SIZE), jnp.bfloat16, transforms=_BF16_TRANSFORMS)
    half = LATENT_DIM // 2
    lat_view, scale_view, rope_view = _fp8_views(kv_u8)

    @functools.partial(
        plgpu.kernel,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        scratch_types=scratch,
        # SMEM is full to the last KB: no cross-warp reduction scratch (every reduction is along
        # rows, inside a warp).
        # Lane semantics: the untiled stage views below (a 128-column block of a 256-byte row, a
        # scale column) have no swizzled layout for the warpgroup layout inference to pick.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, reduction_scratch_bytes=0, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
        interpret=interpret,
    )
    def mla_decode_partials_fp8(*refs, q_smem, q_bar, lat_smem, deq_bar, free_bar, q_free_bar=None, p_smem=None):
        ins, sched_refs, (o_ref, lse_ref) = _kernel_refs(refs, 6, balanced)
        q_ref, lat_ref, scale_ref, rope_ref, bt_ref, lens_ref = ins
        g = lax.axis_index("g")
        wg = lax.axis_index("wg")
        rows = pl.ds(g * ROWS, ROWS)
        cols = pl.ds(wg * half, half)
        steps = _schedule_steps(
            plan_,
            q_ref=q_ref,
            o_ref=o_ref,
            lse_ref=lse_ref,
            q_smem=q_smem,
            q_bar=q_bar,
            q_free_bar=q_free_bar,
            rows=rows,
            cols=cols,
            final=final,
            bt_ref=bt_ref,
            lens_ref=lens_ref,
            sched_refs=sched_refs,
        )

        def pv_update(acc, p16):
            return _pv_accumulate(acc, p16, lat_smem.at[:, cols], p_smem.at[wg] if config.interpretable else None)

        def body(idx, lat_lo, lat_hi, scales, rope, carry):
            (i,) = idx
            (acc, m, l), at = steps.begin(i, carry)
            page_start, seq_len = at.page_start, at.seq_len
            # Both warpgroups are done with the previous page's buffer (their P·V) before it is rewritten.
            plgpu.barrier_arrive(free_bar)
            plgpu.barrier_wait(free_bar)
            _fp8_half_to_smem(wg, lat_lo, lat_hi, rope, seq_len - page_start, lat_smem, scales=scales)
            plgpu.barrier_arrive(deq_bar)
            plgpu.barrier_wait(deq_bar)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, lat_smem.transpose((1, 0)))
                return acc_ref[...]

            sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE), jnp.float32)) * scale_log2
            steps.after_qk(i, at)
            p16, acc, m_new, l = _online_softmax(
                sc, acc, m, l, page_start, _row_limits(seq_len, g, heads=heads, s_q=s_q, causal=causal)
            )
            return steps.end_step((pv_update(acc, p16), m_new, l), at)

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps.n_steps,),
            memory_registers=config.memory_registers,
            num_compute_wgs=2,
            wg_axis="wg",
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=steps.compute_context,
            in_specs=_fp8_in_specs(steps.page_of),
        )(lat_ref, lat_ref, scale_ref, rope_ref)

    if balanced:
        return mla_decode_partials_fp8(q_rows, lat_view, scale_view, rope_view, block_table, seq_lens, *schedule)
    return mla_decode_partials_fp8(q_rows, lat_view, scale_view, rope_view, block_table, seq_lens)


# The transposed fp8 body (R = s_q * H <= 32 query rows): scores are computed as Sᵀ = K·Qᵀ with
# the page's 64 tokens as the wgmma M and the R query rows as N, and the output as Oᵀ = Vᵀ·Pᵀ,
# so no tensor work is spent on padding rows (the plain body pads R to 64 rows and both warpgroups
# score all 64 tokens: 13.6 MFLOP a page where this needs 2.2 at R = 16).
NARROW_ROWS = 32


def _use_transposed_fp8(plan_: _Plan, s_q: int, heads: int, config: MlaDecodeConfig) -> bool:
    """Whether fp8 pages go through `_decode_partials_fp8_t` (see `MlaDecodeConfig.fp8_transposed`)."""
    fits = s_q * heads <= NARROW_ROWS and plan_.schedule == "per_sequence"
    if config.fp8_transposed is None:
        return fits
    if config.fp8_transposed and not fits:
        raise ValueError(
            f"fp8_transposed=True needs s_q * H <= {NARROW_ROWS} query rows and the per_sequence "
            f"schedule, got s_q * H = {s_q * heads}, schedule {plan_.schedule!r}"
        )
    return config.fp8_transposed


def _fp8_in_specs(page_of):
    """The pipeline's in_specs over `_fp8_views`: each page's three parts as they are in HBM, in
    untiled TMA boxes of 256 latent bytes (two per row), 4 fp32 scales and 64 bf16 rope values a
    token (the views' offsets: byte 512 = fp32 word 128, byte 528 = bf16 element 264), as in
    `paged_gather`'s fp8 body."""
    half = LATENT_DIM // 2
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS
    return [
        plgpu.BlockSpec((None, PAGE_SIZE, half), lambda i: (page_of(i), 0, 0), oob_fill_mode=in_bounds),
        plgpu.BlockSpec((None, PAGE_SIZE, half), lambda i: (page_of(i), 0, 1), oob_fill_mode=in_bounds),
        plgpu.BlockSpec((None, PAGE_SIZE, 4), lambda i: (page_of(i), 0, _FP8_SCALE_COL // 4), oob_fill_mode=in_bounds),
        plgpu.BlockSpec(
            (None, PAGE_SIZE, pl.Element(KEY_DIM - LATENT_DIM)),
            lambda i: (page_of(i), 0, _FP8_ROPE_COL),
            oob_fill_mode=in_bounds,
        ),
    ]


def _fp8_half_to_smem(wg, lat_lo, lat_hi, rope, valid, dst, scales=None):
    """Warpgroup ``wg``'s 256 latent columns of an fp8 page (its stage views: latent bytes, fp32
    scales, bf16 rope) into ``dst`` (SMEM [64, 576] in wgmma tiles, bf16); warpgroup 0 also copies
    the rope (bf16 already) into columns 512..575. Rows past ``valid`` may hold anything, even NaN
    bytes or scales, and V must be 0 there (0 x NaN is NaN). Ends with `plgpu.commit_smem`.

    With ``scales`` (the padded body): e4m3 -> f16 -> f32 x the token's block scale -> bf16, rows
    past ``valid`` zeroed as they are written. Without (the transposed body, which applies the
    scales to the scores and to P): e4m3 -> f16 -> bf16, exact (every e4m3 value is a bf16 value);
    on a partial page (``valid`` < 64) this warpgroup's rows past the end are zeroed afterwards."""
    half = LATENT_DIM // 2
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    if scales is not None:
        tok = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, 128), 0, layout=wgmma_layout)
    for w, lat in enumerate((lat_lo, lat_hi)):

        @pl.when(wg == w)
        def _():
            for k in range(half // 128):
                x8 = plgpu.load(lat.at[:, pl.ds(k * 128, 128)], layout=plgpu.Layout.WGMMA_UPCAST_2X, optimized=False)
                x = plgpu.layout_cast(lax.bitcast_convert_type(x8, jnp.float8_e4m3fn).astype(jnp.float16), wgmma_layout)
                if scales is not None:
                    sc = plgpu.load(scales.at[:, w * (half // 128) + k], layout=row_layout, optimized=False)
                    x = x.astype(jnp.float32) * lax.broadcast_in_dim(sc, (PAGE_SIZE, 128), [0])
                    x = jnp.where(tok < valid, x, 0.0)
                dst[:, pl.ds(w * half + k * 128, 128)] = x.astype(dst.dtype)
            if w == 0:
                dst[:, pl.ds(LATENT_DIM, KEY_DIM - LATENT_DIM)] = plgpu.load(
                    rope, layout=wgmma_layout, optimized=False
                ).astype(dst.dtype)

    if scales is None:

        @pl.when(valid < PAGE_SIZE)
        def _():
            plgpu.commit_smem()
            tok = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, 64), 0, layout=wgmma_layout)
            for k in range(half // 64):
                chunk = dst.at[:, pl.ds(wg * half + k * 64, 64)]
                x = plgpu.load(chunk, layout=wgmma_layout)
                chunk[...] = jnp.where(tok < valid, x, jnp.zeros_like(x))

    plgpu.commit_smem()


def _decode_partials_fp8_t(
    q_rows, kv_u8, block_table, seq_lens, *, s_q, heads, causal, scale, plan_: _Plan, config: MlaDecodeConfig, interpret
):
    """`_decode_partials` over fp8 pages for R = s_q * H <= 32 query rows, in transposed form.

    A CTA (split s, sequence b) keeps Q [R, 576] in SMEM. Per page, warpgroup w (0, 1) converts
    its 256 latent columns (blocks 2w and 2w+1 of 128) to bf16 without their scales, into its own
    half of a bf16 [64, 576] buffer (warpgroup 0 adds the rope), and computes its partial scores
    Sᵀ_w = Σ_k scale_k ⊙ (K8_k·Q_kᵀ) [64 tokens, R]: one wgmma per block, each scaled by the
    block's per-token scale along the tokens (rows). Warpgroup 1 hands its partial to warpgroup 0
    through SMEM (barrier s_bar); warpgroup 0 sums (plus the rope scores), runs the online softmax
    over the tokens (axis 0: cross-warp reductions, which only one warpgroup may run at a time,
    since they share Mosaic GPU's reduction scratch), and publishes, per latent block k, Pᵀ_k =
    scale_k ⊙ Pᵀ in bf16 (through transposed views of [R, 64] tiles; zero past the sequence, where
    a scale may be NaN), the rescale alpha, m and l (barrier p_bar). Both then rescale and
    accumulate Oᵀ_k += K8_kᵀ·Pᵀ_k [128, R] for their two blocks. Folding the scales into the
    scores and P leaves the per-element work of a page at e4m3 -> f16 -> bf16 (an H200 profile:
    the scaled, masked dequantisation took half of each warpgroup's time).

    A warpgroup's buffer half is read only by itself, so the buffer needs no cross-warpgroup
    barrier; the one-way hand-offs are single-buffered (warpgroup 1 rewrites its partial only after
    p_bar of the page before, which warpgroup 0 passes after reading it; warpgroup 0 rewrites the
    Pᵀ_k only after s_bar, which warpgroup 1 reaches after its P·V).

    Outputs are transposed: with one split (oᵀ [B, 512, R] in q's dtype, lse [B, R] f32 ln), else
    fp32 partials (oᵀ [B, S, 512, R], lse [B, S, R] in log2). SMEM at R = 32: Q 36 KB, two 41 KB
    stages, the 72 KB buffer, 8 KB partial, 16 KB of Pᵀ_k: 216 KB."""
    B, R, _ = q_rows.shape
    S, pps = plan_.num_splits, plan_.pages_per_split
    final = S == 1
    scale_log2 = scale * _LOG2E
    mma = jnp.bfloat16  # tensor-core inputs (f16: 1-7 % faster at B=128, 3-5 % slower at B <= 8)
    blk = 128  # latent columns per fp8 scale
    nblk = LATENT_DIM // blk  # 4; warpgroup w owns blocks 2w, 2w+1
    if final:
        out_type = (jax.ShapeDtypeStruct((B, LATENT_DIM, R), q_rows.dtype), jax.ShapeDtypeStruct((B, R), jnp.float32))
    else:
        out_type = (
            jax.ShapeDtypeStruct((B, S, LATENT_DIM, R), jnp.float32),
            jax.ShapeDtypeStruct((B, S, R), jnp.float32),
        )
    scratch = dict(
        q_smem=plgpu.SMEM((R, KEY_DIM), mma, transforms=_BF16_TRANSFORMS),
        q_bar=plgpu.Barrier(),
        kv_smem=plgpu.SMEM((PAGE_SIZE, KEY_DIM), mma, transforms=_BF16_TRANSFORMS),
        part_smem=plgpu.SMEM((PAGE_SIZE, R), jnp.float32),
        p_smem=plgpu.SMEM((nblk, R, PAGE_SIZE), mma, transforms=_BF16_TRANSFORMS),
        stat_smem=plgpu.SMEM((3, R), jnp.float32),  # alpha, m, l
        s_bar=plgpu.Barrier(num_arrivals=1),
        p_bar=plgpu.Barrier(num_arrivals=1),
    )
    wgmma_layout = plgpu.Layout.WGMMA
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    lat_view, scale_view, rope_view = _fp8_views(kv_u8)

    @functools.partial(
        plgpu.kernel,
        out_type=out_type,
        grid=(S, B),
        grid_names=("s", "b"),
        num_threads=3,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    def mla_decode_partials_fp8_t(
        q_ref,
        lat_ref,
        scale_ref,
        rope_ref,
        bt_ref,
        lens_ref,
        o_ref,
        lse_ref,
        q_smem,
        q_bar,
        kv_smem,
        part_smem,
        p_smem,
        stat_smem,
        s_bar,
        p_bar,
    ):
        s, b = lax.axis_index("s"), lax.axis_index("b")
        wg = lax.axis_index("wg")
        seq_len = lens_ref[b]
        first_page = s * pps
        table = bt_ref.at[b]
        shape = (PAGE_SIZE, R)  # (tokens, query rows)

        def block_scale(scales, k):
            """Block k's per-token scales (fp32 [64], row layout), broadcast along the query rows."""
            sc = plgpu.load(scales.at[:, k], layout=row_layout, optimized=False)
            return lax.broadcast_in_dim(sc, shape, [0])

        def scores(scales):
            def mm(accs):
                for j, acc_ref in enumerate(accs[:2]):
                    c = pl.ds((2 * wg + j) * blk, blk)
                    plgpu.wgmma(acc_ref, kv_smem.at[:, c], q_smem.at[:, c].transpose((1, 0)))

                @pl.when(wg == 0)
                def _():
                    rope = pl.ds(LATENT_DIM, KEY_DIM - LATENT_DIM)
                    plgpu.wgmma(accs[2], kv_smem.at[:, rope], q_smem.at[:, rope].transpose((1, 0)))

                return tuple(a[...] for a in accs)

            s0, s1, s_rope = pl.run_scoped(lambda *accs: mm(accs), *(plgpu.ACC(shape, jnp.float32) for _ in range(3)))
            return (s0 * block_scale(scales, 2 * wg) + s1 * block_scale(scales, 2 * wg + 1)) + s_rope

        def softmax(part, scales, page_start, m, l):
            """Warpgroup 0: the page's scores (its partial + warpgroup 1's), the online softmax over
            the tokens (axis 0); publishes the Pᵀ_k, alpha, m and l in SMEM."""
            sc = (part + plgpu.load(part_smem, layout=wgmma_layout, optimized=False)) * scale_log2
            key = page_start + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)
            if causal:  # query row r is token j = r // H (H a power of two), at seq_len - s_q + j
                j = lax.shift_right_logical(
                    plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout), int(math.log2(heads))
                )
                visible = key < seq_len - s_q + 1 + j
            else:
                visible = key < seq_len
            sc = jnp.where(visible, sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(axis=0))
            p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, shape, [1]))
            for k in range(nblk):  # past the sequence p is 0 but the scale may be NaN
                p_smem.at[k].transpose((1, 0))[...] = jnp.where(visible, p * block_scale(scales, k), 0.0).astype(mma)
            alpha = jnp.exp2(m - m_new)
            stat_smem[0] = alpha
            stat_smem[1] = m_new
            stat_smem[2] = l * alpha + p.sum(axis=0)
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_bar)

        def pv_update(accs):
            """Both warpgroups: Oᵀ_k = alpha * Oᵀ_k + K8_kᵀ·Pᵀ_k for their two blocks k, with the Pᵀ_k,
            alpha, m and l from SMEM."""
            alpha, m, l = (plgpu.load(stat_smem.at[k], layout=col_layout) for k in range(3))
            accs = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [1]) for a in accs)
            ops = [
                (
                    kv_smem.at[:, pl.ds((2 * wg + j) * blk, blk)].transpose((1, 0)),
                    p_smem.at[2 * wg + j].transpose((1, 0)),
                )
                for j in range(2)
            ]
            if config.interpretable:

                def pv_scoped(*refs):
                    for acc_ref, (v_t, p_t) in zip(refs, ops):
                        plgpu.wgmma(acc_ref, v_t, p_t)
                    return tuple(r[...] for r in refs)

                d = pl.run_scoped(pv_scoped, *(plgpu.ACC(a.shape, jnp.float32) for a in accs))
                accs = tuple(a + x for a, x in zip(accs, d))
            else:

                def pv(refs):
                    for acc_ref, (v_t, p_t) in zip(refs, ops):
                        plgpu.wgmma(acc_ref, v_t, p_t)

                accs = pl.run_state(pv)(tuple(plgpu.ACC.init(a) for a in accs))
            return accs, m, l

        def body(idx, lat_lo, lat_hi, scales, rope, carry):
            (i,) = idx
            accs, m, l = carry
            page_start = (first_page + i) * PAGE_SIZE
            # (The named scopes are what Mosaic GPU's profiler reports: scripts/lab/profile_fp8_decode.py.)
            with jax.named_scope("convert"):
                _fp8_half_to_smem(wg, lat_lo, lat_hi, rope, seq_len - page_start, kv_smem)
            with jax.named_scope("qk"):
                part = scores(scales)

            @pl.when(wg == 1)
            def _():
                with jax.named_scope("hand_over"):
                    part_smem[...] = part
                    plgpu.barrier_arrive(s_bar)
                with jax.named_scope("wait_p"):
                    plgpu.barrier_wait(p_bar)

            @pl.when(wg == 0)
            def _():
                with jax.named_scope("wait_partial"):
                    plgpu.barrier_wait(s_bar)
                with jax.named_scope("softmax"):
                    softmax(part, scales, page_start, m, l)

            with jax.named_scope("pv"):
                return pv_update(accs)

        def compute_context(pipeline):
            @pl.when(wg == 0)
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[b], q_smem, q_bar)

            plgpu.barrier_wait(q_bar)
            zeros = lambda: plgpu.layout_cast(jnp.zeros((blk, R), jnp.float32), wgmma_layout)  # noqa: E731
            init = (
                (zeros(), zeros()),
                plgpu.layout_cast(jnp.full((R,), _M_INIT, jnp.float32), col_layout),
                plgpu.layout_cast(jnp.zeros((R,), jnp.float32), col_layout),
            )
            accs, m, l = pipeline(init)
            l_safe = lax.broadcast_in_dim(jnp.where(l == 0.0, 1.0, l), (blk, R), [1])
            for j, acc in enumerate(accs):
                c = pl.ds((2 * wg + j) * blk, blk)
                if final:
                    o_ref[b, c] = (acc / l_safe).astype(o_ref.dtype)
                else:
                    o_ref[b, s, c] = acc / l_safe
            lse2 = m + jnp.log2(l)

            @pl.when(wg == 0)
            def _():
                if final:
                    lse_ref[b] = lse2 * _LN2
                else:
                    lse_ref[b, s] = lse2

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(_split_pages(seq_len, first_page, pps),),
            memory_registers=config.memory_registers,
            num_compute_wgs=2,
            wg_axis="wg",
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
            in_specs=_fp8_in_specs(lambda i: table[first_page + i]),
        )(lat_ref, lat_ref, scale_ref, rope_ref)

    return mla_decode_partials_fp8_t(q_rows, lat_view, scale_view, rope_view, block_table, seq_lens)


def _combine(o_part, lse_part, *, out_dtype, config: MlaDecodeConfig, interpret, pieces=None):
    """Split combine: o [B, S, Rp, 512] f32 and lse [B, S, Rp] (log2) -> out [B, Rp, 512], lse (ln).

    With ``pieces`` = (piece_start [B], num_pieces [B]) int32 (the balanced schedule): o [NS, Rp,
    512] and lse [NS, Rp] by piece slot, sequence b's pieces in slots [piece_start[b],
    piece_start[b] + num_pieces[b]) (none for an empty sequence: out = 0, lse = -inf).

    One CTA per (64 rows, combine_block_cols columns, sequence) streams the S partial tiles through
    SMEM and keeps an online log-sum-exp, so no split count limits it. Empty splits carry
    lse = -inf and o = 0, so they weigh exp2(-inf) = 0.
    """
    if pieces is None:
        B, S, Rp, _ = o_part.shape
    else:
        B = pieces[0].shape[0]
        Rp = o_part.shape[1]
    G = Rp // ROWS
    cb = config.combine_block_cols
    C = LATENT_DIM // cb
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    @functools.partial(
        plgpu.kernel,
        out_type=(jax.ShapeDtypeStruct((B, Rp, LATENT_DIM), out_dtype), jax.ShapeDtypeStruct((B, Rp), jnp.float32)),
        grid=(C, G, B),
        grid_names=("c", "g", "b"),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    def mla_decode_combine(*refs):
        c, g, b = lax.axis_index("c"), lax.axis_index("g"), lax.axis_index("b")
        if pieces is None:
            o_ref, lse_ref, out_ref, lse_out_ref = refs
            steps = (S,)
            o_spec = plgpu.BlockSpec((None, None, ROWS, cb), lambda s: (b, s, g, c))
            lse_spec = plgpu.BlockSpec((None, None, ROWS), lambda s: (b, s, g))
        else:
            o_ref, lse_ref, start_ref, count_ref, out_ref, lse_out_ref = refs
            first = start_ref[b]
            steps = (count_ref[b],)
            o_spec = plgpu.BlockSpec((None, ROWS, cb), lambda s: (first + s, g, c))
            lse_spec = plgpu.BlockSpec((None, ROWS), lambda s: (first + s, g))

        def body(idx, o_smem, lse_smem, carry):
            del idx
            acc, m, l = carry
            lse = plgpu.load(lse_smem, layout=row_layout)
            o = plgpu.load(o_smem, layout=wgmma_layout)
            m_new = jnp.maximum(m, lse)
            alpha = jnp.exp2(m - m_new)
            w = jnp.exp2(lse - m_new)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + o * lax.broadcast_in_dim(w, o.shape, [0])
            return acc, m_new, l * alpha + w

        acc, m, l = plgpu.emit_pipeline(
            body,
            grid=steps,
            max_concurrent_steps=2,
            in_specs=[o_spec, lse_spec],
            init_carry=(
                plgpu.layout_cast(jnp.zeros((ROWS, cb), jnp.float32), wgmma_layout),
                plgpu.layout_cast(jnp.full((ROWS,), _M_INIT, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout),
            ),
        )(o_ref, lse_ref)
        l_safe = jnp.where(l == 0.0, 1.0, l)
        out_ref[b, pl.ds(g * ROWS, ROWS), pl.ds(c * cb, cb)] = (
            acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        ).astype(out_ref.dtype)

        @pl.when(c == 0)
        def _():
            lse_out_ref[b, pl.ds(g * ROWS, ROWS)] = (m + jnp.log2(l)) * _LN2

    if pieces is None:
        return mla_decode_combine(o_part, lse_part)
    return mla_decode_combine(o_part, lse_part, *pieces)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "causal", "config", "interpret"))
def _mla_decode_kernel(q, kv_pages, block_table, seq_lens, *, softmax_scale, causal, config, interpret):
    B, s_q, H, _ = q.shape
    R = s_q * H
    plan_ = plan(B, s_q, H, block_table.shape[1], config)
    Rp = plan_.row_blocks * ROWS
    q_rows = q.reshape(B, R, KEY_DIM)  # (B, R, K), row = t*H + h
    # TMA needs 16-byte GMEM strides: pad the table to a multiple of 4 int32 columns. The kernel
    # never reads past cdiv(seq_len, 64) pages, so the padding value is irrelevant.
    pad = -block_table.shape[1] % 4
    if pad:
        block_table = jnp.pad(block_table, ((0, 0), (0, pad)))
    interpret_params = plgpu.InterpretGPUParams() if interpret else None
    if is_fp8_pages(kv_pages) and _use_transposed_fp8(plan_, s_q, H, config):
        # Unpadded rows in; the outputs come out transposed ([..., 512, R]).
        out_t, lse = _decode_partials_fp8_t(
            q_rows,
            kv_pages,
            block_table,
            seq_lens,
            s_q=s_q,
            heads=H,
            causal=causal,
            scale=float(softmax_scale),
            plan_=plan_,
            config=config,
            interpret=interpret_params,
        )
        if plan_.num_splits == 1:
            out = jnp.swapaxes(out_t, 1, 2)
        else:  # the combine takes 64-row blocks: pad rows with empty partials (lse -inf)
            o_part = jnp.pad(jnp.swapaxes(out_t, 2, 3), ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
            lse_part = jnp.pad(lse, ((0, 0), (0, 0), (0, Rp - R)), constant_values=-jnp.inf)
            out, lse = _combine(o_part, lse_part, out_dtype=q.dtype, config=config, interpret=interpret_params)
            out, lse = out[:, :R], lse[:, :R]
        return out.reshape(B, s_q, H, LATENT_DIM), lse.reshape(B, s_q, H)
    if Rp != R:  # the 64-row bodies take whole row blocks
        q_rows = jnp.pad(q_rows, ((0, 0), (0, Rp - R), (0, 0)))
    if is_fp8_pages(kv_pages):
        partials = _decode_partials_fp8
    elif plan_.scorer:
        partials = _decode_partials_scorer
    else:
        partials = _decode_partials
    if plan_.schedule == "balanced":
        sched = balanced_schedule(seq_lens, num_ctas=plan_.num_ctas, min_pages_per_cta=config.min_pages_per_split)
        o_part, lse_part = partials(
            q_rows,
            kv_pages,
            block_table,
            seq_lens,
            s_q=s_q,
            heads=H,
            causal=causal,
            scale=float(softmax_scale),
            plan_=plan_,
            config=config,
            interpret=interpret_params,
            schedule=sched[:3],
        )
        out, lse = _combine(
            o_part,
            lse_part,
            out_dtype=q.dtype,
            config=config,
            interpret=interpret_params,
            pieces=(sched.piece_start, sched.num_pieces),
        )
        if Rp != R:
            out, lse = out[:, :R], lse[:, :R]
        return out.reshape(B, s_q, H, LATENT_DIM), lse.reshape(B, s_q, H)
    out, lse = partials(
        q_rows,
        kv_pages,
        block_table,
        seq_lens,
        s_q=s_q,
        heads=H,
        causal=causal,
        scale=float(softmax_scale),
        plan_=plan_,
        config=config,
        interpret=interpret_params,
    )
    if plan_.num_splits > 1:
        out, lse = _combine(out, lse, out_dtype=q.dtype, config=config, interpret=interpret_params)
    if Rp != R:
        out, lse = out[:, :R], lse[:, :R]
    return out.reshape(B, s_q, H, LATENT_DIM), lse.reshape(B, s_q, H)


def mla_decode(
    q, kv_pages, block_table, seq_lens, *, softmax_scale, causal=False, config=None, impl=None, checked=False
):
    """Absorbed MLA decode attention over a paged latent cache.

    Args:
      q: bf16 [B, s_q, H, 576]: absorbed latent query (512) ; rope query (64). H in {16, 32, 64,
        128}; s_q in [1, 4]; B >= 1.
      kv_pages: bf16 [num_pages, 64, 576]: one layer's cache pages, rows = tokens, columns =
        normalised latent (512) ; roped key (64). V is the first 512 columns of the same rows.
        Or fp8 pages, uint8 [num_pages, 64, 656] (`pallas_kernels.page_format`: 512 e4m3 bytes,
        4 fp32 scales, 64 bf16 rope values a token), dequantised to bf16 inside the kernel; the
        reference dequantises them first, then computes as for bf16 pages.
      block_table: int32 [B, max_pages]: page ids of each sequence in token order. Entries past
        cdiv(seq_len, 64) are never read (may be anything); the ones before must be page ids in
        [0, num_pages).
      seq_lens: int32 [B]: cached tokens per sequence, including the s_q new ones, in
        [0, 64 * max_pages] (0: an idle row, out = 0, lse = -inf). When causal, a query with no
        visible key (seq_len < s_q) returns out = 0, lse = -inf.
      softmax_scale: Python float multiplying Q·Kᵀ (e.g. 192**-0.5 * mscale**2).
      causal: query j of s_q sits at position seq_len - s_q + j and sees keys <= that position;
        non-causal queries see all seq_len keys.
      config: `MlaDecodeConfig` (static); None = defaults.
      impl: None (kernel on a Hopper GPU, else reference), "kernel", "interpret" or "reference".
      checked: also check traced block tables and lengths, with `jax.experimental.checkify`
        (the caller wraps the jitted function in `checkify.checkify`; see `_page_table`).
        Concrete ones are always checked.

    Returns:
      out: [B, s_q, H, 512] in q's dtype (bf16); lse: float32 [B, s_q, H], natural log of the
      softmax denominator (scaled scores).

    Raises:
      ValueError naming the argument and the limit: a shape, dtype or head count the kernel does
      not support (`mla_decode_problems`), s_q outside [1, 4], a concrete seq_len outside
      [0, 64 * max_pages] or a concrete block-table entry it reads outside [0, num_pages).
    """
    _validate(q, kv_pages, block_table, seq_lens, softmax_scale, checked=checked)
    if config is None:
        config = MlaDecodeConfig()
    if not isinstance(config, MlaDecodeConfig):
        raise ValueError(f"config must be an MlaDecodeConfig or None, got {type(config).__name__}")
    impl = _platform.resolve_impl(impl)
    if impl == "reference":
        return mla_decode_reference(
            q, kv_pages, block_table, seq_lens, softmax_scale=softmax_scale, causal=causal, checked=checked
        )
    interpret = impl == "interpret"
    if interpret and not config.interpretable:
        config = dataclasses.replace(config, interpretable=True)
    return _mla_decode_kernel(
        q,
        kv_pages,
        block_table,
        seq_lens,
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        config=config,
        interpret=interpret,
    )
