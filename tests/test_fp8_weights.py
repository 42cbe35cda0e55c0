"""FP8 linear weights (`mla_jax.fp8_weights`) and `load_hf_checkpoint(weights="fp8")`.

Expected values come from numpy block loops (`np_quant`, `np_dequant_loop` of tests/test_checkpoint.py, written
from the format's definition) and from HF transformers' outputs stored with the fixture (tests/fixtures/README.md:
hf_v3_tiny_fp8's references are HF's fp32 forward on the weights dequantized by hand, W = fp8 * scale per
128x128 block with partial edge blocks; HF's own CPU FP8 path does not read partial blocks that way, see the
README). The FP8 tolerance on logits: the jnp path dequantizes the weights exactly (fp32 products) and does
not quantize activations, so in fp32 it is the fp32 port's 3e-5 against HF (in bf16 compute an FP8 projection
rounds its dequantized weight to bf16 once, as a dense bf16 load does).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from micro_configs import MICRO_V3
from test_checkpoint import np_dequant_loop, np_quant

from mla_jax import fp8_weights
from models import DeepSeekModel, Engine, SamplingParams, load_hf_checkpoint, save_hf_checkpoint
from models.checkpoint import read_safetensors, write_safetensors

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_v3_tiny_fp8")
DENSE_FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_v3_tiny")
RTOL = ATOL = 3e-5


def fp8_leaves(model):
    """{path: array} of every FP8 weight variable (e4m3 values) of a model."""
    state = nnx.state(model, fp8_weights.Fp8Weight)
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(state)}


# ------------------------------------------------------------------------------------------
# The format (jnp) against numpy loops
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 7), (2, 129, 257)])
def test_quantize_and_dequantize_blocks_match_numpy_loops(shape):
    """Ceil blocks with partial edges, stacked leading axes. Catches: floor block counts (an edge dropped),
    the scale applied per row or per column instead of per block, scale vs 1/scale, a transposed grid."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 3.0, shape[:-2] + (1, 1)).astype(np.float32)
    w[..., :3, :] *= 40.0  # a row block with a larger amax than the others
    q, s = fp8_weights.quantize_blocks(jnp.asarray(w))
    flat = w.reshape((-1,) + shape[-2:])
    want = [np_quant(x) for x in flat]
    want_q = np.stack([a for a, _ in want]).reshape(shape)
    want_s = np.stack([b for _, b in want]).reshape(shape[:-2] + want[0][1].shape)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    # XLA:CPU's fp32 division is not correctly rounded (1 ulp off for about half of all quotients): the
    # scales agree to 1 ulp, and a value whose quotient lies that close to an e4m3 rounding boundary may take
    # the neighbouring code (adjacent bytes: e4m3fn is sign-magnitude).
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=2.5e-7, atol=0)
    got_codes = np.asarray(q).view(np.uint8).astype(int)
    want_codes = want_q.view(np.uint8).astype(int)
    off = got_codes != want_codes
    assert off.mean() < 1e-3 and np.all(np.abs(got_codes - want_codes)[off] == 1), off.sum()
    s2 = want_s * rng.uniform(0.5, 2.0, want_s.shape).astype(np.float32)  # distinct scales, edges included
    deq = np.asarray(fp8_weights.dequantize_blocks(jnp.asarray(want_q), jnp.asarray(s2)))
    ref = np.stack(
        [np_dequant_loop(a, b) for a, b in zip(want_q.reshape(flat.shape), s2.reshape((-1,) + s2.shape[-2:]))]
    )
    np.testing.assert_array_equal(deq, ref.reshape(shape))
    with pytest.raises(ValueError, match=r"^fp8 blocks: scales .* do not match weight .* \(expected"):
        fp8_weights.dequantize_blocks(jnp.asarray(want_q), jnp.asarray(s2)[..., :-1])


@pytest.mark.parametrize("shape, slabs", [((3, 256, 40), 6), ((3, 100, 40), 3)])
def test_a_large_random_fp8_weight_is_quantized_a_slab_at_a_time(monkeypatch, shape, slabs):
    """Over `MAX_BUCKETED` elements (here 2048), `random_blocks` draws and quantizes a slab at a time: slab i of
    whole 128-row blocks (of whole matrices when the rows are not a multiple of 128) is the quantization of the
    init's draw from fold_in(key, i), its scales in place. Catches a slab written over another, scales of another
    slab, a block cut between slabs (its scale would be the amax of part of it)."""
    from mla_jax import initializers

    monkeypatch.setattr(initializers, "MAX_BUCKETED", 2048)
    init, key = initializers.normal(0.02), jax.random.key(5)
    q, s = fp8_weights.random_blocks(init, key, shape)
    assert q.shape == shape and q.dtype == jnp.float8_e4m3fn and s.shape == (3, -(-shape[1] // 128), 1)
    rows = shape[0] * shape[1] // slabs
    q_rows = np.asarray(q).view(np.uint8).reshape(slabs, rows, shape[2])
    s_rows = np.asarray(s).reshape(slabs, -(-rows // 128), 1)
    for i in range(slabs):
        w = init(jax.random.fold_in(key, i), (1, rows, shape[2]), jnp.float32)
        want_q, want_s = fp8_weights.quantize_blocks(w)
        # XLA:CPU's fp32 division is 1 ulp off for some quotients, differently in the fused program (see above)
        np.testing.assert_allclose(s_rows[i], np.asarray(want_s[0]), rtol=2.5e-7, atol=0)
        codes = np.abs(q_rows[i].astype(int) - np.asarray(want_q[0]).view(np.uint8).astype(int))
        assert codes.max() <= 1 and (codes > 0).mean() < 1e-3, (codes > 0).sum()
    assert len({float(x) for x in s_rows[:, 0, 0]}) == slabs  # every slab drawn anew


def test_fp8_linear_is_x_times_the_dequantized_weight_transposed():
    """y = x · Wᵀ with W [N, K] as released. Catches: the weight used untransposed (or its scale grid),
    the output left in fp32 when the compute dtype is bf16."""
    rng = np.random.default_rng(4)
    q, s = np_quant(rng.standard_normal((300, 200)).astype(np.float32))
    x = rng.standard_normal((2, 3, 200)).astype(np.float32)
    y = fp8_weights.fp8_linear(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), dtype=jnp.float32)
    want = x.astype(np.float64) @ np_dequant_loop(q, s).astype(np.float64).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-4)
    yb = fp8_weights.fp8_linear(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), dtype=jnp.bfloat16)
    assert yb.dtype == jnp.bfloat16 and yb.shape == (2, 3, 300)
    assert np.linalg.norm(np.asarray(yb, np.float32) - want) / np.linalg.norm(want) < 1e-2
    with pytest.raises(ValueError, match=r"^fp8_linear: the weight must be float8_e4m3fn \[N, K\], got bfloat16"):
        fp8_weights.fp8_linear(jnp.asarray(x), jnp.asarray(q, jnp.bfloat16), jnp.asarray(s), dtype=jnp.float32)


def test_dequantize_group_rows_is_the_numpy_blocks_of_those_rows():
    """Rows [lo, hi) of each of 6 groups of 48 rows (MLA's W_UK / W_UV halves of wkv_b, one group a head) against
    numpy's block loop on the whole weight: groups straddle the 128-row blocks and the last column block is partial.
    Catches a scale of the wrong row block (the group's offset dropped), the layout transposed, the other half's
    rows, a bad range accepted."""
    rng = np.random.default_rng(5)
    q, s = np_quant(rng.standard_normal((288, 200)).astype(np.float32))
    lin = fp8_weights.Fp8Linear(200, 288, rngs=nnx.Rngs(0))
    lin.weight_fp8[...], lin.scale_inv[...] = jnp.asarray(q), jnp.asarray(s)
    whole = np_dequant_loop(q, s).reshape(6, 48, 200)
    for lo, hi in ((0, 16), (16, 48), (5, 6)):
        got = fp8_weights.dequantize_group_rows(lin, 6, lo, hi)
        assert got.shape == (6, hi - lo, 200) and got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), whole[:, lo:hi])
    lin.dtype = jnp.bfloat16
    got = fp8_weights.dequantize_group_rows(lin, 6, 16, 48)
    np.testing.assert_array_equal(np.asarray(got), whole[:, 16:48].astype(ml_dtypes.bfloat16))  # rounded once
    with pytest.raises(ValueError, match=r"^rows \[40, 50\) of 6 groups do not fit the 288 output rows$"):
        fp8_weights.dequantize_group_rows(lin, 6, 40, 50)


def test_absorbed_products_dequantize_each_half_of_fp8_wkv_b_once():
    """The absorbed path (decode) on an FP8 wkv_b: W_UK and W_UV each dequantize only their half, in the stored
    layout. The bug it pins: both products dequantized the whole [H·(N+V), L] matrix and transposed it, twice a
    layer; it would convert 2x the weight's values and transpose a wkv_b-sized array."""
    from mla_jax.attention import MLA

    cfg = MICRO_V3
    mla = MLA(cfg, rngs=nnx.Rngs(0), weights="fp8")
    H, N, R, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q_nope, q_pe = jnp.ones((1, 1, H, N)), jnp.ones((1, 1, H, R))
    o_lat = jnp.ones((1, 1, H, L))

    def step(q_nope, q_pe, o_lat):
        return mla.absorb_query(q_nope, q_pe), mla.output_from_latent(o_lat)

    eqns = jax.make_jaxpr(step)(q_nope, q_pe, o_lat).eqns

    def walk(eqns):
        for e in eqns:
            yield e
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from walk(sub.eqns)

    eqns = list(walk(eqns))
    w = mla.wkv_b.weight_fp8[...]
    fp8_in = [
        e.invars[0].aval.size
        for e in eqns
        if e.primitive.name == "convert_element_type" and e.invars[0].aval.dtype == jnp.float8_e4m3fn
    ]
    wo = mla.wo.weight_fp8[...]  # the output projection's own e4m3 weight (the reference fp8_linear on a CPU)
    assert sum(fp8_in) == w.size + wo.size, (fp8_in, w.shape, wo.shape)
    assert not [e for e in eqns if e.primitive.name == "transpose" and e.invars[0].aval.size >= w.size // 2]
    want = mla.wkv_b.dense_kernel().reshape(L, H, -1)  # the decompressed path's W (dense_kernel, as before)
    got_q = np.asarray(step(q_nope, q_pe, o_lat)[0])[..., :L]
    np.testing.assert_allclose(got_q, np.einsum("bthn,lhn->bthl", np.ones((1, 1, H, N)), want[..., :N]), rtol=1e-5)


def test_fp8_gemm_impl_is_resolved_in_one_place(monkeypatch):
    """One resolver names the kernel by the rows: `fp8_matvec` up to 32 rows or for a stack (any widths),
    `fp8_matmul` above (K a multiple of 128, bf16 compute). "auto" is the reference off a Hopper GPU and where
    neither serves; asking for a kernel that cannot serve is one line naming why, and so is an unknown name."""
    resolve = fp8_weights.resolve_fp8_gemm_impl
    assert resolve("auto", 4, 256, 128) == "reference"  # a CPU
    assert resolve("kernel", 4, 200, 100) == "kernel"  # fp8_matvec: partial blocks are fine
    assert resolve("reference", 4096, 256, 128) == "reference"
    with pytest.raises(ValueError, match=r"^fp8_gemm_impl='kernel': the kernels cannot serve this: K = 100 is not"):
        resolve("kernel", 64, 256, 100)
    with pytest.raises(ValueError, match=r"compute dtype float32: fp8_matmul quantizes the activations"):
        resolve("kernel", 64, 256, 128, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"M = 64 rows is outside the 1\.\.32"):
        resolve("kernel", 64, 256, 128, stacked=True)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        resolve("cublas", 4, 256, 128)
    monkeypatch.setattr("pallas_kernels.backend.on_hopper", lambda: True)
    assert resolve("auto", 1, 576, 7168) == "kernel"
    assert resolve("auto", 4096, 7168, 2048) == "kernel"
    assert resolve("auto", 4096, 7168, 2048, dtype=jnp.float32) == "reference"
    assert resolve("auto", 64, 256, 100) == "reference"
    with pytest.raises(ValueError, match=r"^weights must be None \(dense, in param_dtype\) or 'fp8', got 'int4'"):
        nnx.eval_shape(lambda: DeepSeekModel(MICRO_V3, rngs=nnx.Rngs(0), weights="int4"))


def test_fp8_linear_calls_the_kernel_its_rows_name(monkeypatch):
    """M <= 32 rows (and a layer of a stack) go to `fp8_matvec` with rows in the compute dtype, more rows to
    `fp8_matmul` with bf16 rows; the interpreted small-M kernel equals the reference, a stack's layer included."""
    rng = np.random.default_rng(5)
    pairs = [np_quant(rng.standard_normal((300, 200)).astype(np.float32)) for _ in range(2)]
    w, sc = (jnp.asarray(np.stack(a)) for a in zip(*pairs))  # a stack of two [300, 200], scales [2, 3, 2]
    x = jnp.asarray(rng.standard_normal((2, 3, 200)), jnp.float32)
    got = fp8_weights.fp8_linear(x, w[1], sc[1], dtype=jnp.float32, impl="interpret")
    want = fp8_weights.fp8_linear_reference(x, w[1], sc[1], dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    got = fp8_weights.fp8_linear(x, w, sc, dtype=jnp.float32, impl="interpret", layer=jnp.int32(1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    ref = fp8_weights.fp8_linear(x, w, sc, dtype=jnp.float32, impl="reference", layer=1)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(want), rtol=1e-6, atol=1e-6)
    calls = []

    def spy(x, w, s, impl):
        calls.append((x.shape, x.dtype, impl))
        return jnp.zeros((x.shape[0], w.shape[0]), jnp.bfloat16)

    monkeypatch.setattr(fp8_weights, "fp8_matmul", spy)
    q2, s2 = np_quant(rng.standard_normal((128, 256)).astype(np.float32))
    x2 = jnp.ones((33, 256), jnp.float32)
    with pytest.raises(ValueError, match=r"compute dtype float32"):
        fp8_weights.fp8_linear(x2, jnp.asarray(q2), jnp.asarray(s2), dtype=jnp.float32, impl="kernel")
    fp8_weights.fp8_linear(x2, jnp.asarray(q2), jnp.asarray(s2), dtype=jnp.bfloat16, impl="kernel")
    assert calls == [((33, 256), jnp.bfloat16, "kernel")]
    with pytest.raises(ValueError, match=r"^fp8_linear: the weight must be float8_e4m3fn a stack \[L, N, K\]"):
        fp8_weights.fp8_linear(x, w[1], sc[1], dtype=jnp.float32, layer=0)


# ------------------------------------------------------------------------------------------
# The FP8 fixture, kept in FP8
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixture_models():
    if not os.path.isfile(os.path.join(FIXTURE, "reference.npz")):
        pytest.skip("fixture hf_v3_tiny_fp8 not generated (scripts/make_hf_fixtures.py)")
    ref = dict(np.load(os.path.join(FIXTURE, "reference.npz")))
    return load_hf_checkpoint(FIXTURE, dtype=jnp.float32, weights="fp8"), ref


def test_fp8_fixture_is_kept_as_released(fixture_models):
    """Every tensor the release stores in e4m3 sits in the model unchanged (the same bytes, its scales
    beside it). Catches: a dequantize + requantize on load, a transpose of the FP8 layout, a projection
    (e.g. the MTP block's or the shared experts') left dense, scales not loaded."""
    model, _ = fixture_models
    raw = read_safetensors(os.path.join(FIXTURE, "model.safetensors"))
    fp8_names = sorted(k for k, v in raw.items() if v.dtype == ml_dtypes.float8_e4m3fn)
    leaves = fp8_leaves(model)
    assert all(v.dtype == jnp.float8_e4m3fn for v in leaves.values())
    assert sum(int(np.prod(v.shape)) for v in leaves.values()) == sum(raw[k].size for k in fp8_names)
    wq_b = model.layer(0).self_attn.wq_b
    name = "model.layers.0.self_attn.q_b_proj.weight"  # [192, 48]: two row blocks, the second partial
    np.testing.assert_array_equal(np.asarray(wq_b.weight_fp8[...]).view(np.uint8), raw[name].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(wq_b.scale_inv[...]), raw[name + "_scale_inv"])
    experts = model.mtp[0].block.mlp.experts  # the MTP block's routed experts, stacked [E, I, D]
    name = "model.layers.3.mlp.experts.5.down_proj.weight"
    np.testing.assert_array_equal(np.asarray(experts.down_proj_fp8[...][5]).view(np.uint8), raw[name].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(experts.down_proj_scale_inv[...][5]), raw[name + "_scale_inv"])
    # what the release keeps dense stays dense
    assert model.lm_head.kernel[...].dtype == jnp.float32 and model.mtp[0].eh_proj.kernel[...].dtype == jnp.float32


def test_fp8_fixture_gives_hf_logits(fixture_models):
    """The FP8 model's logits and MTP logits against HF's. Catches: wrong dequantization anywhere (partial
    blocks above all), a projection computed with its [N, K] weight untransposed."""
    model, ref = fixture_models
    with jax.default_matmul_precision("highest"):
        out = model.forward(jnp.asarray(ref["input_ids"]), with_mtp=True)
    np.testing.assert_allclose(np.asarray(out.logits), ref["logits"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(out.mtp_logits[0]), ref["mtp_logits"], rtol=RTOL, atol=ATOL)


def test_fp8_greedy_tokens_are_the_dequantized_models(fixture_models):
    """The FP8 model's greedy tokens through the engine (cached; the absorbed decode reads W_UK / W_UV out
    of the FP8 wkv_b) are the greedy choices of the model loaded dequantized (its full forward over each
    prompt + the tokens before). Catches: a cached or absorbed path that reads the FP8 weights wrongly
    (wkv_b's halves swapped, its scales ignored), an engine step that bypasses the FP8 projections."""
    fp8, ref = fixture_models
    dense = load_hf_checkpoint(FIXTURE, dtype=jnp.float32)
    prompts = [list(map(int, ref["input_ids"][0][:7])), list(map(int, ref["input_ids"][1][:4]))]
    kw = dict(page_size=8, num_pages=16, max_batch=2, prefill_chunk=8)
    outs = Engine(fp8, **kw).generate(prompts, max_new_tokens=5, sampling=SamplingParams(temperature=0.0)).tokens
    ids = np.zeros(ref["input_ids"].shape, np.int32)  # the fixture's [2, 12]: the shape the HF test runs
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ids[i, : len(p) + len(o)] = p + o
    logits = np.asarray(dense(jnp.asarray(ids)))
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert len(o) == 5 and logits[i, len(p) - 1 : len(p) + 4].argmax(-1).tolist() == o, f"request {i}"


# ------------------------------------------------------------------------------------------
# Loader contract: round trip and one-line refusals
# ------------------------------------------------------------------------------------------
def test_fp8_model_save_load_roundtrip(fixture_models, tmp_path):
    """An FP8 model saved in the release's layout loads back identical with weights="fp8", and dequantized
    without it. Catches: the writer transposing FP8 experts ("stack" vs "stackT"), a missing
    quantization_config, scales written under the wrong names."""
    model, _ = fixture_models
    save_hf_checkpoint(model, tmp_path)
    config = json.load(open(tmp_path / "config.json"))
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    back = load_hf_checkpoint(tmp_path, weights="fp8")
    la = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    lb = jax.tree_util.tree_leaves_with_path(nnx.state(back))
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype, jax.tree_util.keystr(p)
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), jax.tree_util.keystr(p))
    dense = load_hf_checkpoint(tmp_path)
    experts = model.layer(1).mlp.experts  # stacked [E, I, D] e4m3 -> dense [E, D, I]
    want = np_dequant_loop(np.asarray(experts.gate_proj_fp8[...][2]), np.asarray(experts.gate_proj_scale_inv[...][2]))
    np.testing.assert_array_equal(np.asarray(dense.layer(1).mlp.experts.gate_proj[...][2]), want.T)


def test_dense_checkpoint_with_weights_fp8_is_one_line(tmp_path):
    """weights="fp8" never quantizes silently: a checkpoint without the fp8 quantization_config, or one that
    stores a quantized projection densely, is refused naming what to do."""
    with pytest.raises(
        ValueError, match=r"^weights='fp8' keeps FP8 weights as released, but .*config\.json has no fp8"
    ):
        load_hf_checkpoint(DENSE_FIXTURE, weights="fp8")
    if not os.path.isfile(os.path.join(FIXTURE, "config.json")):
        pytest.skip("fixture hf_v3_tiny_fp8 not generated")
    shutil.copy(os.path.join(FIXTURE, "config.json"), tmp_path)
    file = os.path.join(tmp_path, "model.safetensors")
    shutil.copy(os.path.join(FIXTURE, "model.safetensors"), file)
    t = {k: np.array(v) for k, v in read_safetensors(file).items()}
    name = "model.layers.0.self_attn.o_proj.weight"
    t[name] = np_dequant_loop(t[name], t.pop(name + "_scale_inv")).astype(ml_dtypes.bfloat16)
    write_safetensors(file, t)
    with pytest.raises(
        ValueError, match=r"stores 'model\.layers\.0\.self_attn\.o_proj\.weight' as bfloat16, not float8"
    ):
        load_hf_checkpoint(tmp_path, weights="fp8")
    load_hf_checkpoint(tmp_path)  # without weights= it loads (dense)
    config = json.load(open(tmp_path / "config.json"))
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"^weights='fp8' reads e4m3 weights in 128x128 blocks; .* weight_block_size=\[64, 64\]"
    ):
        load_hf_checkpoint(tmp_path, weights="fp8")
