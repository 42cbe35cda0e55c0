"""MoE: routers against an independent NumPy implementation and their properties; grouped GEMM vs dense."""

from __future__ import annotations

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import ModelConfig
from models.experts import MgpuTuning, moe_dense_reference, moe_grouped, resolve_moe_impl
from models.moe import ROUTER_REDUCE_ROWS, MoE, Router, RouterBias, route
from tests.tiers import gpu_full

V3 = ModelConfig.tiny().replace(
    n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, hidden_size=32, moe_intermediate_size=16
)
V2_GREEDY = V3.replace(
    scoring_func="softmax",
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.5,
    model_type="deepseek_v2",
)
V2_GROUP = V2_GREEDY.replace(
    topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=5, routed_scaling_factor=16.0
)


# ------------------------------------------------------------------------------------------
# An independent NumPy router (float64, loops), written from DEEPSEEK_SEMANTICS.md §2
# ------------------------------------------------------------------------------------------
def np_route(logits, bias, cfg):
    logits = np.asarray(logits, np.float64)
    T, E = logits.shape
    G, per = cfg.n_group, E // cfg.n_group
    if cfg.scoring_func == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-logits))
    else:
        z = np.exp(logits - logits.max(-1, keepdims=True))
        s = z / z.sum(-1, keepdims=True)
    idx_out, w_out = [], []
    for t in range(T):
        choice = s[t] + (np.asarray(bias, np.float64) if cfg.topk_method == "noaux_tc" else 0.0)
        if cfg.topk_method != "greedy":
            groups = choice.reshape(G, per)
            if cfg.topk_method == "noaux_tc":
                gscore = np.sort(groups, axis=1)[:, -2:].sum(1)
            else:
                gscore = groups.max(1)
            kept = np.argsort(-gscore, kind="stable")[: cfg.topk_group]
            allowed = np.isin(np.arange(E) // per, kept)
            choice = np.where(allowed, choice, -np.inf)
        idx = np.argsort(-choice, kind="stable")[: cfg.num_experts_per_tok]
        w = s[t, idx]
        if cfg.topk_method == "noaux_tc" and cfg.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        idx_out.append(np.sort(idx))
        w_out.append(w[np.argsort(idx)] * cfg.routed_scaling_factor)
    return np.array(idx_out), np.array(w_out)


def sorted_by_expert(idx, w):
    idx, w = np.asarray(idx), np.asarray(w)
    o = np.argsort(idx, axis=-1)
    return np.take_along_axis(idx, o, -1), np.take_along_axis(w, o, -1)


@pytest.mark.parametrize("cfg", [V3, V2_GREEDY, V2_GROUP], ids=["noaux_tc", "greedy", "group_limited_greedy"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_router_matches_numpy(cfg, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    logits = 2.0 * jax.random.normal(k1, (64, cfg.n_routed_experts))
    bias = 0.5 * jax.random.normal(k2, (cfg.n_routed_experts,)) if cfg.topk_method == "noaux_tc" else None
    r = route(logits, bias, cfg)
    assert r.indices.dtype == jnp.int32 and r.weights.dtype == jnp.float32 and r.scores.dtype == jnp.float32
    idx, w = sorted_by_expert(r.indices, r.weights)
    ref_idx, ref_w = np_route(logits, bias, cfg)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(w, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("T", [1, 2, ROUTER_REDUCE_ROWS, ROUTER_REDUCE_ROWS + 1])
def test_router_logits_of_a_few_rows_are_a_reduction_equal_to_the_float64_product(T):
    """`Router.logits` of 2 to ROUTER_REDUCE_ROWS rows is a product summed over D (no dot in its program), within
    f32 rounding of the float64 product as the dot of other row counts is. Mutation it catches: those rows back
    on a dot (compiled for an H100, a two-row dot of a scanned layer's router is a GEMM fusion behind a copy of
    the layer's [D, E]: V2-Lite's decode step at B = 2 launched 709 kernels, 658 with the reduction)."""
    router = Router(V3, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(T), (T, V3.hidden_size), jnp.bfloat16)
    got = router.logits(x)
    want = np.asarray(x, np.float64) @ np.asarray(router.kernel[...], np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(router.logits)(x))
    assert ("dot_general" in jaxpr) == (not 1 < T <= ROUTER_REDUCE_ROWS), jaxpr


def test_bias_changes_choice_but_never_weight_values():
    k1, k2 = jax.random.split(jax.random.key(3))
    logits = jax.random.normal(k1, (256, V3.n_routed_experts))
    bias = 0.5 * jax.random.normal(k2, (V3.n_routed_experts,))
    r0 = route(logits, jnp.zeros_like(bias), V3)
    r1 = route(logits, bias, V3)
    i0, w0 = sorted_by_expert(r0.indices, r0.weights)
    i1, w1 = sorted_by_expert(r1.indices, r1.weights)
    same = np.all(i0 == i1, axis=1)
    assert 0 < same.sum() < len(same), "the bias should change the choice for some tokens, not all"
    # Same experts -> same weights (to the rounding of the sum, whose order follows the top-k
    # order): the bias never enters the weight values.
    np.testing.assert_allclose(w0[same], w1[same], rtol=3e-7, atol=0)
    # And the weights are always the unbiased sigmoid of the chosen experts, normalised, scaled.
    s = np.asarray(jax.nn.sigmoid(logits))
    g = np.take_along_axis(s, i1, -1)
    np.testing.assert_allclose(w1, g / g.sum(-1, keepdims=True) * V3.routed_scaling_factor, rtol=1e-6)


@pytest.mark.parametrize("bias_shift", [0.0, -5.0])
def test_only_kept_groups_are_chosen(bias_shift):
    # A strongly negative bias makes every biased score negative: a 0-fill of the dropped groups
    # (instead of -inf) would then pick experts from dropped groups (flashinfer #2168).
    k1, k2 = jax.random.split(jax.random.key(4))
    E, G = V3.n_routed_experts, V3.n_group
    logits = jax.random.normal(k1, (256, E))
    bias = 0.3 * jax.random.normal(k2, (E,)) + bias_shift
    r = route(logits, bias, V3)
    choice = np.asarray(jax.nn.sigmoid(logits)) + np.asarray(bias)
    gscore = np.sort(choice.reshape(-1, G, E // G), axis=-1)[..., -2:].sum(-1)
    kept = np.argsort(-gscore, axis=-1)[:, : V3.topk_group]
    chosen_group = np.asarray(r.indices) // (E // G)
    assert all(set(chosen_group[t]) <= set(kept[t]) for t in range(len(kept)))
    # The group limit is not vacuous here: an unrestricted top-k would leave the kept groups.
    plain = np.argsort(-choice, axis=-1)[:, : V3.num_experts_per_tok] // (E // G)
    assert any(not set(plain[t]) <= set(kept[t]) for t in range(len(kept)))


def test_normalised_weights_sum_to_scaling_factor():
    logits = jax.random.normal(jax.random.key(5), (128, V3.n_routed_experts))
    r = route(logits, jnp.zeros((V3.n_routed_experts,)), V3)
    np.testing.assert_allclose(np.asarray(r.weights).sum(-1), V3.routed_scaling_factor, rtol=1e-6)
    # V2 never renormalises, even with norm_topk_prob=True in the config (HF ignores it for V2).
    r2 = route(logits, None, V2_GREEDY.replace(norm_topk_prob=True))
    s = np.asarray(jax.nn.softmax(logits, -1))
    top = -np.sort(-s, axis=-1)[:, : V2_GREEDY.num_experts_per_tok]
    np.testing.assert_allclose(np.asarray(r2.weights), top * V2_GREEDY.routed_scaling_factor, rtol=1e-6)
    assert np.all(np.asarray(r2.weights).sum(-1) < V2_GREEDY.routed_scaling_factor)


def test_router_rejects_wrong_bias_usage():
    logits = jnp.zeros((2, V3.n_routed_experts))
    with pytest.raises(ValueError, match="noaux_tc"):
        route(logits, None, V3)
    with pytest.raises(ValueError, match="greedy"):
        route(logits, jnp.zeros((V3.n_routed_experts,)), V2_GREEDY)


def test_router_bias_is_fp32_non_param_variable():
    # Structure and dtypes only: an abstract module (no init cost).
    moe = nnx.eval_shape(lambda: MoE(V3, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    b = moe.gate.e_score_correction_bias
    assert isinstance(b, RouterBias) and not isinstance(b, nnx.Param)
    assert b.dtype == jnp.float32 and moe.gate.kernel.dtype == jnp.float32  # router fp32 whatever the dtype
    assert moe.experts.gate_proj.dtype == jnp.bfloat16
    assert moe.experts.gate_proj.shape == (16, 32, 16) and moe.experts.down_proj.shape == (16, 16, 32)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    params = jax.tree.leaves(nnx.state(moe, nnx.Param), is_leaf=is_var)
    assert params and not any(isinstance(v, RouterBias) for v in params)
    assert len(jax.tree.leaves(nnx.state(moe, RouterBias), is_leaf=is_var)) == 1
    assert nnx.eval_shape(lambda: MoE(V2_GREEDY, rngs=nnx.Rngs(0))).gate.e_score_correction_bias is None


# ------------------------------------------------------------------------------------------
# Grouped GEMM vs the dense one-hot reference
# ------------------------------------------------------------------------------------------
def random_experts(seed, T=40, K=3, E=8, D=32, I=24, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (T, D), dtype)
    gate = (jax.random.normal(ks[1], (E, D, I)) / np.sqrt(D)).astype(dtype)
    up = (jax.random.normal(ks[2], (E, D, I)) / np.sqrt(D)).astype(dtype)
    down = (jax.random.normal(ks[3], (E, I, D)) / np.sqrt(I)).astype(dtype)
    # Distinct experts per token, drawn from only E-2 experts so that some groups are empty.
    idx = jax.vmap(lambda k: jax.random.permutation(k, E - 2)[:K])(jax.random.split(ks[4], T)).astype(jnp.int32)
    w = jax.random.uniform(ks[5], (T, K), minval=0.1, maxval=1.0)
    return x, w, idx, gate, up, down


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ragged_dot_equals_dense_reference(seed):
    args = random_experts(seed)
    got = jax.jit(lambda *a: moe_grouped(*a, impl="ragged_dot"))(*args)
    want = moe_dense_reference(*args)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(want).max()) > 0.1


def test_ragged_dot_gradients_equal_dense_reference():
    args = random_experts(7)

    def loss(fn, x, w, gate, up, down):
        y = fn(x, w, args[2], gate, up, down)
        return jnp.sum(jnp.sin(y))

    argn = (0, 1, 2, 3, 4)  # x, w, gate, up, down
    g_ragged = jax.grad(lambda *a: loss(lambda *b: moe_grouped(*b, impl="ragged_dot"), *a), argnums=argn)(
        args[0], args[1], args[3], args[4], args[5]
    )
    g_dense = jax.grad(lambda *a: loss(moe_dense_reference, *a), argnums=argn)(
        args[0], args[1], args[3], args[4], args[5]
    )
    chex.assert_trees_all_close(g_ragged, g_dense, rtol=1e-4, atol=1e-5)


def test_moe_module_impls_agree_and_validate():
    cfg = V3
    x = jax.random.normal(jax.random.key(9), (2, 5, cfg.hidden_size))
    m_r = MoE(cfg, rngs=nnx.Rngs(1), impl="ragged_dot")
    m_d = MoE(cfg, rngs=nnx.Rngs(1), impl="dense")
    y_r, r = m_r(x, return_router=True)
    y_d = m_d(x)
    chex.assert_trees_all_close(y_r, y_d, rtol=1e-5, atol=1e-6)
    assert y_r.shape == x.shape and r.indices.shape == (10, cfg.num_experts_per_tok)
    assert resolve_moe_impl("auto", jnp.float32) == "ragged_dot"  # fp32 never takes the bf16 kernel
    with pytest.raises(ValueError, match="'cuda'"):
        resolve_moe_impl("cuda", jnp.float32)
    with pytest.raises(ValueError, match="impl"):
        MoE(cfg, rngs=nnx.Rngs(0), impl="bogus")


def test_mgpu_kernel_interpret_mode_matches_reference():
    """The Mosaic GPU grouped GEMM, run by the Pallas interpreter on CPU (small and bf16)."""
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    x, w, idx, gate, up, down = random_experts(11, T=12, K=2, E=4, D=48, I=40, dtype=jnp.bfloat16)
    tuning = MgpuTuning(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=1)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = moe_grouped(x, w, idx, gate, up, down, impl="mgpu", tuning=tuning)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want = moe_dense_reference(f32(x), w, idx, f32(gate), f32(up), f32(down))
    assert got.dtype == jnp.bfloat16
    err = float(jnp.linalg.norm(f32(got) - want) / jnp.linalg.norm(want))
    assert err < 1e-2, err


class _JaxWithSMs:
    """jax, except that devices()[0] has a GPU's `core_count` (jax's `transposed_ragged_dot` sizes its
    grid by it; a CPU device has none)."""

    def __getattr__(self, name):
        return getattr(jax, name)

    @staticmethod
    def devices():
        return [types.SimpleNamespace(core_count=4)]


def test_mgpu_kernel_gradients_in_interpret_mode_match_the_dense_reference(monkeypatch):
    """The gradient of the Mosaic GPU grouped GEMM (d lhs through `ragged_dot` with the weights read
    transposed, d weights through `transposed_ragged_dot`), run by the Pallas interpreter, against the
    fp32 dense reference's. Guards: rows of the next expert summed into a group's edge block, the
    transposed read of the weights, the row padding leaking into the contraction, a gradient scaled
    or routed to the wrong expert. (The weights' gradient of an expert nobody chose, which the
    kernel leaves unwritten, is zero-filled by the interpreter anyway: the GPU test guards that.)"""
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    monkeypatch.setattr(transposed_ragged_dot_mgpu, "jax", _JaxWithSMs())
    x, w, idx, gate, up, down = random_experts(5, T=12, K=2, E=5, D=48, I=40, dtype=jnp.bfloat16)  # 3, 4: no rows
    tuning = MgpuTuning(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=1)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731

    def loss(fn, x, gate, up, down):
        return jnp.sum(jnp.sin(f32(fn(x, w, idx, gate, up, down))))

    mgpu = lambda *a: moe_grouped(*a, impl="mgpu", tuning=tuning)  # noqa: E731
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = jax.grad(lambda *a: loss(mgpu, *a), argnums=(0, 1, 2, 3))(x, gate, up, down)
    want = jax.grad(lambda *a: loss(moe_dense_reference, *a), argnums=(0, 1, 2, 3))(
        f32(x), f32(gate), f32(up), f32(down)
    )
    assert all(float(jnp.abs(f32(got[i][e])).max()) == 0.0 for i in (1, 2, 3) for e in (3, 4))
    for name, a, b in zip(("x", "gate", "up", "down"), got, want):
        err = float(jnp.linalg.norm(f32(a) - b) / jnp.linalg.norm(b))
        assert err < 1e-2, (name, err)  # measured 5.5e-3 to 6.5e-3 (bf16 operands against fp32)


def _hopper() -> bool:
    from pallas_kernels.backend import on_hopper

    return on_hopper()


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (the Mosaic GPU kernel)")
@pytest.mark.parametrize("T,K,E", gpu_full([(100, 6, 16), (256, 8, 32), (3, 2, 8)], [(100, 6, 16)]))
def test_mgpu_kernel_on_hopper(T, K, E):
    """The real kernel: ragged row counts, empty experts, rows past the groups masked; its gradient (the
    Mosaic GPU backward) against `lax.ragged_dot`'s, with the weights' gradient of the two experts no
    token chose exactly 0 (the kernel leaves their output unwritten: garbage unless masked)."""
    x, w, idx, gate, up, down = random_experts(13, T=T, K=K, E=E, D=256, I=192, dtype=jnp.bfloat16)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    got = jax.jit(lambda *a: moe_grouped(*a, impl="mgpu"))(x, w, idx, gate, up, down)
    ref = jax.jit(lambda *a: moe_grouped(*a, impl="ragged_dot"))(x, w, idx, gate, up, down)
    want = moe_dense_reference(f32(x), w, idx, f32(gate), f32(up), f32(down))
    assert bool(jnp.all(jnp.isfinite(f32(got))))
    err = float(jnp.linalg.norm(f32(got) - want) / jnp.linalg.norm(want))
    err_ref = float(jnp.linalg.norm(f32(ref) - want) / jnp.linalg.norm(want))
    assert err < 1e-2 and err < 3 * err_ref + 1e-3, (err, err_ref)

    def loss(impl, x, gate, up, down):
        return jnp.sum(f32(moe_grouped(x, w, idx, gate, up, down, impl=impl)) ** 2)

    g_m = jax.jit(jax.grad(lambda *a: loss("mgpu", *a), argnums=(0, 1, 2, 3)))(x, gate, up, down)
    g_r = jax.jit(jax.grad(lambda *a: loss("ragged_dot", *a), argnums=(0, 1, 2, 3)))(x, gate, up, down)
    for a, b in zip(g_m, g_r):
        assert bool(jnp.all(jnp.isfinite(f32(a))))
        rel = float(jnp.linalg.norm(f32(a) - f32(b)) / jnp.linalg.norm(f32(b)))
        assert rel < 2e-2, rel
    assert all(float(jnp.abs(f32(g[e])).max()) == 0.0 for g in g_m[1:] for e in (E - 2, E - 1))


def test_grouped_combine_holds_no_float32_copy_of_the_assignments():
    """The compiled `moe_grouped` (ragged_dot, 256 tokens of top-8 over 16 experts, D = 512) un-sorts the expert
    rows in bf16 and weighs them in float32 inside the sum: no float32 array of the T·K rows of D. Catches the rows
    widened before the un-sorting gather (a [T·K, D] float32 copy: 3.5 GiB at a 16K-token chunk of DeepSeek-V3)."""
    from tests import hlo
    from tests.xla_opt import optimized

    T, K, D, I, E = 256, 8, 512, 128, 16
    sd = jax.ShapeDtypeStruct
    args = (sd((T, D), jnp.bfloat16), sd((T, K), jnp.float32), sd((T, K), jnp.int32))
    experts = (sd((E, D, I), jnp.bfloat16), sd((E, D, I), jnp.bfloat16), sd((E, I, D), jnp.bfloat16))
    with optimized():
        text = jax.jit(lambda *a: moe_grouped(*a, impl="ragged_dot")).trace(*args, *experts).lower().compile()
    assert hlo.buffers(text.as_text(), T * K * D * 4 - 1, dtypes=("f32",)) == []
