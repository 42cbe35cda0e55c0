"""MLA: the decompressed and the absorbed forms agree; the absorption identity holds at DeepSeek-V3 sizes."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import MLA, ModelConfig, mla_absorbed_attention, mla_decompressed_attention
from tests.tiers import full, gpu_full


def _randomize(module, seed):
    """Random weights everywhere, norm weights != 1, so nothing hides behind an identity."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [
        (1.0 + 0.2 * jax.random.normal(k, x.shape)) if x.ndim == 1 else 0.08 * jax.random.normal(k, x.shape)
        for k, x in zip(keys, leaves)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _positions(B, T):
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


# The layer jitted: one compile a shape (shared by layers of one structure) instead of one an op.
_call = nnx.jit(lambda m, x, pos, absorbed=False: m(x, pos, absorbed=absorbed), static_argnames="absorbed")


CFGS = {
    "tiny": ModelConfig.tiny(),
    "no_q_lora": ModelConfig.tiny().replace(q_lora_rank=None, rope_interleave=True, model_type="deepseek_v2"),
    "half_rope_plain": ModelConfig.tiny().replace(rope_interleave=False, rope_type="default", rope_factor=1.0),
}


@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("seed", full((0, 1, 2), (0,), "seed 0 at every config and query length"))
@pytest.mark.parametrize("T", [1, 5, 33])
def test_decompressed_equals_absorbed(name, seed, T):
    cfg = CFGS[name]
    mla = _randomize(MLA(cfg, rngs=nnx.Rngs(seed)), seed)
    x = jax.random.normal(jax.random.key(100 + seed), (2, T, cfg.hidden_size))
    pos = _positions(2, T) + seed * 7  # any start offset
    decomp = _call(mla, x, pos, absorbed=False)
    absorbed = _call(mla, x, pos, absorbed=True)
    assert decomp.shape == (2, T, cfg.hidden_size)
    chex.assert_trees_all_close(absorbed, decomp, rtol=2e-5, atol=2e-5)
    assert float(jnp.abs(decomp).max()) > 1e-3  # a real signal, not zeros


def test_ragged_batch_with_padding_positions():
    """Sequences of different lengths in one batch: padded keys (position -1) are never attended to."""
    cfg = CFGS["tiny"]
    mla = _randomize(MLA(cfg, rngs=nnx.Rngs(3)), 3)
    lens = [9, 4]
    x = jax.random.normal(jax.random.key(4), (2, 9, cfg.hidden_size))
    pos = jnp.array([list(range(9)), list(range(4)) + [-1] * 5], jnp.int32)
    full = {ab: _call(mla, x, pos, absorbed=ab) for ab in (False, True)}
    chex.assert_trees_all_close(full[True], full[False], rtol=2e-5, atol=2e-5)
    for b, n in enumerate(lens):  # each row equals running that sequence alone
        alone = _call(mla, x[b : b + 1, :n], pos[b : b + 1, :n])
        chex.assert_trees_all_close(full[False][b : b + 1, :n], alone, rtol=2e-5, atol=2e-5)


def test_causal():
    cfg = CFGS["tiny"]
    mla = _randomize(MLA(cfg, rngs=nnx.Rngs(5)), 5)
    x = jax.random.normal(jax.random.key(6), (1, 8, cfg.hidden_size))
    y = _call(mla, x, _positions(1, 8))
    y2 = _call(mla, x.at[:, 5:].set(7.0), _positions(1, 8))
    chex.assert_trees_all_close(y[:, :5], y2[:, :5], rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(y[:, 5:]), np.asarray(y2[:, 5:]))


def test_decompressed_matches_per_head_numpy():
    """The decompressed reference against a plain float64 NumPy loop over heads."""
    rng = np.random.default_rng(7)
    B, T, S, H, N, R, V, L = 1, 3, 6, 2, 8, 4, 8, 16
    q_nope = rng.standard_normal((B, T, H, N))
    q_pe = rng.standard_normal((B, T, H, R))
    lat = rng.standard_normal((B, S, L + R))
    w = rng.standard_normal((L, H, N + V)) * 0.3
    qpos = np.array([[3, 4, 5]])
    kpos = np.arange(S)[None]
    out = np.zeros((B, T, H, V))
    for h in range(H):
        k = np.concatenate([lat[0, :, :L] @ w[:, h, :N], lat[0, :, L:]], -1)
        v = lat[0, :, :L] @ w[:, h, N:]
        q = np.concatenate([q_nope[0, :, h], q_pe[0, :, h]], -1)
        s = q @ k.T * 0.3
        s = np.where(kpos[0][None] <= qpos[0][:, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[0, :, h] = (p / p.sum(-1, keepdims=True)) @ v
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = mla_decompressed_attention(
        f32(q_nope), f32(q_pe), f32(lat), f32(w), jnp.asarray(qpos), jnp.asarray(kpos), softmax_scale=0.3
    )
    np.testing.assert_allclose(np.asarray(got), out, rtol=1e-5, atol=1e-5)


def test_query_blocks_equal_one_block_and_their_gradients():
    """`q_block` (training's memory-bounded attention) against the whole block: outputs and the
    gradients of every input, with padding (negative positions) and a ragged start in the batch.
    Guards: a block masked with another block's positions (the causal mask shifts), blocks put back in
    the wrong order, and q_block not dividing T silently truncating (it raises)."""
    rng = np.random.default_rng(3)
    B, T, H, N, R, V, L = 2, 12, 2, 8, 4, 8, 16
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    args = [f32(rng.standard_normal(s)) for s in ((B, T, H, N), (B, T, H, R), (B, T, L + R))]
    w = f32(rng.standard_normal((L, H, N + V)) * 0.3)
    pos = jnp.asarray(np.stack([np.arange(T), np.r_[[-1, -1, -1], np.arange(T - 3)]]), jnp.int32)

    def loss(q_block, qn, qp, lat, w):
        o = mla_decompressed_attention(qn, qp, lat, w, pos, pos, softmax_scale=0.3, q_block=q_block)
        return jnp.sum(jnp.sin(o) * jnp.arange(o.size, dtype=o.dtype).reshape(o.shape) / o.size), o

    (l1, o1), g1 = jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True)(None, *args, w)
    (l4, o4), g4 = jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True)(4, *args, w)
    chex.assert_trees_all_close((o4, g4), (o1, g1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="q_block=5 must be >= 1 and divide the 12 queries"):
        mla_decompressed_attention(*args, w, pos, pos, softmax_scale=0.3, q_block=5)


def _cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.full(
    "test_decompressed_equals_absorbed runs the same identity through the MLA layer at every config in the quick tier"
)
def test_absorption_identity_at_deepseek_v3_sizes():
    """128 heads, nope 128, latent 512, rope 64, 512 keys: decompressed vs absorbed cosine > 0.999999 in fp32.

    In bf16 (inputs and weights rounded to bf16, both paths with fp32 accumulation) the two
    paths differ by rounding of different intermediates; the stated bound is rel. L2 < 2e-2.
    """
    H, N, R, V, L, S, T = 128, 128, 64, 128, 512, 512, 2
    k = jax.random.split(jax.random.key(11), 4)
    q_nope = jax.random.normal(k[0], (1, T, H, N))
    q_pe = jax.random.normal(k[1], (1, T, H, R))
    lat = jax.random.normal(k[2], (1, S, L + R))
    w = jax.random.normal(k[3], (L, H, N + V)) * L**-0.5
    qpos = jnp.array([[S - 2, S - 1]], jnp.int32)
    kpos = jnp.arange(S, dtype=jnp.int32)[None]
    scale = ModelConfig.deepseek_v3().softmax_scale

    def both(dtype):
        qn, qp, lt, wt = (a.astype(dtype) for a in (q_nope, q_pe, lat, w))
        decomp = mla_decompressed_attention(qn, qp, lt, wt, qpos, kpos, softmax_scale=scale)
        q_lat = jnp.einsum("bthn,lhn->bthl", qn, wt[..., :N], preferred_element_type=jnp.float32).astype(dtype)
        o_lat, lse = mla_absorbed_attention(
            jnp.concatenate([q_lat, qp], -1), lt, qpos, kpos, softmax_scale=scale, kv_lora_rank=L
        )
        absorbed = jnp.einsum("bthl,lhv->bthv", o_lat, wt[..., N:], preferred_element_type=jnp.float32)
        return decomp.astype(jnp.float32), absorbed, lse

    decomp, absorbed, lse = both(jnp.float32)
    assert _cosine(decomp, absorbed) > 0.999999
    assert bool(jnp.all(jnp.isfinite(lse)))
    ref = decomp
    decomp16, absorbed16, _ = both(jnp.bfloat16)
    for got in (decomp16, absorbed16):
        rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        assert rel < 2e-2, rel


def test_bad_shapes_raise():
    cfg = CFGS["tiny"]
    mla = MLA(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="MLA expects x"):
        mla(jnp.zeros((2, 3, cfg.hidden_size + 1)), _positions(2, 3))
    with pytest.raises(ValueError, match="positions must be"):
        mla(jnp.zeros((2, 3, cfg.hidden_size)), _positions(2, 4))


def test_bf16_params_run():
    cfg = CFGS["tiny"]
    mla = MLA(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (1, 4, cfg.hidden_size), jnp.bfloat16)
    a = mla(x, _positions(1, 4))
    b = mla(x, _positions(1, 4), absorbed=True)
    assert a.dtype == jnp.bfloat16
    rel = float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(a.astype(jnp.float32)))
    assert rel < 3e-2


def test_unknown_attention_impl_is_refused():
    """A misspelt implementation raises instead of silently taking the jnp path."""
    z = jnp.zeros((1, 2, 1, 4))
    with pytest.raises(ValueError, match="impl='flash': must be one of"):
        mla_decompressed_attention(
            z,
            z,
            jnp.zeros((1, 2, 8)),
            jnp.zeros((4, 1, 8)),
            _positions(1, 2),
            _positions(1, 2),
            softmax_scale=1.0,
            impl="flash",
        )


@pytest.mark.gpu
@pytest.mark.parametrize("impl", gpu_full(["cudnn", "mgpu"], ("mgpu",)))
@pytest.mark.parametrize(
    "N,R,V", gpu_full([(128, 64, 128), (16, 64, 16)], [(128, 64, 128)]), ids=["v2-v3-widths", "builtin-widths"]
)
def test_flash_attention_impls_equal_the_jnp_form_with_gradients(N, R, V, impl):
    """impl="cudnn" (cuDNN's flash attention, training's fast path) and impl="mgpu" (this project's Mosaic
    GPU flash attention, `pallas_kernels.flash_attention`; the built-in widths padded to 128 / 64 inside)
    against the jnp form at MLA's widths (qk 192, v 128; and the built-in model's qk 80, v 16), bf16, rows
    right-padded to different lengths: outputs of the valid queries and the gradients of every input.
    Guards: a wrong scale, the causal mask off or shifted, padding keys visible, the v/k halves of wkv_b
    swapped, the mgpu wrapper's padding feeding real values wrong. Left padding (which a by-index mask
    cannot express) gives NaN, not a different attention."""
    from pallas_kernels.backend import on_hopper

    if impl == "mgpu" and not on_hopper():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    if jax.default_backend() != "gpu":
        pytest.skip("cuDNN needs a CUDA GPU")
    rng = np.random.default_rng(5)
    B, T, H, L = 2, 384, 4, 512
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    args = [bf(rng.standard_normal(s)) for s in ((B, T, H, N), (B, T, H, R), (B, T, L + R))]
    w = bf(rng.standard_normal((L, H, N + V)) * 0.05)
    n = np.array([T, T - 77])
    pos = jnp.asarray(np.where(np.arange(T)[None] < n[:, None], np.arange(T)[None], -1), jnp.int32)
    valid = (pos >= 0)[:, :, None, None].astype(jnp.float32)
    weights = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32) * valid

    def loss(impl, qn, qp, lat, w, pos=pos):
        o = mla_decompressed_attention(qn, qp, lat, w, pos, pos, softmax_scale=N**-0.5, impl=impl).astype(jnp.float32)
        return jnp.sum(o * weights), o * valid

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True), static_argnums=0)
    (_, o_ref), g_ref = grad("xla", *args, w)
    (_, o_got), g_got = grad(impl, *args, w)
    f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
    chex.assert_trees_all_close(f32(o_got), f32(o_ref), rtol=2e-2, atol=2e-2)
    for got, ref in zip(f32(g_got), f32(g_ref)):
        assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 2e-2
    left = jnp.asarray(np.stack([np.arange(T), np.r_[[-1] * 5, np.arange(T - 5)]]), jnp.int32)
    o_left = mla_decompressed_attention(*args, w, left, left, softmax_scale=N**-0.5, impl=impl)
    assert bool(jnp.all(jnp.isnan(o_left.astype(jnp.float32))))


def test_cudnn_path_outside_a_gpu_is_one_line_error():
    """impl="cudnn" on a CPU says what it needs instead of cuDNN's 'not detected' traceback from inside jit."""
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the refusal off a GPU")
    z = jnp.zeros((1, 2, 1, 4))
    with pytest.raises(ValueError, match="impl='cudnn' needs a CUDA GPU .*the backend is cpu: use impl='xla'"):
        mla_decompressed_attention(
            z,
            z,
            jnp.zeros((1, 2, 8)),
            jnp.zeros((4, 1, 8)),
            _positions(1, 2),
            _positions(1, 2),
            softmax_scale=1.0,
            impl="cudnn",
        )


def test_einsum_f32_widens_bf16_on_the_cpu_only():
    """`einsum_f32` with bf16 operands: on the CPU the lowered dot takes f32 operands (XLA:CPU has no
    batched bf16 x bf16 -> f32 dot; the bf16 engine with two rows failed, see the e2e cell in
    tests/test_sharding.py), lowered for sm_90 it stays a bf16 dot into f32; the values equal the
    float64 einsum of the same bf16 values to fp32 rounding. Catches the widening applied on every
    platform (an f32 GEMM on the GPU's tensor cores: several times slower) or on none."""
    from mla_jax.attention import einsum_f32

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((2, 3, 4, 64)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((64, 4, 32)), jnp.bfloat16)
    f = jax.jit(lambda a, b: einsum_f32("bthl,lhv->bthv", a, b))
    got = f(a, b)
    want = np.einsum("bthl,lhv->bthv", np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    dots = lambda text: re.findall(r"stablehlo.dot_general[^\n]*", text)  # noqa: E731
    cpu = dots(f.trace(a, b).lower().as_text())
    cuda = dots(f.trace(a, b).lower(lowering_platforms=("cuda",)).as_text())
    assert cpu and all("bf16" not in d for d in cpu), cpu
    assert cuda and all("bf16" in d for d in cuda), cuda


# ------------------------------------------------------------------------------------------
# The cached path's long chunks through the flash forward with query offsets
# ------------------------------------------------------------------------------------------
def test_cached_prefill_attention_resolves_to_the_flash_kernel_on_kernel_backends():
    """`resolve_decompressed_impl("auto", cache_impl=...)`, the cached path's choice: the flash forward over
    the prefix ("mgpu") on a kernel backend ("kernel", also when cross-lowered on a CPU, or "interpret") with
    bf16 compute and one pool; the jnp attention on the reference backend, in fp32, or with a pool per data
    rank; cuDNN refused over a cache. Catches the cached path asking the Hopper check (never the kernel in
    the interpreter or in a cross-lowered step) or taking the kernel on fp32 models / split pools."""
    from mla_jax.attention import resolve_decompressed_impl

    r = lambda cache_impl, dtype=jnp.bfloat16, **kw: resolve_decompressed_impl(  # noqa: E731
        "auto", dtype=dtype, cache_impl=cache_impl, **kw
    )
    assert (r("kernel"), r("interpret"), r("reference")) == ("mgpu", "mgpu", "xla")
    assert (r("kernel", jnp.float32), r("kernel", on_mesh=True)) == ("xla", "xla")
    assert resolve_decompressed_impl("xla", dtype=jnp.bfloat16, cache_impl="kernel") == "xla"
    z = jnp.zeros((1, 2, 1, 4))
    with pytest.raises(ValueError, match="impl='cudnn' cannot attend over a cache"):
        mla_decompressed_attention(
            z, z, jnp.zeros((1, 2, 8)), jnp.zeros((4, 1, 8)), _positions(1, 2), _positions(1, 2),
            softmax_scale=1.0, impl="cudnn", cache_impl="kernel",
        )  # fmt: skip


def test_cached_mgpu_wrapper_derives_offsets_and_refuses_other_positions():
    """`mla_decompressed_attention(impl="mgpu", cache_impl=...)` with the kernel stood in for by its jnp
    reference (`cache_impl="reference"`): rows of a gathered cache (keys 0..n-1 then -1) and chunks at
    p0.. then -1, with prefixes 0, 5 (mid-page of any page size) and 11 and an empty row, equal the jnp
    form; padding queries give 0; positions that are not consecutive give NaN. Catches the query offset
    taken from the wrong column, the key length counted wrong, padding queries not zeroed, and a gap in
    the positions attended as if the chunk were contiguous."""
    B, T, S, H, N, R, L, V = 4, 6, 16, 2, 24, 8, 16, 16  # widths padded to 64 inside
    rng = np.random.default_rng(7)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.5)  # noqa: E731
    args = (f32(B, T, H, N), f32(B, T, H, R), f32(B, S, L + R), f32(L, H, N + V))
    prefix, chunk = np.array([0, 5, 11, 0]), np.array([6, 4, 5, 0])
    t, s = np.arange(T)[None], np.arange(S)[None]
    q_pos = jnp.asarray(np.where(t < chunk[:, None], prefix[:, None] + t, -1), jnp.int32)
    kv_pos = jnp.asarray(np.where(s < (prefix + chunk)[:, None], s, -1), jnp.int32)

    @functools.partial(jax.jit, static_argnums=1)
    def attend(q_pos, impl):
        return mla_decompressed_attention(
            *args, q_pos, kv_pos, softmax_scale=0.3, impl=impl, cache_impl="reference" if impl == "mgpu" else None
        )

    want = np.asarray(attend(q_pos, "xla"))
    got = np.asarray(attend(q_pos, "mgpu"))
    assert np.abs(want).max() > 0.1 and not got[3].any() and not got[1, 4:].any()
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)  # bf16 inputs in the kernel form
    gap = q_pos.at[1, 2].set(9)
    assert np.isnan(np.asarray(attend(gap, "mgpu"))).all()


def _cached_chunks(heads, impls, calls):
    """The tiny config's MLA layer (bf16, `heads` heads), cached call of a chunk after a prefix, as the
    model's layer scan makes it: 3 rows on 16-token pages of a NaN-filled pool: a prefix of 37 tokens (2.3
    pages) then 40, no prefix and 25 tokens, an idle row. The prefix is written by the jnp path; the chunk
    runs on each backend of `impls` -> {impl: out float32 [3, 40, D]}. `calls` collects the flash kernel's
    trace-time calls."""
    import dataclasses

    from mla_jax import flash_forms
    from mla_jax.kv_cache import KVCache, PagedLatentCache

    cfg = ModelConfig.tiny().replace(num_attention_heads=heads)
    mla = _randomize(MLA(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16), 0)
    prefix, chunk, T = [37, 0, 0], [40, 25, 0], 40
    pool = PagedLatentCache(
        num_layers=1, num_pages=24, page_size=16, latent_dim=cfg.latent_dim, max_seqs=3, max_pages_per_seq=8,
        rope_dim=cfg.qk_rope_head_dim, fill_value=float("nan"),
    )  # fmt: skip
    for b in range(3):
        pool.reserve(b, prefix[b] + chunk[b])
    x = jax.random.normal(jax.random.key(1), (3, 2 * T, cfg.hidden_size), jnp.bfloat16)
    pos = np.full((2, 3, T), -1, np.int32)
    for b in range(3):
        pos[0, b, : prefix[b]] = np.arange(prefix[b])
        pos[1, b, : chunk[b]] = prefix[b] + np.arange(chunk[b])
    original = flash_forms.flash_attention_prefill

    def counted(*a, **kw):
        calls.append(kw["impl"])
        return original(*a, **kw)

    step = nnx.jit(lambda m, x, pos, c: m(x, pos, cache=c))
    cache = KVCache.create(pool.pages, pool.block_tables, prefix, decompressed_threshold=16)
    _, cache = step(mla, x[:, :T], jnp.asarray(pos[0]), cache)
    cache = cache.with_lengths([p + c for p, c in zip(prefix, chunk)])
    outs = {}
    flash_forms.flash_attention_prefill = counted
    try:
        for impl in impls:
            out, _ = step(mla, x[:, T:], jnp.asarray(pos[1]), dataclasses.replace(cache, impl=impl))
            outs[impl] = np.asarray(out, np.float32)
    finally:
        flash_forms.flash_attention_prefill = original
    return outs


@pytest.mark.parametrize(
    "impl, heads",
    [
        ("interpret", 1),
        pytest.param("kernel", 4, marks=pytest.mark.gpu),
    ],
)
def test_cached_prefill_chunk_through_the_flash_kernel_equals_the_jnp_path(impl, heads):
    """A prefill chunk of the cached path (the decompressed path: 40 >= the threshold 16) on a kernel
    backend runs `flash_attention_prefill` (the interpreter on a CPU with 1 head; the compiled kernel on a
    Hopper GPU with the tiny config's 4) and gives the jnp path's output over the same cache: a row after
    a 37-token prefix (mid-page), a row with no prefix, an idle row. Catches the chunk attending only to
    itself or from position 0 (the prefix ignored or the offset dropped), the offset of one row applied to
    another, never-written NaN rows past a row's length read, and the kernel never reached (or reached on
    the reference backend)."""
    if impl == "kernel":
        from pallas_kernels.backend import on_hopper

        if not on_hopper():
            pytest.skip("needs a Hopper GPU")
    calls = []
    outs = _cached_chunks(heads, ("reference", impl), calls)
    assert calls == [impl]
    got, want = outs[impl], outs["reference"]
    assert np.isfinite(got).all() and np.abs(want).max() > 1e-2
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, rel


@pytest.mark.parametrize("impl, heads", [("reference", 4), ("interpret", 1)])
def test_cached_chunk_a_row_at_a_time_equals_all_rows_at_once(monkeypatch, impl, heads):
    """The cached path's decompressed attention one row a group (`CACHED_GROUP_BYTES` below one row's keys and
    values) gives what all three rows at once give (a 37-token prefix, none, an idle row), through the jnp form
    and through the flash kernel in the interpreter. Catches a group attending over another group's cache, or
    one group's query offsets and key lengths applied to the others."""
    from mla_jax import attention

    monkeypatch.setattr(attention, "CACHED_GROUP_BYTES", 1 << 40)
    whole = _cached_chunks(heads, (impl,), [])[impl]
    monkeypatch.setattr(attention, "CACHED_GROUP_BYTES", 1)
    calls = []
    rows = _cached_chunks(heads, (impl,), calls)[impl]
    assert calls == ([impl] if impl == "interpret" else [])  # the flash kernel traced once, in the groups' map
    assert np.abs(whole).max() > 1e-2
    chex.assert_trees_all_close(rows, whole, atol=1e-6, rtol=0)


def test_cached_rows_per_group():
    """DeepSeek-V3's prefill chunk of 32 rows over 2048-token tables (128 heads, N + V = 256: 128 MiB of keys
    and values a row) attends 8 rows a group; a batch the budget does not divide takes its largest divisor that
    fits; a row over the budget is a group alone; a small batch is one group; the jnp form's scores count."""
    from mla_jax.attention import CACHED_GROUP_BYTES, cached_rows_per_group

    assert CACHED_GROUP_BYTES == 1 << 30
    assert cached_rows_per_group(32, 2048, 128, 256) == 8
    assert cached_rows_per_group(12, 2048, 128, 256) == 6
    assert cached_rows_per_group(7, 2048, 128, 256) == 7
    assert cached_rows_per_group(9, 2048, 128, 256) == 3
    assert cached_rows_per_group(3, 1 << 20, 128, 256) == 1
    assert cached_rows_per_group(4, 2048, 128, 256, itemsize=4) == 4
    assert cached_rows_per_group(16, 2048, 128, 256, itemsize=4) == 4
    # the jnp form's float32 scores of 512 queries a row (512 MiB) beside its 128 MiB of keys and values
    assert cached_rows_per_group(32, 2048, 128, 256, scores_T=512) == 1
    assert cached_rows_per_group(32, 2048, 128, 256, scores_T=64) == 4


def test_cached_attention_holds_one_group_of_keys_and_values(monkeypatch):
    """The compiled cached attention of 8 rows over 256 keys (8 heads, N = V = 128: 1 MiB of up-projected keys
    and values a row) with a budget of one row holds no array of 4 rows' keys and values or more. Catches the
    rows decompressed all at once (8 MiB, 12 MiB in the keys' float32 copy on a CPU)."""
    from mla_jax import attention
    from tests import hlo
    from tests.xla_opt import optimized

    B, T, S, H, N, R, L = 8, 16, 256, 8, 128, 64, 512
    monkeypatch.setattr(attention, "CACHED_GROUP_BYTES", S * H * 2 * N * 2)
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    f = functools.partial(mla_decompressed_attention, softmax_scale=0.1, impl="xla", cache_impl="reference")
    with optimized():
        text = (
            jax.jit(f)
            .trace(bf(B, T, H, N), bf(B, T, H, R), bf(B, S, L + R), bf(L, H, 2 * N), i32(B, T), i32(B, S))
            .lower()
            .compile()
            .as_text()
        )
    assert hlo.buffers(text, 4 * S * H * 2 * N * 2, dtypes=("bf16", "f32")) == []


def test_model_cached_prefill_lowers_with_the_offset_kernel():
    """The tiny model's cached prefill step (bf16, a 256-token chunk: the decompressed path) on the "kernel"
    backend, cross-lowered for sm_90: the offset flash kernel runs in its layer scans (the reference backend
    never calls it: the test above). Catches the model's cached forward not reaching
    the kernel on the GPU backend (the layer's resolver, or the scan dropping the cache's backend)."""
    from mla_jax.kv_cache import KVCache
    from models import DeepSeekModel
    from pallas_kernels import resolve_page_format

    cfg = ModelConfig.tiny()
    model = nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    graphdef, state = nnx.split(model)
    B, T, P, G = 1, 256, 8, 64
    pages = jax.ShapeDtypeStruct((cfg.num_hidden_layers + 1, 16, G, cfg.latent_dim), jnp.bfloat16)
    fmt = resolve_page_format("bf16", value_dim=cfg.latent_dim, rope_dim=cfg.qk_rope_head_dim)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731

    def lowered(impl):
        def step(state, ids, pos, pages, table, lens):
            cache = KVCache(pages, table, lens, jnp.zeros((), jnp.int32), impl, 256, fmt)
            h, cache = nnx.merge(graphdef, state).hidden_states(ids, pos, cache=cache)
            return h, cache.pages

        return (
            jax.jit(step)
            .trace(state, i32(B, T), i32(B, T), pages, i32(B, P), i32(B))
            .lower(lowering_platforms=("cuda",))
        )

    assert "flash_attention_fwd_offset" in lowered("kernel").as_text()
