"""The latent-writing kernel (`pallas_kernels.latent_write`: a decode step's kv_norm, the key's RoPE and the page
write in one launch, Pallas Triton backend) against its jnp reference: interpret mode on CPU, cross-lowered for
sm_90, in a scanned model's decode step, and compiled on a Hopper GPU."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax.config import ModelConfig
from mla_jax.rope import apply_rope, attention_factor, inv_frequencies, rope_cos_sin
from pallas_kernels.latent_write import (
    latent_rows_reference,
    latent_write,
    latent_write_problems,
    latent_write_reference,
)
from pallas_kernels.stacked_matmul import Partials, rms_norm
from tests.tiers import full, gpu_full

EPS = 1e-6
YARN = ModelConfig.deepseek_v2_lite()  # YaRN frequencies and attention factor (1.0 here), V2-Lite's R = 64


def _inputs(B, T, K, R, *, S=0, L=3, N=6, G=16, P=3, page_dtype=jnp.bfloat16, weight_dtype=jnp.float32, seed=0):
    """A stack of L pools [L, N, G, K + R] of random values (so a row written in the wrong place shows), wkv_a's rows
    (bf16 [B, T, C], or S fp32 split-K partials of them), positions (row 0 at 5.., row 1 from 17: its second page;
    rows past the first two: the last two pages' tokens), each row's own table of P pages, a stack of L norm weights
    (each layer's different), the frequencies."""
    k = jax.random.split(jax.random.key(seed), 4)
    C = K + R
    pages = jax.random.normal(k[0], (L, N, G, C), jnp.float32).astype(page_dtype)
    kv = 3.0 * jax.random.normal(k[1], (S or 1, B * T, C), jnp.float32) / max(S, 1)
    kv = Partials(kv, (B, T, C), jnp.dtype(jnp.bfloat16)) if S else kv[0].reshape(B, T, C).astype(jnp.bfloat16)
    starts = np.array([5, 17] + [G * P - T - 1] * (B - 2))[:B]
    positions = jnp.asarray(starts[:, None] + np.arange(T)[None], jnp.int32)
    table = jnp.asarray((np.arange(B)[:, None] * P + np.arange(P)[None]) % N, jnp.int32)
    w = (1.0 + 0.3 * jax.random.normal(k[2], (L, K), jnp.float32)).astype(weight_dtype)
    cfg = YARN.replace(qk_rope_head_dim=R)
    return pages, kv, positions, table, w, inv_frequencies(cfg), attention_factor(cfg)


def _assert_written(got, want, pages):
    """got == want, one bf16 step apart at most where written (the norm's sum in another order), exactly elsewhere."""
    assert got.shape == want.shape and got.dtype == want.dtype
    changed = np.asarray(jnp.any(want != pages, axis=-1))
    assert changed.any()
    g, w = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    np.testing.assert_array_equal(g[~changed], w[~changed])
    np.testing.assert_allclose(g[changed], w[changed], rtol=1e-2 if got.dtype == jnp.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "B, T, S, interleave, page_dtype, weight_dtype",
    full(
        [
            (1, 1, 4, True, jnp.bfloat16, jnp.float32),  # a V2-Lite decode step: wkv_a's 4 partials, one token
            (2, 3, 0, False, jnp.float32, jnp.bfloat16),  # a verify step's rows, halves, fp32 pages, bf16 weight
            (4, 1, 2, True, jnp.float32, jnp.float32),
            (3, 2, 0, True, jnp.bfloat16, jnp.bfloat16),
        ],
        [(1, 1, 4, True, jnp.bfloat16, jnp.float32), (2, 3, 0, False, jnp.float32, jnp.bfloat16)],
        "the quick tier runs the one-token partials case and the multi-token halves case",
    ),
)
def test_interpret_equals_reference(B, T, S, interleave, page_dtype, weight_dtype):
    """The kernel in the interpreter against `latent_write_reference` into pool 1 of 3 with the norm of layer 2:
    every token's row where its table and position put it, nothing else touched. Catches the row written to another
    pool, page or slot, the norm's weight read at another layer, the partials not summed, the pairs' halves swapped
    or a rotation's sign, the positions' angles off by a token."""
    pages, kv, pos, table, w, freqs, scale = _inputs(
        B, T, 64, 16, S=S, page_dtype=page_dtype, weight_dtype=weight_dtype
    )
    kw = dict(eps=EPS, interleave=interleave, rope_scale=scale, layer=jnp.int32(1), norm_layer=jnp.int32(2))
    got = latent_write(pages, kv, pos, table, w, freqs, impl="interpret", **kw)
    _assert_written(got, latent_write_reference(pages, kv, pos, table, w, freqs, **kw), pages)


def test_rows_are_the_models_latent():
    """The reference's rows are what MLA cached before the kernel: rms_norm(c) with the layer's weight, then the key
    rotated by `rope_cos_sin` of the positions (`apply_rope`), concatenated in kv's dtype; and the kernel writes them
    into one pool [N, G, C] (no stack: no layers) as `write_latents` would. Catches a kernel or reference whose
    rotation or norm drifted from the model's."""
    from mla_jax.kv_cache import write_latents

    pages, kv, pos, table, w, freqs, scale = _inputs(2, 2, 64, 16, page_dtype=jnp.float32)
    cfg = YARN.replace(qk_rope_head_dim=16)
    rows = latent_rows_reference(kv, w[0], pos, freqs, eps=EPS, interleave=True, rope_scale=scale)
    cos, sin = rope_cos_sin(cfg, pos)
    want = jnp.concatenate([rms_norm(kv[..., :64], w[0], EPS).astype(kv.dtype), apply_rope(kv[..., 64:], cos, sin)], -1)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(want, np.float32))
    got = latent_write(pages[0], kv, pos, table, w[0], freqs, eps=EPS, rope_scale=scale, impl="interpret")
    _assert_written(got, write_latents(pages[0], want, pos, table), pages[0])


def test_padding_and_tokens_past_the_table_are_not_written():
    """Negative positions (padding) and positions at or past P·G write nothing: the pools come back unchanged."""
    pages, kv, _, table, w, freqs, _ = _inputs(2, 2, 64, 16)
    pos = jnp.asarray([[-1, -1], [48, 60]], jnp.int32)  # P·G = 48
    got = latent_write(pages, kv, pos, table, w, freqs, eps=EPS, layer=0, norm_layer=0, impl="interpret")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(pages, np.float32))


def test_what_it_cannot_serve_is_one_line_each():
    """Encoded pages and widths off its loads: one line each; "interpret" refuses naming the problem; bad shapes
    are refused naming the value."""
    assert latent_write_problems(jnp.bfloat16, 512, 64) == []
    assert latent_write_problems(jnp.uint8, 512, 64) == [
        "pages of uint8: the kernel writes values, not encoded (fp8 / fp4) rows"
    ]
    assert latent_write_problems(jnp.float32, 96, 64) == [
        "K = 96 latent columns is not a power of two (a load of its own)"
    ]
    assert latent_write_problems(jnp.float32, 64, 24) == [
        "R = 24 rotary columns is not twice a power of two (a load a half)"
    ]
    pages, kv, pos, table, w, freqs, _ = _inputs(1, 1, 64, 16)
    with pytest.raises(
        ValueError, match=r"^latent_write impl='interpret': the kernels cannot serve this: pages of uint8"
    ):
        latent_write(
            pages.astype(jnp.uint8), kv, pos, table, w, freqs, eps=EPS, layer=0, norm_layer=0, impl="interpret"
        )
    with pytest.raises(ValueError, match=r"^latent_write: kv must be \[B=1, T=1, C=80\] \(C the pages' width\), got"):
        latent_write(pages, kv[..., :72], pos, table, w, freqs, eps=EPS, layer=0, norm_layer=0)
    with pytest.raises(ValueError, match=r"^latent_write: pages \[N, G, C\] \(or \[L, N, G, C\] with a layer\)"):
        latent_write(pages, kv, pos, table, w, freqs, eps=EPS, norm_layer=0)
    with pytest.raises(ValueError, match=r"^latent_write: norm weight \[K=64\] \(or \[L, K\] with a norm_layer\)"):
        latent_write(pages, kv, pos, table, w, freqs, eps=EPS, layer=0)
    with pytest.raises(ValueError, match=r"^latent_write: block table \[B=1, P\] expected, got \(2, 3\)$"):
        latent_write(pages, kv, pos, jnp.zeros((2, 3), jnp.int32), w, freqs, eps=EPS, layer=0, norm_layer=0)


@pytest.mark.parametrize("B, S", [(1, 4), (32, 0)])
def test_cross_lowers_for_sm90(B, S):
    """Traced and lowered for an H100 on a CPU host at V2-Lite's shapes (K = 512, R = 64, 27 pools of 64-token
    pages; one token with wkv_a's 4 partials, and B = 32 tokens as rows): one Triton call, no XLA reduction or
    scatter beside it (catches an op the Triton lowering refuses, or the norm or the write left to XLA)."""
    from jax._src import mesh as mesh_lib

    C, L, N, P = 576, 27, 19, 40

    def f(pages, kv, pos, table, w, layer, norm_layer):
        kv = Partials(kv, (B, 1, C), jnp.dtype(jnp.bfloat16)) if S else kv
        return latent_write(
            pages, kv, pos, table, w, inv_frequencies(YARN), eps=EPS, layer=layer, norm_layer=norm_layer, impl="kernel"
        )

    kv = ((S, 8, C), jnp.float32) if S else ((B, 1, C), jnp.bfloat16)
    args = [((L, N, 64, C), jnp.bfloat16), kv, ((B, 1), jnp.int32), ((B, P), jnp.int32), ((26, 512), jnp.bfloat16)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in args] + [jax.ShapeDtypeStruct((), jnp.int32)] * 2
    h100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h100)):
        text = jax.jit(f, donate_argnums=0).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert "stablehlo.reduce" not in text and "stablehlo.scatter" not in text


def test_a_scanned_decode_step_writes_its_latents_through_the_kernel():
    """A scanned model's cached decode step on the interpret backend: each layer's latent is normalised, rotated and
    written by one `latent_write` call (one in each stack's scan body, one in the MTP-less model's dense layer stack),
    reading kv_norm's weight out of the whole stack, and the step's logits equal the reference backend's (XLA's
    norm, rope and scatter). Catches the kernel reading another layer's norm (each layer's differ), writing another
    layer's pool, and the stack's weight not passed whole to the scan's body."""
    from micro_configs import decode_step_on_both_backends, narrow_v2_lite

    from models import DeepSeekModel

    cfg = narrow_v2_lite(3).replace(hidden_size=128, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=16)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0), moe_impl="decode")
    norms = nnx.state(model, nnx.PathContains("kv_norm"))
    nnx.update(model, jax.tree.map(lambda w: 1.0 + 0.3 * jax.random.normal(jax.random.key(1), w.shape, w.dtype), norms))
    (got, jaxpr), (want, ref_jaxpr) = decode_step_on_both_backends(model)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
    assert jaxpr.count("name=latent_write") == 2  # the dense layer's stack and the MoE layers' stack
    assert ref_jaxpr.count("name=latent_write") == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", gpu_full(["v2_lite", "v2_lite_32", "verify"], ["v2_lite", "v2_lite_32"]))
def test_gpu_kernel_equals_the_reference(name):
    """The compiled kernel against the jnp reference at V2-Lite's widths: a B = 1 decode step (wkv_a's 4 partials),
    B = 32 (rows), and a verify step of 3 tokens a row."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    B, T, S = {"v2_lite": (1, 1, 4), "v2_lite_32": (32, 1, 0), "verify": (4, 3, 0)}[name]
    pages, kv, pos, table, w, freqs, scale = _inputs(B, T, 512, 64, S=S, L=4, N=200, G=64, P=4)
    kw = dict(eps=EPS, interleave=True, rope_scale=scale, layer=jnp.int32(3), norm_layer=jnp.int32(1))
    got = jax.jit(lambda pages, w: latent_write(pages, kv, pos, table, w, freqs, impl="kernel", **kw))(pages, w)
    _assert_written(got, latent_write_reference(pages, kv, pos, table, w, freqs, **kw), pages)
