"""Model configuration for DeepSeek-V2, V2-Lite and V3 style models.

`ModelConfig` speaks the vocabulary of DeepSeek's own `config.json` (the Hugging Face field
names), so `ModelConfig.from_hf(dir)` is a field-for-field read. Every field is validated in
`__post_init__` (type, then range); an invalid value raises `ValueError` naming the field and the
value. `from_hf` raises one-line `ValueError`s naming the file and the key for a file that is not
a JSON object, a missing required key, or a value of the wrong type or range.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
ROPE_TYPES = ("default", "yarn")


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1.0 when factor <= 1)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a DeepSeek-style decoder (MLA + dense MLP / MoE + MTP).

    Defaults are DeepSeek-V3 (671B). Dimension letters used across the project:
    D = hidden_size, H = num_attention_heads, L = kv_lora_rank (latent), R = qk_rope_head_dim,
    E = n_routed_experts.
    """

    # --- sizes ---------------------------------------------------------------------------
    vocab_size: int = 129280
    hidden_size: int = 7168  # D
    intermediate_size: int = 18432  # dense MLP width (the first `first_k_dense_replace` layers)
    moe_intermediate_size: int = 2048  # width of one routed expert; shared = n_shared * this
    num_hidden_layers: int = 61
    num_attention_heads: int = 128  # H
    # --- MLA -----------------------------------------------------------------------------
    q_lora_rank: int | None = 1536  # None: queries use one projection `wq` (V2-Lite)
    kv_lora_rank: int = 512  # L: the compressed latent cached per token
    qk_nope_head_dim: int = 128  # per-head query/key width without position information
    qk_rope_head_dim: int = 64  # R: roped part; the key's rope part is shared by all heads
    v_head_dim: int = 128
    # --- MoE -----------------------------------------------------------------------------
    n_routed_experts: int = 256  # E; 0 means every layer is dense
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8  # top-k
    n_group: int = 8  # expert groups for group-limited routing (1 = no grouping)
    topk_group: int = 4  # groups kept per token
    scoring_func: str = "sigmoid"  # "sigmoid" (V3) or "softmax" (V2)
    topk_method: str = "noaux_tc"  # "noaux_tc" (V3), "greedy" / "group_limited_greedy" (V2)
    norm_topk_prob: bool = True  # renormalise the chosen weights (sigmoid scoring only)
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3  # layers [0, k) use the dense MLP
    # --- RoPE / YaRN ---------------------------------------------------------------------
    rope_theta: float = 10000.0
    rope_type: str = "yarn"  # "default" (plain RoPE) or "yarn"
    rope_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = 1.0
    mscale_all_dim: float | None = 1.0
    rope_interleave: bool = True  # released weights rotate pairs (x[2i], x[2i+1])
    max_position_embeddings: int = 163840
    # --- misc ----------------------------------------------------------------------------
    rms_norm_eps: float = 1e-6
    num_mtp_layers: int = 1  # HF: num_nextn_predict_layers
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    model_type: str = "deepseek_v3"

    # ------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {why}")

        for f in dataclasses.fields(self):
            why = _type_problem(f.type, getattr(self, f.name))
            if why:
                raise bad(f.name, why)

        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
        )
        for f in positive:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(f, "must be a positive integer")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise bad("q_lora_rank", "must be a positive integer or None")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        for f in ("n_routed_experts", "n_shared_experts", "num_mtp_layers", "first_k_dense_replace"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise bad(f, "must be a non-negative integer")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise bad("first_k_dense_replace", f"exceeds num_hidden_layers={self.num_hidden_layers}")
        if self.scoring_func not in SCORING_FUNCS:
            raise bad("scoring_func", f"must be one of {SCORING_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise bad("topk_method", f"must be one of {TOPK_METHODS}")
        if self.rope_type not in ROPE_TYPES:
            raise bad("rope_type", f"must be one of {ROPE_TYPES}")
        if self.rms_norm_eps <= 0:
            raise bad("rms_norm_eps", "must be > 0")
        if self.rope_theta <= 0:
            raise bad("rope_theta", "must be > 0")
        if self.rope_type == "yarn":
            if self.rope_factor <= 0:
                raise bad("rope_factor", "must be > 0")
            if self.original_max_position_embeddings <= 0:
                raise bad("original_max_position_embeddings", "must be > 0")
            if self.beta_fast <= 0 or self.beta_slow <= 0:
                raise bad("beta_fast", f"beta_fast and beta_slow must be > 0 (beta_slow={self.beta_slow})")
        if self.n_routed_experts > 0:
            if self.moe_intermediate_size <= 0:
                raise bad("moe_intermediate_size", "must be > 0 when there are routed experts")
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise bad("num_experts_per_tok", f"must be in [1, n_routed_experts={self.n_routed_experts}]")
            if self.n_group < 1:
                raise bad("n_group", "must be >= 1")
            if self.n_routed_experts % self.n_group:
                raise bad("n_group", f"must divide n_routed_experts={self.n_routed_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise bad("topk_group", f"must be in [1, n_group={self.n_group}]")
            per_group = self.n_routed_experts // self.n_group
            if self.topk_method == "noaux_tc" and self.n_group > 1 and per_group < 2:
                raise bad("n_group", "noaux_tc scores a group by its top-2 experts: needs >= 2 experts per group")
            if self.topk_group * per_group < self.num_experts_per_tok:
                raise bad(
                    "topk_group",
                    f"keeps {self.topk_group * per_group} experts, fewer than "
                    f"num_experts_per_tok={self.num_experts_per_tok}",
                )
            if self.routed_scaling_factor <= 0:
                raise bad("routed_scaling_factor", "must be > 0")

    # ------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: nope + rope (192 for V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: kv_lora_rank + qk_rope_head_dim (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN (as HF and the official code)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_type == "yarn" and self.mscale_all_dim:
            m = yarn_get_mscale(self.rope_factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace if self.n_routed_experts else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # --- presets -------------------------------------------------------------------------
    @classmethod
    def deepseek_v3(cls) -> "ModelConfig":
        """DeepSeek-V3 / R1 (671B total, 37B active), as in its published config.json."""
        return cls()

    @classmethod
    def deepseek_v2_lite(cls) -> "ModelConfig":
        """DeepSeek-V2-Lite (16B total, 2.4B active), as in its published config.json."""
        return cls(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            n_group=1,
            topk_group=1,
            scoring_func="softmax",
            topk_method="greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            first_k_dense_replace=1,
            rope_theta=10000.0,
            rope_type="yarn",
            rope_factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.707,
            mscale_all_dim=0.707,
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
            num_mtp_layers=0,
            bos_token_id=100000,
            eos_token_id=100001,
            model_type="deepseek_v2",
        )

    @classmethod
    def deepseek_v2(cls) -> "ModelConfig":
        """DeepSeek-V2 (236B), as in its published config.json (no YaRN mscale in the official file)."""
        return cls(
            vocab_size=102400,
            hidden_size=5120,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=60,
            num_attention_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=160,
            n_shared_experts=2,
            num_experts_per_tok=6,
            n_group=8,
            topk_group=3,
            scoring_func="softmax",
            topk_method="group_limited_greedy",
            norm_topk_prob=False,
            routed_scaling_factor=16.0,
            first_k_dense_replace=1,
            rope_type="yarn",
            rope_factor=40.0,
            original_max_position_embeddings=4096,
            mscale=0.707,
            mscale_all_dim=0.707,
            num_mtp_layers=0,
            bos_token_id=100000,
            eos_token_id=100001,
            model_type="deepseek_v2",
        )

    @classmethod
    def tiny(cls) -> "ModelConfig":
        """A small model with every feature on (q LoRA, YaRN, grouped V3 routing, MTP); the built-in model's shape."""
        return cls(
            vocab_size=264,
            hidden_size=128,
            intermediate_size=320,
            moe_intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            rope_type="yarn",
            rope_factor=4.0,
            original_max_position_embeddings=512,
            mscale=1.0,
            mscale_all_dim=1.0,
            max_position_embeddings=2048,
            num_mtp_layers=1,
            bos_token_id=256,
            eos_token_id=257,
            model_type="deepseek_v3",
        )

    @classmethod
    def builtin(cls) -> "ModelConfig":
        """The built-in model's shape: `tiny()` with attention the Pallas kernels serve (latent 512 +
        rope 64, 16 heads, so `mla_decode` and `paged_gather` run on 64-token pages), trained on
        windows as long as its context (2048)."""
        return cls.tiny().replace(
            num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16
        )

    # --- Hugging Face config.json ----------------------------------------------------------
    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read a DeepSeek-V2/V2-Lite/V3 `config.json` (a directory holding one, or the file itself).

        Accepts the v4 `rope_scaling` dict (`type`) and the v5 `rope_parameters` dict (`rope_type`,
        possibly holding `rope_theta`), and `q_lora_rank: null`. Raises FileNotFoundError when there
        is no such file, and ValueError "<file>: <key>=<value>: <what is wrong>" for invalid JSON, a
        file that is not a JSON object, a missing required key or a bad value.
        """
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json at {path!r}")
        d = read_json_object(file)
        try:
            return cls.from_hf_dict(d)
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """`from_hf` on a parsed config.json; ValueErrors name the key (not the file)."""
        if not isinstance(d, dict):
            raise ValueError(f"a config must be a JSON object, got {_json_kind(d)}")
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
            routed_scaling_factor=_number(get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=get("first_k_dense_replace", 0),
            rope_theta=_number(theta),
            rope_type="yarn" if rope_type == "yarn" else "default",
            rope_interleave=get("rope_interleave", True),
            max_position_embeddings=get("max_position_embeddings", 4096),
            rms_norm_eps=_number(get("rms_norm_eps", 1e-6)),
            num_mtp_layers=get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0,
            tie_word_embeddings=get("tie_word_embeddings", False),
            initializer_range=_number(get("initializer_range", 0.02)),
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
                rope_factor=_number(rope["factor"]),
                original_max_position_embeddings=rope.get("original_max_position_embeddings", 4096),
                beta_fast=_number(rope.get("beta_fast", 32.0)),
                beta_slow=_number(rope.get("beta_slow", 1.0)),
                mscale=_number(rope.get("mscale")),
                mscale_all_dim=_number(rope.get("mscale_all_dim")),
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
            why = _type_problem(types[field], value)
            if why:
                raise ValueError(f"{source.get(field, field)}={value!r}: {why}")
        if kw["n_routed_experts"] == 0:
            kw.update(num_experts_per_tok=1, n_group=1, topk_group=1)
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that Hugging Face transformers reads for this model."""
        v3 = self.model_type != "deepseek_v2"
        d: dict[str, Any] = dict(
            architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            head_dim=self.qk_rope_head_dim,
            n_routed_experts=self.n_routed_experts,
            n_shared_experts=self.n_shared_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            n_group=self.n_group,
            topk_group=self.topk_group,
            scoring_func=self.scoring_func,
            topk_method=self.topk_method,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            first_k_dense_replace=self.first_k_dense_replace,
            moe_layer_freq=1,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            num_nextn_predict_layers=self.num_mtp_layers,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            attention_bias=False,
            attention_dropout=0.0,
            torch_dtype="float32",
            use_cache=True,
        )
        if v3:
            d["rope_interleave"] = self.rope_interleave
        if self.rope_type == "yarn":
            d["rope_scaling"] = dict(
                type="yarn",
                factor=self.rope_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                mscale=self.mscale,
                mscale_all_dim=self.mscale_all_dim,
            )
        return d


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


def _number(v: Any) -> Any:
    """A JSON int read into a float field becomes a float (inf past float range); anything else is left
    for the type check."""
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:
            return math.inf
    return v


def _type_problem(annotation: str, v: Any) -> str | None:
    """What is wrong with `v` for a field annotated `annotation` ("int", "float | None", ...), or None."""
    base, _, optional = annotation.partition(" | ")
    if v is None:
        return None if optional == "None" else f"must be {_KIND_WORDS[base]}, not null"
    if base == "int":
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif base == "float":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(_number(v))
    elif base == "bool":
        ok = isinstance(v, bool)
    else:
        ok = isinstance(v, str)
    if ok:
        return None
    return f"must be {_KIND_WORDS[base]}" + (" or null" if optional else "") + f", got {_json_kind(v)}"


_KIND_WORDS = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}


def _json_kind(v: Any) -> str:
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
        raise ValueError(f"{file}: expected a JSON object ({{...}}), got {_json_kind(d)}")
    return d
