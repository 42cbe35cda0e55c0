"""DeepSeek's `config.json` (the Hugging Face layout) read into a `mla_jax.config.ModelConfig` (`from_hf`,
`from_hf_dict`, functions of the config class `cls`) and written from one (`to_hf_dict`), and the JSON value checks
they share with `ModelConfig`'s validation (`type_problem`, `json_kind`, `read_json_object`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (list, tuple)) and x else x


# config.json keys without a sensible default: the model's shape.
_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def json_number(v: Any) -> Any:
    """A JSON int read into a float field becomes a float (inf past float range); anything else is left
    for the type check."""
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:
            return math.inf
    return v


def type_problem(annotation: str, v: Any) -> str | None:
    """What is wrong with `v` for a field annotated `annotation` ("int", "float | None", ...), or None."""
    base, _, optional = annotation.partition(" | ")
    if v is None:
        return None if optional == "None" else f"must be {_KIND_WORDS[base]}, not null"
    if base == "int":
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif base == "float":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(json_number(v))
    elif base == "bool":
        ok = isinstance(v, bool)
    else:
        ok = isinstance(v, str)
    if ok:
        return None
    return f"must be {_KIND_WORDS[base]}" + (" or null" if optional else "") + f", got {json_kind(v)}"


_KIND_WORDS = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}


def json_kind(v: Any) -> str:
    """How JSON calls the type of a parsed value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a decimal number" if math.isfinite(v) else f"{v}"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, tuple)):
        return "an array (list)"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def read_json_object(file: str | os.PathLike) -> dict[str, Any]:
    """The JSON object a file holds. ValueError naming the file when it is not UTF-8 JSON or not an object
    (`{...}`); OSError when it cannot be read."""
    file = os.fspath(file)
    with open(file, "rb") as f:
        raw = f.read()
    try:
        d = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text (byte {e.start}); expected JSON") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{file}: JSON nested too deeply") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: expected a JSON object ({{...}}), got {json_kind(d)}")
    return d


def from_hf(cls, path: str | os.PathLike):
    """`ModelConfig.from_hf` for the config class `cls` (its contract there)."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json at {path!r}")
    d = read_json_object(file)
    try:
        return cls.from_hf_dict(d)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def from_hf_dict(cls, d: dict[str, Any]):
    """`from_hf` on a parsed config.json -> a `cls`; ValueErrors name the key (not the file)."""
    if not isinstance(d, dict):
        raise ValueError(f"a config must be a JSON object, got {json_kind(d)}")
    missing = [k for k in _REQUIRED_HF_KEYS if d.get(k) is None]
    if missing:
        raise ValueError(
            "missing required key" + ("s " if len(missing) > 1 else " ") + ", ".join(repr(k) for k in missing)
        )
    model_type = d.get("model_type", "deepseek_v3")
    if not isinstance(model_type, str):
        raise ValueError(f"model_type={model_type!r}: must be a string")
    v3 = model_type != "deepseek_v2"
    base = cls.deepseek_v3() if v3 else cls.deepseek_v2_lite()
    rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rope = d.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise ValueError(
            f'{rope_key}={rope!r}: must be an object (or null), e.g. {{"type": "yarn", "factor": 40, ...}}'
        )
    rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))

    def get(key: str, default: Any) -> Any:
        v = d.get(key, default)
        return default if v is None and default is not None else v

    n_group = get("n_group", 1) or 1
    kw: dict[str, Any] = dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        moe_intermediate_size=get("moe_intermediate_size", base.moe_intermediate_size),
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"],
        v_head_dim=d["v_head_dim"],
        n_routed_experts=get("n_routed_experts", 0) or 0,
        n_shared_experts=get("n_shared_experts", 0) or 0,
        num_experts_per_tok=get("num_experts_per_tok", 1) or 1,
        n_group=n_group,
        topk_group=get("topk_group", 1) or 1,
        # HF's V3 router always uses sigmoid + noaux_tc, whatever config.json says.
        scoring_func="sigmoid" if v3 else get("scoring_func", "softmax"),
        topk_method="noaux_tc" if v3 else get("topk_method", "greedy"),
        norm_topk_prob=get("norm_topk_prob", v3),
        routed_scaling_factor=json_number(get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=get("first_k_dense_replace", 0),
        rope_theta=json_number(theta),
        rope_type="yarn" if rope_type == "yarn" else "default",
        rope_interleave=get("rope_interleave", True),
        max_position_embeddings=get("max_position_embeddings", 4096),
        rms_norm_eps=json_number(get("rms_norm_eps", 1e-6)),
        num_mtp_layers=get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0,
        tie_word_embeddings=get("tie_word_embeddings", False),
        initializer_range=json_number(get("initializer_range", 0.02)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_first(d.get("eos_token_id")),
        model_type=model_type,
    )
    # Where each field came from, for messages that name the key the user wrote.
    source = {f: f for f in kw}
    source.update(
        num_mtp_layers="num_nextn_predict_layers",
        rope_theta=f"{rope_key}.rope_theta" if "rope_theta" in rope else "rope_theta",
    )
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"{rope_key}.type={rope_type!r}: not supported (expected 'yarn' or 'default')")
    if rope_type == "yarn":
        if rope.get("factor") is None:
            raise ValueError(f"{rope_key} has type 'yarn' but no 'factor'")
        kw.update(
            rope_factor=json_number(rope["factor"]),
            original_max_position_embeddings=rope.get("original_max_position_embeddings", 4096),
            beta_fast=json_number(rope.get("beta_fast", 32.0)),
            beta_slow=json_number(rope.get("beta_slow", 1.0)),
            mscale=json_number(rope.get("mscale")),
            mscale_all_dim=json_number(rope.get("mscale_all_dim")),
        )
        source.update(
            rope_factor=f"{rope_key}.factor",
            **{
                k: f"{rope_key}.{k}"
                for k in ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
            },
        )
    else:
        kw.update(rope_factor=1.0, mscale=None, mscale_all_dim=None)
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    for field, value in kw.items():
        why = type_problem(types[field], value)
        if why:
            raise ValueError(f"{source.get(field, field)}={value!r}: {why}")
    if kw["n_routed_experts"] == 0:
        kw.update(num_experts_per_tok=1, n_group=1, topk_group=1)
    return cls(**kw)


def to_hf_dict(cfg) -> dict[str, Any]:
    """The config.json that Hugging Face transformers reads for the model of `cfg` (a `ModelConfig`)."""
    v3 = cfg.model_type != "deepseek_v2"
    d: dict[str, Any] = dict(
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        head_dim=cfg.qk_rope_head_dim,
        n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        scoring_func=cfg.scoring_func,
        topk_method=cfg.topk_method,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        first_k_dense_replace=cfg.first_k_dense_replace,
        moe_layer_freq=1,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        num_nextn_predict_layers=cfg.num_mtp_layers,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        attention_bias=False,
        attention_dropout=0.0,
        torch_dtype="float32",
        use_cache=True,
    )
    if v3:
        d["rope_interleave"] = cfg.rope_interleave
    if cfg.rope_type == "yarn":
        d["rope_scaling"] = dict(
            type="yarn",
            factor=cfg.rope_factor,
            original_max_position_embeddings=cfg.original_max_position_embeddings,
            beta_fast=cfg.beta_fast,
            beta_slow=cfg.beta_slow,
            mscale=cfg.mscale,
            mscale_all_dim=cfg.mscale_all_dim,
        )
    return d
