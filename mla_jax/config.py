"""Model configuration for DeepSeek-V2, V2-Lite and V3 style models.

`ModelConfig` speaks the vocabulary of DeepSeek's own `config.json` (the Hugging Face field
names), so `ModelConfig.from_hf(dir)` is a field-for-field read. Every field is validated in
`__post_init__` (type, then range); an invalid value raises `ValueError` naming the field and the
value. `from_hf` raises one-line `ValueError`s naming the file and the key for a file that is not
a JSON object, a missing required key, or a value of the wrong type or range. The presets' bodies are
`mla_jax.presets`; reading and writing config.json is `mla_jax.hf_config`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from mla_jax import hf_config, presets
from mla_jax.hf_config import type_problem

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
            why = type_problem(f.type, getattr(self, f.name))
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

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # --- presets (`mla_jax.presets`) --------------------------------------------------------
    @classmethod
    def deepseek_v3(cls) -> ModelConfig:
        """DeepSeek-V3 / R1 (671B total, 37B active), as in its published config.json."""
        return presets.deepseek_v3(cls)

    @classmethod
    def deepseek_v2_lite(cls) -> ModelConfig:
        """DeepSeek-V2-Lite (16B total, 2.4B active), as in its published config.json."""
        return presets.deepseek_v2_lite(cls)

    @classmethod
    def deepseek_v2(cls) -> ModelConfig:
        """DeepSeek-V2 (236B), as in its published config.json (no YaRN mscale in the official file)."""
        return presets.deepseek_v2(cls)

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A small model with every feature on (q LoRA, YaRN, grouped V3 routing, MTP); the built-in model's shape."""
        return presets.tiny(cls)

    @classmethod
    def builtin(cls) -> ModelConfig:
        """The built-in model's shape: `tiny()` with attention the Pallas kernels serve (latent 512 +
        rope 64, 16 heads, so `mla_decode` and `paged_gather` run on 64-token pages), trained on
        windows as long as its context (2048)."""
        return presets.builtin(cls)

    # --- Hugging Face config.json (`mla_jax.hf_config`) --------------------------------------
    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> ModelConfig:
        """Read a DeepSeek-V2/V2-Lite/V3 `config.json` (a directory holding one, or the file itself).

        Accepts the v4 `rope_scaling` dict (`type`) and the v5 `rope_parameters` dict (`rope_type`,
        possibly holding `rope_theta`), and `q_lora_rank: null`. Raises FileNotFoundError when there
        is no such file, and ValueError "<file>: <key>=<value>: <what is wrong>" for invalid JSON, a
        file that is not a JSON object, a missing required key or a bad value.
        """
        return hf_config.from_hf(cls, path)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """`from_hf` on a parsed config.json; ValueErrors name the key (not the file)."""
        return hf_config.from_hf_dict(cls, d)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that Hugging Face transformers reads for this model."""
        return hf_config.to_hf_dict(self)
