"""Tests of pallas_kernels.mla_decode on fp8 pages (uint8 [N, 64, 656], `pallas_kernels.page_format`).

CPU: the kernel in interpret mode against its reference (dequantise to bf16, then the bf16
reference), and cross-lowering for sm_90 at every head count and query length. GPU (``-m gpu``):
the same equivalence at larger sizes.

The latents' four 128-column blocks have magnitudes 1, 4, 16, 64, so a scale applied to the wrong
block changes the output by far more than bf16 rounding. Every byte a sequence does not own (page
tails, unused and spare pages) is 0xFF: NaN as e4m3 latent, as fp32 scale and as bf16 rope, so a
value outside a sequence that reaches the softmax or P·V shows up as NaN.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    MlaDecodeConfig,
    backend,
    dequantize_latent_fp8,
    mla_decode,
    mla_decode_reference,
    quantize_latent_fp8,
)
from pallas_kernels.mla_decode import mla_decode_fp8_math_reference, mla_decode_schedule, plan, quantize_query_rows
from tests.tiers import full, gpu_full

SCALE = 192**-0.5
BLOCK_MAGNITUDES = np.repeat([1.0, 4.0, 16.0, 64.0], 128)


def make_fp8_inputs(batch, s_q, heads, seq_lens, max_pages, *, seed=0, spare_pages=3, token_spread=0.0):
    """(q bf16 [B,s_q,H,576], fp8 pages uint8 [N,64,656], block table, seq_lens), poisoned as above.
    ``token_spread`` > 0 also scales each token's latent by 2^u, u uniform in [-spread, spread], so the
    tokens' block scales differ (by up to 2^(2 spread)) within a page."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + spare_pages
    lat = rng.standard_normal((num_pages, 64, 576)).astype(np.float32)
    lat[..., :512] *= BLOCK_MAGNITUDES / 16
    if token_spread:
        lat[..., :512] *= 2.0 ** rng.uniform(-token_spread, token_spread, (num_pages, 64, 1))
    pages = np.array(quantize_latent_fp8(jnp.asarray(lat)))
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    owned = np.zeros(num_pages, bool)
    for b, length in enumerate(seq_lens):
        used = -(-length // 64)
        owned[table[b, :used]] = True
        if length % 64:
            pages[table[b, used - 1], length % 64 :] = 0xFF
    pages[~owned] = 0xFF
    q = rng.standard_normal((batch, s_q, heads, 576)).astype(np.float32)
    return (
        jnp.asarray(q, jnp.bfloat16),
        jnp.asarray(pages),
        jnp.asarray(table),
        jnp.asarray(np.asarray(seq_lens, np.int32)),
    )


def assert_matches_reference(args, *, causal, config=None, impl):
    out, lse = mla_decode(*args, softmax_scale=SCALE, causal=causal, config=config, impl=impl)
    ref_out, ref_lse = mla_decode_reference(*args, softmax_scale=SCALE, causal=causal)
    assert out.shape == ref_out.shape and out.dtype == jnp.bfloat16
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    assert np.isfinite(out).all() and np.isfinite(np.asarray(lse)).all()
    # The kernel sees the same bf16 K/V as the reference: what is left is accumulation order and
    # the bf16 output rounding.
    rel = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert rel < 1e-2, f"relative error {rel}"
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=1e-3)


def test_reference_reads_the_dequantised_pages():
    """Guards: the reference reading fp8 bytes as values (or skipping a block's scale): its output
    must equal the bf16 reference over the dequantised pages exactly."""
    q, pages, table, lens = make_fp8_inputs(2, 1, 16, [70, 5], 2, seed=3)
    bf16_pages = jnp.nan_to_num(dequantize_latent_fp8(pages)).astype(jnp.bfloat16)
    got = mla_decode_reference(q, pages, table, lens, softmax_scale=SCALE)
    want = mla_decode_reference(q, bf16_pages, table, lens, softmax_scale=SCALE)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


# --- The FP8 math of the fp8 bodies to come, and its reference ------------------------------------------------------

# Relative error of the FP8 math against the f32 decode over the dequantised pages, on this data (`_fp8_math_args`):
# measured at most 0.050 overall and 0.051 in a 128-column block over `FP8_MATH_CELLS`. Over the target
# of 2e-2: e4m3's 3 mantissa bits round the query (its error grows with the scores' spread; here their std is
# ~3.5: 0.039 with P exact) and P (~2.5 % rms a value, which does not average out over tokens: 0.027 with the
# query exact).
FP8_MATH_BOUND = 6e-2
# (heads, s_q, causal): every head count and query length of the kernel, causal (s_q = 1 is the same either way),
# and two non-causal cells with s_q > 1.
FP8_MATH_CELLS = [(h, t, True) for h in (16, 32, 64, 128) for t in (1, 2, 4)] + [(16, 2, False), (128, 4, False)]


def _f32_reference(args, *, causal):
    """`mla_decode_reference` in f32 over the dequantised pages (fp32 pages: no bf16 rounding of K or V)."""
    q, pages, table, lens = args
    out, lse = mla_decode_reference(q, dequantize_latent_fp8(pages), table, lens, softmax_scale=SCALE, causal=causal)
    return np.asarray(out, np.float32), np.asarray(lse)


def _fp8_math_args(heads, s_q, *, seed):
    """Ragged lengths over 5-page tables (s_q tokens: the shortest a causal query allows; partial pages; the
    full table), the tokens' block scales spread over 2x within a page, NaN bytes outside the sequences."""
    return make_fp8_inputs(3, s_q, heads, [s_q, 97, 320], 5, seed=seed, token_spread=0.5)


def _block_errors(out, ref):
    """Relative error of each 128-column output block (each latent block has its own scales)."""
    o, r = out.reshape(*out.shape[:-1], 4, 128), ref.reshape(*ref.shape[:-1], 4, 128)
    axes = tuple(range(o.ndim - 2)) + (o.ndim - 1,)
    return np.sqrt(((o - r) ** 2).sum(axis=axes) / (r**2).sum(axis=axes))


@pytest.mark.parametrize(
    "heads,s_q,causal",
    full(FP8_MATH_CELLS, [(16, 1, True), (32, 2, True), (128, 4, True), (16, 2, False)], "H=16/32/128, s_q 1/2/4"),
)
def test_fp8_math_reference_is_within_bound_of_f32(heads, s_q, causal):
    """The FP8 math (e4m3 query, e4m3 products with the pages' block scales, P in e4m3 with the scales folded in)
    stays within `FP8_MATH_BOUND` of the exact decode over the dequantised pages, overall and in each 128-column
    block.

    Guards (each checked by introducing it, relative errors at least): block 3's scale left out of Q·Kᵀ (0.87);
    block k's scale applied to block k + 1 in Q·Kᵀ (0.97) or in the fold into P (1.2); the query scale left out
    (0.66); the rope scores dropped (0.21); P not folded with the tokens' scales (the page's largest used for
    every token: 0.28); the fold without the page's largest scale factored out (P · scale underflows e4m3:
    0.067 overall, 1.0 in a block)."""
    args = _fp8_math_args(heads, s_q, seed=heads + 10 * s_q + causal)
    out, lse = mla_decode_fp8_math_reference(*args, softmax_scale=SCALE, causal=causal)
    ref_out, ref_lse = _f32_reference(args, causal=causal)
    assert out.shape == ref_out.shape and out.dtype == jnp.bfloat16
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all() and np.isfinite(np.asarray(lse)).all()
    rel = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert rel <= FP8_MATH_BOUND, f"relative error {rel}"
    assert (_block_errors(out, ref_out) <= FP8_MATH_BOUND).all(), f"block errors {_block_errors(out, ref_out)}"
    # lse follows the largest scores, whose error (the query's rounding) is measured at most 0.50, median 0.05.
    lse_err = np.abs(np.asarray(lse) - ref_lse)
    assert lse_err.max() <= 0.75 and np.median(lse_err) <= 0.1, f"lse errors: max {lse_err.max()}"


def test_fp8_math_reference_quantizes():
    """Guards: the FP8 math reference not rounding at all (the query or P kept in f32, XLA folding the e4m3
    round trip): it must differ from the exact decode by e4m3 rounding (well above bf16's), and from the bf16
    reference's dequantised decode."""
    args = _fp8_math_args(16, 1, seed=5)
    out = np.asarray(mla_decode_fp8_math_reference(*args, softmax_scale=SCALE)[0], np.float32)
    ref_out, _ = _f32_reference(args, causal=False)
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) > 3e-3


def test_quantize_query_rows():
    """Guards: a query scale per block or per tensor instead of per row (a row's largest value must map to
    ±448 exactly), a scale that is not amax / 448, an all-zero row's scale 0 (0/0 = NaN in its values)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 512)).astype(np.float32) * np.array([[1.0], [100.0], [0.0]], np.float32)
    q8, scale = quantize_query_rows(jnp.asarray(q, jnp.bfloat16))
    assert q8.dtype == jnp.float8_e4m3fn and scale.shape == (3,)
    q8 = np.asarray(q8, np.float32)
    np.testing.assert_allclose(np.asarray(scale)[:2], np.abs(q[:2]).max(axis=1) / 448, rtol=1e-2)
    assert np.asarray(scale)[2] == 1.0 and not q8[2].any()
    assert (np.abs(q8[:2]).max(axis=1) == 448).all()
    np.testing.assert_allclose(q8[:2] * np.asarray(scale)[:2, None], q[:2], rtol=1 / 16, atol=1e-2 * np.abs(q).max())


def test_fp8_math_reference_refuses_other_formats():
    """Guards: the FP8 math reference silently reading bf16 pages as if they held e4m3 bytes."""
    q, pages, table, lens = _fp8_math_args(16, 1, seed=1)
    bf16_pages = dequantize_latent_fp8(pages).astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="reads fp8 pages, got bf16 pages"):
        mla_decode_fp8_math_reference(q, bf16_pages, table, lens, softmax_scale=SCALE)


# (heads, s_q, causal, seq_lens, max_pages, num_splits): small enough for the interpreter. R = s_q * H
# <= 32 query rows go through the transposed body, more through the padded shared-buffer body.
INTERPRET_CASES = [
    (16, 1, False, [1, 63], 1, None),  # transposed; length 1; a NaN tail inside the only page
    (16, 2, True, [65, 130], 3, 2),  # transposed; two pages a CTA, causal, split combine
    (32, 1, False, [130, 64], 3, 1),  # transposed; three pages a CTA, one split (final output)
    (32, 2, True, [65, 130], 3, 2),  # two pages through one CTA, page boundaries, causal
    (64, 1, True, [3, 200], 4, 4),  # empty splits, ragged, split combine
    (128, 1, False, [100, 7], 2, 2),  # two row blocks per sequence
]


@pytest.mark.parametrize(
    "heads,s_q,causal,seq_lens,max_pages,num_splits",
    full(
        INTERPRET_CASES,
        [INTERPRET_CASES[i] for i in (1, 3, 5)],
        "both bodies, causal, page boundaries, split combine and two row blocks run by default",
    ),
)
def test_interpret_matches_reference(heads, s_q, causal, seq_lens, max_pages, num_splits):
    """Guards: a scale applied to the wrong 128-column block, the rope columns not copied into the
    key buffer (or, transposed, their scores not added), page-tail rows not zeroed (NaN through
    P·V), the buffer overwritten before the other warpgroup's P·V (a wrong page's V); transposed:
    warpgroup 1's partial scores not added, the softmax state not carried across pages, the query
    rows of a causal token mapped to the wrong limit, and the transposed outputs not transposed back."""
    args = make_fp8_inputs(len(seq_lens), s_q, heads, seq_lens, max_pages, seed=heads + s_q)
    config = MlaDecodeConfig(num_splits=num_splits, min_pages_per_split=1)
    assert_matches_reference(args, causal=causal, config=config, impl="interpret")


@pytest.mark.parametrize("heads", [16, 64], ids=["transposed", "row-block"])
def test_interpret_reads_the_table_at_its_page_offset(heads):
    """Both fp8 bodies at a `page_offset` (the layer's pool in every layer's pages): pools 0 and 2 all 0xFF (NaN in
    e4m3), so a body that ignores the offset, or adds it twice, gives NaN, not the reference over pool 1 alone."""
    q, pages, table, lens = make_fp8_inputs(2, 1, heads, [70, 130], 3, seed=4)
    pad = jnp.full_like(pages, 0xFF)
    config = MlaDecodeConfig(num_splits=2, min_pages_per_split=1)
    offset = jnp.int32(pages.shape[0])
    out = mla_decode(
        q,
        jnp.concatenate([pad, pages, pad]),
        table,
        lens,
        softmax_scale=SCALE,
        config=config,
        impl="interpret",
        page_offset=offset,
    )[0]
    ref = mla_decode_reference(q, pages, table, lens, softmax_scale=SCALE)[0]
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all() and np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_transposed_body_refuses_more_than_32_rows():
    """Guards: fp8_transposed=True silently falling back (or computing garbage) where the transposed
    body does not serve: more than 32 query rows."""
    args = make_fp8_inputs(1, 1, 64, [70], 2)
    with pytest.raises(ValueError, match="needs s_q \\* H <= 32 query rows, got s_q \\* H = 64"):
        mla_decode(*args, softmax_scale=SCALE, config=MlaDecodeConfig(fp8_transposed=True), impl="interpret")


@pytest.mark.parametrize(
    "heads,s_q,lens",
    [
        (16, 2, [1, 65, 200, 0]),  # the transposed body
        pytest.param(64, 1, [3, 65, 200], marks=pytest.mark.full("the padded body reads the table as the bf16 ones")),
    ],
)
def test_interpret_pieces_matches_reference(heads, s_q, lens):
    """Guards the pieces schedule on fp8 pages, both bodies: a sequence in pieces of 2 pages launched in another
    order than their slots (a piece reading from the wrong first page, its partial in another piece's slot), an
    idle row, the transposed body's partials not transposed back before the combine."""
    args = make_fp8_inputs(len(lens), s_q, heads, lens, 4, seed=heads + 7)
    config = MlaDecodeConfig(schedule="pieces", target_ctas=2, min_pages_per_split=1, min_piece_pages=1)
    slots = np.asarray(mla_decode_schedule(args[3], heads=heads, query_len=s_q, config=config).pieces)[:, 3]
    assert (slots != np.arange(len(slots))).any()
    assert plan(len(lens), s_q, heads, 4, config).schedule == "pieces"
    out, lse = mla_decode(*args, softmax_scale=SCALE, causal=s_q > 1, config=config, impl="interpret")
    ref_out, ref_lse = mla_decode_reference(*args, softmax_scale=SCALE, causal=s_q > 1)
    live = np.asarray(args[3]) > 0
    o, r = np.asarray(out, np.float32)[live], np.asarray(ref_out, np.float32)[live]
    assert np.linalg.norm(o - r) / np.linalg.norm(r) < 1e-2
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(ref_lse)[live], atol=2e-2, rtol=1e-3)
    assert np.isneginf(np.asarray(lse)[~live]).all() and not np.asarray(out, np.float32)[~live].any()


@pytest.mark.parametrize("heads,s_q", [(16, 1), (32, 1), (64, 2)])
def test_pieces_cross_lowers_for_sm90(heads, s_q):
    """Guards: the pieces schedule's fp8 bodies (the transposed one's table-row reads and predicated writes, its
    transposed partials into the piece combine) not compiling for sm_90."""
    lowered = _lower(8, s_q, heads, 65, causal=s_q > 1, config=MlaDecodeConfig(schedule="pieces"))
    assert len(re.findall(r"custom_call @mosaic_gpu", lowered.as_text())) == 2


def _lower(batch, s_q, heads, max_pages, *, causal, config=None):
    shapes = (
        jax.ShapeDtypeStruct((batch, s_q, heads, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch * max_pages, 64, 656), jnp.uint8),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    fn = lambda *a: mla_decode(*a, softmax_scale=SCALE, causal=causal, config=config, impl="kernel")
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))


_CROSS = [(h, *shape) for shape in [(1, 128, 128), (2, 1, 512), (4, 8, 65)] for h in (16, 32, 64, 128)]


@pytest.mark.parametrize(
    "heads,s_q,batch,max_pages",
    full(_CROSS, [c for c in _CROSS if c[1] == 4] + [(16, 1, 128, 128), (128, 2, 1, 512)], "s_q = 4 at every H"),
)
def test_cross_lowers_for_sm90(heads, s_q, batch, max_pages):
    """Guards: an fp8 body that does not compile for sm_90 (SMEM over 227 KB, a TMA box or
    register layout the 656-byte rows break) at any supported head count and query length."""
    lowered = _lower(batch, s_q, heads, max_pages, causal=s_q > 1)
    kernels = 1 if plan(batch, s_q, heads, max_pages, MlaDecodeConfig()).num_splits == 1 else 2
    assert len(re.findall(r"custom_call @mosaic_gpu", lowered.as_text())) == kernels


requires_hopper = pytest.mark.skipif(not backend.on_hopper(), reason="needs a Hopper (sm_90) GPU")


def _gpu_ragged_fp8_inputs(heads, s_q, batch, mean_len, *, seed):
    """fp8 pages of ragged lengths around ``mean_len``, with a length-1 (or s_q) sequence and one that fills the
    table."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.normal(mean_len, mean_len / 2, batch), s_q, 2 * mean_len).astype(int).tolist()
    lengths[0], lengths[-1] = max(s_q, 1), 2 * mean_len
    return make_fp8_inputs(batch, s_q, heads, lengths, -(-2 * mean_len // 64), seed=int(rng.integers(1 << 30)))


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "heads,s_q,causal,batch,mean_len,num_splits",
    gpu_full(
        [
            (16, 1, False, 40, 300, None),
            (32, 1, True, 40, 300, None),
            (16, 2, True, 5, 2000, 7),
            (32, 2, True, 5, 2000, 7),
            (64, 1, False, 40, 300, None),
            (64, 4, False, 5, 2000, 7),
            (128, 3, True, 40, 300, None),
            (128, 1, False, 5, 2000, 7),
        ],
        [(16, 2, True, 5, 2000, 7), (128, 3, True, 40, 300, None)],
    ),
)
def test_gpu_kernel_matches_reference(heads, s_q, causal, batch, mean_len, num_splits):
    args = _gpu_ragged_fp8_inputs(heads, s_q, batch, mean_len, seed=heads * 100 + s_q)
    assert_matches_reference(args, causal=causal, config=MlaDecodeConfig(num_splits=num_splits), impl="kernel")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "heads,s_q,causal",
    gpu_full([(16, 1, False), (32, 1, True), (16, 2, True), (64, 1, False)], [(32, 1, True), (16, 2, True)]),
)
def test_gpu_pieces_matches_reference(heads, s_q, causal):
    """The pieces schedule's fp8 bodies (transposed at R <= 32, padded above) on the GPU over ragged lengths and
    the default 132 CTAs: long sequences in several pieces on other SMs, launched in another order than their
    slots (races and table reads the interpreter cannot show)."""
    rng = np.random.default_rng(heads + s_q + 3)
    lengths = np.clip(rng.normal(700, 350, 40), s_q, 1400).astype(int).tolist()
    lengths[0], lengths[-1] = max(s_q, 1), 1400
    args = make_fp8_inputs(40, s_q, heads, lengths, -(-1400 // 64), seed=int(rng.integers(1 << 30)))
    assert_matches_reference(args, causal=causal, impl="kernel", config=MlaDecodeConfig(schedule="pieces"))
