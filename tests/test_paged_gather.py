"""Tests of pallas_kernels.paged_gather: interpret mode and cross-lowering on CPU, the real kernel
on a Hopper GPU (``-m gpu``). The gather is a copy, so results must be bit-exact."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fp4_numpy import fp4_values
from fp8_numpy import fp8_values

from pallas_kernels import (
    BF16_PAGES,
    FP4_PAGES,
    FP8_PAGES,
    PagedGatherConfig,
    PageFormat,
    backend,
    paged_gather,
    paged_gather_reference,
    quantize_latent_fp4,
    quantize_latent_fp8,
)
from pallas_kernels.paged_gather import plan_chunks
from tests.tiers import gpu_full


def make_inputs(batch, max_pages, *, seed=0, spare_pages=2):
    """Random bf16 pages, NaN in pages no sequence owns, and a permuted block table."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + spare_pages
    kv = rng.standard_normal((num_pages, 64, 576), dtype=np.float32)
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    kv[np.setdiff1d(np.arange(num_pages), table)] = np.nan
    return jnp.asarray(kv, jnp.bfloat16), jnp.asarray(table)


def numpy_gather(kv, table, num_tokens):
    kv, table = np.asarray(kv), np.asarray(table)
    return np.stack([np.concatenate([kv[p] for p in row])[:num_tokens] for row in table])


def make_fp8_inputs(batch, max_pages, *, seed=0, spare_pages=2):
    """fp8 pages [num_pages, 64, 656] of random tokens (magnitudes over 1e-6..1e6, a zero block, -0.0),
    0xFF bytes (NaN in every part) in pages no sequence owns, and a permuted block table."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + spare_pages
    lat = rng.standard_normal((num_pages, 64, 576)).astype(np.float32)
    lat *= np.exp(rng.uniform(-14, 14, (num_pages, 64, 1))).astype(np.float32)
    lat[:, 3, 128:256] = 0.0
    lat[:, 5, 7] = -0.0
    pages = np.array(quantize_latent_fp8(jnp.asarray(lat)))
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    pages[np.setdiff1d(np.arange(num_pages), table)] = 0xFF
    return jnp.asarray(pages), jnp.asarray(table)


def make_fp4_inputs(batch, max_pages, *, seed=0, spare_pages=2):
    """fp4 pages [num_pages, 64, 416] of random tokens (16-blocks over 1e-3..1e3, a zero block, -0.0, the
    two latent halves of a token at different scales), 0xFF bytes (an e4m3 NaN scale for every block, NaN
    rope) in pages no sequence owns, and a permuted block table."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + spare_pages
    lat = rng.standard_normal((num_pages, 64, 576)).astype(np.float32)
    lat[..., :512] *= np.exp(rng.uniform(-7, 7, (num_pages, 64, 32))).repeat(16, -1).astype(np.float32)
    lat[..., 256:512] *= 3.0
    lat[:, 3, 32:48] = 0.0
    lat[:, 5, 300] = -0.0
    pages = np.array(jax.jit(quantize_latent_fp4)(jnp.asarray(lat)))
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    pages[np.setdiff1d(np.arange(num_pages), table)] = 0xFF
    return jnp.asarray(pages), jnp.asarray(table)


def test_reference_matches_numpy():
    kv, table = make_inputs(3, 4)
    got = paged_gather_reference(kv, table, num_tokens=200)
    np.testing.assert_array_equal(np.asarray(got), numpy_gather(kv, table, 200))


@pytest.mark.parametrize(
    "batch,max_pages,num_tokens,chunks,steps",
    [
        (2, 5, 320, 2, 3),  # whole pages, uneven chunks (3 + 2 pages)
        (3, 6, 200, None, 2),  # cut inside the 4th page; the table's last pages are never read
        (1, 3, 1, 1, 2),  # a single token
        (2, 2, 65, 4, 3),  # more chunks asked than pages
    ],
)
def test_interpret_is_bit_exact(batch, max_pages, num_tokens, chunks, steps):
    kv, table = make_inputs(batch, max_pages, seed=num_tokens)
    # Poison the table entries past num_tokens: the kernel must not follow them.
    used = -(-num_tokens // 64)
    table = table.at[:, used:].set(-1)
    got = paged_gather(
        kv,
        table,
        num_tokens=num_tokens,
        impl="interpret",
        config=PagedGatherConfig(chunks=chunks, max_concurrent_steps=steps),
    )
    assert got.shape == (batch, num_tokens, 576) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), numpy_gather(kv, table[:, :used], num_tokens))


@pytest.mark.parametrize(
    "batch,max_pages,num_tokens", [(1, 512, 32768), (128, 64, 4096), (256, 130, 8300), (3, 7, 100)]
)
def test_cross_lowers_for_sm90(batch, max_pages, num_tokens):
    shapes = (
        jax.ShapeDtypeStruct((batch * max_pages, 64, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
    )
    fn = lambda kv, bt: paged_gather(kv, bt, num_tokens=num_tokens, impl="kernel")
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_fp8_reference_matches_numpy():
    """Guards: the reference gathering the wrong pages or decoding another layout than the one
    documented (checked against a numpy decode, never against the code's own)."""
    kv, table = make_fp8_inputs(2, 3)
    got = paged_gather_reference(kv, table, num_tokens=150, page_format=FP8_PAGES)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 150, 576)
    np.testing.assert_array_equal(np.asarray(got), fp8_values(numpy_gather(kv, table, 150), dtype=ml_dtypes.bfloat16))


@pytest.mark.parametrize(
    "batch,max_pages,num_tokens,chunks,steps,staging",
    [
        (2, 3, 150, None, 3, 1),  # cut inside the 3rd page, 3 pages in flight
        (3, 2, 128, 2, 2, 1),  # whole pages, one page a CTA
        (1, 2, 1, None, 2, 1),  # a single token
        (2, 5, 300, 1, 2, 2),  # two staging buffers taken in turn over 5 pages, the last one cut
    ],
)
def test_fp8_interpret_is_bit_exact(batch, max_pages, num_tokens, chunks, steps, staging):
    """The fp8 body against the numpy decode, bit for bit (NaN where NaN). Guards: a scale applied
    to the wrong 128-block or token, the rope read from the wrong bytes (elements 264.. of the bf16
    view), the two latent halves swapped, a last page stored whole past num_tokens, a table entry
    past num_tokens followed (they are -1 here), a page no sequence owns read (it is all NaN), and
    with two staging buffers a page stored from the other page's buffer."""
    _interpret_bit_exact(
        FP8_PAGES,
        make_fp8_inputs,
        fp8_values,
        batch,
        max_pages,
        num_tokens,
        PagedGatherConfig(chunks=chunks, max_concurrent_steps=steps, staging_buffers=staging),
    )


def _interpret_bit_exact(fmt, make_inputs, numpy_values, batch, max_pages, num_tokens, config):
    """The quantized body of `fmt` in the interpreter against the numpy decode (`numpy_values`), bit for
    bit, with no NaN (table entries past num_tokens are -1; pages no sequence owns are NaN) -> (kv, table,
    the kernel's output)."""
    kv, table = make_inputs(batch, max_pages, seed=num_tokens)
    used = -(-num_tokens // 64)
    table = table.at[:, used:].set(-1)
    got = paged_gather(kv, table, num_tokens=num_tokens, page_format=fmt, impl="interpret", config=config)
    assert got.shape == (batch, num_tokens, 576) and got.dtype == jnp.bfloat16
    want = numpy_values(numpy_gather(kv, table[:, :used], num_tokens), dtype=ml_dtypes.bfloat16)
    assert not np.isnan(want.astype(np.float32)).any()
    np.testing.assert_array_equal(np.asarray(got), want)
    return kv, table, got


@pytest.mark.parametrize(
    "batch,max_pages,num_tokens,staging", [(1, 512, 32768, 1), (128, 64, 4096, 1), (3, 7, 100, 1), (128, 64, 4096, 2)]
)
def test_fp8_cross_lowers_for_sm90(batch, max_pages, num_tokens, staging):
    """Guards the SMEM budget too: two staging buffers with three 41 KB stages would not fit."""
    shapes = (
        jax.ShapeDtypeStruct((batch * max_pages, 64, 656), jnp.uint8),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
    )
    config = PagedGatherConfig(staging_buffers=staging, max_concurrent_steps=3 if staging == 1 else 2)
    fn = lambda kv, bt: paged_gather(kv, bt, num_tokens=num_tokens, page_format=FP8_PAGES, impl="kernel", config=config)
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1 and "ui8" in text


def test_fp4_reference_matches_numpy():
    """Guards: the reference gathering the wrong pages or decoding another fp4 layout than the documented
    one (nibbles swapped, pairs interleaved, a scale per 32), against the numpy table decode."""
    kv, table = make_fp4_inputs(2, 3)
    got = jax.jit(lambda kv, t: paged_gather_reference(kv, t, num_tokens=150, page_format=FP4_PAGES))(kv, table)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 150, 576)
    np.testing.assert_array_equal(np.asarray(got), fp4_values(numpy_gather(kv, table, 150), dtype=ml_dtypes.bfloat16))


@pytest.mark.parametrize(
    "batch,max_pages,num_tokens,chunks,steps,staging",
    [
        (2, 3, 150, None, 3, 1),  # ragged: cut inside the 3rd page, 3 pages in flight, one page a CTA
        (1, 3, 130, 1, 2, 2),  # one CTA over 3 pages: two staging buffers in turn, the last page 2 tokens
    ],
)
def test_fp4_interpret_is_bit_exact(batch, max_pages, num_tokens, chunks, steps, staging):
    """The fp4 body against the numpy table decode, bit for bit, with no NaN. Guards: low and high nibbles
    swapped or sent to the wrong half of the latent, a 16-block given the scale of its neighbour (or of the
    other half's block), the e2m1 bit trick off for the 0.5 subnormal or the sign, the scales or the rope
    read from the wrong bytes (bf16 element 144..), a last page stored whole past num_tokens, a table entry
    past num_tokens followed (-1 here), a page no sequence owns read (all NaN), and a page stored from the
    other staging buffer."""
    kv, table, got = _interpret_bit_exact(
        FP4_PAGES,
        make_fp4_inputs,
        fp4_values,
        batch,
        max_pages,
        num_tokens,
        PagedGatherConfig(chunks=chunks, max_concurrent_steps=steps, staging_buffers=staging),
    )
    # and the kernel against its own jnp reference (`op` vs `op_reference`), exactly
    chex.assert_trees_all_equal(got, paged_gather_reference(kv, table, num_tokens=num_tokens, page_format=FP4_PAGES))


@pytest.mark.parametrize(
    "batch,max_pages,num_tokens,staging,steps",
    [(1, 512, 32768, None, None), (128, 64, 4096, None, None), (3, 7, 100, 1, 3)],
)
def test_fp4_cross_lowers_for_sm90(batch, max_pages, num_tokens, staging, steps):
    """The fp4 body through the whole Mosaic GPU lowering for sm_90 (TMA boxes of the 416-byte rows, the
    register layouts, the SMEM budget: 26 KB stages + 72 KB staging buffers) for the default config and
    for one staging buffer with 3 steps. Guards a box or layout the lowering refuses, which interpret
    mode does not check."""
    shapes = (
        jax.ShapeDtypeStruct((batch * max_pages, 64, 416), jnp.uint8),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
    )
    config = PagedGatherConfig(staging_buffers=staging, max_concurrent_steps=steps)
    fn = lambda kv, bt: paged_gather(kv, bt, num_tokens=num_tokens, page_format=FP4_PAGES, impl="kernel", config=config)
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1 and "ui8" in text


def test_config_defaults_per_page_format():
    """fp8 pages default to two staging buffers and 2 steps (3 steps would not fit beside them);
    bf16 pages to 3 steps. Guards a default that overflows SMEM or drops the faster fp8 schedule."""
    assert (
        PagedGatherConfig().for_format(FP8_PAGES).staging_buffers,
        PagedGatherConfig().for_format(FP8_PAGES).max_concurrent_steps,
    ) == (2, 2)
    assert PagedGatherConfig().for_format(BF16_PAGES).max_concurrent_steps == 3
    assert PagedGatherConfig(max_concurrent_steps=3).for_format(FP8_PAGES).staging_buffers == 1
    assert PagedGatherConfig(staging_buffers=1).for_format(FP8_PAGES).max_concurrent_steps == 3


def test_plan_chunks():
    assert plan_chunks(1, 64, PagedGatherConfig()) == (64, 1)
    assert plan_chunks(128, 64, PagedGatherConfig()) == (3, 22)
    assert plan_chunks(4, 10, PagedGatherConfig(chunks=4)) == (4, 3)
    assert plan_chunks(4, 9, PagedGatherConfig(chunks=4)) == (3, 3)  # no empty chunk


def test_invalid_inputs_raise():
    kv, table = make_inputs(1, 2)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[1, 128\].* got 129"):
        paged_gather(kv, table, num_tokens=129, impl="interpret")
    with pytest.raises(ValueError, match="num_tokens must be a Python int"):
        paged_gather(kv, table, num_tokens=jnp.int32(3), impl="interpret")
    with pytest.raises(ValueError, match=r"page size 64\), got \(4, 32, 576\)"):
        paged_gather(kv[:, :32], table, num_tokens=10, impl="interpret")
    with pytest.raises(ValueError, match=r"impl='interpret': .*page format fp32 \(the gather kernel reads bf16"):
        paged_gather(kv.astype(jnp.float32), table, num_tokens=10, impl="interpret")
    with pytest.raises(ValueError, match="block_table must be int32"):
        paged_gather(kv, table.astype(jnp.int16), num_tokens=10, impl="interpret")
    with pytest.raises(ValueError, match="max_concurrent_steps must be None, 2 or 3 .* got 4"):
        PagedGatherConfig(max_concurrent_steps=4)
    with pytest.raises(ValueError, match="staging_buffers must be None, 1 or 2, got 3"):
        PagedGatherConfig(staging_buffers=3)
    with pytest.raises(ValueError, match="leaves room for max_concurrent_steps <= 2 fp8 stages of 41 KB, got 3"):
        PagedGatherConfig(staging_buffers=2, max_concurrent_steps=3)


def test_page_format_hook():
    """Guards: a format given where its pages are not (bf16 pages read as fp8), a string accepted as
    a format, an unknown format name accepted, widths the gather does not read, and a format the kernel
    has no body for: refused for "interpret" / "kernel", read by the reference under "auto"."""
    kv, table = make_inputs(1, 2)
    with pytest.raises(ValueError, match="page format 'fp8_e4m3' is unknown"):
        PageFormat(name="fp8_e4m3")
    with pytest.raises(ValueError, match=r"fp8 kv_pages must be \[num_pages, 64, 656\]"):
        paged_gather(kv, table, num_tokens=10, page_format=FP8_PAGES, impl="reference")
    with pytest.raises(ValueError, match="page_format must be a PageFormat"):
        paged_gather(kv, table, num_tokens=10, page_format="bf16", impl="reference")
    got = paged_gather(kv, table, num_tokens=10, page_format=BF16_PAGES, impl="reference")
    np.testing.assert_array_equal(np.asarray(got), numpy_gather(kv, table, 10))
    narrow = FP8_PAGES.with_dims(256, 32)
    with pytest.raises(ValueError, match="reads tokens of 512 latent . 64 rope values, got 256 . 32 .fp8 pages."):
        paged_gather(jnp.zeros((4, 64, narrow.width), jnp.uint8), table, num_tokens=10, page_format=narrow)
    fp32 = kv.astype(jnp.float32)
    with pytest.raises(ValueError, match=r"impl='interpret': .*page format fp32 \(the gather kernel reads bf16, fp8"):
        paged_gather(fp32, table, num_tokens=10, impl="interpret")
    got = paged_gather(fp32, table, num_tokens=10, impl="auto")  # the reference reads every format
    np.testing.assert_array_equal(np.asarray(got), numpy_gather(kv, table, 10))


requires_hopper = pytest.mark.skipif(not backend.on_hopper(), reason="needs a Hopper (sm_90) GPU")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("batch,max_pages,num_tokens", [(32, 64, 4096), (5, 40, 2500), (1, 300, 1)])
@pytest.mark.parametrize("chunks,steps", gpu_full([(None, 3), (7, 2)], [(7, 2)]))
def test_gpu_kernel_is_bit_exact(batch, max_pages, num_tokens, chunks, steps):
    kv, table = make_inputs(batch, max_pages, seed=batch)
    got = paged_gather(
        kv,
        table,
        num_tokens=num_tokens,
        impl="kernel",
        config=PagedGatherConfig(chunks=chunks, max_concurrent_steps=steps),
    )
    want = paged_gather_reference(kv, table, num_tokens=num_tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize(
    "batch,max_pages,num_tokens", gpu_full([(32, 64, 4096), (5, 40, 2500), (1, 300, 1)], [(5, 40, 2500)])
)
@pytest.mark.parametrize(
    "chunks,steps,staging", gpu_full([(None, 3, 1), (7, 2, 1), (None, 2, 2), (7, 2, 2)], [(None, 3, 1), (7, 2, 2)])
)
def test_gpu_quantized_kernel_is_bit_exact(fmt, batch, max_pages, num_tokens, chunks, steps, staging):
    """The fp8 and fp4 bodies on the GPU against the numpy decode, bit for bit."""
    make, values, page_format = {
        "fp8": (make_fp8_inputs, fp8_values, FP8_PAGES),
        "fp4": (make_fp4_inputs, fp4_values, FP4_PAGES),
    }[fmt]
    kv, table = make(batch, max_pages, seed=batch)
    got = paged_gather(
        kv,
        table,
        num_tokens=num_tokens,
        page_format=page_format,
        impl="kernel",
        config=PagedGatherConfig(chunks=chunks, max_concurrent_steps=steps, staging_buffers=staging),
    )
    want = values(numpy_gather(kv, table, num_tokens), dtype=ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(got), want)
