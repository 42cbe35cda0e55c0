"""How `mla_decode` deals pages to CTAs: the static launch plan (row blocks, KV splits, which body), the
pieces schedule computed on the device from the lengths, the "auto" rule between it and the per-sequence one,
the shapes of the partial outputs, and the page walk each body runs (`_schedule_steps`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.mla_decode.config import LATENT_DIM, PAGE_SIZE, RAGGED_SPREAD, ROWS, MlaDecodeConfig
from pallas_kernels.mla_decode.steps import _LN2, _init_carry, _normalise


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static launch geometry derived from the shapes and the config."""

    row_blocks: int  # G: 64-row query blocks per sequence
    num_splits: int  # KV splits per sequence (after dropping splits that are always empty)
    pages_per_split: int
    split_qk: bool  # the Q·Kᵀ-split body (see MlaDecodeConfig.split_qk)
    schedule: str = "per_sequence"
    num_ctas: int = 0  # pieces: piece rows (`num_piece_rows`); else 0
    scorer: bool = False  # the scorer body (see MlaDecodeConfig.scorer; bf16 pages only)

    @property
    def planned(self) -> bool:
        """The main kernel reads a plan built on the device (a `PieceSchedule`), writes fp32 partials by slot and
        is always followed by the combine."""
        return self.schedule == "pieces"


def plan(batch: int, s_q: int, heads: int, max_pages: int, config: MlaDecodeConfig) -> _Plan:
    """The launch geometry `mla_decode` uses for these shapes (exposed for the benchmark); for the "auto"
    schedule its per-sequence branch's (`branch_configs`)."""
    if config.schedule == "auto":
        config = branch_configs(config)[0]
    row_blocks = pl.cdiv(s_q * heads, ROWS)
    if config.num_splits is not None:
        splits = config.num_splits
    else:
        splits = max(1, config.target_ctas // (batch * row_blocks))
        splits = min(splits, max(1, max_pages // config.min_pages_per_split), config.max_splits)
    splits = max(1, min(splits, max_pages))
    pages_per_split = pl.cdiv(max_pages, splits)
    split_qk = config.split_qk if config.split_qk is not None else s_q * heads >= ROWS
    scorer = config.scorer is None or config.scorer  # the scorer body unless asked otherwise
    split_qk = split_qk and not scorer
    if config.schedule == "pieces":
        rows = num_piece_rows(batch, row_blocks, config)
        return _Plan(row_blocks, 1, pages_per_split, split_qk, "pieces", rows, scorer)
    return _Plan(row_blocks, pl.cdiv(max_pages, pages_per_split), pages_per_split, split_qk, scorer=scorer)


def branch_configs(config: MlaDecodeConfig) -> tuple[MlaDecodeConfig, MlaDecodeConfig]:
    """The "auto" schedule's two programs: (the per-sequence config, the pieces config), the other knobs kept."""
    per_sequence = dataclasses.replace(config, schedule="per_sequence")
    return per_sequence, dataclasses.replace(per_sequence, schedule="pieces")


def prefers_pieces(seq_lens):
    """bool [] (of numpy lengths a numpy bool, on the host; else a jax one): the "auto" schedule's rule. The
    pieces schedule when the longest sequence holds more than `RAGGED_SPREAD` x the mean pages (idle rows,
    length 0, counted: the per-sequence schedule gives their CTAs nothing to do); else the per-sequence one.
    Equal lengths and a single sequence never take it. Ragged lengths (max / mean ~ 1.9-2) run faster in
    pieces, equal lengths slower (each piece pays its Q load, a partial write and the combine); the threshold
    lies between the measured cells (docs/PERFORMANCE.md, "Decode kernel beside FlashMLA and vLLM's Triton kernel")."""
    xp = np if isinstance(seq_lens, np.ndarray) else jnp
    pages = (seq_lens.astype(xp.int64 if xp is np else xp.int32) + PAGE_SIZE - 1) // PAGE_SIZE
    return xp.max(pages).astype(xp.float32) * pages.shape[0] > RAGGED_SPREAD * xp.sum(pages).astype(xp.float32)


def host_config(config: MlaDecodeConfig, seq_lens: np.ndarray | None) -> MlaDecodeConfig:
    """The program a caller that knows its lengths on the host runs: for ``schedule="auto"`` the branch
    `prefers_pieces` picks from ``seq_lens`` (numpy: no device work, no conditional in the compiled call; each
    branch compiles once, when first taken), the per-sequence one for ``seq_lens`` None (a call that does not
    decode: one program, whatever its lengths); any other config as it is."""
    if config.schedule != "auto":
        return config
    per_sequence, pieces = branch_configs(config)
    return pieces if seq_lens is not None and prefers_pieces(np.asarray(seq_lens)) else per_sequence


class PieceSchedule(NamedTuple):
    """The "pieces" schedule's plan (`piece_schedule`); every field int32.

    Sequence b's cdiv(seq_lens[b], 64) pages are cut into num_pieces[b] pieces of N pages (the last one
    shorter; N the same for the whole batch); piece k of b reads pages [k·N, k·N + its pages) and writes the
    partial slot piece_start[b] + k, so a sequence's pieces are contiguous slots in key order. Row c of
    ``pieces`` is what CTA c (per row block, in launch order) runs: (b, first page, pages, slot), the longest
    pieces first; rows past the batch's pieces have 0 pages (the CTA writes nothing).
    """

    pieces: jax.Array  # [W, 4], W = `num_piece_rows`
    piece_start: jax.Array  # [B]: slot of sequence b's first piece
    num_pieces: jax.Array  # [B]: 0 for an empty sequence

    @property
    def kernel_refs(self) -> tuple:
        """What a main kernel reads of the schedule (the combine reads `piece_start` and `num_pieces`)."""
        return (self.pieces,)


def num_piece_rows(batch: int, row_blocks: int, config: MlaDecodeConfig) -> int:
    """W, the static bound of a batch's pieces (`piece_schedule`): with N >= the pages of a CTA's share over
    k = ``pieces_per_share``, the pieces of the whole pages number at most k·target_ctas / row_blocks, and every
    sequence adds at most one short piece."""
    return config.pieces_per_share * pl.cdiv(config.target_ctas, row_blocks) + batch


def piece_schedule(seq_lens, *, row_blocks: int, config: MlaDecodeConfig) -> PieceSchedule:
    """The "pieces" schedule's plan, on the device (jit-friendly: static shapes, O(W·B) vector work and one
    sort of W values).

    Args:
      seq_lens: int32 [B] (0 allowed: an idle row gets no piece).
      row_blocks: 64-row query blocks a sequence (each piece runs on that many CTAs).
      config: its ``target_ctas``, ``pieces_per_share``, ``min_pages_per_split`` and ``min_piece_pages`` set N.

    A CTA's share is L = cdiv(total pages x row_blocks, target_ctas) pages; pieces are N = max(
    ``min_pages_per_split``, cdiv(L, ``pieces_per_share``), min(L, ``min_piece_pages``)) pages. Launched longest
    first, the GPU's block scheduler gives each free SM the longest piece left (longest-processing-time-first): the
    whole-N pieces fill the SMs, the sequences' short last pieces fill the gaps.
    """
    B = seq_lens.shape[0]
    W = num_piece_rows(B, row_blocks, config)
    pages = (seq_lens.astype(jnp.int32) + PAGE_SIZE - 1) // PAGE_SIZE  # [B]
    total = jnp.sum(pages)
    share = (total * row_blocks + config.target_ctas - 1) // config.target_ctas
    k = config.pieces_per_share
    n = jnp.maximum(
        jnp.maximum((share + k - 1) // k, config.min_pages_per_split), jnp.minimum(share, config.min_piece_pages)
    )
    num_pieces = (pages + n - 1) // n
    piece_end = jnp.cumsum(num_pieces).astype(jnp.int32)  # inclusive
    piece_start = piece_end - num_pieces
    j = jnp.arange(W, dtype=jnp.int32)  # a piece's slot
    b = jnp.minimum((piece_end[None, :] <= j[:, None]).sum(1, dtype=jnp.int32), B - 1)
    first = (j - piece_start[b]) * n
    size = jnp.where(j < piece_end[-1], jnp.minimum(n, pages[b] - first), 0)
    order = jnp.argsort(-size, stable=True)
    pieces = jnp.stack([b[order], first[order], size[order], j[order]], 1).astype(jnp.int32)
    return PieceSchedule(pieces, piece_start.astype(jnp.int32), num_pieces.astype(jnp.int32))


class AutoSchedule(NamedTuple):
    """The "auto" schedule's plan of a call: the pieces schedule's plan, and whether the call takes it
    (`prefers_pieces`)."""

    pieces: PieceSchedule
    use_pieces: jax.Array  # bool []


def _partials_out_type(B, S, Rp, dtype):
    """Outputs of a main kernel: with one split the final (out [B, Rp, 512] in q's dtype, lse
    [B, Rp] f32, natural log); with several, fp32 partials (o [B, S, Rp, 512], lse [B, S, Rp] in
    log2) for `_combine`."""
    if S == 1:
        return (jax.ShapeDtypeStruct((B, Rp, LATENT_DIM), dtype), jax.ShapeDtypeStruct((B, Rp), jnp.float32))
    return (jax.ShapeDtypeStruct((B, S, Rp, LATENT_DIM), jnp.float32), jax.ShapeDtypeStruct((B, S, Rp), jnp.float32))


def _main_out_geometry(B, Rp, plan_: _Plan, dtype):
    """(out_type, grid, grid_names) of a main kernel. per_sequence: `_partials_out_type` over the grid
    (split s, batch b, row block g). pieces: fp32 partials by piece slot (o [NS, Rp, 512], lse [NS, Rp] in
    log2, NS = `num_piece_rows`; slots no piece takes are never written) over the grid (CTA c, row block g).

    The row block is the grid's last axis, which the GPU launches fastest: the CTAs of one sequence's row blocks
    (H = 128, or s_q x H over 64) start together and read the same pages at the same time, so every page after the
    first CTA's read comes from L2. With the row block first they ran a wave apart and each read its pages from
    memory again: twice the bytes at H = 128."""
    if plan_.planned:
        NS = plan_.num_ctas
        return (
            (jax.ShapeDtypeStruct((NS, Rp, LATENT_DIM), jnp.float32), jax.ShapeDtypeStruct((NS, Rp), jnp.float32)),
            (plan_.num_ctas, plan_.row_blocks),
            ("c", "g"),
        )
    return (
        _partials_out_type(B, plan_.num_splits, Rp, dtype),
        (plan_.num_splits, B, plan_.row_blocks),
        ("s", "b", "g"),
    )


def _split_pages(seq_len, first_page, pages_per_split):
    """Pages a split starting at page ``first_page`` of a sequence of seq_len tokens reads (0 for
    a split past the sequence's end)."""
    return jnp.clip(pl.cdiv(seq_len, PAGE_SIZE) - first_page, 0, pages_per_split)


class _At(NamedTuple):
    """Where a pipeline step is: sequence b, first key of the page, seq_len."""

    b: jax.Array
    page_start: jax.Array
    seq_len: jax.Array


class _Steps(NamedTuple):
    """What a main kernel's page pipeline takes from its schedule (`_schedule_steps`)."""

    n_steps: jax.Array  # pages this CTA reads (its pipeline's dynamic grid)
    page_of: object  # step i -> physical page id (the TMA's index map)
    begin: object  # (i, carry) -> ((acc, m, l), _At): the body's first call
    compute_context: object  # the pipeline's compute context


def _schedule_steps(
    plan_: _Plan,
    *,
    q_ref,
    o_ref,
    lse_ref,
    bt_ref,
    lens_ref,
    off_ref,
    q_smem,
    q_bar,
    rows,
    cols,
    final,
    sched_refs=None,
) -> _Steps:
    """The schedule's side of a main kernel (either body, either page format).

    per_sequence: CTA (g, s, b) reads split s of sequence b; Q is loaded once; the context writes
    the result (final or the split's partial) after the pipeline. pieces (``sched_refs`` = a `PieceSchedule`'s
    `kernel_refs`): CTA (g, c) reads the piece of row c the same way and writes its partial to the row's slot.
    Page ids are the table's entries plus ``off_ref[0]`` (`mla_decode`'s page_offset).
    """
    wg = lax.axis_index("wg")
    if plan_.schedule == "pieces":  # one piece of one sequence: the per-sequence walk over a table row
        (piece_ref,) = sched_refs
        c = lax.axis_index("c")
        b, first_page, n_steps, slot = (piece_ref[c, k] for k in range(4))
        out_at = (slot,)
    else:
        pps = plan_.pages_per_split
        s, b = lax.axis_index("s"), lax.axis_index("b")
        first_page = s * pps
        n_steps = None
        out_at = (b,) if final else (b, s)
    seq_len = lens_ref[b]
    if n_steps is None:
        n_steps = _split_pages(seq_len, first_page, pps)
    table = bt_ref.at[b]
    # An empty split still loads Q and writes (the combine reads every split); a piece row with no piece neither.
    live = (n_steps > 0) if plan_.schedule == "pieces" else True

    def compute_context(pipeline):
        @pl.when(live)
        def _():
            @pl.when(wg == 0)
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows], q_smem, q_bar)

            plgpu.barrier_wait(q_bar)  # one completion releases both compute warpgroups

        o, lse2 = _normalise(*pipeline(_init_carry()))

        @pl.when(live)
        def _():
            o_ref[(*out_at, rows, cols)] = o.astype(o_ref.dtype)

            @pl.when(wg == 0)
            def _():
                lse_ref[(*out_at, rows)] = lse2 * _LN2 if final else lse2

    return _Steps(
        n_steps,
        lambda i: table[first_page + i] + off_ref[0],
        lambda i, carry: (carry, _At(b, (first_page + i) * PAGE_SIZE, seq_len)),
        compute_context,
    )
