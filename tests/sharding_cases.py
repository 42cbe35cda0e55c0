"""The multi-device half of tests/test_sharding.py, run there in ONE subprocess with 8 CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, which this script sets before jax starts; the
rest of the suite keeps its one device).

For each mesh in MESHES it shards a micro model (`mla_jax.sharding.shard_model`) and an input batch
(`shard_batch`), runs the same jitted forward (logits and MTP logits), on EAGER_MESHES the same forward
eagerly (`model(ids, with_mtp=True)`, no jit: the MTP layer's MoE then runs outside any trace) and, for
the meshes in TRAIN_MESHES, one training step (`models.training.step.make_train_step`, AdamW), and prints one JSON line
a mesh: the largest differences from the single-device run and the shard shapes of a few
parameters as `addressable_shards` hold them. On FSDP_MESH it also runs the step of fully sharded
data parallelism (`shard_model(..., fsdp=True)`, the state's shardings pinned). The tests assert on
those lines.

    python tests/sharding_cases.py [--ci] [mesh ...]   # default: every mesh of MESHES (--ci: CI_MESHES,
                                                       # the eager forward on CI_EAGER_MESHES only, no
                                                       # fp8-paged sampled engine, no benchmark cell, no
                                                       # plain training step)
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

# Before jax starts: 8 CPU devices, and XLA's CPU backend without LLVM's expensive passes (each
# mesh compiles its own forward and step; these tiny programs compile in half the time), and one
# thread a device for its matmuls: 8 devices' thread pools on a 2-core machine only contend
# (the whole script 84 -> 71 s, 114 -> 98 s of CPU).
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
        "--xla_cpu_multi_thread_eigen=false",
    ]
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mla_jax.capacity import plan_kv_cache  # noqa: E402
from mla_jax.sharding import make_mesh, shard_batch, shard_model  # noqa: E402
from models import DeepSeekModel  # noqa: E402
from models.serving.engine import Engine  # noqa: E402
from models.serving.sampling import SamplingParams  # noqa: E402
from models.training.loop import checkpoint_manager, restore_checkpoint, save_checkpoint  # noqa: E402
from models.training.step import TrainConfig, init_train_state, make_train_step  # noqa: E402
from tests.micro_configs import MICRO_V3  # noqa: E402

# Eight heads and eight experts, so that tensor=8 and expert=8 still give every device whole heads and
# whole experts; 1 dense layer then 2 MoE layers (a scan of more than one), and the MTP module, an MoE
# layer as in DeepSeek-V3.
CFG = MICRO_V3.replace(num_hidden_layers=3, num_attention_heads=8, n_routed_experts=8)
B, T = 4, 8
MESHES = {  # name: (data, expert, tensor)
    "tp2": (1, 1, 2),
    "tp4": (1, 1, 4),
    "tp8": (1, 1, 8),
    "ep2": (1, 2, 1),
    "ep4": (1, 4, 1),
    "ep8": (1, 8, 1),
    "dp2": (2, 1, 1),
    "dp2ep2": (2, 2, 1),
    "ep2tp2": (1, 2, 2),
    "mixed": (2, 2, 2),
}
# A step compiles in ~12 s of CPU, a forward in ~3: the test runs the step on the mixed mesh alone
# (every axis at once: tensor- and expert-sharded gradients, the all-reduce over data);
# `python tests/sharding_cases.py --train-all` runs it on every mesh.
TRAIN_MESHES = ("mixed",)
FSDP_MESH = "mixed"  # the same step under FSDP: every variable and AdamW moment also split over data
# The eager forward (`model(ids, with_mtp=True)`, no jit; ~6 s of CPU a mesh, its ops compiled one by one) on
# every combination of the axes MoE.parallel maps over: expert alone, data alone, data + expert, expert +
# tensor, all three. (On tensor alone MoE.parallel is off: the eager path is GSPMD's, as under jit.)
EAGER_MESHES = ("ep4", "dp2", "dp2ep2", "ep2tp2", "mixed")
# The suite's quick tier (tests/tiers.py; test_sharding.CI_MESHES): eight-way tensor and expert parallelism,
# data alone, every axis at once (two ways each); the eager forward on every axis at once (its expert axis is
# the one whose eager shard_map failed). Without the fp8-paged sampled engine on DP_FULL_MESH and the
# benchmark's cell on BENCH_MESH (`full_only`: ~30 s of the script's CPU on two cores), and without the plain
# training step (TRAIN_MESHES; FSDP_MESH's step runs: the same step, its state also split over data).
CI_MESHES = ("tp8", "ep8", "dp2", "mixed")
CI_EAGER_MESHES = ("mixed",)
PROMPT_LEN = 3  # greedy decoding fills positions PROMPT_LEN..T-1
# The paged-cache engine, greedy with MTP speculation (~6 s of CPU a mesh); on a data > 1 mesh a pool
# per data rank. On DP_FULL_MESH also the case of one rank out of pages (DP_FULL_PROMPTS), on the same
# compiled steps (the same B, pool, chunk and block-table shapes).
ENGINE_MESHES = ("tp2", "dp2", "mixed")  # tp2: the pool replicated (data = 1)
CI_ENGINE_MESHES = ("dp2", "mixed")  # the quick tier: mixed's tensor devices of a data rank replicate its pool
ENGINE_PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
DP_FULL_MESH = "dp2"
BENCH_MESH = "mixed"  # mla-bench e2e --mesh, in this process: _bench_e2e
KERNEL_MESH = "mixed"  # the data ranks' maps of the kernels' path (KVCache.map_pages, gather): _cache_kernels
DP_FULL_PROMPTS = [list(range(1, 17)), [7, 8, 9], [11, 12, 13]]
# The parameters whose placement the tests read: path in nnx.state(model) -> a short name.
WATCHED = {
    "wq_b": ("moe_layers", "self_attn", "wq_b", "kernel"),
    "wkv_b": ("moe_layers", "self_attn", "wkv_b", "kernel"),
    "wo": ("moe_layers", "self_attn", "wo", "kernel"),
    "wkv_a": ("moe_layers", "self_attn", "wkv_a", "kernel"),
    "experts_gate": ("moe_layers", "mlp", "experts", "gate_proj"),
    "experts_down": ("moe_layers", "mlp", "experts", "down_proj"),
    "mtp_experts_gate": ("mtp", 0, "block", "mlp", "experts", "gate_proj"),
    "dense_up": ("dense_layers", "mlp", "up_proj", "kernel"),
    "router": ("moe_layers", "mlp", "gate", "kernel"),
    "embed": ("embed_tokens", "embedding"),
    "lm_head": ("lm_head", "kernel"),
}


def _leaf(state, path):
    for p in path:
        state = state[p]
    return state[...]


def _placement(x: jax.Array) -> dict:
    """The shard shape every device holds and on how many devices (all shards must agree in shape)."""
    shapes = {tuple(s.data.shape) for s in x.addressable_shards}
    return dict(
        shard_shape=sorted(shapes)[0] if len(shapes) == 1 else sorted(shapes),
        devices=len({s.device for s in x.addressable_shards}),
        distinct=len({s.index for s in x.addressable_shards}),
    )


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _forward(graphdef, state, ids):
    logits, mtp = nnx.merge(graphdef, state)(ids, with_mtp=True)
    return logits, mtp


FORWARD = jax.jit(_forward, static_argnums=(0,))
# AdamW with eps = 1: its first update is lr·g/(|g| + 1), about SGD's for these small gradients, so the
# updated parameters are the gradients' image and a gradient that lost its all-reduce shows at full
# size (with the usual eps, m / sqrt(v) = sign(g) turns rounding noise in near-zero gradients into steps
# of size lr); and it has moments, which FSDP must shard with the weights.
TX = optax.adamw(0.5, eps=1.0)
TC = TrainConfig(bias_update_rate=1e-2)
STEP = make_train_step(TX, TC)


COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def _collectives(graphdef, state, ids) -> list[list[str]]:
    """[[op, result type], ...] of every collective in the compiled forward (a cache hit, no new
    compile); a tuple result (several arrays reduced at once) is one entry per array."""
    hlo = FORWARD.lower(graphdef, state, ids).compile().as_text()
    return [[m.group(2), t] for m in COLLECTIVE.finditer(hlo) for t in re.findall(r"[a-z]+\d*\[[\d,]*\]", m.group(1))]


def _eager(model, ids, ref_logits, ref_mtp) -> dict:
    """`model(ids, with_mtp=True)` outside any jit: the largest differences from the single-device
    (jitted) logits and MTP logits, or the error it raised (one line)."""
    t0 = time.process_time()
    try:
        logits, mtp = model(ids, with_mtp=True)
    except Exception as e:  # the test prints it
        return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    return dict(
        error=None,
        logits_diff=_max_diff(logits, ref_logits),
        mtp_diff=_max_diff(mtp, ref_mtp),
        cpu_s=time.process_time() - t0,
    )


def _greedy(graphdef, state, ids, place):
    """Greedy tokens for positions PROMPT_LEN..T-1 by recomputing the whole (causal) forward each step,
    the batch placed by `place`: the same [B, T] program as the forward, so no new compile (this is
    greedy decoding by the model, not through the paged-cache engine)."""
    ids = np.array(ids)
    for t in range(PROMPT_LEN, T):
        logits, _ = FORWARD(graphdef, state, place(jnp.asarray(ids)))
        ids[:, t] = np.argmax(np.asarray(logits[:, t - 1]), axis=-1)
    return ids[:, PROMPT_LEN:].tolist()


def _engine(model, mesh):
    """(greedy tokens with MTP speculation, the page pools after the run) of an engine whose pool is
    the default one (what the planner predicts) for 2 sequences of 16 tokens: 6 pages of 8 tokens,
    3 a data rank on a data=2 mesh. Block tables are 4 pages wide at every step (min_table_tokens)."""
    e = Engine(model, page_size=8, max_batch=2, max_context=16, kv_dtype=jnp.float32, min_table_tokens=32, mesh=mesh)
    r = e.generate(ENGINE_PROMPTS, max_new_tokens=6, sampling=SamplingParams(temperature=0.0), use_mtp=True)
    return r.tokens, e.cache.pages


def _engine_full(model, mesh):
    """DP_FULL_PROMPTS (16, 3, 3 tokens) for 10 new tokens each, greedy with MTP, on _engine's shapes
    (6 pages, 2 slots) with max_context 32: on one device the 6 pages hold the 16-token prompt's 4
    pages and another's 2; on data=2 each rank holds 3, so the long request runs out on its rank.
    -> dict(tokens, reasons, errors)."""
    e = Engine(
        model,
        page_size=8,
        num_pages=6,
        max_batch=2,
        max_context=32,
        kv_dtype=jnp.float32,
        min_table_tokens=32,
        mesh=mesh,
    )
    r = e.generate(DP_FULL_PROMPTS, max_new_tokens=10, sampling=SamplingParams(temperature=0.0), use_mtp=True)
    return dict(tokens=r.tokens, reasons=r.finish_reasons, errors=r.errors, compiled=e.compile_log)


def _engine_fp8_sampled(model, mesh):
    """ENGINE_PROMPTS on fp8 pages, sampled (temperature 0.8, seed 11; no MTP: its steps would compile
    twice more), on _engine's shapes: the quantising cache write and the dequantising gather inside the
    data ranks' maps, and the sampler's per-request keys, on `mesh` (None: one device). `model` has a
    128-wide latent (fp8 pages hold 128-value scale blocks). -> dict(tokens, pages_shape, pages_dtype,
    pages_placement)."""
    e = Engine(model, page_size=8, max_batch=2, max_context=16, kv_dtype="fp8", min_table_tokens=32, mesh=mesh)
    r = e.generate(ENGINE_PROMPTS, max_new_tokens=6, sampling=SamplingParams(temperature=0.8, seed=11))
    return dict(
        tokens=r.tokens,
        pages_shape=list(e.cache.pages.shape),
        pages_dtype=str(e.cache.pages.dtype),
        pages_placement=_placement(e.cache.pages),
    )


def _cache_kernels(mesh) -> dict:
    """The data ranks' maps of the kernels' path on `mesh` (data = 2): `KVCache.map_pages` (what the layer
    runs `mla_decode` through) and `KVCache.gather`, on bf16 pages [2 layers, 6, 64, 576] split 3 a rank,
    read at layer 1, rows 0 and 1 on ranks 0 and 1 with LOCAL page ids, every page no row reads NaN.
    -> the largest differences from each rank's own pages read on one device (map_pages with
    `mla_decode_reference` inside, the jnp gather), and, lowered for sm_90 with impl "kernel", the
    Mosaic GPU calls in the program and the mesh axes its maps are manual over."""
    from mla_jax.kv_cache import KVCache
    from pallas_kernels import mla_decode
    from pallas_kernels.mla_decode import mla_decode_reference

    rng = np.random.default_rng(3)
    pages = rng.standard_normal((2, 6, 64, 576)).astype(np.float32)
    table, lens = np.array([[2, 0], [1, 2]], np.int32), np.array([100, 70], np.int32)
    for r in range(2):
        for i in set(range(3)) - set(table[r]):
            pages[:, 3 * r + i] = np.nan
    pages = jnp.asarray(pages, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, 1, 16, 576)), jnp.bfloat16)

    def run(impl, q, pages, table, lens):
        c = KVCache.create(pages, table, lens, impl=impl, data_parallel=(mesh, ("data",))).at_layer(1)
        dec = c.map_pages(
            lambda p, t, o, q, n: mla_decode(q, p, t, n, softmax_scale=0.1, causal=True, impl=impl, page_offset=o)[0],
            q,
            c.lengths,
        )
        return dec, c.gather(dtype=jnp.float32)

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(q, P("data", None, "tensor")), put(pages, P(None, "data")), put(table, P("data")), put(lens, P("data")))
    f = jax.jit(run, static_argnums=0)
    dec, (ctx, pos) = f("reference", *args)
    want = jnp.concatenate(
        [
            mla_decode_reference(
                q[r : r + 1],
                pages[1, 3 * r : 3 * r + 3],
                table[r : r + 1],
                lens[r : r + 1],
                softmax_scale=0.1,
                causal=True,
            )[0]
            for r in range(2)
        ]
    )
    own = np.stack([np.asarray(pages[1, 3 * r + table[r]], np.float32).reshape(128, 576) for r in range(2)])
    seen = np.asarray(pos)[..., None] >= 0
    text = f.trace("kernel", *args).lower(lowering_platforms=("cuda",)).as_text()
    # one sdy.manual_computation a map: the axes it is manual over, the pool's shape inside it
    maps = [
        dict(axes=sorted(re.findall(r'"(\w+)"', axes)), pool=pool)
        for axes, pool in re.findall(r"sdy\.manual_computation.*?manual_axes=\{([^}]*)\} \(%\w+: tensor<([^>]*)>", text)
    ]
    return dict(
        decode_diff=_max_diff(dec, want),
        decode_finite=bool(jnp.all(jnp.isfinite(dec.astype(jnp.float32)))),
        gather_diff=float(np.max(np.abs(np.where(seen, np.asarray(ctx) - own, 0.0)))),
        gather_positions=np.asarray(pos)[:, ::32].tolist(),
        out_spec=str(dec.sharding.spec),
        mosaic_calls=len(re.findall(r"custom_call @mosaic_gpu", text)),
        maps=maps,
    )


def _bench_e2e() -> dict:
    """`mla-bench e2e --mesh 1 --mesh data=2,tensor=2`: the tiny V2-Lite cut (bf16, one MoE layer), B=2,
    16-token prompts, 4 new tokens, in this process on 1 and then 4 of its 8 devices -> {"rows": {impl: the
    row}, "png": the plot's first bytes, "meta": the run's e2e_meta.json}. The suite's one tiny e2e cell
    end to end (tests/test_sharding.py asserts on the one-device row as on the mesh one)."""
    from benchmarks import bench_e2e as e2e

    out = tempfile.mkdtemp()
    e2e.main(
        [
            "--config",
            "tiny",
            "--layers",
            "1",
            "--model",
            "v2-lite",
            "--batch",
            "2",
            "--prompt",
            "16",
            "--new-tokens",
            "4",
            "--no-hf",
            "--in-process",
            "--mesh",
            "1",
            "--mesh",
            "data=2,tensor=2",
            "--out",
            out,
        ]
    )
    rows = e2e.bm.read_csv(os.path.join(out, e2e.CSV_NAME))
    with open(os.path.join(out, "e2e.png"), "rb") as f:
        png = list(f.read(8))
    meta = e2e.read_meta(out)
    return dict(
        rows={r["impl"]: r for r in rows},
        png=png,
        meta=dict(bandwidth_gbps=meta["ceilings"]["bandwidth_gbps"], command=meta["command"]),
    )


def _train(model, batch):
    """(state before, state after, metrics) of one step. The step donates the state it is given (its
    buffers are the model's own), so it gets a copy: `model` stays usable for the next mesh."""
    graphdef, state, opt_state = init_train_state(model, TX)
    state_out, _, metrics = STEP(graphdef, jax.tree.map(lambda a: a.copy(), state), opt_state, batch)
    return state, state_out, metrics


def _kept(a, b) -> bool:
    return all(x.sharding.is_equivalent_to(y.sharding, x.ndim) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _fsdp_train(model, mesh, batch) -> dict:
    """One step under FSDP (the state's shardings pinned, as mla-train --mesh runs it): (state before,
    state after, metrics, what the tests read): the placements of a few parameters and of their AdamW
    moments before and after the step, and the stepped state through mla-train's checkpoint functions,
    restored onto its own placement and onto one device (a resumed run may change its mesh)."""
    graphdef, state, opt_state = init_train_state(shard_model(model, mesh, fsdp=True), TX)
    step = make_train_step(TX, TC, shardings=jax.tree.map(lambda x: x.sharding, (state, opt_state)))
    before = _fsdp_placements(state, opt_state)
    state_out, opt_out, metrics = step(graphdef, *jax.tree.map(lambda a: a.copy(), (state, opt_state)), batch)
    out = dict(
        before=before,
        after=_fsdp_placements(state_out, opt_out),
        shardings_kept=_kept((state, opt_state), (state_out, opt_out)),
    )
    # Two arrays of each tree (a weight split over data and tensor, its moment): orbax's time grows with
    # the shards it writes (the whole state: 12 s of CPU), the path through restore_checkpoint does not.
    pick = lambda st, mu: (
        {"wq_b": _leaf(st, WATCHED["wq_b"]), "embed": _leaf(st, WATCHED["embed"])},  # noqa: E731
        {"wq_b": _leaf(mu, WATCHED["wq_b"])},
    )
    saved = pick(state_out, opt_out[0].mu)
    with tempfile.TemporaryDirectory() as d:
        mgr = checkpoint_manager(d)
        save_checkpoint(mgr, 1, *saved, {"trajectory": {}, "corpus_sha256": ""})
        on_mesh = restore_checkpoint(mgr, *pick(state, opt_state[0].mu))
        one_device = restore_checkpoint(mgr, *jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), saved))
        mgr.close()
    for name, (s, o, _) in (("restored_on_mesh", on_mesh), ("restored_on_one_device", one_device)):
        out[name] = dict(
            diff=_max_diff((s, o), saved),
            devices=sorted({len(x.sharding.device_set) for x in jax.tree.leaves((s, o))}),
            shardings_kept=_kept((s, o), saved),
        )
    return state, state_out, metrics, out


def _fsdp_placements(state, opt_state) -> dict:
    """Shard shapes of a few parameters and of their AdamW moments, and the variables (moments) not split
    over `data`: each as its path."""
    adam = opt_state[0]  # optax.adamw: chain(scale_by_adam, add_decayed_weights, scale_by_lr)
    watched = ("wq_b", "experts_gate", "router", "embed")

    def not_data(tree):
        return [
            jax.tree_util.keystr(p)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if x.ndim and "data" not in jax.tree.leaves(tuple(x.sharding.spec))
        ]

    return dict(
        params={k: _placement(_leaf(state, WATCHED[k])) for k in watched},
        mu={k: _placement(_leaf(adam.mu, WATCHED[k])) for k in watched},
        nu={k: _placement(_leaf(adam.nu, WATCHED[k])) for k in watched},
        norm=_placement(state["norm"]["weight"][...]),
        not_over_data=not_data(state) + not_data(adam.mu) + not_data(adam.nu),
    )


def micro_model(cfg=CFG) -> DeepSeekModel:
    """`cfg` with random weights drawn by numpy (eager or jitted nnx init costs seconds of CPU); norms
    around 1, the rest N(0, 0.1), the router bias nonzero, so no two heads or experts are alike."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    flat = [
        (path, v.replace(jnp.asarray((rng.normal(0, 0.1, v.shape) + (path[-1] == "weight")).astype(v.dtype))))
        for path, v in nnx.to_flat_state(state)
    ]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def main(names, train=TRAIN_MESHES, eager=EAGER_MESHES, full_only=True, engine=ENGINE_MESHES):
    model = micro_model()
    ids = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size, dtype=jnp.int32)
    mask = jnp.ones((B, T), jnp.int32).at[1, :3].set(0)  # one left-padded row
    graphdef, state = nnx.split(model)
    ref_logits, ref_mtp = FORWARD(graphdef, state, ids)
    ref_tokens = _greedy(graphdef, state, ids, lambda x: x)
    _, ref_state, ref_metrics = _train(model, dict(input_ids=ids, attention_mask=mask))
    ref_engine, _ = _engine(model, None)
    ref_full = _engine_full(model, None) if DP_FULL_MESH in names else None
    fp8 = full_only and DP_FULL_MESH in names
    model8 = micro_model(CFG.replace(kv_lora_rank=128)) if fp8 else None
    ref_fp8 = _engine_fp8_sampled(model8, None) if fp8 else None
    print(json.dumps(dict(case="devices", count=jax.device_count(), cpu_s=time.process_time())), flush=True)
    for name in names:
        t0 = time.process_time()
        data, expert, tensor = MESHES[name]
        mesh = make_mesh(data=data, expert=expert, tensor=tensor)
        sharded = shard_model(model, mesh)
        s_ids = shard_batch(ids, mesh)
        g, s_state = nnx.split(sharded)
        logits, mtp = FORWARD(g, s_state, s_ids)
        out = dict(
            case=name,
            mesh=dict(data=data, expert=expert, tensor=tensor),
            logits_diff=_max_diff(logits, ref_logits),
            mtp_diff=_max_diff(mtp, ref_mtp),
            logits_scale=float(jnp.max(jnp.abs(ref_logits))),
            ids_placement=_placement(s_ids),
            tokens=_greedy(g, s_state, ids, lambda x: shard_batch(x, mesh)),
            ref_tokens=ref_tokens,
            placements={k: _placement(_leaf(s_state, p)) for k, p in WATCHED.items()},
            collectives=_collectives(g, s_state, s_ids),
            untouched=all(len(a.sharding.device_set) == 1 for a in jax.tree.leaves(nnx.state(model))),
        )
        if name in eager:
            out["eager"] = _eager(sharded, s_ids, ref_logits, ref_mtp)
        if data > 1:
            try:
                shard_batch(ids[: data + 1], mesh)
                out["odd_batch_error"] = None
            except ValueError as e:
                out["odd_batch_error"] = str(e)
        if name in engine:
            t1 = time.process_time()
            tokens, pages = _engine(sharded, mesh)
            # The latent has no head axis: under tensor parallelism every device holds the whole pool; with
            # data > 1 the sequences are split over data (the planner's dp_attention over `data` ranks).
            plan = plan_kv_cache(
                CFG,
                context_len=16,
                num_sequences=2,
                page_size=8,
                kv_dtype="fp32",
                tp=data if data > 1 else tensor,
                dp_attention=data > 1,
                include_mtp=True,
                draft_tokens=3,
            )
            out["engine"] = dict(
                tokens=tokens,
                ref_tokens=ref_engine,
                pages_replicated=pages.sharding.is_fully_replicated,
                pages_shape=list(pages.shape),
                pages_placement=_placement(pages),
                shard_bytes=sorted({s.data.nbytes for s in pages.addressable_shards}),
                planned_per_device_bytes=plan.mla.per_device_bytes,
            )
            if name == DP_FULL_MESH:
                out["engine"]["full"] = _engine_full(sharded, mesh)
                out["engine"]["ref_full"] = ref_full
            if name == DP_FULL_MESH and fp8:
                t2 = time.process_time()
                out["engine"]["fp8_sampled"] = _engine_fp8_sampled(shard_model(model8, mesh), mesh)
                out["engine"]["ref_fp8_sampled"] = ref_fp8
                out["engine"]["fp8_sampled_cpu_s"] = time.process_time() - t2
            out["engine"]["cpu_s"] = time.process_time() - t1
        if name == BENCH_MESH and full_only:
            t1 = time.process_time()
            out["bench_e2e"] = _bench_e2e()
            out["bench_e2e_cpu_s"] = time.process_time() - t1
        if name == KERNEL_MESH:
            t1 = time.process_time()
            out["cache_kernels"] = _cache_kernels(mesh)
            out["cache_kernels"]["cpu_s"] = time.process_time() - t1
        if name in train:
            batch = shard_batch(dict(input_ids=ids, attention_mask=mask), mesh)
            s_in, s_out, metrics = _train(sharded, batch)
            kept = all(
                a.sharding.is_equivalent_to(b.sharding, a.ndim)
                for a, b in zip(jax.tree.leaves(s_in), jax.tree.leaves(s_out))
            )
            out["train"] = dict(
                loss_diff=abs(float(metrics["loss"]) - float(ref_metrics["loss"])),
                loss=float(metrics["loss"]),
                params_diff=_max_diff(s_out, ref_state),
                params_moved=_max_diff(s_out, s_in),
                shardings_kept=kept,
                wq_b_after=_placement(_leaf(s_out, WATCHED["wq_b"])),
                experts_after=_placement(_leaf(s_out, WATCHED["experts_gate"])),
            )
        if name == FSDP_MESH:
            t1 = time.process_time()
            batch = shard_batch(dict(input_ids=ids, attention_mask=mask), mesh)
            f_in, f_out, f_metrics, placed = _fsdp_train(model, mesh, batch)
            out["fsdp"] = dict(
                loss_diff=abs(float(f_metrics["loss"]) - float(ref_metrics["loss"])),
                params_diff=_max_diff(f_out, ref_state),
                params_moved=_max_diff(f_out, f_in),
                cpu_s=time.process_time() - t1,
                **placed,
            )
        out["cpu_s"] = time.process_time() - t0
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--train-all", "--ci")]
    ci = "--ci" in sys.argv
    main(
        args or list(CI_MESHES if ci else MESHES),
        train=list(MESHES) if "--train-all" in sys.argv else () if ci else TRAIN_MESHES,
        eager=CI_EAGER_MESHES if ci else EAGER_MESHES,
        full_only=not ci,
        engine=CI_ENGINE_MESHES if ci else ENGINE_MESHES,
    )
