"""KV-cache capacity planner: how many bytes the MLA latent cache takes, next to MHA and GQA.

MLA caches one latent per token per layer, shared by every head: the normalised compressed KV
(L = kv_lora_rank values) and the roped key (R = qk_rope_head_dim values), L + R = 576 for
DeepSeek-V2/V3. A multi-head cache of the same model would hold, per token per layer, a key of
qk_head_dim = nope + rope values and a value of v_head_dim values for each of H heads.

Every figure is an exact integer number of bytes; `mla_jax.units.format_bytes` prints binary units
(KiB = 1024 B, MiB = 1024**2 B, GiB = 1024**3 B).

    plan = plan_kv_cache(ModelConfig.deepseek_v3(), context_len=131072, tp=8)
    print(format_plan(plan))

The weights' side (`mla-capacity --weights`) is `mla_jax.weights_plan`.

Console script: `mla-capacity = "mla_jax.capacity:main"` (also `python -m mla_jax.capacity`).
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NoReturn, Sequence

from mla_jax.config import ModelConfig
from mla_jax.units import ceil_div, format_bytes, positive_int
from mla_jax.weights_plan import DEFAULT_DEVICE_GIB, WEIGHT_FORMATS, format_weights, plan_weights
from pallas_kernels.page_format import FP4_BLOCK, FP8_BLOCK, NAMES, PageFormat


# Page formats of the latent cache, one entry for each name of `pallas_kernels.page_format.NAMES`
# (the one list of formats; a format added there and not here fails the import). For each: (bytes
# of one token's latent in one layer as a function of L and R, bytes of one cached K or V head
# vector of width w in the MHA/GQA comparison rows, a one-line description).
#
# bf16 / fp16 / fp32 / fp8 / fp4 are the formats the cache allocates: their latent bytes are
# `pallas_kernels.PageFormat.token_bytes`, the number the cache's pools are sized by, so a plan and
# an allocation never disagree. fp8 is DeepSeek's (FlashMLA) page format: L e4m3 bytes, one fp32
# scale per 128 latent values, the rope part kept in bf16 -> 512 + 4*4 + 64*2 = 656 B for V3 (a
# latent width that is not a multiple of 128, which no cache stores, is priced with a whole last
# scale). fp4: e2m1 pairs (two values per byte) with one e4m3 scale byte per 16 values, rope again
# in bf16 -> 256 + 32 + 128 = 416 B (a latent width that is not a multiple of 32 is priced with
# whole bytes and scales rounded up).
# The comparison rows store K and V the way an MHA/GQA cache of that width usually does: fp8
# with a per-tensor scale (1 B a value), fp4 as e2m1 pairs with an e4m3 scale per 16 values.
def _page_format_bytes(name: str):
    def latent_bytes(L: int, R: int) -> int:
        if name == "fp8" and L % FP8_BLOCK:
            return L + ceil_div(L, FP8_BLOCK) * 4 + R * 2
        if name == "fp4" and L % (2 * FP4_BLOCK):
            return ceil_div(L, 2) + ceil_div(L, FP4_BLOCK) + R * 2
        return PageFormat(name, latent_dim=L, rope_dim=R).token_bytes

    return latent_bytes


_COMPARISON_BYTES_AND_DESCRIPTION = {
    "bf16": (lambda w: 2 * w, "bfloat16, 2 B a value"),
    "fp16": (lambda w: 2 * w, "float16, 2 B a value"),
    "fp32": (lambda w: 4 * w, "float32, 4 B a value"),
    "fp8": (lambda w: w, "e4m3 latent + fp32 scale per 128 + bf16 rope"),
    "fp4": (lambda w: ceil_div(w, 2) + ceil_div(w, 16), "e2m1 pairs + e4m3 scale per 16 + bf16 rope"),
}
assert set(_COMPARISON_BYTES_AND_DESCRIPTION) == set(NAMES), (
    f"mla_jax.capacity prices the page formats {sorted(_COMPARISON_BYTES_AND_DESCRIPTION)}, "
    f"pallas_kernels.page_format.NAMES is {NAMES}"
)
KV_DTYPES: dict[str, tuple] = {
    name: (_page_format_bytes(name), *_COMPARISON_BYTES_AND_DESCRIPTION[name]) for name in NAMES
}

DEFAULT_GQA_GROUPS = 8


# --------------------------------------------------------------------------------------------
def mla_kv_bytes(
    layers: int,
    kv_lora_rank: int,
    rope_dim: int,
    element_bytes: int | float,
    tokens: int,
    sequences: int = 1,
) -> int:
    """Bytes of an MLA latent cache: layers * (kv_lora_rank + rope_dim) * element_bytes * tokens * sequences.

    `element_bytes` may be fractional (0.5 for a 4-bit element); the result is rounded up to a
    whole byte. Scale factors of quantized formats are not included; `plan_kv_cache` counts them.
    Every argument must be positive (integers, except `element_bytes`, which may be a float);
    otherwise `ValueError` names the argument and its value.

    >>> mla_kv_bytes(60, 512, 64, 2, 131072) == 8.4375 * 1024**3
    True
    """
    layers = positive_int("layers", layers)
    kv_lora_rank = positive_int("kv_lora_rank", kv_lora_rank)
    rope_dim = positive_int("rope_dim", rope_dim)
    tokens = positive_int("tokens", tokens)
    sequences = positive_int("sequences", sequences)
    if (
        isinstance(element_bytes, bool)
        or not isinstance(element_bytes, numbers.Real)
        or not math.isfinite(element_bytes)
        or element_bytes <= 0
    ):
        raise ValueError(f"element_bytes must be a finite number > 0, got {element_bytes!r}")
    # Exact arithmetic, one rounding at the end. A float is read as the decimal it prints as, so
    # 0.1 B * 10 values is 1 B, not the 1.0000000000000000555 B of the binary double.
    eb = int(element_bytes) if isinstance(element_bytes, numbers.Integral) else Fraction(repr(float(element_bytes)))
    exact = eb * layers * (kv_lora_rank + rope_dim) * tokens * sequences
    return math.ceil(exact)


# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheRow:
    """One cache layout's footprint, in bytes.

    bytes_per_token_layer: one token in one layer.
    bytes_per_token:       one token over all layers.
    logical_bytes:         exactly context_len tokens of every sequence, all layers.
    allocated_bytes:       page-rounded: each sequence holds ceil(context_len / page_size) pages.
    per_device_bytes:      what the most loaded device holds under the plan's parallelism.
    """

    name: str
    bytes_per_token_layer: int
    bytes_per_token: int
    logical_bytes: int
    allocated_bytes: int
    per_device_bytes: int


@dataclass(frozen=True)
class KVPlan:
    """The result of `plan_kv_cache`: the latent MLA cache and its MHA / GQA equivalents.

    All byte counts are exact integers. `mla_saving_vs_mha_pct` and `mla_saving_vs_gqa_pct`
    are 100 * (1 - MLA / other) on bytes per token per layer.
    """

    cfg: ModelConfig = field(repr=False)
    context_len: int
    num_sequences: int
    page_size: int
    kv_dtype: str
    tp: int
    dp_attention: bool
    gqa_groups: int  # groups of the GQA row (the requested number, capped at H)
    layers: int  # cached layers: cfg.num_hidden_layers, + cfg.num_mtp_layers with include_mtp
    pages_per_sequence: int
    allocated_tokens_per_sequence: int  # pages_per_sequence * page_size
    sequences_per_device: int  # of the latent cache: all of them, or ceil(S / tp) under DP attention
    mha_heads_per_device: int  # ceil(H / tp)
    gqa_groups_per_device: int  # ceil(groups / tp): a group is replicated when tp > groups
    mla: CacheRow
    mha: CacheRow
    gqa: CacheRow

    @property
    def rows(self) -> tuple[CacheRow, CacheRow, CacheRow]:
        return (self.mla, self.mha, self.gqa)

    @property
    def mla_saving_vs_mha_pct(self) -> float:
        return 100.0 * (1.0 - self.mla.bytes_per_token_layer / self.mha.bytes_per_token_layer)

    @property
    def mla_saving_vs_gqa_pct(self) -> float:
        return 100.0 * (1.0 - self.mla.bytes_per_token_layer / self.gqa.bytes_per_token_layer)


def latent_bytes_per_token_layer(kv_lora_rank: int, rope_dim: int, kv_dtype: str) -> int:
    """Bytes of one token's latent [c_kv ; k_pe] in one layer for a page format (see `KV_DTYPES`)."""
    return _dtype(kv_dtype)[0](kv_lora_rank, rope_dim)


def _dtype(kv_dtype: object) -> tuple:
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r} is unknown; known: {', '.join(KV_DTYPES)}")
    return KV_DTYPES[kv_dtype]  # type: ignore[index]


def plan_kv_cache(
    cfg: ModelConfig,
    *,
    context_len: int,
    num_sequences: int = 1,
    page_size: int = 64,
    kv_dtype: str = "bf16",
    tp: int = 1,
    dp_attention: bool = False,
    gqa_groups: int = DEFAULT_GQA_GROUPS,
    include_mtp: bool = False,
    draft_tokens: int = 0,
) -> KVPlan:
    """Plan the KV cache of `num_sequences` sequences of `context_len` tokens for `cfg`.

    Per token per layer (H = num_attention_heads, L = kv_lora_rank, R = qk_rope_head_dim,
    qk_head_dim = qk_nope_head_dim + R, v = v_head_dim, b = bytes a value, 2 for bf16/fp16):
      MLA latent: (L + R) * b  (bf16/fp16/fp32; fp8 and fp4 page formats in `KV_DTYPES`)
      MHA:        H * (qk_head_dim + v) * b   (a K of nope + rope and a V per head)
      GQA:        G * (qk_head_dim + v) * b   (G = gqa_groups KV heads, same per-head widths)
    For "fp8" / "fp4" the latent uses the cache's quantized page formats (656 B / 416 B for V3, with
    their scales and a bf16 rope part) and the MHA / GQA rows store each K and V head vector as
    1 B a value (fp8, per-tensor scale) or e2m1 pairs + an e4m3 scale per 16 values (fp4).
    Per sequence the cache allocates ceil((context_len + draft_tokens) / page_size) whole pages.

    Speculative decoding with MTP: `include_mtp=True` counts the `cfg.num_mtp_layers` MTP blocks,
    which keep a latent cache of their own, as extra layers; `draft_tokens` is the room a sequence
    keeps past its context for drafts that are not verified yet (the engine keeps 3 when the model
    has an MTP head). Both default to plain decoding.

    Per device, with `tp` devices:
      MLA, plain tensor parallelism: the latent has no head axis, so every device holds all of it.
      MLA, `dp_attention=True`: sequences are split over the tp devices; the most loaded one
        holds ceil(num_sequences / tp) sequences' pages. (`models.Engine` on a mesh with data = D > 1
        splits them over `data` alone, a pool per data rank: its per-device figure is this one with
        tp = D.)
      MHA / GQA: heads are split by tensor parallelism: ceil(H / tp) heads, ceil(G / tp) groups
        on a device (a KV group is replicated when tp > G), all sequences.

    `gqa_groups` above H is capped at H (GQA with as many groups as heads is MHA). `tp` must
    divide H, or be a multiple of it (each head then replicated): tensor parallelism gives every
    device whole heads. Raises `ValueError` naming the argument for a non-positive size, an
    unknown `kv_dtype`, a `tp` that splits heads unevenly, or a `context_len` beyond
    `cfg.max_position_embeddings`.
    """
    context_len = positive_int("context_len", context_len)
    num_sequences = positive_int("num_sequences", num_sequences)
    page_size = positive_int("page_size", page_size)
    tp = positive_int("tp", tp)
    gqa_groups = positive_int("gqa_groups", gqa_groups)
    if not isinstance(include_mtp, bool):
        raise ValueError(f"include_mtp must be a bool, got {include_mtp!r}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, numbers.Integral) or draft_tokens < 0:
        raise ValueError(f"draft_tokens must be a non-negative integer, got {draft_tokens!r}")
    if not isinstance(dp_attention, bool):
        raise ValueError(f"dp_attention must be a bool, got {dp_attention!r}")
    latent_fn, head_vec_fn, _ = _dtype(kv_dtype)
    if context_len > cfg.max_position_embeddings:
        raise ValueError(
            f"context_len={context_len} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}"
        )

    layers = cfg.num_hidden_layers + (cfg.num_mtp_layers if include_mtp else 0)
    heads = cfg.num_attention_heads
    if heads % tp and tp % heads:
        raise ValueError(
            f"tp={tp} does not divide num_attention_heads={heads} (nor is it a multiple of it): "
            "tensor parallelism gives every device whole heads"
        )
    groups = min(gqa_groups, heads)
    pages = ceil_div(context_len + int(draft_tokens), page_size)
    alloc_tokens = pages * page_size

    seqs_per_device = ceil_div(num_sequences, tp) if dp_attention else num_sequences
    heads_per_device = ceil_div(heads, tp)
    groups_per_device = ceil_div(groups, tp)
    per_head = head_vec_fn(cfg.qk_head_dim) + head_vec_fn(cfg.v_head_dim)  # one K and one V vector

    def row(name: str, per_token_layer: int, device_per_token_layer: int, device_seqs: int) -> CacheRow:
        per_token = per_token_layer * layers
        return CacheRow(
            name=name,
            bytes_per_token_layer=per_token_layer,
            bytes_per_token=per_token,
            logical_bytes=per_token * context_len * num_sequences,
            allocated_bytes=per_token * alloc_tokens * num_sequences,
            per_device_bytes=device_per_token_layer * layers * alloc_tokens * device_seqs,
        )

    latent = latent_fn(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    return KVPlan(
        cfg=cfg,
        context_len=context_len,
        num_sequences=num_sequences,
        page_size=page_size,
        kv_dtype=kv_dtype,
        tp=tp,
        dp_attention=dp_attention,
        gqa_groups=groups,
        layers=layers,
        pages_per_sequence=pages,
        allocated_tokens_per_sequence=alloc_tokens,
        sequences_per_device=seqs_per_device,
        mha_heads_per_device=heads_per_device,
        gqa_groups_per_device=groups_per_device,
        mla=row("latent MLA", latent, latent, seqs_per_device),
        mha=row("MHA equivalent", heads * per_head, heads_per_device * per_head, num_sequences),
        gqa=row(f"GQA-{groups} equivalent", groups * per_head, groups_per_device * per_head, num_sequences),
    )


# --------------------------------------------------------------------------------------------
def format_plan(plan: KVPlan, name: str | None = None) -> str:
    """A readable table of `plan`: latent MLA, MHA and GQA rows, then MLA's saving in percent. The header
    names the model `name` (a preset's, e.g. "deepseek-v3"; default: the config's `model_type`) and its
    cached layers (the MTP layers among them when the plan counts them)."""
    cfg = plan.cfg
    s = "" if plan.num_sequences == 1 else "s"
    if plan.dp_attention:
        mla_split = (
            f"latent split by sequence (DP attention): {plan.sequences_per_device} of "
            f"{plan.num_sequences} sequence{s} on the most loaded device"
        )
    else:
        mla_split = "latent replicated on every device (it has no head axis)"
    mtp = plan.layers - cfg.num_hidden_layers
    layers = f"{cfg.num_hidden_layers} layers" + (
        f" + {mtp} MTP layer{'s' if mtp > 1 else ''} (speculative decoding)" if mtp else ""
    )
    lines = [
        f"model: {name or cfg.model_type}, {layers}, H={cfg.num_attention_heads}, "
        f"latent {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}, "
        f"qk_head_dim {cfg.qk_head_dim}, v_head_dim {cfg.v_head_dim}",
        f"cache: {plan.kv_dtype} ({KV_DTYPES[plan.kv_dtype][2]}), context {plan.context_len:,} tokens "
        f"x {plan.num_sequences:,} sequence{s}, page {plan.page_size} "
        f"({plan.pages_per_sequence:,} pages = {plan.allocated_tokens_per_sequence:,} tokens a sequence)",
        f"devices: tp={plan.tp}; {mla_split}; MHA {plan.mha_heads_per_device} of "
        f"{cfg.num_attention_heads} heads, GQA {plan.gqa_groups_per_device} of {plan.gqa_groups} "
        f"groups a device",
        "",
    ]
    header = ("cache", "bytes/token/layer", "bytes/token", "logical total", "page-rounded", "per device")
    body = [
        (
            r.name,
            f"{r.bytes_per_token_layer:,} B",
            f"{r.bytes_per_token:,} B",
            format_bytes(r.logical_bytes),
            format_bytes(r.allocated_bytes),
            format_bytes(r.per_device_bytes),
        )
        for r in plan.rows
    ]
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]

    def fmt(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:]))
        return "  ".join((first, *rest))

    lines.append(fmt(header))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(row) for row in body)
    lines += [
        "",
        f"MLA saving (bytes per token per layer): {plan.mla_saving_vs_mha_pct:.2f} % vs MHA, "
        f"{plan.mla_saving_vs_gqa_pct:.2f} % vs GQA-{plan.gqa_groups}",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------
PRESETS = {
    "deepseek-v3": ModelConfig.deepseek_v3,
    "deepseek-v2-lite": ModelConfig.deepseek_v2_lite,
    "deepseek-v2": ModelConfig.deepseek_v2,
    "tiny": ModelConfig.tiny,
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports every error as one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _build_parser() -> _Parser:
    p = _Parser(
        prog="mla-capacity",
        description="KV-cache capacity of the MLA latent cache, next to MHA and GQA equivalents "
        "(binary units: KiB = 1024 B, GiB = 1024**3 B).",
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--preset", choices=sorted(PRESETS), default="deepseek-v3", help="built-in model shape (default: deepseek-v3)"
    )
    model.add_argument("--config", metavar="PATH", help="a Hugging Face config.json (or a directory holding one)")
    p.add_argument("--context", type=int, default=131072, help="tokens a sequence (default: 131072)")
    p.add_argument("--sequences", type=int, default=1, help="concurrent sequences (default: 1)")
    p.add_argument("--page-size", type=int, default=64, help="tokens a cache page (default: 64)")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="bf16", help="cache page format (default: bf16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    p.add_argument("--dp-attention", action="store_true", help="split the latent cache by sequence over the tp devices")
    p.add_argument(
        "--gqa-groups",
        type=int,
        default=DEFAULT_GQA_GROUPS,
        help=f"KV groups of the GQA comparison row (default: {DEFAULT_GQA_GROUPS})",
    )
    p.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        help="also plan the weights in this format: bytes per device on meshes of 1..32 devices and the room "
        "left for the cache (fp8: the release's e4m3 + 128x128 block scales)",
    )
    p.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GIB",
        help=f"memory of one device in GiB, with --weights (default: {DEFAULT_DEVICE_GIB}, an H200)",
    )
    p.add_argument(
        "--mtp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count the MTP layers' latent cache (speculative decoding keeps one a layer; default: on for a "
        "model that has MTP layers, e.g. deepseek-v3's 62nd layer)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The `mla-capacity` console script; returns 0, or exits 2 with a one-line error (1 when stdout closes early)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = ModelConfig.from_hf(args.config) if args.config else PRESETS[args.preset]()
    except KeyError as e:
        parser.error(f"--config {args.config}: config.json lacks the field {e}")
    except (OSError, ValueError, TypeError) as e:  # missing file, bad JSON, invalid values
        parser.error(f"--config {args.config}: {e}")
    name = args.config if args.config else args.preset
    if args.device_memory is not None and not args.weights:
        parser.error(f"--device-memory {args.device_memory:g} needs --weights bf16|fp8: it sizes the room they leave")
    if args.mtp and not cfg.num_mtp_layers:
        parser.error(f"--mtp: {name} has no MTP layers (num_nextn_predict_layers=0); drop --mtp")
    try:
        plan = plan_kv_cache(
            cfg,
            context_len=args.context,
            num_sequences=args.sequences,
            page_size=args.page_size,
            kv_dtype=args.kv_dtype,
            tp=args.tp,
            dp_attention=args.dp_attention,
            gqa_groups=args.gqa_groups,
            include_mtp=cfg.num_mtp_layers > 0 if args.mtp is None else args.mtp,
        )
    except ValueError as e:
        # Name the flag the user typed, not the keyword argument.
        flags = {
            "context_len": "--context",
            "num_sequences": "--sequences",
            "page_size": "--page-size",
            "tp": "--tp",
            "gqa_groups": "--gqa-groups",
        }
        msg = str(e)
        for kw, flag in flags.items():
            if msg.startswith(f"{kw} ") or msg.startswith(f"{kw}="):
                msg = f"{flag}: {msg}"
                break
        parser.error(msg)
    text = format_plan(plan, name if args.config is None else f"{name} ({cfg.model_type})")
    if args.weights:
        gib = DEFAULT_DEVICE_GIB if args.device_memory is None else args.device_memory
        if not (math.isfinite(gib) and gib > 0):
            parser.error(f"--device-memory: must be a positive number of GiB, got {gib}")
        device_bytes = int(gib * 1024**3)
        fits = plan_weights(cfg, args.weights, plan, device_bytes=device_bytes)
        text += "\n\n" + format_weights(cfg, args.weights, plan, fits, device_bytes)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `mla-capacity | head`: the reader left; exit without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
