"""Training-step benchmark: one cell (model, B x T tokens a step, remat policy, CE chunk, MoE impl) through the
step `mla-train` uses (`models.training.step.make_train_step`, the AdamW of `models.training.loop.make_optimizer`).

Usage: ``python -m benchmarks train [--model v2-lite] [--layers 4] [--batch 1] [--seq 4096] [--remat none]
[--ce-chunk 0] [--moe-impl auto] [--steps 5] [--out DIR]`` (``--help`` for every option; ``--model tiny
--seq 32`` runs on a CPU in seconds).

Models (random weights from `DeepSeekModel`'s init, no download):
* ``v2-lite``: `ModelConfig.deepseek_v2_lite()` cut to ``--layers`` main layers (default 4: 1 dense + 3 MoE;
  8: 1 dense + 7 MoE). No MTP module (V2-Lite has none).
* ``builtin``: `ModelConfig.builtin()` (the built-in model's shape: 4 layers, 1 MTP module);
* ``tiny``: `ModelConfig.tiny()` (CPU-sized). ``--layers`` cuts these two as well (at least one MoE layer).

Per cell: the step is lowered and compiled once (``compile_s``; ``lower_s`` the tracing), its
`jax.stages.Compiled.memory_analysis()` read (``argument_gb``, ``output_gb``, ``temp_gb``, ``alias_gb``;
``peak_gb`` = argument + output + temp - alias, the outputs that reuse the donated state's buffers counted
once), then ``--warmup`` steps and ``--steps`` timed steps, each to `block_until_ready`:
``step_ms`` = the median, ``tok_s`` = B * T / median.
MFU = train FLOPs / step seconds / ``--peak-tflops`` (790 TFLOP/s, the H200's bf16 dense rate), with
    train FLOPs = 6 * (matmul parameters a token passes through) * tokens + 3 * causal attention (forward),
    matmul parameters a token passes through = per main layer the attention projections and the dense MLP,
    or the shared experts, the router and K of the E routed experts; the LM head; per MTP module (when the
    model has one and the loss uses it) its eh_proj, its layer and the LM head again, over the B * (T-1-k)
    positions MTP depth k sees; norms and the embedding lookup are not matmuls and do not count;
    causal attention (forward) = 2 * H * (qk_head_dim + v_head_dim) * B * T(T+1)/2 per layer (scores and
    weighted values of the decompressed path; MTP depth k: T-1-k tokens); the backward is twice the forward.
Rows go to ``train.csv`` (appended; a failing cell, e.g. out of memory, is a row with the error's first line,
and the run's exit status is then 1) and ``train.jsonl`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

import benchmarks as bm
from benchmarks.bench_e2e import layer_counts, param_counts
from mla_jax import ModelConfig
from mla_jax.attention import DECOMPRESSED_IMPLS, resolve_decompressed_impl
from models import DeepSeekModel
from models.deepseek import REMAT_POLICIES
from models.experts import MOE_TRAINING_IMPLS, resolve_moe_impl
from models.training.loop import TrainSettings, make_optimizer
from models.training.step import TrainConfig, init_train_state, make_train_step

MODELS = ("v2-lite", "builtin", "tiny")
H200_BF16_TFLOPS = 790.0
CSV_NAME, JSONL_NAME = "train.csv", "train.jsonl"
COLUMNS = [
    "model",
    "layers",
    "B",
    "T",
    "tokens",
    "remat",
    "ce_chunk",
    "attn_q_block",
    "attn_impl",
    "moe_impl",
    "dtype",
    "param_dtype",
    "params",
    "active_params",
    "train_tflop",
    "lower_s",
    "compile_s",
    "step_ms",
    "step_ms_min",
    "tok_s",
    "tflops",
    "mfu",
    "peak_gb",
    "argument_gb",
    "output_gb",
    "temp_gb",
    "alias_gb",
    "loss_first",
    "loss_last",
    "device",
    "jax",
    "error",
]


# ------------------------------------------------------------------------------------------
# Models and counting (pure functions of the config)
# ------------------------------------------------------------------------------------------
def model_config(name: str, layers: int | None = None):
    """The ModelConfig of a benchmark model (see the module docstring), cut to `layers` main layers."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    cfg = {"v2-lite": ModelConfig.deepseek_v2_lite, "builtin": ModelConfig.builtin, "tiny": ModelConfig.tiny}[name]()
    if name == "v2-lite" and layers is None:
        layers = 4
    if layers:
        cfg = cfg.replace(num_hidden_layers=layers, first_k_dense_replace=min(cfg.first_k_dense_replace, layers - 1))
    return cfg


def active_params(cfg) -> dict[str, int]:
    """Matmul parameters one token passes through: {"main": main layers + LM head, "mtp": one MTP module's
    eh_proj + layer + the LM head again, "total": main + the MTP modules'}."""
    c = param_counts(cfg)
    dense, moe = layer_counts(cfg)
    moe_layer = c["attention"] + c["shared"] + c["router"] + cfg.num_experts_per_tok * c["expert"]
    dense_layer = c["attention"] + c["dense_mlp"]
    head = c["lm_head"] or c["embedding"]
    main = dense * dense_layer + moe * moe_layer + head
    mtp = 2 * cfg.hidden_size * cfg.hidden_size + (moe_layer if cfg.n_routed_experts else dense_layer) + head
    return {"main": main, "mtp": mtp, "total": main + cfg.num_mtp_layers * mtp}


def train_flops(cfg, batch: int, seq: int, *, with_mtp: bool = True) -> float:
    """FLOPs of one training step (forward + backward) on B sequences of T tokens (the module docstring)."""
    a = active_params(cfg)
    per_pair = 2 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)

    def causal(n: int) -> float:
        return per_pair * batch * n * (n + 1) / 2

    matmul = a["main"] * batch * seq
    attn = cfg.num_hidden_layers * causal(seq)
    if with_mtp:
        for k in range(cfg.num_mtp_layers):
            n = seq - 1 - k
            if n < 1:
                break
            matmul += a["mtp"] * batch * n
            attn += causal(n)
    return 6.0 * matmul + 3.0 * attn


def total_params(state) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(state))


# ------------------------------------------------------------------------------------------
# One cell
# ------------------------------------------------------------------------------------------
def memory_columns(compiled) -> dict:
    """memory_analysis() of a compiled step in GB (peak = argument + output + temp - alias)."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    g = lambda n: n / 1e9  # noqa: E731
    arg, out, tmp, alias = (
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.temp_size_in_bytes,
        m.alias_size_in_bytes,
    )
    return dict(
        argument_gb=g(arg), output_gb=g(out), temp_gb=g(tmp), alias_gb=g(alias), peak_gb=g(arg + out + tmp - alias)
    )


def make_step(tc_kwargs: dict):
    """(jitted train step, optimizer) of mla-train's recipe with TrainConfig(**tc_kwargs)."""
    tx, _ = make_optimizer(TrainSettings(steps=1000, warmup=10, lr=3e-4))
    return make_train_step(tx, TrainConfig(**tc_kwargs)), tx


def lower_and_compile(step, *args):
    """(the compiled step, seconds lowering, seconds compiling) for these (real or abstract) arguments."""
    t0 = time.perf_counter()
    lowered = step.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return compiled, t1 - t0, time.perf_counter() - t1


def build_state(cfg, tx, *, dtype: str, param_dtype: str, moe_impl: str, abstract: bool = False):
    """(graphdef, state, opt_state) of a fresh model; `abstract`: shapes only (jax.ShapeDtypeStruct leaves)."""
    dt = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
    make = lambda: DeepSeekModel(
        cfg,
        rngs=nnx.Rngs(0),
        dtype=dt[dtype],
        param_dtype=dt[param_dtype],  # noqa: E731
        moe_impl=resolve_moe_impl(moe_impl, dt[dtype], training=True),
    )
    if abstract:
        graphdef, state = nnx.split(nnx.eval_shape(make))
        return graphdef, state, jax.eval_shape(tx.init, nnx.split_state(state, nnx.Param, ...)[0])
    return init_train_state(make(), tx)


def random_batch(cfg, batch: int, seq: int, seed: int = 0, abstract: bool = False):
    if abstract:
        return {"input_ids": jax.ShapeDtypeStruct((batch, seq), jnp.int32)}
    ids = jax.random.randint(jax.random.key(seed), (batch, seq), 0, cfg.vocab_size, dtype=jnp.int32)
    return {"input_ids": ids}


def time_steps(compiled, state, opt_state, batch, warmup: int, steps: int):
    """Runs `warmup` + `steps` steps of a compiled step -> (seconds of each timed step, first and last loss,
    state, opt_state)."""
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, opt_state, m = compiled(state, opt_state, batch)
        jax.block_until_ready((state, opt_state, m))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(m["loss"]))
    return times, losses[0], losses[-1], state, opt_state


def run_cell(args) -> dict:
    """One benchmark cell -> its row (COLUMNS); exceptions propagate."""
    cfg = model_config(args.model, args.layers)
    row = dict(
        model=args.model,
        layers=cfg.num_hidden_layers,
        B=args.batch,
        T=args.seq,
        tokens=args.batch * args.seq,
        remat=args.remat,
        ce_chunk=args.ce_chunk,
        attn_q_block=args.attn_q_block,
        attn_impl=args.attn_impl,
        moe_impl=args.moe_impl,
        dtype=args.dtype,
        param_dtype=args.param_dtype,
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
    )
    step, tx = make_step(
        dict(remat=args.remat, ce_chunk=args.ce_chunk, attn_q_block=args.attn_q_block, attn_impl=args.attn_impl)
    )
    graphdef, state, opt_state = build_state(
        cfg, tx, dtype=args.dtype, param_dtype=args.param_dtype, moe_impl=args.moe_impl
    )
    row["params"] = total_params(nnx.split_state(state, nnx.Param, ...)[0])
    flops = train_flops(cfg, args.batch, args.seq)
    row["active_params"] = active_params(cfg)["total"]
    row["train_tflop"] = flops / 1e12
    batch = random_batch(cfg, args.batch, args.seq)
    compiled, row["lower_s"], row["compile_s"] = lower_and_compile(step, graphdef, state, opt_state, batch)
    row.update(memory_columns(compiled))
    times, row["loss_first"], row["loss_last"], *_ = time_steps(
        compiled, state, opt_state, batch, args.warmup, args.steps
    )
    med = statistics.median(times)
    row.update(
        step_ms=med * 1e3,
        step_ms_min=min(times) * 1e3,
        tok_s=args.batch * args.seq / med,
        tflops=flops / med / 1e12,
        mfu=flops / med / (args.peak_tflops * 1e12),
    )
    return row


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------
def append_row(out_dir: str, row: dict) -> None:
    """Adds `row` to train.csv (`benchmarks.append_row`: rewritten whole through a temporary file) and to
    train.jsonl."""
    os.makedirs(out_dir, exist_ok=True)
    bm.append_row(os.path.join(out_dir, CSV_NAME), row, columns=COLUMNS, jsonl=os.path.join(out_dir, JSONL_NAME))


def cell_name(row: dict) -> str:
    return f"{row['model']} L{row['layers']} {row['B']}x{row['T']} remat={row['remat']}"


def summary(row: dict) -> str:
    if row.get("error"):
        return f"{cell_name(row)}: {row['error']}"
    return (
        f"{row['model']} L{row['layers']} {row['B']}x{row['T']} remat={row['remat']} ce_chunk={row['ce_chunk']} "
        f"attn={row['attn_impl']}{'/' + str(row['attn_q_block']) if row['attn_q_block'] else ''} "
        f"moe={row['moe_impl']}: step {row['step_ms']:.1f} ms, {row['tok_s']:.0f} tok/s, MFU {row['mfu']:.1%}, "
        f"peak {row.get('peak_gb', float('nan')):.2f} GB, compile {row['compile_s']:.1f} s"
    )


# ------------------------------------------------------------------------------------------
def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {v}")
        return v

    return parse


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (v > 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {v}")
    return v


def parser() -> argparse.ArgumentParser:
    p = bm.OneLineParser(
        prog="python -m benchmarks train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=MODELS, default="v2-lite", help="the model (see above)")
    p.add_argument(
        "--layers",
        type=_int_at_least(2),
        default=None,
        help="main layers, >= 2 (1 dense + at least 1 MoE; v2-lite default 4: 1 dense + 3 MoE); cuts builtin/tiny too",
    )
    p.add_argument("--batch", type=_int_at_least(1), default=1, help="sequences a step")
    p.add_argument(
        "--seq",
        type=_int_at_least(3),
        default=4096,
        help="tokens a sequence (>= 3: the MTP loss predicts two tokens ahead)",
    )
    p.add_argument("--remat", choices=REMAT_POLICIES, default="none", help="rematerialisation of each scanned layer")
    p.add_argument(
        "--ce-chunk",
        type=_int_at_least(0),
        default=0,
        help="tokens per LM-head cross-entropy chunk (0: the whole logits at once)",
    )
    p.add_argument(
        "--attn-q-block",
        type=_int_at_least(0),
        default=0,
        help="queries per block of the decompressed attention (0: all at once)",
    )
    p.add_argument(
        "--attn-impl",
        choices=DECOMPRESSED_IMPLS,
        default="auto",
        help="the decompressed attention: xla (jnp), cudnn (cuDNN flash attention) or mgpu "
        "(pallas_kernels.flash_attention); the last two GPU only; auto (default) = mgpu for "
        "--dtype bf16 on a Hopper GPU, else xla (mla-train's rule; the row names the one used)",
    )
    p.add_argument(
        "--moe-impl",
        choices=MOE_TRAINING_IMPLS,
        default="auto",
        help="expert computation (models.experts.resolve_moe_impl)",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute dtype")
    p.add_argument(
        "--param-dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="parameter (and so gradient and AdamW moment) dtype; mla-train keeps fp32",
    )
    p.add_argument("--steps", type=_int_at_least(1), default=5, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=_int_at_least(0), default=2, help="untimed steps after the compile")
    p.add_argument(
        "--peak-tflops", type=_positive_float, default=H200_BF16_TFLOPS, help="the MFU denominator (TFLOP/s)"
    )
    p.add_argument("--out", default="runs/bench_train", help="directory for train.csv / train.jsonl")
    return p


def main(argv=None):
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.attn_impl == "auto":
        args.attn_impl = resolve_decompressed_impl("auto", dtype={"bf16": "bfloat16", "fp32": "float32"}[args.dtype])
    try:
        row = run_cell(args)
    except Exception as e:  # noqa: BLE001 - a cell that fails (out of memory) is a row, not a traceback
        cfg = model_config(args.model, args.layers)
        row = dict(
            model=args.model,
            layers=cfg.num_hidden_layers,
            B=args.batch,
            T=args.seq,
            tokens=args.batch * args.seq,
            remat=args.remat,
            ce_chunk=args.ce_chunk,
            attn_q_block=args.attn_q_block,
            attn_impl=args.attn_impl,
            moe_impl=args.moe_impl,
            dtype=args.dtype,
            param_dtype=args.param_dtype,
            error=bm.one_line(e),
        )
    append_row(args.out, row)
    print(summary(row))
    bm.exit_if_failed("train", [row], os.path.join(args.out, CSV_NAME), name=cell_name)
    return row


if __name__ == "__main__":
    main()
