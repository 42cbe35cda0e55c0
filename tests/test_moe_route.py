"""The decode routing kernel (`pallas_kernels.moe_route`, Pallas Triton backend) against its jnp reference: interpret
mode on CPU, cross-lowered for sm_90, and inside an MoE layer's decode path."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import ModelConfig
from mla_jax.linear import Stacked
from models import moe as moe_mod
from models.moe import MoE
from pallas_kernels.moe_route import (
    FAST_TILE,
    MAX_TILE,
    DecodeRoute,
    RouteSpec,
    moe_route,
    moe_route_is_fast,
    moe_route_problems,
    moe_route_reference,
    route_reference,
    sort_by_expert,
)
from tests.tiers import full, gpu_full

# name: (E, spec, the largest T the kernel takes at that E)
SPECS = {
    "v2_lite": (64, RouteSpec(6, "greedy", "softmax"), 256),
    "v2_group": (32, RouteSpec(5, "group_limited_greedy", "softmax", n_group=4, topk_group=2), 512),
    # V2's 160 experts: E padded to 256 inside the kernel, groups of 20
    "v2_160": (
        160,
        RouteSpec(6, "group_limited_greedy", "softmax", n_group=8, topk_group=3, routed_scaling_factor=16.0),
        64,
    ),
    "v3": (
        256,
        RouteSpec(8, "noaux_tc", "sigmoid", n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
        64,
    ),
}


def _inputs(name, T, seed=0):
    E, spec, _ = SPECS[name]
    k1, k2 = jax.random.split(jax.random.key(seed))
    logits = 2.0 * jax.random.normal(k1, (T, E), jnp.float32)
    bias = 0.5 * jax.random.normal(k2, (E,), jnp.float32) if spec.topk_method == "noaux_tc" else None
    return logits, bias, spec


def _assert_routes_equal(got: DecodeRoute, want: DecodeRoute):
    for f in ("indices_TK", "group_sizes_E", "group_starts_E", "row_TK", "token_M"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == jnp.int32 and a.shape == b.shape, (f, a.dtype, a.shape, b.shape)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f)
    for a, b, f in zip(got.expert_programs, want.expert_programs, ("experts", "starts", "sizes")):
        assert a.dtype == jnp.int32 and a.shape == b.shape, (f, a.dtype, a.shape, b.shape)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg="expert_programs " + f)
    for f in ("weights_TK", "weight_M"):
        assert getattr(got, f).dtype == jnp.float32
        chex.assert_trees_all_close(getattr(got, f), getattr(want, f), rtol=1e-6, atol=0)


def _assert_sorted_by_expert(r: DecodeRoute, E: int):
    """The contract, from numpy alone: row r of the sort is numpy's stable argsort of the flattened indices (rows
    grouped by expert, token order inside a group), starts exclusive, token and weight of each row."""
    idx, w = np.asarray(r.indices_TK), np.asarray(r.weights_TK)
    T, K = idx.shape
    order = np.argsort(idx.reshape(-1), kind="stable")
    sizes = np.bincount(idx.reshape(-1), minlength=E)
    np.testing.assert_array_equal(np.asarray(r.group_sizes_E), sizes)
    np.testing.assert_array_equal(np.asarray(r.group_starts_E), np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    np.testing.assert_array_equal(np.asarray(r.token_M), order // K)
    np.testing.assert_array_equal(np.asarray(r.weight_M), w.reshape(-1)[order])
    inv = np.empty_like(order)
    inv[order] = np.arange(T * K)
    np.testing.assert_array_equal(np.asarray(r.row_TK), inv.reshape(T, K))
    experts, starts, counts = (np.asarray(a) for a in r.expert_programs)
    A = min(T * K, E)
    touched = np.flatnonzero(sizes)  # ascending: the programs that run, each with its rows
    np.testing.assert_array_equal(experts[: touched.size], touched)
    np.testing.assert_array_equal(starts[: touched.size], np.cumsum(sizes)[touched] - sizes[touched])
    np.testing.assert_array_equal(counts[: touched.size], sizes[touched])
    assert experts.size >= A and not counts[touched.size :].any()  # the rest are idle


_ROUTE_CELLS = [(name, T) for name, (_, _, t_max) in SPECS.items() for T in (1, 5, 32, t_max)]
# The quick tier: each routing rule once, and each token count once among them (1, 5, 32 and a spec's most).
_QUICK_ROUTE_CELLS = [("v2_lite", 1), ("v2_group", 5), ("v2_160", 32), ("v3", SPECS["v3"][2])]


@pytest.mark.parametrize(
    "name, T", full(_ROUTE_CELLS, _QUICK_ROUTE_CELLS, "each routing rule and each token count run in the quick tier")
)
def test_interpret_equals_reference(name, T):
    """The kernel in the interpreter equals the jnp reference (indices, sort exactly; weights to 1e-6) for V2-Lite,
    V2's group-limited greedy (32 and 160 experts) and V3's noaux_tc, 1 token to the most the kernel takes.
    Catches: the wrong group score (max vs top-2 sum), the bias in the weights, the renormalisation applied to V2,
    padded rows counted into the sizes or padded columns chosen, a top-k round picking a taken expert."""
    logits, bias, spec = _inputs(name, T, seed=T)
    got = jax.jit(lambda l, b: moe_route(l, b, spec=spec, impl="interpret"))(logits, bias)
    want = moe_route_reference(logits, bias, spec=spec)
    _assert_routes_equal(got, want)
    _assert_sorted_by_expert(got, SPECS[name][0])


@pytest.mark.parametrize("name", list(SPECS))
def test_ties_choose_as_lax_top_k(name):
    """Rows of equal logits, and logits from a set of four values (repeats within and across groups; for V3 a bias
    of repeated values too): the indices equal lax.top_k's (descending, ties to the lower index; groups alike).
    Catches ties broken to the higher index, a tied maximum counted once in a V3 group's top-2 sum, or a round that
    re-picks an expert already taken when two scores are equal."""
    E, spec, _ = SPECS[name]
    rng = np.random.default_rng(7)
    logits = np.concatenate([np.zeros((2, E)), rng.integers(0, 4, (14, E)).astype(np.float64) * 0.5])
    logits = jnp.asarray(logits, jnp.float32)
    bias = jnp.asarray(rng.integers(0, 2, E) * 0.25, jnp.float32) if spec.topk_method == "noaux_tc" else None
    got = moe_route(logits, bias, spec=spec, impl="interpret")
    _, want_idx, _ = route_reference(logits, bias, spec=spec)
    np.testing.assert_array_equal(np.asarray(got.indices_TK), np.asarray(want_idx))
    _assert_routes_equal(got, moe_route_reference(logits, bias, spec=spec))
    if bias is None:  # equal rows: the first K experts (of the first `topk_group` groups)
        np.testing.assert_array_equal(np.asarray(got.indices_TK[0]), np.arange(spec.num_experts_per_tok))


def test_the_sort_is_the_stable_argsort_of_the_indices():
    """On random routings (40 tokens, many sharing experts), the kernel's and the reference's sorted rows equal
    numpy's stable argsort of the flattened indices, its inverse, the tokens and the weights of the rows. Catches a
    sort that orders a group's rows by choice rank instead of token, inclusive starts (every row one group late), a
    row's weight or token taken from another assignment."""
    E, spec, _ = SPECS["v2_lite"]
    logits = jax.random.normal(jax.random.key(3), (40, E)) * 0.3
    logits = logits.at[:, :8].add(2.0)  # crowd experts 0..7: groups of many rows
    got = moe_route(logits, None, spec=spec, impl="interpret")
    assert int(got.group_sizes_E.max()) > 20
    _assert_sorted_by_expert(got, E)
    _assert_sorted_by_expert(moe_route_reference(logits, None, spec=spec), E)


def test_reference_equals_the_old_route_and_argsort_path():
    """`moe_route_reference` equals what `moe_grouped` computed from `models.moe.route` (argsort stable, bincount,
    the inverse argsort), written out here, and `sort_by_expert` is that same code; a sort whose groups were not in
    token order, or whose starts were inclusive, differs (checked against a deliberately wrong variant)."""
    E, spec, _ = SPECS["v3"]
    logits, bias, _ = _inputs("v3", 24, seed=5)
    cfg = ModelConfig.tiny().replace(
        n_routed_experts=E, n_group=8, topk_group=4, num_experts_per_tok=8, routed_scaling_factor=2.5
    )
    assert RouteSpec.from_config(cfg) == spec
    r = moe_mod.route(logits, bias, cfg)
    K = r.indices.shape[1]
    flat = r.indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E)
    old = DecodeRoute(
        r.weights,
        r.indices,
        sizes,
        jnp.cumsum(sizes) - sizes,
        jnp.argsort(order).reshape(-1, K),
        order // K,
        r.weights.reshape(-1)[order],
        None,
    )
    got = moe_route_reference(logits, bias, spec=spec)
    old = old._replace(expert_programs=got.expert_programs)  # checked against numpy by _assert_sorted_by_expert
    _assert_sorted_by_expert(got, E)
    _assert_routes_equal(got, old)
    np.testing.assert_array_equal(np.asarray(sort_by_expert(r.weights, r.indices, E).row_TK), np.asarray(old.row_TK))
    wrong_starts = got._replace(group_starts_E=jnp.cumsum(got.group_sizes_E))
    flat = np.asarray(got.indices_TK).reshape(-1)
    late_first = np.lexsort((-np.arange(flat.size), flat))  # grouped by expert, later tokens first
    wrong_order = got._replace(token_M=jnp.asarray(late_first // K, jnp.int32))
    for bad in (wrong_starts, wrong_order):
        with pytest.raises(AssertionError):
            _assert_sorted_by_expert(bad, E)


def test_what_it_cannot_serve_is_one_line_each(monkeypatch):
    """The tile cap, named with its values; "kernel" refuses in one line, "auto" on a Hopper GPU falls back to the
    reference (catches a cap that lets a tile past MAX_TILE reach the kernel, or "auto" raising)."""
    _, v3, t_max = SPECS["v3"]
    assert (
        MAX_TILE == 64 * 256
        and moe_route_problems(t_max, 256, v3) == []
        and moe_route_problems(256, 64, SPECS["v2_lite"][1]) == []
    )
    assert moe_route_problems(65, 256, v3) == [
        "T·E = 128·256 = 32768 (each padded to a power of two) is more than the 16384 elements of one program's "
        "[T, E] tile"
    ]
    assert moe_route_problems(0, 256, v3) == ["T = 0 tokens: the kernel routes at least 1"]
    logits, bias, _ = _inputs("v3", 65)
    with pytest.raises(ValueError, match=r"^moe_route impl='kernel': .*T·E = 128·256 = 32768 .*16384"):
        moe_route(logits, bias, spec=v3, impl="kernel")
    monkeypatch.setattr("pallas_kernels.backend.on_hopper", lambda: True)
    _assert_routes_equal(moe_route(logits, bias, spec=v3), moe_route_reference(logits, bias, spec=v3))
    with pytest.raises(ValueError, match=r"^the correction bias must be \[E=256\], got shape \(8,\)$"):
        moe_route(logits, bias[:8], spec=v3)
    with pytest.raises(ValueError, match=r"^RouteSpec.topk_method must be one of"):
        RouteSpec(8, "top2")


@pytest.mark.parametrize("name", ["v3", "v2_160"])
def test_cross_lowers_for_sm90(name):
    """The kernel traced and lowered for an H200 on a CPU host at the largest T it takes: one Triton call and no XLA
    sort left (catches an op the Triton lowering refuses, or the routing falling back to XLA's sort)."""
    from jax._src import mesh as mesh_lib

    E, spec, T = SPECS[name]
    args = (jax.ShapeDtypeStruct((T, E), jnp.float32),)
    if spec.topk_method == "noaux_tc":
        args += (jax.ShapeDtypeStruct((E,), jnp.float32),)
    h200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h200)):
        f = lambda logits, bias=None: moe_route(logits, bias, spec=spec, impl="kernel")  # noqa: E731
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert "stablehlo.sort" not in text


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for v in eqn.params.values():
            sub = getattr(v, "jaxpr", v)
            if hasattr(sub, "eqns"):
                yield from _pallas_calls(sub)


@pytest.mark.parametrize("name", ["v3", "v2_group", "v2_160"])
def test_the_kernel_takes_no_constant_operand(name):
    """The kernel computes the experts' groups itself and takes the correction bias only where the rules have one
    (`noaux_tc`): a constant operand of a kernel (the groups' ids, a zero bias) is materialised by a kernel launch
    of its own at every scanned layer (two a layer in V2-Lite's decode step compiled for an H100). Catches such an
    operand coming back."""
    E, spec, T = SPECS[name]
    bias = jnp.zeros((E,), jnp.float32) if spec.topk_method == "noaux_tc" else None
    jaxpr = jax.make_jaxpr(lambda x: moe_route(x, bias, spec=spec, impl="interpret"))(jnp.zeros((T, E)))
    (call,) = _pallas_calls(jaxpr.jaxpr)
    assert len(call.invars) == 1 + (bias is not None)


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_moe_decode_path_with_moe_route_equals_the_path_without(kind, monkeypatch):
    """An MoE layer on the decode path (the decode kernel and the routing kernel in the interpreter) against the
    same layer with the routing kernel turned off (jnp routing, `moe_grouped`'s own argsort): the same output and
    router decisions. Catches the precomputed sort handed to `moe_grouped` wrongly (rows un-sorted to the wrong
    assignment, weights of other rows, starts that the decode kernel reads off by a group)."""
    cfg = ModelConfig.tiny().replace(
        n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, hidden_size=128, moe_intermediate_size=64
    )
    if kind == "v2":
        cfg = cfg.replace(
            scoring_func="softmax",
            topk_method="group_limited_greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            model_type="deepseek_v2",
        )
    m = MoE(cfg, rngs=nnx.Rngs(0), impl="decode")
    if m.gate.e_score_correction_bias is not None:
        m.gate.e_score_correction_bias[...] = 0.1 * jax.random.normal(jax.random.key(1), (16,))
    x = jax.random.normal(jax.random.key(2), (3, 4, 128))
    stacked = Stacked(jnp.int32(0), "interpret")
    calls = []
    real = moe_mod.moe_route
    monkeypatch.setattr(moe_mod, "moe_route", lambda *a, **k: calls.append(k["impl"]) or real(*a, **k))
    y, r = m(x, return_router=True, stacked=stacked)
    assert calls == ["interpret"]
    monkeypatch.setattr(moe_mod, "moe_route_problems", lambda *a: ["off"])
    y0, r0 = m(x, return_router=True, stacked=stacked)
    assert len(calls) == 1
    np.testing.assert_array_equal(np.asarray(r.indices), np.asarray(r0.indices))
    chex.assert_trees_all_close((y, r.weights, r.scores), (y0, r0.weights, r0.scores), rtol=1e-6, atol=1e-6)


def test_the_layer_routes_by_kernel_only_up_to_the_measured_tile(monkeypatch):
    """`MoE` takes the routing kernel while [T, E] fits `FAST_TILE` (where an H200 measured it faster than XLA's
    sorts) and sorts with XLA past it (catches the measured limit dropped: B = 128 steps 1.6 % slower)."""
    cfg = ModelConfig.tiny().replace(
        n_routed_experts=16, num_experts_per_tok=4, hidden_size=128, moe_intermediate_size=64
    )
    m = MoE(cfg, rngs=nnx.Rngs(0), impl="decode")
    stacked = Stacked(jnp.int32(0), "interpret")
    calls = []
    monkeypatch.setattr(
        moe_mod, "moe_route", lambda *a, **k: calls.append(a[0].shape) or moe_route_reference(*a[:2], spec=k["spec"])
    )
    last_fast = FAST_TILE // 16
    for T in (1, last_fast, last_fast + 1):
        jax.eval_shape(lambda x: m(x, stacked=stacked), jax.ShapeDtypeStruct((T, 128), jnp.float32))
    assert calls == [(1, 16), (last_fast, 16)]
    assert moe_route_is_fast(32, 64) and not moe_route_is_fast(33, 64) and moe_route_is_fast(8, 256)


def test_moe_decode_takes_the_starts_it_is_given():
    """`moe_decode(group_starts_E=...)` reads the rows at the starts given (the kernel in the interpreter): starts
    off by one row give other rows' results, so a keyword the kernel ignored, or read shifted, shows; a wrong
    shape is refused in one line."""
    from pallas_kernels.moe_decode import MoeDecodeConfig, moe_decode, moe_decode_reference

    rng = np.random.default_rng(0)
    sizes = jnp.asarray([2, 0, 3, 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((7, 32)), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) / 6, jnp.float32) for s in ((4, 32, 32), (4, 32, 32), (4, 32, 32))]
    config = MoeDecodeConfig(block_i=32, block_d=32, block_o=32, block_k=32)
    starts = jnp.cumsum(sizes) - sizes
    ref = moe_decode_reference(x, sizes, *w)
    got = moe_decode(x, sizes, *w, config=config, impl="interpret", group_starts_E=starts)
    chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)
    shifted = moe_decode(x, sizes, *w, config=config, impl="interpret", group_starts_E=starts + 1)
    assert not np.allclose(np.asarray(shifted[:6]), np.asarray(ref[:6]), atol=1e-3)
    with pytest.raises(ValueError, match=r"^group_starts must be \[E=4\] like group_sizes, got shape \(3,\)$"):
        moe_decode(x, sizes, *w, config=config, impl="interpret", group_starts_E=starts[:3])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, T",
    gpu_full(
        [("v2_lite", 1), ("v2_lite", 32), ("v2_lite", 128), ("v3", 1), ("v3", 64)],
        [("v2_lite", 32), ("v3", 64)],
    ),
)
def test_gpu_kernel_equals_the_reference(name, T):
    """The compiled kernel (Triton's scan for the cumsums, the scatter stores of the sorted rows and programs)
    against the jnp reference at V2-Lite's and V3's expert counts."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    logits, bias, spec = _inputs(name, T, seed=T)
    got = jax.jit(lambda l, b: moe_route(l, b, spec=spec, impl="kernel"))(logits, bias)
    _assert_routes_equal(got, moe_route_reference(logits, bias, spec=spec))
