"""Sharding as data: every parameter of a DeepSeek model placed on a device mesh by two small tables.

Read in order:
- `PARAM_AXES` names the logical axes of each parameter (by the end of its path in the model:
  `("wq_b", "kernel") -> ("q_lora", "heads")`); a parameter of a scanned stack (`dense_layers`,
  `moe_layers`) gets the logical axis "layers" in front.
- a rules table (`DEFAULT_RULES`) maps each logical axis to a mesh axis, a tuple of mesh axes, or
  None (replicated). Changing the layout is changing this table; modules never name mesh axes.

The default layout (mesh axes `data`, `expert`, `tensor`, see `make_mesh`):
- tensor parallelism over heads: `wq` / `wq_b` and `wkv_b` by their output columns (H·K, whole heads
  per device: the head count must divide), `wo` by its input rows; the MLPs' hidden dim (dense
  layers, shared experts, and the routed experts' own) by `tensor`; embedding and LM head by vocab.
  The all-reduce after `wo` and `down_proj` is GSPMD's, from these placements.
- expert parallelism: the routed experts' leading expert axis over `expert`.
- data parallelism: the batch of the inputs over `data` (`shard_batch`).
- replicated: the stacked layer axis, the LoRA ranks (q_lora, kv_lora: the 576-wide latent has no
  head axis), the model width, the router and every norm.

Fully sharded data parallelism (FSDP, ZeRO-3; `fsdp=True` of `spec_for`, `model_specs`, `model_shardings`,
`shard_model`, what `mla-train --mesh` trains with): on top of the rules, each variable's largest dim that
the rules leave unsharded and that the batch's mesh axes (`rules["batch"]`: `data`) divide is sharded over
them (ties: the first such dim; never the stacked layer axis, which the scan slices one layer at a time;
a variable with no such dim stays as the rules place it). The optimizer state follows the parameters
(`models.training.step.init_train_state`), so a weight, its gradient and its AdamW moments each take 1/data of
the memory the rules alone give them; under `jax.jit` GSPMD gathers each weight where it is used.

    mesh = make_mesh(data=1, expert=2, tensor=2)
    model = shard_model(model, mesh)              # a new model; the argument is left as it was
    model = shard_model(model, mesh, fsdp=True)   # for training: and each variable over `data` (FSDP)
    ids = shard_batch(ids, mesh)
    engine = Engine(model, mesh=mesh, ...)        # models.serving.engine: the page pools replicated on the mesh
                                                  # (with data > 1: a pool per data rank, split over data)

Under `jax.jit` GSPMD partitions the rest (the forward, the training step, the engine's steps); no
module adds a sharding constraint of its own.
"""

from __future__ import annotations

import math
import numbers
from typing import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

MESH_AXES = ("data", "expert", "tensor")

# Logical axes of each parameter of models.DeepSeekModel (unstacked shape), by the end of its path:
# the last two names, else the last one. A parameter that matches no row is an error, so a new
# parameter cannot slip through replicated.
PARAM_AXES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),  # [V, D]
    ("lm_head", "kernel"): ("embed", "vocab"),  # [D, V]
    ("wq", "kernel"): ("embed", "heads"),  # [D, H·(N+R)]  (no q LoRA)
    ("wq_a", "kernel"): ("embed", "q_lora"),  # [D, Q]
    ("wq_b", "kernel"): ("q_lora", "heads"),  # [Q, H·(N+R)]
    ("wkv_a", "kernel"): ("embed", "kv_lora"),  # [D, L+R]
    ("wkv_b", "kernel"): ("kv_lora", "heads"),  # [L, H·(N+V)]
    ("wo", "kernel"): ("heads", "embed"),  # [H·V, D]
    ("gate_proj", "kernel"): ("embed", "mlp"),  # [D, F] dense MLP, shared experts
    ("up_proj", "kernel"): ("embed", "mlp"),  # [D, F]
    ("down_proj", "kernel"): ("mlp", "embed"),  # [F, D]
    ("experts", "gate_proj"): ("experts", "embed", "expert_mlp"),  # [E, D, I]
    ("experts", "up_proj"): ("experts", "embed", "expert_mlp"),  # [E, D, I]
    ("experts", "down_proj"): ("experts", "expert_mlp", "embed"),  # [E, I, D]
    ("gate", "kernel"): ("embed", "router"),  # [D, E] router, fp32
    ("gate", "e_score_correction_bias"): ("router",),  # [E]
    ("eh_proj", "kernel"): ("mtp_concat", "embed"),  # [2D, D]
    ("weight",): ("norm",),  # every RMSNorm
}
STACKS = ("dense_layers", "moe_layers")  # their variables have a leading layer axis

# Logical axis -> mesh axis (str), mesh axes (tuple, sharded over their product) or None (replicated).
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "layers": None,
    "embed": None,
    "vocab": "tensor",
    "heads": "tensor",
    "q_lora": None,
    "kv_lora": None,
    "mlp": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    "router": None,
    "norm": None,
    "mtp_concat": None,
}


def make_mesh(data: int = 1, expert: int = 1, tensor: int = 1, *, devices=None) -> jax.sharding.Mesh:
    """A `Mesh` of shape (data, expert, tensor) over the first data·expert·tensor devices of
    `devices` (default `jax.devices()`); `tensor` is the fastest-varying axis (neighbouring devices).

    ValueError when a size is not an integer >= 1 or the product does not divide the device count.
    """
    sizes = dict(data=data, expert=expert, tensor=tensor)
    for name, n in sizes.items():
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
            raise ValueError(f"make_mesh: {name}={n!r} must be an integer >= 1")
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(sizes.values())
    if len(devices) % n:
        raise ValueError(
            f"make_mesh: data={data} x expert={expert} x tensor={tensor} = {n} devices does not "
            f"divide the {len(devices)} devices available"
        )
    return jax.make_mesh(
        tuple(sizes.values()), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices[:n]
    )


def parse_mesh(spec: str) -> dict[str, int]:
    """'data=2,tensor=2' -> {'data': 2, 'tensor': 2} (the command lines' `--mesh`; axes left out are 1).
    ValueError (one line, naming the spec and the bad part) for an unknown or repeated axis, a part
    without '=', or a size that is not an integer >= 1."""
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, eq, value = part.strip().partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name:
            raise ValueError(
                f"mesh spec {spec!r}: {part.strip()!r} is not axis=size (axes: {', '.join(MESH_AXES)}; "
                f"e.g. data=2,tensor=2)"
            )
        if name not in MESH_AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r} (axes: {', '.join(MESH_AXES)})")
        if name in sizes:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} is given twice")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"mesh spec {spec!r}: {name}={value!r} must be an integer >= 1")
        sizes[name] = int(value)
    return sizes


def path_name(path: tuple) -> str:
    """('moe_layers', 'mlp', 'experts', 'gate_proj') -> 'moe_layers.mlp.experts.gate_proj'."""
    return ".".join(str(p) for p in path)


def logical_axes(path: tuple) -> tuple[str, ...]:
    """The logical axes of the variable at `path` of a DeepSeekModel (its stacked shape)."""
    names = tuple(str(p) for p in path)
    axes = PARAM_AXES.get(names[-2:]) if len(names) >= 2 else None
    if axes is None:
        axes = PARAM_AXES.get(names[-1:])
    if axes is None:
        raise ValueError(f"sharding: parameter {path_name(path)} matches no row of PARAM_AXES")
    return ("layers",) + axes if names[0] in STACKS else axes


def _mesh_axes(logical: str, rules: Mapping, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    if logical not in rules:
        raise ValueError(f"sharding: logical axis {logical!r} has no rule (rules: {sorted(rules)})")
    target = rules[logical]
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    for a in axes:
        if a not in mesh_shape:
            raise ValueError(
                f"sharding: rule {logical!r} -> {a!r}: the mesh has no axis {a!r} (axes: {', '.join(mesh_shape)})"
            )
    return axes


def spec_for(
    path: tuple,
    shape: tuple[int, ...],
    mesh_shape: Mapping[str, int],
    rules: Mapping = DEFAULT_RULES,
    *,
    fsdp: bool = False,
) -> PartitionSpec:
    """The PartitionSpec of the variable at `path` with `shape` (with `fsdp`, one more dim over the batch's
    mesh axes: see the module docstring); ValueError when its rank does not match its row or a sharded
    dim is not divisible by its mesh axes."""
    logical = logical_axes(path)
    if len(logical) != len(shape):
        raise ValueError(
            f"sharding: parameter {path_name(path)} has shape {tuple(shape)}, but its logical axes are {logical}"
        )
    spec = []
    for dim, (name, size) in enumerate(zip(logical, shape)):
        axes = _mesh_axes(name, rules, mesh_shape)
        n = math.prod(mesh_shape[a] for a in axes)
        if size % n:
            over = " x ".join(f"{a}={mesh_shape[a]}" for a in axes)
            raise ValueError(
                f"sharding: parameter {path_name(path)} dim {dim} ({name}, size {size}) is not "
                f"divisible by mesh axis {over}"
            )
        spec.append(None if not axes or n == 1 else axes[0] if len(axes) == 1 else axes)
    if fsdp:
        _fsdp_dim(spec, logical, shape, mesh_shape, rules)
    return PartitionSpec(*spec)


def _fsdp_dim(
    spec: list, logical: tuple[str, ...], shape: tuple[int, ...], mesh_shape: Mapping[str, int], rules: Mapping
) -> None:
    """In place: the largest dim of `spec` left unsharded (not the layer axis) that the batch's mesh axes
    divide, over those axes (the ones the spec does not use already)."""
    used = {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}
    axes = tuple(a for a in _mesh_axes("batch", rules, mesh_shape) if a not in used)
    n = math.prod(mesh_shape[a] for a in axes)
    if n == 1:
        return
    free = [
        d
        for d, (name, size) in enumerate(zip(logical, shape))
        if spec[d] is None and name != "layers" and size % n == 0
    ]
    if free:
        d = max(free, key=lambda d: shape[d])  # the first of the largest
        spec[d] = axes[0] if len(axes) == 1 else axes


def _mesh_shape(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def _check_heads(model, mesh_shape: Mapping[str, int], rules: Mapping) -> None:
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        return
    axes = _mesh_axes("heads", rules, mesh_shape)
    n = math.prod(mesh_shape[a] for a in axes)
    if cfg.num_attention_heads % n:
        over = " x ".join(f"{a}={mesh_shape[a]}" for a in axes)
        raise ValueError(
            f"sharding: num_attention_heads={cfg.num_attention_heads} is not divisible by mesh axis "
            f"{over}: tensor parallelism gives every device whole heads"
        )


def model_specs(model: nnx.Module, mesh, rules: Mapping = DEFAULT_RULES, *, fsdp: bool = False) -> nnx.State:
    """The PartitionSpec of every variable of `model`: an nnx.State of `nnx.state(model)`'s structure whose
    leaves are PartitionSpecs (so `jax.tree.map(f, state, specs)` pairs them). Checks every sharded dim
    (and the head count) against `mesh` (a Mesh or an AbstractMesh). `fsdp`: see the module docstring."""
    shape = _mesh_shape(mesh)
    _check_heads(model, shape, rules)
    flat = [
        (path, v.replace(spec_for(path, v.shape, shape, rules, fsdp=fsdp)))
        for path, v in nnx.to_flat_state(nnx.state(model))
    ]
    return nnx.from_flat_state(flat)


def model_shardings(
    model: nnx.Module, mesh: jax.sharding.Mesh, rules: Mapping = DEFAULT_RULES, *, fsdp: bool = False
) -> nnx.State:
    """`model_specs` as NamedShardings on `mesh` (for `jax.jit`'s in_shardings / out_shardings)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), model_specs(model, mesh, rules, fsdp=fsdp))


def shard_model(
    model: nnx.Module, mesh: jax.sharding.Mesh, rules: Mapping = DEFAULT_RULES, *, fsdp: bool = False
) -> nnx.Module:
    """A copy of `model` with every variable placed on `mesh` by `rules` (`jax.device_put` with a
    `NamedSharding`; with `fsdp`, one more dim of each over the batch's mesh axes, see the module
    docstring); `model` itself is left on its devices. Modules with a `parallel` attribute
    (the MoE) get (mesh, the batch's mesh axes, the experts' mesh axes) there. ValueError (one line,
    naming the parameter, dim and mesh axis) when a sharded dim is not divisible, or the head count
    by the heads' axis."""
    shardings = model_shardings(model, mesh, rules, fsdp=fsdp)
    graphdef, state = nnx.split(model)
    sharded = nnx.merge(graphdef, jax.tree.map(_place, state, shardings))
    # The routed experts run per data rank and per expert rank (models.moe.MoE.parallel).
    shape = _mesh_shape(mesh)
    batch, experts = _mesh_axes("batch", rules, shape), _mesh_axes("experts", rules, shape)
    split = math.prod(shape[a] for a in batch + experts) > 1
    sharded.set_attributes(parallel=(mesh, batch, experts) if split else None, raise_if_not_found=False)
    return sharded


def _place(x, sharding: NamedSharding) -> jax.Array:
    # An array on one device goes through the host: device_put from a device onto a multi-device
    # sharding compiles a resharding program for every array (2.5 s of CPU for the 55 arrays of a
    # micro model on 8 CPU devices); from the host it only sends each device its shard.
    if isinstance(x, jax.Array) and len(x.sharding.device_set) == 1:
        x = np.asarray(x)
    return jax.device_put(x, sharding)


def batch_spec(ndim: int, mesh, rules: Mapping = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec of a [B, ...] input: the batch over `rules["batch"]`, the rest replicated."""
    axes = _mesh_axes("batch", rules, _mesh_shape(mesh))
    lead = None if not axes else axes[0] if len(axes) == 1 else axes
    return PartitionSpec(lead, *([None] * (ndim - 1)))


def batch_axes(mesh, rules: Mapping = DEFAULT_RULES) -> tuple[tuple[str, ...], int]:
    """(the mesh axes the batch is split over by `rules`, their total size); ((), 1) when `mesh` is None or
    the batch is not split."""
    if mesh is None:
        return (), 1
    shape = _mesh_shape(mesh)
    axes = _mesh_axes("batch", rules, shape)
    n = math.prod(shape[a] for a in axes)
    return (axes, n) if n > 1 else ((), 1)


def shard_batch(tree, mesh: jax.sharding.Mesh, rules: Mapping = DEFAULT_RULES):
    """Every array of `tree` (leading axis = batch) placed on `mesh` with its batch split by `rules`;
    ValueError when the batch is not divisible by the batch's mesh axes."""
    shape = _mesh_shape(mesh)
    axes = _mesh_axes("batch", rules, shape)
    n = math.prod(shape[a] for a in axes)

    def put(x):
        if x.shape[0] % n:
            raise ValueError(
                f"sharding: batch of {x.shape[0]} is not divisible by mesh axis "
                + " x ".join(f"{a}={shape[a]}" for a in axes)
            )
        return _place(x, NamedSharding(mesh, batch_spec(x.ndim, mesh, rules)))

    return jax.tree.map(put, tree)
