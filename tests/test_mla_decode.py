"""Tests of pallas_kernels.mla_decode.

CPU (default): the reference against an independent numpy loop; the kernel in interpret mode
against the reference over the feature list; cross-lowering of every production configuration
for sm_90; input validation. GPU (``-m gpu``, Hopper only): the same equivalence at larger sizes.

Every input has the unused page slots and the tail of each sequence's last page poisoned with NaN,
and block tables are random permutations, so a key or value outside a sequence that reaches the
softmax or P·V shows up as NaN. (A whole page fetched past a sequence and then masked by position
would not: the interpreter does not bounds-check TMA reads. The page ranges are the kernel's own
arithmetic; the GPU tests and the benchmarks' byte counts are what bound them.)
"""

import dataclasses
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import MlaDecodeConfig, backend, mla_decode, mla_decode_reference
from pallas_kernels.mla_decode import (
    AutoSchedule,
    PieceSchedule,
    mla_decode_schedule,
    num_piece_rows,
    piece_schedule,
    plan,
    prefers_pieces,
)
from tests.tiers import full, gpu_full

SCALE = 192**-0.5
# The kernel bodies: plain (both warpgroups score the whole page), split-QK, the scorer body (one
# warpgroup scores, two others accumulate P·V; per_sequence schedule only).
VARIANTS = [dict(scorer=False, split_qk=False), dict(scorer=False, split_qk=True), dict(scorer=True)]
VARIANT_IDS = ["plain", "split_qk", "scorer"]


def make_inputs(batch, s_q, heads, seq_lens, max_pages, *, seed=0, spare_pages=3):
    """Random bf16 inputs with a permuted block table and NaN everywhere a sequence does not own.

    Returns (q [B,s_q,H,576], kv_pages [num_pages,64,576], block_table [B,max_pages], seq_lens [B]).
    """
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + spare_pages
    kv = rng.standard_normal((num_pages, 64, 576), dtype=np.float32)
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    owned = np.zeros(num_pages, bool)
    for b, length in enumerate(seq_lens):
        used = -(-length // 64)
        owned[table[b, :used]] = True
        if length % 64:
            kv[table[b, used - 1], length % 64 :] = np.nan  # tail of the last page
    kv[~owned] = np.nan  # unused slots and spare pages
    q = rng.standard_normal((batch, s_q, heads, 576), dtype=np.float32)
    return (
        jnp.asarray(q, jnp.bfloat16),
        jnp.asarray(kv, jnp.bfloat16),
        jnp.asarray(table),
        jnp.asarray(np.asarray(seq_lens, np.int32)),
    )


def assert_matches_reference(args, *, causal, config=None, impl, keyless_rows=False):
    """``keyless_rows``: the inputs have rows with no visible key (seq_len 0, or causal with
    seq_len < s_q), whose documented lse is -inf: then lse must be -inf exactly there."""
    out, lse = mla_decode(*args, softmax_scale=SCALE, causal=causal, config=config, impl=impl)
    ref_out, ref_lse = mla_decode_reference(*args, softmax_scale=SCALE, causal=causal)
    assert out.shape == ref_out.shape and out.dtype == jnp.bfloat16
    assert lse.shape == ref_lse.shape and lse.dtype == jnp.float32
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    assert np.isfinite(out).all()
    if keyless_rows:
        empty = np.isneginf(np.asarray(ref_lse))
        assert empty.any() and (np.isneginf(np.asarray(lse)) == empty).all()
        assert np.isfinite(np.asarray(lse)[~empty]).all()
    else:
        assert np.isfinite(np.asarray(lse)).all()
    rel = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert rel < 1e-2, f"relative error {rel}"
    chex.assert_trees_all_close(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=1e-3)


# ------------------------------------------------------------------------------------------------
# The reference itself, against a per-query numpy loop written independently.
# ------------------------------------------------------------------------------------------------


def numpy_decode(q, kv_pages, block_table, seq_lens, scale, causal):
    q = np.asarray(q, np.float64)
    kv_pages = np.asarray(kv_pages, np.float64)
    batch, s_q, heads, _ = q.shape
    out = np.zeros((batch, s_q, heads, 512))
    lse = np.zeros((batch, s_q, heads))
    for b in range(batch):
        length = int(seq_lens[b])
        rows = np.concatenate([kv_pages[p] for p in np.asarray(block_table[b])])[:length]
        for t in range(s_q):
            visible = length - s_q + t + 1 if causal else length
            keys = rows[:visible]
            for h in range(heads):
                s = keys @ q[b, t, h] * scale
                w = np.exp(s - s.max())
                out[b, t, h] = w @ keys[:, :512] / w.sum()
                lse[b, t, h] = s.max() + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_numpy_loop(causal):
    args = make_inputs(2, 3, 16, [5, 130], 3, seed=1)
    out, lse = mla_decode_reference(*args, softmax_scale=SCALE, causal=causal)
    want_out, want_lse = numpy_decode(*args, SCALE, causal)
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4, rtol=1e-5)


def test_reference_causal_differs_from_non_causal():
    # Guards the causal mask against being a no-op: with s_q > 1 the early queries see fewer keys.
    args = make_inputs(1, 2, 16, [70], 2, seed=2)
    causal_out, _ = mla_decode_reference(*args, softmax_scale=SCALE, causal=True)
    full_out, _ = mla_decode_reference(*args, softmax_scale=SCALE, causal=False)
    assert not np.allclose(np.asarray(causal_out[:, 0], np.float32), np.asarray(full_out[:, 0], np.float32))
    np.testing.assert_array_equal(np.asarray(causal_out[:, 1]), np.asarray(full_out[:, 1]))


# ------------------------------------------------------------------------------------------------
# Interpret mode (CPU): the kernel's own code path, with P staged through SMEM.
# ------------------------------------------------------------------------------------------------

# (heads, s_q, causal, seq_lens, max_pages, num_splits): small enough for the interpreter.
INTERPRET_CASES = [
    (16, 1, False, [1, 63], 1, None),  # length 1; a tail inside the only page
    (16, 4, True, [4, 129], 3, 2),  # 4x16 rows fill exactly one block; causal
    (32, 3, True, [65, 130], 3, 2),  # 96 rows pad to two blocks; page boundaries
    (32, 1, False, [64, 1], 2, 3),  # exact page; two empty splits for length 1
    (64, 2, True, [3, 200], 4, 4),  # empty splits; ragged
    (64, 1, False, [128], 2, 1),  # one split: final output from the main kernel
    (128, 1, False, [100, 7], 2, 2),  # two row blocks per sequence
    (128, 2, True, [66], 2, None),  # four row blocks, causal
]


# The plain body (not the default on bf16 pages): one case by default, every case under --full.
@pytest.mark.parametrize(
    "heads,s_q,causal,seq_lens,max_pages,num_splits",
    full(INTERPRET_CASES, [INTERPRET_CASES[2]], "the scorer body (the default) runs these cases"),
)
def test_interpret_matches_reference(heads, s_q, causal, seq_lens, max_pages, num_splits):
    args = make_inputs(len(seq_lens), s_q, heads, seq_lens, max_pages, seed=heads + s_q)
    config = MlaDecodeConfig(num_splits=num_splits, min_pages_per_split=1, scorer=False, split_qk=False)
    assert_matches_reference(args, causal=causal, config=config, impl="interpret")


# The split-QK variant (two rendezvous barriers per page) over a subset of the cases.
@pytest.mark.parametrize(
    "heads,s_q,causal,seq_lens,max_pages,num_splits",
    full([INTERPRET_CASES[i] for i in (1, 3, 4, 6)], [INTERPRET_CASES[1]], "one split-QK case; the scorer's"),
)
def test_interpret_split_qk_matches_reference(heads, s_q, causal, seq_lens, max_pages, num_splits):
    args = make_inputs(len(seq_lens), s_q, heads, seq_lens, max_pages, seed=heads + s_q + 1)
    config = MlaDecodeConfig(num_splits=num_splits, min_pages_per_split=1, scorer=False, split_qk=True)
    assert_matches_reference(args, causal=causal, config=config, impl="interpret")


# The scorer body (one warpgroup scores each page and accumulates P·V over 128 columns, two others
# over 192 each; every warpgroup with its own loop, meeting at barriers).
# Catches: P of one page read after the scorer rewrote it for the next (p_free); an accumulating
# warpgroup that does not rescale by the page's alpha, or normalises with a stale running sum; a
# page slot refilled while a warpgroup still reads it; a V tail (NaN-poisoned) reaching P·V in
# any of the three column ranges; the lse or a column range of the output written wrongly.
@pytest.mark.parametrize(
    "heads,s_q,causal,seq_lens,max_pages,num_splits",
    full(
        [INTERPRET_CASES[i] for i in (0, 1, 2, 4, 5, 6)],
        [INTERPRET_CASES[i] for i in (0, 2, 4, 5)],
        "the scorer's other cases (s_q = 4 exactly one block; four row blocks) run under --full",
    ),
)
def test_interpret_scorer_matches_reference(heads, s_q, causal, seq_lens, max_pages, num_splits):
    args = make_inputs(len(seq_lens), s_q, heads, seq_lens, max_pages, seed=heads + s_q + 3)
    config = MlaDecodeConfig(num_splits=num_splits, min_pages_per_split=1, scorer=True)
    assert_matches_reference(args, causal=causal, config=config, impl="interpret")


def test_scorer_has_no_races(mla_decode_races):
    """The interpreter's race detector over the scorer body with one page slot, refilled every page: catches the
    TMA warpgroup refilling the slot before the scorer and both accumulating warpgroups released it, and the
    scorer rewriting P while an accumulating warpgroup still reads it (waits the numbers alone may not show)."""
    args = make_inputs(2, 1, 32, [130, 70], 3, seed=23)  # 3 and 2 pages through one slot
    config = MlaDecodeConfig(num_splits=1, scorer=True, max_concurrent_steps=1)
    assert_matches_reference(args, causal=False, config=config, impl="interpret")
    assert not mla_decode_races()


@pytest.mark.parametrize(
    "variant",
    [VARIANTS[2], *(pytest.param(v, marks=pytest.mark.full("the scorer body's case")) for v in VARIANTS[:2])],
    ids=[VARIANT_IDS[2], *VARIANT_IDS[:2]],
)
def test_interpret_query_without_keys_gives_zero_and_minus_inf(variant):
    # seq_len = 1 < s_q = 2, causal: query 0 sits at position -1 and sees no key. Documented
    # result: out = 0, lse = -inf (the reference agrees); query 1 is ordinary.
    args = make_inputs(2, 2, 32, [1, 70], 2, seed=5)
    config = MlaDecodeConfig(num_splits=2, min_pages_per_split=1, **variant)
    out, lse = mla_decode(*args, softmax_scale=SCALE, causal=True, config=config, impl="interpret")
    ref_out, ref_lse = mla_decode_reference(*args, softmax_scale=SCALE, causal=True)
    assert np.all(np.asarray(out[0, 0]) == 0) and np.all(np.asarray(ref_out[0, 0]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[0, 0]))) and np.all(np.isneginf(np.asarray(ref_lse[0, 0])))
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    rel = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert rel < 1e-2, f"relative error {rel}"
    np.testing.assert_allclose(np.asarray(lse[:, 1]), np.asarray(ref_lse[:, 1]), atol=2e-2)


def pools_around(kv_pages, fill):
    """``kv_pages`` as the middle pool of three back to back, the others all ``fill`` (-> pages, offset)."""
    pad = jnp.full_like(kv_pages, fill)
    return jnp.concatenate([pad, kv_pages, pad]), kv_pages.shape[0]


PAGE_OFFSET_CASES = [(VARIANTS[2], "per_sequence"), (VARIANTS[0], "per_sequence"), (VARIANTS[2], "pieces")]
PAGE_OFFSET_IDS = ["scorer", "plain", "scorer-pieces"]


def assert_reads_the_table_at_its_page_offset(variant, schedule, impl):
    """`page_offset` (a layer's pool in every layer's pages, `KVCache.map_pages`): the table's ids plus the offset.
    Pools 0 and 2 are NaN, so a body that ignores the offset or adds it twice gives NaN, not the reference over
    pool 1 alone."""
    q, kv, table, lens = make_inputs(2, 1, 16, [70, 130], 3, seed=9)
    pages, offset = pools_around(kv, np.nan)
    config = MlaDecodeConfig(num_splits=2, min_pages_per_split=1, schedule=schedule, **variant)
    call = jax.jit(
        lambda o: mla_decode(q, pages, table, lens, softmax_scale=SCALE, config=config, impl=impl, page_offset=o)
    )
    out, lse = call(jnp.int32(offset))  # traced, as the scan's layer index is
    ref_out, ref_lse = mla_decode_reference(q, kv, table, lens, softmax_scale=SCALE)
    chex.assert_trees_all_close(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=3e-2, rtol=2e-2)
    chex.assert_trees_all_close(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=1e-3)
    shifted = mla_decode_reference(q, pages, table, lens, softmax_scale=SCALE, page_offset=offset)[0]
    chex.assert_trees_all_equal(shifted, ref_out)  # the reference takes the same offset


@pytest.mark.parametrize("variant,schedule", PAGE_OFFSET_CASES, ids=PAGE_OFFSET_IDS)
def test_interpret_reads_the_table_at_its_page_offset(variant, schedule):
    assert_reads_the_table_at_its_page_offset(variant, schedule, "interpret")


def test_bad_page_offset_raises():
    args = make_inputs(1, 1, 16, [70], 2)
    with pytest.raises(ValueError, match=r"page_offset must be an integer scalar, got 1.5"):
        mla_decode(*args, softmax_scale=SCALE, page_offset=1.5)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = .* is not a page id"):
        mla_decode(*args, softmax_scale=SCALE, page_offset=args[1].shape[0])  # every id past the pages


def test_interpret_handles_unpadded_block_table_width():
    # max_pages = 5 is not a multiple of 4 int32 (16 B): the result must not depend on the wrapper's
    # padding of the table (which GMEM strides on the GPU want; the interpreter does not model them).
    args = make_inputs(1, 1, 16, [300], 5, seed=7)
    assert_matches_reference(args, causal=False, config=MlaDecodeConfig(num_splits=2), impl="interpret")


# ------------------------------------------------------------------------------------------------
# The pieces schedule: each sequence cut into pieces of N pages, one a CTA, launched longest first.
# ------------------------------------------------------------------------------------------------


def check_pieces(sched: PieceSchedule, seq_lens, row_blocks, config):
    """What any plan of the pieces schedule must satisfy, checked from the lengths with Python loops: N from
    the share rule; sequence b's pages covered once, in N-page pieces from page 0 (the last one short), piece k
    writing slot piece_start[b] + k with the slots of the batch contiguous from 0; the rows in non-increasing
    size, the rows with no piece last; W rows."""
    pages = [-(-int(n) // 64) for n in seq_lens]
    share = -(-sum(pages) * row_blocks // config.target_ctas)
    n = max(config.min_pages_per_split, -(-share // config.pieces_per_share), min(share, config.min_piece_pages))
    rows = np.asarray(sched.pieces)
    assert rows.shape == (num_piece_rows(len(pages), row_blocks, config), 4)
    sizes = rows[:, 2]
    assert (np.diff(sizes) <= 0).all() and (sizes >= 0).all()
    want_num = [-(-p // n) for p in pages]
    assert np.asarray(sched.num_pieces).tolist() == want_num
    assert np.asarray(sched.piece_start).tolist() == np.concatenate([[0], np.cumsum(want_num)[:-1]]).tolist()
    live = rows[sizes > 0]
    assert len(live) == sum(want_num)
    for b, p in enumerate(pages):
        mine = sorted((int(first), int(size), int(slot)) for bb, first, size, slot in live if bb == b)
        assert [m[0] for m in mine] == list(range(0, p, n)), (b, mine)
        assert [m[1] for m in mine] == [min(n, p - f) for f in range(0, p, n)]
        assert [m[2] for m in mine] == [int(sched.piece_start[b]) + k for k in range(len(mine))]


def test_piece_schedule_by_hand():
    """Pages [1, 1, 2, 0, 128, 5, 200] (337), 8 CTAs: a share of cdiv(337, 8) = 43 pages, pieces of cdiv(43, 2) =
    22. Sequence 4 is 5 pieces of 22 and one of 18, sequence 6 nine of 22 and one of 2; the fourteen full pieces
    run first, then 18, 5, 2, 2, 1, 1; 2 x 8 + 7 = 23 rows, three of them empty. Catches N from the wrong share,
    the sort ascending, slots in launch order instead of per sequence."""
    lens = jnp.asarray([1, 64, 65, 0, 8192, 300, 12800], jnp.int32)
    config = MlaDecodeConfig(schedule="pieces", target_ctas=8, min_pages_per_split=1)
    sched = piece_schedule(lens, row_blocks=1, config=config)
    rows = np.asarray(sched.pieces)
    assert rows.shape == (23, 4)
    assert rows[:, 2].tolist() == [22] * 14 + [18, 5, 2, 2, 1, 1, 0, 0, 0]
    assert (
        rows[0].tolist() == [4, 0, 22, 3] and rows[14].tolist() == [4, 110, 18, 8] and rows[15].tolist() == [5, 0, 5, 9]
    )
    assert np.asarray(sched.num_pieces).tolist() == [1, 1, 1, 0, 6, 1, 10]
    assert np.asarray(sched.piece_start).tolist() == [0, 1, 2, 3, 3, 9, 10]
    check_pieces(sched, lens, 1, config)


@pytest.mark.parametrize(
    "row_blocks,k,min_pages",
    [
        (1, 2, 4),
        pytest.param(2, 1, 1, marks=pytest.mark.full("two row blocks: the interpreted H = 128 pieces case")),
        pytest.param(2, 4, 2, marks=pytest.mark.full("other piece counts: the by-hand case pins the rule")),
    ],
)
def test_piece_schedule_covers_every_page_once(row_blocks, k, min_pages):
    """Random ragged batches (idle rows, one-token and one-page sequences among them; batches whose shares are
    below `min_piece_pages`, so their pieces are whole shares) through `check_pieces`."""
    rng = np.random.default_rng(row_blocks * 10 + k)
    config = MlaDecodeConfig(schedule="pieces", target_ctas=132, pieces_per_share=k, min_pages_per_split=min_pages)
    for B in (1, 7, 128):
        lens = rng.integers(0, 20000, B)
        lens[: min(B, 3)] = [1, 64, 0][: min(B, 3)]
        check_pieces(
            piece_schedule(jnp.asarray(lens, jnp.int32), row_blocks=row_blocks, config=config), lens, row_blocks, config
        )
    small = piece_schedule(jnp.full(8, 4096, jnp.int32), row_blocks=row_blocks, config=config)  # share 4 or 8
    assert set(np.asarray(small.pieces)[:, 2].tolist()) <= {0, 4 * row_blocks}  # whole shares, not halves
    empty = piece_schedule(jnp.zeros(4, jnp.int32), row_blocks=row_blocks, config=config)
    assert not np.asarray(empty.pieces)[:, 2].any() and not np.asarray(empty.num_pieces).any()


# (heads, s_q, causal, seq_lens, max_pages, target_ctas, variant): sequences cut into one-page and
# several-page pieces, an idle row, a one-token row, a page-boundary length (64), a causal row that sees no key.
PIECE_CASES = [
    (16, 2, True, [1, 64, 65, 190, 0, 3], 3, 2, dict()),  # the scorer body (the default); pieces of 2 pages and 1
    (64, 1, False, [1, 0, 65, 3, 200, 64], 4, 3, dict(scorer=False, split_qk=False)),
    (128, 1, False, [1, 64, 130], 3, 4, dict()),  # two row blocks a piece
]


@pytest.mark.parametrize(
    "heads,s_q,causal,seq_lens,max_pages,target_ctas,variant",
    [
        PIECE_CASES[0],
        pytest.param(*PIECE_CASES[1], marks=pytest.mark.full("the plain body on pieces (the scorer is the default)")),
        pytest.param(*PIECE_CASES[2], marks=pytest.mark.full("two row blocks; the GPU tests run H = 128")),
    ],
)
def test_interpret_pieces_matches_reference(heads, s_q, causal, seq_lens, max_pages, target_ctas, variant):
    """Catches, with sequences cut into several pieces: a piece reading from the wrong first page (its keys'
    positions or pages shifted), a partial written to another piece's slot or the combine merging another
    sequence's slots, a piece row with no piece writing over a real slot, an idle row not giving out 0, lse -inf,
    a page past a sequence's end reaching P·V (NaN-poisoned)."""
    args = make_inputs(len(seq_lens), s_q, heads, seq_lens, max_pages, seed=heads + s_q + 5)
    config = MlaDecodeConfig(
        schedule="pieces", target_ctas=target_ctas, min_pages_per_split=1, min_piece_pages=1, **variant
    )
    sched = mla_decode_schedule(args[3], heads=heads, query_len=s_q, config=config)
    assert isinstance(sched, PieceSchedule) and int(np.asarray(sched.num_pieces).max()) >= 2  # really cut
    slots = np.asarray(sched.pieces)[:, 3]
    assert (slots != np.arange(len(slots))).any()  # and launched in another order than their slots
    keyless = min(seq_lens) < (s_q if causal else 1)
    assert_matches_reference(args, causal=causal, config=config, impl="interpret", keyless_rows=keyless)


@pytest.mark.full(
    "test_interpret_pieces_matches_reference (the call's own plan) and the engine's plan-once test (a plan handed "
    "to every layer)"
)
def test_interpret_pieces_reads_the_schedule_it_is_given():
    """Another valid plan of the same lengths (pieces of another size) is read as given: the output is bit for
    bit that plan's own config's, not the call's; a plan for another batch is one line."""
    lens = [64, 65, 1, 380, 3]
    args = make_inputs(len(lens), 1, 16, lens, 6, seed=12)
    config = MlaDecodeConfig(schedule="pieces", target_ctas=4, min_pages_per_split=1, min_piece_pages=1, scorer=False)
    other = dataclasses.replace(config, min_pages_per_split=3)  # pieces of 3 pages, not 2; the same rows
    given = mla_decode_schedule(args[3], heads=16, config=other)
    assert not np.array_equal(
        np.asarray(given.pieces), np.asarray(mla_decode_schedule(args[3], heads=16, config=config).pieces)
    )
    got = mla_decode(*args, softmax_scale=SCALE, config=config, impl="interpret", schedule=given)
    chex.assert_trees_all_equal(got, mla_decode(*args, softmax_scale=SCALE, config=other, impl="interpret"))
    with pytest.raises(ValueError, match=r"^schedule.pieces is int32 \(13, 4\); B=5, s_q=1, H=16 .* \(11, 4\)"):
        mla_decode(
            *args,
            softmax_scale=SCALE,
            config=dataclasses.replace(config, target_ctas=3),
            impl="interpret",
            schedule=mla_decode_schedule(args[3], heads=16, config=config),
        )
    assert mla_decode_schedule(args[3], heads=16, config=MlaDecodeConfig()) is None  # per_sequence: no plan
    with pytest.raises(ValueError, match=r"^schedule= is a device plan's; config.schedule is 'per_sequence'"):
        mla_decode(*args, softmax_scale=SCALE, impl="interpret", schedule=given)


@pytest.mark.parametrize("heads,s_q,variant", [(16, 1, "scorer"), (128, 2, "scorer"), (64, 1, "split_qk")])
def test_pieces_cross_lowers_for_sm90(heads, s_q, variant):
    """Catches a pieces construct Mosaic GPU cannot lower for sm_90 (the table row's scalar reads, the
    predicated writes of a row with no piece), which interpret mode accepts."""
    config = MlaDecodeConfig(schedule="pieces", split_qk=variant == "split_qk", scorer=variant == "scorer")
    lowered = lower_for_sm90(8, s_q, heads, 130, causal=s_q > 1, config=config)
    assert _mosaic_calls(lowered) == 2  # the main kernel and the piece combine


def test_auto_schedule_rule_on_the_lengths():
    """`prefers_pieces`, by hand: pages = ceil(len / 64); pieces iff max · B > 1.5 · sum. Pins the measured
    sides (equal lengths: per-sequence; uniform draws over 256-16384 and 1-32768, max / mean ~ 2: pieces), a
    single sequence, idle rows counted, and both sides of the threshold."""

    def device_rule(lens):
        return bool(prefers_pieces(jnp.asarray(lens, jnp.int32)))

    def rule(lens):  # the host's form (numpy in, numpy out: `host_config`) gives the same answer
        got = prefers_pieces(np.asarray(lens, np.int32))
        assert isinstance(got, np.bool_) and got == device_rule(lens), lens
        return bool(got)

    assert not rule([8192] * 128) and not rule([5000]) and not rule([0])
    rng = np.random.default_rng(0)
    assert rule(rng.integers(256, 16385, 128)) and rule(rng.integers(1, 32769, 32))
    assert rule([4096] * 8 + [0] * 8)  # half the rows idle: max 64 pages, mean 32
    assert not rule([192, 64])  # pages 3, 1: 3 · 2 = 6, not > 1.5 · 4
    assert rule([256, 64])  # pages 4, 1: 8 > 7.5
    assert not rule([100, 64])  # pages 2, 1: 4, not > 4.5


def test_host_config_picks_the_branch_from_the_lengths():
    """`host_config` (a serving loop's per-step choice): "auto" becomes the per-sequence program on equal lengths
    and the pieces program on ragged ones (`branch_configs`, the other knobs kept); any other config passes
    unchanged, and None's defaults through `mla_jax.cache_paths.step_decode_config` choose as "auto" does. Catches the
    branches swapped and an "auto" config reaching the compiled step (its device conditional)."""
    from mla_jax.cache_paths import step_decode_config
    from pallas_kernels.mla_decode import host_config

    auto = MlaDecodeConfig(schedule="auto", target_ctas=8)
    even, ragged = np.full(16, 4096, np.int32), np.asarray([64] * 15 + [8192], np.int32)
    assert host_config(auto, even) == dataclasses.replace(auto, schedule="per_sequence")
    assert host_config(auto, ragged) == dataclasses.replace(auto, schedule="pieces")
    assert host_config(dataclasses.replace(auto, scorer=False), ragged).scorer is False
    assert host_config(auto, None) == dataclasses.replace(auto, schedule="per_sequence")  # a step that does not decode
    pieces, split = MlaDecodeConfig(schedule="pieces"), MlaDecodeConfig(num_splits=2)
    assert host_config(pieces, even) is pieces and step_decode_config(pieces, even) is pieces
    assert host_config(split, ragged) is split and step_decode_config(split, ragged) is split
    assert step_decode_config(auto, ragged).schedule == "pieces"
    # the defaults (None) choose as "auto" does: None (the per-sequence defaults) or the pieces config
    assert step_decode_config(None, ragged) == MlaDecodeConfig(schedule="pieces")
    assert step_decode_config(None, even) is None and step_decode_config(None, None) is None


@pytest.mark.parametrize(
    "lens,ragged",
    [
        pytest.param([130, 128, 129, 190], False, marks=pytest.mark.full("the ragged case catches swapped branches")),
        pytest.param(
            [1, 64, 65, 380],
            True,
            marks=pytest.mark.full(
                "test_host_config_picks_the_branch_from_the_lengths (the engine's choice, made on the host: no "
                "conditional) and test_auto_schedule_cross_lowers_for_sm90 (the kernel's conditional lowers)"
            ),
        ),
    ],
)
def test_interpret_auto_runs_the_program_its_rule_picks(lens, ragged):
    """schedule="auto" gives the reference's output, and bit for bit the output of the program the rule picks:
    the per-sequence config on near-equal lengths, the pieces one on ragged ones (catches the branches
    swapped, the plan of one branch handed to the other, the predicate ignored)."""
    args = make_inputs(len(lens), 1, 16, lens, 6, seed=11)
    auto = MlaDecodeConfig(schedule="auto", min_pages_per_split=1, target_ctas=4)
    plan_ = mla_decode_schedule(args[3], heads=16, config=auto)
    assert isinstance(plan_, AutoSchedule) and bool(plan_.use_pieces) == ragged
    picked = dataclasses.replace(auto, schedule="pieces" if ragged else "per_sequence")
    # planned once outside the call (the engine's way; the call's own plan is the same function of the lengths)
    got = mla_decode(*args, softmax_scale=SCALE, causal=True, config=auto, impl="interpret", schedule=plan_)
    chex.assert_trees_all_equal(
        got, mla_decode(*args, softmax_scale=SCALE, causal=True, config=picked, impl="interpret")
    )
    ref_out, ref_lse = mla_decode_reference(*args, softmax_scale=SCALE, causal=True)
    out, ref_out = np.asarray(got[0], np.float32), np.asarray(ref_out, np.float32)
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2  # assert_matches_reference's bounds
    chex.assert_trees_all_close(np.asarray(got[1]), np.asarray(ref_lse), atol=2e-2, rtol=1e-3)
    with pytest.raises(ValueError, match=r"^schedule must be an AutoSchedule \(mla_decode_schedule\), got Piece"):
        mla_decode(*args, softmax_scale=SCALE, config=auto, impl="interpret", schedule=plan_.pieces)


def test_auto_schedule_cross_lowers_for_sm90():
    """Both programs in one module: the per-sequence scorer (with its split combine) and the pieces scorer
    with the piece combine, under one conditional."""
    lowered = lower_for_sm90(8, 1, 64, 130, causal=False, config=MlaDecodeConfig(schedule="auto"))
    assert _mosaic_calls(lowered) == 4


def test_bad_schedule_raises():
    with pytest.raises(ValueError, match="schedule must be one of .* got 'even'"):
        MlaDecodeConfig(schedule="even")
    with pytest.raises(ValueError, match=r"pieces_per_share must be in \[1, 64\], got 0"):
        MlaDecodeConfig(schedule="pieces", pieces_per_share=0)


# ------------------------------------------------------------------------------------------------
# Cross-lowering (CPU): every production configuration through the full Mosaic GPU lowering.
# ------------------------------------------------------------------------------------------------


def lower_for_sm90(batch, s_q, heads, max_pages, *, causal, config=None):
    shapes = (
        jax.ShapeDtypeStruct((batch, s_q, heads, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch * max_pages, 64, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    fn = lambda *a: mla_decode(*a, softmax_scale=SCALE, causal=causal, config=config, impl="kernel")
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))


def _mosaic_calls(lowered) -> int:
    return len(re.findall(r"custom_call @mosaic_gpu", lowered.as_text()))


# Every (H, s_q) the kernel supports, each at one of three launch shapes: B=1 with 1024 pages (many KV
# splits, the combine kernel), B=8 with 130 pages (a few splits, a partial last split) and B=256 (no
# split: the main kernel writes the output; the largest grid), causal or not. Shape and causality rotate
# so that every H and every s_q meets all three shapes and both maskings, and every shape both maskings
# (the body depends on H, s_q and causal; the launch shape decides the split plan and the grid). 16
# lowerings instead of the 96 of the full product (the interpret tests and the GPU suite run both maskings of
# the bodies).
_LAUNCH_SHAPES = [(1, 1024), (8, 130), (256, 512)]
CROSS_LOWERING_CASES = [
    (heads, s_q, *_LAUNCH_SHAPES[(h_i + s_q) % 3], (h_i + s_q) % 2 == 1)
    for h_i, heads in enumerate((16, 32, 64, 128))
    for s_q in (1, 2, 3, 4)
]


def test_cross_lowering_cases_cover_every_shape_pairing():
    """Guards the rotation above: dropping a launch shape or a masking for some H or s_q (a bad modulus)
    would leave, e.g., H=128 never lowered with the combine kernel, or s_q=4 never causal."""
    for i, name in ((0, "heads"), (1, "s_q")):
        for value in {c[i] for c in CROSS_LOWERING_CASES}:
            mine = [c for c in CROSS_LOWERING_CASES if c[i] == value]
            assert {(c[2], c[3]) for c in mine} == set(_LAUNCH_SHAPES), (name, value, mine)
            assert {c[4] for c in mine} == {False, True}, (name, value, mine)
    assert {((c[2], c[3]), c[4]) for c in CROSS_LOWERING_CASES} == {
        (sh, k) for sh in _LAUNCH_SHAPES for k in (False, True)
    }
    assert len({(c[0], c[1]) for c in CROSS_LOWERING_CASES}) == 16


@pytest.mark.parametrize(
    "heads,s_q,batch,max_pages,causal",
    full(CROSS_LOWERING_CASES, [c for c in CROSS_LOWERING_CASES if c[1] in (1, 2)], "s_q 1 and 2 at every H"),
)
def test_cross_lowers_for_sm90(heads, s_q, batch, max_pages, causal):
    lowered = lower_for_sm90(batch, s_q, heads, max_pages, causal=causal)
    # one Mosaic GPU call for the main kernel, and one more for the combine when KV is split
    kernels_expected = 1 if plan(batch, s_q, heads, max_pages, MlaDecodeConfig()).num_splits == 1 else 2
    assert _mosaic_calls(lowered) == kernels_expected


# Every variant at every head count and every s_q, whichever the default picks there (the benchmarks time
# them); s_q rotates against H (each variant sees each H once and each s_q once; H x s_q pairs of the
# default body are CROSS_LOWERING_CASES'), and the two variants get opposite rotations.
VARIANT_CASES = [
    (v, heads, 1 + (h_i + 2 * v_i) % 4) for v_i, v in enumerate(VARIANTS) for h_i, heads in enumerate((16, 32, 64, 128))
]


def test_variant_cases_cover_every_head_count_and_query_length():
    """Guards the rotation above: a bad modulus that left a variant never lowered at some H or s_q."""
    for v in VARIANTS:
        assert sorted(c[1] for c in VARIANT_CASES if c[0] == v) == [16, 32, 64, 128]
        assert sorted(c[2] for c in VARIANT_CASES if c[0] == v) == [1, 2, 3, 4]


# By default every scorer case (the default body) and one of each other body; all under --full.
_CI_VARIANT_CASES = [c for c in VARIANT_CASES if c[0] is VARIANTS[2]] + [VARIANT_CASES[0], VARIANT_CASES[4]]


@pytest.mark.parametrize(
    "variant,heads,s_q",
    full(VARIANT_CASES, _CI_VARIANT_CASES, "the scorer body at every H, one case of the others"),
    ids=[f"{VARIANT_IDS[VARIANTS.index(v)]}-{h}-{q}" for v, h, q in VARIANT_CASES],
)
def test_cross_lowers_every_kernel_variant_for_sm90(variant, heads, s_q):
    config = MlaDecodeConfig(**variant)
    lowered = lower_for_sm90(8, s_q, heads, 130, causal=s_q > 1, config=config)
    assert _mosaic_calls(lowered) == (1 if plan(8, s_q, heads, 130, config).num_splits == 1 else 2)


@pytest.mark.parametrize(
    "config",
    [
        MlaDecodeConfig(max_concurrent_steps=1),
        MlaDecodeConfig(num_splits=256, combine_block_cols=64),
        MlaDecodeConfig(num_splits=3, combine_block_cols=256),
    ],
)
def test_cross_lowers_tuning_configs(config):
    # A tuning knob that dropped the combine kernel (or added one) would show in the call count.
    lowered = lower_for_sm90(4, 2, 64, 300, causal=True, config=config)
    splits = plan(4, 2, 64, 300, config).num_splits
    assert splits > 1  # each of these configs splits KV: the combine kernel must be there
    assert _mosaic_calls(lowered) == 2


def test_interpretable_variant_is_not_a_production_config():
    # The plain and split-QK bodies' SMEM-staged P buffers do not fit next to Q and two KV stages:
    # lowering must say so rather than the production path silently using them. (The scorer body
    # keeps P in SMEM either way; its interpretable form only accumulates through run_scoped.)
    with pytest.raises(ValueError, match="shared memory"):
        lower_for_sm90(2, 1, 64, 8, causal=False, config=MlaDecodeConfig(interpretable=True, scorer=False))


# ------------------------------------------------------------------------------------------------
# Split planning and dispatch
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["per_sequence", "pieces"])
def test_row_blocks_are_the_fastest_launched_grid_axis(schedule):
    # Pallas hands the grid's last axis to the GPU as its fastest one: the CTAs of one sequence's row blocks (H = 128
    # here: two) must be neighbours there, so they read each page together and the second read comes from L2. With
    # the row block first they ran a wave apart and each read every page from memory (Nsight Compute: 1.2 GB read
    # for 604 MB of pages at 128 x 4096, H = 128).
    from pallas_kernels.mla_decode.schedule import _main_out_geometry

    p = plan(8, 1, 128, 64, MlaDecodeConfig(schedule=schedule))
    assert p.row_blocks == 2
    _, grid, names = _main_out_geometry(8, 128, p, jnp.bfloat16)
    assert names[-1] == "g" and grid[-1] == p.row_blocks


def test_plan_fills_about_one_wave():
    p = plan(8, 1, 64, 512, MlaDecodeConfig())
    assert p.num_splits == 16 and 8 * p.num_splits <= 132
    assert plan(128, 1, 64, 512, MlaDecodeConfig()).num_splits == 1
    small = plan(1, 1, 16, 8, MlaDecodeConfig())  # 8 pages, >= 4 pages per split
    assert small.num_splits == 2 and small.pages_per_split == 4
    capped = plan(1, 1, 16, 10, MlaDecodeConfig(num_splits=4))  # 3+3+3+1 pages
    assert (capped.num_splits, capped.pages_per_split) == (4, 3)
    assert plan(1, 1, 16, 9, MlaDecodeConfig(num_splits=4)).num_splits == 3  # no split left empty
    assert plan(1, 1, 64, 512, MlaDecodeConfig()).num_splits == 64  # max_splits
    assert plan(1, 1, 64, 512, MlaDecodeConfig(max_splits=128)).num_splits == 128


def test_plan_body_defaults():
    # The scorer body by default; without it, split-QK exactly when a CTA's 64 rows are all real query rows.
    assert all(
        plan(8, s_q, h, 64, MlaDecodeConfig()).scorer and not plan(8, s_q, h, 64, MlaDecodeConfig()).split_qk
        for s_q, h in [(1, 16), (2, 32), (1, 128)]
    )
    old = MlaDecodeConfig(scorer=False)
    assert [
        plan(8, s_q, h, 64, old).split_qk for s_q, h in [(1, 16), (1, 32), (2, 32), (4, 16), (1, 64), (3, 128)]
    ] == [False, False, True, True, True, True]
    assert not plan(8, 1, 128, 64, MlaDecodeConfig(scorer=False, split_qk=False)).split_qk
    assert plan(8, 1, 16, 64, MlaDecodeConfig(scorer=False, split_qk=True)).split_qk
    assert plan(8, 1, 64, 64, MlaDecodeConfig(schedule="pieces")).scorer


@pytest.mark.skipif(backend.on_hopper(), reason="checks the non-Hopper default")
def test_default_impl_off_hopper_is_the_reference():
    args = make_inputs(1, 1, 16, [10], 1)
    out, lse = mla_decode(*args, softmax_scale=SCALE)
    ref_out, ref_lse = mla_decode_reference(*args, softmax_scale=SCALE)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))


# ------------------------------------------------------------------------------------------------
# Input validation
# ------------------------------------------------------------------------------------------------


def _shapes_ok():
    return make_inputs(1, 1, 16, [10], 1)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (
            lambda q, kv, bt, sl: (q[:, :, :8], kv, bt, sl),
            r"impl=\'interpret\': .*heads = 8 \(the decode kernel supports H in \(16, 32, 64, 128\)\)",
        ),
        (
            lambda q, kv, bt, sl: (jnp.concatenate([q] * 5, 1), kv, bt, sl),
            r"s_q = 5 \(the decode kernel takes 1 to 4 query tokens",
        ),
        (lambda q, kv, bt, sl: (q.astype(jnp.float32), kv, bt, sl), "q must be bfloat16, got float32"),
        (lambda q, kv, bt, sl: (q[..., :512], kv, bt, sl), "last dim must be 576.* got 512"),
        (lambda q, kv, bt, sl: (q, kv[:, :32], bt, sl), r"page_size = 32 \(the decode kernel reads 64-token pages\)"),
        (
            lambda q, kv, bt, sl: (q, kv.astype(jnp.float16), bt, sl),
            r"page format fp16 \(the decode kernel reads bf16, fp8 pages\)",
        ),
        (
            lambda q, kv, bt, sl: (q, kv, bt.astype(jnp.int64 if jax.config.x64_enabled else jnp.int16), sl),
            "block_table must be int32",
        ),
        (lambda q, kv, bt, sl: (q, kv, jnp.concatenate([bt, bt]), sl), r"block_table must be \[B=1"),
        (lambda q, kv, bt, sl: (q, kv, bt, sl[None]), r"seq_lens must be \[B=1\], got \(1, 1\)"),
    ],
)
def test_invalid_inputs_raise(mutate, match):
    args = mutate(*_shapes_ok())
    with pytest.raises(ValueError, match=match):
        mla_decode(*args, softmax_scale=SCALE, impl="interpret")


def test_invalid_scale_and_impl_raise():
    args = _shapes_ok()
    with pytest.raises(ValueError, match="softmax_scale must be a Python float"):
        mla_decode(*args, softmax_scale=jnp.float32(0.1), impl="reference")
    with pytest.raises(ValueError, match="finite and > 0, got nan"):
        mla_decode(*args, softmax_scale=math.nan, impl="reference")
    with pytest.raises(ValueError, match="impl must be one of .* got 'cuda'"):
        mla_decode(*args, softmax_scale=SCALE, impl="cuda")
    with pytest.raises(ValueError, match="max_concurrent_steps must be 1 or 2 .* got 3"):
        MlaDecodeConfig(max_concurrent_steps=3)
    with pytest.raises(ValueError, match="combine_block_cols .* got 96"):
        MlaDecodeConfig(combine_block_cols=96)


# ------------------------------------------------------------------------------------------------
# GPU (Hopper): the production kernel at larger sizes
# ------------------------------------------------------------------------------------------------

requires_hopper = pytest.mark.skipif(not backend.on_hopper(), reason="needs a Hopper (sm_90) GPU")


def _ragged_lengths(rng, batch, mean, s_q):
    return np.clip(rng.normal(mean, mean / 2, batch), s_q, 2 * mean).astype(int).tolist()


def _gpu_ragged_inputs(heads, s_q, batch, mean_len, seed_offset):
    """A `GPU_CASES` batch of ragged lengths with a length-1 (or s_q) sequence and one that fills the table."""
    rng = np.random.default_rng(heads * 100 + s_q * 10 + batch + seed_offset)
    lengths = _ragged_lengths(rng, batch, mean_len, s_q)
    lengths[0], lengths[-1] = max(s_q, 1), 2 * mean_len
    return make_inputs(batch, s_q, heads, lengths, -(-2 * mean_len // 64), seed=int(rng.integers(1 << 30)))


# (heads, s_q, causal, batch, mean length, num_splits): every head count with every s_q; the
# batch/length/split setting alternates so both the heuristic split and a forced odd split run.
GPU_CASES = [
    (h, s_q, causal, *((40, 300, None) if (i + j) % 2 else (5, 2000, 7)))
    for i, h in enumerate((16, 32, 64, 128))
    for j, (s_q, causal) in enumerate(((1, False), (2, True), (3, True), (4, False)))
]


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads,s_q,causal,batch,mean_len,num_splits", gpu_full(GPU_CASES, GPU_CASES[::10]))
def test_gpu_kernel_matches_reference(heads, s_q, causal, batch, mean_len, num_splits):
    rng = np.random.default_rng(heads * 100 + s_q * 10 + batch)
    lengths = _ragged_lengths(rng, batch, mean_len, s_q)
    lengths[0] = max(s_q, 1)  # a length-1 (or s_q) sequence in every case
    lengths[-1] = 2 * mean_len  # and one that fills the table
    max_pages = -(-2 * mean_len // 64)
    args = make_inputs(batch, s_q, heads, lengths, max_pages, seed=int(rng.integers(1 << 30)))
    assert_matches_reference(
        args, causal=causal, config=MlaDecodeConfig(num_splits=num_splits, scorer=False, split_qk=False), impl="kernel"
    )


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("variant,schedule", PAGE_OFFSET_CASES, ids=PAGE_OFFSET_IDS)
def test_gpu_reads_the_table_at_its_page_offset(variant, schedule):
    assert_reads_the_table_at_its_page_offset(variant, schedule, "kernel")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("variant", gpu_full(VARIANTS, VARIANTS[2:]), ids=VARIANT_IDS)
@pytest.mark.parametrize(
    "s_q,causal,lengths",
    gpu_full(
        [(1, False, [1, 63, 64, 65, 130, 192]), (2, True, [4096, 129, 2, 4000])], [(2, True, [4096, 129, 2, 4000])]
    ),
)
def test_gpu_page_boundaries(s_q, causal, lengths, variant):
    args = make_inputs(len(lengths), s_q, 64, lengths, 64, seed=3)
    assert_matches_reference(args, causal=causal, config=MlaDecodeConfig(**variant), impl="kernel")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads,s_q,causal,batch,mean_len,num_splits", gpu_full(GPU_CASES[1::3], GPU_CASES[1:2]))
def test_gpu_split_qk_matches_reference(heads, s_q, causal, batch, mean_len, num_splits):
    rng = np.random.default_rng(heads + s_q + batch)
    lengths = _ragged_lengths(rng, batch, mean_len, s_q)
    lengths[0] = s_q
    max_pages = -(-2 * mean_len // 64)
    args = make_inputs(batch, s_q, heads, lengths, max_pages, seed=int(rng.integers(1 << 30)))
    assert_matches_reference(
        args, causal=causal, config=MlaDecodeConfig(num_splits=num_splits, scorer=False, split_qk=True), impl="kernel"
    )


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads,s_q,causal,batch,mean_len,num_splits", gpu_full(GPU_CASES, GPU_CASES[1:2]))
def test_gpu_scorer_matches_reference(heads, s_q, causal, batch, mean_len, num_splits):
    args = _gpu_ragged_inputs(heads, s_q, batch, mean_len, 1)
    assert_matches_reference(
        args, causal=causal, config=MlaDecodeConfig(num_splits=num_splits, scorer=True), impl="kernel"
    )


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads,s_q,causal", gpu_full([(64, 1, False), (128, 2, True)], []))
def test_gpu_large_batch(heads, s_q, causal):
    """B = 256 (the top of the supported batch range): one split per sequence, ragged lengths."""
    batch = 256
    rng = np.random.default_rng(heads + s_q)
    lengths = _ragged_lengths(rng, batch, 600, s_q)
    lengths[0], lengths[-1] = s_q, 1200
    args = make_inputs(batch, s_q, heads, lengths, -(-1200 // 64), seed=11)
    config = MlaDecodeConfig()
    assert plan(batch, s_q, heads, args[2].shape[1], config).num_splits == 1
    assert_matches_reference(args, causal=causal, impl="kernel", config=config)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("variant", gpu_full(VARIANTS, VARIANTS[2:]), ids=VARIANT_IDS)
@pytest.mark.parametrize(
    "heads,s_q,causal",
    gpu_full(
        [(16, 1, False), (64, 1, False), (64, 2, True), (128, 1, False), (128, 4, True)],
        [(128, 4, True)],
    ),
)
def test_gpu_pieces_matches_reference(heads, s_q, causal, variant):
    """The pieces schedule on the GPU over the default 132 CTAs: ragged lengths with an idle row, a length-1 one,
    page-boundary lengths and one that fills the table, so long sequences are cut into several pieces that run
    on other SMs in another order than their slots. Catches what the interpreter cannot: a piece row's scalar
    reads racing the TMA warpgroup, a row with no piece writing, a page read past a piece."""
    rng = np.random.default_rng(heads + 10 * s_q + 1)
    batch = 40
    lengths = _ragged_lengths(rng, batch, 700, s_q)
    lengths[0], lengths[1], lengths[2], lengths[3], lengths[-1] = 0, 1, 64, 128, 1400
    args = make_inputs(batch, s_q, heads, lengths, -(-1400 // 64), seed=int(rng.integers(1 << 30)))
    assert_matches_reference(
        args, causal=causal, impl="kernel", keyless_rows=True, config=MlaDecodeConfig(schedule="pieces", **variant)
    )
