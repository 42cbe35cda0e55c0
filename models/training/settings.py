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
from models.experts import MOE_TRAINING_IMPLS

DEFAULT_CORPUS = CORPUS_PATH  # inside the package (models/data), so an installed wheel trains with no arguments
PRESETS = ("tiny", "builtin", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3")
DTYPES = ("fp32", "bf16")
AUTO_WARMUP = 60  # the warm-up of a run of 600 steps or more when none is given (a tenth of a shorter run's)


class TrainerError(ValueError):
    """A bad input, setting or checkpoint; the message is one line that names it."""


class SettingError(TrainerError):
    """A bad value of one or more settings. The message names them by field (`steps`); `message(style)`
    names them another way (the command line uses `--steps`)."""

    def __init__(self, template: str, *names: str, **values: Any):
        self.template, self.names, self.values = template, names, values
        super().__init__(self.message(str))

    def message(self, style) -> str:
        own = self.template.format(*(style(n) for n in self.names), **self.values)
        return "; ".join([own, *(e.message(style) for e in self.more)])

    more: tuple[SettingError, ...] = ()  # errors said after this one (`joined`)

    @staticmethod
    def joined(errors: list[SettingError]) -> SettingError:
        """One SettingError saying all of `errors` (non-empty), in order, "; " between them."""
        first = errors[0]
        first.more = (*first.more, *errors[1:])
        first.args = (first.message(str),)
        return first


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
    warmup: int | None = None  # linear warm-up steps; None: `warmup_steps` picks it from `steps`
    weight_decay: float = 0.1  # AdamW decay on matrices (not norms, biases)
    clip: float = 1.0  # global gradient-norm clip (0 = off)
    seed: int = 0  # initialisation and data-order seed
    dtype: str = "fp32"  # compute dtype (DTYPES); parameters stay fp32
    mtp_weight: float = 0.3  # λ of the MTP loss
    balance_alpha: float = 1e-4  # α of the sequence-wise balance loss
    bias_update_rate: float = 1e-2  # γ of the aux-loss-free router-bias update
    moe_impl: str = "auto"  # expert computation (models.experts.MOE_TRAINING_IMPLS, resolve_moe_impl)
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

    # The settings that change the training trajectory: a resumed run must use the same ones, but for `steps`
    # (a resumed run may train to another total, its schedule that of the new total) and a warm-up left out
    # (a resumed run then keeps the checkpoint's).
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
        problems = self.problems()
        if problems:
            raise SettingError.joined(problems)

    def problems(self) -> list[SettingError]:
        """Every bad value, each a SettingError (the constructor raises them joined, so one bad setting does not
        hide the next)."""
        out: list[SettingError] = []
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                out.append(SettingError("{0} must be >= 1, got {v}", name, v=getattr(self, name)))
        if 1 <= self.seq_len < 3:
            out.append(
                SettingError(
                    "{0} must be >= 3 (the MTP loss predicts two tokens ahead), got {v}", "seq_len", v=self.seq_len
                )
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            out.append(SettingError("{0} must be a positive number, got {v}", "lr", v=self.lr))
        for name in ("warmup", "eval_every", "save_every"):
            if (getattr(self, name) or 0) < 0:
                out.append(SettingError("{0} must be >= 0, got {v}", name, v=getattr(self, name)))
        if self.eval_windows < 1:  # every evaluation (the final one at least) reads held-out windows
            out.append(
                SettingError(
                    "{0} must be >= 1 (held-out windows per evaluation), got {v}", "eval_windows", v=self.eval_windows
                )
            )
        if self.warmup is not None and self.steps >= 1 and self.warmup >= self.steps:
            out.append(
                SettingError("{0} ({w}) must be smaller than {1} ({s})", "warmup", "steps", w=self.warmup, s=self.steps)
            )
        if not 0 <= self.min_lr_ratio <= 1:
            out.append(SettingError("{0} must be in [0, 1], got {v}", "min_lr_ratio", v=self.min_lr_ratio))
        for name in ("weight_decay", "clip", "mtp_weight", "balance_alpha", "bias_update_rate"):
            if getattr(self, name) < 0:
                out.append(SettingError("{0} must be >= 0, got {v}", name, v=getattr(self, name)))
        for name, choices in (
            ("dtype", DTYPES),
            ("moe_impl", MOE_TRAINING_IMPLS),
            ("remat", REMAT_POLICIES),
            ("attn_impl", DECOMPRESSED_IMPLS),
        ):
            if getattr(self, name) not in choices:
                out.append(SettingError("{0} must be one of {c}, got {v!r}", name, c=choices, v=getattr(self, name)))
        if self.ce_chunk < 0:
            out.append(SettingError("{0} must be >= 0 (0 = unchunked), got {v}", "ce_chunk", v=self.ce_chunk))
        if self.attn_q_block < 0:
            out.append(
                SettingError("{0} must be >= 0 (0 = all queries at once), got {v}", "attn_q_block", v=self.attn_q_block)
            )
        if self.mesh is not None:
            try:
                data = self.mesh_sizes().get("data", 1)
            except SettingError as e:
                out.append(e)
            else:
                if self.batch_size >= 1 and self.batch_size % data:
                    out.append(
                        SettingError(
                            "{0} {b} is not divisible by data={d} of {1} {spec}: each data rank takes whole sequences",
                            "batch_size",
                            "mesh",
                            b=self.batch_size,
                            d=data,
                            spec=self.mesh,
                        )
                    )
        return out

    @property
    def warmup_steps(self) -> int:
        """The warm-up the schedule uses: `warmup`, or when it is None, min(AUTO_WARMUP, steps // 10), at least 1
        and below `steps` (0 for a 1-step run)."""
        if self.warmup is not None:
            return self.warmup
        return max(0, min(AUTO_WARMUP, max(1, self.steps // 10), self.steps - 1))

    def mesh_sizes(self) -> dict[str, int]:
        """{axis: size} of `mesh` ({} without one); SettingError on a spec `parse_mesh` refuses."""
        if self.mesh is None:
            return {}

        try:
            return parse_mesh(self.mesh)
        except ValueError as e:  # the message quotes the spec
            raise SettingError("{0}: {e}", "mesh", e=e) from None

    def trajectory(self) -> dict[str, Any]:
        """The TRAJECTORY settings as a checkpoint records them (the warm-up as the schedule uses it)."""
        return {k: self.warmup_steps if k == "warmup" else getattr(self, k) for k in self.TRAJECTORY}


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
