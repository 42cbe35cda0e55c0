"""Absorbed Multi-head Latent Attention decode over a paged latent KV cache (Mosaic GPU, sm_90).

Dimension letters: B batch, T query tokens per sequence (s_q), H heads, R = T*H query rows,
P pages, S cached tokens, L latent width 512, K key width 576 = 512 latent + 64 rope.

The absorbed form (DeepSeek-V2 §2.1.2): with q_lat = q_nope·W_UK folded into the query, every head
attends over the same 576-wide cached latents, and V is the first 512 columns of the same rows.
So one KV page tile in shared memory serves Q·Kᵀ (576 wide) and P·V (512 wide), and the kernel is a
flash-decoding loop over pages.

This package: this file is the public face (`mla_decode`, what it serves (`mla_decode_problems`), the choice
of body); `reference` its argument checks and the plain-jnp references; `config` the tuning knobs and limits,
`schedule` how pages are dealt to CTAs and where partial results go, `steps` the per-page softmax and
P·V steps every body shares, `bf16` and `scorer` the bodies over bf16 pages, `fp8` those over fp8 pages,
`combine` the kernel that merges split partials.

* Query rows: the (T, H) pairs of a sequence are packed row-major into R = T·H rows (row = t·H + h)
  and padded to a multiple of 64, the wgmma M tile. A CTA owns one 64-row block, so H=16, T=1 pads
  16 rows to 64, and H=128 uses two CTAs (row blocks) per sequence and KV split. A query made in that layout
  (`QueryRows`, `pallas_kernels.head_matmul.absorbed_query`) is taken as it is, with no pad.
* Split-KV: each sequence's pages are cut into ``num_splits`` contiguous ranges so that
  B·row_blocks·num_splits fills about one wave of the GPU's SMs. With one split, the kernel
  writes the final bf16 output and natural-log LSE itself. With more, it writes fp32 partials and a
  second, small Mosaic GPU kernel combines them (still a single jitted call; no XLA math).
* Pieces (`MlaDecodeConfig.schedule="pieces"`): each sequence cut into pieces of at most N pages (N from
  the lengths: a CTA's share of the batch's pages over ``pieces_per_share``), one piece a CTA, no piece
  crossing a sequence, so every CTA runs the per-sequence body; the CTAs are launched longest piece first and
  the GPU's block scheduler hands each free SM the next (`piece_schedule`); the combine merges each
  sequence's pieces.
* Warp specialisation: warpgroup 2 streams pages through the block table with TMA
  (two 73.7 KB stages; with Q resident that is 221 KB of the 227 KB of SMEM); warpgroups 0 and 1
  each own 256 of the 512 output columns (a 64x512 fp32 accumulator in one warpgroup spills).
  Per page, S = Q·Kᵀ, an online softmax in fp32 in the exp2 domain, then O += P·V with P (bf16)
  from registers. Two bodies: the plain one has both warpgroups compute all of S (redundant
  tensor work, no synchronisation); the split-QK one has each compute S for 32 of the 64 tokens
  and exchange row maxima, P halves and row sums through SMEM (two CTA barriers per page).
  `MlaDecodeConfig.split_qk` picks; by default split-QK when all 64 rows of a CTA are real.
* The scorer body (`_decode_partials_scorer`, the default on bf16 pages, per sequence split or
  piece): four warpgroups with loops of their own. The TMA one streams the pages; warpgroup 0
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

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend
from pallas_kernels.mla_decode.bf16 import _decode_partials
from pallas_kernels.mla_decode.combine import _combine
from pallas_kernels.mla_decode.config import (
    KERNEL_FORMATS,
    KEY_DIM,
    LATENT_DIM,
    MAX_QUERY_LEN,
    PAGE_SIZE,
    RAGGED_SPREAD,
    ROWS,
    SCHEDULES,
    SUPPORTED_HEADS,
    MlaDecodeConfig,
    checked_config,
)
from pallas_kernels.mla_decode.fp8 import NARROW_ROWS, _decode_partials_fp8, _decode_partials_fp8_t, _use_transposed_fp8
from pallas_kernels.mla_decode.fp8_math import quantize_query_rows
from pallas_kernels.mla_decode.reference import (
    QueryRows,
    _validate,
    mla_decode_fp8_math_reference,
    mla_decode_reference,
)
from pallas_kernels.mla_decode.schedule import (
    AutoSchedule,
    PieceSchedule,
    branch_configs,
    host_config,
    num_piece_rows,
    piece_schedule,
    plan,
    prefers_pieces,
)
from pallas_kernels.mla_decode.scorer import SCORER_MEMORY_REGISTERS, _decode_partials_scorer
from pallas_kernels.page_format import PageFormat

__all__ = [
    "KERNEL_FORMATS",
    "KEY_DIM",
    "LATENT_DIM",
    "MAX_QUERY_LEN",
    "NARROW_ROWS",
    "PAGE_SIZE",
    "RAGGED_SPREAD",
    "ROWS",
    "SCHEDULES",
    "SCHEDULE_SCOPE",
    "SCORER_MEMORY_REGISTERS",
    "SUPPORTED_HEADS",
    "AutoSchedule",
    "SplitPartials",
    "MlaDecodeConfig",
    "PieceSchedule",
    "branch_configs",
    "host_config",
    "mla_decode",
    "mla_decode_fp8_math_reference",
    "mla_decode_problems",
    "mla_decode_reference",
    "mla_decode_schedule",
    "num_piece_rows",
    "piece_schedule",
    "plan",
    "prefers_pieces",
    "quantize_query_rows",
    "QueryRows",
]


# ------------------------------------------------------------------------------------------------
# What the kernel serves
# ------------------------------------------------------------------------------------------------


def mla_decode_problems(heads: int, page_size: int, page_format: PageFormat, query_len: int = 1) -> list[str]:
    """Why the decode kernel cannot serve these inputs: [] when it can, else one line per broken limit.

    Args:
      heads: query heads of one call (H of q; per device under tensor parallelism).
      page_size: tokens a cache page.
      page_format: the pages' `PageFormat` (its latent and rope widths included).
      query_len: s_q, the query tokens a sequence has in the call.

    The limits: H in `SUPPORTED_HEADS`, `PAGE_SIZE`-token pages, tokens of `LATENT_DIM` latent + 64 rope
    values in a format of `KERNEL_FORMATS`, s_q <= `MAX_QUERY_LEN`. The reference serves every one of them.
    """
    if not isinstance(page_format, PageFormat):
        raise ValueError(f"page_format must be a PageFormat, got {page_format!r}")
    problems = []
    if heads not in SUPPORTED_HEADS:
        problems.append(f"heads = {heads!r} (the decode kernel supports H in {SUPPORTED_HEADS})")
    if page_size != PAGE_SIZE:
        problems.append(f"page_size = {page_size!r} (the decode kernel reads {PAGE_SIZE}-token pages)")
    if (page_format.latent_dim, page_format.rope_dim) != (LATENT_DIM, KEY_DIM - LATENT_DIM):
        problems.append(
            f"{page_format.latent_dim} latent + {page_format.rope_dim} rope values a token (the decode kernel "
            f"reads {LATENT_DIM} + {KEY_DIM - LATENT_DIM})"
        )
    if page_format.name not in KERNEL_FORMATS:
        problems.append(f"page format {page_format.name} (the decode kernel reads {', '.join(KERNEL_FORMATS)} pages)")
    if not 1 <= query_len <= MAX_QUERY_LEN:
        problems.append(f"s_q = {query_len} (the decode kernel takes 1 to {MAX_QUERY_LEN} query tokens a sequence)")
    return problems


# ------------------------------------------------------------------------------------------------
# The kernel: the choice of body, then its launch (and the combine)
# ------------------------------------------------------------------------------------------------


def _body(page_format: PageFormat, plan_, s_q: int, heads: int, config: MlaDecodeConfig):
    """The partials function that serves these pages, query rows and config."""
    if page_format.name == "fp8":
        if _use_transposed_fp8(s_q, heads, config):
            return _decode_partials_fp8_t
        return _decode_partials_fp8
    if plan_.scorer:
        return _decode_partials_scorer
    return _decode_partials


# What the interpreter runs the kernels with (a test swaps in race detection).
INTERPRET_PARAMS = plgpu.InterpretGPUParams()

SCHEDULE_SCOPE = "mla_decode_schedule"  # the name scope of the schedule's ops (a test finds where they run)


def _schedule_for(seq_lens, plan_, config: MlaDecodeConfig) -> PieceSchedule:
    with jax.named_scope(SCHEDULE_SCOPE):
        return piece_schedule(seq_lens, row_blocks=plan_.row_blocks, config=config)


def mla_decode_schedule(seq_lens, *, heads: int, query_len: int = 1, config: MlaDecodeConfig | None = None):
    """The work plan `mla_decode(..., config=config, schedule=...)` takes for these lengths: a `PieceSchedule`
    when ``config.schedule`` is "pieces", an `AutoSchedule` (the pieces plan and the rule's choice) for "auto",
    else None (the per-sequence schedule has nothing to plan on the device).

    It depends on the lengths, the heads, s_q and the config only, so a forward pass builds it once and
    hands it to every layer's call (`mla_jax.kv_cache.KVCache.decode_plan`) instead of each layer
    building its own. ``seq_lens`` is int32 [B], what `mla_decode` gets (cached tokens, the s_q new ones
    included); ``heads`` and ``query_len`` are q's H and s_q.
    """
    config = checked_config(config)
    if config.schedule == "per_sequence":
        return None
    if seq_lens.ndim != 1 or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be int32 [B], got {seq_lens.dtype} {seq_lens.shape}")
    if config.schedule == "auto":
        pieces = branch_configs(config)[1]
        sched = _schedule_for(seq_lens, plan(seq_lens.shape[0], query_len, heads, 1, pieces), pieces)
        with jax.named_scope(SCHEDULE_SCOPE):
            return AutoSchedule(sched, prefers_pieces(seq_lens))
    plan_ = plan(seq_lens.shape[0], query_len, heads, 1, config)
    return _schedule_for(seq_lens, plan_, config)


def _check_schedule(schedule, B: int, s_q: int, H: int, config: MlaDecodeConfig) -> None:
    """A work plan handed to `mla_decode` fits this call: the config's schedule, B sequences, its CTAs."""
    if config.schedule == "auto":
        if not isinstance(schedule, AutoSchedule):
            raise ValueError(f"schedule must be an AutoSchedule (mla_decode_schedule), got {type(schedule).__name__}")
        if schedule.use_pieces.shape != () or schedule.use_pieces.dtype != jnp.bool_:
            raise ValueError(
                f"schedule.use_pieces must be a bool scalar, got {schedule.use_pieces.dtype} "
                f"{schedule.use_pieces.shape}"
            )
        return _check_schedule(schedule.pieces, B, s_q, H, branch_configs(config)[1])
    if config.schedule != "pieces":
        raise ValueError(f"schedule= is a device plan's; config.schedule is {config.schedule!r}, which has none")
    if not isinstance(schedule, PieceSchedule):
        raise ValueError(f"schedule must be a PieceSchedule (mla_decode_schedule), got {type(schedule).__name__}")
    ctas = plan(B, s_q, H, 1, config).num_ctas
    want = {"pieces": (ctas, 4), "piece_start": (B,), "num_pieces": (B,)}
    for name, shape in want.items():
        got = getattr(schedule, name)
        if got.shape != shape or got.dtype != jnp.int32:
            raise ValueError(
                f"schedule.{name} is {got.dtype} {got.shape}; B={B}, s_q={s_q}, H={H} and this config need int32 "
                f"{shape} (build it with mla_decode_schedule)"
            )


@dataclasses.dataclass(frozen=True)
class SplitPartials:
    """A decode call's output before its split combine (`mla_decode(..., split_partials=True)`): each KV split's
    output and log-sum-exp, for a consumer that merges them as it loads them (`stacked_head_matmul`'s W_UV at one
    row: the combine's launch then goes). o: f32 [B, S, Rp, 512], lse: f32 [B, S, Rp] (base 2) for S splits, the
    query rows r = t·H + h padded to Rp; empty splits carry lse = -inf and o = 0. `combined()` merges them as the
    call would have (the combine kernel) -> [B, s_q, H, 512] in `dtype`; `shape` is that array's."""

    o: jax.Array
    lse: jax.Array
    s_q: int
    heads: int
    dtype: object
    config: MlaDecodeConfig
    interpret: object = None

    @property
    def shape(self) -> tuple:
        return (self.o.shape[0], self.s_q, self.heads, LATENT_DIM)

    def astype(self, dtype) -> "SplitPartials":
        """The same partials, merged into `dtype`."""
        return dataclasses.replace(self, dtype=jnp.dtype(dtype))

    def reshape(self, *shape) -> "SplitPartials":
        """The same partials (their rows are B·s_q, H heads of 512 columns whatever the view asked)."""
        if math.prod(shape[0] if len(shape) == 1 else shape) != math.prod(self.shape):
            raise ValueError(f"cannot view split partials of {self.shape} as {shape}")
        return self

    def combined(self) -> jax.Array:
        out, lse = _merged(self.o, self.lse, self.shape[:3], self.dtype, self.config, self.interpret)
        return _finish(out, lse, self.shape[:3], self.lse.shape[-1], transposed=False)[0]


jax.tree_util.register_dataclass(
    SplitPartials, data_fields=["o", "lse"], meta_fields=["s_q", "heads", "dtype", "config", "interpret"]
)


def _merged(out, lse, BsH, dtype, config, interpret, pieces=None, transposed=False):
    """The combine kernel over split (or piece) partials -> (out [B, R or Rp, 512] in `dtype` ([B, 512, R]
    transposed), lse [B, Rp], ln): the kernel's rows, which `_finish` trims and shapes."""
    B, s_q, H = BsH
    R, Rp = s_q * H, lse.shape[-1]
    trim = not transposed and Rp == ROWS and R < Rp and R % 8 == 0  # the combine writes the real rows only
    kw = dict(config=config, interpret=interpret, pieces=pieces, transposed=transposed)
    return _combine(out, lse, out_dtype=dtype, rows_out=R if trim else None, **kw)


def _finish(out, lse, BsH, Rp, transposed):
    """The kernel's (merged) rows -> out [B, s_q, H, 512], lse [B, s_q, H]: the real R = s_q·H of Rp rows."""
    B, s_q, H = BsH
    R = s_q * H
    if transposed:
        out = jnp.swapaxes(out, 1, 2)
    elif Rp != R:
        out, lse = out[:, :R], lse[:, :R]
    return out.reshape(B, s_q, H, LATENT_DIM), lse.reshape(B, s_q, H)


@functools.partial(
    jax.jit, static_argnames=("softmax_scale", "causal", "page_format", "config", "interpret", "split_partials")
)
def _mla_decode_kernel(
    q,
    kv_pages,
    block_table,
    seq_lens,
    schedule,
    *,
    softmax_scale,
    causal,
    page_format,
    config,
    interpret,
    split_partials=False,
    page_offset=None,
):
    B, s_q, H, _ = q.shape
    if page_offset is None:
        page_offset = jnp.zeros((1,), jnp.int32)
    if config.schedule == "auto":  # both programs, one taken by the rule (`prefers_pieces`)
        per_sequence, pieces = branch_configs(config)
        if schedule is None:
            schedule = mla_decode_schedule(seq_lens, heads=H, query_len=s_q, config=config)
        run = functools.partial(
            _mla_decode_kernel,
            q,
            kv_pages,
            block_table,
            seq_lens,
            softmax_scale=softmax_scale,
            causal=causal,
            page_format=page_format,
            interpret=interpret,
            page_offset=page_offset,
        )
        return lax.cond(
            schedule.use_pieces,
            lambda: run(schedule.pieces, config=pieces),
            lambda: run(None, config=per_sequence),
        )
    R = s_q * H
    plan_ = plan(B, s_q, H, block_table.shape[1], config)
    Rp = plan_.row_blocks * ROWS
    q_rows = q.rows if isinstance(q, QueryRows) else q.reshape(B, R, KEY_DIM)  # (B, R or Rp, K), row = t*H + h
    # TMA needs 16-byte GMEM strides: pad the table to a multiple of 4 int32 columns. The kernel
    # never reads past cdiv(seq_len, 64) pages, so the padding value is irrelevant.
    pad = -block_table.shape[1] % 4
    if pad:
        block_table = jnp.pad(block_table, ((0, 0), (0, pad)))
    interpret_params = INTERPRET_PARAMS if interpret else None
    partials = _body(page_format, plan_, s_q, H, config)
    body_args = dict(  # what every body takes besides the arrays
        s_q=s_q,
        heads=H,
        causal=causal,
        scale=float(softmax_scale),
        plan_=plan_,
        config=config,
        interpret=interpret_params,
    )
    sched = None
    if plan_.planned:
        sched = schedule if schedule is not None else _schedule_for(seq_lens, plan_, config)
        body_args["schedule"] = sched.kernel_refs
    # The transposed fp8 body takes the R rows as they are and returns oᵀ ([..., 512, R]); the others take
    # whole 64-row blocks.
    transposed = partials is _decode_partials_fp8_t
    if transposed and isinstance(q, QueryRows):
        q_rows = q_rows[:, :R]
    elif Rp != R and not transposed and not isinstance(q, QueryRows):
        q_rows = jnp.pad(q_rows, ((0, 0), (0, Rp - R), (0, 0)))
    out, lse = partials(q_rows, kv_pages, block_table, seq_lens, page_offset, **body_args)
    if split_partials and not plan_.planned and plan_.num_splits > 1 and not transposed:
        return SplitPartials(out, lse, s_q, H, q.dtype, config, interpret_params)
    if plan_.planned or plan_.num_splits > 1:  # fp32 partials (by split or by piece slot) to merge
        pieces = (sched.piece_start, sched.num_pieces) if plan_.planned else None
        out, lse = _merged(out, lse, (B, s_q, H), q.dtype, config, interpret_params, pieces, transposed)
    return _finish(out, lse, (B, s_q, H), Rp, transposed)


def mla_decode(
    q,
    kv_pages,
    block_table,
    seq_lens,
    *,
    softmax_scale,
    causal=False,
    page_format=None,
    config=None,
    impl="auto",
    checked=False,
    schedule=None,
    split_partials=False,
    page_offset=0,
):
    """Absorbed MLA decode attention over a paged latent cache.

    Args:
      q: bf16 [B, s_q, H, 576]: absorbed latent query (512) ; rope query (64), or that query as `QueryRows`
        (already padded to the kernel's rows). The kernel takes H in `SUPPORTED_HEADS` and s_q in [1, 4]; the
        reference any.
      kv_pages: [num_pages, page_size, W]: one layer's cache pages, rows = tokens. bf16 pages are
        [num_pages, 64, 576]: normalised latent (512) ; roped key (64), and V is the first 512 columns of
        the same rows. fp8 pages are uint8 [num_pages, 64, 656] (`pallas_kernels.page_format`: 512 e4m3
        bytes, 4 fp32 scales, 64 bf16 rope values a token), dequantised to bf16 inside the kernel.
      block_table: int32 [B, max_pages]: page ids of each sequence in token order. Entries past
        cdiv(seq_len, page_size) are never read (may be anything); the ones before must be page ids in
        [0, num_pages).
      seq_lens: int32 [B]: cached tokens per sequence, including the s_q new ones, in
        [0, page_size * max_pages] (0: an idle row, out = 0, lse = -inf). When causal, a query with no
        visible key (seq_len < s_q) returns out = 0, lse = -inf.
      softmax_scale: Python float multiplying Q·Kᵀ (e.g. 192**-0.5 * mscale**2).
      causal: query j of s_q sits at position seq_len - s_q + j and sees keys <= that position;
        non-causal queries see all seq_len keys.
      page_format: the pages' `PageFormat`, checked against their dtype and width; None reads it from
        them (`pallas_kernels.page_format_of`), as `paged_gather` does.
      config: `MlaDecodeConfig` (static); None = defaults.
      impl: one of `pallas_kernels.backend.IMPLS`: "auto" (the kernel on a Hopper GPU where it serves the
        inputs, `mla_decode_problems`; else the reference), "kernel", "interpret" or "reference".
      checked: also check traced block tables and lengths, with `jax.experimental.checkify`
        (the caller wraps the jitted function in `checkify.checkify`; see `_page_table`).
        Concrete ones are always checked.
      schedule: with ``config.schedule`` "pieces" or "auto", the work plan `mla_decode_schedule`
        built for these ``seq_lens`` (so the layers of a step share one); None builds it here. It must be the
        plan of these lengths: a plan of other lengths reads the wrong pages.
      split_partials: where the kernel would merge its KV splits' partials in a launch of its own (the
        per-sequence schedule at more than one split, bf16 pages or the fp8 row-block body), return them unmerged
        as (`SplitPartials`, None), for a consumer that merges them as it loads them; elsewhere (out, lse) as
        without.
      page_offset: an int32 scalar (traced or not) added to every block-table entry read: a table of one pool's
        page ids over ``kv_pages`` holding several pools back to back (`KVCache.map_pages`: every layer's pages,
        the layer's first page at layer * N). The kernel adds it as it reads the table (no launch to offset it).

    Returns:
      out: [B, s_q, H, 512] in q's dtype (bf16); lse: float32 [B, s_q, H], natural log of the
      softmax denominator (scaled scores).

    Raises:
      ValueError naming the argument and the limit: shapes or dtypes that disagree, pages that are in no
      format or not in ``page_format``, "kernel" / "interpret" on inputs the kernel does not serve
      (`mla_decode_problems`), a concrete seq_len outside [0, page_size * max_pages] or a concrete
      block-table entry it reads outside [0, num_pages).
    """
    fmt = _validate(
        q, kv_pages, block_table, seq_lens, softmax_scale, page_format, checked=checked, page_offset=page_offset
    )
    config = checked_config(config)
    B, s_q, H, _ = q.shape
    if isinstance(q, QueryRows) and q.rows.shape[1] != QueryRows.padded(s_q, H):
        raise ValueError(f"QueryRows of s_q={s_q}, H={H} need {QueryRows.padded(s_q, H)} rows, got {q.rows.shape[1]}")
    if schedule is not None:
        _check_schedule(schedule, B, s_q, H, config)
    impl = backend.choose(impl, mla_decode_problems(H, kv_pages.shape[1], fmt, s_q))
    if impl == "reference":
        return mla_decode_reference(
            q,
            kv_pages,
            block_table,
            seq_lens,
            softmax_scale=softmax_scale,
            causal=causal,
            page_format=fmt,
            checked=checked,
            page_offset=page_offset,
        )
    interpret = impl == "interpret"
    if interpret and not config.interpretable:
        config = dataclasses.replace(config, interpretable=True)
    out = _mla_decode_kernel(
        q,
        kv_pages,
        block_table,
        seq_lens,
        schedule,
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        page_format=fmt,
        config=config,
        interpret=interpret,
        split_partials=bool(split_partials),
        page_offset=jnp.asarray(page_offset, jnp.int32).reshape(1),
    )
    if isinstance(out, SplitPartials):
        return out, None
    return out
