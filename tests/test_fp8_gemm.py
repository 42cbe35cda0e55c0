"""Tests of pallas_kernels.fp8_gemm (block-scaled FP8 GEMM, DeepSeek-V3's recipe, Mosaic GPU).

CPU (default): the quantizer and the weight dequantization against numpy loops; the kernel in the Pallas
Mosaic GPU interpreter against the same-recipe reference (prefill split, decode split with padded rows,
N not a multiple of 128, one CTA walking every tile); cross-lowering for sm_90 at DeepSeek-V3 shapes (SMEM,
TMA boxes, 8-bit wgmma operand rules and layouts, which the interpreter does not check); input validation
and the "auto" fallback. GPU (``-m gpu``, Hopper only): the kernel at V3 shapes against both references.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.fp8_gemm as fg
from pallas_kernels import backend
from pallas_kernels.fp8_gemm import (
    Fp8MatmulConfig,
    default_config,
    dequantize_blocks,
    fp8_matmul,
    fp8_matmul_problems,
    fp8_matmul_reference,
    quantize_activations,
    smem_bytes,
)
from tests.tiers import gpu_full

# DeepSeek-V3's projections (N, K): q_a, q_b, kv_a, wo, MLP gate/up, down, routed expert up, down.
V3_SHAPES = {
    "q_a": (1536, 7168),
    "q_b": (24576, 1536),
    "kv_a": (576, 7168),
    "wo": (7168, 16384),
    "gate_up": (18432, 7168),
    "down": (7168, 18432),
    "expert_up": (2048, 7168),
    "expert_down": (7168, 2048),
}


def make_inputs(M, N, K, *, seed=0):
    """x bf16 [M, K] whose 128-column blocks differ in magnitude by up to 2^6 (a wrong activation scale
    shows), e4m3 weights and block scales spread over 2^-10..2^-4 (a scale taken from the wrong block,
    row or column shows)."""
    rng = np.random.default_rng(seed)
    Kb, Nb = -(-K // 128), -(-N // 128)
    x = rng.standard_normal((M, K)) * np.repeat(2.0 ** rng.integers(-3, 4, (M, Kb)), 128, axis=1)[:, :K]
    w = rng.standard_normal((N, K)) * 32
    s = 2.0 ** rng.uniform(-10, -4, (Nb, Kb))
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.float8_e4m3fn), jnp.asarray(s, jnp.float32)


def assert_close(got, want, name="y"):
    """Same recipe: bf16 rounding of fp32 sums apart; every element within 1 % of the tensor's largest
    magnitude plus 1 % of its own, relative Frobenius error below 0.5 %."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), f"{name}: non-finite values"
    chex.assert_trees_all_close(got, want, atol=1e-2 * float(np.abs(want).max()), rtol=1e-2, custom_message=name)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 5e-3, f"{name}: relative error {rel}"


# ------------------------------------------------------------------------------------------------
# The recipe (plain jnp)
# ------------------------------------------------------------------------------------------------


def test_quantize_activations_is_v3_act_quant():
    """Per (row, 128-column block): scale = amax / 448 and xq = x / scale in e4m3, a last partial
    block by its own amax, an all-zero block finite. Catches the scale taken per row or per column
    instead of per tile, scale inverted (amax * 448), a partial block read as a full one, 0/0."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 300)).astype(np.float32) * 5
    x[1, 128:256] = 0.0
    xq, s = quantize_activations(jnp.asarray(x))
    assert xq.shape == (3, 300) and xq.dtype == jnp.float8_e4m3fn and s.shape == (3, 3)
    for r in range(3):
        for b in range(3):
            blk = x[r, b * 128 : (b + 1) * 128]
            want = max(np.abs(blk).max(), 1e-4) / 448.0
            np.testing.assert_allclose(float(s[r, b]), want, rtol=1e-6)
    assert float(np.abs(np.asarray(xq, np.float32)).max()) == 448.0  # each block's amax maps to e4m3's max
    back = np.asarray(dequantize_blocks(xq, s))
    np.testing.assert_allclose(back, x, atol=np.abs(x).max() / 16)  # e4m3: 3 mantissa bits
    assert not np.asarray(xq, np.float32)[1, 128:256].any()


def test_weight_dequantization_and_the_two_references():
    """dequantize_blocks against a numpy loop with N and K not multiples of 128 (partial scale
    blocks), and the same-recipe reference within fp8 error of the exact product. Catches w_scale
    read transposed ([Kb, Nb]) or by the wrong block, and a reference that skips the activations'
    quantization (then the two agree too closely) or applies it wrong (then they differ grossly)."""
    x, w, s = make_inputs(64, 192, 320, seed=2)
    wn, sn = np.asarray(w, np.float32), np.asarray(s)
    want = np.empty_like(wn)
    for n in range(192):
        for k in range(320):
            want[n, k] = wn[n, k] * sn[n // 128, k // 128]
    np.testing.assert_array_equal(np.asarray(dequantize_blocks(w, s)), want)
    same = np.asarray(fp8_matmul_reference(x, w, s), np.float32)
    exact = np.asarray(fp8_matmul_reference(x, w, s, quantize_x=False), np.float32)
    np.testing.assert_allclose(exact, np.asarray(x, np.float32) @ want.T, rtol=1e-2, atol=1e-2 * np.abs(exact).max())
    rel = np.linalg.norm(same - exact) / np.linalg.norm(exact)
    assert 5e-3 < rel < 6e-2, rel


# ------------------------------------------------------------------------------------------------
# Interpret mode (CPU): the kernel's arithmetic
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "M, N, K, config, sms",
    [
        (128, 256, 384, None, None),
        (40, 256, 256, None, None),
        (64, 192, 384, Fp8MatmulConfig(block_m=64, block_n=64, max_concurrent_steps=2), 1),
    ],
    ids=["prefill-128x128-tiles", "decode-40-rows-wg-side-by-side", "n192-one-cta-walks-6-tiles"],
)
def test_interpret_matches_same_recipe_reference(monkeypatch, M, N, K, config, sms):
    """The kernel in the interpreter against the same-recipe reference.

    prefill: default config (warpgroups stacked along M, 128-column blocks), K = 3 blocks through 3
    stages: catches the promotion applied once at the end instead of per K block (wrong under
    per-block scales), the x scale of the wrong warpgroup's rows, a K block skipped or repeated.
    decode: M = 40 (padded to the 64-row CTA), warpgroups side by side (64 columns each): catches the
    second warpgroup's columns or weight scale (the next 64-column group, same 128-block) mis-indexed,
    padded rows leaking into the output.
    n192: N = 192 (a partial weight-scale block), 2 tiles of M x 3 of N walked by one CTA (a
    persistent grid of 1) through 2 stages over 3 K blocks, with the race detector: catches a stage
    refilled while a warpgroup still reads its scales (no proxy fence before its release), the
    epilogue's SMEM reused before its TMA store read it, the pipeline state carried wrongly across tiles,
    the tile order (planar snake) visiting a tile twice or never, the weight scales of the partial
    block (columns 128..191) dropped by the wrapper's per-16-column repeat."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    if sms is not None:
        monkeypatch.setattr(fg, "H100_SMS", sms)
        monkeypatch.setattr(fg, "INTERPRET_PARAMS", fg.plgpu.InterpretGPUParams(detect_races=True))
    x, w, s = make_inputs(M, N, K, seed=M + N + K)
    got = fp8_matmul(x, w, s, impl="interpret", config=config)
    assert got.shape == (M, N) and got.dtype == jnp.bfloat16
    assert_close(got, fp8_matmul_reference(x, w, s))
    if sms is not None:
        assert not interpret_pallas_call.get_races().races_found


# ------------------------------------------------------------------------------------------------
# Cross-lowering for sm_90 (CPU)
# ------------------------------------------------------------------------------------------------


def _lower(M, N, K, config=None, fn=None):
    shapes = (
        jax.ShapeDtypeStruct((M, K), jnp.bfloat16),
        jax.ShapeDtypeStruct((N, K), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((-(-N // 128), -(-K // 128)), jnp.float32),
    )
    fn = fn or (lambda x, w, s: fp8_matmul(x, w, s, impl="kernel", config=config))
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("M, name", [(4096, "gate_up"), (4096, "kv_a"), (32, "wo")])
def test_default_config_cross_lowers_at_v3_shapes(M, name):
    """The default configs (prefill 128x128 CTA with 5 stages; kv_a's 576 columns in 64-column blocks;
    decode 64x128 CTA with 8 stages) lower for sm_90 into one Mosaic GPU kernel: catches an SMEM
    overflow, a TMA box or GMEM stride the hardware refuses (the 16-byte weight-scale rows), an 8-bit
    wgmma operand that is not K-major or not 128-byte swizzled, a layout the inference rejects (the
    per-row scale vector)."""
    N, K = V3_SHAPES[name]
    assert fp8_matmul_problems(M, N, K) == []
    assert _lower(M, N, K).as_text().count("custom_call @mosaic_gpu") == 1


def test_smem_estimate_and_lowering_agree_on_an_overflow():
    """6 stages of 128x128 tiles need more than 227 KB: `smem_bytes` says so, `fp8_matmul_problems`
    refuses the config in one line, and the kernel's own lowering overflows too; 5 stages (the default)
    fit. Catches the estimate drifting from the kernel's allocation."""
    over, fits = Fp8MatmulConfig(max_concurrent_steps=6), Fp8MatmulConfig(max_concurrent_steps=5)
    assert smem_bytes(fits) <= fg.SMEM_BYTES < smem_bytes(over)
    assert fp8_matmul_problems(4096, 7168, 2048, fits) == []
    (line,) = fp8_matmul_problems(4096, 7168, 2048, over)
    assert "bytes of SMEM, over the 232448" in line
    M, N, K = 256, 256, 1024
    raw = lambda x, w, s: fg._fp8_gemm(  # noqa: E731
        quantize_activations(x)[0],
        jnp.zeros((K // 128, M), jnp.float32),
        w,
        jnp.zeros((K // 128, N // 16), jnp.float32),
        config=over,
        num_sms=132,
        interpret=None,
    )
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        _lower(M, N, K, fn=raw)


# ------------------------------------------------------------------------------------------------
# Validation and dispatch
# ------------------------------------------------------------------------------------------------


def _arr(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


W = jnp.float8_e4m3fn


@pytest.mark.parametrize(
    "x, w, s, kw, message",
    [
        (_arr(64, 256, dtype=jnp.float32), _arr(128, 256, dtype=W), _arr(1, 2, dtype=jnp.float32), {}, "x must be bf"),
        (_arr(64, 256), _arr(128, 256), _arr(1, 2, dtype=jnp.float32), {}, "w must be float8_e4m3fn"),
        (_arr(64, 256), _arr(128, 384, dtype=W), _arr(1, 3, dtype=jnp.float32), {}, r"w must be \[N, K=256\]"),
        (
            _arr(64, 256),
            _arr(128, 256, dtype=W),
            _arr(2, 1, dtype=jnp.float32),
            {},
            r"w_scale must be float32 \(1, 2\)",
        ),
        (
            _arr(64, 200),
            _arr(128, 200, dtype=W),
            _arr(1, 2, dtype=jnp.float32),
            {},
            "K = 200 is not a positive multiple",
        ),
        (_arr(64, 256), _arr(96, 256, dtype=W), _arr(1, 2, dtype=jnp.float32), {}, "N = 96 is not a positive multiple"),
        (_arr(64, 256), _arr(128, 256, dtype=W), _arr(1, 2, dtype=jnp.float32), dict(config=1), "config must be"),
        (_arr(64, 256), _arr(128, 256, dtype=W), _arr(1, 2, dtype=jnp.float32), dict(impl="gpu"), "impl must be one"),
    ],
)
def test_bad_inputs_are_one_line_value_errors(x, w, s, kw, message):
    """Each limit is checked up front with a message naming the value and the limit, instead of an
    error from inside the lowering or a kernel that reads past a ragged K or N."""
    kw = dict(dict(impl="kernel"), **kw)
    with pytest.raises(ValueError, match=message) as e:
        jax.eval_shape(lambda x, w, s: fp8_matmul(x, w, s, **kw), x, w, s)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(block_m=96), "block_m must be 64 or 128, got 96"),
        (dict(block_n=256), "block_n must be 64 or 128, got 256"),
        (dict(block_m=128, block_n=128), "block_m \\* block_n must be <= 8192"),
        (dict(wg_split="k"), "wg_split must be 'm' or 'n'"),
        (dict(max_concurrent_steps=1), r"max_concurrent_steps must be an int in \[2, 8\], got 1"),
    ],
)
def test_bad_config_is_refused(kw, message):
    """The config's own limits, at construction."""
    with pytest.raises(ValueError, match=message):
        Fp8MatmulConfig(**kw)


def test_auto_takes_the_kernel_only_where_it_serves(monkeypatch):
    """On a Hopper GPU "auto" runs the kernel for a served shape and the reference for one the kernel
    refuses (K = 200); off Hopper always the reference. Catches "auto" sending a ragged K to the kernel
    (it would read past the last K block) or skipping the kernel where it serves."""
    calls = []
    monkeypatch.setattr(
        fg, "_fp8_gemm", lambda xq, *a, **k: calls.append(xq.shape) or jnp.zeros((64, 128), jnp.bfloat16)
    )
    served = (_arr(64, 256), _arr(128, 256, dtype=W), _arr(1, 2, dtype=jnp.float32))
    refused = (_arr(64, 200), _arr(128, 200, dtype=W), _arr(1, 2, dtype=jnp.float32))
    trace = lambda args: jax.eval_shape(lambda *a: fp8_matmul(*a), *args)  # a fresh trace each call
    trace(served)
    assert calls == []  # CPU: the reference
    monkeypatch.setattr(backend, "on_hopper", lambda: True)
    monkeypatch.setattr(fg, "_num_sms", lambda: 132)
    trace(served)
    assert calls == [(64, 256)]
    assert trace(refused).shape == (64, 128)
    assert calls == [(64, 256)]


def test_default_configs_serve_every_v3_projection():
    """At prefill (4096 rows) and decode (1, 32 rows) the default config serves all of V3's projections
    and fits SMEM: catches a default whose CTA tile does not divide kv_a's 576 columns."""
    for M in (1, 32, 4096):
        for name, (N, K) in V3_SHAPES.items():
            assert fp8_matmul_problems(M, N, K) == [], (M, name)
            assert smem_bytes(default_config(M, N, K)) <= fg.SMEM_BYTES


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

requires_hopper = pytest.mark.skipif(not backend.on_hopper(), reason="needs a Hopper (sm_90) GPU")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "M, name",
    gpu_full([(m, n) for m in (1, 32, 4096) for n in ("q_a", "kv_a", "q_b", "down")], [(4096, "kv_a"), (32, "down")]),
)
def test_gpu_kernel_matches_references_at_v3_shapes(M, name):
    """The kernel on an H200 (async wgmma, TMA, the persistent grid over many tiles: what the
    interpreter cannot model) against the same-recipe reference (tight) and the exact dequantized
    product (within fp8 error): catches wgmma/TMA races, a stage overwritten before both warpgroups
    consumed it, garbage from unwritten tiles, and a promotion that loses the fp32 precision."""
    N, K = V3_SHAPES[name]
    x, w, s = make_inputs(M, N, K, seed=M)
    got = jax.jit(lambda *a: fp8_matmul(*a, impl="kernel"))(x, w, s)
    assert_close(got, jax.jit(fp8_matmul_reference)(x, w, s), name)
    exact = np.asarray(jax.jit(lambda *a: fp8_matmul_reference(*a, quantize_x=False))(x, w, s), np.float32)
    rel = np.linalg.norm(np.asarray(got, np.float32) - exact) / np.linalg.norm(exact)
    assert rel < 6e-2, f"{name}: relative error against the exact product {rel}"


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "config",
    gpu_full(
        [
            Fp8MatmulConfig(block_m=128, block_n=64, max_concurrent_steps=4),
            Fp8MatmulConfig(block_m=64, block_n=64, max_concurrent_steps=8),
            Fp8MatmulConfig(block_m=64, block_n=128, wg_split="n", max_concurrent_steps=4),
        ],
        [],
    ),
    ids=["256x64", "128x64", "64x256"],
)
def test_gpu_tuning_configs_match_reference(config):
    """The probe's other tile shapes are correct too (the sweep times only correct kernels)."""
    M, (N, K) = 1024, V3_SHAPES["expert_up"]
    x, w, s = make_inputs(M, N, K, seed=3)
    got = jax.jit(lambda *a: fp8_matmul(*a, impl="kernel", config=config))(x, w, s)
    assert_close(got, jax.jit(fp8_matmul_reference)(x, w, s))
