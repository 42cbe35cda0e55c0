"""`mla-bench e2e` on a CPU: the counting functions against hand arithmetic, the quantized formats' plumbing,
the flags, the worker subprocess. The tiny cell end to end (bf16, on one device and on a mesh) runs in the
8-device sharding subprocess (`tests/test_sharding.py::test_bench_e2e_runs_a_tiny_cell_on_one_device_and_on_a_mesh`)."""

import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks import bench_e2e as e2e
from mla_jax import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ModelConfig.tiny()  # V=264 D=128 F=320 I=64, 4 layers (1 dense), H=4 Q=64 L=64 N=32 R=16 Vd=32, E=8 K=2


def test_param_counts_of_tiny_by_hand():
    c = e2e.param_counts(TINY)
    # wq_a 128*64 + wq_b 64*4*48 + wkv_a 128*80 + wkv_b 64*4*64 + wo 4*32*128
    assert c["attention"] == 8192 + 12288 + 10240 + 16384 + 16384 == 63488
    assert c["layer_norms"] == 2 * 128 + 64 + 64
    assert c["dense_mlp"] == 3 * 128 * 320
    assert c["shared"] == c["expert"] == 3 * 128 * 64
    assert c["router"] == 128 * 8 and c["lm_head"] == c["embedding"] == 264 * 128


def test_decode_floor_of_tiny_by_hand():
    # B=1: one token picks K=2 of the 8 experts, so 8 * (1 - 6/8) = 2 are read.
    assert e2e.expected_experts_touched(TINY, 1) == 2.0
    dense_layer = (63488 + 384) * 2 + 122880 * 2  # attention + norms, dense MLP
    moe_layer = (63488 + 384) * 2 + 24576 * 2 + 1024 * 4 + 2 * 24576 * 2  # + shared, fp32 router, 2 experts
    head = 33792 * 2 + 128 * 2 + 1 * 128 * 2  # LM head, final norm, 1 embedding row
    kv = 1 * 20 * 80 * 2 * 4  # 20 cached tokens, 80 values, 4 layers
    assert dense_layer + 3 * moe_layer + head + kv == 1292288
    assert e2e.decode_floor_bytes(TINY, 1, 20) == 1292288
    # B=4: 8 * (1 - 0.75^4) = 5.46875 experts; the KV grows with B * context.
    assert e2e.expected_experts_touched(TINY, 4) == 5.46875
    moe4 = (63488 + 384) * 2 + 24576 * 2 + 1024 * 4 + 5.46875 * 24576 * 2
    head4 = 33792 * 2 + 128 * 2 + 4 * 128 * 2
    assert e2e.decode_floor_bytes(TINY, 4, 30.5) == dense_layer + 3 * moe4 + head4 + 4 * 30.5 * 160 * 4


def test_decode_floor_of_v2_lite_matches_the_issue():
    cfg = ModelConfig.deepseek_v2_lite()
    # ~4.9 GB a step at batch 1 (1K context), and about 61 of the 64 experts touched at batch 32.
    assert 4.85e9 < e2e.decode_floor_bytes(cfg, 1, 1088) < 5.0e9
    assert 61.0 < e2e.expected_experts_touched(cfg, 32) < 61.5
    # the KV part: 27 layers * 576 * 2 B a token
    assert e2e.decode_floor_bytes(cfg, 8, 2000) - e2e.decode_floor_bytes(cfg, 8, 1000) == 8 * 1000 * 27 * 1152
    assert abs(e2e.total_params(cfg) / 1e9 - 15.706) < 1e-3


def test_prefill_flops_of_tiny_by_hand():
    # attention x4 layers, one dense MLP, 3 MoE layers x (shared + router + 2 routed experts)
    per_token = 4 * 63488 + 122880 + 3 * (24576 + 1024 + 2 * 24576)
    attn = 2 * 4 * 4 * (48 + 32) * (16 * 17 / 2)  # layers * H * (qk + v) * causal pairs
    expected = 2 * per_token * 16 + 2 * 33792 + attn
    assert expected == 19650560
    assert e2e.prefill_flops(TINY, 1, 16) == expected
    assert e2e.prefill_flops(TINY, 3, 16) == 2 * per_token * 48 + 3 * 2 * 33792 + 3 * attn


def test_derive_fills_the_ratio_columns():
    row = dict(B=1, prompt=16, new_tokens=4, prefill_s=0.5, decode_ms_step=2.0)
    e2e.derive(row, TINY, dict(matmul_tflops=1.0, bandwidth_gbps=100.0))
    assert row["prefill_tok_s"] == 32 and row["prefill_mfu"] == pytest.approx(19650560 / 0.5 / 1e12)
    assert row["floor_ms"] == pytest.approx(e2e.decode_floor_bytes(TINY, 1, 18) / 1e11 * 1e3)
    assert row["x_floor"] == pytest.approx(2.0 / row["floor_ms"])


def test_cells_parse_and_group_into_worker_segments():
    cells = e2e.parse_cells("v2-lite:1x1024,8x1024;v3-cut:1x1024;v2-lite:1x8192")
    assert cells == [("v2-lite", 1, 1024), ("v2-lite", 8, 1024), ("v3-cut", 1, 1024), ("v2-lite", 1, 8192)]
    assert [len(s) for s in e2e.segments(cells)] == [2, 1, 1]
    assert e2e.parse_cells(e2e.format_cells(cells)) == cells
    assert e2e.kv_pages(ModelConfig.deepseek_v2_lite(), 8, 1024, 128) == 8 * 18  # ceil(1152 / 64)
    assert e2e.kv_pages(e2e.model_config("v3-cut"), 1, 1024, 128) == 19  # + 3 draft rows


def test_full_models_on_a_cpu_are_a_one_line_error(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "e2e", "--quick", "--no-hf", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == e2e.EXIT_NO_GPU
    assert "timing needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr


def test_decode_floor_reads_the_planners_fp8_bytes():
    """The KV part of the floor is sum(seq_lens) * layers * the planner's bytes a token: 656 in fp8
    (512 e4m3 + 4 fp32 scales + 64 bf16 rope), by hand; the weights part does not change."""
    cfg = ModelConfig.deepseek_v2_lite()
    fp8 = e2e.decode_floor_bytes(cfg, 8, 2000, kv_dtype="fp8") - e2e.decode_floor_bytes(cfg, 8, 1000, kv_dtype="fp8")
    assert fp8 == 8 * 1000 * 27 * (512 + 16 + 128)
    assert e2e.decode_floor_bytes(cfg, 1, 1, kv_dtype="fp8") - 27 * 656 == e2e.decode_floor_bytes(cfg, 1, 1) - 27 * 1152


def test_decode_floor_of_fp8_weights_by_hand():
    """--weights fp8: the attention projections, the dense MLP and the shared and routed experts cost 1 byte a
    weight + 4 bytes per 128x128 block; norms, router, LM head and embedding rows stay 2 bytes (tiny, B=1)."""
    q = 1 + 4 / 16384
    dense_layer = 63488 * q + 384 * 2 + 122880 * q
    moe_layer = 63488 * q + 384 * 2 + 24576 * q + 1024 * 4 + 2 * 24576 * q
    head = 33792 * 2 + 128 * 2 + 1 * 128 * 2
    kv = 1 * 20 * 80 * 2 * 4
    got = e2e.decode_floor_bytes(TINY, 1, 20, weights="fp8")
    assert got == pytest.approx(dense_layer + 3 * moe_layer + head + kv, rel=1e-12)
    cfg = e2e.model_config("v3-cut")  # 5 layers: the bf16 LM head (1.9 GB) is a quarter of its floor
    assert 0.6 < e2e.decode_floor_bytes(cfg, 1, 1088, weights="fp8") / e2e.decode_floor_bytes(cfg, 1, 1088) < 0.65


def test_layers_cut_every_model():
    """`--layers` cuts V2-Lite as it cuts the V3 cut (a cut that was silently ignored made `mla-bench serve --layers
    4` serve all 27 layers), keeping at least one MoE layer."""
    assert e2e.model_config("v2-lite").num_hidden_layers == 27
    four = e2e.model_config("v2-lite", layers=4)
    assert (four.num_hidden_layers, four.first_k_dense_replace, four.num_moe_layers) == (4, 1, 3)
    one = e2e.model_config("v2-lite", layers=1)
    assert (one.num_hidden_layers, one.num_moe_layers) == (1, 1)
    assert e2e.model_config("v3-cut", layers=2).num_moe_layers == 1


def test_random_fp8_model_has_the_fp8_layout_and_the_inits_spread():
    """`--weights fp8` builds the FP8 model without an fp32 copy of its weights: every FP8 weight e4m3 in its
    module's shape, its scales std / 16, the dequantized spread the dense init's (std 0.02), the rest dense."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mla_jax import fp8_weights

    cfg = e2e.model_config("v3-cut", config="tiny", layers=2)
    model, _ = e2e.build_model(cfg, jnp.bfloat16, weights="fp8")
    want = nnx.eval_shape(
        lambda: e2e.DeepSeekModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, weights="fp8")
    )
    got_leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    want_leaves = jax.tree_util.tree_leaves_with_path(nnx.state(want))
    assert [(p, v.shape, v.dtype) for p, v in got_leaves] == [(p, v.shape, v.dtype) for p, v in want_leaves]
    experts = model.moe_layers.mlp.experts
    w = np.asarray(fp8_weights.dequantize_blocks(experts.gate_proj_fp8[...], experts.gate_proj_scale_inv[...]))
    assert np.isfinite(w).all() and abs(w.std() / cfg.initializer_range - 1) < 0.05
    assert np.all(np.asarray(experts.gate_proj_scale_inv[...]) == np.float32(cfg.initializer_range / 16))
    assert (
        model.embed_tokens.embedding[...].dtype == jnp.bfloat16 and float(model.embed_tokens.embedding[...].std()) > 0
    )
    with pytest.raises(ValueError, match="one device"):
        e2e.build_model(cfg, jnp.bfloat16, mesh=object(), weights="fp8")


@pytest.mark.parametrize("fmt, token_bytes, latent", [("fp8", 512 + 16 + 128, 128), ("fp4", 256 + 32 + 128, 64)])
def test_quantized_formats_plumb_through_the_e2e_bench(fmt, token_bytes, latent):
    """--kv-dtype fp8 / fp4: the floor reads the format's bytes a token (fp8: 512 e4m3 + 4 fp32 scales +
    64 bf16 rope; fp4: 256 packed e2m1 + 32 e4m3 scales + 64 bf16 rope; by hand), the engine gets the
    format's name (not a jnp dtype), and the tiny model's latent is one the format stores (fp8 widens
    it to 128, a scale block; fp4 keeps 64, a multiple of 32). Guards the format turned into a jnp dtype
    or another format's bytes on the way to the engine / the floor. The engine on those pages:
    tests/test_engine.py, `mla-generate --kv-dtype fp8` (tests/test_generate_cli.py); the bench's tiny
    cell end to end: tests/test_sharding.py (bf16)."""
    cfg = ModelConfig.deepseek_v2_lite()
    assert (
        e2e.decode_floor_bytes(cfg, 1, 1, kv_dtype=fmt) - 27 * token_bytes
        == e2e.decode_floor_bytes(cfg, 1, 1) - 27 * 1152
    )
    assert e2e.kv_dtype_arg(fmt) == fmt
    tiny = e2e.model_config("v2-lite", config="tiny", layers=1, kv_dtype=fmt)
    assert tiny.kv_lora_rank == latent
    from pallas_kernels import resolve_page_format

    assert (
        resolve_page_format(e2e.kv_dtype_arg(fmt), value_dim=tiny.latent_dim, rope_dim=tiny.qk_rope_head_dim).name
        == fmt
    )


def test_mesh_flags_and_token_agreement():
    """`--mesh` values: "1" is one device, specs parse in order, a repeat or a bad spec is one line (exit 2
    with the flag named); agreement counts each request up to its first difference (a later match is not
    agreement: the contexts differ from there). Catches a label collision between meshes (rows of two
    layouts under one impl) and an agreement that counts positions after a divergence."""
    assert e2e.parse_meshes(None) == [None]
    assert e2e.parse_meshes(["1", "tensor=2", "data=2,expert=2"]) == [None, {"tensor": 2}, {"data": 2, "expert": 2}]
    assert [e2e.mesh_label(m) for m in e2e.parse_meshes(["1", "data=2,expert=2"])] == ["ours", "ours@data=2,expert=2"]
    with pytest.raises(ValueError, match="mesh 'tensor=2' is given twice"):
        e2e.parse_meshes(["tensor=2", "tensor=2"])
    with pytest.raises(SystemExit, match=r"^e2e: error: --mesh: mesh spec 'data2': 'data2' is not axis=size"):
        e2e.main(["--mesh", "data2", "--config", "tiny"])
    assert e2e.token_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == 4 / 6
    assert e2e.token_agreement([[1, 2]], [[1, 2, 3]]) == 2 / 3


def _args(*argv):
    return e2e.parser().parse_args(list(argv))


def test_tiny_config_cells_fit_the_tiny_models_context():
    """`mla-bench e2e --config tiny` ran the full grid (2 models x B 1..128 x 1024- and 8192-token prompts, 16
    cells, 128 new tokens): it did not finish in 200 s on a CPU, and its 8192-token cells failed in the engine's
    pool planner with "context_len=8320 exceeds the model's max_position_embeddings=2048". Its default cells now
    come from the tiny models' context (TINY_CELLS; the planner that refused them accepts every one), an
    explicit --batch / --prompt / --cells still wins, and the full grid is unchanged."""
    args = _args("--config", "tiny")
    cells = e2e.grid(args)
    assert cells == [("v2-lite", 1, 256), ("v2-lite", 4, 1024), ("v3-cut", 1, 256)]
    for name, b, t in cells:
        cfg = e2e.model_config(name, config="tiny")
        assert e2e.kv_pages(cfg, b, t, args.new_tokens) == b * -(-(t + args.new_tokens + 3 * cfg.num_mtp_layers) // 64)
    assert e2e.grid(_args("--config", "tiny", "--quick", "--model", "v3-cut")) == [("v3-cut", 1, 256)]
    assert e2e.grid(_args("--config", "tiny", "--new-tokens", "1900", "--model", "v3-cut")) == [("v3-cut", 1, 145)]
    assert e2e.grid(_args("--config", "tiny", "--batch", "2", "--prompt", "16", "--model", "v2-lite")) == [
        ("v2-lite", 2, 16)
    ]
    full = e2e.grid(_args())
    assert len(full) == 16 and full[0] == ("v2-lite", 1, 1024) and full[-1] == ("v3-cut", 128, 8192)
    assert e2e.grid(_args("--quick")) == e2e.QUICK_CELLS
    assert "v2-lite B=1 at 1/8 of the context" in " ".join(e2e.parser().format_help().split())  # --help says


def test_tiny_config_runs_its_cells_in_one_worker(tmp_path, monkeypatch):
    """The driver started a worker process per model (for a clean GPU): on a CPU each start cost seconds of
    imports and an eager model build. With --config tiny one worker gets every cell, both models'."""
    calls = []
    monkeypatch.setattr(e2e, "run_worker", lambda args, argv, kind, cells, extra, deadline: calls.append(cells) or 0)
    monkeypatch.setattr(e2e, "report", lambda csv_path, out_dir: [])
    e2e.drive(_args("--config", "tiny", "--no-hf", "--out", str(tmp_path)), [])
    assert calls == ["v2-lite:1x256,4x1024;v3-cut:1x256"]
    calls.clear()
    e2e.drive(_args("--no-hf", "--quick", "--out", str(tmp_path)), [])
    assert calls == ["v2-lite:1x1024,8x1024,32x1024,128x1024", "v3-cut:1x1024,8x1024", "v2-lite:1x8192,8x8192"]


def test_ragged_prompts_are_drawn_once_per_cell():
    """--ragged: B lengths uniform in [T // 16, T], the same draw for a cell every time (ours and any rerun see
    the same batch), each prompt a prefix of the fixed cell's row; without it, T each and the rows unchanged."""
    assert e2e.prompt_lengths(4, 1024) == [1024] * 4
    lens = e2e.prompt_lengths(32, 1024, ragged=True, seed=3)
    assert lens == e2e.prompt_lengths(32, 1024, ragged=True, seed=3)
    assert all(64 <= n <= 1024 for n in lens) and len(set(lens)) > 16
    assert lens != e2e.prompt_lengths(32, 1024, ragged=True, seed=4)
    fixed = e2e.make_prompts(50, 32, 1024, 3)
    ragged = e2e.make_prompts(50, 32, 1024, 3, ragged=True)
    assert [len(p) for p in ragged] == lens and all(r == f[: len(r)] for r, f in zip(ragged, fixed))
    assert e2e.lengths_label(1024, True) == "uniform 64-1024" and e2e.lengths_label(1024, False) == "fixed"
    assert e2e.prompt_lengths(3, 10, ragged=True) and min(e2e.prompt_lengths(8, 10, ragged=True)) >= 1


def test_derive_counts_a_ragged_cells_rows():
    """A ragged row's prefill FLOPs are its rows' (a long and a short prompt: not B times the longest's), its
    prefill tok/s counts the tokens it prefilled, and its decode floor the mean context (B · mean = the lengths'
    sum). Catches the ragged cell counted as B prompts of T."""
    row = dict(B=2, prompt=1024, new_tokens=8, prompt_lens=[1024, 100], prefill_s=0.5, decode_ms_step=1.0)
    ceil = dict(bandwidth_gbps=1000.0, matmul_tflops=100.0)
    got = e2e.derive(dict(row), TINY, ceil)
    want = e2e.prefill_flops(TINY, 1, 1024) + e2e.prefill_flops(TINY, 1, 100)
    assert got["prefill_gflop"] == pytest.approx(want / 1e9, rel=1e-12)
    assert got["prefill_gflop"] < e2e.prefill_flops(TINY, 2, 1024) / 1e9
    assert got["prefill_tok_s"] == pytest.approx(1124 / 0.5)
    floor = e2e.decode_floor_bytes(TINY, 2, 562 + 4)
    assert got["floor_gb"] == pytest.approx(floor / 1e9, rel=1e-12)
    fixed = e2e.derive(dict(row, prompt_lens=None), TINY, ceil)  # a fixed cell: as before
    assert fixed["prefill_gflop"] == pytest.approx(e2e.prefill_flops(TINY, 2, 1024) / 1e9, rel=1e-12)


def test_prefill_time_counts_the_mixed_steps():
    """A ragged cell's prompt tokens partly run in mixed steps: their time counts as prefill time (the bug: a
    ragged V2-Lite cell at 203 % prefill MFU), and a cell without mixed steps keeps its prefill steps' time."""
    assert e2e.warm_prefill_seconds(dict(prefill_s=0.4, mixed_s=0.3)) == pytest.approx(0.7)
    assert e2e.warm_prefill_seconds(dict(prefill_s=0.4, mixed_s=0.0)) == pytest.approx(0.4)


def test_tiny_config_cell_end_to_end(tmp_path):
    """`mla-bench e2e --config tiny` with one model (v3-cut: one cell, 256 tokens = 1/8 of its context; 4 new
    tokens, one layer), in this process: the row the full run's cells give, no error. Its 8192-token cell failed
    ("context_len=8320 exceeds ... 2048"). The full three-cell run (README) is timed by hand. Run with --ragged
    (the cell's prompt drawn shorter, the row saying so; `sharding_cases.py` runs the fixed cells' path)."""
    argv = ["--config", "tiny", "--model", "v3-cut", "--layers", "1", "--new-tokens", "4", "--no-hf", "--in-process"]
    rows = e2e.main(argv + ["--ragged", "--out", str(tmp_path)])
    assert [(r["model"], r["B"], r["prompt"], r["new_tokens"], r["error"]) for r in rows] == [("v3-cut", 1, 256, 4, "")]
    assert rows[0]["decode_steps"] == 3 and rows[0]["same_tokens"] is True
    assert rows[0]["lengths"] == "uniform 16-256"
    assert float(rows[0]["prompt_mean"]) == e2e.prompt_lengths(1, 256, ragged=True)[0] < 256


def test_a_cell_that_fails_late_keeps_the_rows_before_and_fails_the_run(tmp_path, monkeypatch):
    """`mla-bench e2e` whose second cell fails (out of memory): e2e.csv holds the first cell's figures and the
    second's row with its error, and the run exits with one line naming the cell, status 1 (it exited 0, so a
    script running the benchmark saw no failure)."""
    import benchmarks as bm
    from benchmarks import e2e_ours

    calls = []

    def cell(model, cfg, name, b, t, args, ceil, **kw):
        calls.append(t)
        if len(calls) == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.\nthe details")
        return dict(model=name, impl="ours", B=b, prompt=t, new_tokens=args.new_tokens, decode_ms_step=1.5)

    monkeypatch.setattr(e2e_ours, "run_cell", cell)
    argv = ["--config", "tiny", "--cells", "v3-cut:1x16,1x32", "--layers", "1", "--new-tokens", "4", "--no-hf"]
    with pytest.raises(SystemExit) as exc:
        e2e.main(argv + ["--in-process", "--out", str(tmp_path)])
    msg = exc.value.code
    assert isinstance(msg, str) and "\n" not in msg, msg
    assert msg.startswith(
        "e2e: error: 1 of 2 rows failed (the first, v3-cut ours B=1 prompt=32: RuntimeError: RESOURCE_EXHAUSTED"
    ), msg
    rows = bm.read_csv(str(tmp_path / "e2e.csv"))
    assert [(r["prompt"], r["decode_ms_step"], r["error"][:32]) for r in rows] == [
        (16, 1.5, ""),
        (32, "", "RuntimeError: RESOURCE_EXHAUSTED"),
    ]


def test_a_worker_stopped_by_the_time_budget_cuts_its_cells_not_fails_them(tmp_path, monkeypatch):
    """`mla-bench e2e --quick --time-budget 270 --cell-grace 40` on an H200: the B = 128 cell was still running
    when the budget's grace ran out; the driver stopped its worker as asked, then wrote the cell as an error
    ("worker exited with code 124") and the run ended with status 1. A cell cut by the budget is a row noted
    "cut by the time budget"; a worker that dies on its own is still an error."""
    import benchmarks as bm

    def stopped(cmd, env=None, timeout=None):
        assert timeout is not None  # a budget gives the worker a deadline
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(e2e.subprocess, "run", stopped)
    budget = ("--no-hf", "--time-budget", "100", "--out", str(tmp_path))
    rows = e2e.drive(_args("--cells", "v2-lite:1x1024,8x1024", *budget), [])
    assert [(r["B"], r["error"], r["note"]) for r in rows] == [
        (b, "", "cut by the time budget (its worker stopped 300 s past it)") for b in (1, 8)
    ]
    monkeypatch.setattr(e2e.subprocess, "run", lambda cmd, env=None, timeout=None: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(SystemExit, match="worker exited with code 1 before this cell"):
        e2e.drive(_args("--cells", "v2-lite:1x1024", *budget), [])
    assert bm.read_csv(str(tmp_path / "e2e.csv"))[0]["note"] == ""


def test_a_model_whose_weights_exceed_the_device_is_skipped_not_failed(tmp_path, monkeypatch):
    """`mla-bench e2e` over a model whose bf16 weights alone exceed the device's planned share (here a device of
    1 MiB; the V3 cut in bf16 on an 80 GB card): its cells are rows noted "skipped (the bf16 weights need ...)",
    as the peer's cells that do not fit, nothing is built and the run exits normally (the README's `--quick` on
    an H100 ended with status 1 on those rows)."""
    from benchmarks import e2e_models

    monkeypatch.setattr(e2e_models, "device_bytes_limit", lambda *a: 1 << 20)
    monkeypatch.setattr(e2e_models, "DeepSeekModel", None)  # building anything fails the test
    argv = ["--config", "tiny", "--cells", "v3-cut:1x16,2x16", "--layers", "1", "--dtype", "bf16", "--no-hf"]
    rows = e2e.main(argv + ["--in-process", "--out", str(tmp_path)])
    skipped = "skipped (the bf16 weights need "
    assert [(r["B"], r["error"], r["note"][: len(skipped)]) for r in rows] == [(1, "", skipped), (2, "", skipped)]
    assert "the device offers 0.9 MiB" in rows[0]["note"]


def test_small_figures_keep_their_digits(tmp_path, capsys):
    """Guards: `mla-bench e2e --config tiny` printed `building 0.00B parameters` (the tiny model's 1.43M) and
    `bf16 matmul 0 TFLOP/s` (a CPU's fraction of one) beside a prefill MFU of 20.8 % computed from it."""
    import benchmarks as bm
    from benchmarks import e2e_cells, e2e_report

    assert bm.count(e2e.total_params(TINY)) == "1.43M"  # 1 431 936
    assert bm.count(e2e.total_params(ModelConfig.deepseek_v2_lite())) == "15.7B"
    assert [bm.figure(x) for x in (0.2873, 12.34, 789.6)] == ["0.287", "12.3", "790"]
    e2e_cells.write_meta(str(tmp_path), dict(ceilings=dict(bandwidth_gbps=21.4, matmul_tflops=0.2873)))
    e2e_report.report(str(tmp_path / "none.csv"), str(tmp_path))
    assert "bf16 matmul 0.287 TFLOP/s" in capsys.readouterr().out
