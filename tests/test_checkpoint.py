"""HF checkpoint loading/saving: exact round trips, fp8 block dequantization, shards, clear errors."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from micro_configs import MICRO_V3  # noqa: E402

from mla_jax import ModelConfig
from models import DeepSeekModel, load_hf_checkpoint, save_hf_checkpoint
from models.checkpoint import dequantize_fp8_blocks, read_hf_tensors, read_safetensors, write_safetensors

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
V3 = MICRO_V3
V2_LITE = V3.replace(
    q_lora_rank=None,
    scoring_func="softmax",
    topk_method="greedy",
    n_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    num_mtp_layers=0,
    n_shared_experts=2,
    model_type="deepseek_v2",
)


def random_model(cfg, param_dtype=jnp.float32, seed=0):
    """A DeepSeekModel whose every variable (norms and router bias included) is random, without jit/init cost."""
    abstract = nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape).astype(np.float32), s.dtype), state)
    return nnx.merge(graphdef, state)


def leaves(model):
    return jax.tree_util.tree_leaves_with_path(nnx.state(model))


def assert_models_equal(a, b):
    la, lb = leaves(a), leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype, (jax.tree_util.keystr(path), x.dtype, y.dtype)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "cfg,dtype,shard",
    [(V3, jnp.float32, None), (V3, jnp.bfloat16, 20_000), (V2_LITE, jnp.float32, None)],
    ids=["v3-f32", "v3-bf16-sharded", "v2"],
)
def test_save_load_roundtrip_is_exact(tmp_path, cfg, dtype, shard):
    model = random_model(cfg, dtype)
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=shard)
    files = sorted(os.listdir(tmp_path))
    if shard:
        assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    else:
        assert files == ["config.json", "model.safetensors"]
    assert ModelConfig.from_hf(tmp_path) == cfg
    back = load_hf_checkpoint(tmp_path, dtype=dtype)
    assert_models_equal(model, back)
    # The router stays fp32 whatever the dtype; the bias is saved too (it is part of the routing).
    assert back.layer(1).mlp.gate.kernel[...].dtype == jnp.float32


def test_saved_layout_is_the_hf_fixture_layout(tmp_path):
    src = os.path.join(FIXTURES, "hf_v3_tiny")
    if not os.path.isdir(src):
        pytest.skip("fixture hf_v3_tiny not generated")
    model = load_hf_checkpoint(src, dtype=jnp.bfloat16)  # the fixture stores bf16 (bias fp32)
    save_hf_checkpoint(model, tmp_path)
    ours, theirs = read_hf_tensors(tmp_path), read_hf_tensors(src)
    assert sorted(ours) == sorted(theirs)  # same names, per-expert keys and MTP copies included
    for k in theirs:
        # Our router kernel is fp32 whatever the dtype (HF keeps it fp32 in memory too).
        want_dtype = np.float32 if k.endswith("mlp.gate.weight") else theirs[k].dtype
        assert ours[k].dtype == want_dtype and ours[k].shape == theirs[k].shape, k
        np.testing.assert_array_equal(ours[k].astype(np.float32), theirs[k].astype(np.float32), err_msg=k)
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_hf(src)


# ------------------------------------------------------------------------------------------
# fp8
# ------------------------------------------------------------------------------------------
def np_dequant_loop(q, s, block=128):
    """Block by block, the plain way."""
    out = np.zeros(q.shape, np.float32)
    for a in range(0, q.shape[0], block):
        for b in range(0, q.shape[1], block):
            out[a : a + block, b : b + block] = (
                q[a : a + block, b : b + block].astype(np.float32) * s[a // block, b // block]
            )
    return out


def np_quant(w, block=128):
    o, i = w.shape
    s = np.zeros((-(-o // block), -(-i // block)), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for a in range(s.shape[0]):
        for b in range(s.shape[1]):
            blk = w[a * block : (a + 1) * block, b * block : (b + 1) * block]
            s[a, b] = max(np.abs(blk).max(), 1e-12) / 448.0
            q[a * block : (a + 1) * block, b * block : (b + 1) * block] = (blk / s[a, b]).astype(
                ml_dtypes.float8_e4m3fn
            )
    return q, s


@pytest.mark.parametrize("shape", [(200, 300), (130, 60), (128, 256), (5, 7)])
def test_fp8_dequant_matches_numpy_blocks(shape):
    rng = np.random.default_rng(1)
    q, s = np_quant(rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 3.0))
    s *= rng.uniform(0.5, 2.0, s.shape).astype(np.float32)  # distinct scales per block, edges included
    np.testing.assert_array_equal(dequantize_fp8_blocks(q, s), np_dequant_loop(q, s))
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        dequantize_fp8_blocks(q, s[:, :-1] if s.shape[1] > 1 else s[:-1])


def test_fp8_checkpoint_is_dequantized_on_load(tmp_path):
    model = random_model(V3)
    save_hf_checkpoint(model, tmp_path)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = dict(read_safetensors(file))
    name = "model.layers.0.mlp.down_proj.weight"  # [32, 48]; and a 2-block one below
    q, s = np_quant(np.asarray(tensors[name], np.float32))
    tensors[name], tensors[name + "_scale_inv"] = q, s
    tensors = {k: np.array(v) for k, v in tensors.items()}
    write_safetensors(file, tensors)
    back = load_hf_checkpoint(tmp_path)
    np.testing.assert_array_equal(np.asarray(back.layer(0).mlp.down_proj.kernel[...]), np_dequant_loop(q, s).T)
    # fp8 without its scales is an error naming the tensor
    del tensors[name + "_scale_inv"]
    write_safetensors(file, tensors)
    with pytest.raises(ValueError, match="down_proj.weight.*block scales"):
        load_hf_checkpoint(tmp_path)
    # mis-shaped scales: the error names the scale tensor
    tensors[name + "_scale_inv"] = np.ones((3, 3), np.float32)
    write_safetensors(file, tensors)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight_scale_inv'.*does not match"):
        load_hf_checkpoint(tmp_path)
    # scales next to a weight that is not fp8: refused, naming the weight
    tensors[name] = np.asarray(np_dequant_loop(q, s), np.float32)
    tensors[name + "_scale_inv"] = s
    write_safetensors(file, tensors)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' has block scales"):
        load_hf_checkpoint(tmp_path)


def test_fp8_fixture_header_is_read_by_hand():
    d = os.path.join(FIXTURES, "hf_v3_tiny_fp8")
    if not os.path.isdir(d):
        pytest.skip("fixture hf_v3_tiny_fp8 not generated")
    raw = read_safetensors(os.path.join(d, "model.safetensors"))
    name = "model.layers.0.mlp.gate_proj.weight"  # [160, 64]: two row blocks, the second partial
    assert raw[name].dtype == ml_dtypes.float8_e4m3fn and raw[name + "_scale_inv"].shape == (2, 1)
    np.testing.assert_array_equal(read_hf_tensors(d)[name], np_dequant_loop(raw[name], raw[name + "_scale_inv"]))


# ------------------------------------------------------------------------------------------
# File format compatibility and errors
# ------------------------------------------------------------------------------------------
def test_reader_and_writer_agree_with_safetensors_library(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(2)
    t = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": np.arange(7, dtype=np.int32),
        "c": rng.standard_normal((2, 2, 2)).astype(np.float16),
    }
    st.save_file(t, str(tmp_path / "lib.safetensors"))
    ours = read_safetensors(str(tmp_path / "lib.safetensors"))
    write_safetensors(str(tmp_path / "ours.safetensors"), t)
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    for k in t:
        np.testing.assert_array_equal(ours[k], t[k])
        np.testing.assert_array_equal(theirs[k], t[k])


@pytest.fixture
def saved(tmp_path):
    save_hf_checkpoint(random_model(V3), tmp_path)
    file = os.path.join(tmp_path, "model.safetensors")
    return tmp_path, file, {k: np.array(v) for k, v in read_safetensors(file).items()}


def test_missing_tensor_is_named(saved):
    d, file, t = saved
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]
    write_safetensors(file, t)
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_hf_checkpoint(d)


def test_unexpected_tensor_is_named(saved):
    d, file, t = saved
    t["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)
    write_safetensors(file, t)
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.self_attn\.extra\.weight"):
        load_hf_checkpoint(d)


def test_misshaped_tensor_is_named_with_shapes(saved):
    d, file, t = saved
    t["model.layers.0.self_attn.kv_b_proj.weight"] = np.zeros((32, 15), np.float32)
    write_safetensors(file, t)
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight.*\(32, 15\).*expected \(32, 16\)"):
        load_hf_checkpoint(d)


def test_mtp_copy_must_equal_main(saved):
    d, file, t = saved
    t["model.layers.2.shared_head.head.weight"] = t["lm_head.weight"] + 1.0
    write_safetensors(file, t)
    with pytest.raises(ValueError, match=r"shared_head\.head\.weight.*copy of 'lm_head\.weight'"):
        load_hf_checkpoint(d)


def test_missing_shard_is_named(tmp_path):
    save_hf_checkpoint(random_model(V3), tmp_path, max_shard_bytes=20_000)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / victim)
    with pytest.raises(FileNotFoundError, match=victim):
        load_hf_checkpoint(tmp_path)


def test_pickle_checkpoints_are_refused(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(V3.to_hf_dict(), f)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match="pickle"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="pickle"):
        load_hf_checkpoint(tmp_path / "pytorch_model.bin")


def test_load_streams_a_sharded_checkpoint_in_bounded_host_memory(tmp_path):
    """`load_hf_checkpoint` reads a sharded checkpoint file by file, each tensor straight into the model's
    (device) variables: the host memory it allocates while loading (numpy buffers, traced by tracemalloc;
    the files themselves are memory-mapped) stays under twice the largest shard, here about a fifth of the
    model, and the weights are exact. Catches a host buffer the size of a whole stacked variable (every
    layer's experts at once, as the loader built before streaming) or the whole checkpoint read into host
    memory (what FP8 dequantization in `read_hf_tensors` does)."""
    import tracemalloc

    cfg = MICRO_V3.replace(num_hidden_layers=6, n_routed_experts=16, hidden_size=128, moe_intermediate_size=256)
    model = random_model(cfg)
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=2_000_000)  # shards of ~2 MB: jax's own allocations ~0.5
    shards = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    largest = max(os.path.getsize(f) for f in shards)
    state = nnx.state(model)
    stacked = sum(x.nbytes for k in ("dense_layers", "moe_layers") for x in jax.tree.leaves(state[k]))
    assert stacked > 4 * largest and len(shards) >= 8  # the stacked variables span many shards
    load_hf_checkpoint(tmp_path, dtype=jnp.float32)  # traced and compiled: what is measured is the loading
    tracemalloc.start()
    try:
        loaded = load_hf_checkpoint(tmp_path, dtype=jnp.float32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 2 * largest, (peak, largest)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(loaded))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
