"""`mla-bench e2e`'s peer: Hugging Face transformers' DeepSeek model of the same config (random bf16 weights on
the GPU) over the run's cells, in its own process; a cell that would not fit or would take too long is a
"skipped (reason)" row. The rows go through the same `derive` as ours."""

from __future__ import annotations

import json
import os
import tempfile
import time

import benchmarks as bm
from benchmarks.e2e_cells import append_row, grid, make_prompts, read_meta
from benchmarks.e2e_floor import derive, prefill_flops, total_params
from benchmarks.e2e_models import model_config
from benchmarks.e2e_report import summary


def hf_memory_bytes(cfg, batch: int, prompt: int, new_tokens: int, attn: str) -> float:
    """A generous estimate of what HF's eager model needs for a cell: bf16 weights (no MTP: HF does not build
    it) + its decompressed cache (per token and layer H * (qk_head_dim + v_head_dim) bf16 values) + the
    prefill's activations (MLP intermediates of every prompt token; with eager attention the [B, H, T, T]
    scores in bf16 and fp32)."""
    S = prompt + new_tokens
    weights = total_params(cfg, with_mtp=False) * 2
    kv = cfg.num_hidden_layers * batch * S * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 2
    widest = max(cfg.intermediate_size, cfg.n_shared_experts * cfg.moe_intermediate_size)
    act = batch * prompt * (4 * cfg.hidden_size + 3 * widest) * 2
    if attn == "eager":
        act += batch * cfg.num_attention_heads * prompt * prompt * (2 + 4 + 2)
    return weights + kv + act + batch * cfg.vocab_size * 4


def _hf_class_name(cfg) -> str:
    return "DeepseekV2ForCausalLM" if cfg.model_type == "deepseek_v2" else "DeepseekV3ForCausalLM"


def build_hf_model(cfg, attn: str):
    """transformers' DeepSeek model for `cfg` (same sizes), bf16, random init, on the GPU.

    The config goes the way of a real checkpoint: `cfg.to_hf_dict()` written as config.json and read by
    `AutoConfig.from_pretrained` (what the project's HF fixtures are loaded through, legacy rope keys included).
    """
    import torch  # noqa: PLC0415 (optional: the HF peer's, not a dependency)
    import transformers  # noqa: PLC0415 (optional: the HF peer's, not a dependency)

    d = cfg.to_hf_dict()
    d.pop("torch_dtype", None)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(d, f)
        config = transformers.AutoConfig.from_pretrained(tmp)
    err = None
    for dtype_kw in ("dtype", "torch_dtype"):  # transformers 5 / 4 spelling
        try:
            with torch.device("cuda"):
                model = transformers.AutoModelForCausalLM.from_config(
                    config, attn_implementation=attn, **{dtype_kw: torch.bfloat16}
                )
            return model.to(device="cuda", dtype=torch.bfloat16).eval()
        except TypeError as e:
            err = e
    raise err


def hf_timed_generate(model, ids, new_tokens: int, limit_s: float):
    """Greedy generation with HF's cache: one forward over the prompt (last-position logits), then cached steps
    until `new_tokens` tokens or `limit_s` seconds -> (prefill s, decode s, decode steps)."""
    import torch  # noqa: PLC0415 (optional: the HF peer's, not a dependency)

    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.model(input_ids=ids, use_cache=True)
        nxt = model.lm_head(out.last_hidden_state[:, -1]).argmax(-1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        pkv, steps = out.past_key_values, 0
        for _ in range(new_tokens - 1):
            out = model.model(input_ids=nxt[:, None], past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            nxt = model.lm_head(out.last_hidden_state[:, -1]).argmax(-1)
            steps += 1
            if time.perf_counter() - t0 > limit_s:
                break
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    del out, pkv
    return t1 - t0, t2 - t1, steps


def run_hf_worker(args) -> None:
    """The HF peer over this run's cells of one model, smallest first; a row per cell."""
    cells = sorted(grid(args), key=lambda c: (c[1] * c[2], c[2]))
    if not cells:
        return
    name = cells[0][0]
    cfg = model_config(name, config=args.config, layers=args.layers, kv_dtype=args.kv_dtype)
    meta = read_meta(args.out)
    ceil = meta.get("ceilings")
    base = dict(
        model=name, impl="hf", new_tokens=args.new_tokens, mtp="off", layers=cfg.num_hidden_layers, kv_dtype="bf16"
    )

    def skip_all(reason):
        for _, b, t in cells:
            append_row(args.out, dict(base, B=b, prompt=t, note=f"skipped ({reason})"))
        bm.log(f"# HF peer {name}: skipped ({reason})")

    try:
        import torch  # noqa: PLC0415 (optional: the HF peer's, not a dependency; skipped without it)
        import transformers  # noqa: PLC0415 (optional: as torch)
    except ImportError as e:
        return skip_all(f"not importable: {e}")
    if not torch.cuda.is_available():
        return skip_all("no CUDA device for torch")
    kind = _hf_class_name(cfg)
    if not hasattr(transformers, kind):
        return skip_all(f"transformers {transformers.__version__} has no {kind}")
    bm.log(f"# HF peer {name}: building {kind} (transformers {transformers.__version__}, attention {args.hf_attn}) ...")
    t0 = time.perf_counter()
    try:
        model = build_hf_model(cfg, args.hf_attn)
    except ValueError as e:  # an attention implementation this model or install does not support
        bm.log(f"# HF peer {name}: attention {args.hf_attn!r} refused ({bm.one_line(e)}); using eager")
        model = None
    except Exception as e:  # noqa: BLE001
        return skip_all(f"build failed: {bm.one_line(e)}")
    try:
        model = model or build_hf_model(cfg, "eager")
    except Exception as e:  # noqa: BLE001
        return skip_all(f"build failed: {bm.one_line(e)}")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    attn = getattr(model.config, "_attn_implementation", args.hf_attn)
    base.update(
        build_s=build_s,
        weights_gb=sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
        note=f"transformers {transformers.__version__}, attention {attn}",
    )
    bm.log(f"# HF peer {name}: built in {build_s:.1f} s")
    warm_ids = torch.randint(0, cfg.vocab_size, (1, 16), device="cuda")
    hf_timed_generate(model, warm_ids, 3, args.hf_cell_limit)  # loads kernels, cuBLAS handles
    prev = None  # (B, T, prefill s) of the last timed cell
    for _, b, t in bm.progress(cells, desc=f"e2e HF {name}"):
        row = dict(base, B=b, prompt=t)
        need = hf_memory_bytes(cfg, b, t, args.new_tokens, attn)
        free = torch.cuda.mem_get_info()[0]
        est = prev[2] * prefill_flops(cfg, b, t) / prefill_flops(cfg, prev[0], prev[1]) if prev else None
        if args.deadline and time.time() > args.deadline:
            row["note"] = "skipped (time budget)"
        elif need > 0.92 * free:
            row["note"] = f"skipped (needs ~{need / 1e9:.0f} GB, {free / 1e9:.0f} GB free)"
        elif est and est > args.hf_cell_limit:
            row["note"] = f"skipped (prefill estimated {est:.0f} s > {args.hf_cell_limit:.0f} s)"
        else:
            try:
                torch.cuda.reset_peak_memory_stats()
                ids = torch.tensor(make_prompts(cfg.vocab_size, b, t, args.seed), device="cuda")
                hf_timed_generate(model, ids[:, :16], 2, args.hf_cell_limit)
                prefill_s, decode_s, steps = hf_timed_generate(model, ids, args.new_tokens, args.hf_cell_limit)
                row.update(
                    prefill_s=prefill_s,
                    ttft_s=prefill_s,
                    decode_steps=steps,
                    peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9,
                )
                if steps:
                    row.update(decode_ms_step=decode_s / steps * 1e3, decode_tok_s=b * steps / decode_s)
                if steps < args.new_tokens - 1:
                    row["note"] += f"; decode cut at {steps}/{args.new_tokens - 1} steps (time limit)"
                prev = (b, t, prefill_s)
                derive(row, cfg, ceil)
            except Exception as e:  # noqa: BLE001 - torch.cuda.OutOfMemoryError and friends
                row["error"] = bm.one_line(e)
            ids = None
            torch.cuda.empty_cache()
        append_row(args.out, row)
        bm.log("  " + summary(row))
