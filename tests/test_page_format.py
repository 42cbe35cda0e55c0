"""Tests of pallas_kernels.page_format: the fp8 byte layout against a numpy / ml_dtypes construction
from the documented layout (tests/fp8_numpy.py, never the code under test), the round-trip error
bound, zero blocks, byte counts against the capacity planner, and one-line errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8_numpy import fp8_bytes, fp8_values
from pallas_kernels import (BF16_PAGES, FP8_PAGES, PageFormat, dequantize_latent_fp8, page_format_of,
                            quantize_latent_fp8)

L, R = 512, 64


def adversarial_latents(shape=(3, 5), seed=0):
  """Random tokens whose 128-blocks span 16 orders of magnitude, plus hand-made rows: signed zeros,
  an all-zero block, e4m3 rounding ties (normal and subnormal) and a block whose amax is negative."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape + (L + R,)).astype(np.float32)
  x[..., :L] *= np.exp(rng.uniform(-18, 18, shape + (4,))).repeat(128, axis=-1).astype(np.float32)
  flat = x.reshape(-1, L + R)
  flat[0, :128] = 0.0                                  # all-zero block
  flat[0, 128:256] = -0.0                              # all negative zeros: bytes 0x80, scale 0
  flat[1, 3] = -0.0                                    # one -0.0 in a live block
  # Block 0 of row 2 has amax 448 (scale exactly 1): the quotients are the values themselves.
  ties = [448.0, 1.0625, 1.1875, 17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11, 464.0 / 2, -0.0]
  flat[2, :128] = 0.5
  flat[2, :len(ties)] = ties
  flat[3, 256:384] = np.linspace(-3.0, 1.0, 128)      # amax from a negative value
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
  assert (flat[0, 128:256] == 0x80).all() and flat[1, 3] == 0x80      # e4m3 signed zeros
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
  np.testing.assert_array_equal(dec, fp8_values(fp8_bytes(x)))   # the decode is the documented one
  blocks = x[..., :L].reshape(x.shape[:-1] + (4, 128))
  err = np.abs(dec[..., :L].reshape(blocks.shape) - blocks)
  bound = np.abs(blocks).max(-1, keepdims=True) * (16 / 448) * (1 + 2.0 ** -20)
  assert (err <= bound).all(), float((err / np.maximum(bound, 1e-45)).max())
  live = bound[..., 0] > 0
  assert (err.max(-1)[live] / bound[..., 0][live]).max() > 0.5   # the bound is the right size, not loose
  np.testing.assert_array_equal(dec[..., L:], x[..., L:].astype(ml_dtypes.bfloat16).astype(np.float32))
  # through the PageFormat hooks, as the cache and paged_gather's reference call them
  np.testing.assert_array_equal(np.asarray(FP8_PAGES.decode(FP8_PAGES.encode(jnp.asarray(x)))), dec)
  np.testing.assert_array_equal(np.asarray(FP8_PAGES.dequantize_reference(FP8_PAGES.encode(jnp.asarray(x)))),
                                dec.astype(ml_dtypes.bfloat16))


def test_all_zero_blocks_have_scale_zero_and_decode_to_zero():
  """Guards: 0 / 0 = NaN for an all-zero block (the scale must be 0 and the division guarded), and a
  zero block spilling into its neighbours' scales."""
  x = np.zeros((2, L + R), np.float32)
  x[0, 128:256] = np.linspace(-1, 1, 128)
  stored = np.asarray(quantize_latent_fp8(jnp.asarray(x)))
  scales = stored[:, L:L + 16].copy().view("<f4")
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


@pytest.mark.parametrize("name, latent, rope, token_bytes", [
    ("fp8", 512, 64, 656), ("bf16", 512, 64, 1152), ("fp16", 512, 64, 1152), ("fp32", 512, 64, 2304),
    ("fp8", 256, 32, 256 + 8 + 64), ("bf16", 64, 16, 160)])
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
  assert hash(PageFormat("fp8", kernel_supported=FP8_PAGES.kernel_supported)) == hash(FP8_PAGES)
  assert FP8_PAGES.with_dims(256, 32) == PageFormat("fp8", FP8_PAGES.kernel_supported, 256, 32)


def test_page_format_of():
  assert page_format_of(jnp.zeros((2, 64, 656), jnp.uint8)).name == "fp8"
  assert page_format_of(jnp.zeros((2, 64, 656), jnp.uint8)).latent_dim == 512
  assert page_format_of(jnp.zeros((2, 4, 80), jnp.float32), rope_dim=16) == PageFormat("fp32", True, 64, 16)
  assert page_format_of(jnp.zeros((3, 576), jnp.bfloat16)).name == "bf16"


@pytest.mark.parametrize("call, match", [
    pytest.param(lambda: FP8_PAGES.decode(jnp.zeros((2, 576), jnp.uint8)),
                 "fp8 pages hold 656 elements a token, got last dim 576", id="decode-width"),
    pytest.param(lambda: FP8_PAGES.encode(jnp.zeros((2, 656))),
                 r"fp8 pages store 576 values a token \(512 latent \+ 64 rope\), got last dim 656", id="encode-width"),
    pytest.param(lambda: BF16_PAGES.decode(jnp.zeros((2, 656), jnp.bfloat16)),
                 "bf16 pages hold 576 elements a token, got last dim 656", id="bf16-decode-width"),
    pytest.param(lambda: dequantize_latent_fp8(jnp.zeros((2, 600), jnp.uint8)),
                 "last dim 600 is not an fp8 page row", id="dequantize-width"),
    pytest.param(lambda: dequantize_latent_fp8(jnp.zeros((2, 656), jnp.int8)),
                 "fp8 pages are uint8, got int8", id="dequantize-dtype"),
    pytest.param(lambda: quantize_latent_fp8(jnp.zeros((2, 164))),
                 "positive multiple of 128, got 100", id="quantize-width"),
    pytest.param(lambda: PageFormat("fp8", latent_dim=200),
                 "fp8 pages need latent_dim a positive multiple of 128 .* got 200", id="format-latent"),
    pytest.param(lambda: PageFormat("bf16", rope_dim=-1), "rope_dim must be a non-negative integer, got -1",
                 id="format-rope"),
    pytest.param(lambda: FP8_PAGES.validate(jnp.zeros((2, 64, 576), jnp.uint8)),
                 r"fp8 kv_pages must be \[num_pages, 64, 656\] \(page size 64\), got \(2, 64, 576\)",
                 id="validate-shape"),
    pytest.param(lambda: FP8_PAGES.validate(jnp.zeros((2, 64, 656), jnp.int8)),
                 "fp8 kv_pages must be uint8, got int8", id="validate-dtype"),
    pytest.param(lambda: page_format_of(jnp.zeros((2, 600), jnp.uint8)),
                 "uint8 pages of last dim 600 are not fp8 pages with rope_dim=64", id="format-of-width"),
    pytest.param(lambda: page_format_of(jnp.zeros((2, 576), jnp.int8)),
                 "pages of dtype int8 are in no known page format", id="format-of-dtype"),
])
def test_bad_widths_are_one_line_errors(call, match):
  with pytest.raises(ValueError, match=match) as e:
    call()
  assert "\n" not in str(e.value)
