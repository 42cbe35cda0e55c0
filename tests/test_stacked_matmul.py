"""Decode-shaped projections over a stack of layers (`pallas_kernels.stacked_matmul`, Pallas Triton backend) against
their reference, and the model's decode step with its projections passed whole (`mla_jax.linear`)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax.kv_cache import KVCache
from mla_jax.linear import stacked_filter
from models import DeepSeekModel, Engine
from pallas_kernels.head_matmul import stacked_head_matmul, stacked_head_matmul_problems
from pallas_kernels.stacked_matmul import (
    ANY_ROWS,
    NORM_ROWS,
    Partials,
    RowNorm,
    StackedMatmulConfig,
    stacked_matmul,
    stacked_matmul_problems,
    stacked_matmul_reference,
)
from tests.micro_configs import decode_step_on_both_backends, narrow_v2_lite
from tests.tiers import full, gpu_full

SMALL = StackedMatmulConfig(block_n=32, block_k=32)


def _stack(M, K=96, N=64, L=3, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((L, K, N)) / np.sqrt(K), jnp.float32)
    return x, w


@pytest.mark.parametrize("M, split_k", [(1, None), (3, 3), (19, 3), (32, 1)])
def test_kernel_reads_the_named_layer_of_the_stack(M, split_k):
    """Every layer of the stack through the interpreter equals x · w[layer] computed in numpy (catches a wrong
    layer offset, the split-K partials summed wrongly or not at all, rows past M leaking from the padding, and
    at M = 3 (fewer than 16, read a row a load) a row loaded into another's place or left out)."""
    x, w = _stack(M)
    config = StackedMatmulConfig(block_n=32, block_k=32, split_k=split_k)
    f = jax.jit(lambda x, w, layer: stacked_matmul(x, w, layer, config=config, impl="interpret"))
    for layer in range(w.shape[0]):
        want = np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
        chex.assert_trees_all_close(np.asarray(f(x, w, jnp.int32(layer)), np.float64), want, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(f(x, w, jnp.int32(2)), stacked_matmul_reference(x, w, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", [1, 5])
def test_widths_narrower_than_a_block_are_one_block(M):
    """K = 64 and N = 32 under the default 128 x 64 blocks (the built-in model's widths are this narrow): one chunk,
    one column block, equal to numpy (catches the config's block used as it is: a chunk past the row's end)."""
    x, w = _stack(M, K=64, N=32)
    got = stacked_matmul(x, w, jnp.int32(1), impl="interpret")
    want = np.asarray(x, np.float64) @ np.asarray(w[1], np.float64)
    chex.assert_trees_all_close(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "M, split_k, stacked_weight", [(1, 3, True), (19, 1, False), (2, 1, False), (4, 3, True), (5, 3, True)]
)
def test_the_norm_inside_the_kernel_equals_the_norm_then_the_product(M, split_k, stacked_weight):
    """`norm=RowNorm(...)`: the rows' RMSNorm applied in the kernel equals `rms_norm` then the product, and float64
    numpy's; for each layer of the stack with a stacked norm weight [L, K]. Catches a program's root mean square
    taken over its own K range only (split_k = 3 with 3 chunks: every program holds a third), a piece of the row
    left out of it (K = 96 loads as three pieces of 32), eps left out, another layer's norm weight, the weight
    applied before the cast to the rows' dtype being skipped, and the single row (read unpadded, repeated over
    the dot's 16 rows) stored from the wrong row; at 2 and 4 rows (normalised in the kernel, each row's scale its
    own) a row scaled by another's root mean square; with more rows (normalised by XLA first), the norm skipped."""
    rng = np.random.default_rng(M)
    x, w = _stack(M, K=96, N=64, seed=M)
    x = (x * 3.0 + 0.5).astype(jnp.bfloat16)
    g_all = jnp.asarray(rng.uniform(0.5, 1.5, (w.shape[0], 96)), jnp.float32)
    config = StackedMatmulConfig(block_n=32, block_k=32, split_k=split_k)
    for layer in range(w.shape[0]):
        g = g_all if stacked_weight else g_all[layer]
        norm = RowNorm(g, 1e-6)
        got = stacked_matmul(x, w, jnp.int32(layer), norm=norm, dtype=jnp.float32, config=config, impl="interpret")
        ref = stacked_matmul(x, w, jnp.int32(layer), norm=norm, dtype=jnp.float32, config=config, impl="reference")
        xf = np.asarray(x, np.float64)
        y = xf / np.sqrt(np.mean(xf * xf, axis=1, keepdims=True) + 1e-6)
        want = (np.asarray(g_all[layer], np.float64) * y) @ np.asarray(w[layer], np.float64)
        chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-2)  # y rounded to bf16
    with pytest.raises(
        ValueError, match=r"^stacked_matmul: the norm's weight must be \[K=96\] or \[L, K\], got \(95,\)$"
    ):
        stacked_matmul(x, w, 0, norm=RowNorm(jnp.ones(95), 1e-6), config=config, impl="interpret")


@pytest.mark.parametrize(
    "M, norm",
    full(
        [(1, False), (1, True), (3, True), (7, False), (7, True), (19, True)],
        [(1, True), (3, True), (19, True)],
        "the quick tier takes one row, few rows normalised inside and many rows",
    ),
)
def test_partials_as_rows_equal_their_sum(M, norm):
    """`Partials` given as the rows (another call's unsummed split-K partials, Mp >= M rows) equal their sum cast to
    the rows' dtype given as an array: with few rows summed by the kernel as it loads them (up to `NORM_ROWS` also
    normalised there), with more by XLA first. Catches a partial left out of the sum (S = 3), the sum not rounded to
    the rows' bf16 before the product or the norm, and a row read from the wrong partials' row."""
    rng = np.random.default_rng(M)
    Mp = 1 if M == 1 else 16 * -(-M // 16)
    parts = jnp.asarray(rng.standard_normal((3, Mp, 96)), jnp.float32)
    rows = Partials(parts, (M, 96), jnp.dtype(jnp.bfloat16))
    _, w = _stack(M, K=96, N=64, seed=M + 1)
    g = RowNorm(jnp.asarray(rng.uniform(0.5, 1.5, (w.shape[0], 96)), jnp.float32), 1e-6) if norm else None
    want_rows = (parts[0] + parts[1] + parts[2])[:M].astype(jnp.bfloat16)
    chex.assert_trees_all_equal(rows.total(), want_rows)
    for layer in range(w.shape[0]):
        got = stacked_matmul(rows, w, jnp.int32(layer), norm=g, dtype=jnp.float32, config=SMALL, impl="interpret")
        want = stacked_matmul_reference(want_rows, w, jnp.int32(layer), norm=g, dtype=jnp.float32)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", full([1, 3, 19], [3, 19], "the quick tier takes few rows and many"))
def test_keep_splits_hands_the_partials_on(M):
    """``keep_splits=True``: below 16 rows the kernel's split-K partials come back as `Partials` whose sum is the
    product (a reduction launch fewer between two projections), the logical shape kept through a reshape; from 16
    rows the product itself; with `ANY_ROWS` the partials at every row count. Catches partials of the wrong rows or a
    split dropped, and `ANY_ROWS` summed at 16 rows or more."""
    x, w = _stack(M, K=96, N=64, seed=M)
    config = StackedMatmulConfig(block_n=32, block_k=32, split_k=3)
    kept = stacked_matmul(x, w, jnp.int32(2), dtype=jnp.float32, config=config, impl="interpret", keep_splits=True)
    want = stacked_matmul_reference(x, w, jnp.int32(2), dtype=jnp.float32)
    if M < 16:
        assert isinstance(kept, Partials) and kept.parts.shape[0] == 3 and kept.shape == (M, 64)
        chex.assert_trees_all_close(kept.reshape(1, M, 64).total(), want[None], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=rf"^Partials of {M} rows of 64 cannot be rows of shape \({M}, 32\)$"):
            kept.reshape(M, 32)
    else:
        assert not isinstance(kept, Partials)
        chex.assert_trees_all_close(kept, want, rtol=1e-5, atol=1e-5)
    # `ANY_ROWS`: the partials at any number of rows (for `latent_write`, which sums each row's as it loads it)
    anyway = stacked_matmul(
        x, w, jnp.int32(2), dtype=jnp.float32, config=config, impl="interpret", keep_splits=ANY_ROWS
    )
    assert isinstance(anyway, Partials) and anyway.shape == (M, 64)
    chex.assert_trees_all_close(anyway.total(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M, split_k", [(1, 3), (3, None), (19, 1)])
def test_several_stacks_in_one_launch_equal_each_alone(M, split_k):
    """A tuple of stacks (MLA's `wq` and `wkv_a` on one layer input) in one launch: each result equals float64
    numpy's product with its own weight of the named layer, the input's norm applied in the kernel (1 and 3 rows) or
    by XLA (19), the first handed on as `Partials` and the second summed. Catches a program of the second stack's
    tiles reading the first's weight or columns (its tile index not shifted by the first's tile count), the two
    stacks' narrower-than-a-block widths mixed up (N = 32 and 64 under 64-wide blocks), a tile written twice or
    not at all, and the norm left out of the second product."""
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.standard_normal((M, 96)) * 2 + 0.5, jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((3, 96, 192)) / np.sqrt(96), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((3, 96, 32)) / np.sqrt(96), jnp.float32)
    g = jnp.asarray(rng.uniform(0.5, 1.5, (3, 96)), jnp.float32)
    config = StackedMatmulConfig(block_n=64, block_k=32, split_k=split_k)

    def f(x, w1, w2, g, i):
        norm = RowNorm(g, 1e-6)
        return stacked_matmul(x, (w1, w2), i, norm=norm, config=config, impl="interpret", keep_splits=(True, False))

    for layer in range(3):
        q, kv = f(x, w1, w2, g, jnp.int32(layer))
        assert isinstance(q, Partials) == (M < 16) and not isinstance(kv, Partials)
        q = q.total() if isinstance(q, Partials) else q
        xf = np.asarray(x, np.float64)
        xn = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + 1e-6) * np.asarray(g[layer], np.float64)
        for got, w in ((q, w1), (kv, w2)):
            want = xn @ np.asarray(w[layer], np.float64)
            chex.assert_trees_all_close(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"^stacked_matmul: the stacks must share L and K, got shapes "):
        stacked_matmul(x, (w1, w2[:2]), 0, config=config, impl="interpret")
    with pytest.raises(ValueError, match=r"^stacked_matmul: keep_splits has 1 entries for 2 stacks$"):
        stacked_matmul(x, (w1, w2), 0, config=config, impl="interpret", keep_splits=(True,))


@pytest.mark.parametrize("rows", [1, 3])
def test_the_norm_with_its_weight_apart_is_the_same_norm(rows):
    """`rms_norm(..., weight_apart=True)` (the weight's multiply kept out of XLA's row-norm fusion, so that a scanned
    layer's weight slice is read in place and not copied) gives the same bits as the plain formula and float64's
    value within bf16 rounding, under jit and for a weight of another dtype. Catches the multiply moved before the
    cast to the rows' dtype (a second rounding), or the rows normalised twice."""
    from pallas_kernels.stacked_matmul import rms_norm

    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 256)) * 3 + 1, jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 256), jnp.float32)
    f = jax.jit(lambda x, w, apart: rms_norm(x, w, 1e-6, weight_apart=apart), static_argnums=2)
    np.testing.assert_array_equal(np.asarray(f(x, w, True)), np.asarray(f(x, w, False)))
    xf = np.asarray(x, np.float64)
    want = np.asarray(w, np.float64) * (xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + 1e-6))
    chex.assert_trees_all_close(np.asarray(f(x, w, True), np.float64), want, rtol=1e-2, atol=1e-2)


def test_configs_past_a_programs_shared_memory_are_refused():
    """A config whose pipeline (stages x the row tile and the weight tile) overflows an H100's shared memory is
    refused in one line rather than failing the card's compile: W_UV's 256-deep chunks at 128 rows needed 320 KB
    (V2-Lite's decode at B = 128 did not compile for an H100). Catches the default config of a row count choosing
    such a config."""
    assert stacked_head_matmul_problems(128, 16, 512, 128, contract_rows=True) == []  # W_UV's default at 128 rows
    assert stacked_head_matmul_problems(1, 16, 512, 128, contract_rows=True) == []
    big = StackedMatmulConfig(block_n=32, block_k=256, split_k=1)
    assert stacked_head_matmul_problems(128, 16, 512, 128, big) == [
        "4 stages of a 128 x 256 row tile and a 256 x 32 weight tile need 327680 bytes of shared memory; an H100 /"
        " H200 program has 232448"
    ]
    assert stacked_matmul_problems(128, 2048, 3072) == []  # V2-Lite's wq at batch 128, the default config


def test_what_it_cannot_serve_is_one_line_each():
    assert stacked_matmul_problems(1, 2048, 3072) == []  # V2-Lite's wq
    assert stacked_matmul_problems(128, 2048, 576) == []  # V2-Lite's wkv_a at batch 128
    assert stacked_matmul_problems(1, 64, 1280) == []  # the built-in model's wq_b: K narrower than a block
    assert stacked_matmul_problems(129, 100, 48) == [
        "M = 129 rows is more than the 128 a decode-shaped call takes",
        "K = 100 is not a multiple of the block 128 (nor a power of two >= 16 below it)",
        "N = 48 is not a multiple of the block 64 (nor a power of two >= 16 below it)",
    ]
    x, w = _stack(2)
    msg = r"^stacked_matmul: K = 96 is not a multiple of the block 128 \(nor a power of two >= 16 below it\)$"
    with pytest.raises(ValueError, match=msg):
        stacked_matmul(x, w, 0, impl="interpret")
    with pytest.raises(ValueError, match=r"^w must be a stack \[L, K=96, N\], got shape \(96, 64\)$"):
        stacked_matmul(x, w[0], 0, config=SMALL, impl="interpret")


@pytest.mark.parametrize("M, split_k", [(1, None), (2, 2), (19, 2)])
def test_head_matmul_reads_each_head_of_the_named_layer(M, split_k):
    """Both per-head forms through the interpreter against numpy on every layer of a head-interleaved stack
    [L, R, H·(N+V)] (catches a wrong head stride or column offset, W_UK read where W_UV is meant, the contraction
    taken over the wrong axis, the split partials summed wrongly, another layer's weights, and at M = 2 (read a
    row a load) a row read from the wrong head's place)."""
    rng = np.random.default_rng(M)
    L, R, H, N, V = 3, 64, 4, 32, 16
    w = jnp.asarray(rng.standard_normal((L, R, H * (N + V))) / 8, jnp.float32)
    q = jnp.asarray(rng.standard_normal((M, H, N)), jnp.float32)
    o = jnp.asarray(rng.standard_normal((M, H, R)), jnp.float32)
    config = StackedMatmulConfig(block_n=16, block_k=16, split_k=split_k)
    uk = jax.jit(
        lambda q, w, i: stacked_head_matmul(q, w, i, col_offset=0, contract_rows=False, config=config, impl="interpret")
    )
    uv = jax.jit(
        lambda o, w, i: stacked_head_matmul(
            o, w, i, col_offset=N, contract_rows=True, width=V, config=config, impl="interpret"
        )
    )
    for layer in range(L):
        w_RHP = np.asarray(w[layer], np.float64).reshape(R, H, N + V)
        want_uk = np.einsum("mhn,lhn->mhl", np.asarray(q, np.float64), w_RHP[..., :N])
        want_uv = np.einsum("mhl,lhv->mhv", np.asarray(o, np.float64), w_RHP[..., N:])
        chex.assert_trees_all_close(np.asarray(uk(q, w, jnp.int32(layer)), np.float64), want_uk, rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(np.asarray(uv(o, w, jnp.int32(layer)), np.float64), want_uv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", full([1, 3, 17], [3], "the quick tier takes few rows"))
def test_head_matmul_reads_q_nope_from_the_query_partials(M):
    """W_UK given the last query projection's `Partials` of whole heads [M, H, Px] and ``k_cols`` (q_nope the first
    columns of each head's query) equals the product of the summed query's q_nope: each head read at its own stride
    (Px, not K), the sum over the splits taken and cast to the rows' dtype. Catches a head read at stride K, the
    rope columns contracted, a split left out; 17 rows are summed by XLA first."""
    rng = np.random.default_rng(M)
    H, Px, K, R = 4, 48, 32, 64
    Mp = 1 if M == 1 else 16 * -(-M // 16)
    parts = jnp.asarray(rng.standard_normal((2, Mp, H * Px)), jnp.float32)
    q = Partials(parts, (M, H * Px), jnp.dtype(jnp.bfloat16)).reshape(M, H, Px)
    w = jnp.asarray(rng.standard_normal((3, R, H * (K + 16))) / 8, jnp.bfloat16)
    q_nope = q.total()[..., :K]
    for layer in range(3):
        kw = dict(col_offset=0, contract_rows=False, config=StackedMatmulConfig(block_n=32, block_k=32))
        got = stacked_head_matmul(q, w, jnp.int32(layer), impl="interpret", k_cols=K, **kw)
        want = stacked_head_matmul(q_nope, w, jnp.int32(layer), impl="reference", **kw)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"^k_cols = 49 must be in \[1, 48\], the columns of x's heads$"):
        stacked_head_matmul(q, w, 0, col_offset=0, contract_rows=False, impl="interpret", k_cols=49)


def test_head_matmul_limits_are_one_line_each():
    assert stacked_head_matmul_problems(1, 16, 128, 512) == []  # V2-Lite's W_UK
    assert stacked_head_matmul_problems(129, 16, 24, 512) == [
        "M = 129 rows is more than the 128 a decode-shaped call takes",
        "K = 24 is not a multiple of the block 128 (nor a power of two >= 16 below it)",
    ]
    assert stacked_head_matmul_problems(1, 16, 384, 128, contract_rows=True) == [  # W_UV's 256-deep chunks
        "K = 384 is not a multiple of the block 256 (nor a power of two >= 16 below it)"
    ]
    # a split that does not divide the contraction's chunks would drop the last ones: refused, not summed short
    assert stacked_head_matmul_problems(1, 16, 128, 512, StackedMatmulConfig(block_n=64, block_k=32, split_k=3)) == [
        "split_k = 3 does not divide K / block_k = 4"
    ]
    w = jnp.zeros((2, 64, 4 * 48), jnp.float32)
    with pytest.raises(ValueError, match=r"^col_offset \+ K = 64 is more than the head's P = 48 columns$"):
        stacked_head_matmul(jnp.zeros((1, 4, 32)), w, 0, col_offset=32, contract_rows=False, impl="interpret")


def test_cross_lowers_for_sm90():
    from jax._src import mesh as mesh_lib

    x, w = jnp.zeros((1, 2048), jnp.bfloat16), jnp.zeros((26, 2048, 3072), jnp.bfloat16)
    layer = jnp.int32(3)  # made outside the abstract mesh, where no eager op can run
    h200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h200)):
        traced = jax.jit(lambda x, w, i: stacked_matmul(x, w, i, impl="kernel")).trace(x, w, layer)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        # the norm inside (a stacked weight read at the layer): still one kernel and nothing else of size
        normed = lambda x, w, g, i: stacked_matmul(x, w, i, norm=RowNorm(g, 1e-6), impl="kernel")  # noqa: E731
        g = jax.ShapeDtypeStruct((26, 2048), jnp.float32)
        text_norm = jax.jit(normed).trace(x, w, g, layer).lower(lowering_platforms=("cuda",)).as_text()
        # an MTP verify step's two rows: read as they are and normalised inside, no pad and no norm around it
        x2 = jax.ShapeDtypeStruct((2, 2048), jnp.bfloat16)
        text_two = jax.jit(normed).trace(x2, w, g, layer).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert text_norm.count("xla.gpu.triton") == 1 and "stablehlo.rsqrt" not in text_norm
    assert text_two.count("xla.gpu.triton") == 1 and "stablehlo.rsqrt" not in text_two
    assert "stablehlo.pad" not in text_two


def test_head_matmul_cross_lowers_for_sm90():
    from jax._src import mesh as mesh_lib

    q, w = jnp.zeros((1, 16, 128), jnp.bfloat16), jnp.zeros((26, 512, 4096), jnp.bfloat16)
    layer = jnp.int32(3)
    h200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    f = lambda q, w, i: stacked_head_matmul(q, w, i, col_offset=0, contract_rows=False, impl="kernel")  # noqa: E731
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h200)):
        text = jax.jit(f).trace(q, w, layer).lower(lowering_platforms=("cuda",)).as_text()
        q2 = jax.ShapeDtypeStruct((2, 16, 128), jnp.bfloat16)
        text_two = jax.jit(f).trace(q2, w, layer).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert text_two.count("xla.gpu.triton") == 1 and "stablehlo.pad" not in text_two  # two rows read as they are


def test_projections_chained_through_partials_cross_lower_with_nothing_between():
    """MLA's query projection into W_UK, W_UV into `wo` and `wq_a` into `wq_b` (the query norm between) at a decode
    step's one row and an MTP verify step's two: two kernels and no reduction, slice, norm or pad of XLA's between
    them (each was a launch)."""
    from jax._src import mesh as mesh_lib

    h200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    w_uv, w_o = jnp.zeros((26, 512, 4096), jnp.bfloat16), jnp.zeros((26, 2048, 2048), jnp.bfloat16)
    w_qa, w_qb = jnp.zeros((26, 2048, 1536), jnp.bfloat16), jnp.zeros((26, 1536, 3072), jnp.bfloat16)
    w_q = jnp.zeros((26, 2048, 3072), jnp.bfloat16)  # V2-Lite's wq: 16 heads of 192
    g = jnp.ones((26, 1536), jnp.float32)
    layer = jnp.int32(3)

    def absorbed(q, w_q, w_uk, i):  # wq's partials into W_UK (q_nope: the first 128 of each head's 192 columns)
        q = stacked_matmul(q, w_q, i, impl="kernel", keep_splits=True)
        return stacked_head_matmul(
            q.reshape(q.shape[0], 16, 192), w_uk, i, col_offset=0, contract_rows=False, impl="kernel", k_cols=128
        )

    def out(o, w_uv, w_o, i):
        o = stacked_head_matmul(
            o, w_uv, i, col_offset=128, contract_rows=True, width=128, impl="kernel", keep_splits=True
        )
        return stacked_matmul(o, w_o, i, impl="kernel")

    def query(x, w_qa, w_qb, g, i):
        q_a = stacked_matmul(x, w_qa, i, impl="kernel", keep_splits=True)
        return stacked_matmul(q_a, w_qb, i, norm=RowNorm(g, 1e-6), impl="kernel")

    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h200)):
        for M in (1, 2):
            o = jax.ShapeDtypeStruct((M, 16, 512), jnp.bfloat16)
            x = jax.ShapeDtypeStruct((M, 2048), jnp.bfloat16)
            for text in (
                jax.jit(absorbed).trace(x, w_q, w_uv, layer).lower(lowering_platforms=("cuda",)).as_text(),
                jax.jit(out).trace(o, w_uv, w_o, layer).lower(lowering_platforms=("cuda",)).as_text(),
                jax.jit(query).trace(x, w_qa, w_qb, g, layer).lower(lowering_platforms=("cuda",)).as_text(),
            ):
                between = text.split("xla.gpu.triton", 2)[1]  # from the first kernel's call to the second's
                assert text.count("xla.gpu.triton") == 2
                ops = ("stablehlo.reduce", "stablehlo.rsqrt", "stablehlo.pad", "stablehlo.slice")
                assert not any(op in between for op in ops)


# A narrow V2-Lite whose attention output and shared-expert projections are multiples of the kernel's blocks
# (wq 128 -> 128, wo 128 -> 128, shared experts 128 <-> 128), while wkv_a (128 -> 48) and the dense MLP
# (width 96) are not: those stay sliced by the scan.
SERVED = narrow_v2_lite(3).replace(hidden_size=128, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=8)


@pytest.mark.full("the partials' kernel tests and the whole-stack decode step cover it in the quick tier")
def test_query_lora_decode_step_reads_its_norm_and_partials_in_place():
    """With a query LoRA (wq_a, q_norm, wq_b: DeepSeek-V3's and the built-in model's), a decode step of one row and
    of two (an MTP verify step's) on the interpret backend equals the reference backend's logits: wq_a's partials go
    unsummed into wq_b, whose kernel sums them and applies q_norm (its layer's weight read in place); W_UV's go into
    wo. Catches the query norm skipped or taken from another layer, and a chained projection reading the partials
    of the wrong rows."""
    cfg = SERVED.replace(q_lora_rank=64)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(1))
    e = Engine(model, page_size=16, num_pages=8, max_batch=2, kv_dtype=jnp.float32)
    rng = np.random.default_rng(1)
    fwd = jax.jit(lambda ids, positions, cache: model(ids, positions, cache=cache))
    for B, T in ((1, 1), (1, 2)):
        S = 4 + T
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, S)), jnp.int32)
        table = jnp.arange(B, dtype=jnp.int32)[:, None]

        def run(impl):
            cache = KVCache.create(e.cache.pages, table, jnp.zeros((B,), jnp.int32), impl=impl)
            _, cache = fwd(ids[:, :-T], jnp.broadcast_to(jnp.arange(S - T), (B, S - T)), cache)
            last = (ids[:, -T:], jnp.broadcast_to(jnp.arange(S - T, S), (B, T)), cache)
            return fwd(*last)[0], str(jax.make_jaxpr(fwd)(*last))

        (got, jaxpr), (want, _) = run("interpret"), run("reference")
        chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
        assert jaxpr.count("name=stacked_matmul") == 9  # wq_a, wq_b, wo a stack; the MoE stack's 3 shared experts


def test_decode_step_with_whole_stack_projections_equals_the_sliced_one():
    """A cached decode call on the interpret backend passes the served projections whole and reads each layer's
    in place: its logits equal the reference backend's (sliced by the scan; catches a projection reading another
    layer's weights or skipping the stacked path), and the program holds one stacked_matmul a served projection
    (wq and wo in the dense stack; wq, wo and the three shared-expert ones in the MoE stack) and one
    stacked_head_matmul for each of the absorbed W_UK and W_UV in each stack."""
    (got, jaxpr), (want, ref_jaxpr) = decode_step_on_both_backends(DeepSeekModel(SERVED, rngs=nnx.Rngs(0)))
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
    assert jaxpr.count("name=stacked_matmul") == 7
    assert jaxpr.count("name=stacked_head_matmul") == 4  # W_UK and W_UV in each stack
    assert "name=stacked_matmul" not in ref_jaxpr and "name=stacked_head_matmul" not in ref_jaxpr


@pytest.mark.parametrize("q_lora", full([None, 64], [None], "the query LoRA's decode step is the full tier's"))
def test_a_decode_step_projects_the_query_and_the_latent_in_one_launch(q_lora):
    """Where `stacked_matmul` serves both of a layer input's projections (wq or wq_a, and wkv_a: 64 wide here), a
    decode step runs them as one launch (`MLA.project_q_kv`) and its logits equal the reference backend's. Catches
    the latent taken from the query's columns (or the other way round), the norm of the layer input applied to one
    of them only, and a layer falling back to two launches (7 stacked_matmul calls, not 9; with the LoRA 9, not
    11)."""
    cfg = SERVED.replace(qk_rope_head_dim=32, q_lora_rank=q_lora)
    (got, jaxpr), (want, _) = decode_step_on_both_backends(DeepSeekModel(cfg, rngs=nnx.Rngs(2)), seed=2)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
    assert jaxpr.count("name=stacked_matmul") == (7 if q_lora is None else 9)


def test_the_filter_takes_served_projections_only():
    """Only `STACKED_PROJECTIONS` kernels of served shapes, `HEAD_PROJECTIONS` kernels (wkv_b, read per head by
    `stacked_head_matmul`) and, for up to `NORM_ROWS` rows, the `STACKED_NORMS` weights (the input norm, applied in
    the projections' kernel) go whole: not the router, not a projection whose widths the blocks do not divide, not
    the other norms, not the input norm of more rows (XLA normalises those first: a whole weight would be sliced)."""
    stack = nnx.eval_shape(lambda: DeepSeekModel(SERVED, rngs=nnx.Rngs(0))).moe_layers
    whole_paths = {}
    for rows in (1, NORM_ROWS, NORM_ROWS + 1):
        _, whole, _ = nnx.split(stack, stacked_filter(rows), ...)
        whole_paths[rows] = sorted("/".join(map(str, p)) for p, _ in nnx.to_flat_state(whole))
    assert whole_paths[1] == whole_paths[NORM_ROWS] == ["input_layernorm/weight"] + whole_paths[NORM_ROWS + 1]
    assert whole_paths[NORM_ROWS + 1] == [
        "mlp/shared_experts/down_proj/kernel",
        "mlp/shared_experts/gate_proj/kernel",
        "mlp/shared_experts/up_proj/kernel",
        "self_attn/wkv_b/kernel",
        "self_attn/wo/kernel",
        "self_attn/wq/kernel",
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("M", gpu_full([1, 8, 32, 128], (1, 128)))
@pytest.mark.parametrize(
    "K, N", gpu_full([(2048, 3072), (2048, 576), (2048, 2816), (2816, 2048)], [(2048, 576), (2816, 2048)])
)  # V2-Lite wq, wkv_a, MLP
def test_gpu_kernel_equals_the_reference_at_v2_lite_shapes(M, K, N):
    """The compiled kernel (bf16, a 26-layer stack, a traced layer) against XLA's GEMM of the same layer."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(M + K + N)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((26, K, N)) / np.sqrt(K), jnp.bfloat16)
    got = jax.jit(lambda x, w, i: stacked_matmul(x, w, i, impl="kernel"))(x, w, jnp.int32(17))
    want = jax.jit(stacked_matmul_reference)(x, w, jnp.int32(17))
    chex.assert_trees_all_close(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("M", gpu_full([1, 2, 32], (1, 32)))
def test_gpu_query_and_latent_projections_in_one_launch_equal_the_reference(M):
    """V2-Lite's wq (2048 -> 3072) and wkv_a (2048 -> 576) in one compiled launch, the input norm inside at one and
    two rows, against `rms_norm` then XLA's GEMM of each. Catches the compiled branch on the tile index sending a
    program to the other stack, which the interpreter's test runs through other code."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.standard_normal((M, 2048)) * 3 + 1, jnp.bfloat16)
    wq = jnp.asarray(rng.standard_normal((27, 2048, 3072)) / np.sqrt(2048), jnp.bfloat16)
    wkv = jnp.asarray(rng.standard_normal((27, 2048, 576)) / np.sqrt(2048), jnp.bfloat16)
    g = jnp.asarray(rng.uniform(0.5, 1.5, (27, 2048)), jnp.bfloat16)
    f = jax.jit(
        lambda x, w1, w2, g, i, impl: stacked_matmul(x, (w1, w2), i, norm=RowNorm(g, 1e-6), impl=impl), static_argnums=5
    )
    got = f(x, wq, wkv, g, jnp.int32(19), "kernel")
    want = f(x, wq, wkv, g, jnp.int32(19), "reference")
    for a, b in zip(got, want, strict=True):
        chex.assert_trees_all_close(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [2048, 7168])  # V2-Lite's hidden width (one piece), V3's (seven pieces of 1024)
def test_gpu_single_row_norm_inside_equals_the_norm_then_the_product(K):
    """The compiled kernel normalising a single row (`RowNorm`, a stacked norm weight read at a traced layer)
    against `rms_norm` then XLA's GEMM. Catches a compiled piece load of the row reading the wrong columns or
    the wrong layer's norm weight, which the interpreter's test cannot see."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(K)
    x = jnp.asarray(rng.standard_normal((1, K)) * 4 + 1, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, K, 576)) / np.sqrt(K), jnp.bfloat16)
    norm = RowNorm(jnp.asarray(rng.uniform(0.5, 1.5, (4, K)), jnp.bfloat16), 1e-6)
    f = jax.jit(lambda x, w, g, i, impl: stacked_matmul(x, w, i, norm=RowNorm(g, 1e-6), impl=impl), static_argnums=4)
    got = f(x, w, norm.weight, jnp.int32(3), "kernel")
    want = f(x, w, norm.weight, jnp.int32(3), "reference")
    chex.assert_trees_all_close(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("M", gpu_full([1, 32, 128], (1, 32)))
def test_gpu_head_matmul_equals_the_reference_at_v2_lite_shapes(M):
    """The compiled per-head kernel (bf16, V2-Lite's wkv_b stack [26, 512, 16·256], a traced layer), W_UK and
    W_UV, against XLA's einsum of the same layer."""
    from pallas_kernels.backend import on_hopper
    from pallas_kernels.head_matmul import stacked_head_matmul_reference

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(M)
    w = jnp.asarray(rng.standard_normal((26, 512, 16 * 256)) / np.sqrt(512), jnp.bfloat16)
    for x, kw in (
        (rng.standard_normal((M, 16, 128)), dict(col_offset=0, contract_rows=False)),
        (rng.standard_normal((M, 16, 512)), dict(col_offset=128, contract_rows=True, width=128)),
    ):
        x = jnp.asarray(x, jnp.bfloat16)
        got = jax.jit(lambda x, w, i, kw=kw: stacked_head_matmul(x, w, i, impl="kernel", **kw))(x, w, jnp.int32(17))
        want = jax.jit(lambda x, w, i, kw=kw: stacked_head_matmul_reference(x, w, i, **kw))(x, w, jnp.int32(17))
        chex.assert_trees_all_close(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------
# W_UV merging the decode kernel's KV splits as it loads them (`SplitPartials`)
# ------------------------------------------------------------------------------------------
def _split_partials(S, rows=1, H=16, seed=0):
    """Split partials of `rows` query rows as the decode kernel leaves them (64 padded rows, lse base 2), split 1
    empty (lse -inf, o 0) as a split past a short sequence's pages is."""
    from pallas_kernels.mla_decode import INTERPRET_PARAMS, MlaDecodeConfig, SplitPartials

    k1, k2 = jax.random.split(jax.random.key(seed))
    o = jax.random.normal(k1, (1, S, 64, 512), jnp.float32)
    lse = 3.0 * jax.random.normal(k2, (1, S, 64), jnp.float32)
    o, lse = o.at[:, 1].set(0.0), lse.at[:, 1].set(-jnp.inf)
    config = MlaDecodeConfig(interpretable=True)
    return SplitPartials(o, lse, rows, H, jnp.dtype(jnp.bfloat16), config, INTERPRET_PARAMS)


@pytest.mark.parametrize(
    "S, rows",
    full([(8, 1), (2, 1), (6, 1), (8, 2), (4, 3)], [(8, 1), (6, 1), (8, 2)], "one count merged, one not, two rows"),
)
def test_w_uv_merges_split_partials_as_it_loads_them(S, rows):
    """W_UV's kernel given the decode kernel's split partials (interpret mode) equals the kernel given their merge by
    the combine kernel: merged in the kernel for one sequence's rows (a decode step's one, a verify step's 2 or 3)
    and a power-of-two count of splits, merged first otherwise (6 splits). Catches a split's weight not normalised, a
    split left out (the empty one taking weight), a head reading another head's row of the partials, and a query
    token's row merged with another token's weights."""
    sp = _split_partials(S, rows)
    w = (0.05 * jax.random.normal(jax.random.key(7), (3, 512, 16 * 160), jnp.float32)).astype(jnp.bfloat16)
    kw = dict(col_offset=32, contract_rows=True, width=128, impl="interpret")
    got = jax.jit(lambda sp, w, i: stacked_head_matmul(sp, w, i, **kw))(sp, w, jnp.int32(2))
    merged = sp.combined()
    assert merged.shape == (1, rows, 16, 512) and merged.dtype == jnp.bfloat16
    want = stacked_head_matmul(merged.reshape(rows, 16, 512), w, jnp.int32(2), **kw)
    assert got.shape == want.shape == (rows, 16, 128)
    chex.assert_trees_all_close(got, want, rtol=2e-3, atol=2e-3)  # the merge rounded to bf16 either way


def test_a_one_row_decode_step_merges_its_kv_splits_in_w_uv(monkeypatch):
    """A B = 1 decode step on the interpret backend whose decode kernel runs two KV splits (bf16 pages of 64
    tokens, a 100-token context): W_UV's kernel merges them and no combine launch is left, with the logits of the
    same step whose kernel merges them by its combine (`split_partials` off). Catches the layer not asking for the
    partials (a combine left) and a merge in W_UV that differs from the combine's."""
    from mla_jax import attention as attention_mod
    from mla_jax.kv_cache import KVCache
    from pallas_kernels.mla_decode import MlaDecodeConfig

    cfg = SERVED.replace(num_hidden_layers=2, num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(3))
    e = Engine(model, page_size=64, num_pages=4, max_batch=1, kv_dtype=jnp.bfloat16)
    S = 100
    ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (1, S)), jnp.int32)
    table = jnp.asarray([[0, 1]], jnp.int32)
    fwd = jax.jit(lambda ids, positions, cache: model(ids, positions, cache=cache))
    cache = KVCache.create(e.cache.pages, table, jnp.full((1,), S - 1, jnp.int32))  # lengths after the writes
    _, cache = fwd(ids[:, :-1], jnp.arange(S - 1)[None], cache)  # the context, by the reference backend
    split = MlaDecodeConfig(num_splits=2, min_pages_per_split=1)
    step = KVCache.create(cache.pages, table, jnp.full((1,), S, jnp.int32), impl="interpret", decode_config=split)
    last = (ids[:, -1:], jnp.full((1, 1), S - 1, jnp.int32), step)
    got, jaxpr = fwd(*last)[0], str(jax.make_jaxpr(fwd)(*last))
    real = attention_mod.mla_decode
    monkeypatch.setattr(attention_mod, "mla_decode", lambda *a, **k: real(*a, **{**k, "split_partials": False}))
    fwd = jax.jit(lambda ids, positions, cache: model(ids, positions, cache=cache))
    want, jaxpr_combined = fwd(*last)[0], str(jax.make_jaxpr(fwd)(*last))
    assert jaxpr.count("mla_decode_combine") == 0 < jaxpr_combined.count("mla_decode_combine")
    # the merge's arithmetic differs from the combine's: a few bf16 roundings flip (1.4e-3 here; 4.4e-2 with the
    # splits' weights not normalised)
    chex.assert_trees_all_close(got, want, rtol=5e-3, atol=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_w_uv_merges_split_partials_as_the_combine_does(rows):
    """On the card: W_UV's compiled kernel merging 8 KV splits of one sequence's rows (a decode step's one, a verify
    step's two) as it loads them against the compiled combine kernel's merge followed by W_UV (V2-Lite's 16 heads,
    512 x 128 per head)."""
    from pallas_kernels.backend import on_hopper
    from pallas_kernels.mla_decode import MlaDecodeConfig, SplitPartials

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    sp = _split_partials(8, rows)
    sp = SplitPartials(sp.o, sp.lse, rows, 16, sp.dtype, MlaDecodeConfig())
    w = (0.05 * jax.random.normal(jax.random.key(7), (27, 512, 16 * 256), jnp.float32)).astype(jnp.bfloat16)
    kw = dict(col_offset=128, contract_rows=True, width=128, impl="kernel")
    got = jax.jit(lambda sp, w, i: stacked_head_matmul(sp, w, i, **kw))(sp, w, jnp.int32(26))
    want = jax.jit(lambda sp, w, i: stacked_head_matmul(sp.combined().reshape(rows, 16, 512), w, i, **kw))(
        sp, w, jnp.int32(26)
    )
    chex.assert_trees_all_close(got, want, rtol=2e-3, atol=2e-3)


def test_a_cached_mtp_block_reads_its_weights_in_place():
    """The MTP module's block in a cached call (the draft of an MTP verify step) runs as a stack of one layer: its
    served projections through `stacked_matmul` and its W_UK / W_UV through `stacked_head_matmul`, each weight read in
    place, and its output equals the reference backend's (the block through XLA's dots). Catches the block through
    the dots again (no stacked kernel in its program) and a stack of one that reads another module's weights."""
    model = DeepSeekModel(SERVED.replace(num_mtp_layers=1), rngs=nnx.Rngs(3))
    e = Engine(model, page_size=16, num_pages=8, max_batch=1, kv_dtype=jnp.float32)
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.standard_normal((1, 2, SERVED.hidden_size)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, SERVED.vocab_size, (1, 2)), jnp.int32)
    positions = jnp.arange(2, dtype=jnp.int32)[None]
    draft = jax.jit(lambda h, ids, cache: model.mtp_block(h, ids, positions, cache=cache))

    def run(impl):
        cache = KVCache.create(e.cache.pages, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32), impl=impl)
        return draft(h, ids, cache)[0], str(jax.make_jaxpr(draft)(h, ids, cache))

    (got, jaxpr), (want, ref_jaxpr) = run("interpret"), run("reference")
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
    assert (jaxpr.count("name=stacked_matmul"), jaxpr.count("name=stacked_head_matmul")) == (5, 2), jaxpr.count(
        "name=stacked_matmul"
    )
    assert "name=stacked_matmul" not in ref_jaxpr
