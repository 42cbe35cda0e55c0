"""A training run's settings (`TrainSettings`, what `mla-train`'s flags set), the model configs it can name,
and the errors of the trainer modules: `TrainerError` (a bad input, setting or checkpoint; one line) and
`SettingError`, its subclass, which names the settings at fault so the command line can print them as flags.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, ClassVar

from mla_jax.attention import DECOMPRESSED_IMPLS
from mla_jax.config import ModelConfig
from mla_jax.sharding import parse_mesh
from models.data import CORPUS_PATH
from models.deepseek import REMAT_POLICIES
from models.moe import MOE_TRAINING_IMPLS

DEFAULT_CORPUS = CORPUS_PATH  # inside the package (models/data), so an installed wheel trains with no arguments
PRESETS = ("tiny", "builtin", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3")
DTYPES = ("fp32", "bf16")


class TrainerError(ValueError):
    """A bad input, setting or checkpoint; the message is one line that names it."""


class SettingError(TrainerError):
    """A bad value of one or more settings. The message names them by field (`steps`); `message(style)`
    names them another way (the command line uses `--steps`)."""

    def __init__(self, template: str, *names: str, **values: Any):
        self.template, self.names, self.values = template, names, values
        super().__init__(self.message(str))

    def message(self, style) -> str:
        return self.template.format(*(style(n) for n in self.names), **self.values)


# ------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """A run's settings; the defaults train `ModelConfig.tiny()` on 256-token windows (CPU-sized; the
    built-in model's own recipe is in `models/builtin/training.json`)."""

    config: str = "tiny"  # a preset (PRESETS) or a config.json path
    steps: int = 800  # total optimizer steps
    batch_size: int = 8  # sequences per step
    seq_len: int = 256  # tokens per training window
    lr: float = 4e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr of the cosine decay, relative to lr
    warmup: int = 60  # linear warmup steps
    weight_decay: float = 0.1  # AdamW decay on matrices (not norms, biases)
    clip: float = 1.0  # global gradient-norm clip (0 = off)
    seed: int = 0  # initialisation and data-order seed
    dtype: str = "fp32"  # compute dtype (DTYPES); parameters stay fp32
    mtp_weight: float = 0.3  # λ of the MTP loss
    balance_alpha: float = 1e-4  # α of the sequence-wise balance loss
    bias_update_rate: float = 1e-2  # γ of the aux-loss-free router-bias update
    moe_impl: str = "auto"  # expert computation (models.moe.MOE_TRAINING_IMPLS, resolve_moe_impl)
    # Not part of the trajectory: a resumed run may change them.
    remat: str = "none"  # rematerialisation of each scanned layer (models.deepseek.REMAT_POLICIES)
    ce_chunk: int = 0  # tokens per LM-head cross-entropy chunk (0 = the whole logits at once)
    attn_q_block: int = 0  # queries per block of the decompressed attention (0 = all at once)
    attn_impl: str = "auto"  # the decompressed attention: xla (jnp), cudnn or mgpu (flash; a GPU);
    #                                 auto: mla_jax.attention.resolve_decompressed_impl
    mesh: str | None = None  # a device mesh, "data=2,tensor=2" (mla_jax.sharding.parse_mesh; FSDP over data)
    corpus: str = DEFAULT_CORPUS  # UTF-8 text, paragraphs separated by blank lines
    eval_every: int = 100  # held-out evaluation period in steps (0 = only at the end)
    eval_windows: int = 64  # held-out windows per evaluation (at most what the split holds)
    save_every: int = 200  # checkpoint period in steps (0 = only at the end)

    # The settings that change the training trajectory: a resumed run must use the same ones.
    TRAJECTORY: ClassVar[tuple[str, ...]] = (
        "config",
        "steps",
        "batch_size",
        "seq_len",
        "lr",
        "min_lr_ratio",
        "warmup",
        "weight_decay",
        "clip",
        "seed",
        "dtype",
        "mtp_weight",
        "balance_alpha",
        "bias_update_rate",
        "moe_impl",
    )

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise SettingError("{0} must be >= 1, got {v}", name, v=getattr(self, name))
        if self.seq_len < 3:
            raise SettingError(
                "{0} must be >= 3 (the MTP loss predicts two tokens ahead), got {v}", "seq_len", v=self.seq_len
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise SettingError("{0} must be a positive number, got {v}", "lr", v=self.lr)
        for name in ("warmup", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise SettingError("{0} must be >= 0, got {v}", name, v=getattr(self, name))
        if self.eval_windows < 1:  # every evaluation (the final one at least) reads held-out windows
            raise SettingError(
                "{0} must be >= 1 (held-out windows per evaluation), got {v}", "eval_windows", v=self.eval_windows
            )
        if self.warmup >= self.steps:
            raise SettingError(
                "{0} ({w}) must be smaller than {1} ({s})", "warmup", "steps", w=self.warmup, s=self.steps
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise SettingError("{0} must be in [0, 1], got {v}", "min_lr_ratio", v=self.min_lr_ratio)
        for name in ("weight_decay", "clip", "mtp_weight", "balance_alpha", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise SettingError("{0} must be >= 0, got {v}", name, v=getattr(self, name))
        if self.dtype not in DTYPES:
            raise SettingError("{0} must be one of {c}, got {v!r}", "dtype", c=DTYPES, v=self.dtype)
        if self.moe_impl not in MOE_TRAINING_IMPLS:
            raise SettingError("{0} must be one of {c}, got {v!r}", "moe_impl", c=MOE_TRAINING_IMPLS, v=self.moe_impl)
        if self.remat != "none":
            if self.remat not in REMAT_POLICIES:
                raise SettingError("{0} must be one of {c}, got {v!r}", "remat", c=REMAT_POLICIES, v=self.remat)
        if self.ce_chunk < 0:
            raise SettingError("{0} must be >= 0 (0 = unchunked), got {v}", "ce_chunk", v=self.ce_chunk)
        if self.attn_q_block < 0:
            raise SettingError(
                "{0} must be >= 0 (0 = all queries at once), got {v}", "attn_q_block", v=self.attn_q_block
            )
        if self.attn_impl not in DECOMPRESSED_IMPLS:
            raise SettingError("{0} must be one of {c}, got {v!r}", "attn_impl", c=DECOMPRESSED_IMPLS, v=self.attn_impl)
        if self.mesh is not None:
            data = self.mesh_sizes().get("data", 1)
            if self.batch_size % data:
                raise SettingError(
                    "{0} {b} is not divisible by data={d} of {1} {spec}: each data rank takes whole sequences",
                    "batch_size",
                    "mesh",
                    b=self.batch_size,
                    d=data,
                    spec=self.mesh,
                )

    def mesh_sizes(self) -> dict[str, int]:
        """{axis: size} of `mesh` ({} without one); SettingError on a spec `parse_mesh` refuses."""
        if self.mesh is None:
            return {}

        try:
            return parse_mesh(self.mesh)
        except ValueError as e:  # the message quotes the spec
            raise SettingError("{0}: {e}", "mesh", e=e) from None

    def trajectory(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.TRAJECTORY}


def load_config(spec: str):
    """A ModelConfig from a preset name or a config.json path, with the byte tokenizer's specials
    (SettingError on anything else)."""

    key = spec.replace("-", "_")
    if key in PRESETS:
        cfg = getattr(ModelConfig, key)()
    elif os.path.exists(spec):
        try:
            cfg = ModelConfig.from_hf(spec)
        except (ValueError, KeyError, json.JSONDecodeError, OSError) as e:  # OSError: a directory without one
            raise SettingError("{0} {spec!r}: {e}", "config", spec=spec, e=e) from e
    else:
        raise SettingError(
            "{0} {spec!r}: not a preset ({p}) nor an existing config.json", "config", spec=spec, p=", ".join(PRESETS)
        )
    if cfg.vocab_size < 259:
        raise SettingError(
            "{0} {spec!r}: vocab_size={v} cannot hold the byte tokenizer (256 bytes + bos/eos/pad)",
            "config",
            spec=spec,
            v=cfg.vocab_size,
        )
    # The byte tokenizer's specials, so an exported config.json tells generation where to stop.
    return cfg.replace(bos_token_id=256, eos_token_id=257)
