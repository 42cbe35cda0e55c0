"""Tests of pallas_kernels.flash_attention (causal flash attention, forward and backward kernels).

CPU (default): the reference against an independent numpy loop; the kernels in the Pallas Mosaic
GPU interpreter against the reference (forward and dq, dk, dv); cross-lowering of the forward and
of ``jax.grad`` for sm_90 at the training shape (B=16, T=4096, H=16, 192/128), which checks SMEM,
TMA boxes, wgmma shapes and layouts (the interpreter checks none of those); input validation; the
``mla_decompressed_attention(impl="mgpu")`` wiring. GPU (``-m gpu``, Hopper only): kernel against
reference at a medium shape; the ``impl="mgpu"`` wiring on the GPU is checked beside cuDNN's in
``tests/test_attention.py::test_flash_attention_impls_equal_the_jnp_form_with_gradients``.
"""

import re

import chex
import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend
from pallas_kernels.flash_attention import FlashAttentionConfig, flash_attention, flash_attention_reference, smem_bytes

D, V = 192, 128  # MLA's decompressed widths (128 nope + 64 rope; v 128)
SCALE = D**-0.5

requires_hopper = pytest.mark.skipif(not backend.on_hopper(), reason="needs a Hopper (sm_90) GPU")


def make_inputs(B, T, H, d=D, v=V, *, seed=0):
    """q, k [B,T,H,d], v [B,T,H,v] and a cotangent do [B,T,H,v], bf16. The last 64 keys get scores
    ~4x larger, so a query that sees a future key (a causal-mask or loop-bound bug) is dominated by it."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, d), dtype=np.float32)
    k = rng.standard_normal((B, T, H, d), dtype=np.float32)
    k[:, -64:] *= 4.0
    vv = rng.standard_normal((B, T, H, v), dtype=np.float32)
    do = rng.standard_normal((B, T, H, v), dtype=np.float32)
    return tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, vv, do))


def fwd_and_grads(fn, q, k, v, do):
    """(o, (dq, dk, dv)) as float32 numpy, the gradient of sum(o * do)."""
    o, vjp = jax.vjp(fn, q, k, v)
    grads = vjp(do)
    return np.asarray(o, np.float32), tuple(np.asarray(g, np.float32) for g in grads)


def assert_close(got, want, name):
    """bf16 tolerances: every element within 2 % of the tensor's largest magnitude, and a relative
    Frobenius error below 1 %; no NaN or inf."""
    assert np.isfinite(got).all(), f"{name}: non-finite values"
    scale = float(np.abs(want).max())
    chex.assert_trees_all_close(got, want, atol=2e-2 * scale, rtol=0, custom_message=name)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, f"{name}: relative error {rel}"


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------


def test_reference_matches_a_numpy_loop():
    """The oracle against a per-query float64 loop: catches an off-by-one in the causal mask (the
    diagonal key excluded or the next key included) or a softmax over the wrong axis."""
    q, k, v, _ = make_inputs(1, 8, 2, 64, 64, seed=1)
    got = np.asarray(flash_attention_reference(q, k, v, softmax_scale=0.3), np.float32)
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    want = np.zeros(got.shape)
    for t in range(8):
        for h in range(2):
            s = kn[0, : t + 1, h] @ qn[0, t, h] * 0.3
            p = np.exp(s - s.max())
            want[0, t, h] = p @ vn[0, : t + 1, h] / p.sum()
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=1e-2)


# ------------------------------------------------------------------------------------------------
# Interpret mode (CPU): the kernels' arithmetic
# ------------------------------------------------------------------------------------------------


def test_interpret_forward_and_gradients_match_reference():
    """Forward and dq, dk, dv of the three kernels (interpretable variant) at T=256 = 2 CTAs of 128
    rows, 2 heads: catches a wrong causal loop bound (a CTA stopping before its diagonal, or a dK/dV
    CTA starting past it), a mask applied to the wrong rows of the second warpgroup, a missing
    softmax_scale on dq or dk, lse saved in the wrong log base, a missing rescale of the
    accumulator by alpha, a head or batch indexing mix-up, and NaN/inf leaking from fully masked
    blocks (the second warpgroup's last block in the dQ kernel is entirely in the future)."""
    q, k, v, do = make_inputs(1, 256, 2)
    fn = lambda impl: lambda q, k, v: flash_attention(q, k, v, softmax_scale=SCALE, impl=impl)  # noqa: E731
    o, grads = fwd_and_grads(fn("interpret"), q, k, v, do)
    o_ref, grads_ref = fwd_and_grads(fn("reference"), q, k, v, do)
    assert_close(o, o_ref, "o")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(g, g_ref, name)


def test_interpret_non_causal_other_widths_small_blocks(monkeypatch):
    """causal=False, D = V = 64, block_kv = 64, B=2, T=256: catches widths hard-coded to 192/128, a
    causal mask or loop bound applied when causal is off, a batch index taken from the wrong grid
    axis, and (4 forward steps over 2 stages) a K/V stage reused before both warpgroups released it
    or refilled with the wrong block (the forward's K released before its Q·Kᵀ fails here, as wrong
    values). Runs with the interpreter's race detector (every kernel reuses its stages here), for
    unordered SMEM accesses; barriers out of balance show up as a hang."""
    import importlib

    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    fa = importlib.import_module("pallas_kernels.flash_attention")
    monkeypatch.setattr(fa, "INTERPRET_PARAMS", plgpu.InterpretGPUParams(detect_races=True))
    q, k, v, do = make_inputs(2, 256, 1, 64, 64, seed=3)
    cfg = FlashAttentionConfig(block_kv=64)
    fn = lambda impl: (
        lambda q, k, v: flash_attention(  # noqa: E731
            q, k, v, softmax_scale=0.125, causal=False, impl=impl, config=cfg
        )
    )
    o, grads = fwd_and_grads(fn("interpret"), q, k, v, do)
    assert not interpret_pallas_call.get_races().races_found
    o_ref, grads_ref = fwd_and_grads(fn("reference"), q, k, v, do)
    assert_close(o, o_ref, "o")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(g, g_ref, name)


# ------------------------------------------------------------------------------------------------
# Cross-lowering for sm_90 (CPU): SMEM, TMA, wgmma and layout limits of the production kernels
# ------------------------------------------------------------------------------------------------


def _lower(fn, B, T, H, d=D, v=V):
    shapes = (
        jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((B, T, H, v), jnp.bfloat16),
    )
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))


def _mosaic_calls(lowered) -> int:
    return len(re.findall(r"custom_call @mosaic_gpu", lowered.as_text()))


def test_cross_lowers_forward_and_backward_at_the_training_shape():
    """The production kernels (registers as the wgmma A operand, run_state accumulators, default
    config) lower for sm_90 at B=16, T=4096, H=16, 192/128: one Mosaic GPU kernel forward, three
    under jax.grad (forward, dK/dV, dQ). Catches an SMEM overflow (e.g. a third forward K/V stage of
    128 keys), a TMA box over 256 elements, a wgmma N over 256 and a layout the inference rejects."""
    f = lambda q, k, v: flash_attention(q, k, v, softmax_scale=SCALE, impl="kernel")  # noqa: E731
    assert _mosaic_calls(_lower(f, 16, 4096, 16)) == 1
    g = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    assert _mosaic_calls(_lower(g, 16, 4096, 16)) == 3


def test_smem_estimate_and_lowering_agree_on_an_overflow():
    """A config whose forward needs more than 227 KB (4 stages of 128 keys) is refused up front in one
    line, and the lowering of that kernel does overflow: catches `smem_bytes` (and the docstring's
    budget) drifting from the kernel's real allocation."""
    import importlib

    fa = importlib.import_module("pallas_kernels.flash_attention")
    cfg = FlashAttentionConfig(max_concurrent_steps=4)
    assert smem_bytes(D, V, cfg)["forward"] > fa.SMEM_BYTES
    assert all(b <= fa.SMEM_BYTES for b in smem_bytes(D, V, FlashAttentionConfig()).values())
    f = lambda q, k, v: flash_attention(q, k, v, softmax_scale=SCALE, impl="kernel", config=cfg)  # noqa: E731
    with pytest.raises(ValueError, match=r"needs \d+ bytes of SMEM in the forward kernel .* over the 232448"):
        _lower(f, 1, 512, 1)
    fwd = lambda q, k, v: fa._forward(q, k, v, scale=SCALE, causal=True, config=cfg, interpret=None)  # noqa: E731
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        _lower(fwd, 1, 512, 1)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def _arr(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "q, k, v, kw, message",
    [
        (
            _arr(1, 128, 1, 192, dtype=jnp.float32),
            _arr(1, 128, 1, 192),
            _arr(1, 128, 1, 128),
            {},
            "q must be bfloat16, got float32",
        ),
        (
            _arr(1, 128, 1, 160),
            _arr(1, 128, 1, 160),
            _arr(1, 128, 1, 128),
            {},
            r"q/k width D must be a multiple of 64 in \[64, 256\], got 160",
        ),
        (
            _arr(1, 128, 1, 192),
            _arr(1, 128, 1, 192),
            _arr(1, 128, 1, 320),
            {},
            r"v width V must be a multiple of 64 in \[64, 256\], got 320",
        ),
        (
            _arr(1, 200, 1, 192),
            _arr(1, 200, 1, 192),
            _arr(1, 200, 1, 128),
            {},
            "T .* must be a positive multiple of 128 .* got 200",
        ),
        (_arr(1, 128, 2, 192), _arr(1, 128, 1, 192), _arr(1, 128, 1, 128), {}, "k must have q's shape"),
        (
            _arr(1, 128, 1, 192),
            _arr(1, 128, 1, 192),
            _arr(1, 128, 1, 128),
            dict(softmax_scale=-1.0),
            "softmax_scale must be finite and > 0, got -1.0",
        ),
        (_arr(1, 128, 1, 192), _arr(1, 128, 1, 192), _arr(1, 128, 1, 128), dict(impl="gpu"), "impl must be one of"),
    ],
)
def test_bad_inputs_are_one_line_value_errors(q, k, v, kw, message):
    """Each limit is checked up front with a message naming the value and the limit, instead of an
    error from deep inside the lowering (or a silently wrong kernel, for T not a block multiple)."""
    kw = dict(dict(softmax_scale=SCALE, impl="kernel"), **kw)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda q, k, v: flash_attention(q, k, v, **kw), q, k, v)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(block_kv=96), "block_kv must be 64 or 128, got 96"),
        (dict(block_kv_dq=32), "block_kv_dq must be 64 or 128, got 32"),
        (dict(max_concurrent_steps=1), r"max_concurrent_steps must be an int in \[2, 4\], got 1"),
        (dict(memory_registers=20), "memory_registers must be a multiple of 8"),
    ],
)
def test_bad_config_is_refused(kw, message):
    """The config's own limits, at construction."""
    with pytest.raises(ValueError, match=message):
        FlashAttentionConfig(**kw)


# ------------------------------------------------------------------------------------------------
# Wiring: mla_decompressed_attention(impl="mgpu")
# ------------------------------------------------------------------------------------------------


def test_mla_decompressed_attention_mgpu_path_matches_the_jnp_form():
    """`_mgpu_causal_attention` (the kernel in the interpreter) against mla_decompressed_attention's jnp form
    on right-padded rows with T=100 and widths qk 96 / v 40 (padded up to the kernel's 128 block and
    multiples of 64 inside): catches the wrong q/k/v assembly being passed, the T or width padding
    leaking into real values, padding queries not zeroed, and non-right-padded positions (left
    padding) not turned into NaN."""
    from mla_jax.attention import _mgpu_causal_attention, mla_decompressed_attention

    B, T, H, N, R, L, V = 1, 100, 1, 80, 16, 64, 40  # qk 96 and v 40: padded to 128 / 64 inside
    rng = np.random.default_rng(5)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.5, jnp.bfloat16)  # noqa: E731
    q_nope, q_pe, kv_latent, w = bf(B, T, H, N), bf(B, T, H, R), bf(B, T, L + R), bf(L, H, N + V)
    n = np.array([70])  # 30 padding queries, and T padded from 100 to 128 inside
    idx = np.arange(T)[None]
    pos = jnp.asarray(np.where(idx < n[:, None], idx, -1), jnp.int32)
    want = mla_decompressed_attention(q_nope, q_pe, kv_latent, w, pos, pos, softmax_scale=SCALE)

    def via_kernel(q_BTHD, k, v, q_positions, kv_positions, softmax_scale):
        return _mgpu_causal_attention(q_BTHD, k, v, q_positions, kv_positions, softmax_scale, kernel_impl="interpret")

    import mla_jax.attention as attention

    original = attention._mgpu_causal_attention
    attention._mgpu_causal_attention = via_kernel
    try:
        f = jax.jit(lambda *a: mla_decompressed_attention(*a, softmax_scale=SCALE, impl="mgpu"))  # one compile
        got = f(q_nope, q_pe, kv_latent, w, pos, pos)
        left = jnp.asarray(np.where(idx >= T - n[:, None], idx - (T - n[:, None]), -1), jnp.int32)
        bad = f(q_nope, q_pe, kv_latent, w, left, left)
    finally:
        attention._mgpu_causal_attention = original
    assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32), "o")
    assert bool(jnp.all(jnp.isnan(bad.astype(jnp.float32))))


def test_train_step_with_mgpu_attention_cross_lowers(monkeypatch):
    """The tiny model's training gradient with TrainConfig(attn_impl="mgpu", remat="full") lowers for
    sm_90 with the flash kernels inside the scanned, rematerialised layers (forward, its recompute,
    dK/dV, dQ): catches the custom_vjp breaking under scan/remat or the wrapper's padding to the
    kernel's shapes (qk 48 / v 32 -> 64 / 64, T=128) going wrong at trace time."""
    from flax import nnx

    import mla_jax.attention as attention
    from mla_jax.config import ModelConfig
    from models.deepseek import DeepSeekModel
    from models.training import TrainConfig, loss_fn

    original = attention._mgpu_causal_attention
    monkeypatch.setattr(attention, "_mgpu_causal_attention", lambda *a: original(*a, kernel_impl="kernel"))
    model = nnx.eval_shape(
        lambda: DeepSeekModel(ModelConfig.tiny(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    )
    graphdef, state = nnx.split(model)
    tc = TrainConfig(attn_impl="mgpu", remat="full")

    def grads(state, ids):
        return jax.grad(lambda m: loss_fn(m, {"input_ids": ids}, tc)[0])(nnx.merge(graphdef, state))

    lowered = jax.jit(grads).trace(state, jax.ShapeDtypeStruct((1, 128), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert _mosaic_calls(lowered) >= 4


def test_mgpu_path_outside_a_gpu_is_one_line_error():
    """impl="mgpu" on a CPU says what it needs instead of a Mosaic GPU error from inside jit."""
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the refusal off a GPU")
    from mla_jax.attention import mla_decompressed_attention

    z = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    pos = jnp.arange(128, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match="impl='mgpu' needs a Hopper GPU .*the backend is cpu: use impl='xla'"):
        mla_decompressed_attention(
            z,
            z,
            jnp.zeros((1, 128, 72), jnp.bfloat16),
            jnp.zeros((8, 1, 128), jnp.bfloat16),
            pos,
            pos,
            softmax_scale=1.0,
            impl="mgpu",
        )


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("B, T, H, causal", [(2, 1024, 4, True), (1, 2048, 2, True), (2, 512, 2, False)])
def test_gpu_kernel_matches_reference(B, T, H, causal):
    """The production kernels on the GPU (async wgmma, TMA, register-A operands: what the
    interpreter cannot model) against the reference, forward and gradients: catches wgmma/TMA races
    (a stage overwritten before both warpgroups consumed it) and garbage from unwritten outputs."""
    q, k, v, do = make_inputs(B, T, H, seed=T + H)
    fn = lambda impl: jax.jit(
        lambda q, k, v: flash_attention(  # noqa: E731
            q, k, v, softmax_scale=SCALE, causal=causal, impl=impl
        )
    )
    o, grads = fwd_and_grads(fn("kernel"), q, k, v, do)
    o_ref, grads_ref = fwd_and_grads(fn("reference"), q, k, v, do)
    assert_close(o, o_ref, "o")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(g, g_ref, name)
