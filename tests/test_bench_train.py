"""`mla-bench train` on a CPU: the FLOP count against hand arithmetic, one micro cell end to end, a failing cell."""

import math

import pytest
from micro_configs import MICRO_V3

from benchmarks import bench_train as bt
from mla_jax import ModelConfig


def test_train_flops_of_tiny_by_hand():
    """tiny(): 4 layers (1 dense + 3 MoE, E=8 of which K=2 routed), one MTP module, B=1, T=16. Catches all E
    experts counted instead of K, the shared experts or router left out, the MTP module (its eh_proj, its
    layer, the LM head again, over T-1 positions) left out or given T positions, the backward's 2x dropped,
    and causal attention counted as T^2 or without the MTP layer's."""
    cfg = ModelConfig.tiny()
    # per token (counts checked by hand in test_bench_e2e): attention 63488, dense MLP 3*128*320 = 122880,
    # shared expert = routed expert = 3*128*64 = 24576, router 128*8 = 1024, LM head 264*128 = 33792
    main = 4 * 63488 + 122880 + 3 * (24576 + 1024 + 2 * 24576) + 33792
    mtp = 2 * 128 * 128 + (63488 + 24576 + 1024 + 2 * 24576) + 33792
    assert (main, mtp) == (634880, 204800)
    matmul = 6 * (main * 16 + mtp * 15)
    pair = 2 * 4 * (48 + 32)  # 2 * H * (qk_head_dim + v_head_dim)
    attn = 3 * pair * (4 * 16 * 17 / 2 + 15 * 16 / 2)  # forward + backward, 4 layers at T=16, MTP at 15
    assert matmul + attn == 80655360
    assert bt.train_flops(cfg, 1, 16) == 80655360
    assert bt.active_params(cfg)["total"] == main + mtp


def test_v2_lite_cut_active_params_by_hand():
    """The 4-layer V2-Lite cut of the training issue: 0.54 B matmul parameters a token (of ~2.3 B), so MFU's
    6·N·tokens uses 6 of 64 experts. Catches the wrong layer split (first_k_dense_replace) and E for K."""
    cfg = bt.model_config("v2-lite", 4)
    assert (cfg.num_hidden_layers, cfg.num_moe_layers, cfg.num_mtp_layers) == (4, 3, 0)
    attention = 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048
    expert = 3 * 2048 * 1408
    moe = attention + 2 * expert + 2048 * 64 + 6 * expert
    dense = attention + 3 * 2048 * 10944
    assert bt.active_params(cfg)["total"] == dense + 3 * moe + 102400 * 2048 == 540016640


MICRO = MICRO_V3.replace(vocab_size=64, num_mtp_layers=0)  # D=32, 1 dense + 1 MoE layer (E=4, K=2), H=2


def test_micro_cell_end_to_end(tmp_path, monkeypatch):
    """One cell through `main` (a micro config in place of tiny's, so it compiles in seconds): the CSV row
    has the columns the issue asks for, filled, and the FLOP and MFU columns equal a hand computation from
    the measured step time. Catches a missing or misnamed column, MFU against another peak or per token,
    tok/s from the mean instead of the median's step, and an empty memory_analysis."""
    monkeypatch.setattr(bt, "model_config", lambda name, layers=None: MICRO)
    bt.main(
        [
            "--model",
            "tiny",
            "--batch",
            "2",
            "--seq",
            "8",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--dtype",
            "fp32",
            "--param-dtype",
            "fp32",
            "--out",
            str(tmp_path),
        ]
    )
    import benchmarks as bm

    (row,) = bm.read_csv(str(tmp_path / "train.csv"))
    assert not row["error"], row["error"]
    for col in ("tok_s", "mfu", "peak_gb", "temp_gb", "argument_gb", "output_gb", "compile_s", "step_ms"):
        assert isinstance(row[col], float) and row[col] > 0, (col, row[col])
    assert (row["B"], row["T"], row["tokens"], row["ce_chunk"], row["remat"], row["attn_impl"]) == (
        2,
        8,
        16,
        0,
        "none",
        "xla",
    )
    # hand count: attention wq_a 32*24 + wq_b 24*2*16 + wkv_a 32*24 + wkv_b 16*2*16 + wo 2*8*32 = 3328;
    # dense layer + 3*32*48; MoE layer + shared 3*32*16 + router 32*4 + 2 of 4 experts 2*3*32*16; head 64*32
    active = (3328 + 4608) + (3328 + 1536 + 128 + 3072) + 2048
    flops = 6 * active * 16 + 3 * 2 * (2 * 2 * (16 + 8) * 2 * 8 * 9 / 2)  # + 2 layers of causal attention
    assert flops == 1774080
    assert math.isclose(row["train_tflop"], flops / 1e12, rel_tol=1e-9)
    seconds = row["step_ms"] / 1e3
    assert math.isclose(row["tok_s"], 16 / seconds, rel_tol=1e-6)
    assert math.isclose(row["mfu"], flops / seconds / 790e12, rel_tol=1e-6)
    # the donated state: the outputs alias the arguments, so the peak counts them once
    assert row["alias_gb"] > 0
    assert math.isclose(
        row["peak_gb"], row["argument_gb"] + row["output_gb"] + row["temp_gb"] - row["alias_gb"], rel_tol=1e-6
    )


def test_a_failing_cell_is_a_row_after_the_earlier_ones_and_fails_the_run(tmp_path, monkeypatch):
    """train.csv gathers cells run after run: a cell that fails (out of memory) is appended after the earlier
    run's row with its error, and the run exits with one line and status 1 (it exited 0: a script sweeping cells
    saw no failure)."""
    import benchmarks as bm

    done = dict(
        model="tiny", layers=4, B=1, T=8, remat="none", ce_chunk=0, attn_q_block=0, attn_impl="xla", moe_impl="auto"
    )
    done.update(step_ms=2.0, tok_s=4000.0, mfu=0.1, peak_gb=0.01, compile_s=1.0)
    outcomes = iter([done, RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.0GiB.\nmore")])

    def cell(args):
        out = next(outcomes)
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(bt, "run_cell", cell)
    argv = ["--model", "tiny", "--batch", "1", "--seq", "8", "--out", str(tmp_path)]
    bt.main(argv)
    with pytest.raises(SystemExit) as exc:
        bt.main(argv)
    msg = exc.value.code
    assert isinstance(msg, str) and "\n" not in msg, msg
    assert msg.startswith("train: error: 1 of 1 rows failed (the first, tiny L4 1x8 remat=none: RuntimeError"), msg
    rows = bm.read_csv(str(tmp_path / "train.csv"))
    assert [(r["step_ms"], r["error"][:32]) for r in rows] == [(2.0, ""), ("", "RuntimeError: RESOURCE_EXHAUSTED")]
