"""Decode-shaped FP8 projections (`pallas_kernels.fp8_matvec`, Pallas Triton backend) against numpy: interpret mode
on CPU, cross-lowered for sm_90, and on a Hopper GPU at DeepSeek-V3's projection shapes.

Guards against: a scale taken from the wrong block (row, column or layer), the edge tiles of widths that are not
multiples of the blocks read out of bounds or counted twice, split-K partials summed wrongly, the wrong layer of
a stack, rows past M leaking from the padding, the integer e4m3 decoding differing from jnp's conversion."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_matvec import (
    MAX_ROWS,
    Fp8MatvecConfig,
    default_config,
    e4m3_to_f32,
    fp8_matvec,
    fp8_matvec_problems,
    fp8_matvec_reference,
    resolve_operands,
)
from tests.tiers import gpu_full


def make_fp8(shape, *, seed=0):
    """e4m3 weights [..., N, K] spread over the format's range (subnormals included) and fp32 block scales
    [..., nb, kb] spread over 2^-10..2^-2, so that a scale from another block changes the result."""
    rng = np.random.default_rng(seed)
    *lead, N, K = shape
    w = jnp.asarray(rng.standard_normal(shape) * 64, jnp.float32).astype(jnp.float8_e4m3fn)
    s = jnp.asarray(np.exp2(rng.uniform(-10, -2, (*lead, -(-N // 128), -(-K // 128)))), jnp.float32)
    return w, s


def np_dequant(w, s):
    """float64 [N, K] = w · s per 128x128 block, by numpy (the format's definition)."""
    w = np.asarray(w.astype(jnp.float32), np.float64)
    s = np.repeat(np.repeat(np.asarray(s, np.float64), 128, axis=0), 128, axis=1)
    return w * s[: w.shape[0], : w.shape[1]]


def test_integer_decoding_equals_jnps_conversion_for_all_256_codes():
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(e4m3_to_f32(jnp.asarray(codes)))
    want = np.asarray(jnp.asarray(codes).view(jnp.float8_e4m3fn).astype(jnp.float32))
    nan = np.isnan(want)
    assert codes[nan].tolist() == [0x7F, 0xFF]
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0.0 and subnormals too


# N = 200, K = 300: partial scale blocks (2 x 3 of them) and edge tiles in both directions for 32-wide blocks.
# operands "x": float32 rows, so the product is exact to fp32 (the f16 and e4m3 operands have a test of their own).
CASES = [
    pytest.param(1, 3, Fp8MatvecConfig(block_n=32, block_k=32, operands="x"), id="M1-stack-autosplit"),
    pytest.param(5, None, Fp8MatvecConfig(block_n=64, block_k=64, convert="bits", operands="x"), id="M5-2d-bits"),
    pytest.param(16, 2, Fp8MatvecConfig(block_n=32, block_k=32, split_k=5, operands="x"), id="M16-stack-split5"),
    pytest.param(32, 2, Fp8MatvecConfig(block_n=128, block_k=128, split_k=1, operands="x"), id="M32-stack-nosplit"),
]


@pytest.mark.parametrize("M, L, config", CASES)
def test_interpret_equals_numpy_on_partial_blocks(M, L, config):
    N, K = 200, 300
    w, s = make_fp8((N, K) if L is None else (L, N, K), seed=M)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
    if L is None:
        got = jax.jit(lambda x, w, s: fp8_matvec(x, w, s, config=config, impl="interpret"))(x, w, s)
        want = np.asarray(x, np.float64) @ np_dequant(w, s).T
        chex.assert_trees_all_close(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        return
    f = jax.jit(lambda x, w, s, i: fp8_matvec(x, w, s, i, config=config, impl="interpret"))
    for layer in range(L):
        got = f(x, w, s, jnp.int32(layer))
        want = np.asarray(x, np.float64) @ np_dequant(w[layer], s[layer]).T
        assert got.shape == (M, N) and got.dtype == jnp.float32
        chex.assert_trees_all_close(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bf16_rows_against_the_reference():
    """bf16 activations: the kernel scales each block's fp32 partial, the reference rounds the scaled weights to
    bf16 first; they agree to bf16 rounding."""
    w, s = make_fp8((2, 96, 256), seed=7)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((3, 256)), jnp.bfloat16)
    config = Fp8MatvecConfig(block_n=32, block_k=64)
    got = jax.jit(lambda x, w, s: fp8_matvec(x, w, s, 1, config=config, impl="interpret"))(x, w, s)
    want = fp8_matvec_reference(x, w, s, 1)
    assert got.dtype == jnp.bfloat16
    rel = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
    assert rel < 1e-2, rel


def np_act_quant(x):
    """float64 x [M, K] rounded the way DeepSeek-V3's `act_quant` does: per (row, 128-column block), scale = amax /
    448, the scaled values rounded to e4m3 (by ml_dtypes, not the code under test), times the scale again."""
    import ml_dtypes

    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    for k0 in range(0, x.shape[1], 128):
        b = x[:, k0 : k0 + 128]
        amax = np.abs(b).max(axis=1, keepdims=True)
        sc = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32).astype(np.float64)
        out[:, k0 : k0 + 128] = (b / sc).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * sc
    return out


@pytest.mark.parametrize("M, L, block_k", [(1, 2, 32), (5, None, 64), (17, 2, 128)])
def test_interpret_e4m3_and_f16_operands_equal_numpy(M, L, block_k):
    """`operands="f16"` (rows scaled by a power of two into float16, weights converted to f16) equals the fp64
    product to f16's rounding of x, rows of very different magnitude included (a row at 3e6 overflows f16 unless
    scaled); `operands="e4m3"` (x quantized per 128-column block) equals the fp64 product of x rounded as
    DeepSeek-V3's act_quant rounds it, numpy's rounding. Catches: the per-row factor not undone or applied to the
    wrong row, a block scale of x from the wrong block (K = 300: three blocks, the last partial) or row, the
    masked edge lanes of the fp8 tiles not zeroed."""
    N, K = 200, 300
    w, s = make_fp8((N, K) if L is None else (L, N, K), seed=M + 1)
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, K)) * np.exp2(rng.integers(-12, 12, (M, 1)))
    x[0, :5] *= 3e6 / np.abs(x[0, :5]).max()  # f16's max is 65504
    x = jnp.asarray(x, jnp.float32)
    layer = None if L is None else jnp.int32(L - 1)
    dq = np_dequant(w, s) if L is None else np_dequant(w[L - 1], s[L - 1])
    for operands, xr, tol in (("f16", np.asarray(x, np.float64), 2e-3), ("e4m3", np_act_quant(x), 1e-5)):
        config = Fp8MatvecConfig(block_n=32, block_k=block_k, operands=operands)
        got = np.asarray(jax.jit(lambda x, w, s: fp8_matvec(x, w, s, layer, config=config, impl="interpret"))(x, w, s))
        want = xr @ dq.T
        assert np.isfinite(got).all(), operands
        # row by row: each row has its own magnitude
        err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
        assert (err < tol).all(), (operands, err)
    # e4m3's own error against the exact product: what x's 3 mantissa bits cost (DeepSeek-V3's recipe)
    exact = np.asarray(x, np.float64) @ dq.T
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert 1e-3 < rel < 6e-2, rel


def test_what_it_cannot_serve_is_one_line_each():
    assert fp8_matvec_problems(1, 576, 7168) == []  # V3's kv_a: N a partial block
    assert fp8_matvec_problems(MAX_ROWS, 200, 300) == []
    assert fp8_matvec_problems(33, 0, 7168, Fp8MatvecConfig(split_k=3)) == [
        "M = 33 rows is outside the 1..32 a decode-shaped call takes",
        "N = 0, K = 7168: nothing to compute",
        "split_k = 3 does not divide ceil(K / block_k) = 56",
    ]
    w, s = make_fp8((2, 64, 128))
    x = jnp.zeros((33, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^fp8_matvec: M = 33 rows is outside the 1\.\.32"):
        fp8_matvec(x, w, s, 0, impl="interpret")
    with pytest.raises(ValueError, match=r"^w must be float8_e4m3fn a stack \[L, N, K\]"):
        fp8_matvec(x[:1], w[0], s[0], 0)
    with pytest.raises(ValueError, match=r"^scale must be float32 \(2, 1, 1\)"):
        fp8_matvec(x[:1], w, s[:, :, :0], 0)
    with pytest.raises(ValueError, match=r"power of two in \[16, 128\], got 256"):
        Fp8MatvecConfig(block_n=256)
    with pytest.raises(ValueError, match=r"^Fp8MatvecConfig.operands must be one of \('x', 'f16', 'e4m3'\), got 'fp8'"):
        Fp8MatvecConfig(operands="fp8")
    with pytest.raises(ValueError, match=r"operands='e4m3' needs block_k >= 32"):
        Fp8MatvecConfig(operands="e4m3", block_k=16)
    with pytest.raises(
        ValueError, match=r"^Fp8MatvecConfig.convert='bits' converts to x's dtype: it needs operands='x'"
    ):
        Fp8MatvecConfig(convert="bits", operands="f16")
    # the default operands: f16 for bf16 rows (finer than bf16), x's own dtype for float32 rows and for "bits"
    assert resolve_operands(Fp8MatvecConfig(), jnp.bfloat16) == "f16"
    assert resolve_operands(Fp8MatvecConfig(), jnp.float32) == "x"
    assert resolve_operands(Fp8MatvecConfig(convert="bits"), jnp.bfloat16) == "x"
    assert resolve_operands(Fp8MatvecConfig(operands="e4m3"), jnp.float32) == "e4m3"


def test_default_config_widens_the_projections_back_to_the_hidden_width():
    """Without a config, 128 columns a program for N >= 4096 and K >= 2·N (V3's wo and down: measured faster at
    M = 32), 64 elsewhere (gate_up, q_a, q_b, kv_a: measured slower at 128), and the call takes it (its grid's
    column programs, traced, not run); the f16 form at 128 columns, bf16 rows of different magnitudes, the last
    program's columns partly past N (masked), against float64 numpy. Catches the rule inverted (wo at 64) and a
    default that ignores the widths."""
    widths = {n: default_config(*V3_PROJECTIONS[n]).block_n for n in V3_PROJECTIONS}
    assert widths == dict(q_a=64, q_b=64, kv_a=64, wo=128, gate_up=64, down=128, shared_up=64, shared_down=64)
    for (N, K), programs in (((4100, 8200), 33), ((4100, 8000), 65)):
        sds = jax.ShapeDtypeStruct
        w, sc = sds((2, N, K), jnp.float8_e4m3fn), sds((2, -(-N // 128), -(-K // 128)), jnp.float32)
        call = lambda x, w, s: fp8_matvec(x, w, s, 1, impl="interpret")  # noqa: E731
        jaxpr = jax.make_jaxpr(call)(sds((1, K), jnp.bfloat16), w, sc)
        grids = [e.params["grid_mapping"].grid for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        assert [g[1] for g in grids] == [programs], grids
    N, K = 200, 300
    w, s = make_fp8((2, N, K), seed=3)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, K)) * np.exp2(rng.integers(-10, 10, (3, 1))), jnp.bfloat16)
    config = Fp8MatvecConfig(block_n=128)
    got = jax.jit(lambda x, w, s: fp8_matvec(x, w, s, jnp.int32(1), config=config, impl="interpret"))(x, w, s)
    want = np.asarray(x, np.float64) @ np_dequant(w[1], s[1]).T
    err = np.abs(np.asarray(got, np.float64) - want).max(axis=1) / np.abs(want).max(axis=1)
    assert (err < 1e-2).all(), err  # bf16 output rounding


@pytest.mark.parametrize("convert, operands", [("cast", "x"), ("bits", "x"), ("cast", "f16"), ("cast", "e4m3")])
def test_cross_lowers_for_sm90(convert, operands):
    """The Triton lowering at V3's kv_a (N = 576, a partial scale block) over a 61-layer stack, and at
    widths the blocks do not divide (masked edges)."""
    from jax._src import mesh as mesh_lib

    h200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    layer = jnp.int32(3)  # made outside the abstract mesh, where no eager op can run
    for M, L, N, K in ((1, 61, 576, 7168), (5, 2, 200, 300)):
        args = (
            jax.ShapeDtypeStruct((M, K), jnp.bfloat16),
            jax.ShapeDtypeStruct((L, N, K), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((L, -(-N // 128), -(-K // 128)), jnp.float32),
        )
        config = Fp8MatvecConfig(convert=convert, operands=operands)
        with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h200)):
            traced = jax.jit(lambda x, w, s, i: fp8_matvec(x, w, s, i, config=config, impl="kernel")).trace(
                *args, layer
            )
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 1


# (N, K) of DeepSeek-V3's decode projections: q_a, q_b, kv_a (with rope), wo, dense gate/up, dense down, the
# shared expert's gate/up and down.
V3_PROJECTIONS = {
    "q_a": (1536, 7168),
    "q_b": (24576, 1536),
    "kv_a": (576, 7168),
    "wo": (7168, 16384),
    "gate_up": (18432, 7168),
    "down": (7168, 18432),
    "shared_up": (2048, 7168),
    "shared_down": (7168, 2048),
}


@pytest.mark.gpu
@pytest.mark.parametrize("convert", ["cast", "bits"])
@pytest.mark.parametrize("M", gpu_full([1, 5, 32], (1,)))
@pytest.mark.parametrize("name", gpu_full(list(V3_PROJECTIONS), list(V3_PROJECTIONS)[:2]))
def test_gpu_kernel_equals_the_reference_at_v3_shapes(name, M, convert):
    """The compiled kernel (bf16 rows, a 4-layer stack, a traced layer) against the reference's dequantize + dot."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    N, K = V3_PROJECTIONS[name]
    w, s = make_fp8((4, N, K), seed=M)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.bfloat16)
    config = Fp8MatvecConfig(convert=convert, operands="x")
    got = jax.jit(lambda x, w, s, i: fp8_matvec(x, w, s, i, config=config, impl="kernel"))(x, w, s, jnp.int32(2))
    want = jax.jit(fp8_matvec_reference)(x, w, s, jnp.int32(2))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("operands", ["f16", "e4m3"])
@pytest.mark.parametrize("M", gpu_full([1, 32], (1,)))
@pytest.mark.parametrize("name", ["wo", "kv_a"])
def test_gpu_operands_equal_their_numpy_products(name, M, operands):
    """The compiled f16 / fp8 x fp8 products at V3 shapes (kv_a: a partial scale block) against numpy: f16 against
    the exact product, e4m3 against the product of x rounded as act_quant rounds it."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    N, K = V3_PROJECTIONS[name]
    w, s = make_fp8((2, N, K), seed=M)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.bfloat16)
    config = Fp8MatvecConfig(operands=operands)
    got = jax.jit(lambda x, w, s, i: fp8_matvec(x, w, s, i, config=config, impl="kernel"))(x, w, s, jnp.int32(1))
    xr = np.asarray(x, np.float64) if operands == "f16" else np_act_quant(np.asarray(x, np.float64))
    want = xr @ np_dequant(w[1], s[1]).T
    got = np.asarray(got, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # bf16 output rounding


@pytest.mark.gpu
@pytest.mark.parametrize("M", gpu_full([1, 5, 32], (5,)))
@pytest.mark.parametrize("name", gpu_full(list(V3_PROJECTIONS), list(V3_PROJECTIONS)[2:4]))
def test_gpu_default_config_equals_numpy_at_v3_shapes(name, M):
    """The call without a config (`default_config`: f16 products, 128 columns for wo and down)
    at every V3 projection, rows of magnitudes 2^-10..2^10 apart, against float64 numpy, row by row."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    N, K = V3_PROJECTIONS[name]
    w, s = make_fp8((2, N, K), seed=M)
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.standard_normal((M, K)) * np.exp2(rng.integers(-10, 10, (M, 1))), jnp.bfloat16)
    got = jax.jit(lambda x, w, s, i: fp8_matvec(x, w, s, i, impl="kernel"))(x, w, s, jnp.int32(1))
    want = np.asarray(x, np.float64) @ np_dequant(w[1], s[1]).T
    err = np.linalg.norm(np.asarray(got, np.float64) - want, axis=1) / np.linalg.norm(want, axis=1)
    assert (err < 1e-2).all(), err  # bf16 output rounding


# ------------------------------------------------------------------------------------------
# The model: an FP8 decode step reads its projections and experts in place
# ------------------------------------------------------------------------------------------
def _micro_fp8_logits(runs, dtype=jnp.float32):
    """A V3-shaped micro model in FP8 (q LoRA, sigmoid routing, a dense layer and two MoE layers, widths that are
    not multiples of 128), one cached call of 2 rows x 5 tokens per (cache impl, MoE impl) of `runs` -> a list of
    (logits, the call's jaxpr as text)."""
    from flax import nnx
    from micro_configs import MICRO_V3

    from mla_jax.kv_cache import KVCache
    from models import DeepSeekModel, Engine
    from models.moe import MoE

    cfg = MICRO_V3.replace(hidden_size=128, moe_intermediate_size=64, num_hidden_layers=3, num_mtp_layers=0)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0), weights="fp8", dtype=dtype, param_dtype=dtype)
    e = Engine(model, page_size=16, num_pages=8, max_batch=2, kv_dtype=dtype)
    B, T = 2, 5
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    table = jnp.asarray([[0], [1]], jnp.int32)
    out = []
    for impl, moe_impl in runs:
        for _, m in nnx.iter_modules(model):
            if isinstance(m, MoE):
                m.impl = moe_impl
        fwd = jax.jit(lambda ids, positions, cache: model(ids, positions, cache=cache))
        args = (ids, positions, KVCache.create(e.cache.pages, table, jnp.zeros((B,), jnp.int32), impl=impl))
        out.append((fwd(*args)[0], str(jax.make_jaxpr(fwd)(*args))))
    return out


def test_fp8_cached_call_on_the_kernels_equals_the_reference_path():
    """The micro FP8 model's cached call of decode size on the interpret backend with the decode experts passes
    every FP8 projection of the scanned stacks whole to `fp8_matvec` and the routed experts whole to
    `moe_decode_fp8`; its logits equal those of the reference backend with `ragged_dot` experts (every projection
    sliced by the scan and dequantized, the experts dequantized in chunks out of the whole stack). Catches a layer
    reading another layer's weights, scales or experts, a projection skipping the FP8 path."""
    (got, jaxpr), (want, ref_jaxpr) = _micro_fp8_logits([("interpret", "decode"), ("reference", "ragged_dot")])
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
    # wq_a, wq_b, wkv_a, wo and the dense MLP's 3 in the dense stack; the attention's 4 and the shared expert's 3
    assert jaxpr.count("name=fp8_matvec") == 14
    assert jaxpr.count("name=moe_decode_fp8_gate_up") == 1 and jaxpr.count("name=moe_decode_fp8_down") == 1
    assert "name=fp8_matvec" not in ref_jaxpr and "name=moe_decode" not in ref_jaxpr


@pytest.mark.gpu
def test_gpu_fp8_cached_call_on_the_kernels_equals_the_reference_path():
    """The same in bf16 on a Hopper GPU: the compiled kernels ("kernel" backend) against the reference backend."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    (got, jaxpr), (want, _) = _micro_fp8_logits([("kernel", "decode"), ("reference", "ragged_dot")], jnp.bfloat16)
    assert jaxpr.count("name=fp8_matvec") == 14
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


def test_arrays_the_triton_lowering_cannot_index_fall_back_or_are_refused():
    """An e4m3 array of 2**31..2**32 bytes gets 32-bit element offsets in Pallas' Triton lowering, which wrap:
    on the H200 `moe_decode_fp8` over V3's 256 experts of one layer (3.76e9 bytes) read an illegal address.
    "auto" must take the reference there and "kernel" refuse in one line; a 2-byte array of the same element
    count (64-bit offsets above 4 GiB) and a smaller e4m3 stack are served. Shapes only (jax.eval_shape)."""
    from pallas_kernels import backend
    from pallas_kernels.moe_decode import moe_decode_fp8

    f8, f32, bf16 = jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16
    sds = jax.ShapeDtypeStruct
    assert backend.triton_offset_problems("w", (256, 2048, 7168), f8)
    assert not backend.triton_offset_problems("w", (256, 2048, 7168), bf16)
    assert not backend.triton_offset_problems("w", (128, 2048, 7168), f8)
    assert not backend.triton_offset_problems("w", (600, 2048, 7168), f8)  # > 4 GiB: 64-bit offsets

    E, D, I = 256, 7168, 2048
    args = (
        sds((8, D), bf16),
        sds((E,), jnp.int32),
        sds((E, I, D), f8),
        sds((E, I, D), f8),
        sds((E, D, I), f8),
        sds((E, I // 128, D // 128), f32),
        sds((E, I // 128, D // 128), f32),
        sds((E, D // 128, I // 128), f32),
    )
    with pytest.raises(ValueError, match=r"^moe_decode_fp8 impl='kernel': .*32-bit offsets"):
        jax.eval_shape(lambda *a: moe_decode_fp8(*a, impl="kernel"), *args)
    assert jax.eval_shape(lambda *a: moe_decode_fp8(*a, impl="auto"), *args).shape == (8, D)

    w, s = sds((61, 24576, 1536), f8), sds((61, 192, 12), f32)  # V3's q_b stack: 2.3e9 bytes
    with pytest.raises(ValueError, match=r"^fp8_matvec impl='kernel': .*32-bit offsets"):
        jax.eval_shape(lambda x, w, s: fp8_matvec(x, w, s, 3, impl="kernel"), sds((1, 1536), bf16), w, s)
