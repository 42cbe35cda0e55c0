"""Tests of pallas_kernels.page_format: the fp8 and fp4 byte layouts against numpy / ml_dtypes
constructions from the documented layouts (tests/fp8_numpy.py, tests/fp4_numpy.py, never the code
under test), the round-trip error bounds, zero blocks, byte counts against the capacity planner, and
one-line errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fp4_numpy import fp4_bytes, fp4_values
from fp8_numpy import fp8_bytes, fp8_values

from pallas_kernels import (
    BF16_PAGES,
    FP4_PAGES,
    FP8_PAGES,
    PageFormat,
    dequantize_latent_fp4,
    dequantize_latent_fp8,
    page_format_of,
    quantize_latent_fp4,
    quantize_latent_fp8,
)

L, R = 512, 64


def adversarial_latents(shape=(3, 5), seed=0):
    """Random tokens whose 128-blocks span 16 orders of magnitude, plus hand-made rows: signed zeros,
    an all-zero block, e4m3 rounding ties (normal and subnormal) and a block whose amax is negative."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape + (L + R,)).astype(np.float32)
    x[..., :L] *= np.exp(rng.uniform(-18, 18, shape + (4,))).repeat(128, axis=-1).astype(np.float32)
    flat = x.reshape(-1, L + R)
    flat[0, :128] = 0.0  # all-zero block
    flat[0, 128:256] = -0.0  # all negative zeros: bytes 0x80, scale 0
    flat[1, 3] = -0.0  # one -0.0 in a live block
    # Block 0 of row 2 has amax 448 (scale exactly 1): the quotients are the values themselves.
    ties = [448.0, 1.0625, 1.1875, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 2.0**-11, 464.0 / 2, -0.0]
    flat[2, :128] = 0.5
    flat[2, : len(ties)] = ties
    flat[3, 256:384] = np.linspace(-3.0, 1.0, 128)  # amax from a negative value
    return x


def test_fp8_bytes_match_the_numpy_construction():
    """Guards: the scale off by one ulp (XLA turns `/ 448` and `/ scale` into multiplications by a
    reciprocal: the first version stored such scales in ~54 % of blocks), big-endian or misplaced
    scale / rope bytes, truncation instead of round-to-nearest-even, a missing clip, and -0.0 written
    as 0x00 instead of 0x80."""
    x = adversarial_latents()
    got = np.asarray(jax.jit(quantize_latent_fp8)(jnp.asarray(x)))
    want = fp8_bytes(x)
    assert got.dtype == np.uint8 and got.shape == (3, 5, 656)
    np.testing.assert_array_equal(got, want)
    flat = got.reshape(-1, 656)
    assert (flat[0, 128:256] == 0x80).all() and flat[1, 3] == 0x80  # e4m3 signed zeros
    # the ties row, by hand: 448 = 0x7E; 1.0625 -> 1.0 (0x38); 1.1875 -> 1.25 (0x3A); 17 -> 16 (0x58);
    # 19 -> 20 (0x5A); 2^-10 (half the smallest subnormal) -> 0; 3 * 2^-10 -> 2 * 2^-9 (0x02); 2^-11 -> 0
    assert list(flat[2, :8]) == [0x7E, 0x38, 0x3A, 0x58, 0x5A, 0x00, 0x02, 0x00]
    assert flat[2, 512:516].view("<f4")[0] == 1.0


def test_fp8_round_trip_error_is_within_half_an_e4m3_step_of_the_top_binade():
    """|decoded - x| <= 16/448 of the block's amax (the top binade [256, 448] has steps of 32), rope
    exact to bf16. Guards: one scale for all 512 values (the blocks here differ by up to 1e15, so small
    blocks would lose everything), a scale not multiplied back, the rope stored in fp8, e5m2."""
    x = adversarial_latents(seed=1)
    dec = np.asarray(dequantize_latent_fp8(quantize_latent_fp8(jnp.asarray(x))))
    assert dec.dtype == np.float32 and dec.shape == x.shape
    np.testing.assert_array_equal(dec, fp8_values(fp8_bytes(x)))  # the decode is the documented one
    blocks = x[..., :L].reshape(x.shape[:-1] + (4, 128))
    err = np.abs(dec[..., :L].reshape(blocks.shape) - blocks)
    bound = np.abs(blocks).max(-1, keepdims=True) * (16 / 448) * (1 + 2.0**-20)
    assert (err <= bound).all(), float((err / np.maximum(bound, 1e-45)).max())
    live = bound[..., 0] > 0
    assert (err.max(-1)[live] / bound[..., 0][live]).max() > 0.5  # the bound is the right size, not loose
    np.testing.assert_array_equal(dec[..., L:], x[..., L:].astype(ml_dtypes.bfloat16).astype(np.float32))
    # through the PageFormat hooks, as the cache and paged_gather's reference call them
    np.testing.assert_array_equal(np.asarray(FP8_PAGES.decode(FP8_PAGES.encode(jnp.asarray(x)))), dec)
    np.testing.assert_array_equal(
        np.asarray(FP8_PAGES.dequantize_reference(FP8_PAGES.encode(jnp.asarray(x)))), dec.astype(ml_dtypes.bfloat16)
    )


def test_all_zero_blocks_have_scale_zero_and_decode_to_zero():
    """Guards: 0 / 0 = NaN for an all-zero block (the scale must be 0 and the division guarded), and a
    zero block spilling into its neighbours' scales."""
    x = np.zeros((2, L + R), np.float32)
    x[0, 128:256] = np.linspace(-1, 1, 128)
    stored = np.asarray(quantize_latent_fp8(jnp.asarray(x)))
    scales = stored[:, L : L + 16].copy().view("<f4")
    np.testing.assert_array_equal(scales, np.float32([[0, np.float32(1) / np.float32(448), 0, 0], [0, 0, 0, 0]]))
    assert (stored[1] == 0).all()
    dec = np.asarray(dequantize_latent_fp8(jnp.asarray(stored)))
    assert np.isfinite(dec).all()
    np.testing.assert_array_equal(dec[1], 0)
    np.testing.assert_array_equal(dec[0, :128], 0)
    np.testing.assert_array_equal(dec[0, 256:], 0)


def test_a_nan_token_decodes_to_nan_everywhere():
    """The cache poisons never-written rows with an encoded NaN token (fill_value=nan): every one of
    its 576 values must decode to NaN, so a read of such a row shows. Guards: a NaN amax taking the
    `scale > 0` guard's 1.0 and a NaN rope part turning finite."""
    dec = np.asarray(FP8_PAGES.decode(FP8_PAGES.encode(jnp.full((L + R,), jnp.nan))))
    assert np.isnan(dec).all()


# --- fp4 pages ----------------------------------------------------------------------------------
def fp4_latents(shape=(3, 5), seed=0):
    """Random tokens whose 16-blocks span 1e-2..1e4 (normal e4m3 scales), plus hand-made rows: e2m1
    rounding ties at scale 1, signed zeros, an all-zero block, a block whose scale rounds to 0, one with a
    subnormal scale, one that saturates (amax / 6 > 448), and first / second latent halves that differ."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape + (L + R,)).astype(np.float32)
    x[..., :L] *= np.exp(rng.uniform(-3, 8, shape + (L // 16,))).repeat(16, axis=-1).astype(np.float32)
    flat = x.reshape(-1, L + R)
    # Row 0, block 0: amax 6, so the scale is exactly 1 and the codes are the values' own e2m1 roundings.
    flat[0, :16] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -5.5, 0.3, -0.74, 4.0, 0.0, 1.5, -3.0]
    flat[0, 16:32] = 0.0  # all-zero block: scale 0, codes 0
    flat[0, 32:48] = -0.0
    flat[1, 48:64] = 0.005 * np.linspace(-1, 1, 16)  # amax / 6 = 8.3e-4 < 2^-10: the scale rounds to 0
    flat[1, 64:80] = 0.01 * np.linspace(-1, 1, 16)  # amax / 6 = 1.7e-3: the subnormal scale 2^-9
    flat[1, 80:96] = 5000.0 * np.linspace(-1, 1, 16)  # amax / 6 = 833 > 448: the scale saturates
    flat[2, 256:272] = 6.0 * 1.06  # amax / 6 = 1.06 rounds down to 1: x / s = 6.36 clips
    return x


def test_fp4_bytes_match_the_numpy_construction():
    """Guards: the two nibbles of a byte swapped, the pairing interleaved (value 2j, 2j + 1) instead of
    (j, j + L/2), a scale per 32 or 8 values, the scale rounded up or truncated instead of to nearest,
    e2m1 ties away from zero (0.25 -> 0.5, 2.5 -> 3, 5 -> 6), a missing clip to ±6, a scale that rounds
    to 0 dividing by 0, a saturating scale turned NaN (e4m3 has no infinity), -0.0 losing its sign bit,
    and scale / rope bytes misplaced."""
    x = fp4_latents()
    got = np.asarray(jax.jit(quantize_latent_fp4)(jnp.asarray(x)))
    assert got.dtype == np.uint8 and got.shape == (3, 5, 416)
    np.testing.assert_array_equal(got, fp4_bytes(x))
    flat = got.reshape(-1, 416)
    # by hand: row 0's block 0 sits in the low nibbles of bytes 0..15 (scale byte 256 = e4m3 1.0 = 0x38)
    assert flat[0, 256] == 0x38
    assert list(flat[0, :16] & 0xF) == [7, 0, 2, 2, 4, 4, 6, 6, 8, 0xF, 1, 9, 6, 0, 3, 0xD]
    assert flat[0, 257] == 0 and (flat[0, 16:32] & 0xF == 0).all()  # zero blocks: scale 0, codes 0
    assert flat[1, 259] == 0 and (flat[1, 48:64] & 0xF == 0).all()  # scale rounded to 0
    assert flat[1, 260] == 0x01 and flat[1, 261] == 0x7E  # subnormal 2^-9; saturated 448
    assert flat[2, 256 + 16] == 0x38 and (flat[2, :16] >> 4 == 7).all()  # 6.36 / 1 clipped to code 7
    np.testing.assert_array_equal(
        flat[:, 288:].view("<u2"), x.reshape(-1, L + R)[:, L:].astype(ml_dtypes.bfloat16).view("<u2")
    )


def test_fp4_round_trip_error_is_within_one_e2m1_step_of_the_scale():
    """|decoded - x| <= amax_k / 6 * 17/16 for every block with a normal scale (half the e2m1 top step 2
    times the scale, or a clip of at most 6/16 of it, with the scale 1/16 above amax / 6 at most), and the
    decode equals the numpy table decode. Guards: one scale for a whole token (blocks here differ by up to
    5e4), the scale not multiplied back, the nibbles read in the wrong order, the rope quantised."""
    x = fp4_latents(seed=1)
    stored = jax.jit(FP4_PAGES.encode)(jnp.asarray(x))
    dec = np.asarray(jax.jit(dequantize_latent_fp4)(stored))
    assert dec.dtype == np.float32 and dec.shape == x.shape
    np.testing.assert_array_equal(dec, fp4_values(fp4_bytes(x)))
    blocks = x[..., :L].reshape(x.shape[:-1] + (L // 16, 16))
    amax = np.abs(blocks).max(-1, keepdims=True)
    normal = ((amax / 6 >= 2.0**-6) & (amax / 6 <= 448))[..., 0]
    err = np.abs(dec[..., :L].reshape(blocks.shape) - blocks)
    bound = amax / 6 * (17 / 16)
    assert (err[normal] <= bound[normal]).all()
    assert (err.max(-1)[normal] / bound[..., 0][normal]).max() > 0.5  # the bound is the right size
    np.testing.assert_array_equal(dec[..., L:], x[..., L:].astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(FP4_PAGES.decode)(stored)), dec)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(FP4_PAGES.dequantize_reference)(stored)), dec.astype(ml_dtypes.bfloat16)
    )


def test_an_fp4_nan_token_decodes_to_nan_everywhere():
    """The cache's NaN-poisoned rows: e2m1 has no NaN, so the NaN must ride on the e4m3 scale (0x7F).
    Guards: a NaN amax taking the `scale > 0` guard and storing scale 0 (the row would read as zeros)."""
    dec = np.asarray(jax.jit(lambda x: FP4_PAGES.decode(FP4_PAGES.encode(x)))(jnp.full((L + R,), jnp.nan)))
    assert np.isnan(dec).all()


@pytest.mark.parametrize(
    "name, latent, rope, token_bytes",
    [
        ("fp8", 512, 64, 656),
        ("bf16", 512, 64, 1152),
        ("fp16", 512, 64, 1152),
        ("fp32", 512, 64, 2304),
        ("fp8", 256, 32, 256 + 8 + 64),
        ("bf16", 64, 16, 160),
        ("fp4", 512, 64, 416),
        ("fp4", 32, 16, 16 + 2 + 32),
    ],
)
def test_token_bytes_are_the_planners(name, latent, rope, token_bytes):
    """Guards: planned and allocated bytes drifting apart (two formulas for one number), and the width
    of an fp8 token miscounted (scales forgotten, rope in one byte)."""
    from mla_jax.capacity import latent_bytes_per_token_layer

    fmt = PageFormat(name, latent_dim=latent, rope_dim=rope)
    assert fmt.token_bytes == token_bytes == latent_bytes_per_token_layer(latent, rope, name)
    assert fmt.page_shape(64) == (64, fmt.width)
    assert fmt.width * jnp.dtype(fmt.storage_dtype).itemsize == token_bytes
    assert jnp.zeros(fmt.page_shape(64), fmt.storage_dtype).nbytes == 64 * token_bytes


def test_formats_are_static_values():
    """A format is a static argument of jitted code: hashable and compared by value."""
    assert FP8_PAGES.storage_dtype == jnp.uint8 and FP8_PAGES.width == 656 and FP8_PAGES.quantized
    assert BF16_PAGES.storage_dtype == jnp.bfloat16 and BF16_PAGES.width == 576 and not BF16_PAGES.quantized
    assert hash(PageFormat("fp8")) == hash(FP8_PAGES)
    assert FP8_PAGES.with_dims(256, 32) == PageFormat("fp8", 256, 32)


def test_page_format_of():
    assert page_format_of(jnp.zeros((2, 64, 656), jnp.uint8)).name == "fp8"
    assert page_format_of(jnp.zeros((2, 64, 656), jnp.uint8)).latent_dim == 512
    assert page_format_of(jnp.zeros((2, 4, 80), jnp.float32), rope_dim=16) == PageFormat("fp32", 64, 16)
    assert page_format_of(jnp.zeros((3, 576), jnp.bfloat16)).name == "bf16"
    assert page_format_of(jnp.zeros((2, 64, 416), jnp.uint8)) == FP4_PAGES
    assert page_format_of(jnp.zeros((2, 50), jnp.uint8), rope_dim=16) == PageFormat("fp4", 32, 16)


@pytest.mark.parametrize(
    "call, match",
    [
        pytest.param(
            lambda: FP8_PAGES.decode(jnp.zeros((2, 576), jnp.uint8)),
            "fp8 pages hold 656 elements a token, got last dim 576",
            id="decode-width",
        ),
        pytest.param(
            lambda: FP8_PAGES.encode(jnp.zeros((2, 656))),
            r"fp8 pages store 576 values a token \(512 latent \+ 64 rope\), got last dim 656",
            id="encode-width",
        ),
        pytest.param(
            lambda: BF16_PAGES.decode(jnp.zeros((2, 656), jnp.bfloat16)),
            "bf16 pages hold 576 elements a token, got last dim 656",
            id="bf16-decode-width",
        ),
        pytest.param(
            lambda: dequantize_latent_fp8(jnp.zeros((2, 600), jnp.uint8)),
            "last dim 600 is not an fp8 page row",
            id="dequantize-width",
        ),
        pytest.param(
            lambda: dequantize_latent_fp8(jnp.zeros((2, 656), jnp.int8)),
            "fp8 pages are uint8, got int8",
            id="dequantize-dtype",
        ),
        pytest.param(
            lambda: quantize_latent_fp8(jnp.zeros((2, 164))), "positive multiple of 128, got 100", id="quantize-width"
        ),
        pytest.param(
            lambda: PageFormat("fp8", latent_dim=200),
            "fp8 pages need latent_dim a positive multiple of 128 .* got 200",
            id="format-latent",
        ),
        pytest.param(
            lambda: PageFormat("bf16", rope_dim=-1), "rope_dim must be a non-negative integer, got -1", id="format-rope"
        ),
        pytest.param(
            lambda: FP8_PAGES.validate(jnp.zeros((2, 64, 576), jnp.uint8)),
            r"fp8 kv_pages must be \[num_pages, 64, 656\] \(page size 64\), got \(2, 64, 576\)",
            id="validate-shape",
        ),
        pytest.param(
            lambda: FP8_PAGES.validate(jnp.zeros((2, 64, 656), jnp.int8)),
            "fp8 kv_pages must be uint8, got int8",
            id="validate-dtype",
        ),
        pytest.param(
            lambda: page_format_of(jnp.zeros((2, 600), jnp.uint8)),
            "uint8 pages of last dim 600 are not fp8 or fp4 pages with rope_dim=64",
            id="format-of-width",
        ),
        pytest.param(
            lambda: page_format_of(jnp.zeros((2, 524), jnp.uint8)),
            r"uint8 pages of last dim 524 fit both fp8 \(L=384\) and fp4 \(L=704\) pages with rope_dim=64; "
            "pass the PageFormat explicitly",
            id="format-of-ambiguous",
        ),
        pytest.param(
            lambda: PageFormat("fp4", latent_dim=48),
            r"fp4 pages need latent_dim a positive multiple of 32 .* got 48",
            id="fp4-format-latent",
        ),
        pytest.param(
            lambda: quantize_latent_fp4(jnp.zeros((2, 64 + 48))),
            "fp4 pages need a latent width that is a positive multiple of 32, got 48",
            id="fp4-quantize-width",
        ),
        pytest.param(
            lambda: dequantize_latent_fp4(jnp.zeros((2, 656), jnp.uint8)),
            "last dim 656 is not an fp4 page row",
            id="fp4-dequantize-width",
        ),
        pytest.param(
            lambda: dequantize_latent_fp4(jnp.zeros((2, 416), jnp.int8)),
            "fp4 pages are uint8, got int8",
            id="fp4-dequantize-dtype",
        ),
        pytest.param(
            lambda: FP4_PAGES.decode(jnp.zeros((2, 656), jnp.uint8)),
            "fp4 pages hold 416 elements a token, got last dim 656",
            id="fp4-decode-width",
        ),
        pytest.param(
            lambda: page_format_of(jnp.zeros((2, 576), jnp.int8)),
            "pages of dtype int8 are in no known page format",
            id="format-of-dtype",
        ),
    ],
)
def test_bad_widths_are_one_line_errors(call, match):
    with pytest.raises(ValueError, match=match) as e:
        call()
    assert "\n" not in str(e.value)
