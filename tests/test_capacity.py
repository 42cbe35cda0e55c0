"""Tests of the KV-cache capacity planner against hand-computed byte counts."""

import dataclasses
import json
import math
import subprocess
import sys

import jax.numpy as jnp
import pytest

from mla_jax.capacity import KV_DTYPES, format_plan, main, mla_kv_bytes, plan_kv_cache
from mla_jax.config import ModelConfig
from mla_jax.units import format_bytes
from mla_jax.weights_plan import weight_bytes
from pallas_kernels import PageFormat

GiB = 1024**3
V3 = ModelConfig.deepseek_v3()
PRESETS = {
    "deepseek-v3": ModelConfig.deepseek_v3(),
    "deepseek-v2-lite": ModelConfig.deepseek_v2_lite(),
    "deepseek-v2": ModelConfig.deepseek_v2(),
    "tiny": ModelConfig.tiny(),
}


# --- mla_kv_bytes --------------------------------------------------------------------------
def test_v2_shape_per_token_and_128k_context():
    # 60 layers * (512 + 64) * 2 B = 69,120 B a token over all layers.
    assert mla_kv_bytes(60, 512, 64, 2, 1) == 69_120
    total = mla_kv_bytes(60, 512, 64, 2, 131072)
    assert total == 69_120 * 131_072 == 9_059_696_640
    assert total == 8.4375 * GiB
    assert format_bytes(total) == "8.4375 GiB"
    assert mla_kv_bytes(60, 512, 64, 2, 131072, sequences=3) == 3 * total


def test_fractional_element_bytes_round_up():
    assert mla_kv_bytes(1, 512, 64, 0.5, 1) == 288  # exact
    assert mla_kv_bytes(1, 3, 2, 0.5, 1) == 3  # 2.5 B -> 3
    assert mla_kv_bytes(1, 1, 2, 0.1, 1) == 1  # 0.3 B -> 1, not 0
    assert mla_kv_bytes(1, 8, 2, 0.1, 1) == 1  # 10 * 0.1 B is 1 B, not 2 (binary 0.1 is a hair above)
    assert mla_kv_bytes(1, 8, 2, 0.1, 3) == 3
    assert isinstance(mla_kv_bytes(2, 512, 64, 1.0, 7), int)


def test_numpy_scalars_are_accepted():
    np = pytest.importorskip("numpy")
    assert mla_kv_bytes(np.int64(60), 512, 64, np.float32(2.0), np.int32(131072)) == 9_059_696_640
    assert mla_kv_bytes(1, 512, 64, np.float32(0.5), 1) == 288


@pytest.mark.parametrize("name", ["layers", "kv_lora_rank", "rope_dim", "tokens", "sequences"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", None])
def test_mla_kv_bytes_rejects_bad_integers(name, bad):
    kw = dict(layers=2, kv_lora_rank=512, rope_dim=64, element_bytes=2, tokens=8, sequences=1)
    kw[name] = bad
    with pytest.raises(ValueError, match=rf"{name}.*{repr(bad).replace('.', '[.]')}"):
        mla_kv_bytes(**kw)


@pytest.mark.parametrize("bad", [0, -2, 0.0, float("nan"), float("inf"), True, "2", None])
def test_mla_kv_bytes_rejects_bad_element_bytes(bad):
    with pytest.raises(ValueError, match="element_bytes"):
        mla_kv_bytes(2, 512, 64, bad, 8)


# --- format_bytes --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (69_120, "67.5 KiB"),
        (1024**2, "1 MiB"),
        (4_997_120, "4.765625 MiB"),
        (GiB, "1 GiB"),
        (610 * GiB, "610 GiB"),
        (int(8.4375 * GiB), "8.4375 GiB"),
        (3 * 1024**4, "3 TiB"),
        (1024**5, "1 PiB"),
    ],
)
def test_format_bytes_binary_units(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_format_bytes_rejects(bad):
    with pytest.raises(ValueError, match="n must be"):
        format_bytes(bad)


# --- the planner ---------------------------------------------------------------------------
def _mha_8192_config():
    # H=32, qk_head_dim 64 + 64 = 128, v 128: 32 * 256 = 8192 MHA values a token a layer;
    # latent 512 + 64 = 576.
    return ModelConfig.tiny().replace(
        num_attention_heads=32,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=128,
        kv_lora_rank=512,
    )


def test_saving_576_vs_8192():
    plan = plan_kv_cache(_mha_8192_config(), context_len=1024)
    assert plan.mla.bytes_per_token_layer == 576 * 2
    assert plan.mha.bytes_per_token_layer == 8192 * 2
    expected = 100 * (1 - 576 / 8192)
    assert plan.mla_saving_vs_mha_pct == pytest.approx(expected)
    assert round(plan.mla_saving_vs_mha_pct, 2) == round(expected, 2) == 92.97
    assert "92.97 % vs MHA" in format_plan(plan)
    # GQA-8: 8 * 256 = 2048 values -> 1 - 576/2048.
    assert round(plan.mla_saving_vs_gqa_pct, 2) == 71.88
    assert "71.88 % vs GQA-8" in format_plan(plan)


def test_v3_rows():
    plan = plan_kv_cache(V3, context_len=131072)
    assert plan.mla.bytes_per_token_layer == 576 * 2 == 1_152
    assert plan.mha.bytes_per_token_layer == 128 * (192 + 128) * 2 == 81_920
    assert plan.gqa.bytes_per_token_layer == 8 * (192 + 128) * 2 == 5_120
    assert plan.mla.bytes_per_token == 1_152 * 61
    assert plan.mla.logical_bytes == 1_152 * 61 * 131072 == 8.578125 * GiB
    assert plan.mha.logical_bytes == 610 * GiB
    assert plan.gqa.name == "GQA-8 equivalent" and plan.gqa_groups == 8


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("kv_dtype, b", [("bf16", 2), ("fp16", 2), ("fp32", 4)])
def test_rows_match_formulas(preset, kv_dtype, b):
    cfg = PRESETS[preset]
    ctx, seqs, page = 1000, 3, 64
    plan = plan_kv_cache(cfg, context_len=ctx, num_sequences=seqs, page_size=page, kv_dtype=kv_dtype)
    H, groups = cfg.num_attention_heads, min(8, cfg.num_attention_heads)
    per_head = cfg.qk_head_dim + cfg.v_head_dim
    expect = {
        "mla": (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * b,
        "mha": H * per_head * b,
        "gqa": groups * per_head * b,
    }
    alloc = math.ceil(ctx / page) * page
    for key, per_tl in expect.items():
        row = getattr(plan, key)
        assert row.bytes_per_token_layer == per_tl
        assert row.bytes_per_token == per_tl * cfg.num_hidden_layers
        assert row.logical_bytes == per_tl * cfg.num_hidden_layers * ctx * seqs
        assert row.allocated_bytes == per_tl * cfg.num_hidden_layers * alloc * seqs
        assert row.per_device_bytes == row.allocated_bytes  # tp=1
    assert plan.mla.logical_bytes == mla_kv_bytes(
        cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, b, ctx, seqs
    )


def test_gqa_groups_parameter_and_cap():
    plan = plan_kv_cache(V3, context_len=64, gqa_groups=16)
    assert plan.gqa.bytes_per_token_layer == 16 * 320 * 2 and plan.gqa.name == "GQA-16 equivalent"
    tiny = plan_kv_cache(ModelConfig.tiny(), context_len=64)  # H=4 < 8: GQA-4 is MHA
    assert tiny.gqa_groups == 4 and tiny.gqa.bytes_per_token_layer == tiny.mha.bytes_per_token_layer


@pytest.mark.parametrize(
    "ctx, page, alloc",
    [
        (100, 64, 128),
        (1, 64, 64),
        (64, 64, 64),
        (65, 64, 128),
        (128, 64, 128),
        (129, 64, 192),
        (100, 1, 100),
        (100, 1000, 1000),
        (131072, 64, 131072),
    ],
)
def test_page_rounding(ctx, page, alloc):
    plan = plan_kv_cache(V3, context_len=ctx, page_size=page, num_sequences=2)
    assert plan.allocated_tokens_per_sequence == alloc
    assert plan.pages_per_sequence == alloc // page
    for row in plan.rows:
        assert row.logical_bytes == row.bytes_per_token * ctx * 2
        assert row.allocated_bytes == row.bytes_per_token * alloc * 2


def test_tp_replicates_the_latent_and_splits_heads():
    one = plan_kv_cache(V3, context_len=4096, num_sequences=5)
    tp8 = plan_kv_cache(V3, context_len=4096, num_sequences=5, tp=8)
    # The latent has no head axis: every device holds all of it, whatever tp is.
    assert tp8.mla.per_device_bytes == tp8.mla.allocated_bytes == one.mla.per_device_bytes
    assert tp8.mha.per_device_bytes * 8 == tp8.mha.allocated_bytes  # 16 of 128 heads
    assert tp8.mha_heads_per_device == 16
    assert tp8.gqa.per_device_bytes * 8 == tp8.gqa.allocated_bytes  # 1 of 8 groups
    # tp > groups: each device still holds a whole group (replicated), tp > H: a whole head.
    tp16 = plan_kv_cache(V3, context_len=4096, num_sequences=5, tp=16)
    assert tp16.gqa_groups_per_device == 1
    assert tp16.gqa.per_device_bytes * 8 == tp16.gqa.allocated_bytes
    tp256 = plan_kv_cache(V3, context_len=4096, tp=256)
    assert tp256.mha_heads_per_device == 1
    assert tp256.mha.per_device_bytes * 128 == tp256.mha.allocated_bytes
    # Totals do not depend on the layout.
    for a, b in zip(one.rows, tp8.rows):
        assert (a.logical_bytes, a.allocated_bytes) == (b.logical_bytes, b.allocated_bytes)


@pytest.mark.parametrize("seqs, tp, per_device", [(5, 2, 3), (5, 4, 2), (7, 8, 1), (1, 8, 1), (16, 8, 2), (9, 1, 9)])
def test_dp_attention_splits_sequences(seqs, tp, per_device):
    plan = plan_kv_cache(V3, context_len=100, num_sequences=seqs, tp=tp, dp_attention=True)
    assert plan.sequences_per_device == per_device
    # ceil(S / tp) sequences, each 128 tokens (2 pages of 64), 61 layers, 1152 B.
    assert plan.mla.per_device_bytes == per_device * 128 * 61 * 1_152
    assert plan.mla.allocated_bytes == seqs * 128 * 61 * 1_152
    # MHA / GQA keep their tensor-parallel head split.
    assert plan.mha.per_device_bytes == plan.mha.allocated_bytes * math.ceil(128 / tp) // 128


def test_quantized_page_formats_v3():
    def per_tl(dtype):
        return plan_kv_cache(V3, context_len=64, kv_dtype=dtype).mla.bytes_per_token_layer

    assert per_tl("fp8") == 512 + 4 * 4 + 64 * 2 == 656
    assert per_tl("fp4") == 256 + 32 + 128 == 416 == PageFormat("fp4").token_bytes  # what the cache allocates
    assert per_tl("fp32") == 576 * 4
    assert per_tl("bf16") == per_tl("fp16") == 1_152
    # A latent width that is not a multiple of 128 / 16 still pays for a whole last scale.
    odd = ModelConfig.tiny().replace(kv_lora_rank=200)  # rope 16
    plan = plan_kv_cache(odd, context_len=64, kv_dtype="fp8")
    assert plan.mla.bytes_per_token_layer == 200 + 2 * 4 + 16 * 2
    plan = plan_kv_cache(odd, context_len=64, kv_dtype="fp4")
    assert plan.mla.bytes_per_token_layer == 100 + 13 + 16 * 2
    # The comparison rows: fp8 one byte a value; fp4 e2m1 pairs + a scale byte per 16 values.
    fp8 = plan_kv_cache(V3, context_len=64, kv_dtype="fp8")
    assert fp8.mha.bytes_per_token_layer == 128 * 320
    fp4 = plan_kv_cache(V3, context_len=64, kv_dtype="fp4")
    assert fp4.mha.bytes_per_token_layer == 128 * ((96 + 12) + (64 + 8))


def test_unknown_dtype_lists_known_ones():
    with pytest.raises(ValueError, match="kv_dtype='int3'") as e:
        plan_kv_cache(V3, context_len=64, kv_dtype="int3")
    for known in KV_DTYPES:
        assert known in str(e.value)
    for bad in (None, ["bf16"], "BF16"):
        with pytest.raises(ValueError, match="kv_dtype"):
            plan_kv_cache(V3, context_len=64, kv_dtype=bad)


@pytest.mark.parametrize("name", ["context_len", "num_sequences", "page_size", "tp", "gqa_groups"])
@pytest.mark.parametrize("bad", [0, -3, 2.0, True, None])
def test_planner_rejects_bad_sizes(name, bad):
    kw = dict(context_len=128)
    kw[name] = bad
    with pytest.raises(ValueError, match=name):
        plan_kv_cache(V3, **kw)


def test_planner_rejects_context_beyond_max_positions():
    tiny = ModelConfig.tiny()
    plan_kv_cache(tiny, context_len=2048)  # the limit itself is fine
    with pytest.raises(ValueError, match=r"context_len=2049.*max_position_embeddings=2048"):
        plan_kv_cache(tiny, context_len=2049)


def test_plan_is_frozen_and_table_has_every_row():
    plan = plan_kv_cache(V3, context_len=131072, num_sequences=4, tp=8, dp_attention=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tp = 2  # type: ignore[misc]
    text = format_plan(plan)
    for needle in (
        "latent MLA",
        "MHA equivalent",
        "GQA-8 equivalent",
        "bytes/token/layer",
        "logical total",
        "page-rounded",
        "per device",
        "1,152 B",
        "81,920 B",
        "% vs MHA",
    ):
        assert needle in text
    assert format_bytes(plan.mla.per_device_bytes) in text


# --- the command line ----------------------------------------------------------------------
def test_cli_default_prints_table(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    # V3 with its MTP layer: 62 layers x 1,152 B x 131,072 tokens
    assert "GiB" in out and "latent MLA" in out and "8.71875 GiB" in out


def test_cli_counts_the_mtp_layer_and_names_the_preset(capsys):
    """`mla-capacity` did not count V3's MTP layer (the 62nd layer's latent cache the engine keeps when it
    speculates): 61 x 1,152 B a token, 8.578125 GiB at 128K; and its header printed the config's
    model_type (deepseek_v3), not the preset asked for. Now --mtp is on for a model with MTP layers
    (--no-mtp: plain decoding) and the header names the preset."""
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: deepseek-v3, 61 layers + 1 MTP layer (speculative decoding), H=128,")
    assert "71,424 B" in out and "8.71875 GiB" in out  # 62 x 1,152 B a token
    assert main(["--no-mtp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: deepseek-v3, 61 layers, H=128,") and "8.578125 GiB" in out
    assert main(["--preset", "deepseek-v2-lite"]) == 0  # no MTP layers: nothing to count, no error
    out = capsys.readouterr().out
    assert out.startswith("model: deepseek-v2-lite, 27 layers, H=16,")
    assert main(["--preset", "tiny", "--context", "2048", "--mtp"]) == 0
    assert "4 layers + 1 MTP layer" in capsys.readouterr().out
    assert format_plan(plan_kv_cache(V3, context_len=64)).startswith("model: deepseek_v3, 61 layers,")  # library


def test_cli_all_flags(capsys):
    argv = [
        "--preset",
        "deepseek-v2",
        "--context",
        "100",
        "--sequences",
        "5",
        "--page-size",
        "64",
        "--kv-dtype",
        "fp8",
        "--tp",
        "2",
        "--dp-attention",
        "--gqa-groups",
        "4",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 of 5 sequences" in out and "GQA-4 equivalent" in out and "656 B" in out


def test_cli_config_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_dict()))
    assert main(["--config", str(tmp_path), "--context", "2048"]) == 0
    # tiny: (4 layers + its MTP layer) * (64 + 16) values * 2 B * 2048 tokens = 1,638,400 B.
    out = capsys.readouterr().out
    assert "1.5625 MiB" in out and out.startswith(f"model: {tmp_path} (deepseek_v3), 4 layers + 1 MTP layer (")
    assert main(["--config", str(tmp_path), "--context", "2048", "--no-mtp"]) == 0
    assert "1.25 MiB" in capsys.readouterr().out  # 4 layers


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--context", "0"], "--context"),
        (["--context", "abc"], "--context"),
        (["--context", "200000"], "max_position_embeddings"),
        (["--sequences", "-1"], "--sequences"),
        (["--page-size", "0"], "--page-size"),
        (["--tp", "0"], "--tp"),
        (["--gqa-groups", "0"], "--gqa-groups"),
        (["--kv-dtype", "int3"], "--kv-dtype"),
        (["--preset", "gpt2"], "--preset"),
        (["--preset", "tiny", "--config", "x"], "--config"),
        (["--config", "/no/such/dir"], "--config"),
        (["--weights", "int4"], "--weights"),
        (["--weights", "fp8", "--device-memory", "0"], "--device-memory: must be a positive number of GiB, got 0.0"),
    ],
)
def test_cli_errors_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("mla-capacity: error:")


def test_cli_device_memory_without_weights_is_refused(capsys):
    """Guards: `--device-memory 80` without `--weights` printed the cache table alone, as if the flag had been
    read: it sizes only the weights' section."""
    with pytest.raises(SystemExit) as e:
        main(["--device-memory", "80"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "mla-capacity: error: --device-memory 80 needs --weights bf16|fp8: it sizes the room they leave (see --help)\n"
    )


@pytest.mark.parametrize(
    "n, text",
    [
        (685_082_400_000, "638.03 GiB"),  # was 638.034804 GiB (V3's fp8 weights on one device)
        (186_075_560_416, "173.29 GiB"),  # was 173.29637 GiB
        (1024**2 - 1, "1023.99 KiB"),  # was 1023.999023 KiB; cut, never rounded up to "1024 KiB"
        (9_361_686_528, "8.71875 GiB"),  # exact figures stay exact
    ],
)
def test_format_bytes_inexact_figures_have_two_decimals(n, text):
    """Guards: a figure that six decimals do not hold exactly printed all six (`638.034804 GiB` in
    `mla-capacity --weights fp8`): it has two, cut."""
    assert format_bytes(n) == text


def test_cli_bad_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tmp_path)])
    assert e.value.code == 2
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tmp_path)])
    assert e.value.code == 2
    assert "hidden_size" in capsys.readouterr().err


def test_python_dash_m():
    # One subprocess (it imports jax through the package): the error paths are covered in-process.
    ok = subprocess.run(
        [sys.executable, "-m", "mla_jax.capacity", "--context", "4096"], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    assert "latent MLA" in ok.stdout and "MiB" in ok.stdout


def test_mtp_layers_and_draft_room():
    cfg = ModelConfig.deepseek_v3()
    plain = plan_kv_cache(cfg, context_len=4096)
    spec = plan_kv_cache(cfg, context_len=4096, include_mtp=True, draft_tokens=3)
    assert plain.mla.bytes_per_token == 61 * 1152
    assert spec.mla.bytes_per_token == 62 * 1152  # the MTP block keeps its own latent cache
    assert spec.pages_per_sequence == 65  # 4096 + 3 tokens -> one more 64-token page
    assert spec.mla.logical_bytes == 62 * 1152 * 4096  # logical: exactly the context
    assert spec.mla.allocated_bytes == 62 * 1152 * 65 * 64
    with pytest.raises(ValueError, match="draft_tokens"):
        plan_kv_cache(cfg, context_len=4096, draft_tokens=-1)
    with pytest.raises(ValueError, match="include_mtp"):
        plan_kv_cache(cfg, context_len=4096, include_mtp=1)


# --- weights by format (--weights) ---------------------------------------------------------------
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_weight_bytes_count_every_variable_of_the_model(weights):
    """The planner's arithmetic against the model itself: the bytes of every variable of an abstract
    DeepSeekModel in that format (bf16 params, fp32 router; fp8: e4m3 projections and fp32 scales). Catches a
    projection the planner forgets or prices in the wrong format (e.g. the MTP block's, or wkv_b's scales)."""
    import jax
    from flax import nnx
    from micro_configs import MICRO_V3

    from models import DeepSeekModel

    cfg = MICRO_V3.replace(hidden_size=160)  # a width past one 128-block: partial scale blocks in both dims
    model = nnx.eval_shape(
        lambda: DeepSeekModel(
            cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, weights=weights.replace("bf16", "") or None
        )
    )
    want = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    assert weight_bytes(cfg, weights) == want


def test_weight_bytes_per_device_split_the_routed_experts_over_expert():
    """Two expert ranks hold half of every routed expert (58 MoE layers + the MTP block's, 256 experts of
    3 x 2048 x 7168 values) and all the rest: the difference is half the experts' bytes."""
    experts = 59 * 256 * 3 * 2048 * 7168
    assert weight_bytes(V3, "bf16") - weight_bytes(V3, "bf16", expert=2) == experts * 2 // 2
    scales = 59 * 256 * 3 * 16 * 56  # one fp32 per 128 x 128 block of each [2048, 7168] expert matrix
    assert weight_bytes(V3, "fp8") - weight_bytes(V3, "fp8", expert=2) == (experts + 4 * scales) // 2


def test_cli_weights_names_the_mesh_that_holds_v3_in_fp8(capsys):
    """V3 in FP8 (685 GB, the release's 688.6 GB less the MTP layer's copies of the embedding and head)
    fits 8 H200s, in bf16 it needs 16; the line says how much room is left for the cache."""
    assert main(["--weights", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "weights: fp8 (projections e4m3 + fp32 scale per 128x128 block" in out
    assert "smallest mesh that holds the fp8 weights: 8 device(s), expert=1 tensor=8:" in out
    assert "tokens of bf16 latent cache (71,424 B a token over 62 layers)" in out
    assert main(["--weights", "bf16"]) == 0
    assert "smallest mesh that holds the bf16 weights: 16 device(s)" in capsys.readouterr().out
    assert round(weight_bytes(V3, "fp8") / 1e9, 1) == 685.1
