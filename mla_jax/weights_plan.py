"""Weights planner (`weight_bytes`, `plan_weights`; `mla-capacity --weights fp8|bf16`, whose cache side is
`mla_jax.capacity`): the bytes of the model's weights in a format, in all and on each device of an (expert x tensor)
mesh placed by `mla_jax.sharding`'s tables, and what each device has left for the cache. "fp8" is the release's
(`mla_jax.fp8_weights`): every decoder and MTP-block projection 1 B a value plus a 4 B scale per 128x128
block; embeddings, norms, `eh_proj` and the LM head 2 B a value; the router and its bias 4 B (fp32) in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mla_jax.config import ModelConfig
from mla_jax.fp8_weights import FP8_BLOCK as FP8_WEIGHT_BLOCK
from mla_jax.sharding import DEFAULT_RULES, PARAM_AXES
from mla_jax.units import ceil_div, format_bytes, positive_int

WEIGHT_FORMATS = ("bf16", "fp8")
DEFAULT_DEVICE_GIB = 140  # an H200 (nvidia-smi: 143771 MiB)
MESH_DEVICES = (1, 2, 4, 8, 16, 32)


def _weight_tensors(cfg: ModelConfig, include_mtp: bool = True):
    """(PARAM_AXES key, kernel shape ([in, out], experts [E, in, out]), how many, bytes a value when fixed
    (fp32 router) or None, quantized in the release) for every weight of `models.DeepSeekModel(cfg)`."""
    D, H, E = cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts
    L, R, Q, I = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.moe_intermediate_size
    out = [(("embed_tokens", "embedding"), (cfg.vocab_size, D), 1, None, False), (("weight",), (D,), 1, None, False)]
    if not cfg.tie_word_embeddings:
        out.append((("lm_head", "kernel"), (D, cfg.vocab_size), 1, None, False))

    def layer(moe: bool, n: int):
        t = [(("weight",), (D,), 2 * n, None, False), (("weight",), (L,), n, None, False)]
        if Q is None:
            t.append((("wq", "kernel"), (D, H * cfg.qk_head_dim), n, None, True))
        else:
            t += [(("wq_a", "kernel"), (D, Q), n, None, True), (("weight",), (Q,), n, None, False)]
            t.append((("wq_b", "kernel"), (Q, H * cfg.qk_head_dim), n, None, True))
        t += [
            (("wkv_a", "kernel"), (D, L + R), n, None, True),
            (("wkv_b", "kernel"), (L, H * (cfg.qk_nope_head_dim + cfg.v_head_dim)), n, None, True),
            (("wo", "kernel"), (H * cfg.v_head_dim, D), n, None, True),
        ]
        F = cfg.n_shared_experts * I if moe else cfg.intermediate_size
        if moe:
            t.append((("gate", "kernel"), (D, E), n, 4, False))
            if cfg.topk_method == "noaux_tc":
                t.append((("gate", "e_score_correction_bias"), (E,), n, 4, False))
            t += [(("experts", p), (E, D, I), n, None, True) for p in ("gate_proj", "up_proj")]
            t.append((("experts", "down_proj"), (E, I, D), n, None, True))
        if F:
            t += [((p, "kernel"), (D, F), n, None, True) for p in ("gate_proj", "up_proj")]
            t.append((("down_proj", "kernel"), (F, D), n, None, True))
        return t

    n_moe = cfg.num_moe_layers
    out += layer(False, cfg.num_hidden_layers - n_moe) + layer(True, n_moe)
    if include_mtp and cfg.num_mtp_layers:
        k = cfg.num_mtp_layers
        out += [(("weight",), (D,), 3 * k, None, False), (("eh_proj", "kernel"), (2 * D, D), k, None, False)]
        out += layer(E > 0, k)
    return [t for t in out if t[2] > 0]


def _tensor_bytes(shape: tuple, fixed: int | None, quantized: bool, weights: str) -> int:
    values = math.prod(shape)
    if fixed is not None:
        return values * fixed
    if weights == "fp8" and quantized:
        *lead, k, n = shape
        return values + 4 * math.prod(lead) * ceil_div(k, FP8_WEIGHT_BLOCK) * ceil_div(n, FP8_WEIGHT_BLOCK)
    return 2 * values


def _check_weights(weights: object) -> str:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r} is unknown; known: {', '.join(WEIGHT_FORMATS)}")
    return weights  # type: ignore[return-value]


def weight_bytes(cfg: ModelConfig, weights: str, *, expert: int = 1, tensor: int = 1, include_mtp: bool = True) -> int:
    """Bytes of the model's weights in format `weights` ("bf16" | "fp8", see the module docstring): in all
    (expert = tensor = 1), or on the most loaded device of a mesh with those `expert` and `tensor` axes,
    each weight split as `mla_jax.sharding.DEFAULT_RULES` places it (a split that does not divide rounds
    up; FP8 scales split with their weight). `include_mtp`: the MTP modules' weights too."""
    _check_weights(weights)
    mesh = {"data": 1, "expert": positive_int("expert", expert), "tensor": positive_int("tensor", tensor)}
    total = 0
    for key, shape, count, fixed, quantized in _weight_tensors(cfg, include_mtp):
        split = 1
        for logical in PARAM_AXES[key]:
            rule = DEFAULT_RULES[logical]
            split *= math.prod(mesh[a] for a in ((rule,) if isinstance(rule, str) else rule or ()))
        total += count * ceil_div(_tensor_bytes(shape, fixed, quantized, weights), split)
    return total


@dataclass(frozen=True)
class MeshFit:
    """One mesh's weights and the room left for the cache, per device."""

    expert: int
    tensor: int
    weight_bytes: int  # on the most loaded device
    room_bytes: int  # device memory - weight_bytes (negative: the weights do not fit)
    cache_tokens: int  # tokens of the latent cache (all cached layers) that fit in the room, 0 if none


def plan_weights(cfg: ModelConfig, weights: str, plan, *, device_bytes: int) -> list[MeshFit]:
    """The weights of `cfg` in `weights` on meshes of `MESH_DEVICES` devices, each split all over `expert`
    and all over `tensor` (the expert count and the head count must allow it), with the room each device
    has left for the latent cache of `plan` (a `mla_jax.capacity.KVPlan`; its per-device bytes per token: the
    latent of every cached layer, replicated under tensor parallelism). Room is before activations and XLA's
    workspace."""
    _check_weights(weights)
    device_bytes = positive_int("device_bytes", device_bytes)
    fits = []
    for n in MESH_DEVICES:
        for expert, tensor in ((n, 1), (1, n)) if n > 1 else ((1, 1),):
            if cfg.n_routed_experts % expert or cfg.num_attention_heads % tensor:
                continue
            w = weight_bytes(
                cfg, weights, expert=expert, tensor=tensor, include_mtp=plan.layers > cfg.num_hidden_layers
            )
            room = device_bytes - w
            fits.append(MeshFit(expert, tensor, w, room, max(room, 0) // plan.mla.bytes_per_token))
    return fits


def format_weights(cfg: ModelConfig, weights: str, plan, fits: list[MeshFit], device_bytes: int) -> str:
    """The weights section of `mla-capacity --weights`: the total, a row per mesh (`plan_weights`' `fits` of the
    cache `plan`), and the smallest mesh that holds them."""
    total = weight_bytes(cfg, weights, include_mtp=plan.layers > cfg.num_hidden_layers)
    desc = {
        "fp8": "projections e4m3 + fp32 scale per 128x128 block, the rest bf16, router fp32",
        "bf16": "bf16, router fp32",
    }[weights]
    lines = [
        f"weights: {weights} ({desc}): {format_bytes(total)} in all; device memory {format_bytes(device_bytes)}",
        "",
    ]
    header = ("mesh", "devices", "weights/device", "room for cache/device", "cache tokens/device")
    body = [
        (
            f"expert={f.expert} tensor={f.tensor}",
            str(f.expert * f.tensor),
            format_bytes(f.weight_bytes),
            format_bytes(f.room_bytes) if f.room_bytes >= 0 else "does not fit",
            f"{f.cache_tokens:,}",
        )
        for f in fits
    ]
    widths = [max(len(r[i]) for r in (header, *body)) for i in range(len(header))]
    fmt = lambda r: "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])  # noqa: E731
    lines += [fmt(header), "  ".join("-" * w for w in widths), *map(fmt, body), ""]
    held = [f for f in fits if f.room_bytes > 0]
    if held:
        f = min(held, key=lambda f: (f.expert * f.tensor, -f.room_bytes))
        lines.append(
            f"smallest mesh that holds the {weights} weights: {f.expert * f.tensor} device(s), expert={f.expert} "
            f"tensor={f.tensor}: {format_bytes(f.room_bytes)} left a device = {f.cache_tokens:,} tokens of "
            f"{plan.kv_dtype} latent cache ({plan.mla.bytes_per_token:,} B a token over {plan.layers} layers)"
        )
    else:
        lines.append(f"no mesh of up to {MESH_DEVICES[-1]} devices holds the {weights} weights")
    return "\n".join(lines)
