#!/usr/bin/env python
"""Build tiny Hugging Face DeepSeek-V2/V3 oracle fixtures, or check a checkpoint against them.

This script needs torch + transformers (5.x) + safetensors + numpy. They are NOT dependencies of
mla-jax: run it in a separate environment (see tests/fixtures/README.md).

Mode 1 -- generate fixtures::

    python scripts/make_hf_fixtures.py --out tests/fixtures

writes one folder per variant (hf_v3_tiny, hf_v3_tiny_fp8, hf_v2_lite_tiny, hf_v2_group_tiny), each with
``config.json``, safetensors weights and ``reference.npz``.

Mode 2 -- check a checkpoint written by our own exporter::

    python scripts/make_hf_fixtures.py --check-roundtrip DIR [--reference NPZ] [--tol 1e-4]

loads DIR with ``AutoModelForCausalLM.from_pretrained(DIR, dtype=float32, attn_implementation="eager")``
(or, when config.json has an fp8 ``quantization_config``, by dequantizing the 128x128-block fp8 weights by
hand), runs the reference ``input_ids`` and compares the logits with the reference ``logits``. When DIR holds
an MTP layer (``model.layers.{num_hidden_layers}.*``) and the reference has ``mtp_logits``, the MTP logits
are compared too. Exits 1 when any max abs diff exceeds ``--tol``. ``--reference`` defaults to
``DIR/reference.npz``.

How the fixtures are made
-------------------------
* Models are built with ``<Arch>ForCausalLM._from_config(config, attn_implementation="eager")`` in fp32,
  on CPU. Every parameter is re-drawn from a generator seeded by (global seed, parameter name), so a
  weight with the same name and shape is identical across variants (hf_v3_tiny_fp8 differs from hf_v3_tiny
  only where its config differs). Draws: RMSNorm weights 1 + 0.1*N(0,1); embeddings N(0,1); lm_head
  N(0,1)*2/sqrt(hidden); router gate N(0,1)*2/sqrt(hidden); ``e_score_correction_bias`` N(0,1)*0.25
  (checked to change the chosen experts for a good fraction of tokens); every other matrix N(0,1)/sqrt(fan_in).
* Every weight is then rounded to bfloat16 values, and stored as bfloat16 in the safetensors (like the
  real releases; halves the fixture size). ``e_score_correction_bias`` is stored as float32 (as in the
  release). The forward passes that produce the references run in float32 on those exact values, so loading
  the bf16 tensors and upcasting them to fp32 is lossless. The fp8 variant stores float8_e4m3fn weights
  with fp32 ``weight_scale_inv`` block scales; its references use the dequantized weights (fp8 * scale).
* References are produced by RE-LOADING the written folder with ``from_pretrained`` (and
  ``MtpModel.from_pretrained`` for MTP), and asserted equal to the in-memory model that was saved.

reference.npz
-------------
``input_ids`` int32 [2, 12] (uniform random tokens in [0, vocab), seeded);
``logits`` f32 [2, 12, vocab]: full causal forward, no cache, position_ids 0..11, no attention mask;
``hidden`` f32 [2, 12, hidden]: HF ``output_hidden_states[-1]`` = the final POST-norm hidden (asserted
equal to ``model.model(...).last_hidden_state``);
``router_input`` f32 [24, hidden]: the input of the first MoE layer's ``mlp`` (i.e. post_attention_layernorm
output of layer ``first_k_dense_replace``), batch-major flattened;
``router_topk_idx`` int32 [24, k] and ``router_topk_weight`` f32 [24, k]: HF's router module
(``mlp.gate``) on ``router_input``; HF returns them unsorted (``topk(sorted=False)``); here EACH ROW IS
SORTED BY EXPERT INDEX (ascending), the weights permuted along;
``router_logits`` f32 [24, E]: the raw router logits x @ W_gate^T (before sigmoid/softmax);
V3 variants only: ``mtp_logits`` f32 [2, 11, vocab] and ``mtp_hidden`` f32 [2, 11, hidden]
(the MTP layer's output after ``shared_head.norm``, before the head).

MTP oracle (V3 variants)
------------------------
Computed with transformers' own ``MtpModel`` (``transformers/modeling_layers.py``), loaded from the written
folder by ``MtpModel.from_pretrained(main_model)``. Position i (0..10) combines the main model's
post-final-norm hidden h[:, i] (HF ``hidden_states[-1]``) with the embedding of token i+1:
``x = eh_proj(cat([enorm(embed(ids[:, i+1])), hnorm(h[:, i])], -1))``, then the MTP decoder block (an MoE
block; causal over the 11 positions; RoPE positions 0..10), then ``shared_head.norm``, then ``lm_head``
(the main model's head; the MTP layer's stored ``shared_head.head`` / ``embed_tokens`` are copies of
``lm_head`` / ``model.embed_tokens``). mtp_logits[:, i] predicts token i+2. (HF's own drafting loop uses
positions 1..11 for the shifted tokens; RoPE attention is shift-invariant, so only roundoff differs.)
The same result is also composed by hand from the in-memory ``MtpLayer`` modules and asserted equal.
HF quirk worked around: ``DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected`` is hard-coded to
``model\\.layers\\.61.*`` and ``MtpModel.get_mtp_weights_regex`` derives the MTP keys from it, so for a tiny
model we set that attribute on the loaded instance to ``model\\.layers\\.{num_hidden_layers}\\..*`` first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import zlib

import numpy as np

SEED = 1234
BATCH, SEQ = 2, 12
FP8_BLOCK = 128
FP8_MAX = 448.0

YARN_V3 = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

V3_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=163840,
    rope_parameters=dict(YARN_V3),
    rope_interleave=True,
    num_nextn_predict_layers=1,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    # Present in the real V3 config.json; HF ignores them (V3 routing is always sigmoid + noaux_tc).
    topk_method="noaux_tc",
    scoring_func="sigmoid",
)

# fp8 variant: dense MLP intermediate 160 (> 128) so that partial 128x128 blocks occur in both the
# output dim (gate/up_proj [160, 64]) and the input dim (down_proj [64, 160]); q_b_proj [192, 48] and
# kv_b_proj [256, 32] give multi-block output dims too.
V3_TINY_FP8 = dict(V3_TINY, intermediate_size=160)

V2_LITE_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=2,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    topk_method="greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=163840,
    rope_parameters=dict(YARN_V3, mscale=0.707, mscale_all_dim=0.707),
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=100,
    eos_token_id=101,
    scoring_func="softmax",
)

# top-3 (not top-2): with group score = max, a top-k with k <= topk_group always lies inside the kept
# groups, so group_limited_greedy would be a no-op; with k=3 > topk_group=2 it changes the choice.
V2_GROUP_TINY = dict(
    V2_LITE_TINY,
    q_lora_rank=48,
    n_shared_experts=2,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    topk_method="group_limited_greedy",
    routed_scaling_factor=16.0,
    rope_parameters=dict(YARN_V3),
)

VARIANTS = {
    # name: (arch, config kwargs, options)
    "hf_v3_tiny": ("v3", V3_TINY, dict(sharded=True, fp8=False)),
    "hf_v3_tiny_fp8": ("v3", V3_TINY_FP8, dict(sharded=False, fp8=True)),
    # hf_v2_lite_tiny keeps the v4-style config.json rope keys ("rope_scaling" + "rope_theta"), as the
    # released DeepSeek-V2-Lite config.json has them, so loaders must parse both spellings.
    "hf_v2_lite_tiny": ("v2", V2_LITE_TINY, dict(sharded=False, fp8=False, legacy_rope_keys=True)),
    "hf_v2_group_tiny": ("v2", V2_GROUP_TINY, dict(sharded=False, fp8=False)),
}


# --------------------------------------------------------------------------------------------------
# torch helpers (imported lazily so that `--help` works anywhere)


def _torch():
    import torch

    return torch


def _classes(arch):
    import transformers as tf

    if arch == "v3":
        return tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM
    return tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM


def _gen(name, seed=SEED):
    torch = _torch()
    g = torch.Generator().manual_seed((seed * 1000003 + zlib.crc32(name.encode())) % (2**63))
    return g


def _randn(name, shape):
    torch = _torch()
    return torch.randn(*shape, generator=_gen(name), dtype=torch.float32)


def _bf16_round(t):
    torch = _torch()
    return t.to(torch.bfloat16).to(torch.float32)


def randomize_(module, prefix=""):
    """Re-draw every parameter (and the router's e_score_correction_bias buffer) of `module`."""
    torch = _torch()
    norm_params = set()
    for mname, mod in module.named_modules():
        if type(mod).__name__.endswith("RMSNorm"):
            norm_params.add(f"{mname}.weight" if mname else "weight")
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = prefix + name
            if name in norm_params:
                v = 1.0 + 0.1 * _randn(full, p.shape)
            elif name.endswith("embed_tokens.weight"):
                v = _randn(full, p.shape)
            elif name.endswith("lm_head.weight"):
                v = _randn(full, p.shape) * (2.0 / math.sqrt(p.shape[-1]))
            elif name.endswith("mlp.gate.weight"):
                v = _randn(full, p.shape) * (2.0 / math.sqrt(p.shape[-1]))
            elif p.ndim >= 2:
                v = _randn(full, p.shape) / math.sqrt(p.shape[-1])
            else:
                raise RuntimeError(f"don't know how to randomize {full} {tuple(p.shape)}")
            p.copy_(_bf16_round(v))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(_bf16_round(0.25 * _randn(prefix + name, b.shape)))


def unfuse_decoder_layer(layer, prefix):
    """Checkpoint (per-expert) state dict of an in-memory HF decoder layer, keys prefixed by `prefix`."""
    out = {}
    for k, v in layer.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}{base}{e}.gate_proj.weight"] = v[e, :inter].clone()
                out[f"{prefix}{base}{e}.up_proj.weight"] = v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{prefix}{base}{e}.down_proj.weight"] = v[e].clone()
        else:
            out[prefix + k] = v.clone()
    return out


def fuse_decoder_layer_sd(sd):
    """Inverse of unfuse_decoder_layer for unprefixed block keys (per-expert -> fused gate_up/down)."""
    torch = _torch()
    out, experts = {}, {}
    for k, v in sd.items():
        m = re.match(r"(.*mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    for base, per in experts.items():
        n = len(per)
        out[base + "gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]], 0) for e in range(n)]
        )
        out[base + "down_proj"] = torch.stack([per[e]["down_proj"] for e in range(n)])
    return out


# --------------------------------------------------------------------------------------------------
# fp8 block quantization (DeepSeek-V3 release layout)


def is_fp8_target(name, tensor):
    """2-D linear weights of decoder layers: attention projections, experts, shared experts, dense MLP."""
    if tensor.ndim != 2 or not name.endswith(".weight"):
        return False
    if not name.startswith("model.layers."):
        return False
    if re.search(r"(norm|layernorm)\.weight$", name):
        return False
    if re.search(r"\.(mlp\.gate|eh_proj|shared_head\.head|embed_tokens)\.weight$", name):
        return False
    return True


def fp8_quantize(w):
    """w fp32 [out, in] -> (q float8_e4m3fn [out, in], scale_inv fp32 [ceil(out/128), ceil(in/128)])."""
    torch = _torch()
    o, i = w.shape
    bo, bi = -(-o // FP8_BLOCK), -(-i // FP8_BLOCK)
    scale = torch.empty(bo, bi, dtype=torch.float32)
    q = torch.empty(o, i, dtype=torch.float8_e4m3fn)
    for a in range(bo):
        for b in range(bi):
            blk = w[a * FP8_BLOCK : (a + 1) * FP8_BLOCK, b * FP8_BLOCK : (b + 1) * FP8_BLOCK]
            s = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            scale[a, b] = s
            q[a * FP8_BLOCK : (a + 1) * FP8_BLOCK, b * FP8_BLOCK : (b + 1) * FP8_BLOCK] = (blk / s).to(
                torch.float8_e4m3fn
            )
    return q, scale


def fp8_dequantize(q, scale):
    torch = _torch()
    s = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[: q.shape[0], : q.shape[1]]
    return q.to(torch.float32) * s


def load_safetensors_dir(d):
    """All tensors of a checkpoint folder (single file or sharded with an index)."""
    from safetensors.torch import load_file

    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        files = sorted(set(json.load(open(idx))["weight_map"].values()))
    else:
        files = [f for f in sorted(os.listdir(d)) if f.endswith(".safetensors")]
    sd = {}
    for f in files:
        sd.update(load_file(os.path.join(d, f)))
    return sd


def dequantize_state_dict(sd):
    torch = _torch()
    out = {}
    for k, v in sd.items():
        if k.endswith(".weight_scale_inv"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            out[k] = fp8_dequantize(v, sd[k[: -len(".weight")] + ".weight_scale_inv"])
        else:
            out[k] = v.to(torch.float32)
    return out


# --------------------------------------------------------------------------------------------------
# model construction / running


def build_config(arch, kw):
    cfg_cls, _ = _classes(arch)
    return cfg_cls(**kw)


def mtp_prefix(cfg):
    return f"model.layers.{cfg.num_hidden_layers}."


def mtp_checkpoint_tensors(mtp_model, main_model, cfg):
    """The MTP layer in DeepSeek's release layout: model.layers.{L}.*"""
    layer = mtp_model.layers[0]
    p = mtp_prefix(cfg)
    out = unfuse_decoder_layer(layer.mtp_block, p)
    out[p + "enorm.weight"] = layer.enorm.weight.detach().clone()
    out[p + "hnorm.weight"] = layer.hnorm.weight.detach().clone()
    out[p + "eh_proj.weight"] = layer.eh_proj.weight.detach().clone()
    out[p + "shared_head.norm.weight"] = layer.post_norm.weight.detach().clone()
    out[p + "shared_head.head.weight"] = main_model.lm_head.weight.detach().clone()
    out[p + "embed_tokens.weight"] = main_model.model.embed_tokens.weight.detach().clone()
    return out


def mtp_state_dict_for_hf(sd, cfg):
    """Checkpoint keys model.layers.{L}.* -> HF MtpModel keys (for loading by hand, e.g. fp8)."""
    p = mtp_prefix(cfg)
    block, out = {}, {}
    for k, v in sd.items():
        if not k.startswith(p):
            continue
        r = k[len(p) :]
        if r in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            out["layers.0." + r] = v
        elif r == "shared_head.norm.weight":
            out["layers.0.post_norm.weight"] = v
        elif r in ("shared_head.head.weight", "embed_tokens.weight"):
            continue
        else:
            block[r] = v
    for k, v in fuse_decoder_layer_sd(block).items():
        out["layers.0.mtp_block." + k] = v
    return out


def causal_forward(model, ids):
    torch = _torch()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        last = model.model(input_ids=ids, use_cache=False).last_hidden_state
    hidden = out.hidden_states[-1]
    assert torch.equal(hidden, last), "hidden_states[-1] != last_hidden_state (expected post-norm)"
    return out.logits.float(), hidden.float()


def mtp_forward_hf(mtp_model, ids, hidden):
    """HF MtpModel.forward_layer on the whole (shifted) sequence: positions 0..S-2."""
    torch = _torch()
    b, s = ids.shape
    pos = torch.arange(s - 1)[None].expand(b, -1)
    with torch.no_grad():
        h = mtp_model.forward_layer(0, hidden[:, :-1], pos, None, input_ids=ids[:, 1:])
        logits = mtp_model._project_to_logits(h)
    return logits.float(), h.float()


def mtp_forward_composed(mtp_model, main_model, ids, hidden):
    """The same, composed by hand from the in-memory modules (cross-check of the HF path)."""
    torch = _torch()
    b, s = ids.shape
    n = s - 1
    pos = torch.arange(n)[None].expand(b, -1)
    layer = mtp_model.layers[0]
    with torch.no_grad():
        emb = main_model.model.embed_tokens(ids[:, 1:])
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(hidden[:, :-1])], -1))
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None].expand(b, 1, n, n)
        pe = main_model.model.rotary_emb(x, position_ids=pos)
        x = layer.mtp_block(x, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        if isinstance(x, tuple):
            x = x[0]
        h = layer.post_norm(x)
        logits = main_model.lm_head(h)
    return logits.float(), h.float()


def router_reference(model, cfg, ids):
    """Input of the first MoE layer's mlp, and HF's router outputs on it (rows sorted by expert index)."""
    torch = _torch()
    layer = model.model.layers[cfg.first_k_dense_replace]
    captured = {}

    def hook(_mod, args):
        captured["x"] = args[0].detach().clone()

    h = layer.mlp.register_forward_pre_hook(hook)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    h.remove()
    x = captured["x"].reshape(-1, cfg.hidden_size).float()
    with torch.no_grad():
        logits, w, idx = layer.mlp.gate(x)
    order = torch.argsort(idx, dim=-1)
    idx = torch.gather(idx, 1, order)
    w = torch.gather(w, 1, order)
    return x, logits.float(), idx.to(torch.int32), w.float()


def routing_bias_effect(model, cfg, x):
    """Fraction of tokens whose chosen expert set changes when e_score_correction_bias is zeroed."""
    torch = _torch()
    gate = model.model.layers[cfg.first_k_dense_replace].mlp.gate
    if not hasattr(gate, "e_score_correction_bias"):
        return None
    with torch.no_grad():
        _, _, i1 = gate(x)
        saved = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        _, _, i0 = gate(x)
        gate.e_score_correction_bias.copy_(saved)
    s1 = torch.sort(i1, -1).values
    s0 = torch.sort(i0, -1).values
    return float((s1 != s0).any(-1).float().mean())


def group_limit_effect(model, cfg, router_logits, idx_sorted):
    """Fraction of tokens whose chosen experts differ from an ungrouped top-k on the same scores."""
    torch = _torch()
    gate = model.model.layers[cfg.first_k_dense_replace].mlp.gate
    if (cfg.n_group or 1) <= 1:
        return None
    if hasattr(gate, "e_score_correction_bias"):
        scores = router_logits.sigmoid() + gate.e_score_correction_bias
    else:
        scores = router_logits.softmax(-1)
    free = torch.sort(torch.topk(scores, cfg.num_experts_per_tok, -1).indices, -1).values
    return float((free != idx_sorted.long()).any(-1).float().mean())


def load_mtp_hf(main_model, cfg):
    """HF MtpModel.from_pretrained with the layer-61 hard-coding worked around."""
    from transformers.modeling_layers import MtpModel

    main_model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{cfg.num_hidden_layers}\..*"]
    return MtpModel.from_pretrained(main_model).eval()


# --------------------------------------------------------------------------------------------------
# writing


def write_shards(sd, out_dir, groups):
    """groups: list of key lists, one per shard file; writes model-0000i-of-0000n.safetensors + index."""
    from safetensors.torch import save_file

    n = len(groups)
    weight_map, total = {}, 0
    for i, keys in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in keys}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        os.chmod(os.path.join(out_dir, fname), 0o644)
        for k in keys:
            weight_map[k] = fname
            total += sd[k].numel() * sd[k].element_size()
    assert set(weight_map) == set(sd), "shards must cover every tensor exactly once"
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


def shard_groups(keys, cfg):
    """3 shards: embed + first layers | remaining main layers + norm + lm_head | MTP layer (like the release)."""
    L = cfg.num_hidden_layers

    def layer_of(k):
        m = re.match(r"model\.layers\.(\d+)\.", k)
        return int(m.group(1)) if m else None

    g1 = [k for k in keys if k.startswith("model.embed_tokens") or (layer_of(k) is not None and layer_of(k) < 2)]
    g3 = [k for k in keys if layer_of(k) is not None and layer_of(k) >= L]
    g2 = [k for k in keys if k not in set(g1) | set(g3)]
    return [sorted(g) for g in (g1, g2, g3) if g]


def to_storage_dtypes(sd):
    torch = _torch()
    out = {}
    for k, v in sd.items():
        if k.endswith(("e_score_correction_bias", "weight_scale_inv")) or v.dtype != torch.float32:
            out[k] = v
        else:
            b = v.to(torch.bfloat16)
            assert torch.equal(b.to(torch.float32), v), f"{k} is not bf16-representable"
            out[k] = b
    return out


def make_variant(name, out_root):
    torch = _torch()
    from safetensors.torch import save_file

    arch, kw, opts = VARIANTS[name]
    cfg = build_config(arch, kw)
    _, model_cls = _classes(arch)
    torch.manual_seed(SEED)
    model = model_cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    randomize_(model)
    has_mtp = arch == "v3" and getattr(cfg, "num_mtp_layers", 0)
    mtp = None
    if has_mtp:
        from transformers.modeling_layers import MtpModel

        mtp = MtpModel(model, cfg.num_mtp_layers).eval()
        randomize_(mtp.layers, prefix=mtp_prefix(cfg) + "mtp.")
        mtp.tie_with_main_model(model)

    # checkpoint state dict: HF's own save_pretrained for the main model (per-expert keys) ...
    tmp = tempfile.mkdtemp()
    try:
        model.save_pretrained(tmp)
        from safetensors.torch import load_file

        sd = load_file(os.path.join(tmp, "model.safetensors"))
        config_json = json.load(open(os.path.join(tmp, "config.json")))
    finally:
        shutil.rmtree(tmp)
    # ... cross-checked against our own unfusing (used for the MTP block)
    for i, layer in enumerate(model.model.layers):
        mine = unfuse_decoder_layer(layer, f"model.layers.{i}.")
        for k, v in mine.items():
            assert torch.equal(sd[k], v), f"unfuse mismatch at {k}"
    if mtp is not None:
        sd.update(mtp_checkpoint_tensors(mtp, model, cfg))

    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=_gen("input_ids"))

    stored = {}
    if opts.get("fp8"):
        deq = {}
        for k, v in sd.items():
            if is_fp8_target(k, v):
                q, s = fp8_quantize(v)
                stored[k], stored[k[: -len(".weight")] + ".weight_scale_inv"] = q, s
                deq[k] = fp8_dequantize(q, s)
            else:
                stored[k] = v
                deq[k] = v
        # put the dequantized weights into the in-memory models (references use them)
        main_sd = {k: v for k, v in deq.items() if not k.startswith(mtp_prefix(cfg))}
        model_cls_sd = fuse_decoder_layer_sd(main_sd)
        missing, unexpected = model.load_state_dict(model_cls_sd, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
        if mtp is not None:
            mtp_sd = mtp_state_dict_for_hf(deq, cfg)
            missing, unexpected = mtp.layers.load_state_dict(
                {k[len("layers.") :]: v for k, v in mtp_sd.items()}, strict=True
            )
        config_json["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
    stored = to_storage_dtypes(stored if stored else sd)

    # in-memory references (checked against the reloaded folder below)
    logits_mem, hidden_mem = causal_forward(model, ids)
    if mtp is not None:
        mtp_logits_mem, mtp_h_mem = mtp_forward_composed(mtp, model, ids, hidden_mem)

    out_dir = os.path.join(out_root, name)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    config_json["dtype"] = "bfloat16"
    if opts.get("legacy_rope_keys"):
        rp = dict(config_json.pop("rope_parameters"))
        config_json["rope_theta"] = rp.pop("rope_theta")
        rp["type"] = rp.pop("rope_type")
        config_json["rope_scaling"] = rp
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(sorted(config_json.items())), f, indent=2)
        f.write("\n")
    if opts.get("sharded"):
        write_shards(stored, out_dir, shard_groups(sorted(stored), cfg))
    else:
        save_file(
            {k: v.contiguous() for k, v in sorted(stored.items())},
            os.path.join(out_dir, "model.safetensors"),
            metadata={"format": "pt"},
        )
        os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)

    # reload from disk and compute the references from the reloaded models
    main2, mtp2 = load_checkpoint(out_dir)
    logits, hidden = causal_forward(main2, ids)
    d = (logits - logits_mem).abs().max().item()
    assert d < 1e-5, f"{name}: reloaded logits differ from in-memory by {d}"
    x, rlogits, ridx, rw = router_reference(main2, main2.config, ids)
    ref = dict(
        input_ids=ids.numpy().astype(np.int32),
        logits=logits.numpy().astype(np.float32),
        hidden=hidden.numpy().astype(np.float32),
        router_input=x.numpy().astype(np.float32),
        router_logits=rlogits.numpy().astype(np.float32),
        router_topk_idx=ridx.numpy().astype(np.int32),
        router_topk_weight=rw.numpy().astype(np.float32),
    )
    info = {"max_abs_logit": float(logits.abs().max())}
    if mtp is not None:
        assert mtp2 is not None, "MTP layer did not load back"
        mtp_logits, mtp_h = mtp_forward_hf(mtp2, ids, hidden)
        d = (mtp_logits - mtp_logits_mem).abs().max().item()
        assert d < 1e-5, f"{name}: HF MtpModel differs from composed MTP by {d}"
        ref["mtp_logits"] = mtp_logits.numpy().astype(np.float32)
        ref["mtp_hidden"] = mtp_h.numpy().astype(np.float32)
        info["max_abs_mtp_logit"] = float(mtp_logits.abs().max())
    info["bias_changes_selection_frac"] = routing_bias_effect(main2, main2.config, x)
    info["group_limit_changes_selection_frac"] = group_limit_effect(main2, main2.config, rlogits, ridx)
    np.savez_compressed(os.path.join(out_dir, "reference.npz"), **ref)
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    info["folder_bytes"] = size
    print(f"{name}: {json.dumps(info)}")
    return info


# --------------------------------------------------------------------------------------------------
# loading (used by generation and by --check-roundtrip)


def load_checkpoint(d):
    """(main model, MtpModel or None), fp32, eager attention, from a checkpoint folder."""
    torch = _torch()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_json = json.load(open(os.path.join(d, "config.json")))
    qc = cfg_json.get("quantization_config")
    if qc is not None and qc.get("quant_method") == "fp8":
        # dequantize by hand (HF's fp8 quantizer targets accelerators); W = fp8 * scale per 128x128 block
        assert qc.get("weight_block_size", [128, 128]) == [FP8_BLOCK, FP8_BLOCK], qc
        cfg = AutoConfig.from_pretrained(d)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        main = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
        sd = dequantize_state_dict(load_safetensors_dir(d))
        L = cfg.num_hidden_layers
        main_sd = fuse_decoder_layer_sd({k: v for k, v in sd.items() if not k.startswith(f"model.layers.{L}.")})
        missing, unexpected = main.load_state_dict(main_sd, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
        mtp = None
        if any(k.startswith(f"model.layers.{L}.") for k in sd) and getattr(cfg, "num_mtp_layers", 0):
            from transformers.modeling_layers import MtpModel

            mtp = MtpModel(main, cfg.num_mtp_layers).eval()
            mtp_sd = mtp_state_dict_for_hf(sd, cfg)
            mtp.layers.load_state_dict({k[len("layers.") :]: v for k, v in mtp_sd.items()}, strict=True)
            mtp.tie_with_main_model(main)
        return main, mtp

    main = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = main.config
    mtp = None
    if getattr(cfg, "num_mtp_layers", 0) and cfg.model_type == "deepseek_v3":
        idx = os.path.join(d, "model.safetensors.index.json")
        prefix = f"model.layers.{cfg.num_hidden_layers}."
        if os.path.exists(idx):
            keys = json.load(open(idx))["weight_map"].keys()
        else:
            from safetensors import safe_open

            keys = []
            for f in os.listdir(d):
                if f.endswith(".safetensors"):
                    with safe_open(os.path.join(d, f), "pt") as fh:
                        keys += list(fh.keys())
        if any(k.startswith(prefix) for k in keys):
            mtp = load_mtp_hf(main, cfg)
    return main, mtp


def check_roundtrip(d, ref_path, tol):
    torch = _torch()
    ref = np.load(ref_path)
    main, mtp = load_checkpoint(d)
    ids = torch.from_numpy(ref["input_ids"].astype(np.int64))
    logits, hidden = causal_forward(main, ids)
    ok = True
    diff = float(np.abs(logits.numpy() - ref["logits"]).max())
    print(f"logits: max abs diff {diff:.3e} (max |ref| {np.abs(ref['logits']).max():.3f})")
    ok &= diff <= tol
    if "mtp_logits" in ref.files:
        if mtp is None:
            print(f"mtp_logits: reference has them but {d} holds no MTP layer (model.layers.N.*): not compared")
        else:
            mlog, _ = mtp_forward_hf(mtp, ids, hidden)
            mdiff = float(np.abs(mlog.numpy() - ref["mtp_logits"]).max())
            print(f"mtp_logits: max abs diff {mdiff:.3e}")
            ok &= mdiff <= tol
    print("OK" if ok else f"FAIL (tolerance {tol:g})")
    return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="generate all fixtures under this folder (e.g. tests/fixtures)")
    ap.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="generate only these variants")
    ap.add_argument("--check-roundtrip", metavar="DIR", help="compare a checkpoint folder with a reference")
    ap.add_argument("--reference", metavar="NPZ", help="reference.npz (default DIR/reference.npz)")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args(argv)
    torch = _torch()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    torch.use_deterministic_algorithms(True)
    if args.check_roundtrip:
        ref = args.reference or os.path.join(args.check_roundtrip, "reference.npz")
        return check_roundtrip(args.check_roundtrip, ref, args.tol)
    if not args.out:
        ap.error("give --out DIR or --check-roundtrip DIR")
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or VARIANTS:
        make_variant(name, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
