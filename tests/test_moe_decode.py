"""The decode-shaped MoE kernel (`pallas_kernels.moe_decode`, Pallas Triton backend) against its
`lax.ragged_dot` reference: interpret mode on CPU, cross-lowered for sm_90, and on a Hopper GPU.

Guards against: a row tile that skips or double-counts rows when an expert has more rows than a tile
(16 or 32: `MoeDecodeConfig.row_tile`) or 0; buffers padded for another tile than the config's; the default
config's row tile not following the rows an expert; rows past the groups written with garbage; the contraction
loop missing a chunk (block sizes not dividing D / I are refused instead); the custom gradient drifting from
ragged_dot's;
"auto" choosing the decode kernel for prefill-sized calls (its weights would be re-read per tile);
the shared experts run as pseudo-experts in the same launches reading another layer, another pseudo-expert's
columns or the routed rows, or added twice (or not at all) by the MoE layer.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import initializers
from models import experts
from models.experts import moe_dense_reference, moe_grouped, resolve_moe_impl
from models.moe import MoE
from pallas_kernels.moe_decode import (
    SHARED_MAX_ROWS,
    MoeDecodeConfig,
    SharedExperts,
    default_config,
    fp8_default_config,
    moe_decode,
    moe_decode_fp8,
    moe_decode_fp8_problems,
    moe_decode_fp8_reference,
    moe_decode_problems,
    moe_decode_reference,
)
from tests.tiers import full, gpu_full

SMALL = MoeDecodeConfig(block_i=32, block_d=32, block_o=32, block_k=32)


def small(row_tile=16):
    """SMALL's blocks at `row_tile` rows a tile."""
    return dataclasses.replace(SMALL, row_tile=row_tile)


def _problem(sizes, D=64, I=64, pad=3, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    E = len(sizes)
    M = int(sum(sizes)) + pad
    x = jnp.asarray(rng.standard_normal((M, D)), dtype)
    w = [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), dtype) for s in ((E, D, I), (E, D, I), (E, I, D))]
    return x, jnp.asarray(sizes, jnp.int32), *w


@pytest.mark.parametrize("row_tile", [16, 32])
@pytest.mark.parametrize(
    "sizes, pad",
    [([1, 0, 0, 2], 3), ([0, 17, 3, 0], 3), ([33, 1, 0, 16], 3), ([17, 0, 49, 33], 0)],
    ids=["few", "17-rows", "3-tiles", "49-rows"],
)
def test_interpret_matches_reference(sizes, pad, row_tile):
    """At 16- and 32-row tiles, groups of 17, 33 and 49 rows (one past one, two and three 16-row tiles; one past
    one 32-row tile, and 49 > 32 + 16). Catches a tile stepping by other than its height (32-row tiles 16 apart:
    cdiv(49, 32) = 2 tiles leave row 48; 16-row tiles 32 apart skip rows 16-31 of 33) and a mask of another
    height than the tile. (The interpreter pads a ref to any slice it is given, so padding shows only in
    test_row_tiles_stay_in_their_buffers.)"""
    args = _problem(sizes, pad=pad)
    ref = moe_decode_reference(*args)
    got = moe_decode(*args, config=small(row_tile), impl="interpret")
    assert got.dtype == jnp.float32 and got.shape == ref.shape
    chex.assert_trees_all_close(got, ref, rtol=1e-2, atol=1e-2)  # bf16 h rounded alike; sums in fp32
    assert not np.asarray(got[int(sum(sizes)) :]).any()  # rows past the groups are 0


def _reach_past_buffers(monkeypatch):
    """Records, as the interpreted kernels run, each `plt.load` / `plt.store` whose slice of a dimension ends past
    the ref's (masked rows included): (what, end, size) tuples. The list returned fills as the kernels run."""
    import jax.experimental.pallas.triton as plt
    from jax._src.state.indexing import NDIndexer, Slice
    from jax._src.state.types import TransformedRef

    past = []

    def checked(op, name):
        def run(ref, *args, **kwargs):
            assert isinstance(ref, TransformedRef) and len(ref.transforms) == 1, ref
            (idx,) = ref.transforms
            assert isinstance(idx, NDIndexer), idx
            for size, s in zip(ref.ref.shape, idx.indices):
                if isinstance(s, Slice):
                    cb = lambda end, size=size: end > size and past.append((name, int(end), size))  # noqa: E731
                    jax.debug.callback(cb, s.start + s.size)
            return op(ref, *args, **kwargs)

        return run

    monkeypatch.setattr(plt, "load", checked(plt.load, "load"))
    monkeypatch.setattr(plt, "store", checked(plt.store, "store"))
    return past


@pytest.mark.parametrize("row_tile", [16, 32])
def test_row_tiles_stay_in_their_buffers(monkeypatch, row_tile):
    """No row tile's load or store reaches past its buffer, masked rows included: x, h and y are padded by the
    config's tile (a 16-row pad at 32-row tiles lets the last tile of the 33-row group ending at the last row reach
    15 rows past), the shared experts' h and partials by whole tiles of it (3 tokens at 32-row tiles: 16 rows
    padded would be written 32), the fp8 rows' f16 factors likewise. The interpreter pads a ref to whatever slice it
    is given, so the values cannot show it; a GPU's masked lanes are not read either, but an address past the buffer
    is one a later change (a load without its mask) would read."""
    config = small(row_tile)
    args = _problem([17, 0, 49, 33], pad=0)
    xs, ws = _shared(3, 2)
    past = _reach_past_buffers(monkeypatch)
    y, _ = moe_decode(*args, config=config, impl="interpret", shared=SharedExperts(*ws, 1), x_shared_TD=xs)
    fp8 = _fp8_problem([2, 0, 33], dtype=jnp.bfloat16, layers=1, pad=0)
    fp8_config = dataclasses.replace(config, block_d=64, block_i=64, block_o=64, block_k=64, fp8_f16=True)
    moe_decode_fp8(*fp8, config=fp8_config, impl="interpret")
    jax.effects_barrier()
    assert past == []
    chex.assert_trees_all_close(y, moe_decode_reference(*args), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("row_tile", [16, 32, 64])
def test_cross_lowers_for_sm90(row_tile):
    """Each row tile the config takes lowers to Triton (a tile shape Triton refuses fails here)."""
    from jax._src import mesh as mesh_lib

    args = _problem([2, 0, 5, 1])
    h200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    # Triton's lowering asks the device for its compute capability: name an abstract H200 (the
    # arguments are made before, outside the abstract mesh, where no eager op can run).
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h200)):
        traced = jax.jit(lambda *a: moe_decode(*a, config=small(row_tile), impl="kernel")).trace(*args)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2, "gate/up and down kernels"


@pytest.mark.parametrize("row_tile", [None, 32])
def test_moe_grouped_decode_equals_the_dense_oracle_and_ragged_dot_gradients(monkeypatch, row_tile):
    """Also with `decode_config` (`mla-bench moe --row-tiles`): the config reaches the kernel (a dropped one would
    time 16-row tiles under a 32 label), and the gradient's custom VJP takes it as a static argument."""
    import models.experts as ex

    config = None if row_tile is None else MoeDecodeConfig(row_tile=row_tile)
    seen, real = [], ex.moe_decode
    monkeypatch.setattr(ex, "moe_decode", lambda *a, **kw: seen.append(kw["config"]) or real(*a, **kw))
    rng = np.random.default_rng(1)
    T, K, E, D, I = 5, 2, 4, 128, 64  # multiples of the default blocks
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    gate, up, down = (
        jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32) for s in ((E, D, I), (E, D, I), (E, I, D))
    )
    got = moe_grouped(x, w, idx, gate, up, down, impl="decode_interpret", decode_config=config)
    chex.assert_trees_all_close(got, moe_dense_reference(x, w, idx, gate, up, down), rtol=1e-4, atol=1e-4)
    assert seen == [config]

    def loss(impl, x, gate):
        kw = dict(decode_config=config) if impl == "decode_interpret" else {}
        return jnp.sum(moe_grouped(x, w, idx, gate, up, down, impl=impl, **kw) ** 2)

    g_dec = jax.grad(lambda *a: loss("decode_interpret", *a), argnums=(0, 1))(x, gate)
    g_ref = jax.grad(lambda *a: loss("ragged_dot", *a), argnums=(0, 1))(x, gate)
    chex.assert_trees_all_close(g_dec, g_ref, rtol=1e-4, atol=1e-4)


def test_widths_the_blocks_do_not_divide_are_refused():
    assert moe_decode_problems(2048, 1408) == []  # V2-Lite
    assert moe_decode_problems(7168, 2048) == []  # V3
    assert moe_decode_problems(128, 48) == ["I (moe_intermediate_size) = 48 is not a multiple of the block 64"]
    with pytest.raises(ValueError, match="moe_decode: D"):
        moe_decode(*_problem([1, 1], D=48), impl="interpret")
    with pytest.raises(ValueError, match="power of two"):
        MoeDecodeConfig(block_i=48)


def test_row_tile_is_16_unless_given_and_refused_in_one_line():
    """The default keeps 16-row tiles (taller ones are untimed on a card); a row tile that is not a power of two
    from 16 to 64 is refused in one line naming it (24 would step rows past a tile's mask, 128 overflow the
    registers of two fp32 accumulators)."""
    assert default_config(2048, 1408) == MoeDecodeConfig(block_k=128) and MoeDecodeConfig().row_tile == 16
    for bad in (24, 8, 128):
        with pytest.raises(ValueError, match=rf"^MoeDecodeConfig.row_tile must be a power of two .*, got {bad}$"):
            MoeDecodeConfig(row_tile=bad)


def test_auto_takes_the_decode_kernel_only_for_decode_shaped_calls(monkeypatch):
    monkeypatch.setattr("pallas_kernels.backend.on_hopper", lambda: True)
    bf16 = jnp.bfloat16
    assert resolve_moe_impl("auto", bf16, rows=6, num_experts=64, widths=(2048, 1408)) == "decode"
    assert resolve_moe_impl("auto", bf16, rows=768, num_experts=64, widths=(2048, 1408)) == "decode"  # B=128
    assert resolve_moe_impl("auto", bf16, rows=3072, num_experts=64, widths=(2048, 1408)) == "mgpu"  # prefill
    assert resolve_moe_impl("auto", bf16, rows=6, num_experts=64, widths=(64, 48)) == "mgpu"  # widths refused
    assert resolve_moe_impl("auto", jnp.float32, rows=6, num_experts=64) == "ragged_dot"
    assert experts.DECODE_ROWS_PER_EXPERT == 16


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", gpu_full([1, 32, 128], (32,)))
def test_gpu_kernel_matches_reference_at_v2_lite_widths(tokens):
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(tokens)
    E, K = 64, 6
    sizes = np.bincount(np.concatenate([rng.choice(E, K, replace=False) for _ in range(tokens)]), minlength=E)
    args = _problem(sizes.tolist(), D=2048, I=1408, pad=5)
    got = jax.jit(lambda *a: moe_decode(*a, impl="kernel"))(*args)
    ref = jax.jit(moe_decode_reference)(*args)
    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-2, rel
    assert not np.asarray(got[int(sizes.sum()) :]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", gpu_full([1, 16], (1,)))
def test_gpu_rows_gathered_from_their_tokens_equal_the_rows_given(tokens):
    """The compiled kernel at V2-Lite's widths with `row_tokens` (each row's token gathered in the loads, the shared
    experts reading the tokens, a spare row's token out of range and never read) against the same rows given."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(tokens)
    E, K = 64, 6
    picks = np.concatenate([rng.choice(E, K, replace=False) for _ in range(tokens)])
    order = np.argsort(picks, kind="stable")
    sizes = np.bincount(picks, minlength=E)
    _, gs, g, u, d = _problem(sizes.tolist(), D=2048, I=1408, pad=0)
    x_TD = jnp.asarray(rng.standard_normal((tokens, 2048)), jnp.bfloat16)
    row_tokens = jnp.asarray(np.concatenate([order // K, [10**6] * 3]), jnp.int32)
    sh = [jnp.asarray(rng.standard_normal(s) / 40, jnp.bfloat16) for s in ((2048, 2816), (2048, 2816), (2816, 2048))]
    shared = SharedExperts(*sh)
    got = jax.jit(lambda *a: moe_decode(*a, impl="kernel", shared=shared, row_tokens=row_tokens))(x_TD, gs, g, u, d)
    rows = x_TD[jnp.clip(row_tokens, 0, tokens - 1)]
    want = jax.jit(lambda *a: moe_decode(*a, impl="kernel", shared=shared, x_shared_TD=x_TD))(rows, gs, g, u, d)
    chex.assert_trees_all_equal(got, want)


def test_engine_with_the_decode_experts_reads_each_layer_out_of_the_stack():
    """moe_impl="decode" (the kernel's reference on CPU) makes the cached forward hand the MoE the
    whole [L, E, ...] expert stack with a layer offset instead of a per-layer slice: a wrong offset
    (another layer's experts, or layer 0's for all) changes the generated tokens."""
    from flax import nnx
    from micro_configs import narrow_v2_lite

    from models import DeepSeekModel, Engine

    cfg = narrow_v2_lite(4).replace(hidden_size=128, moe_intermediate_size=64)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    out = {}
    for impl in ("ragged_dot", "decode"):
        m = DeepSeekModel(cfg, rngs=nnx.Rngs(0), moe_impl=impl)
        out[impl] = (
            Engine(m, page_size=16, num_pages=16, max_batch=2, kv_dtype=jnp.float32)
            .generate(prompts, max_new_tokens=6)
            .tokens
        )
    assert out["decode"] == out["ragged_dot"]


# ------------------------------------------------------------------------------------------
# FP8 experts (`moe_decode_fp8`): DeepSeek-V3's release layout, read in place and converted in registers
# ------------------------------------------------------------------------------------------
def _fp8_problem(sizes, D=256, I=256, layers=2, pad=3, seed=0, dtype=jnp.float32):
    """Rows for `sizes` and FP8 experts of `layers` stacked layers, flattened ([layers·E, ...]); 2x2 scale blocks
    per expert (D = I = 256), scales spread over 2^-12..2^-6 so a scale of another block, expert or layer shows."""
    rng = np.random.default_rng(seed)
    E = len(sizes)
    x = jnp.asarray(rng.standard_normal((int(sum(sizes)) + pad, D)), dtype)
    ws, ss = [], []
    for shape in ((layers * E, I, D), (layers * E, I, D), (layers * E, D, I)):
        ws.append(jnp.asarray(rng.standard_normal(shape) * 64, jnp.float32).astype(jnp.float8_e4m3fn))
        ss.append(jnp.asarray(np.exp2(rng.uniform(-12, -6, (shape[0], shape[1] // 128, shape[2] // 128))), jnp.float32))
    return x, jnp.asarray(sizes, jnp.int32), *ws, *ss


def _np_experts(x, sizes, g, u, d, sg, su, sd, offset):
    """float64 silu(x·Wgᵀ) * (x·Wuᵀ) · Wdᵀ of each row (group e: expert `offset + e`); rows past the groups: 0."""
    from test_fp8_matvec import np_dequant

    x = np.asarray(x, np.float64)
    y = np.zeros_like(x)
    r = 0
    for e, n in enumerate(np.asarray(sizes)):
        w = [np_dequant(a[offset + e], s[offset + e]) for a, s in ((g, sg), (u, su), (d, sd))]
        xe = x[r : r + n]
        h = xe @ w[0].T
        y[r : r + n] = (h * 0.5 * (1 + np.tanh(h / 2)) * (xe @ w[1].T)) @ w[2].T  # silu, without exp overflow
        r += n
    return y


@pytest.mark.parametrize("sizes", [[1, 0, 0, 2], [0, 17, 3, 0]], ids=["empty-experts", "17-rows"])
def test_fp8_interpret_reads_the_offset_experts_and_their_block_scales(sizes):
    """Layer 1's experts of a 2-layer stack (offset E): the kernel against numpy's float64 (catches the wrong
    expert or layer, a scale of another block, rows of empty experts written) and against the reference."""
    args = _fp8_problem(sizes)
    E = len(sizes)
    config = MoeDecodeConfig(block_i=64, block_d=64, block_o=64, block_k=64)
    got = jax.jit(lambda *a: moe_decode_fp8(*a, expert_offset=E, config=config, impl="interpret"))(*args)
    want = _np_experts(*args, offset=E)
    chex.assert_trees_all_close(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert not np.asarray(got[int(sum(sizes)) :]).any()  # rows past the groups are 0
    ref = moe_decode_fp8_reference(*args, expert_offset=E)
    chex.assert_trees_all_close(got, ref, rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max()))


def test_fp8_bits_conversion_and_bf16_rows():
    args = _fp8_problem([2, 0, 1, 1], dtype=jnp.bfloat16, layers=1)
    config = MoeDecodeConfig(block_i=64, block_d=128, block_o=64, block_k=64, fp8_convert="bits")
    got = moe_decode_fp8(*args, config=config, impl="interpret")
    ref = moe_decode_fp8_reference(*args)
    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-2, rel


def test_fp8_in_f16_scales_each_row_and_undoes_it():
    """bf16 rows with `fp8_f16` take f16 products: each row of x scaled by a power of two into f16's range, the
    factor undone on the fp32 gate/up products before the SiLU, and h's rows scaled the same way for the down
    products (undone on y). Rows from 2^-20 to 2^20 in size (one at 2^20
    overflows f16 unscaled; the SiLU is not linear, so a factor applied after it shows) against numpy's float64,
    row by row.
    Catches x's or h's factors not applied, applied to another row tile's rows, or x's after the SiLU."""
    x, sizes, *w = _fp8_problem([2, 0, 17, 1], dtype=jnp.float32, layers=1)
    rng = np.random.default_rng(3)
    x = jnp.asarray(np.asarray(x) * np.exp2(rng.integers(-20, 21, (x.shape[0], 1))), jnp.bfloat16)
    config = MoeDecodeConfig(block_i=64, block_d=128, block_o=64, block_k=64, fp8_f16=True)
    assert config.f16(jnp.bfloat16) and not config.f16(jnp.float32)
    assert not MoeDecodeConfig().f16(jnp.bfloat16)  # opt-in until timed on a GPU
    got = np.asarray(jax.jit(lambda *a: moe_decode_fp8(*a, config=config, impl="interpret"))(x, sizes, *w))
    want = _np_experts(np.asarray(x, np.float64), sizes, *w, offset=0)
    n = int(sum(sizes))
    assert np.isfinite(got).all()
    err = np.abs(got[:n] - want[:n]).max(axis=1) / np.abs(want[:n]).max(axis=1)
    assert (err < 5e-3).all(), err  # x and h rounded to f16 (11 bits), the output to bf16
    assert not got[n:].any()
    with pytest.raises(ValueError, match=r"^MoeDecodeConfig.fp8_f16 converts e4m3 -> f16 by cast, not 'bits'"):
        MoeDecodeConfig(fp8_f16=True, fp8_convert="bits")


def test_fp8_what_it_cannot_serve_is_one_line_each():
    assert moe_decode_fp8_problems(7168, 2048) == []  # V3
    assert moe_decode_fp8_problems(256, 256, MoeDecodeConfig(block_d=256)) == [
        "block_d = 256 spans more than one 128-wide scale block"
    ]
    x, sizes, g, u, d, sg, su, sd = _fp8_problem([1, 1], layers=1)
    with pytest.raises(ValueError, match=r"^down weights must be \[E=2, D=256, I=256\]"):
        moe_decode_fp8(x, sizes, g, u, d[:, :, :128], sg, su, sd)
    with pytest.raises(ValueError, match=r"^up scales must be float32 \(2, 2, 2\)"):
        moe_decode_fp8(x, sizes, g, u, d, sg, su[:, :1], sd)
    with pytest.raises(ValueError, match=r"^gate weights must be float8_e4m3fn"):
        moe_decode_fp8(x, sizes, g.astype(jnp.bfloat16), u, d, sg, su, sd)


def test_fp8_default_config_fits_the_widths():
    """moe_decode_fp8's default (config None): 128-wide down tiles where D and I allow, 64 where not (a default of
    128 everywhere would refuse the tiny model's I = 64 and send it off the kernel), 4 stages, f16 products."""
    assert fp8_default_config(7168, 2048) == MoeDecodeConfig(block_o=128, block_k=128, num_stages=4, fp8_f16=True)
    tiny = fp8_default_config(128, 64)
    assert (tiny.block_i, tiny.block_d, tiny.block_o, tiny.block_k) == (64, 128, 128, 64)
    assert moe_decode_fp8_problems(128, 64) == [] and moe_decode_fp8_problems(7168, 2048) == []
    assert moe_decode_fp8_problems(128, 64, MoeDecodeConfig(block_k=128)) != []


def test_fp8_default_config_in_interpret_mode():
    """config None on bf16 rows runs the default (128-wide down tiles, f16 products) against float64 numpy: a
    default whose down tiles read the wrong columns of a 128-wide block, or that leaves a row's f16 scale
    undone or applies another row's, misses by far more than the bound."""
    x, *rest = _fp8_problem([2, 0, 3, 1], dtype=jnp.bfloat16)
    args = (
        x * jnp.exp2(3.0 * jnp.arange(x.shape[0]))[:, None].astype(x.dtype),
        *rest,
    )  # rows 8x apart: each its own factor
    got = np.asarray(jax.jit(lambda *a: moe_decode_fp8(*a, expert_offset=4, impl="interpret"))(*args), np.float64)
    want = _np_experts(np.asarray(args[0], np.float64), *args[1:], offset=4)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-2, err


@pytest.mark.parametrize("f16", [False, True, None])
def test_fp8_cross_lowers_for_sm90(f16):
    from jax._src import mesh as mesh_lib

    E, D, I = 16, 7168, 2048
    args = (
        jax.ShapeDtypeStruct((8, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((E,), jnp.int32),
        *(jax.ShapeDtypeStruct(s, jnp.float8_e4m3fn) for s in ((3 * E, I, D), (3 * E, I, D), (3 * E, D, I))),
        *(jax.ShapeDtypeStruct(s, jnp.float32) for s in ((3 * E, 16, 56), (3 * E, 16, 56), (3 * E, 56, 16))),
    )
    off = jnp.int32(E)
    h200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h200)):
        config = None if f16 is None else MoeDecodeConfig(fp8_f16=f16)  # None: fp8_default_config
        traced = jax.jit(lambda *a: moe_decode_fp8(*a[:-1], expert_offset=a[-1], config=config, impl="kernel")).trace(
            *args, off
        )
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2, "gate/up and down kernels"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", gpu_full([1, 32], (1,)))
def test_gpu_fp8_kernel_matches_reference_at_v3_widths(tokens):
    """V3's routed experts (256 of D = 7168, I = 2048, top-8) of layer 1 of a 2-layer stack, bf16 rows."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    E, K, D, I = 256, 8, 7168, 2048
    rng = np.random.default_rng(tokens)
    sizes = np.bincount(np.concatenate([rng.choice(E, K, replace=False) for _ in range(tokens)]), minlength=E)
    keys = jax.random.split(jax.random.key(tokens), 7)
    x = jax.random.normal(keys[0], (int(sizes.sum()) + 5, D), jnp.bfloat16)
    shapes = ((2 * E, I, D), (2 * E, I, D), (2 * E, D, I))
    # drawn a slab at a time: a float32 draw of a 2-layer stack is 28 GiB, beside other tests on the same GPU
    draw = initializers.normal(64.0)
    ws = [draw(k, s, jnp.float8_e4m3fn) for k, s in zip(keys[1:4], shapes)]
    ss = [
        jnp.exp2(jax.random.uniform(k, (s[0], s[1] // 128, s[2] // 128), jnp.float32, -12.0, -6.0))
        for k, s in zip(keys[4:], shapes)
    ]
    args = (x, jnp.asarray(sizes, jnp.int32), *ws, *ss)
    for convert, f16 in (("cast", True), ("cast", False), ("bits", False), (None, None)):
        config = None if convert is None else MoeDecodeConfig(fp8_convert=convert, fp8_f16=f16)  # None: the default
        got = jax.jit(lambda *a: moe_decode_fp8(*a, expert_offset=E, config=config, impl="kernel"))(*args)
        ref = jax.jit(lambda *a: moe_decode_fp8_reference(*a, expert_offset=E))(*args)
        rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        assert rel < 1e-2, (convert, f16, rel)
        assert not np.asarray(got[int(sizes.sum()) :]).any()


# ------------------------------------------------------------------------------------------
# Shared experts in the same two launches (`SharedExperts`: S / I pseudo-experts after the E routed ones)
# ------------------------------------------------------------------------------------------
def _shared(T, n_shared, D=64, I=64, layers=3, seed=5, dtype=jnp.bfloat16, stacked=True):
    """Tokens [T, D] and shared experts of width S = n_shared · I: a stack of `layers` layers (each its own
    weights, so another layer's show) or one layer's 2-D weights."""
    rng = np.random.default_rng(seed)
    S = n_shared * I
    xs = jnp.asarray(rng.standard_normal((T, D)), dtype)
    lead = (layers,) if stacked else ()
    ws = [jnp.asarray(rng.standard_normal(lead + s) / np.sqrt(s[0]), dtype) for s in ((D, S), (D, S), (S, D))]
    return xs, ws


def _np_swiglu(x, g, u, d):
    """float64 silu(x·g) * (x·u) · d: the shared MLP, written apart from the code under test."""
    x, g, u, d = (np.asarray(a, np.float64) for a in (x, g, u, d))
    a = x @ g
    return (a / (1 + np.exp(-a)) * (x @ u)) @ d


@pytest.mark.parametrize(
    "T, n_shared, stacked, row_tile",
    full(
        [(T, n, st, rt) for T in (1, 3, 17) for n in (1, 2) for st in (True, False) for rt in (16, 32)],
        [(1, 1, True, 16), (3, 2, False, 16), (17, 2, True, 16), (3, 2, True, 32), (17, 1, False, 32)],
        "each row count, shared-expert count, weight form (stack, 2d) and row tile runs in the quick tier",
    ),
)
def test_shared_interpret_matches_reference_and_leaves_the_routed_rows(T, n_shared, stacked, row_tile):
    """Routed and shared experts in one pair of launches, layer 1 of a 3-layer stack at a traced index (or 2-D
    weights) against the reference. Catches: the shared programs reading another layer (or layer 0), a wrong
    column offset h·I of a pseudo-expert, a partial dropped from the sum (S/I = 2), the second row tile of 17
    tokens skipped, and shared programs writing into the routed rows (the routed output must be bit-identical
    to a call without shared experts); at 16- and 32-row tiles (17 tokens: two tiles or one)."""
    args = _problem([1, 0, 17, 2])
    xs, ws = _shared(T, n_shared, stacked=stacked)
    config = small(row_tile)

    @jax.jit
    def run(layer):
        sh = SharedExperts(*ws, layer)
        return moe_decode(*args, config=config, impl="interpret", shared=sh, x_shared_TD=xs)

    y, ys = run(jnp.int32(1))
    y_ref, ys_ref = moe_decode_reference(*args, shared=SharedExperts(*ws, 1), x_shared_TD=xs)
    assert ys.dtype == jnp.float32 and ys.shape == (T, 64)
    chex.assert_trees_all_close(ys, ys_ref, rtol=1e-2, atol=1e-2)  # bf16 h rounded alike; sums in fp32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(moe_decode(*args, config=config, impl="interpret")))
    chex.assert_trees_all_close(y, y_ref, rtol=1e-2, atol=1e-2)


def test_shared_result_is_a_plain_swiglu_of_the_layers_weights():
    """f32 rows (no rounding of h): the kernel's and the reference's shared output against numpy's float64 SwiGLU
    of the layer's weights, independent of the code under test. Catches a shared reference (and kernel) that
    agree with each other but not with the MLP: the SiLU on the up product, gate and up swapped, h·W_down's
    rows taken at another pseudo-expert's offset, the layer index ignored."""
    T, n_shared = 17, 2
    xs, ws = _shared(T, n_shared, dtype=jnp.float32)
    args = _problem([2, 0, 1, 1], dtype=jnp.float32)
    want = _np_swiglu(xs, *(w[2] for w in ws))
    sh = SharedExperts(*ws, jnp.int32(2))
    _, got = jax.jit(lambda *a: moe_decode(*a, config=SMALL, impl="interpret", shared=sh, x_shared_TD=xs))(*args)
    _, ref = moe_decode_reference(*args, shared=sh, x_shared_TD=xs)
    for y in (got, ref):
        chex.assert_trees_all_close(np.asarray(y, np.float64), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_shared_cross_lowers_for_sm90_in_two_launches():
    """V2-Lite's widths (D = 2048, I = 1408, S = 2816) with a 26-layer shared stack at a traced layer: still two
    Triton kernels (a third launch, or a shared path the Triton lowering refuses, fails here)."""
    from jax._src import mesh as mesh_lib

    E, D, I, S, L = 8, 2048, 1408, 2816, 26
    args = (
        jax.ShapeDtypeStruct((12, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((E,), jnp.int32),
        *(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((E, D, I), (E, D, I), (E, I, D))),
        jax.ShapeDtypeStruct((2, D), jnp.bfloat16),
        *(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((L, D, S), (L, D, S), (L, S, D))),
        jax.ShapeDtypeStruct((), jnp.int32),
    )

    def call(x, sizes, g, u, d, xs, sg, su, sd, layer):
        sh = SharedExperts(sg, su, sd, layer)
        return moe_decode(x, sizes, g, u, d, impl="kernel", shared=sh, x_shared_TD=xs)

    h200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h200)):
        text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2, "routed and shared experts in the gate/up and down kernels"


def test_shared_widths_and_arguments_refused_in_one_line():
    """S must be a multiple of I (the pseudo-experts are I wide): a kernel that took S = 96 with I = 64 would
    drop (or read past) its last 32 columns. Also: shared weights without the tokens, mismatched shapes."""
    assert moe_decode_problems(2048, 1408, S=2816) == []  # V2-Lite: 2 shared experts of 1408
    assert moe_decode_problems(7168, 2048, S=2048) == []  # V3: 1 shared expert
    assert moe_decode_problems(128, 64, S=96) == ["S (the shared experts' width) = 96 is not a multiple of I = 64"]
    args = _problem([1, 1])
    xs, ws = _shared(2, 1, I=64)
    bad = [w[..., :96] if i < 2 else w[:, :96] for i, w in enumerate(_shared(2, 2)[1])]
    with pytest.raises(
        ValueError, match=r"^moe_decode: S \(the shared experts' width\) = 96 is not a multiple of I = 64$"
    ):
        moe_decode(*args, config=SMALL, impl="interpret", shared=SharedExperts(*bad, 0), x_shared_TD=xs)
    with pytest.raises(ValueError, match=r"^moe_decode: shared experts need both"):
        moe_decode(*args, config=SMALL, impl="interpret", shared=SharedExperts(*ws, 0))
    with pytest.raises(ValueError, match=r"^shared down weights must be \(3, 64, 64\)"):
        moe_decode(
            *args, config=SMALL, impl="interpret", shared=SharedExperts(ws[0], ws[1], ws[2][:, :32], 0), x_shared_TD=xs
        )
    with pytest.raises(ValueError, match=r"^x_shared must be bfloat16 \[T, D=64\]"):
        moe_decode(*args, config=SMALL, shared=SharedExperts(*ws, 0), x_shared_TD=xs.astype(jnp.float32))


def test_moe_grouped_with_shared_gradients_equal_the_unfused_ones():
    """moe_grouped's decode path with the shared experts fused: the value and the gradients (x, routed and shared
    weights) against ragged_dot + a jnp SwiGLU. Catches the custom gradient dropping the shared experts'
    cotangents (x's through them, or their weights')."""
    rng = np.random.default_rng(2)
    T, K, E, D, I = 5, 2, 4, 128, 64
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    routed = [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32) for s in ((E, D, I),) * 2 + ((E, I, D),)]
    _, sw = _shared(T, 2, D=D, I=I, dtype=jnp.float32)

    def fused(x, gate, sg, sd):
        sh = SharedExperts(sg, sw[1], sd, jnp.int32(1))
        return moe_grouped(x, w, idx, gate, *routed[1:], impl="decode_interpret", shared=sh)

    def apart(x, gate, sg, sd):
        y = moe_grouped(x, w, idx, gate, *routed[1:], impl="ragged_dot")
        return y + jnp.dot(jax.nn.silu(x @ sg[1]) * (x @ sw[1][1]), sd[1])

    args = (x, routed[0], sw[0], sw[2])
    chex.assert_trees_all_close(fused(*args), apart(*args), rtol=1e-4, atol=1e-4)
    grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3))(*args) for f in (fused, apart)]
    chex.assert_trees_all_close(*grads, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stacked", [True, False], ids=["stack", "2d"])
def test_moe_layer_with_fused_shared_experts_equals_the_unfused_layer(monkeypatch, stacked):
    """An MoE layer's decode path (bf16, the kernels interpreted) with its shared experts inside the decode kernel
    equals the same layer running them apart (`self.shared_experts`, by stacked_matmul for a whole stack) to bf16
    rounding, for shared kernels that are a whole stack [L, D, S] read at `Stacked.index` and for 2-D ones. The
    fused call must not run the MLP as well (it would add the shared experts twice), and the unfused must run it."""
    from flax import nnx

    from mla_jax import ModelConfig
    from mla_jax.linear import Stacked
    from models.mlp import MLP

    cfg = ModelConfig.tiny().replace(n_shared_experts=2)  # D = 128, I = 64, S = 128
    m = MoE(cfg, rngs=nnx.Rngs(3), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, impl="decode")
    if stacked:  # a 3-layer stack of the shared experts' kernels, as a scanned model passes them whole
        rng = np.random.default_rng(4)
        for lin in (m.shared_experts.gate_proj, m.shared_experts.up_proj, m.shared_experts.down_proj):
            k = lin.kernel[...]
            lin.kernel = nnx.Param(jnp.asarray(rng.standard_normal((3,) + k.shape) * 0.05, jnp.bfloat16))
    x = jax.random.normal(jax.random.key(7), (1, 3, cfg.hidden_size), jnp.bfloat16)
    st = Stacked(jnp.int32(1), "interpret")
    assert m._decode_shared("decode", st, 1) is not None
    # past one row tile the shared experts run apart (their programs would re-read the weights a tile)
    assert m._decode_shared("decode", st, SHARED_MAX_ROWS + 1) is None

    calls = []
    mlp_call = MLP.__call__
    monkeypatch.setattr(MLP, "__call__", lambda self, *a: calls.append(1) or mlp_call(self, *a))
    fused = m(x, stacked=st)
    assert not calls, "the fused call ran the shared MLP too"
    monkeypatch.setattr(MoE, "_decode_shared", lambda self, impl, stacked, rows: None)
    apart = m(x, stacked=st)
    assert calls
    assert fused.dtype == apart.dtype == jnp.bfloat16
    scale = float(jnp.abs(apart.astype(jnp.float32)).max())
    chex.assert_trees_all_close(fused.astype(jnp.float32), apart.astype(jnp.float32), rtol=2e-2, atol=1e-2 * scale)


@pytest.mark.full(
    "test_moe_layer_with_fused_shared_experts_equals_the_unfused_layer[stack] (the layer at a stack index) and "
    "test_engine_with_the_decode_experts_reads_each_layer_out_of_the_stack run in the quick tier"
)
def test_model_decode_step_runs_the_shared_experts_in_the_moe_kernel():
    """A scanned model's cached decode step with moe_impl="decode" on the interpret backend: the shared experts'
    kernels go in whole ([L, D, S]) and run inside the two moe_decode launches at the scan's layer index. Its
    logits equal the reference backend's (catches the shared experts read at another layer, or added twice or
    not at all), and the program holds no stacked_matmul for them (wq and wo of the dense and MoE stacks only)
    and two moe_decode launches."""
    from flax import nnx
    from micro_configs import decode_step_on_both_backends, narrow_v2_lite

    from models import DeepSeekModel

    cfg = narrow_v2_lite(3).replace(hidden_size=128, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=8)
    (got, jaxpr), (want, _) = decode_step_on_both_backends(DeepSeekModel(cfg, rngs=nnx.Rngs(0), moe_impl="decode"))
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
    assert jaxpr.count("name=stacked_matmul") == 4
    assert jaxpr.count("name=moe_decode_gate_up") == jaxpr.count("name=moe_decode_down") == 1


@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "shared"])
def test_expert_programs_run_only_the_listed_experts(with_shared):
    """`expert_programs` (the experts that got rows, their starts and sizes; padded with programs of size 0) give
    the same rows as one program an expert (catches a program reading its expert by program id instead of the
    list, a size-0 program writing, the shared programs placed after E rather than after the A listed ones)."""
    sizes = [0, 3, 0, 0, 17, 0, 1, 0]
    x, gs, g, u, d = _problem(sizes)
    starts = np.cumsum(sizes) - sizes
    touched = [e for e, n in enumerate(sizes) if n]
    pad = 5 - len(touched)  # A = 5 programs: the three touched experts and two of size 0
    programs = tuple(
        jnp.asarray(a, jnp.int32)
        for a in (
            touched + [0] * pad,
            [starts[e] for e in touched] + [0] * pad,
            [sizes[e] for e in touched] + [0] * pad,
        )
    )
    kw = {}
    if with_shared:
        rng = np.random.default_rng(3)
        T = 3
        sh = [jnp.asarray(rng.standard_normal(s) / 8, jnp.bfloat16) for s in ((64, 128), (64, 128), (128, 64))]
        kw = dict(shared=SharedExperts(*sh), x_shared_TD=x[:T])
    want = moe_decode(x, gs, g, u, d, config=SMALL, impl="interpret", **kw)
    got = moe_decode(x, gs, g, u, d, config=SMALL, impl="interpret", expert_programs=programs, **kw)
    chex.assert_trees_all_equal(got, want)
    with pytest.raises(ValueError, match=r"^expert_programs must be three int \[A\] arrays"):
        moe_decode(x, gs, g, u, d, config=SMALL, impl="interpret", expert_programs=programs[:2])


@pytest.mark.parametrize("row_tile", [16, 32])
@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "shared"])
def test_rows_gathered_from_their_tokens_equal_the_rows_given(with_shared, row_tile):
    """`row_tokens`: x holds the T tokens and the kernel gathers each routed row's token as it loads it (no [M, D]
    rows made between the route and the experts) -> the same rows as x[row_tokens] given as rows; the shared
    experts then read the T tokens themselves. The rows past the groups (a buffer's spare rows: their tokens out of
    range here) come back 0. Catches a row tile reading its rows as they are instead of their tokens and the shared
    programs reading routed rows; at 16- and 32-row tiles (a group of 33: a whole 32-row tile of gathered rows),
    a tile's token indices built for 16 rows (the rest of a 32-row tile reading another token); a bad argument is
    one line."""
    sizes = [0, 3, 0, 0, 33, 0, 1, 0]
    config = small(row_tile)
    rng = np.random.default_rng(5)
    T, M = 7, sum(sizes)
    x_TD = jnp.asarray(rng.standard_normal((T, 64)), jnp.bfloat16)
    _, gs, g, u, d = _problem(sizes)
    tokens = jnp.asarray(np.concatenate([rng.integers(0, T, M), [10**6, -(10**6), 10**6]]), jnp.int32)
    kw, given = {}, {}
    if with_shared:
        sh = [jnp.asarray(rng.standard_normal(s) / 8, jnp.bfloat16) for s in ((64, 128), (64, 128), (128, 64))]
        kw, given = dict(shared=SharedExperts(*sh)), dict(shared=SharedExperts(*sh), x_shared_TD=x_TD)
    rows = x_TD[jnp.clip(tokens, 0, T - 1)]
    want = moe_decode(rows, gs, g, u, d, config=config, impl="interpret", **given)
    got = moe_decode(x_TD, gs, g, u, d, config=config, impl="interpret", row_tokens=tokens, **kw)
    chex.assert_trees_all_equal(got, want)
    ref = moe_decode(x_TD, gs, g, u, d, config=config, impl="reference", row_tokens=jnp.clip(tokens, 0, T - 1), **kw)
    chex.assert_trees_all_close(got, ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match=r"^row_tokens must be int \[M\], got float32 \(2, 3\)$"):
        moe_decode(x_TD, gs, g, u, d, config=config, impl="interpret", row_tokens=jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"^moe_decode: with row_tokens the shared experts read x's tokens"):
        moe_decode(x_TD, gs, g, u, d, config=config, impl="interpret", row_tokens=tokens, x_shared_TD=x_TD)
