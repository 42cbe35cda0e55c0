"""The name map between a Hugging Face DeepSeek checkpoint and `models.DeepSeekModel`: every variable (each layer's
slice of a scanned stack) and the HF tensor name(s) it is read from and written to (`hf_entries`), the MTP layer's
copies of main tensors (`mtp_copies`), and the layout conversions between the two (`hf_shape`); the loader and saver
are `models.checkpoint`.

Names (DEEPSEEK_SEMANTICS.md §4): torch weights [out, in]; per-expert keys `mlp.experts.{e}.{gate,up,down}_proj.weight`;
the MTP module k at `model.layers.{num_hidden_layers + k}.*`; an FP8 weight's block scales at `<name>_scale_inv`.
"""

from __future__ import annotations

from typing import Iterator

from flax import nnx

from mla_jax.config import ModelConfig

SCALE_SUFFIX = "_scale_inv"


# kind "T": torch [out, in] <-> kernel [in, out]; "id": as is; "stackT": E per-expert tensors,
# each transposed, stacked along a new leading axis; "stack": the same without the transpose (FP8 experts
# and their scales keep torch's layout). Main layer i lives at index j of one of the
# model's two scanned stacks (`dense_layers` / `moe_layers`, variables [n, ...]): its entries carry
# that index and fill (load) or read (save) slice j; every other entry has index None.
Entry = tuple[tuple, "int | None", str, object]  # (path in the model, stack index, kind, hf name | list)


def _projection(path: tuple, index: int | None, name: str, weights) -> Iterator[Entry]:
    """A quantizable projection: its dense kernel (kind "T"), or with weights="fp8" its `Fp8Linear`'s e4m3
    weight and scales as stored."""
    if weights == "fp8":
        yield path + ("weight_fp8",), index, "id", name
        yield path + ("scale_inv",), index, "id", name + SCALE_SUFFIX
    else:
        yield path + ("kernel",), index, "T", name


def _layer_entries(
    cfg: ModelConfig, prefix: str, base: tuple, is_moe: bool, index: int | None, weights=None
) -> Iterator[Entry]:
    yield base + ("input_layernorm", "weight"), index, "id", prefix + "input_layernorm.weight"
    yield base + ("post_attention_layernorm", "weight"), index, "id", prefix + "post_attention_layernorm.weight"
    a, sa = base + ("self_attn",), prefix + "self_attn."
    if cfg.q_lora_rank is None:
        yield from _projection(a + ("wq",), index, sa + "q_proj.weight", weights)
    else:
        yield from _projection(a + ("wq_a",), index, sa + "q_a_proj.weight", weights)
        yield a + ("q_norm", "weight"), index, "id", sa + "q_a_layernorm.weight"
        yield from _projection(a + ("wq_b",), index, sa + "q_b_proj.weight", weights)
    yield from _projection(a + ("wkv_a",), index, sa + "kv_a_proj_with_mqa.weight", weights)
    yield a + ("kv_norm", "weight"), index, "id", sa + "kv_a_layernorm.weight"
    yield from _projection(a + ("wkv_b",), index, sa + "kv_b_proj.weight", weights)
    yield from _projection(a + ("wo",), index, sa + "o_proj.weight", weights)
    m, sm = base + ("mlp",), prefix + "mlp."
    if not is_moe:
        for p in ("gate_proj", "up_proj", "down_proj"):
            yield from _projection(m + (p,), index, sm + p + ".weight", weights)
        return
    yield m + ("gate", "kernel"), index, "T", sm + "gate.weight"
    if cfg.topk_method == "noaux_tc":
        yield m + ("gate", "e_score_correction_bias"), index, "id", sm + "gate.e_score_correction_bias"
    for p in ("gate_proj", "up_proj", "down_proj"):
        names = [f"{sm}experts.{e}.{p}.weight" for e in range(cfg.n_routed_experts)]
        if weights == "fp8":
            yield m + ("experts", p + "_fp8"), index, "stack", names
            yield m + ("experts", p + SCALE_SUFFIX), index, "stack", [n + SCALE_SUFFIX for n in names]
        else:
            yield m + ("experts", p), index, "stackT", names
    if cfg.n_shared_experts > 0:
        for p in ("gate_proj", "up_proj", "down_proj"):
            yield from _projection(m + ("shared_experts", p), index, f"{sm}shared_experts.{p}.weight", weights)


def hf_entries(cfg: ModelConfig, weights=None) -> list[Entry]:
    """Every (model path, stack index, kind, HF name(s)) of a `DeepSeekModel(cfg, weights=weights)`; covers
    each variable (each layer's slice of a stacked one) exactly once. With weights="fp8" a quantized
    projection is two entries, its e4m3 weight and its `_scale_inv`."""
    out: list[Entry] = [
        (("embed_tokens", "embedding"), None, "id", "model.embed_tokens.weight"),
        (("norm", "weight"), None, "id", "model.norm.weight"),
    ]
    if not cfg.tie_word_embeddings:
        out.append((("lm_head", "kernel"), None, "T", "lm_head.weight"))
    n_dense = cfg.num_hidden_layers - cfg.num_moe_layers
    for i in range(cfg.num_hidden_layers):
        moe = i >= n_dense
        stack, j = ("moe_layers", i - n_dense) if moe else ("dense_layers", i)
        out += _layer_entries(cfg, f"model.layers.{i}.", (stack,), moe, j, weights)
    for k in range(cfg.num_mtp_layers):
        p, b = f"model.layers.{cfg.num_hidden_layers + k}.", ("mtp", k)
        out += [
            (b + ("enorm", "weight"), None, "id", p + "enorm.weight"),
            (b + ("hnorm", "weight"), None, "id", p + "hnorm.weight"),
            (b + ("eh_proj", "kernel"), None, "T", p + "eh_proj.weight"),
            (b + ("shared_head_norm", "weight"), None, "id", p + "shared_head.norm.weight"),
        ]
        out += _layer_entries(cfg, p, b + ("block",), cfg.n_routed_experts > 0, None, weights)
    return out


def mtp_copies(cfg: ModelConfig) -> dict[str, str]:
    """MTP-layer tensors that duplicate main ones: {copy name: main name}."""
    out = {}
    for k in range(cfg.num_mtp_layers):
        p = f"model.layers.{cfg.num_hidden_layers + k}."
        out[p + "embed_tokens.weight"] = "model.embed_tokens.weight"
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        out[p + "shared_head.head.weight"] = head
    return out


def variable(model, path: tuple) -> nnx.Variable:
    """The variable of `model` at `path` (attribute names and list indices, as `hf_entries` gives)."""
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    if not isinstance(node, nnx.Variable):
        raise TypeError(f"model path {path} is {type(node).__name__}, not a variable")
    return node


def hf_shape(shape: tuple, kind: str) -> tuple:
    """The shape of one HF tensor of an entry of `kind` whose model variable (or its stack slice) is `shape`."""
    if kind == "T":
        return tuple(shape[::-1])
    if kind == "stackT":
        return tuple(shape[1:][::-1])
    return tuple(shape[1:]) if kind == "stack" else tuple(shape)
