"""What a run builds from its settings before the first step: the model, the AdamW optimizer and its
learning-rate schedule, the jitted train and eval steps (on one device or a mesh), and the memory check that
refuses a model that cannot fit before anything is allocated.

Precision: fp32 parameters (the master copy), compute in `TrainSettings.dtype` (bf16 casts each weight at use),
fp32 gradients and fp32 AdamW moments (they follow the parameters); see `models.training.step`.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from mla_jax.attention import resolve_decompressed_impl
from mla_jax.sharding import MESH_AXES, make_mesh, model_shardings, model_specs, shard_model
from models.deepseek import DeepSeekModel
from models.experts import resolve_moe_impl
from models.training.settings import SettingError, TrainSettings, load_config
from models.training.step import TrainConfig, init_train_state, loss_fn, make_train_step, optimizer_shardings


def make_optimizer(s: TrainSettings):
    """(optax AdamW with warmup + cosine schedule and global-norm clipping, the schedule)."""
    return _optimizer(s.lr, s.min_lr_ratio, s.warmup_steps, s.steps, s.weight_decay, s.clip)


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
def compiled_steps(tx, tc):
    """The jitted (train_step, eval_step), one pair per (optimizer, loss weights): a second run in the
    same process (a resumed run, a test) reuses the compiled steps instead of compiling again."""

    return make_train_step(tx, tc), make_eval_step(tc)


def compiled_mesh_steps(tx, tc, state_shardings, params_like):
    """(train_step, eval_step) on a mesh: the step returns the state and the AdamW state placed as
    `state_shardings` and `models.training.step.optimizer_shardings` say (not cached: a new Trainer compiles)."""

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
