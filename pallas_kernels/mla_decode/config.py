"""`mla_decode`'s limits and its tuning knobs (`MlaDecodeConfig`, a static argument of the kernel)."""

from __future__ import annotations

import dataclasses

PAGE_SIZE = 64  # tokens per KV page (the TMA box and the wgmma N of Q·Kᵀ)
KEY_DIM = 576  # latent 512 ; rope 64
LATENT_DIM = 512  # V width (first 512 columns of each cached row)
ROWS = 64  # query rows per CTA = wgmma M of one warpgroup
SUPPORTED_HEADS = (16, 32, 64, 128)
MAX_QUERY_LEN = 4
KERNEL_FORMATS = ("bf16", "fp8")  # page formats the kernel has bodies for (`pallas_kernels.page_format.NAMES`)
SCHEDULES = ("per_sequence", "pieces", "auto")
RAGGED_SPREAD = 1.5  # "auto": the pieces schedule when the longest sequence has more pages than this x the mean


@dataclasses.dataclass(frozen=True)
class MlaDecodeConfig:
    """Static tuning knobs of `mla_decode`.

    Attributes:
      num_splits: KV splits per sequence; None picks ``target_ctas // (B * row_blocks)`` capped so
        every split gets at least ``min_pages_per_split`` pages and at most ``max_splits`` splits.
      target_ctas: CTAs the split heuristic aims for (132 = one wave on an H100/H200 SXM).
      min_pages_per_split: lower bound of pages per split for the heuristic (each CTA pays a
        73.7 KB Q load and a partial write, so tiny splits cost more than they hide).
      max_splits: upper bound of the heuristic (the combine reads every split's partial).
      max_concurrent_steps: KV pages in flight per CTA. Each stage is 73.7 KB of SMEM; with Q resident
        only 2 fit.
      memory_registers: registers per thread left to the TMA warpgroup (setmaxnreg) of the plain and
        split-QK bodies (the scorer body's keeps `SCORER_MEMORY_REGISTERS`).
      combine_block_cols: output columns per CTA of the split combine kernel (divides 512).
      split_qk: with ``scorer=False``, each compute warpgroup computes Q·Kᵀ for its own 32 of the
        page's 64 tokens (instead of both computing all 64); the two exchange row maxima, P halves
        (bf16) and row sums through SMEM with two CTA barriers per page. Halves the Q·Kᵀ tensor
        work. None = on when the 64 query rows of a CTA are all real (s_q * H >= 64), where it
        measures faster.
      interpretable: use constructs the Pallas interpreter can run (P staged through SMEM, P·V
        accumulated with ``run_scoped`` instead of ``run_state``); slower, for interpret mode only.
      schedule: how pages are dealt to CTAs. "per_sequence": each CTA takes one split of one
        sequence (``num_splits`` per sequence, the same for all). "pieces": each sequence is cut into
        pieces of at most N pages, N from the lengths on the device (a CTA's share of the batch's pages over
        ``pieces_per_share``, at least ``min_pages_per_split``), one piece a CTA, the CTAs launched longest
        piece first so the GPU's block scheduler deals them out as SMs free up (longest-processing-time
        first); a piece never crosses a sequence, so each CTA runs the per-sequence body on one piece, and
        the combine merges every sequence's pieces; ``num_splits`` and ``max_splits`` do not apply and the
        combine always runs. "auto": per call, the pieces schedule for ragged lengths and the
        per-sequence one otherwise (`prefers_pieces`: the longest sequence holds more than `RAGGED_SPREAD` x
        the mean pages, idle rows counted); a caller holding the lengths on the host picks the program there
        (`host_config`), else both are compiled under a device conditional.
      pieces_per_share: with the "pieces" schedule, the pieces one CTA's share of the work (the batch's pages
        x row blocks over ``target_ctas``) is cut into: 1 gives the fewest partials (each costs a 128 KB
        fp32 write and its read in the combine), more give the scheduler finer pieces to even out.
      min_piece_pages: with the "pieces" schedule, pieces are at least min(this, a share) pages long, so a
        small batch's shares stay whole (each piece pays a Q load and a partial write, about three pages'
        time; small batches in half-share pieces run slower than the per-sequence splits: docs/PERFORMANCE.md,
        "Decode kernel beside FlashMLA and vLLM's Triton kernel").
      fp8_transposed: for fp8 pages, the transposed body (`_decode_partials_fp8_t`: scores as
        Sᵀ = K·Qᵀ with the R = s_q * H query rows as the wgmma N, so no tensor work on padding
        rows, and no barrier around a shared key buffer) instead of the padded 64-row body. It
        serves R <= 32 (H=16 and 32 at s_q=1, H=16 at s_q=2). None = on wherever it serves.
      scorer: for bf16 pages, the scorer body (`_decode_partials_scorer`): one warpgroup computes each
        page's Q·Kᵀ once, the softmax and P·V over 128 columns, two others P·V over 192 columns each, beside
        the TMA warpgroup. None or True = on (the fastest body: docs/PERFORMANCE.md, "Tried and rejected"); False
        picks between the plain and split-QK bodies by ``split_qk``. fp8 pages have bodies of their own.
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
    pieces_per_share: int = 2
    min_piece_pages: int = 16
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
        if self.min_piece_pages < 1:
            raise ValueError(f"min_piece_pages must be >= 1, got {self.min_piece_pages}")
        if not 1 <= self.pieces_per_share <= 64:
            raise ValueError(f"pieces_per_share must be in [1, 64], got {self.pieces_per_share}")
        if self.min_pages_per_split < 1:
            raise ValueError(f"min_pages_per_split must be >= 1, got {self.min_pages_per_split}")
        if self.max_concurrent_steps not in (1, 2):
            raise ValueError(
                f"max_concurrent_steps must be 1 or 2 (73.7 KB of SMEM each), got {self.max_concurrent_steps}"
            )
        if not 24 <= self.memory_registers <= 256 or self.memory_registers % 8:
            raise ValueError(f"memory_registers must be a multiple of 8 in [24, 256], got {self.memory_registers}")
        if self.combine_block_cols not in (64, 128, 256):
            raise ValueError(f"combine_block_cols must be one of 64, 128, 256, got {self.combine_block_cols}")


def checked_config(config, *, name: str = "config") -> MlaDecodeConfig:
    """`config`, or the defaults for None; anything else is a one-line ValueError naming ``name`` (how the
    caller calls the argument)."""
    if config is None:
        return MlaDecodeConfig()
    if not isinstance(config, MlaDecodeConfig):
        raise ValueError(f"{name} must be an MlaDecodeConfig or None, got {type(config).__name__}: {config!r}")
    return config
