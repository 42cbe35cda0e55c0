"""Tests of pallas_kernels.flash_attention (causal flash attention, forward and backward kernels).

CPU (default): the reference against an independent numpy loop; the kernels in the Pallas Mosaic
GPU interpreter against the reference (forward and dq, dk, dv); cross-lowering of the forward and
of ``jax.grad`` for sm_90 at the training shape (B=16, T=4096, H=16, 192/128), which checks SMEM,
TMA boxes, wgmma shapes and layouts (the interpreter checks none of those); input validation; the
``mla_decompressed_attention(impl="mgpu")`` wiring. GPU (``-m gpu``, Hopper only): kernel against
reference at a medium shape; the ``impl="mgpu"`` wiring on the GPU is checked beside cuDNN's in
``tests/test_attention.py::test_flash_attention_impls_equal_the_jnp_form_with_gradients``.

`flash_attention_prefill` (the forward with per-row query offsets and key lengths, for prefill chunks over
a cached prefix): its reference against a numpy loop, the kernel in the interpreter (offsets off the block
and page grid, several rows, an empty row, keys past the bounds poisoned with NaN), cross-lowering at a
V2-Lite prefill chunk, validation; on the GPU the kernel at larger shapes and T = 1. The layer and model wiring:
``tests/test_attention.py``.
"""

import re

import chex
import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend
from pallas_kernels.flash_attention import (
    FlashAttentionConfig,
    flash_attention,
    flash_attention_prefill,
    flash_attention_prefill_reference,
    flash_attention_reference,
    smem_bytes,
)
from tests.tiers import gpu_full

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
    from models.training.step import TrainConfig, loss_fn

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
# flash_attention_prefill: query offsets and key lengths
# ------------------------------------------------------------------------------------------------


def prefill_inputs(offsets, kv_lens, T, S, H, d, v, *, block=64, seed=0):
    """(q, k, v) bf16 and the key/value copies the kernel gets: keys and values in blocks wholly past a
    row's kv_len (from kv_len rounded up to `block`) are NaN there, zeros in the reference's copy. A kernel
    that fetches and multiplies such a block (a loop bound past kv_len) turns the row's output NaN; keys
    in the block that straddles kv_len stay finite (the kernel multiplies them by p = 0)."""
    rng = np.random.default_rng(seed)
    B = len(offsets)
    q = rng.standard_normal((B, T, H, d), dtype=np.float32)
    k = rng.standard_normal((B, S, H, d), dtype=np.float32)
    vv = rng.standard_normal((B, S, H, v), dtype=np.float32)
    k_nan, v_nan = k.copy(), vv.copy()
    for b, n in enumerate(kv_lens):
        end = -(-n // block) * block
        k[b, n:], vv[b, n:] = 0.0, 0.0
        k_nan[b, end:], v_nan[b, end:] = np.nan, np.nan
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return bf(q), (bf(k), bf(vv)), (bf(k_nan), bf(v_nan)), i32(offsets), i32(kv_lens)


def test_prefill_reference_matches_a_numpy_loop():
    """The prefill oracle against a float64 loop over rows, queries and heads: row b's query t at position
    offsets[b] + t sees keys s <= that position and s < kv_lens[b]. Catches the causal mask taken by index
    instead of by position (offset ignored or subtracted), kv_len off by one, a row that sees no key giving
    NaN instead of 0, and causal=False still applying the diagonal."""
    offsets, kv_lens = [0, 3, 9, 2], [4, 6, 13, 0]
    q, (k, v), _, off, lens = prefill_inputs(offsets, kv_lens, 4, 13, 2, 64, 64, seed=2)
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    ref = jax.jit(flash_attention_prefill_reference, static_argnames=("softmax_scale", "causal"))
    for causal in (True, False):
        got = np.asarray(ref(q, k, v, off, lens, softmax_scale=0.3, causal=causal), np.float32)
        want = np.zeros(got.shape)
        for b, (p0, n) in enumerate(zip(offsets, kv_lens)):
            for t in range(4):
                seen = min(n, p0 + t + 1) if causal else n
                for h in range(2):
                    if seen <= 0:
                        continue
                    s = kn[b, :seen, h] @ qn[b, t, h] * 0.3
                    p = np.exp(s - s.max())
                    want[b, t, h] = p @ vn[b, :seen, h] / p.sum()
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=1e-2)


def test_interpret_prefill_matches_reference(monkeypatch):
    """The offset forward kernel (interpretable variant, race detector on) against the reference: 4 rows
    of a 100-query chunk over 300 keys (T and S padded inside to 128 and 320), block_kv 64, q·k 128 / v 64.
    Row 0 has no prefix (the training case), row 1 a prefix of 37 (not a multiple of the block or of a
    page: the diagonal crosses two blocks), row 2 a prefix of 200 with kv_len 290 < 200 + 100 (its last
    queries see fewer keys than their position: the kv_len mask), row 3 is empty (kv_len 0: a pipeline of
    no steps, output 0). Catches the offset or kv_len read from the wrong row, the mask skipped on a
    block that straddles the offset diagonal, a loop bound past kv_len or past the CTA's last query
    (fetched NaN blocks poison the row), 0/0 on an empty row, widths swapped, a padded query or key
    leaking into real outputs, and unordered SMEM accesses."""
    import importlib

    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    fa = importlib.import_module("pallas_kernels.flash_attention")
    monkeypatch.setattr(fa, "INTERPRET_PARAMS", plgpu.InterpretGPUParams(detect_races=True))
    q, kv, kv_nan, off, lens = prefill_inputs([0, 37, 200, 0], [100, 137, 290, 0], 100, 300, 1, 128, 64)
    kw = dict(softmax_scale=128**-0.5, config=FlashAttentionConfig(block_kv=64))
    got = np.asarray(flash_attention_prefill(q, *kv_nan, off, lens, impl="interpret", **kw), np.float32)
    assert not interpret_pallas_call.get_races().races_found
    want = np.asarray(flash_attention_prefill_reference(q, *kv, off, lens, **kw), np.float32)
    assert_close(got, want, "o")
    assert not got[3].any()


def test_prefill_cross_lowers_at_a_v2_lite_chunk():
    """The production offset kernel lowers for sm_90 at a V2-Lite prefill chunk: B=1, T=2048 queries after a
    6144-token prefix (S = 8192 keys), 16 heads, q·k 192 / v 128: one Mosaic GPU kernel, the offset one.
    Catches the scalar reads of the offsets or the dynamic loop bound breaking the warp-specialized
    pipeline's lowering, and SMEM/TMA/wgmma limits at these shapes."""

    def f(q, k, v, off, lens):
        return flash_attention_prefill(q, k, v, off, lens, softmax_scale=SCALE, impl="kernel")

    shapes = (
        jax.ShapeDtypeStruct((1, 2048, 16, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, 8192, 16, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, 8192, 16, V), jnp.bfloat16),
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    text = jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    assert "flash_attention_fwd_offset" in text


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(off=_arr(2, dtype=jnp.int32)), r"q_offsets must be int32 \[B=1\], got int32 \(2,\)"),
        (dict(lens=_arr(1, dtype=jnp.float32)), r"kv_lens must be int32 \[B=1\], got float32"),
        (dict(k=_arr(1, 256, 2, 192)), r"k must be \[B=1, S, H=1, D=192\]"),
        (dict(v=_arr(1, 200, 1, 128)), r"v must be \[B=1, S=256, H=1, V\]"),
        (dict(q=_arr(1, 128, 1, 96), k=_arr(1, 256, 1, 96)), r"q/k width D must be a multiple of 64 .* got 96"),
        (dict(q=_arr(1, 0, 1, 192)), "B, T, S and H must be >= 1, got B=1, T=0"),
    ],
)
def test_prefill_bad_inputs_are_one_line_value_errors(change, message):
    """Each limit of `flash_attention_prefill` named in one line up front (not an error from the lowering)."""
    args = dict(
        q=_arr(1, 128, 1, 192),
        k=_arr(1, 256, 1, 192),
        v=_arr(1, 256, 1, 128),
        off=_arr(1, dtype=jnp.int32),
        lens=_arr(1, dtype=jnp.int32),
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        order = [args[name] for name in ("q", "k", "v", "off", "lens")]
        jax.eval_shape(lambda *a: flash_attention_prefill(*a, softmax_scale=SCALE, impl="kernel"), *order)


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "B, T, H, causal",
    gpu_full([(2, 1024, 4, True), (1, 2048, 2, True), (2, 512, 2, False)], [(2, 512, 2, False)]),
)
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


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "offsets, kv_lens, T", [([0, 1000, 1536, 0], [512, 1512, 2048, 0], 512), ([5, 70, 2047], [6, 71, 2048], 1)]
)
def test_gpu_prefill_matches_reference(offsets, kv_lens, T):
    """The production offset kernel on the GPU against the reference at 192/128 over 2048 keys, keys past
    the bounds NaN. T=512: rows with no prefix, a prefix of 1000 (mid-page, mid-block), a full table, and an
    empty row (a pipeline of no steps on real barriers: a hang or garbage shows here, not in the
    interpreter). T=1 (one query per row, 127 padded rows in its CTA). Catches async wgmma/TMA races under
    the dynamic loop bound, the empty pipeline, and the one real row of a CTA taken from the wrong place."""
    q, kv, kv_nan, off, lens = prefill_inputs(offsets, kv_lens, T, 2048, 2, D, V, block=128, seed=9)
    f = jax.jit(lambda *a: flash_attention_prefill(*a, softmax_scale=SCALE, impl="kernel"))
    got = np.asarray(f(q, *kv_nan, off, lens), np.float32)
    want = np.asarray(flash_attention_prefill_reference(q, *kv, off, lens, softmax_scale=SCALE), np.float32)
    assert_close(got, want, "o")
    for b, n in enumerate(kv_lens):
        if n == 0:
            assert not got[b].any()
