"""Training a small DeepSeek-style model (MLA + MoE + MTP) on a text corpus: data, schedule, evaluation,
logging, the loss curve, orbax checkpoints with exact resume, and HF-layout export. `mla-train` is
the command line over this module.

    from models.trainer import TrainSettings, train
    result = train(TrainSettings(steps=200, seq_len=128), out="runs/small")      # -> RunResult
    result = train(TrainSettings(steps=400, seq_len=128), out="runs/small", resume=True)

What one step is: `models.training.make_train_step` (CE + λ·MTP + α·sequence-wise balance loss,
AdamW on the Params, then the aux-loss-free router-bias update outside the gradient). This module
adds everything around it; `Trainer` holds one run's pieces and `TrainState` its state between
steps, so a caller can drive the steps itself (`Trainer.init`, `.restore`, `.step`, `.evaluate`, `.save`).

Data: the corpus is split into paragraphs (blank-line separated); the last `HELDOUT_FRACTION`
of them are held out. Each paragraph becomes [bos] + UTF-8 bytes + [eos] (`ByteTokenizer`), and
the paragraphs of each split are concatenated into one token stream. A training batch is B
windows of T tokens at offsets drawn from `numpy.random.default_rng([seed, step])`: the data
order is a pure function of (seed, step), so the step number *is* the data-order RNG state and
resuming at step s draws exactly the batches an uninterrupted run would have drawn.
Evaluation: consecutive non-overlapping T-token windows of the held-out stream (fixed).

Checkpoints (orbax `CheckpointManager`, `<out>/checkpoints/<step>`): every variable of the
model (Params and router biases), the optax state (moments and the schedule's step count) and
a JSON record: the step, the data-order seed, the settings that shape the trajectory, the model
config, the corpus fingerprint and a sha256 of each array tree. Resuming refuses different
settings, another corpus or another model config, and a checkpoint whose files do not read back
exactly as they were saved (truncated, edited, renamed, half written): each is one `TrainerError`
naming the checkpoint directory. A save that fails (a full disk, no permission) is one `TrainerError`
naming the step directory and the cause; its partial files are removed and the earlier checkpoints stay.
SIGINT / SIGTERM during `train`: the current step ends, its checkpoint is saved (even before the first
periodic one), then `Interrupted` (a KeyboardInterrupt) says where; `resume=True` continues from it.

Precision: fp32 parameters (the master copy), compute in `TrainSettings.dtype` (bf16 casts each weight
at use), fp32 gradients and fp32 AdamW moments (they follow the parameters); see `models.training`.

Memory: before anything is allocated, `check_memory` compares what the parameters, their gradients
and the AdamW state need (from shapes alone) with the memory there is, and refuses a model that
cannot fit, with both figures.

A device mesh (`TrainSettings.mesh`, `mla-train --mesh data=2,tensor=2`): fully sharded data parallelism
on top of the tensor / expert rules (`mla_jax.sharding`, `fsdp=True`): every variable and its AdamW
moments sharded over `data` as well, the batch split over `data`, the donated state returned with the
shardings it came with (`models.training.make_train_step(shardings=...)`). Checkpoints hold the global
arrays, so a run may resume on another mesh, or on one device (restored onto the run's own placement).
Several processes (`jax.distributed`, `models.distributed`): every process runs the same loop on the
same batches (the data order is a function of the step) and holds its devices' shards; process 0 alone
writes the metrics, the plot and the export, and orbax writes the checkpoints of all of them.

Errors are `TrainerError` (a bad input, setting or checkpoint; one line); `SettingError`, its
subclass, names the settings at fault so the command line can print them as flags.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from mla_jax.attention import DECOMPRESSED_IMPLS, resolve_decompressed_impl
from mla_jax.config import ModelConfig
from mla_jax.sharding import MESH_AXES, make_mesh, model_shardings, model_specs, parse_mesh, shard_batch, shard_model
from models.checkpoint import save_hf_checkpoint
from models.data import CORPUS_PATH
from models.deepseek import REMAT_POLICIES, DeepSeekModel
from models.moe import MOE_TRAINING_IMPLS, resolve_moe_impl
from models.tokenizer import ByteTokenizer, save_byte_tokenizer
from models.training import TrainConfig, init_train_state, loss_fn, make_train_step, optimizer_shardings

HELDOUT_FRACTION = 0.05
DEFAULT_CORPUS = CORPUS_PATH  # inside the package (models/data), so an installed wheel trains with no arguments
PRESETS = ("tiny", "builtin", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3")
DTYPES = ("fp32", "bf16")
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------
def split_corpus(text: str, heldout_fraction: float = HELDOUT_FRACTION) -> tuple[list[str], list[str]]:
    """(train paragraphs, held-out paragraphs): the last `heldout_fraction` of the blank-line separated
    paragraphs (at least one) are held out. Deterministic; raises TrainerError on fewer than 2 paragraphs."""
    paras = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
    paras = [p for p in paras if p]
    if len(paras) < 2:
        raise TrainerError(f"the corpus needs at least 2 paragraphs (blank-line separated), found {len(paras)}")
    n_held = max(1, int(round(len(paras) * heldout_fraction)))
    return paras[:-n_held], paras[-n_held:]


def token_stream(paragraphs: list[str], tok) -> np.ndarray:
    """int32 [N]: [bos] + bytes + [eos] per paragraph, concatenated."""
    ids: list[int] = []
    for p in paragraphs:
        ids += tok.encode(p, add_bos=True)
        ids.append(tok.eos_id)
    return np.asarray(ids, np.int32)


def train_batch(stream: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int) -> np.ndarray:
    """int32 [B, T]: random windows; the offsets depend only on (seed, step) (see the module docstring)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len + 1, size=batch_size)
    return np.stack([stream[s : s + seq_len] for s in starts])


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """int32 [W, T]: the first `max_windows` consecutive non-overlapping windows of the held-out stream."""
    n = min(len(stream) // seq_len, max_windows)
    return stream[: n * seq_len].reshape(n, seq_len)


def corpus_fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class CorpusData:
    """A corpus made ready for a run: the token streams of both splits and the fixed evaluation windows."""

    train_ids: np.ndarray  # int32 [N_train]
    heldout_ids: np.ndarray  # int32 [N_held]
    windows: np.ndarray  # int32 [W, T]
    fingerprint: str  # corpus_fingerprint of the text


def load_corpus(path: str, seq_len: int, max_windows: int) -> CorpusData:
    """Read, split and tokenize a corpus (TrainerError when it is missing, not UTF-8 or too short)."""

    if os.path.isdir(path):
        raise SettingError("{0} {p!r} is a directory, not a text file", "corpus", p=path)
    if not os.path.isfile(path):
        raise SettingError("{0} {p!r}: no such file", "corpus", p=path)
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            text = f.read()
        except UnicodeDecodeError as e:
            raise SettingError("{0} {p!r} is not UTF-8 text: {e}", "corpus", p=path, e=e) from e
    tok = ByteTokenizer()
    train_paras, held_paras = split_corpus(text)
    train_ids, held_ids = token_stream(train_paras, tok), token_stream(held_paras, tok)
    if len(train_ids) < seq_len + 1:
        raise SettingError(
            "the training split has {n} tokens, fewer than {0} {t} + 1", "seq_len", n=len(train_ids), t=seq_len
        )
    windows = eval_windows(held_ids, seq_len, max_windows)
    if len(windows) == 0:
        raise SettingError(
            "the held-out split has {n} tokens, fewer than one {0} window ({t})", "seq_len", n=len(held_ids), t=seq_len
        )
    return CorpusData(train_ids, held_ids, windows, corpus_fingerprint(text))


# ------------------------------------------------------------------------------------------
# Model, optimizer, steps, memory
# ------------------------------------------------------------------------------------------
def make_optimizer(s: TrainSettings):
    """(optax AdamW with warmup + cosine schedule and global-norm clipping, the schedule)."""
    return _optimizer(s.lr, s.min_lr_ratio, s.warmup, s.steps, s.weight_decay, s.clip)


@functools.lru_cache(maxsize=8)
def _optimizer(lr, min_lr_ratio, warmup, steps, weight_decay, clip):

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=steps, end_value=lr * min_lr_ratio
    )
    # Decay matrices only: norms' scales and 1-D tensors are not weights to shrink toward 0.
    adamw = optax.adamw(
        schedule,
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        weight_decay=weight_decay,
        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
    )
    tx = optax.chain(optax.clip_by_global_norm(clip), adamw) if clip > 0 else adamw
    return tx, schedule


def compute_dtype(s: TrainSettings):
    """The jnp compute dtype of `s.dtype` ("fp32" | "bf16")."""
    return jnp.bfloat16 if s.dtype == "bf16" else jnp.float32


def resolve_attn_impl(s: TrainSettings) -> str:
    """`s.attn_impl` made concrete (`mla_jax.attention.resolve_decompressed_impl`; mla-train's windows are
    unpadded, as the flash attentions need)."""
    return resolve_decompressed_impl(s.attn_impl, dtype=compute_dtype(s), on_mesh=s.mesh is not None)


def train_config(s: TrainSettings):

    return TrainConfig(
        mtp_weight=s.mtp_weight,
        balance_alpha=s.balance_alpha,
        bias_update_rate=s.bias_update_rate,
        remat=s.remat,
        ce_chunk=s.ce_chunk,
        attn_q_block=s.attn_q_block,
        attn_impl=resolve_attn_impl(s),
    )


@functools.lru_cache(maxsize=8)
def _steps(tx, tc):
    """The jitted (train_step, eval_step), one pair per (optimizer, loss weights): a second run in the
    same process (a resumed run, a test) reuses the compiled steps instead of compiling again."""

    return make_train_step(tx, tc), make_eval_step(tc)


def _mesh_steps(tx, tc, state_shardings, params_like):
    """(train_step, eval_step) on a mesh: the step returns the state and the AdamW state placed as
    `state_shardings` and `models.training.optimizer_shardings` say (not cached: a new Trainer compiles)."""

    params_sh = nnx.split_state(state_shardings, nnx.Param, ...)[0]
    opt_sh = optimizer_shardings(tx, params_like, params_sh)
    return make_train_step(tx, tc, shardings=(state_shardings, opt_sh)), make_eval_step(
        tc, jax.tree.leaves(state_shardings)[0].mesh
    )


def make_eval_step(tc, mesh=None):
    """A jitted `eval_step(graphdef, state, ids [W,T]) -> metrics` (loss_fn without the update); on `mesh`
    the metrics come back replicated (readable on every host)."""

    def eval_step(graphdef, state, ids):
        _, metrics = loss_fn(nnx.merge(graphdef, state), {"input_ids": ids}, tc)
        return metrics

    if mesh is None:
        return jax.jit(eval_step, static_argnums=(0,))

    return jax.jit(eval_step, static_argnums=(0,), out_shardings=NamedSharding(mesh, PartitionSpec()))


def build_model(cfg, s: TrainSettings):
    """The DeepSeekModel of a fresh run: initialised from `s.seed`, fp32 parameters, `s.dtype` compute."""

    dtype = compute_dtype(s)
    moe_impl = resolve_moe_impl(s.moe_impl, dtype, training=True)
    return DeepSeekModel(cfg, rngs=nnx.Rngs(s.seed), dtype=dtype, param_dtype=jnp.float32, moe_impl=moe_impl)


def initial_state(s: TrainSettings, cfg=None, mesh=None):
    """(graphdef, state, opt_state) of a fresh run: the model initialised from the seed, AdamW's zero state;
    with `mesh` (`make_train_mesh`), placed on it (FSDP). Also the template a checkpoint is restored into."""

    cfg = load_config(s.config) if cfg is None else cfg
    tx, _ = make_optimizer(s)
    model = build_model(cfg, s)
    if mesh is not None:
        model = shard_model(model, mesh, fsdp=True)
    return init_train_state(model, tx)


def make_train_mesh(s: TrainSettings, cfg):
    """(the Mesh of `s.mesh`, the NamedShardings of the model's variables on it: the rules + FSDP), checked
    against the devices there are and the model's shapes: SettingError on `mesh` (a mesh larger than the
    devices, a head count or width it does not divide). None without a mesh."""
    if s.mesh is None:
        return None

    sizes = s.mesh_sizes()
    try:
        mesh = make_mesh(**sizes)
        return mesh, model_shardings(nnx.eval_shape(lambda: build_model(cfg, s)), mesh, fsdp=True)
    except ValueError as e:
        raise SettingError("{0} {spec}: {e}", "mesh", spec=s.mesh, e=e) from None


def training_memory(cfg, s: TrainSettings) -> dict[str, int]:
    """Bytes a training step holds at least, from shapes alone (nothing is allocated): the model's
    variables, a gradient per parameter and the optimizer state; activations come on top.
    -> {"parameters": count, "variables", "gradients", "optimizer", "total": bytes}; with `s.mesh`, also
    "per_device": the same four figures for the largest shard one device holds (the FSDP layout)."""

    abstract = nnx.eval_shape(lambda: build_model(cfg, s))
    variables = nnx.state(abstract)
    params = nnx.state(abstract, nnx.Param)
    tx, _ = make_optimizer(s)
    opt = jax.eval_shape(tx.init, params)

    def nbytes(tree):
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    out = {
        "parameters": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
        "variables": nbytes(variables),
        "gradients": nbytes(params),
        "optimizer": nbytes(opt),
    }
    out["total"] = out["variables"] + out["gradients"] + out["optimizer"]
    if s.mesh is not None:
        sizes = s.mesh_sizes()
        specs = model_specs(abstract, AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES), fsdp=True)

        def shard_bytes(tree, spec_tree):
            return sum(
                int(np.prod(x.shape))
                * np.dtype(x.dtype).itemsize
                // math.prod(sizes.get(a, 1) for e in spec if e for a in ((e,) if isinstance(e, str) else e))
                for x, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(spec_tree, is_leaf=_is_spec))
            )

        grads = shard_bytes(params, nnx.split_state(specs, nnx.Param, ...)[0])
        dev = {
            "variables": shard_bytes(variables, specs),
            "gradients": grads,
            # the moments follow their parameters; the step counts are a few bytes
            "optimizer": out["optimizer"] * grads // max(out["gradients"], 1),
        }
        dev["total"] = dev["variables"] + dev["gradients"] + dev["optimizer"]
        out["per_device"] = dev
    return out


def _is_spec(x) -> bool:

    return isinstance(x, PartitionSpec)


def available_memory() -> tuple[int, str]:
    """(bytes free for training, where): the accelerator's free memory when jax runs on one, else the
    host's available memory."""

    dev = jax.local_devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"free on the {dev.device_kind}"
    try:
        import psutil  # noqa: PLC0415 (optional: orbax-checkpoint's dependency, not ours)

        return int(psutil.virtual_memory().available), "of available host memory"
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "of host memory"


def _on_accelerator() -> bool:

    return jax.local_devices()[0].platform != "cpu"


def _gb(n: float) -> str:
    return f"{n / 1e12:.1f} TB" if n >= 1e12 else f"{n / 1e9:.2f} GB"


def check_memory(cfg, s: TrainSettings) -> None:
    """SettingError (on `config`) when the parameters, gradients and AdamW state alone exceed the memory
    there is: a model that cannot fit is refused in one line instead of being killed mid-allocation.
    On a mesh of accelerators, one device's shards against one device's free memory (the CPU's devices
    share the host's memory: there, the whole)."""
    need = training_memory(cfg, s)
    have, where = available_memory()
    each = ""
    if "per_device" in need and _on_accelerator():
        need, each = dict(need["per_device"], parameters=need["parameters"]), f" per device on the mesh {s.mesh}"
    if need["total"] > have:
        raise SettingError(
            "{0} {spec!r}: training needs at least {total}{each} ({n:.2f}B parameters: {v} of weights + {g} of "
            "gradients + {o} of AdamW state, before activations), more than the {have} {where}",
            "config",
            spec=s.config,
            total=_gb(need["total"]),
            each=each,
            n=need["parameters"] / 1e9,
            v=_gb(need["variables"]),
            g=_gb(need["gradients"]),
            o=_gb(need["optimizer"]),
            have=_gb(have),
            where=where,
        )


# ------------------------------------------------------------------------------------------
# Evaluation and metrics
# ------------------------------------------------------------------------------------------
def evaluate(eval_step, graphdef, state, windows: np.ndarray, batch_size: int, place=None) -> dict[str, float]:
    """Token-weighted mean CE and MTP loss over the held-out windows (every window has T tokens);
    `place(ids)` puts each chunk where the step wants it (default: `jnp.asarray`)."""

    place = jnp.asarray if place is None else place
    ce = mtp = 0.0
    n = 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        m = eval_step(graphdef, state, place(chunk))
        ce += float(m["ce"]) * len(chunk)
        mtp += float(m["mtp_loss"]) * len(chunk)
        n += len(chunk)
    return {"eval_ce": ce / n, "eval_mtp_loss": mtp / n}


def load_balance(expert_load_NE) -> float:
    """max/mean expert load of the worst MoE layer (1.0 = perfectly balanced)."""
    load = np.asarray(expert_load_NE, np.float64)
    if load.size == 0:
        return 1.0
    return float(np.max(load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-9)))


class MetricsLog:
    """`metrics.jsonl`: one JSON row per training step ({"step", "loss", "ce", ...}) or evaluation
    ({"step", "eval_ce", ...}); `rows` holds what the file holds."""

    def __init__(self, path: str, upto_step: int | None = None, write: bool = True):
        """Keep the rows of an existing file up to `upto_step` (what a resumed run continues; None = none).
        `write=False`: rows in memory only (the processes of a run other than the first)."""
        self.path, self.write = path, write
        self.rows: list[dict] = []
        if upto_step is not None and os.path.isfile(path):
            with open(path) as f:
                self.rows = [r for r in map(json.loads, filter(str.strip, f)) if r["step"] <= upto_step]
        if write:
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.rows)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if not self.write:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def plot_losses(rows: list[dict], path: str) -> None:
    """The loss curve (train and held-out CE, main and MTP head, log scale) as a PNG."""
    # here, not at import: 0.8 s of every tool's start-up (`mla-generate` never plots)
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    train = [r for r in rows if "ce" in r]
    ev = [r for r in rows if "eval_ce" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot([r["step"] for r in train], [r["ce"] for r in train], lw=0.8, alpha=0.8, label="train CE")
        ax.plot(
            [r["step"] for r in train],
            [r["mtp_ce"] for r in train],
            lw=0.8,
            alpha=0.6,
            label="train MTP CE (token i+2)",
        )
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_ce"] for r in ev], "o-", label="held-out CE")
        ax.plot([r["step"] for r in ev], [r["eval_mtp_ce"] for r in ev], "s--", label="held-out MTP CE")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("mla-train")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------
_ITEMS = ("state", "opt_state")


def checkpoint_manager(out: str, create: bool = True, tidy: bool = False):
    """The orbax CheckpointManager of `<out>/checkpoints` (the last two steps are kept). `tidy`: first remove
    the unfinished saves (`*.orbax-checkpoint-tmp*`) a killed run left behind (a run's own manager only: never
    while another process may be saving there)."""

    opts = ocp.CheckpointManagerOptions(max_to_keep=2, create=create, cleanup_tmp_directories=tidy)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(out, "checkpoints")), options=opts)


def tree_sha256(tree) -> str:
    """sha256 over every leaf's key path, dtype, shape and bytes, in tree order."""

    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.ascontiguousarray(host_array(x))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def host_array(x) -> np.ndarray:
    """The whole of a (global) array in this process's memory: sharded over other processes' devices, it
    is gathered from them (a collective: every process must call it, in the same order)."""

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def save_checkpoint(mgr, step: int, state, opt_state, meta: dict) -> None:
    """Write step `step`: both array trees and `meta` plus their checksums (`tree_sha256`), then wait.

    A save that fails (a full disk, no permission) is one TrainerError naming the step directory and the
    cause; its partial files are removed and the earlier checkpoints stay as they were. A KeyboardInterrupt
    during the save removes them too, once orbax's threads have ended, and goes on."""

    meta = {**meta, "step": step, "sha256": {"state": tree_sha256(state), "opt_state": tree_sha256(opt_state)}}
    directory = str(mgr.directory)
    where = os.path.join(directory, str(step))
    existed = os.path.exists(where)
    try:
        with _OrbaxNoiseHeld():
            try:
                mgr.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state),
                        opt_state=ocp.args.StandardSave(opt_state),
                        meta=ocp.args.JsonSave(meta),
                    ),
                    force=True,
                )
                mgr.wait_until_finished()
            except BaseException:
                try:  # orbax's threads write into the folder removed below: let them end first
                    mgr.wait_until_finished()
                except Exception:  # noqa: BLE001 - their error is the one being reported
                    pass
                raise
    except BaseException as e:
        for name in os.listdir(directory) if os.path.isdir(directory) else ():
            if name.startswith(f"{step}.orbax-checkpoint-tmp") or (name == str(step) and not existed):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        try:
            mgr.reload()  # forget the step it did not finish
            last = mgr.latest_step()
        except Exception:  # noqa: BLE001
            last = None
        if not isinstance(e, Exception):  # an interruption: `train` says what there is
            raise
        kept = (
            "there is no earlier checkpoint"
            if last is None
            else f"the last checkpoint, {os.path.join(directory, str(last))}, is intact (--resume continues from it)"
        )
        raise TrainerError(
            f"cannot save checkpoint {where}: {_save_failure(e)}; its partial files were removed; {kept}"
        ) from None


class _OrbaxNoiseHeld:
    """Holds back what orbax and its threads print while a save runs. A failed save logs the traceback of each
    thread that saw the error, tensorstore's callbacks report theirs ("Event loop is closed") and asyncio reports
    every failed write as its task is collected: about a thousand lines, where one line says it all. What a
    save that succeeds logs at WARNING or above is passed on at the end."""

    LOGGERS = ("absl", "asyncio")

    def __enter__(self):
        self.held: list = []
        self.unraisablehook, sys.unraisablehook = sys.unraisablehook, self.held.append
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self._hold)
        return self

    def _hold(self, record) -> bool:
        self.held.append(record)
        return False

    def __exit__(self, exc_type, *_):
        if exc_type is not None:
            gc.collect()  # the failed write tasks go now, while asyncio's reports of them are held
        sys.unraisablehook = self.unraisablehook
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self._hold)
        if exc_type is not None:  # and those collected or reported later (by a thread still ending) are dropped
            for name in self.LOGGERS:
                logging.getLogger(name).addFilter(_not_an_orbax_orphan)
        if exc_type is None:
            for item in self.held:
                if not isinstance(item, logging.LogRecord):
                    self.unraisablehook(item)
                elif item.levelno >= logging.WARNING:
                    logging.getLogger(item.name).handle(item)


def _not_an_orbax_orphan(record) -> bool:
    """False for a late report of a failed save's write error, already said in one line: asyncio's for an orbax
    write task whose error nobody read, and the traceback an orbax thread logs (through absl) as it ends after
    the save has returned."""
    text = record.getMessage()
    if text.startswith("Task exception was never retrieved") and "orbax" in text:
        return False
    return not ("orbax" in record.pathname and "raised an exception" in text)


def _save_failure(e: BaseException) -> str:
    """Why a save failed, in words: the operating system's reason where there is one ("No space left on
    device"; tensorstore reports it as os_error_code=28 inside its message), else the exception's first line."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno)
        code = re.search(r"os_error_code='?(\d+)", str(seen))
        if code:
            return os.strerror(int(code.group(1)))
        seen = seen.__cause__ or seen.__context__
    return _reason(e)


def _reason(e: BaseException) -> str:
    """An exception as a short phrase: its first line, without tensorstore's spec dump."""
    text = (str(e).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def checkpoint_record(mgr, step: int | None = None) -> tuple[int, str, dict]:
    """(step, its directory, its JSON record) of `step` (default the latest), checked to belong to that
    directory; TrainerError when there is none or it cannot be read."""

    try:
        steps = mgr.all_steps()
    except Exception as e:  # noqa: BLE001 - anything orbax cannot list is a damaged directory
        raise TrainerError(f"cannot list the checkpoints in {mgr.directory}: {_reason(e)}") from e
    if not steps:
        raise TrainerError(f"no checkpoint in {mgr.directory} to resume from")
    step = max(steps) if step is None else step
    where = os.path.join(str(mgr.directory), str(step))
    try:
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001
        raise TrainerError(f"checkpoint {where}: its record (meta/metadata) cannot be read: {_reason(e)}") from e
    if not isinstance(meta, dict) or not {"step", "trajectory", "corpus_sha256"} <= meta.keys():
        raise TrainerError(f"checkpoint {where}: its record (meta/metadata) is not one mla-train wrote")
    if meta["step"] != step:
        raise TrainerError(
            f"checkpoint {where} holds step {meta['step']}, not {step}: a step directory renamed or "
            "copied from another run; remove it or restore its name"
        )
    return step, where, meta


def restore_checkpoint(mgr, state_template, opt_template, step: int | None = None):
    """(state, opt_state, meta) of `step` (default the latest), restored into the templates' structure and
    checked against the checksums saved with them. TrainerError, naming the step directory and what is
    wrong, on a missing, truncated, altered or mismatched checkpoint."""

    step, where, meta = checkpoint_record(mgr, step)
    abstract = lambda t: jax.tree.map(ocp.utils.to_shape_dtype_struct, t)  # noqa: E731

    # orbax hands back arrays committed to a device; fresh ones are uncommitted, and jit keys its cache
    # on that, so a resumed run would compile the step again. A host round-trip is exact. A template on a
    # mesh (committed, sharded) is what orbax restored onto: kept as it comes.
    def fresh(tree, template):
        return jax.tree.map(
            lambda x, ref: x if isinstance(ref.sharding, NamedSharding) else jnp.asarray(np.asarray(x)), tree, template
        )

    restored = []
    for item, template in zip(_ITEMS, (state_template, opt_template)):
        try:
            tree = mgr.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(abstract(template))}))
            tree = fresh(tree[item], template)
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds; all mean "unreadable"
            raise TrainerError(f"checkpoint {where}/{item} cannot be read: {_reason(e)}") from e
        saved = meta.get("sha256", {}).get(item)
        if saved is not None and tree_sha256(tree) != saved:
            raise TrainerError(
                f"checkpoint {where}/{item}: the arrays read back differ from those saved (sha256 "
                "mismatch): its files were damaged or changed"
            )
        restored.append(tree)
    return restored[0], restored[1], meta


def _config_record(cfg) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


# ------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------
def export(graphdef, state, directory: str, summary: dict | None = None) -> None:
    """HF layout (config.json + model.safetensors) plus the byte-tokenizer marker, loadable by
    `load_hf_checkpoint` / `load_tokenizer` / `mla-generate --checkpoint`; `summary` -> training.json.
    Of several processes every one calls it (the arrays are gathered from all) and process 0 writes."""

    state = jax.tree.map(host_array, state)  # from every process's devices (a collective)
    if jax.process_index() != 0:
        return
    save_hf_checkpoint(nnx.merge(graphdef, state), directory)
    save_byte_tokenizer(directory)
    if summary is not None:
        with open(os.path.join(directory, "training.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")


def _portable(value):
    """A path inside the package's root (the repository, in a checkout) made relative to it: an exported
    model must not carry this machine's absolute paths."""
    if isinstance(value, str) and os.path.isabs(value) and os.path.commonpath([_PACKAGE_ROOT, value]) == _PACKAGE_ROOT:
        return os.path.relpath(value, _PACKAGE_ROOT)
    return value


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainState:
    """A run between two steps: the model (graphdef + state: Params and router biases), the optax state,
    and the steps done, which is also the data-order RNG state (batch `step` is drawn next)."""

    graphdef: Any
    state: Any
    opt_state: Any
    step: int = 0


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM (`train`): `str()` is the one line to print; `step` the step reached,
    `checkpoint` the directory of the last checkpoint (None when there is none)."""

    def __init__(self, message: str, step: int | None, checkpoint: str | None):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint


class _StopRequest:
    """SIGINT and SIGTERM while a run trains: the first sets `signal` (the loop stops after the current step
    and saves a checkpoint) and says so in one line; a second gives both signals back to their old handlers
    and stops at once (`forced`): KeyboardInterrupt, or, while a checkpoint is being saved (`saving`, the step),
    one line and the process's exit with status 130 (orbax's writer threads cannot be stopped halfway; the
    next run's `checkpoint_manager(tidy=True)` removes what they left). A signal ignored by whoever started
    the process stays ignored, and off the main thread (where Python runs signal handlers) nothing is
    installed. `speak`: print those lines (process 0 of several); `bar`: a progress bar holds the line."""

    def __init__(self, speak: bool = True, bar: bool = False):
        self.signal: int | None = None
        self.forced = False
        self.saving: int | None = None
        self.speak, self.bar = speak, bar
        self._old: dict = {}

    def _say(self, line: str) -> None:
        if self.speak:  # os.write: a handler may run while the main thread is inside a print to stderr
            os.write(2, (("\n" if self.bar else "") + "mla-train: " + line + "\n").encode())

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            old = signal.getsignal(sig)
            if old is not None and old != signal.SIG_IGN:  # None: a handler not set from Python, left alone
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
            self._say(
                f"{signal.Signals(signum).name}: stopping after this step, with a checkpoint (a second signal "
                "quits at once, without it)"
            )
            return
        self.forced = True
        self.restore()
        if self.saving is not None:
            self._say(
                f"interrupted again while saving the checkpoint of step {self.saving}: quit at once without it (the "
                "next run removes its partial files; the earlier checkpoints are kept)"
            )
            try:
                sys.stdout.flush()
            finally:
                os._exit(130)
        raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def _interrupted(mgr, ts: TrainState | None, forced: bool) -> Interrupted:
    """The Interrupted of a run stopped at once (a second signal, or one outside the loop): where it got to
    and the last checkpoint there is."""
    try:
        last = mgr.latest_step()
    except Exception:  # noqa: BLE001
        last = None
    where = None if last is None else os.path.join(str(mgr.directory), str(last))
    what = ("interrupted again" if forced else "interrupted") + ("" if ts is None else f" at step {ts.step}")
    if forced:
        what += ": stopped at once"
    tail = "no checkpoint was saved" if where is None else f"the last checkpoint is {where}; continue with --resume"
    return Interrupted(f"{what}; {tail}", None if ts is None else ts.step, where)


def _directory_problem(path: str) -> str | None:
    """Why `path` cannot be a directory to write in (it, or a folder on the way to it, is a file); None when
    it is a directory or can be made one."""
    p = os.path.normpath(path)
    while p and not os.path.exists(p):
        p = os.path.dirname(p)
    if not p or os.path.isdir(p):
        return None
    return "is a file, not a directory" if p == os.path.normpath(path) else f"{p!r} is a file, not a directory"


@dataclasses.dataclass
class RunResult:
    step: int
    train_ce: float | None
    eval: dict[str, float]
    out: str
    export_dir: str | None


class Trainer:
    """One run's fixed pieces: settings, model config (memory-checked), corpus, optimizer and compiled
    steps. Its methods take and return the `TrainState`; `train` below drives them.

        trainer = Trainer(TrainSettings(steps=100))
        ts = trainer.init()
        ts, row = trainer.step(ts)              # one optimizer step; row: loss, ce, mtp_ce, ..., tokens_per_s
        trainer.evaluate(ts)                    # {"eval_ce", "eval_mtp_loss", "eval_mtp_ce"}
    """

    def __init__(self, settings: TrainSettings, cfg=None):
        self.settings = settings
        self.cfg = load_config(settings.config) if cfg is None else cfg
        layout = make_train_mesh(settings, self.cfg)  # before the memory check: it reads the mesh's shapes
        self.mesh = None if layout is None else layout[0]
        check_memory(self.cfg, settings)
        self.data = load_corpus(settings.corpus, settings.seq_len, settings.eval_windows)
        self.tx, self.schedule = make_optimizer(settings)
        if layout is None:
            self.train_step, self.eval_step = _steps(self.tx, train_config(settings))
        else:
            params = nnx.state(nnx.eval_shape(lambda: build_model(self.cfg, settings)), nnx.Param)
            self.train_step, self.eval_step = _mesh_steps(self.tx, train_config(settings), layout[1], params)

    def init(self) -> TrainState:
        return TrainState(*initial_state(self.settings, self.cfg, self.mesh), step=0)

    def place(self, ids: np.ndarray):
        """int32 [B, T] ids where the steps want them: on the mesh split over `data` (replicated when
        B does not divide, e.g. the last held-out chunk), else as a plain array."""

        if self.mesh is None:
            return jnp.asarray(ids)

        if len(ids) % self.mesh.shape["data"] == 0:
            return shard_batch(ids, self.mesh)
        return jax.device_put(ids, NamedSharding(self.mesh, PartitionSpec()))

    def record(self, step: int) -> dict[str, Any]:
        """The JSON record saved with a checkpoint of `step` (what `restore` checks)."""
        return {
            "step": step,
            "data_seed": self.settings.seed,
            "corpus_sha256": self.data.fingerprint,
            "trajectory": self.settings.trajectory(),
            "model_config": _config_record(self.cfg),
        }

    def save(self, mgr, ts: TrainState) -> None:
        save_checkpoint(mgr, ts.step, ts.state, ts.opt_state, self.record(ts.step))

    def restore(self, mgr) -> TrainState:
        """The latest checkpoint of `mgr`, refused (TrainerError) unless it was written by a run of the same
        corpus, trajectory settings and model config, and reads back exactly as it was saved."""
        step, where, saved = checkpoint_record(mgr)
        if saved["corpus_sha256"] != self.data.fingerprint:
            raise TrainerError(f"checkpoint {where} was trained on another corpus than {self.settings.corpus!r}")
        given = self.settings.trajectory()
        diff = {k: (v, given[k]) for k, v in saved["trajectory"].items() if k in given and given[k] != v}
        if diff:
            raise TrainerError(
                f"checkpoint {where} was trained with other settings (saved/given): "
                + ", ".join(f"{k}={a!r}/{b!r}" for k, (a, b) in diff.items())
            )
        now = _config_record(self.cfg)
        diff = {k: (v, now[k]) for k, v in saved.get("model_config", {}).items() if k in now and now[k] != v}
        if diff:
            raise TrainerError(
                f"checkpoint {where} holds a model of another config than {self.settings.config!r} "
                "(saved/given): " + ", ".join(f"{k}={a!r}/{b!r}" for k, (a, b) in diff.items())
            )
        fresh = self.init()
        state, opt_state, _ = restore_checkpoint(mgr, fresh.state, fresh.opt_state, step)
        return TrainState(fresh.graphdef, state, opt_state, step)

    def step(self, ts: TrainState) -> tuple[TrainState, dict[str, float]]:
        """One optimizer step on batch `ts.step` -> (the next state, its metrics row). FloatingPointError when
        the loss is not finite."""

        s = self.settings
        batch = {"input_ids": self.place(train_batch(self.data.train_ids, ts.step, s.seed, s.batch_size, s.seq_len))}
        t0 = time.perf_counter()
        state, opt_state, m = self.train_step(ts.graphdef, ts.state, ts.opt_state, batch)
        m = jax.device_get(m)
        seconds = time.perf_counter() - t0
        if not math.isfinite(float(m["loss"])):
            raise FloatingPointError(f"loss is {float(m['loss'])} at step {ts.step + 1}; try a lower learning rate")
        row = {
            "step": ts.step + 1,
            "loss": float(m["loss"]),
            "ce": float(m["ce"]),
            "mtp_ce": float(m["mtp_loss"]) / s.mtp_weight if s.mtp_weight > 0 else float("nan"),
            "balance_loss": float(m["balance_loss"]),
            "load_max_over_mean": load_balance(m["expert_load"]),
            "grad_norm": float(m["grad_norm"]),
            "lr": float(self.schedule(ts.step)),
            "tokens_per_s": s.batch_size * s.seq_len / seconds,
        }
        return TrainState(ts.graphdef, state, opt_state, ts.step + 1), row

    def evaluate(self, ts: TrainState) -> dict[str, float]:
        """Held-out CE and MTP loss, and the MTP head's plain CE (the step's "mtp_loss" carries λ)."""
        ev = evaluate(self.eval_step, ts.graphdef, ts.state, self.data.windows, self.settings.batch_size, self.place)
        w = self.settings.mtp_weight
        ev["eval_mtp_ce"] = ev["eval_mtp_loss"] / w if w > 0 else float("nan")
        return ev


def train(
    settings: TrainSettings,
    out: str,
    *,
    resume: bool = False,
    stop_at: int | None = None,
    export_dir: str | None = None,
    progress: bool = True,
    cfg=None,
) -> RunResult:
    """Train per `settings` in the run directory `out` (checkpoints/, metrics.jsonl, loss.png, export/).

    resume: continue from the latest checkpoint in `out` (without it, `out` must hold none).
    stop_at: stop after this step with a checkpoint, as if interrupted (an unfinished run is not exported).
    export_dir: where the finished model goes in HF layout (default `<out>/export`).
    progress: a tqdm bar on stderr; without it, a log line at each evaluation.
    Raises TrainerError on a bad input, setting or checkpoint (or a checkpoint that cannot be saved),
    FloatingPointError on a diverged loss, and `Interrupted` on SIGINT / SIGTERM: called from the main thread,
    the first signal ends the current step, saves its checkpoint and then raises it (`--resume` continues from
    there); a second one stops at once. Of several processes, each must receive the signal (as launchers send
    it): the processes stop together only then.
    """

    if stop_at is not None and stop_at < 1:
        raise SettingError("{0} must be >= 1, got {v}", "stop_at", v=stop_at)
    if settings.attn_impl == "cudnn" and jax.default_backend() != "gpu":
        raise SettingError(
            "{0} cudnn needs a CUDA GPU (cuDNN's flash attention); this machine's backend is {b}",
            "attn_impl",
            b=jax.default_backend(),
        )
    if settings.attn_impl == "mgpu" and jax.default_backend() != "gpu":
        raise SettingError(
            "{0} mgpu needs a Hopper GPU (the Mosaic GPU flash attention kernel); this machine's backend is {b}",
            "attn_impl",
            b=jax.default_backend(),
        )
    for name, d in (("out", out), ("export", export_dir)):
        why = None if d is None else _directory_problem(d)
        if why:
            raise SettingError("{0} {d!r}: {why}", name, d=d, why=why)
    trainer = Trainer(settings, cfg)  # config, memory and corpus are checked before anything is written
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise SettingError("{0} {d!r}: cannot create it: {e}", "out", d=out, e=e.strerror or e) from None
    mgr = checkpoint_manager(out, tidy=True)
    primary = jax.process_index() == 0  # of several processes, one writes the log, the plot and the export
    # SIGINT / SIGTERM: stop after the current step, with a checkpoint
    stop_request = _StopRequest(speak=primary, bar=progress and primary)
    stop_request.install()
    ts = None

    def save(ts: TrainState) -> None:
        stop_request.saving = ts.step
        try:
            trainer.save(mgr, ts)
        finally:
            stop_request.saving = None

    try:
        if resume:
            ts = trainer.restore(mgr)
        elif mgr.latest_step() is not None:
            raise SettingError(
                "{0} {out!r} already holds checkpoints: pass {1}, or choose another {0}", "out", "resume", out=out
            )
        else:
            ts = trainer.init()
        say = functools.partial(print, file=sys.stderr) if primary else lambda *a: None
        log = MetricsLog(os.path.join(out, "metrics.jsonl"), upto_step=ts.step if resume else None, write=primary)
        s = settings
        start = ts.step
        stop = s.steps if stop_at is None else min(stop_at, s.steps)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ts.state))

        def run_eval(ts: TrainState) -> dict[str, float]:
            ev = trainer.evaluate(ts)
            log.append({"step": ts.step, **ev})
            if primary:
                plot_losses(log.rows, os.path.join(out, "loss.png"))
            return ev

        bar = tqdm(
            total=stop,
            initial=start,
            disable=not (progress and primary),
            desc="mla-train",
            dynamic_ncols=True,
            file=sys.stderr,
        )
        if not progress:
            on = "" if trainer.mesh is None else f" on the mesh {s.mesh} ({trainer.mesh.size} devices)"
            say(
                f"mla-train: {n_params / 1e6:.2f}M parameters{on}, {len(trainer.data.train_ids)} train / "
                f"{len(trainer.data.heldout_ids)} held-out tokens, steps {start}->{stop}, attention "
                f"{resolve_attn_impl(s)}"
            )
        train_ce = None
        t_start = time.perf_counter()
        try:
            while ts.step < stop and stop_request.signal is None:
                first = ts.step == start
                ts, row = trainer.step(ts)
                # the step alone (not evaluation or checkpoints); a session's first step includes compiling it
                if first:
                    row["tokens_per_s"] = float("nan")
                log.append(row)
                train_ce = row["ce"]
                bar.update(1)
                bar.set_postfix(
                    loss=f"{row['ce']:.3f}",
                    mtp=f"{row['mtp_ce']:.3f}",
                    tok_s=f"{row['tokens_per_s']:.0f}",
                    load=f"{row['load_max_over_mean']:.2f}",
                    refresh=False,
                )
                if stop_request.signal is not None:  # no evaluation, no export: the checkpoint below, then stop
                    break
                if s.eval_every and ts.step % s.eval_every == 0 and ts.step != stop:
                    ev = run_eval(ts)
                    msg = f"step {ts.step}: train CE {train_ce:.4f}, held-out CE {ev['eval_ce']:.4f} nats/token"
                    if progress and primary:
                        bar.write(msg, file=sys.stderr)
                    elif not progress:
                        say("mla-train: " + msg)
                if s.save_every and ts.step % s.save_every == 0 and ts.step != stop:
                    save(ts)
        finally:
            bar.close()
        if mgr.latest_step() != ts.step and ts.step > 0:
            save(ts)
        stop_request.restore()  # from here on (evaluation, export) a signal interrupts as it would anywhere
        if stop_request.signal is not None:
            if ts.step == 0:
                raise Interrupted("interrupted before the first step: nothing to save", 0, None)
            where = os.path.join(str(mgr.directory), str(ts.step))
            raise Interrupted(
                f"interrupted at step {ts.step}: checkpoint saved to {where}; continue with --resume", ts.step, where
            )
        ev = run_eval(ts)
        last_ce = float("nan") if train_ce is None else train_ce
        say(
            f"mla-train: step {ts.step}/{s.steps}: train CE {last_ce:.4f}, "
            f"held-out CE {ev['eval_ce']:.4f} nats/token ({ev['eval_ce'] / math.log(2):.3f} bits), "
            f"held-out MTP CE {ev['eval_mtp_ce']:.4f}"
        )
        done_dir = None
        if ts.step >= s.steps:  # an interrupted run (stop_at) is not a finished model
            done_dir = export_dir or os.path.join(out, "export")
            run_args = {
                "out": out,
                **dataclasses.asdict(s),
                "stop_at": stop_at,
                "resume": resume,
                "export": export_dir,
                "attn_impl_used": resolve_attn_impl(s),
            }
            summary = {
                "step": ts.step,
                "train_ce_last_step": train_ce,
                **ev,
                "train_seconds_this_session": round(time.perf_counter() - t_start, 1),
                "heldout_tokens_evaluated": int(trainer.data.windows.size),
                "parameters": n_params,
                "corpus_sha256": trainer.data.fingerprint,
                "args": {k: _portable(v) for k, v in run_args.items()},
            }
            try:
                export(ts.graphdef, ts.state, done_dir, summary)
            except OSError as e:  # a full disk: the checkpoint of the last step is saved
                raise SettingError(
                    "{0} {d!r}: cannot write the exported model: {e} (the checkpoint of step {n} is saved)",
                    "export",
                    d=done_dir,
                    e=e.strerror or e,
                    n=ts.step,
                ) from None
            say(f"mla-train: exported to {done_dir}")
        return RunResult(ts.step, train_ce, ev, out, done_dir)
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted):
            raise
        raise _interrupted(mgr, ts, stop_request.forced) from None
    finally:
        stop_request.restore()
        mgr.close()
