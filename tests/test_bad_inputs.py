"""Every bad input ends in one clear error: a `ValueError` naming the input and the limit from the
API, one line `prog: error: ...` and a non-zero exit from the command-line tools, no traceback,
nothing written. One parametrised test per row of docs/ERRORS.md; each param id names the bug it
guards (what happened before the fix).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from models.builtin import BUILTIN_DIR
from pallas_kernels import (
    BF16_PAGES,
    FP4_PAGES,
    FP8_PAGES,
    PageFormat,
    backend,
    mla_decode,
    mla_decode_problems,
    mla_decode_reference,
    paged_gather,
    paged_gather_reference,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(BUILTIN_DIR, "config.json")) as _f:
    BUILTIN_CONFIG = json.load(_f)

# ------------------------------------------------------------------------------------------------
# Kernels: block tables and lengths (pallas_kernels.mla_decode / paged_gather and references)
# ------------------------------------------------------------------------------------------------
NUM_PAGES = 4


def _decode_inputs(table, lens):
    q = jnp.zeros((len(lens), 1, 16, 576), jnp.bfloat16)
    kv = jnp.ones((NUM_PAGES, 64, 576), jnp.bfloat16)
    return q, kv, jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32)


def _decode(impl):
    return lambda q, kv, bt, sl, **kw: mla_decode(q, kv, bt, sl, softmax_scale=0.1, impl=impl, **kw)


def _decode_ref(q, kv, bt, sl, **kw):
    return mla_decode_reference(q, kv, bt, sl, softmax_scale=0.1, **kw)


def _gather(impl):
    # num_tokens = the largest length: every row reads that many pages.
    return lambda q, kv, bt, sl, **kw: paged_gather(kv, bt, num_tokens=int(max(sl)), impl=impl, **kw)


def _gather_ref(q, kv, bt, sl, **kw):
    return paged_gather_reference(kv, bt, num_tokens=int(max(sl)), **kw)


KERNEL_FNS = {
    "mla_decode[interpret]": _decode("interpret"),
    "mla_decode[reference]": _decode("reference"),
    "mla_decode_reference": _decode_ref,
    "paged_gather[interpret]": _gather("interpret"),
    "paged_gather_reference": _gather_ref,
}

# (table, lengths, message); the id says what happened before the fix.
BAD_TABLES = [
    pytest.param(
        [[0, 1], [2, 4]],
        [10, 100],
        r"block_table\[1, 1\] = 4 is not a page id: kv_pages has 4 pages "
        r"\(ids 0\.\.3\)",
        id="page-id-past-pool-read-the-last-page-silently",
    ),
    pytest.param(
        [[0, 1], [-1, 3]],
        [10, 100],
        r"block_table\[1, 0\] = -1 is not a page id",
        id="negative-page-id-wrapped-to-the-last-page",
    ),
    pytest.param(
        [[0, 1], [2, 3]],
        [10, 129],
        r"seq_lens\[1\] = 129 is outside \[0, 128\]: the block table "
        r"holds 2 pages of 64 tokens",
        id="seq-len-past-the-table-was-clipped",
    ),
]


@pytest.mark.parametrize("fn", KERNEL_FNS.values(), ids=KERNEL_FNS.keys())
@pytest.mark.parametrize("table,lens,match", BAD_TABLES)
def test_kernel_block_table_and_lengths(fn, table, lens, match):
    if fn in (KERNEL_FNS["paged_gather[interpret]"], KERNEL_FNS["paged_gather_reference"]) and "seq_lens" in match:
        match = r"num_tokens must be in \[1, 128\]"  # one length for every row: a static argument
    with pytest.raises(ValueError, match=match):
        fn(*_decode_inputs(table, lens))


def test_kernel_negative_seq_len():
    """seq_lens < 0 was accepted (every key masked)."""
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = -1 is outside \[0, 128\]"):
        _decode_ref(*_decode_inputs([[0, 1]], [-1]))


def test_kernel_unread_entries_may_hold_anything():
    """Entries past cdiv(seq_len, 64) are never read: garbage there is no error (as documented)."""
    args = _decode_inputs([[0, 99], [2, -5]], [64, 0])
    out, lse = _decode_ref(*args)
    assert out.shape == (2, 1, 16, 512) and np.isneginf(np.asarray(lse[1])).all()
    assert paged_gather_reference(args[1], args[2][:1], num_tokens=64).shape == (1, 64, 576)


CHECKED_FNS = {
    "mla_decode[interpret]": lambda q, kv, bt, sl: mla_decode(
        q, kv, bt, sl, softmax_scale=0.1, impl="interpret", checked=True
    ),
    "mla_decode_reference": lambda q, kv, bt, sl: _decode_ref(q, kv, bt, sl, checked=True),
    "paged_gather[interpret]": lambda q, kv, bt, sl: paged_gather(
        kv, bt, num_tokens=100, impl="interpret", checked=True
    ),
}


@pytest.mark.parametrize("fn", CHECKED_FNS.values(), ids=CHECKED_FNS.keys())
def test_kernel_checked_mode_under_jit(fn):
    """Under jax.jit the table is traced and cannot raise: `checked=True` + checkify reports the
    same message (before: nothing, the reference read the last page)."""
    q, kv, bt, sl = _decode_inputs([[0, 1], [2, 4]], [10, 100])
    run = checkify.checkify(jax.jit(fn))
    err, _ = run(q, kv, bt, sl)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 4 is not a page id"):
        err.throw()
    err, _ = run(q, kv, bt.at[1, 1].set(3), sl)
    assert err.get() is None
    # Traced without checked=True: no check and no cost (the documented contract).
    jax.jit(_decode_ref)(q, kv, bt, sl)


def test_kernel_checked_mode_seq_lens():
    q, kv, bt, sl = _decode_inputs([[0, 1]], [200])
    err, _ = checkify.checkify(jax.jit(lambda *a: _decode_ref(*a, checked=True)))(q, kv, bt, sl)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 200 is outside \[0, 128\]"):
        err.throw()


@pytest.mark.parametrize(
    "args,problems",
    [
        pytest.param((128, 64, BF16_PAGES), [], id="supported"),
        pytest.param((16, 64, FP8_PAGES, 4), [], id="fp8-verify"),
        pytest.param(
            (8, 64, BF16_PAGES), [r"heads = 8 \(the decode kernel supports H in \(16, 32, 64, 128\)\)"], id="heads"
        ),
        pytest.param(
            (16, 32, PageFormat("fp32", latent_dim=128, rope_dim=64)),
            [
                r"page_size = 32 \(the decode kernel reads 64-token pages\)",
                r"128 latent \+ 64 rope values a token \(the decode kernel reads 512 \+ 64\)",
                r"page format fp32 \(the decode kernel reads bf16, fp8 pages\)",
            ],
            id="page-widths-format",
        ),
        pytest.param((16, 64, FP4_PAGES), [r"page format fp4 \(the decode kernel reads bf16, fp8 pages\)"], id="fp4"),
        pytest.param((16, 64, BF16_PAGES, 5), [r"s_q = 5 \(the decode kernel takes 1 to 4"], id="query-len"),
    ],
)
def test_mla_decode_problems(args, problems):
    """One function says what the decode kernel serves (the engine and the model's layer ask it; they copied
    the limits before, and a module flag said whether the fp8 body existed)."""
    got = mla_decode_problems(*args)
    assert len(got) == len(problems), got
    for line, pattern in zip(got, problems):
        assert "\n" not in line
        assert re.search(pattern, line), (pattern, line)


def test_kernels_take_quantized_pages_the_same_way():
    """mla_decode and paged_gather read the same pages the same way (they differed: mla_decode inferred fp8
    from the width, paged_gather refused uint8 pages without page_format=): a format read from the pages'
    dtype and width, or given and checked against them, and one message for pages in no format."""
    from pallas_kernels import quantize_latent_fp8

    rng = np.random.default_rng(0)
    pages = quantize_latent_fp8(jnp.asarray(rng.standard_normal((4, 64, 576)), jnp.float32))
    bt, sl = jnp.asarray([[2, 0]], jnp.int32), jnp.asarray([100], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, 1, 16, 576)), jnp.bfloat16)
    want = paged_gather(pages, bt, num_tokens=100, page_format=FP8_PAGES, impl="reference")
    np.testing.assert_array_equal(np.asarray(paged_gather(pages, bt, num_tokens=100, impl="reference")), want)
    out_given = mla_decode(q, pages, bt, sl, softmax_scale=0.1, page_format=FP8_PAGES, impl="reference")[0]
    out_read = mla_decode(q, pages, bt, sl, softmax_scale=0.1, impl="reference")[0]
    np.testing.assert_array_equal(np.asarray(out_given), np.asarray(out_read))
    odd = jnp.zeros((4, 64, 600), jnp.uint8)
    for call in (
        lambda: paged_gather(odd, bt, num_tokens=100),
        lambda: mla_decode(q, odd, bt, sl, softmax_scale=0.1),
    ):
        with pytest.raises(ValueError, match=r"^uint8 pages of last dim 600 are not fp8 or fp4 pages"):
            call()
    for call in (
        lambda: paged_gather(pages, bt, num_tokens=100, page_format=FP4_PAGES),
        lambda: mla_decode(q, pages, bt, sl, softmax_scale=0.1, page_format=FP4_PAGES),
    ):
        with pytest.raises(ValueError, match=r"^fp4 kv_pages must be \[num_pages, 64, 416\]"):
            call()


# ------------------------------------------------------------------------------------------------
# Page formats and the cache's format (pallas_kernels.page_format, mla_jax.kv_cache, the engine)
# ------------------------------------------------------------------------------------------------
def _fp8_write_float_rows():
    from mla_jax.kv_cache import write_latents

    write_latents(
        jnp.zeros((2, 4, 656), jnp.uint8),
        jnp.zeros((1, 3, 576)),
        jnp.zeros((1, 3), jnp.int32),
        jnp.zeros((1, 1), jnp.int32),
    )


def _cache(dtype, latent_dim=576, rope_dim=64):
    from mla_jax.kv_cache import PagedLatentCache

    return PagedLatentCache(
        num_layers=1,
        num_pages=2,
        page_size=4,
        latent_dim=latent_dim,
        max_seqs=1,
        max_pages_per_seq=2,
        dtype=dtype,
        rope_dim=rope_dim,
    )


def _gather_other_widths():
    from pallas_kernels import FP8_PAGES, paged_gather

    paged_gather(
        jnp.zeros((2, 64, 328), jnp.uint8),
        jnp.zeros((1, 1), jnp.int32),
        num_tokens=4,
        page_format=FP8_PAGES.with_dims(256, 32),
        impl="reference",
    )


@pytest.mark.parametrize(
    "call,match",
    [
        pytest.param(
            lambda: _cache("fp6"),
            r"^page format 'fp6' is unknown; known: bf16, fp16, fp32, fp8, fp4$",
            id="unknown-format-name",
        ),
        pytest.param(
            lambda: _cache("fp4", latent_dim=64, rope_dim=16),
            r"^fp4 pages need latent_dim a positive multiple of 32 \(two halves of 16-value blocks, paired in "
            r"bytes\), got 48$",
            id="fp4-latent",
        ),
        pytest.param(lambda: _cache(jnp.int8), r"^page format int8 is unknown; known: bf16", id="int8-pages"),
        pytest.param(
            lambda: _cache("fp8", latent_dim=80, rope_dim=16),
            r"^fp8 pages need latent_dim a positive multiple of 128 \(one fp32 scale per 128 values\), "
            r"got 64$",
            id="fp8-latent-not-a-multiple-of-128",
        ),
        pytest.param(
            lambda: _cache("fp8", rope_dim=-1), r"^rope_dim must be a non-negative integer, got -1$", id="negative-rope"
        ),
        pytest.param(
            _fp8_write_float_rows,
            r"^uint8 \(fp8 / fp4\) pages take encoded rows \(PageFormat.encode the "
            r"latents first\), got float32 \(1, 3, 576\)$",
            id="float-rows-cast-to-bytes",
        ),
        pytest.param(
            _gather_other_widths,
            r"^paged_gather reads tokens of 512 latent \+ 64 rope values, got 256 \+ 32 "
            r"\(fp8 pages\)$",
            id="gather-other-widths-read-as-576",
        ),
    ],
)
def test_page_format_errors(call, match):
    with pytest.raises(ValueError) as e:
        call()
    assert "\n" not in str(e.value) and re.search(match, str(e.value)), str(e.value)


@pytest.mark.skipif(backend.on_hopper(), reason="checks the refusal off a Hopper GPU")
def test_generate_attention_impl_kernel_without_a_gpu_says_so(capsys):
    """`mla-generate --attention-impl kernel` on a CPU: one line naming the flag and "no Hopper GPU" (it never
    said so; the kernels were tried and failed far from the flag)."""
    from models.serving.cli import main

    line = _one_line_exit_2(main, ["--attention-impl", "kernel", "--max-new-tokens", "2"], capsys, "mla-generate")
    assert line.startswith(
        "mla-generate: error: --attention-impl='kernel': the kernels cannot serve this: no Hopper GPU"
    )


def test_generate_kv_dtype_fp8_on_a_narrow_latent(tmp_path, capsys):
    """`mla-generate --kv-dtype fp8` on a checkpoint whose kv_lora_rank (32) fp8 pages cannot hold."""
    from models.serving.cli import main

    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "hf_v3_tiny")
    for name in os.listdir(fixture):
        if name.endswith((".json", ".safetensors")):
            shutil.copy(os.path.join(fixture, name), tmp_path / name)
    _word_tokenizer(tmp_path, vocab=json.load(open(os.path.join(fixture, "config.json")))["vocab_size"])
    line = _one_line_exit_2(
        main, ["--checkpoint", str(tmp_path), "--prompt", "w1", "--kv-dtype", "fp8"], capsys, "mla-generate"
    )
    assert line == (
        "mla-generate: error: --kv-dtype fp8: fp8 pages need latent_dim a positive multiple of 128 "
        "(one fp32 scale per 128 values), got 32"
    )


@pytest.mark.parametrize(
    "bench,name,known",
    [
        ("mla_decode", "fp4", "'bf16', 'fp8'"),
        ("paged_gather", "fp6", "'bf16', 'fp8', 'fp4'"),
        ("e2e", "fp6", "'bf16', 'fp16', 'fp32', 'fp8', 'fp4'"),
    ],
)
def test_bench_kv_dtype(bench, name, known, capsys):
    """`mla-bench mla_decode --kv-dtype fp4` (the decode kernel has no fp4 body), `paged_gather|e2e --kv-dtype
    fp6` (e2e passed any name through to the engine, which failed in its worker; the others printed
    argparse's usage block); paged_gather and e2e list fp4 among their formats."""
    mod = importlib.import_module(f"benchmarks.bench_{bench}")
    line = _one_line_exit_2(mod.main, ["--kv-dtype", name], capsys, f"python -m benchmarks {bench}")
    assert line.endswith(f"argument --kv-dtype: invalid choice: '{name}' (choose from {known}) (see --help)"), line


@pytest.mark.parametrize(
    "argv,tail",
    [
        pytest.param(
            ["--remat", "dots"],
            "argument --remat: invalid choice: 'dots' (choose from 'none', 'full', "
            "'dots_saveable', 'dots_with_no_batch_dims_saveable')",
            id="remat-unknown-policy",
        ),
        pytest.param(
            ["--ce-chunk", "-8"], "argument --ce-chunk: must be an integer >= 0, got -8", id="ce-chunk-negative"
        ),
        pytest.param(
            ["--ce-chunk", "4k"], "argument --ce-chunk: must be an integer >= 0, got '4k'", id="ce-chunk-text"
        ),
        pytest.param(
            ["--attn-q-block", "-1"],
            "argument --attn-q-block: must be an integer >= 0, got -1",
            id="attn-q-block-negative",
        ),
        pytest.param(
            ["--attn-impl", "flash"],
            "argument --attn-impl: invalid choice: 'flash' (choose from 'auto', 'xla', 'cudnn', 'mgpu')",
            id="attn-impl-unknown",
        ),
        pytest.param(["--batch", "0"], "argument --batch: must be an integer >= 1, got 0", id="batch-0"),
        pytest.param(["--seq", "2"], "argument --seq: must be an integer >= 3, got 2", id="seq-too-short-for-mtp"),
        pytest.param(["--layers", "1"], "argument --layers: must be an integer >= 2, got 1", id="layers-no-moe-layer"),
        pytest.param(
            ["--moe-impl", "fast"],
            "argument --moe-impl: invalid choice: 'fast' (choose from 'auto', 'ragged_dot', 'mgpu', 'dense')",
            id="moe-impl-unknown",
        ),
        pytest.param(
            ["--peak-tflops", "0"],
            "argument --peak-tflops: must be a positive number, got 0.0",
            id="peak-tflops-zero-divides",
        ),
    ],
)
def test_bench_train_flags(argv, tail, capsys):
    """`mla-bench train` with a bad flag value: one line naming the flag and the value, status 2, before any
    model is built (each id names the value that would otherwise reach the model or the MFU division)."""
    from benchmarks import bench_train

    line = _one_line_exit_2(bench_train.main, argv, capsys, "python -m benchmarks train")
    assert line.endswith(tail + " (see --help)"), line


# ------------------------------------------------------------------------------------------------
# Sampling: tiny temperatures and non-finite logits (models.serving.sampling)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("filtered", [False, True], ids=["random", "filtered"])
@pytest.mark.parametrize(
    "temperature",
    [
        pytest.param(1e-10, id="1e-10-gave-NaN-probs-and-NUL-bytes"),
        pytest.param(1e-30, id="1e-30"),
        pytest.param(2e-38, id="smallest-normal-range"),
        pytest.param(1e-40, id="subnormal-is-greedy"),
        pytest.param(1e-300, id="zero-in-fp32-is-greedy"),
    ],
)
def test_sampling_tiny_temperature_is_greedy_and_finite(temperature, filtered):
    from models.serving.sampling import SamplingArrays, SamplingParams, filtered_probs, row_keys, sample_from_probs

    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 300), jnp.float32) * jnp.asarray(
        [[1.0], [30.0], [1e3], [1e-3]]
    )
    s = SamplingArrays.from_params([SamplingParams(temperature=temperature, top_p=0.9 if filtered else 1.0)] * 4)
    probs = jax.jit(filtered_probs, static_argnames="filtered")(logits, s, filtered=filtered)
    probs = np.asarray(probs)
    assert np.isfinite(probs).all() and np.allclose(probs.sum(-1), 1.0)
    keys = row_keys(jnp.broadcast_to(jax.random.PRNGKey(1), (4, 2)), jnp.arange(4))
    tokens = np.asarray(jax.jit(sample_from_probs)(keys, jnp.asarray(probs)))
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), -1))


def test_sampling_finite_rows_flags_nan_and_inf():
    """NaN weights gave NaN logits, and the sampler turned them into token 0 (a NUL byte)."""
    from models.serving.sampling import NonFiniteLogitsError, check_finite_rows, finite_rows

    x = np.zeros((5, 8), np.float32)
    x[1, 3] = np.nan
    x[2, 0] = np.inf
    x[3, :] = -np.inf  # no token left: no distribution
    x[4, :4] = -np.inf  # masked tokens are fine
    ok = np.asarray(jax.jit(finite_rows)(jnp.asarray(x)))
    assert ok.tolist() == [True, False, False, False, True]
    check_finite_rows(ok[[0, 4]])
    with pytest.raises(NonFiniteLogitsError, match=r"NaN or infinite logits for request\(s\) \[7, 8, 9\]"):
        check_finite_rows(ok, requests=[6, 7, 8, 9, 10])
    assert issubclass(NonFiniteLogitsError, ValueError)  # the CLIs' one-line path


def test_greedy_finite_check_from_the_drawn_logit_equals_finite_rows():
    """The greedy steps judge a row by its argmax's own logit (one reduction over the vocabulary, not two): a NaN
    that the argmax passed over (a NaN after a larger finite logit), a +inf, or a row of -inf would slip through
    if the argmax did not pick NaN first, then +inf; rows of [B, k + 1, V] (a verify step) as of [B, V]."""
    from models.serving.sampling import finite_rows
    from models.serving.steps import _finite

    x = np.zeros((6, 8), np.float32)
    x[0, 5] = 3.0  # finite
    x[1, 0], x[1, 6] = 9.0, np.nan  # a NaN after the largest finite logit
    x[2, 2], x[2, 4] = np.inf, np.nan
    x[3, 7] = np.inf
    x[4, :] = -np.inf
    x[5, :3] = -np.inf  # masked tokens are fine
    for logits in (jnp.asarray(x), jnp.asarray(x).reshape(3, 2, 8)):
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        got = np.asarray(jax.jit(_finite, static_argnums=2)(logits, tokens, "greedy")).reshape(-1)
        assert got.tolist() == np.asarray(finite_rows(logits)).reshape(-1).tolist() == [1, 0, 0, 0, 0, 1]


# ------------------------------------------------------------------------------------------------
# Capacity planner (mla_jax.capacity: plan_kv_cache and mla-capacity)
# ------------------------------------------------------------------------------------------------
def _one_line_exit_2(main, argv, capsys, prog, stdout=""):
    """Runs a CLI's main in-process; returns its one error line (asserts exit 2, and that stdout holds
    only `stdout`: nothing, or for errors found while generating, the echoed prompt)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.strip().split("\n") if not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err and out.strip() == stdout.strip(), (out, err)
    return lines[0]


@pytest.mark.parametrize(
    "preset,tp",
    [pytest.param("deepseek_v3", 3, id="tp3-planned-43-of-128-heads"), pytest.param("tiny", 6, id="tp6-of-4-heads")],
)
def test_capacity_tp_must_split_whole_heads(preset, tp):
    from mla_jax import ModelConfig
    from mla_jax.capacity import plan_kv_cache

    cfg = getattr(ModelConfig, preset)()
    with pytest.raises(ValueError, match=rf"tp={tp} does not divide num_attention_heads={cfg.num_attention_heads}"):
        plan_kv_cache(cfg, context_len=1024, tp=tp)
    plan_kv_cache(cfg, context_len=1024, tp=2 * cfg.num_attention_heads)  # a multiple: heads replicated


def test_capacity_cli_tp(capsys):
    """`mla-capacity --tp 3` printed a plan for "43 of 128 heads" and exited 0."""
    from mla_jax.capacity import main

    line = _one_line_exit_2(main, ["--tp", "3"], capsys, "mla-capacity")
    assert "--tp" in line and "tp=3 does not divide num_attention_heads=128" in line


def test_capacity_cli_mtp_on_a_model_without_mtp_layers(capsys):
    """`mla-capacity --mtp` on a model with no MTP layer (V2-Lite) would print a plan that counts none and
    looks like one that does; it is one line naming the flag and the model. (--mtp is new: it counts the
    MTP layers' latent cache, on by default for a model that has them.)"""
    from mla_jax.capacity import main

    line = _one_line_exit_2(main, ["--preset", "deepseek-v2-lite", "--mtp"], capsys, "mla-capacity")
    assert line == (
        "mla-capacity: error: --mtp: deepseek-v2-lite has no MTP layers (num_nextn_predict_layers=0); "
        "drop --mtp (see --help)"
    )


# ------------------------------------------------------------------------------------------------
# Device mesh and sharding (mla_jax.sharding: make_mesh, shard_model)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sizes,match",
    [
        pytest.param(dict(tensor=0), r"^make_mesh: tensor=0 must be an integer >= 1$", id="size-0-IndexError-from-jax"),
        pytest.param(
            dict(expert=2.0), r"^make_mesh: expert=2\.0 must be an integer >= 1$", id="float-size-accepted-as-2"
        ),
        pytest.param(
            dict(data=3),
            r"^make_mesh: data=3 x expert=1 x tensor=1 = 3 devices does not divide the 1 "
            r"devices available$",
            id="more-devices-than-there-are-without-the-axes",
        ),
    ],
)
def test_make_mesh_sizes(sizes, match):
    from mla_jax.sharding import make_mesh

    with pytest.raises(ValueError, match=match):
        make_mesh(**sizes)


def _abstract_micro(**overrides):
    from flax import nnx
    from micro_configs import MICRO_V3

    from models import DeepSeekModel

    return nnx.eval_shape(lambda: DeepSeekModel(MICRO_V3.replace(**overrides), rngs=nnx.Rngs(0)))


# (config overrides, mesh (data, expert, tensor), rules overrides, message); checked before anything moves,
# so an AbstractMesh of any size stands in for the devices.
BAD_SHARDINGS = [
    pytest.param(
        {},
        (1, 8, 1),
        {},
        r"^sharding: parameter moe_layers\.mlp\.experts\.down_proj dim 1 \(experts, size 4\) "
        r"is not divisible by mesh axis expert=8$",
        id="8-way-ep-of-4-experts",
    ),
    pytest.param(
        {},
        (1, 1, 4),
        {},
        r"^sharding: num_attention_heads=2 is not divisible by mesh axis tensor=4: tensor "
        r"parallelism gives every device whole heads$",
        id="tp4-of-2-heads-split-head-columns",
    ),
    pytest.param(
        dict(vocab_size=41),
        (1, 1, 2),
        {},
        r"^sharding: parameter embed_tokens\.embedding dim 0 \(vocab, "
        r"size 41\) is not divisible by mesh axis tensor=2$",
        id="odd-vocab-over-tp2",
    ),
    pytest.param(
        {},
        (1, 1, 2),
        dict(heads="model"),
        r"^sharding: rule 'heads' -> 'model': the mesh has no axis "
        r"'model' \(axes: data, expert, tensor\)$",
        id="rule-to-a-missing-mesh-axis",
    ),
]


@pytest.mark.parametrize("overrides,mesh,rules,match", BAD_SHARDINGS)
def test_shard_model_divisibility(overrides, mesh, rules, match):
    from jax.sharding import AbstractMesh

    from mla_jax.sharding import DEFAULT_RULES, MESH_AXES, shard_model

    with pytest.raises(ValueError, match=match):
        shard_model(_abstract_micro(**overrides), AbstractMesh(mesh, MESH_AXES), dict(DEFAULT_RULES, **rules))


# ------------------------------------------------------------------------------------------------
# config.json (ModelConfig.from_hf)
# ------------------------------------------------------------------------------------------------
def _without(*keys):
    return {k: v for k, v in BUILTIN_CONFIG.items() if k not in keys}


# (config.json text, message after "<file>: "); ids: what happened before.
BAD_CONFIGS = [
    pytest.param(
        json.dumps([BUILTIN_CONFIG]),
        r"expected a JSON object \(\{\.\.\.\}\), got an array \(list\)",
        id="list-AttributeError",
    ),
    pytest.param(
        '{"vocab_size": 264,',
        r"not valid JSON: Expecting property name .*line 1 column 20",
        id="invalid-json-message-without-the-file",
    ),
    pytest.param(
        json.dumps(dict(BUILTIN_CONFIG, n_group="2")),
        r"n_group='2': must be an integer, got a string",
        id="n_group-string-TypeError",
    ),
    pytest.param(
        json.dumps(dict(BUILTIN_CONFIG, moe_intermediate_size="64")),
        r"moe_intermediate_size='64': must be an integer, got a string",
        id="moe_intermediate_size-string",
    ),
    pytest.param(
        json.dumps(dict(BUILTIN_CONFIG, rope_scaling="yarn")),
        r"rope_scaling='yarn': must be an object \(or null\)",
        id="rope_scaling-string-AttributeError",
    ),
    pytest.param(
        json.dumps(dict(BUILTIN_CONFIG, rope_scaling={"type": "yarn"})),
        r"rope_scaling has type 'yarn' but no 'factor'",
        id="yarn-without-factor-KeyError",
    ),
    pytest.param(
        json.dumps(dict(BUILTIN_CONFIG, rope_scaling=dict(BUILTIN_CONFIG["rope_scaling"], factor="4"))),
        r"rope_scaling\.factor='4': must be a finite number, got a string",
        id="rope-factor-string",
    ),
    pytest.param(
        json.dumps(dict(BUILTIN_CONFIG, num_experts_per_tok=2.0)),
        r"num_experts_per_tok=2\.0: must be an integer, got a decimal number",
        id="top-k-2.0-accepted",
    ),
    pytest.param(
        json.dumps(dict(BUILTIN_CONFIG, norm_topk_prob="false")),
        r"norm_topk_prob='false': must be true or false",
        id="bool-string-read-as-true",
    ),
    pytest.param(
        json.dumps(_without("vocab_size")),
        r"missing required key 'vocab_size'$",
        id="missing-key-reported-as-'vocab_size'",
    ),
    pytest.param(
        json.dumps(_without("vocab_size", "hidden_size")),
        r"missing required keys 'vocab_size', 'hidden_size'",
        id="missing-keys",
    ),
    pytest.param(
        json.dumps(dict(BUILTIN_CONFIG, n_group=3)),
        r"n_group=3: must divide n_routed_experts=8",
        id="range-error-without-the-file",
    ),
]


@pytest.mark.parametrize("text,match", BAD_CONFIGS)
def test_config_json(tmp_path, text, match):
    from mla_jax import ModelConfig

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / 'config.json'}: "), msg
    assert re.search(match, msg), (match, msg)


def test_config_json_not_utf8(tmp_path):
    from mla_jax import ModelConfig

    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"config\.json: not UTF-8 text \(byte 0\)"):
        ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize(
    "field,value,match",
    [
        pytest.param("n_group", "2", r"ModelConfig\.n_group='2': must be an integer, got a string", id="str-TypeError"),
        pytest.param("num_experts_per_tok", 2.0, r"num_experts_per_tok=2\.0: must be an integer", id="float-int"),
        pytest.param("rope_theta", "1e4", r"rope_theta='1e4': must be a finite number", id="str-float"),
        pytest.param("tie_word_embeddings", 1, r"tie_word_embeddings=1: must be true or false", id="int-bool"),
    ],
)
def test_model_config_field_types(field, value, match):
    from mla_jax import ModelConfig

    with pytest.raises(ValueError, match=match):
        ModelConfig.tiny().replace(**{field: value})


# ------------------------------------------------------------------------------------------------
# Safetensors files (models.checkpoint.read_safetensors / read_hf_tensors / checkpoint_files)
# ------------------------------------------------------------------------------------------------
def _header_file(path, header, data=b""):
    """A safetensors file with this header (a JSON-able value or raw bytes) and data section."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(np.uint64(len(raw)).astype("<u8").tobytes() + raw + data)
    return str(path)


def _raw(path, data: bytes):
    path.write_bytes(data)
    return str(path)


def _good_file(path):
    from models.checkpoint import write_safetensors

    write_safetensors(str(path), {"w": np.ones((64, 128), np.float32)})
    return str(path)


def _truncated(path):
    _good_file(path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 28840)
    return str(path)


W = {"dtype": "F32", "shape": [2, 2]}
BAD_SAFETENSORS = [
    pytest.param(
        lambda p: _raw(p, b"\x01\x02"), r"not a safetensors file \(shorter than 8 bytes\)", id="shorter-than-8-bytes"
    ),
    pytest.param(
        lambda p: _raw(p, b"\xff" * 8 + b"{}"),
        r"header length 18446744073709551615 exceeds the 2 bytes that follow",
        id="huge-header-length",
    ),
    pytest.param(
        lambda p: _raw(p, np.random.default_rng(0).bytes(4096)),
        r"not a safetensors file, or truncated: its header length \d+ exceeds",
        id="random-bytes",
    ),
    pytest.param(
        _truncated,
        r"tensor 'w': byte range 0\.\.32768 lies past the end of the data section \(3928 bytes\)",
        id="truncated-cannot-reshape-982-into-(64,128)",
    ),
    pytest.param(
        lambda p: _header_file(p, b"\xff\xfenot json"), r"its 10-byte header is not UTF-8 JSON", id="header-not-utf8"
    ),
    pytest.param(
        lambda p: _header_file(p, b"{'w': 1}"),
        r"its 8-byte header is not UTF-8 JSON \(Expecting property",
        id="header-not-json",
    ),
    pytest.param(
        lambda p: _header_file(p, [1, 2]),
        r"the safetensors header must be a JSON object, got list",
        id="header-not-an-object",
    ),
    pytest.param(
        lambda p: _header_file(p, {"w": [1, 2]}),
        r"tensor 'w': header entry must be an object",
        id="entry-not-an-object-TypeError",
    ),
    pytest.param(
        lambda p: _header_file(p, {"w": dict(W, dtype="F4", data_offsets=[0, 16])}, bytes(16)),
        r"tensor 'w' has unsupported dtype 'F4'",
        id="unknown-dtype",
    ),
    pytest.param(
        lambda p: _header_file(p, {"w": dict(W, dtype=["F32"], data_offsets=[0, 16])}, bytes(16)),
        r"tensor 'w' has unsupported dtype \['F32'\]",
        id="dtype-a-list-TypeError-unhashable",
    ),
    pytest.param(
        lambda p: _header_file(p, {"w": dict(W, shape=[2, -2], data_offsets=[0, 16])}, bytes(16)),
        r"tensor 'w': shape must be a list of non-negative integers, got \[2, -2\]",
        id="negative-shape",
    ),
    pytest.param(
        lambda p: _header_file(p, {"w": dict(W, data_offsets=[16, 0])}, bytes(16)),
        r"tensor 'w': data_offsets must be \[begin, end\] with 0 <= begin <= end, got \[16, 0\]",
        id="offsets-reversed",
    ),
    pytest.param(
        lambda p: _header_file(p, {"w": dict(W, data_offsets=[0])}, bytes(16)),
        r"tensor 'w': data_offsets must be \[begin, end\]",
        id="offsets-one-number-ValueError-unpack",
    ),
    pytest.param(
        lambda p: _header_file(p, {"w": dict(W, data_offsets=[0, 1 << 40])}, bytes(16)),
        r"tensor 'w': byte range 0\.\.1099511627776 lies past the end of the data section \(16 bytes\)",
        id="offsets-past-the-end",
    ),
    pytest.param(
        lambda p: _header_file(p, {"w": dict(W, data_offsets=[0, 12])}, bytes(16)),
        r"tensor 'w': byte range 0\.\.12 does not fit shape \(2, 2\) float32",
        id="offsets-wrong-length",
    ),
]


@pytest.mark.parametrize("make,match", BAD_SAFETENSORS)
def test_safetensors_file(tmp_path, make, match):
    from models.checkpoint import read_safetensors

    file = make(tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as e:
        read_safetensors(file)
    msg = str(e.value)
    assert msg.startswith(f"{file}: ") and "\n" not in msg, msg
    assert re.search(match, msg), (match, msg)


def test_safetensors_good_file_still_reads(tmp_path):
    from models.checkpoint import read_safetensors

    t = read_safetensors(_good_file(tmp_path / "a.safetensors"))
    assert t["w"].shape == (64, 128) and float(t["w"].sum()) == 64 * 128


@pytest.mark.parametrize(
    "index,match",
    [
        pytest.param("{", r"model\.safetensors\.index\.json: not valid JSON", id="index-invalid-json"),
        pytest.param("[]", r"index\.json: expected a JSON object", id="index-a-list"),
        pytest.param(
            '{"metadata": {}}',
            r'index\.json: "weight_map" must be a non-empty object',
            id="index-without-weight_map-KeyError",
        ),
        pytest.param(
            '{"weight_map": {"w": 3}}',
            r'"weight_map" must be a non-empty object of tensor name -> shard',
            id="index-shard-not-a-string",
        ),
    ],
)
def test_safetensors_index(tmp_path, index, match):
    from models.checkpoint import checkpoint_files

    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=match):
        checkpoint_files(str(tmp_path))


def test_safetensors_duplicate_tensor_names_both_shards(tmp_path):
    from models.checkpoint import read_hf_tensors, write_safetensors

    for name in ("a", "b"):
        write_safetensors(str(tmp_path / f"{name}.safetensors"), {"w": np.zeros(2, np.float32)})
    with pytest.raises(
        ValueError,
        match=r"tensor 'w' appears in more than one shard: .*a\.safetensors and "
        r".*b\.safetensors",
    ):
        read_hf_tensors(str(tmp_path))


def test_fp8_scales_must_be_2d():
    from models.checkpoint import dequantize_fp8_blocks

    with pytest.raises(ValueError, match=r"2-D weight and 2-D scales, got weight \(4,\)"):
        dequantize_fp8_blocks(np.zeros(4, np.float32), np.ones((1, 1), np.float32))


def _rewrite_tensor(d, name, change):
    """Rewrite one tensor of the checkpoint directory `d`'s model.safetensors as `change(array)`."""
    from models.checkpoint import read_safetensors, write_safetensors

    tensors = {k: np.array(v) for k, v in read_safetensors(str(d / "model.safetensors")).items()}
    tensors[name] = change(tensors[name])
    write_safetensors(str(d / "model.safetensors"), tensors)


# (the change, the message); the id says what happened before the fix
BAD_HF_TENSORS = [
    pytest.param(
        lambda d: _rewrite_tensor(d, "model.norm.weight", lambda a: a.astype(np.int32)),
        r"tensor 'model\.norm\.weight' is stored as int32, but it is a floating-point weight \(float32 here\): "
        r"a float tensor written with an integer dtype has lost its fractions$",
        id="int32-float-weight-loaded-silently-logits-moved",
    ),
    pytest.param(
        lambda d: _rewrite_tensor(d, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", lambda a: a != 0),
        r"tensor 'model\.layers\.1\.self_attn\.kv_a_proj_with_mqa\.weight' is stored as bool, but it is a "
        r"floating-point weight",
        id="bool-float-weight-loaded-silently",
    ),
    pytest.param(
        lambda d: _rewrite_tensor(d, "lm_head.weight", lambda a: a.reshape(-1)),
        r"tensor 'lm_head\.weight' has shape \(\d+,\), expected \(\d+, \d+\) for this config$",
        id="flattened-lm_head-blamed-the-intact-mtp-copy",
    ),
]


@pytest.mark.parametrize("change,match", BAD_HF_TENSORS)
def test_hf_checkpoint_tensors(tmp_path, change, match):
    """`load_hf_checkpoint`: a tensor of the wrong dtype or shape is named itself, in one line."""
    from models.checkpoint import load_hf_checkpoint

    d = _byte_checkpoint(tmp_path)
    change(d)
    with pytest.raises(ValueError) as e:
        load_hf_checkpoint(d)
    assert re.match(match, str(e.value)), str(e.value)  # the message starts with the tensor


def test_hf_checkpoint_float_dtypes_still_load(tmp_path):
    """The control of the dtype check: bf16 / fp16 weights (floating, narrower than the model's) still load."""
    import ml_dtypes

    from models.checkpoint import load_hf_checkpoint

    d = _byte_checkpoint(tmp_path)
    _rewrite_tensor(d, "model.norm.weight", lambda a: a.astype(ml_dtypes.bfloat16))
    _rewrite_tensor(d, "model.layers.0.self_attn.o_proj.weight", lambda a: a.astype(np.float16))
    load_hf_checkpoint(d)


# ------------------------------------------------------------------------------------------------
# Tokenizers (models.tokenizer)
# ------------------------------------------------------------------------------------------------
def _byte_checkpoint(tmp_path):
    """A copy of the built-in checkpoint directory (config.json, model.safetensors, byte_tokenizer.json)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    for name in os.listdir(BUILTIN_DIR):
        if name.endswith((".json", ".safetensors")) and name != "training.json":
            shutil.copy(os.path.join(BUILTIN_DIR, name), d / name)
    return d


BAD_TOKENIZER_DIRS = [
    pytest.param(
        "tokenizer.json",
        '{"version": "1.0", "model": 3}',
        r"cannot read tokenizer .*tokenizer\.json: valid JSON, but not a Hugging Face tokenizer\.json: its "
        r'"model" must be an object \(BPE, WordLevel, \.\.\.\), got 3$',
        id="tokenizer.json-malformed-bare-Exception",
    ),
    pytest.param(
        "tokenizer.json",
        "[1, 2",
        r"cannot read tokenizer .*tokenizer\.json: not valid JSON: Expecting ',' delimiter: line 1 column 6",
        id="tokenizer.json-invalid-read-as-a-type-error",
    ),
    pytest.param(
        "tokenizer.json",
        '{"a": 1}',
        r"cannot read tokenizer .*tokenizer\.json: valid JSON, but not a Hugging Face tokenizer\.json: it has no "
        r"\"model\" entry \(its keys: 'a'\)$",
        id="valid-json-not-a-tokenizer-read-as-a-syntax-error",
    ),
    pytest.param(
        "tokenizer.json",
        json.dumps(BUILTIN_CONFIG),
        r"valid JSON, but not a Hugging Face tokenizer\.json: it has no \"model\" entry \(its keys: 'architectures'",
        id="config.json-as-tokenizer.json-read-as-a-syntax-error",
    ),
    pytest.param(
        "tokenizer.json",
        '{"model": {"type": "BPE"}}',
        r"valid JSON, but not a Hugging Face tokenizer\.json: Missing vocab/merges",
        id="tokenizer-library-reason-kept",
    ),
    pytest.param(
        "tokenizer_config.json", "{", r"tokenizer_config\.json: not valid JSON", id="tokenizer_config-invalid"
    ),
    pytest.param("config.json", "[]", r"config\.json: expected a JSON object", id="config.json-list-AttributeError"),
    pytest.param(
        "byte_tokenizer.json",
        '{"type": "byte", "vocab_size": "264"}',
        r"byte_tokenizer\.json: ByteTokenizer vocab_size='264': must be an int",
        id="byte-marker-vocab-string-TypeError",
    ),
    pytest.param(
        "byte_tokenizer.json",
        '{"type": "byte", "bos_id": 300}',
        r"byte_tokenizer\.json: ByteTokenizer bos_id=300: must be an int in \[256, 264\)",
        id="byte-marker-bos-past-vocab",
    ),
]


@pytest.mark.parametrize("name,text,match", BAD_TOKENIZER_DIRS)
def test_tokenizer_files(tmp_path, name, text, match):
    from models.tokenizer import load_tokenizer

    d = _byte_checkpoint(tmp_path)
    if name == "tokenizer_config.json":  # read only beside a tokenizer.json
        _word_tokenizer(d)
    (d / name).write_text(text)
    with pytest.raises(ValueError) as e:
        load_tokenizer(d)
    assert "\n" not in str(e.value) and re.search(match, str(e.value)), str(e.value)


def _word_tokenizer(d, vocab=264):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))


def test_tokenizer_special_id_types(tmp_path):
    from models.tokenizer import load_tokenizer

    d = _byte_checkpoint(tmp_path)
    _word_tokenizer(d)
    (d / "config.json").write_text(json.dumps(dict(BUILTIN_CONFIG, bos_token_id="<s>")))
    with pytest.raises(ValueError, match=r"config\.json: bos_token_id='<s>': must be an integer token id"):
        load_tokenizer(d)
    (d / "config.json").write_text(json.dumps(dict(BUILTIN_CONFIG, eos_token_id=999)))
    with pytest.raises(
        ValueError,
        match=r"tokenizer\.json with .*config\.json: HFTokenizer eos_id=999 is outside the "
        r"vocabulary \[0, 264\)",
    ):
        load_tokenizer(d)


@pytest.mark.parametrize("hf", [False, True], ids=["byte", "tokenizer.json"])
@pytest.mark.parametrize(
    "text,match",
    [
        pytest.param(
            "ab\udcff", r"character 2 is the byte 0xff, which is not UTF-8", id="argv-byte-0xff-UnicodeEncodeError"
        ),
        pytest.param("\ud800", r"character 0 is a lone surrogate U\+D800", id="lone-surrogate-TypeError-in-tokenizers"),
    ],
)
def test_tokenizer_encode_non_utf8_text(tmp_path, hf, text, match):
    from models.tokenizer import ByteTokenizer, HFTokenizer

    if hf:
        _word_tokenizer(tmp_path)
        tok = HFTokenizer(tmp_path / "tokenizer.json")
    else:
        tok = ByteTokenizer()
    with pytest.raises(ValueError, match=match):
        tok.encode(text)


# ------------------------------------------------------------------------------------------------
# Command-line tools: every bad input above is one line `prog: error: ...`, exit 2, no traceback
# ------------------------------------------------------------------------------------------------
def _snapshot(d):
    return {name: (d / name).read_bytes() for name in sorted(os.listdir(d))}


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


BAD_CHECKPOINTS = [
    pytest.param(
        lambda d: (d / "config.json").write_text(json.dumps([BUILTIN_CONFIG])),
        r"config\.json: expected a JSON object",
        id="config-list",
    ),
    pytest.param(
        lambda d: (d / "config.json").write_text(json.dumps(dict(BUILTIN_CONFIG, n_group="2"))),
        r"config\.json: n_group='2': must be an integer",
        id="config-n_group-string",
    ),
    pytest.param(
        lambda d: (d / "config.json").write_text(json.dumps(_without("vocab_size"))),
        r"config\.json: missing required key 'vocab_size'",
        id="config-missing-key",
    ),
    pytest.param(
        lambda d: (d / "config.json").write_text("{"), r"config\.json: not valid JSON", id="config-invalid-json"
    ),
    pytest.param(
        lambda d: _truncate(d / "model.safetensors"),
        r"model\.safetensors: tensor '.*': byte range .* lies past the end of the data section",
        id="safetensors-truncated",
    ),
    pytest.param(
        lambda d: (d / "model.safetensors").write_bytes(np.random.default_rng(1).bytes(999)),
        r"model\.safetensors: not a safetensors file, or truncated: its header length",
        id="safetensors-random",
    ),
    pytest.param(
        lambda d: (d / "tokenizer.json").write_text('{"model": 3}'),
        r"cannot read tokenizer .*tokenizer\.json",
        id="tokenizer-malformed-traceback",
    ),
    pytest.param(
        lambda d: (d / "tokenizer.json").write_text('{"a": 1}'),
        r"cannot read tokenizer .*tokenizer\.json: valid JSON, but not a Hugging Face tokenizer\.json: it has no ",
        id="tokenizer-valid-json-read-as-a-syntax-error",
    ),
    *BAD_HF_TENSORS,
]


@pytest.mark.parametrize("corrupt,match", BAD_CHECKPOINTS)
def test_generate_cli_bad_checkpoint(tmp_path, capsys, corrupt, match):
    """mla-generate --checkpoint DIR: one line naming the file, exit 2; the directory is left as it was."""
    from models.serving.cli import main

    d = _byte_checkpoint(tmp_path)
    corrupt(d)
    before = _snapshot(d)
    line = _one_line_exit_2(
        main, ["--checkpoint", str(d), "--max-new-tokens", "1", "--no-warmup"], capsys, "mla-generate"
    )
    assert line.startswith(f"mla-generate: error: --checkpoint {d}: ")
    assert re.search(match, line), (match, line)
    assert _snapshot(d) == before


@pytest.mark.parametrize(
    "spec,match",
    [
        pytest.param(
            "data2",
            r"--mesh: mesh spec 'data2': 'data2' is not axis=size \(axes: data, expert, tensor; "
            r"e\.g\. data=2,tensor=2\)",
            id="no-equals-sign",
        ),
        pytest.param(
            "model=2",
            r"--mesh: mesh spec 'model=2': unknown axis 'model' \(axes: data, expert, tensor\)",
            id="unknown-axis",
        ),
        pytest.param(
            "data=2,data=4", r"--mesh: mesh spec 'data=2,data=4': axis 'data' is given twice", id="axis-twice"
        ),
        pytest.param(
            "tensor=two",
            r"--mesh: mesh spec 'tensor=two': tensor='two' must be an integer >= 1",
            id="size-not-a-number",
        ),
        pytest.param("tensor=0", r"--mesh: mesh spec 'tensor=0': tensor='0' must be an integer >= 1", id="size-0"),
        pytest.param(
            "tensor=2",
            r"--mesh tensor=2: make_mesh: data=1 x expert=1 x tensor=2 = 2 devices does not "
            r"divide the 1 devices available",
            id="more-devices-than-there-are",
        ),
    ],
)
def test_generate_cli_mesh_spec(spec, match, capsys):
    """`mla-generate --mesh SPEC`: a spec that names no mesh this process can build is one line, before the
    model loads."""
    from models.serving.cli import main

    line = _one_line_exit_2(main, ["--mesh", spec, "--max-new-tokens", "1", "--no-warmup"], capsys, "mla-generate")
    assert re.search("^mla-generate: error: " + match + "$", line), line


def test_generate_cli_tiny_temperature_is_greedy(capsys):
    """`mla-generate --temperature 1e-10` printed NUL bytes (NaN probabilities) and exited 0."""
    from models.serving.cli import main

    texts = []
    for t in ("1e-10", "0"):
        assert main(["--temperature", t, "--max-new-tokens", "4", "--no-warmup"]) == 0
        texts.append(capsys.readouterr().out.split("\n[stats]")[0])
    assert "\x00" not in texts[0] and texts[0] == texts[1]


def test_generate_cli_non_utf8_prompt_is_one_line(capsys):
    """A non-UTF-8 --prompt (bytes 0xff on the command line arrive as U+DCFF) gave UnicodeEncodeError's
    message (byte tokenizer) or a TypeError traceback (tokenizer.json)."""
    from models.serving.cli import main

    line = _one_line_exit_2(
        main, ["--prompt", "ab\udcff", "--max-new-tokens", "1", "--no-warmup"], capsys, "mla-generate"
    )
    assert "the byte 0xff, which is not UTF-8" in line


def test_generate_cli_non_utf8_prompt_names_the_flag(capsys):
    from models.serving.cli import main

    line = _one_line_exit_2(
        main, ["--prompt", "ab\udcff", "--max-new-tokens", "1", "--no-warmup"], capsys, "mla-generate"
    )
    assert "--prompt" in line


def test_generate_cli_nan_weights(tmp_path, capsys):
    """NaN weights: the sampler drew token 0 from NaN logits, printing NUL bytes, exit 0."""
    from models.checkpoint import read_safetensors, write_safetensors
    from models.serving.cli import main

    d = _byte_checkpoint(tmp_path)
    tensors = {k: np.array(v) for k, v in read_safetensors(str(d / "model.safetensors")).items()}
    tensors["model.norm.weight"][:] = np.nan
    write_safetensors(str(d / "model.safetensors"), tensors)
    line = _one_line_exit_2(
        main,
        ["--checkpoint", str(d), "--max-new-tokens", "2", "--no-warmup"],
        capsys,
        "mla-generate",
        stdout="Once upon a time, there was a",
    )  # the prompt echo, no NUL
    assert "NaN or infinite logits" in line
    # with the warm-up run (the default) the error comes before anything is printed
    line = _one_line_exit_2(main, ["--checkpoint", str(d), "--max-new-tokens", "2"], capsys, "mla-generate")
    assert "NaN or infinite logits" in line


@pytest.mark.parametrize(
    "text,match",
    [
        pytest.param(json.dumps([BUILTIN_CONFIG]), r"config\.json: expected a JSON object", id="list-traceback"),
        pytest.param(
            json.dumps(dict(BUILTIN_CONFIG, moe_intermediate_size="64")),
            r"config\.json: moe_intermediate_size='64': must be an integer",
            id="string-TypeError",
        ),
        pytest.param(
            json.dumps(dict(BUILTIN_CONFIG, rope_scaling="yarn")),
            r"config\.json: rope_scaling='yarn'",
            id="rope-string-traceback",
        ),
        pytest.param(
            json.dumps(_without("vocab_size")), r"config\.json: missing required key 'vocab_size'", id="missing-key"
        ),
    ],
)
def test_capacity_cli_bad_config(tmp_path, capsys, text, match):
    from mla_jax.capacity import main

    (tmp_path / "config.json").write_text(text)
    line = _one_line_exit_2(main, ["--config", str(tmp_path)], capsys, "mla-capacity")
    assert line.startswith(f"mla-capacity: error: --config {tmp_path}: ")
    assert re.search(match, line), (match, line)


@pytest.mark.parametrize(
    "argv,match",
    [
        pytest.param(
            ["-m", "models.serving.cli", b"--prompt", b"\xff", "--max-new-tokens", "1", "--no-warmup"],
            "the byte 0xff, which is not UTF-8",
            id="generate-non-utf8-argv",
        ),
        pytest.param(
            ["-m", "mla_jax.capacity", "--tp", "3"],
            "--tp: tp=3 does not divide num_attention_heads=128",
            id="capacity-tp3",
        ),
    ],
)
def test_console_scripts_exit_2_without_traceback(argv, match):
    """The real console path (a subprocess): status 2, one line on stderr, nothing on stdout."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, *argv], capture_output=True, env=env, timeout=300, cwd=ROOT)
    err = r.stderr.decode("utf-8", "replace")
    lines = [ln for ln in err.strip().split("\n") if not ln.startswith("warning:")]
    assert r.returncode == 2 and not r.stdout.strip(), (r.returncode, r.stdout, err)
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in err, err


def test_capacity_cli_closed_stdout():
    """`mla-capacity | head -1` ended in a BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    try:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
        r = subprocess.run(
            [sys.executable, "-m", "mla_jax.capacity"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env,
            timeout=300,
            cwd=ROOT,
        )
    finally:
        os.close(write_end)
    assert r.returncode == 1 and b"Traceback" not in r.stderr, r.stderr


@pytest.mark.xla_optimized
def test_generate_cli_says_when_the_context_limit_ends_the_text(capsys):
    """A 2047-token prompt with 96 new tokens stopped after 2 tokens without a word."""
    from models.serving.cli import main

    assert main(["--prompt", "a" * 2046, "--max-new-tokens", "96", "--no-warmup"]) == 0  # + BOS = 2047 tokens
    _, err = capsys.readouterr()
    assert "note: stopped after" in err and "of 96 new tokens at the model's context limit (2048 tokens" in err
