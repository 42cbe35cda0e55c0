"""Sharding as data (`mla_jax.sharding`): the tables, and the model on a mesh of 8 CPU devices.

The multi-device cases run in ONE subprocess (`tests/sharding_cases.py`, which sets
`--xla_force_host_platform_device_count=8` before jax starts), so the rest of the suite keeps its one
device; the tests here assert on the lines it prints. The single-device tests read the tables over
abstract models (`nnx.eval_shape`) and `AbstractMesh`es: no weights, no devices.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from micro_configs import MICRO_V3, narrow_v2_lite

from mla_jax.sharding import DEFAULT_RULES, MESH_AXES, make_mesh, model_specs, spec_for
from models import DeepSeekModel
from tests.tiers import full, full_tier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = ("tp2", "tp4", "tp8", "ep2", "ep4", "ep8", "dp2", "dp2ep2", "ep2tp2", "mixed")
# The quick tier (tests/tiers.py): eight ways of tensor and of expert parallelism (a head, an expert a device),
# data alone, and the mixed mesh with every axis at once, two ways each (sharding_cases.CI_MESHES); `--full`
# adds the rest.
CI_MESHES = ("tp8", "ep8", "dp2", "mixed")
_WHY = "the mixed mesh (every axis two ways), dp2 and the eight-way mesh of each axis run in the quick tier"
TRAIN_MESHES = ("mixed",)  # sharding_cases.TRAIN_MESHES
FSDP_MESH = "mixed"  # sharding_cases.FSDP_MESH
ATOL = 1e-5


def _abstract(cfg):
    return nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0)))


def _mesh(data=1, expert=1, tensor=1):
    return AbstractMesh((data, expert, tensor), MESH_AXES)


def _flat_specs(model, mesh, rules=DEFAULT_RULES, fsdp=False):
    return {".".join(map(str, p)): s for p, s in nnx.to_flat_state(model_specs(model, mesh, rules, fsdp=fsdp))}


@pytest.fixture(scope="module")
def cases(request):
    """{mesh name: the JSON line sharding_cases.py printed for it}; one subprocess for the module (the
    quick tier's meshes, or every mesh under `--full`)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    tier = [] if full_tier(request.config) else ["--ci"]
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "sharding_cases.py"), *tier],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    return {d["case"]: d for d in lines}


# ------------------------------------------------------------------------------------------------
# The tables, on one device
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [MICRO_V3, narrow_v2_lite(3)], ids=["v3-q-lora-mtp", "v2-lite-no-q-lora"])
def test_every_parameter_has_a_placement(cfg):
    """A parameter that matches no row of PARAM_AXES (a new module, a renamed one) raised nothing and
    stayed replicated on every device; here every variable gets a spec of its own rank, and the
    stacked layers' leading axis is replicated."""
    specs = _flat_specs(_abstract(cfg), _mesh(expert=2, tensor=2))
    state = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(_abstract(cfg)))}
    assert specs.keys() == state.keys()
    for name, spec in specs.items():
        assert len(spec) == len(state[name].shape), name
        if name.startswith(("dense_layers.", "moe_layers.")):
            assert spec[0] is None, name


def test_default_layout():
    """Each row of the default layout as the issue states it; a row swapped (wo sharded on its output,
    wq_b on the LoRA rank, the experts on their width) changes no number, only this."""
    s = _flat_specs(_abstract(MICRO_V3), _mesh(data=2, expert=2, tensor=2))
    assert s["moe_layers.self_attn.wq_b.kernel"] == P(None, None, "tensor")
    assert s["moe_layers.self_attn.wkv_b.kernel"] == P(None, None, "tensor")
    assert s["moe_layers.self_attn.wo.kernel"] == P(None, "tensor", None)
    assert s["moe_layers.self_attn.wkv_a.kernel"] == P(None, None, None)  # the latent: no head axis
    assert s["moe_layers.mlp.experts.gate_proj"] == P(None, "expert", None, "tensor")
    assert s["moe_layers.mlp.experts.down_proj"] == P(None, "expert", "tensor", None)
    assert s["mtp.0.block.mlp.experts.up_proj"] == P("expert", None, "tensor")  # MTP block: no layer axis
    assert s["dense_layers.mlp.down_proj.kernel"] == P(None, "tensor", None)
    assert s["moe_layers.mlp.gate.kernel"] == P(None, None, None)
    assert s["embed_tokens.embedding"] == P("tensor", None)
    assert s["lm_head.kernel"] == P(None, "tensor")
    assert s["norm.weight"] == P(None)


def test_the_layout_is_the_table():
    """Changing a rule changes the placement and nothing else has to change (a module that named a
    mesh axis itself would not follow): heads off `tensor`, experts over (`expert`, `data`)."""
    rules = dict(DEFAULT_RULES, heads=None, experts=("expert", "data"))
    s = _flat_specs(_abstract(MICRO_V3), _mesh(data=2, expert=2, tensor=2), rules)
    assert s["moe_layers.self_attn.wq_b.kernel"] == P(None, None, None)
    assert s["moe_layers.mlp.experts.gate_proj"] == P(None, ("expert", "data"), None, "tensor")


def test_fsdp_layout():
    """`fsdp=True` adds `data` on each variable's largest dim the rules leave unsharded and `data` divides,
    and changes nothing else: catches FSDP on the smallest dim, on the last of equal dims, on a dim
    `data` does not divide (jax would refuse it at device_put), on the scanned stack's layer axis (each
    scan step would gather the whole stack), over an axis the rules already use, or with the batch
    rule off (no data parallelism: nothing to shard over)."""
    m = _mesh(data=2, expert=2, tensor=2)
    rules, fsdp = _flat_specs(_abstract(MICRO_V3), m), _flat_specs(_abstract(MICRO_V3), m, fsdp=True)
    assert fsdp["moe_layers.self_attn.wq_b.kernel"] == P(None, "data", "tensor")  # [1, Q=24, H·K=32]
    assert fsdp["moe_layers.self_attn.wkv_a.kernel"] == P(None, "data", None)  # [1, D=32, 24]
    assert fsdp["moe_layers.mlp.experts.gate_proj"] == P(None, "expert", "data", "tensor")
    assert fsdp["moe_layers.mlp.gate.kernel"] == P(None, "data", None)  # [1, D=32, E=4]
    assert fsdp["embed_tokens.embedding"] == P("tensor", "data")
    assert fsdp["lm_head.kernel"] == P("data", "tensor")
    assert fsdp["norm.weight"] == P("data")
    for name, spec in fsdp.items():  # one dim more, from replicated to data; the rest as the rules say
        changed = [d for d, (a, b) in enumerate(zip(rules[name], spec)) if a != b]
        assert len(changed) <= 1 and all(rules[name][d] is None and spec[d] == "data" for d in changed), name
    shape = dict(data=2, expert=1, tensor=1)
    stacked_norm = ("moe_layers", "input_layernorm", "weight")
    assert spec_for(stacked_norm, (8, 3), shape, fsdp=True) == P(None, None)  # 8 layers: not the layer axis
    assert spec_for(stacked_norm, (8, 6), shape, fsdp=True) == P(None, "data")
    assert spec_for(("embed_tokens", "embedding"), (6, 6), shape, fsdp=True) == P("data", None)  # the first
    assert spec_for(("embed_tokens", "embedding"), (7, 6), shape, fsdp=True) == P(None, "data")  # 7 odd
    assert _flat_specs(_abstract(MICRO_V3), m, dict(DEFAULT_RULES, batch=None), fsdp=True) == _flat_specs(
        _abstract(MICRO_V3), m, dict(DEFAULT_RULES, batch=None)
    )
    assert _flat_specs(_abstract(MICRO_V3), _mesh(expert=2, tensor=2), fsdp=True) == _flat_specs(
        _abstract(MICRO_V3), _mesh(expert=2, tensor=2)
    )


def test_make_mesh_on_one_device():
    """The mesh has the three named axes in the documented order, of size 1 on one device (a mesh
    built over jax.devices() with the wrong product failed inside jax with a reshape error)."""
    mesh = make_mesh()
    assert mesh.axis_names == MESH_AXES and mesh.devices.shape == (1, 1, 1)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)  # GSPMD partitions the rest


# ------------------------------------------------------------------------------------------------
# 8 CPU devices (one subprocess)
# ------------------------------------------------------------------------------------------------
def test_the_subprocess_has_eight_devices(cases):
    """The flag was set too late (after jax started): every 'mesh' would hold one device and every
    case below would compare the single-device model with itself."""
    assert cases["devices"]["count"] == 8
    assert set(CI_MESHES) <= cases.keys()


@pytest.mark.parametrize("mesh", full(MESHES, CI_MESHES, _WHY))
def test_forward_equals_one_device(cases, mesh):
    """Logits and MTP logits of the sharded model, inputs split over `data`, equal the single-device
    model (fp32): catches a partitioning that sums partial heads twice or not at all (a missing or
    doubled all-reduce after wo / down_proj), experts gathered from the wrong shard, a vocab shard
    of the embedding read as the whole table."""
    c = cases[mesh]
    assert c["logits_diff"] <= ATOL and c["mtp_diff"] <= ATOL, c
    assert c["logits_scale"] > 100 * ATOL  # logits of all zeros would agree trivially
    assert c["untouched"], "shard_model moved the model it was given"


EAGER_MESHES = ("ep4", "dp2", "dp2ep2", "ep2tp2", "mixed")  # sharding_cases.EAGER_MESHES
CI_EAGER_MESHES = ("mixed",)  # sharding_cases.CI_EAGER_MESHES: every axis at once (expert among them)


@pytest.mark.parametrize("mesh", full(EAGER_MESHES, CI_EAGER_MESHES, "the eager forward on mixed (every axis)"))
def test_eager_forward_with_mtp_equals_one_device(cases, mesh):
    """`model(ids, with_mtp=True)` called eagerly (no jax.jit) on the sharded model equals the single-device
    logits and MTP logits. The MTP layer is an MoE layer (DeepSeek-V3's layout) and, unlike the main
    layers, is not inside a scan: eagerly its routed experts' partial-manual shard_map (MoE.parallel) ran
    through jax's eager shard_map path, which raised `shard_map out_specs argument must refer to an axis
    marked as manual ({'expert'}) ... refers to 'data' ... 'tensor'` on every mesh with an expert or data
    axis (expert=4, data=2, data=2,expert=2, expert=2,tensor=2, data=2,expert=2,tensor=2)."""
    e = cases[mesh]["eager"]
    assert e["error"] is None, e["error"]
    assert e["logits_diff"] <= ATOL and e["mtp_diff"] <= ATOL, e


@pytest.mark.parametrize("mesh", full(("tp2", "tp4", "tp8", "ep2", "ep4", "ep8"), CI_MESHES, _WHY))
def test_only_activations_move(cases, mesh):
    """Under tensor or expert parallelism alone the compiled forward moves only activations: all-reduces
    of float arrays shaped like tokens ([B, T, D] after wo / down_proj, [T·K, ...] assignment rows of
    the routed experts) and all-gathers of integers (the experts' group sizes). A placement GSPMD
    cannot use where it is makes it gather in every step: with wo split by its output instead of its
    head rows (tried), the attention outputs are all-gathered and resharded by all-to-alls; the
    logits stay equal, the bandwidth TP was for is gone."""
    for op, t in cases[mesh]["collectives"]:
        dims = [int(d) for d in t[t.index("[") + 1 : -1].split(",") if d]
        if op == "all-gather":
            assert t.startswith("s32"), (op, t)
        else:
            assert op == "all-reduce" and dims[0] in (4, 4 * 8, 4 * 7, 4 * 8 * 2, 4 * 7 * 2), (op, t)


@pytest.mark.parametrize("mesh", ("dp2", "mixed"))
def test_each_data_rank_routes_its_own_tokens(cases, mesh):
    """With the batch split over `data`, the routed experts run per data rank (MoE.parallel, a
    shard_map over `data`): nothing of the model width and no assignment list is all-gathered. One
    sort over every token (before) all-gathered the T·K expert choices (s32[64]) and had every rank
    compute every token's experts. (The router's top-k over [T, E] scores is still gathered.)"""
    D, TK = 32, (4 * 8 * 2, 4 * 7 * 2)
    for op, t in cases[mesh]["collectives"]:
        if op == "all-gather":
            dims = [int(d) for d in t[t.index("[") + 1 : -1].split(",") if d]
            assert dims[-1] != D and not (t.startswith("s32") and dims[0] in TK), (op, t)


@pytest.mark.parametrize("mesh", full(("ep2", "ep4", "ep8"), CI_MESHES, _WHY))
def test_expert_parallelism_sums_once(cases, mesh):
    """Under `expert` alone each rank computes the assignments to its own experts (MoE.parallel, a
    shard_map over `expert`) and the one collective of a MoE block is the all-reduce of its [B·T, D]
    output: the scanned main MoE layers' body, then the MTP block's. GSPMD by itself (before)
    all-gathered the group sizes and all-reduced [T·K, I] twice and [T·K, D] once a block."""
    assert cases[mesh]["collectives"] == [["all-reduce", "f32[32,32]"], ["all-reduce", "f32[28,32]"]]


@pytest.mark.parametrize("mesh", full(MESHES, CI_MESHES, _WHY))
def test_greedy_tokens_equal_one_device(cases, mesh):
    """Greedy decoding (recomputing the causal forward each step) gives the single-device tokens."""
    c = cases[mesh]
    assert c["tokens"] == c["ref_tokens"]


@pytest.mark.parametrize("mesh", full(MESHES, CI_MESHES, _WHY))
def test_placements_read_from_addressable_shards(cases, mesh):
    """Each device holds 1/tensor of wq_b's and wkv_b's head columns and of wo's head rows,
    1/expert of the routed experts (1/tensor of their width), its vocab slice of the embedding and
    LM head, all of the latent projection wkv_a and of the router; the batch is split over `data`.
    A parameter left replicated (or sharded on the wrong axis) gives the same numbers above and is
    caught only here."""
    c = cases[mesh]
    m, pl = c["mesh"], c["placements"]
    dp, ep, tp = m["data"], m["expert"], m["tensor"]
    n = dp * ep * tp
    L, Q, HK, HV, D, E, I, V = 2, 24, 8 * 16, 8 * 8, 32, 8, 16, 40  # sharding_cases.CFG
    assert pl["wq_b"] == dict(shard_shape=[L, Q, HK // tp], devices=n, distinct=tp)
    assert pl["wkv_b"] == dict(shard_shape=[L, 16, 8 * 16 // tp], devices=n, distinct=tp)
    assert pl["wo"] == dict(shard_shape=[L, HV // tp, D], devices=n, distinct=tp)
    assert pl["wkv_a"] == dict(shard_shape=[L, D, 16 + 8], devices=n, distinct=1)
    assert pl["experts_gate"] == dict(shard_shape=[L, E // ep, D, I // tp], devices=n, distinct=ep * tp)
    assert pl["experts_down"] == dict(shard_shape=[L, E // ep, I // tp, D], devices=n, distinct=ep * tp)
    assert pl["mtp_experts_gate"] == dict(shard_shape=[E // ep, D, I // tp], devices=n, distinct=ep * tp)
    assert pl["dense_up"] == dict(shard_shape=[1, D, 48 // tp], devices=n, distinct=tp)
    assert pl["router"] == dict(shard_shape=[L, D, E], devices=n, distinct=1)
    assert pl["embed"] == dict(shard_shape=[V // tp, D], devices=n, distinct=tp)
    assert pl["lm_head"] == dict(shard_shape=[D, V // tp], devices=n, distinct=tp)
    assert c["ids_placement"] == dict(shard_shape=[4 // dp, 8], devices=n, distinct=dp)


ENGINE_MESHES = ("tp2", "dp2", "mixed")  # sharding_cases.ENGINE_MESHES
CI_ENGINE_MESHES = ("dp2", "mixed")  # sharding_cases.CI_ENGINE_MESHES
_ENGINE_WHY = "dp2 and mixed (whose tensor devices of a data rank hold its pool replicated, as tp2's do)"


@pytest.mark.parametrize("mesh", full(ENGINE_MESHES, CI_ENGINE_MESHES, _ENGINE_WHY))
def test_engine_on_a_mesh(cases, mesh):
    """Engine(model, mesh=...) on tensor=2 (one pool, replicated), data=2 alone and data=2, expert=2,
    tensor=2: greedy generation
    with MTP speculation through the paged latent cache gives the single-device engine's tokens.
    Catches a cached step that GSPMD partitions wrongly (the absorbed path slices W_UK / W_UV out of
    the head-sharded wkv_b, the verify step runs the MTP block) and, with a pool per data rank, a
    block table holding global page ids on the sharded pool (rank 1's ids 3..5 fall outside its 3
    local pages: its writes are dropped, its gathers clamped) or a write landing in the other rank's
    pages (its tokens would be read back as this row's)."""
    e = cases[mesh]["engine"]
    assert e["tokens"] == e["ref_tokens"] and all(len(t) == 6 for t in e["tokens"])


@pytest.mark.parametrize("mesh", full(ENGINE_MESHES, CI_ENGINE_MESHES, _ENGINE_WHY))
def test_each_data_rank_holds_its_own_pages(cases, mesh):
    """With data = 2 the pool's page axis is split over `data`: each device holds the 3 pages of its
    rank, [layers, N / 2, page, width], and the expert / tensor devices of a rank hold the same shard
    (the latent has no head axis). A pool left replicated (every device all 6 pages: twice the memory
    DP attention is for) or split over another axis is caught here, not by any token. With data = 1
    (tp2) every device holds the whole pool: a pool split over `tensor` would give each device half the
    pages a sequence reads."""
    c = cases[mesh]
    e, m = c["engine"], c["mesh"]
    n = m["data"] * m["expert"] * m["tensor"]
    L, N, G, C = 3 + 1, 6, 8, 16 + 8  # main layers + the MTP layer, 2 sequences x 3 pages, page, latent width
    assert e["pages_shape"] == [L, N, G, C]
    assert e["pages_placement"] == dict(shard_shape=[L, N // m["data"], G, C], devices=n, distinct=m["data"])
    assert e["pages_replicated"] == (m["data"] == 1)


@pytest.mark.parametrize("mesh", full(ENGINE_MESHES, CI_ENGINE_MESHES, _ENGINE_WHY))
def test_planner_per_device_bytes_are_what_each_device_holds(cases, mesh):
    """mla_jax.capacity's per-device MLA figure equals the bytes of each device's shard of the engine's
    page pools, read from addressable_shards: with data ranks the planner's dp_attention split over
    `data` (half the sequences a device; the tensor devices of a rank hold the latent whole). A
    planner that divided the latent by tp (as for MHA heads), or an engine pool of another size than
    planned, would differ."""
    e = cases[mesh]["engine"]
    assert e["shard_bytes"] == [e["planned_per_device_bytes"]]


def test_one_data_rank_out_of_pages_fails_only_its_request(cases):
    """data=2, 6 pages (3 a rank, 24 tokens), 2 slots (one a rank); prompts of 16, 3 and 3 tokens, 10
    new tokens each. On one device the shared pool holds the long request's 4 pages next to another's
    2 and all three finish; on the mesh the long one runs out on its rank after 8 tokens and fails
    alone ("error", the message naming its rank and the rank's 3 pages), its tokens up to then the
    single-device ones; the request on the other rank, and the third one (admitted to the failed
    request's rank, onto its freed pages), give exactly the single-device tokens. Catches an
    allocator that counts the pool as one (rank 0 taking rank 1's pages: a local id beyond its shard),
    a failure that releases or rewinds another slot's pages, a freed page handed to the wrong rank,
    and stale rows of the failed request read by the next one. No step compiles for it."""
    e = cases["dp2"]["engine"]
    full, ref = e["full"], e["ref_full"]
    assert ref["reasons"] == ["length"] * 3 and ref["errors"] == [None] * 3
    assert full["reasons"] == ["error", "length", "length"]
    assert "data rank 0's 3 are free" in full["errors"][0] and full["errors"][1:] == [None, None]
    a = full["tokens"][0]
    assert 0 < len(a) < 10 and a == ref["tokens"][0][: len(a)]
    assert full["tokens"][1:] == ref["tokens"][1:]
    assert full["compiled"] == [] and ref["compiled"] == []


@pytest.mark.full(
    "test_each_data_rank_holds_its_own_pages and test_data_ranks_read_their_own_pages_through_the_kernels_maps "
    "(the data ranks' pools and maps); fp8 pages and sampling on one device in tests/test_engine.py"
)
def test_fp8_pages_and_sampling_on_data_ranks(cases):
    """data=2 with fp8 pages (a 128-wide latent: 128 e4m3 bytes, 1 fp32 scale, 8 bf16 rope = 148 bytes a
    token) and temperature 0.8: the same sampled tokens as one device. Catches the quantising write or the
    dequantising gather inside the data ranks' maps reading or writing another rank's bytes (or the rows
    of the wrong width), the fp8 pool replicated instead of split over data, and sampling keys that
    depend on the slot or the rank rather than the request."""
    e = cases["dp2"]["engine"]
    got, ref = e["fp8_sampled"], e["ref_fp8_sampled"]
    assert got["tokens"] == ref["tokens"] and all(len(t) == 6 for t in got["tokens"])
    assert got["pages_dtype"] == ref["pages_dtype"] == "uint8"
    assert got["pages_shape"] == ref["pages_shape"] == [4, 6, 8, 148]
    assert got["pages_placement"] == dict(shard_shape=[4, 3, 8, 148], devices=2, distinct=2)


def test_data_ranks_read_their_own_pages_through_the_kernels_maps(cases):
    """data=2, expert=2, tensor=2: `KVCache.map_pages` (the layer's `mla_decode` call) and `gather`, on a
    pool split 3 pages a rank with LOCAL page ids, layer 1 of 2, every page no row reads NaN, give each
    rank's own pages read on one device (exactly: the same jnp code per row), the outputs split over
    `data`. Catches a map that hands every rank the whole pool (rank 1's local ids read rank 0's pages:
    NaN; measured), one that ignores the layer (reads layer 0: off by ~4; measured), rows not split
    with the pages. Lowered for sm_90 with the kernels: the Mosaic GPU calls sit in maps manual over
    every mesh axis (the interpreter's callbacks and a kernel GSPMD cannot partition need that), each
    on its rank's 3 pages of both layers."""
    k = cases["mixed"]["cache_kernels"]
    assert k["decode_finite"] and k["decode_diff"] == 0.0 and k["gather_diff"] == 0.0
    assert k["gather_positions"] == [[0, 32, 64, 96], [0, 32, 64, -1]]  # rows of 100 and 70 tokens
    assert k["out_spec"] == "P('data',)"
    assert k["mosaic_calls"] >= 2 and len(k["maps"]) == 2
    assert all(m == dict(axes=["data", "expert", "tensor"], pool="2x3x64x576xbf16") for m in k["maps"])


@pytest.mark.full(
    "test_engine_on_a_mesh (the engine the benchmark times, on the mixed mesh); tests/test_bench_e2e.py (the "
    "benchmark's cell on one device)"
)
def test_bench_e2e_runs_a_tiny_cell_on_one_device_and_on_a_mesh(cases):
    """`mla-bench e2e --mesh 1 --mesh data=2,tensor=2` (tiny V2-Lite cut in bf16, B=2, 4 new tokens; in the
    sharding subprocess, the suite's one tiny e2e cell end to end): a row per mesh, every timing and ratio
    column filled (positive, finite), 3 warm decode steps, the warm generate repeating the cold one, the
    plot and the run's metadata written. On the mesh: 4 devices with the engine's pool on all 4 (a
    benchmark that built the engine without its mesh would show 1) and the one-device row's greedy tokens
    (a sharded build with other weights than the eager one, or a wrong layout, would not agree). Also the
    regression test of bf16 on the CPU with two rows: XLA:CPU had no batched bf16 x bf16 -> f32 dot
    (`mla_jax.attention.einsum_f32`), and the one-device cell failed with `DotThunk::Execute` before it."""
    e = cases["mixed"]["bench_e2e"]
    rows = e["rows"]
    assert set(rows) == {"ours", "ours@data=2,tensor=2"}
    for r in rows.values():
        assert r["error"] == "", r["error"]
        assert (r["model"], r["B"], r["prompt"], r["new_tokens"]) == ("v2-lite", 2, 16, 4)
        for k in (
            "cold_wall_s",
            "warm_wall_s",
            "compile_s",
            "ttft_s",
            "prefill_s",
            "prefill_tok_s",
            "prefill_mfu",
            "decode_ms_step",
            "decode_tok_s",
            "floor_gb",
            "floor_ms",
            "x_floor",
            "build_s",
            "weights_gb",
        ):
            assert isinstance(r[k], float) and math.isfinite(r[k]) and r[k] > 0, (k, r[k])
        assert r["decode_steps"] == 3 and r["same_tokens"] is True and r["compiles"] >= 2
        assert r["prefill_tok_s"] == pytest.approx(2 * 16 / r["prefill_s"])
    one, mesh = rows["ours"], rows["ours@data=2,tensor=2"]
    assert (one["mesh"], one["devices"], one["pool_devices"], one["agree_one_device"]) == ("one device", 1, 1, "")
    assert (mesh["mesh"], mesh["devices"], mesh["pool_devices"], mesh["agree_one_device"]) == (
        "data=2,tensor=2",
        4,
        4,
        1.0,
    )
    assert bytes(e["png"]) == b"\x89PNG\r\n\x1a\n"
    assert e["meta"]["bandwidth_gbps"] > 0 and "--config tiny" in e["meta"]["command"]


def test_batch_not_divisible_by_data(cases):
    """3 rows over data=2: one line naming the batch and the mesh axis (jax.device_put's own error is
    a paragraph about a NamedSharding's global shape)."""
    assert cases["dp2"]["odd_batch_error"] == "sharding: batch of 3 is not divisible by mesh axis data=2"


@pytest.mark.parametrize(
    "mesh",
    full(
        TRAIN_MESHES,
        (),
        "test_fsdp_train_step_equals_one_device_and_shards_everything_over_data (the same step on the mixed mesh, "
        "its state also split over data: loss, variables and shardings kept)",
    ),
)
def test_train_step_equals_one_device(cases, mesh):
    """One AdamW step (eps = 1: near SGD, see sharding_cases.TX; models.training.step's step: loss, MTP loss,
    balance loss, router-bias rule) on the sharded state and batch gives the single-device loss and
    updated variables: catches a gradient that misses its all-reduce over `data` (each half-batch's
    gradient would be applied), or a sharded parameter's gradient taken from one shard; and the step
    keeps every variable's sharding (an update that came back replicated would silently undo the
    layout after one step)."""
    t = cases[mesh]["train"]
    assert t["loss_diff"] <= ATOL and t["params_diff"] <= ATOL, t
    assert t["params_moved"] > 100 * ATOL  # the step did change the parameters
    assert t["shardings_kept"]
    assert t["experts_after"]["distinct"] == cases[mesh]["mesh"]["expert"] * cases[mesh]["mesh"]["tensor"]


def test_fsdp_train_step_equals_one_device_and_shards_everything_over_data(cases):
    """FSDP (`shard_model(..., fsdp=True)`, `init_train_state`, `make_train_step(shardings=...)`) on
    data=2, expert=2, tensor=2: one AdamW step gives the single-device loss and updated variables (a
    gradient taken from one data shard of a weight, or summed twice over data, would differ); every
    variable and both AdamW moments of every parameter hold 1/data of what the rules alone give them
    (an optimizer state created replicated, as `tx.init` left the step counts, or moments that kept
    the rules' layout, would be caught here, not by any number), and hold it after the step (a step
    that let GSPMD choose its outputs could hand back another layout, and the next step's donation
    would miss). The stepped arrays go through mla-train's checkpoint functions and come back exactly,
    onto their own shardings or onto one device."""
    f = cases[FSDP_MESH]["fsdp"]
    assert f["loss_diff"] <= ATOL and f["params_diff"] <= ATOL, f
    assert f["params_moved"] > 100 * ATOL
    L, Q, HK, D, E, I, V = 2, 24, 8 * 16, 32, 8, 16, 40  # sharding_cases.CFG; data = expert = tensor = 2
    expected = {  # the rules' shard with its largest free dim halved over data
        "wq_b": dict(shard_shape=[L, Q // 2, HK // 2], devices=8, distinct=4),  # q_lora over data
        "experts_gate": dict(shard_shape=[L, E // 2, D // 2, I // 2], devices=8, distinct=8),  # embed
        "router": dict(shard_shape=[L, D // 2, E], devices=8, distinct=2),  # embed (not E)
        "embed": dict(shard_shape=[V // 2, D // 2], devices=8, distinct=4),  # embed
    }
    for when in ("before", "after"):
        p = f[when]
        assert p["params"] == expected and p["mu"] == expected and p["nu"] == expected, (when, p)
        assert p["norm"] == dict(shard_shape=[D // 2], devices=8, distinct=2), (when, p["norm"])
        assert p["not_over_data"] == [], (when, p["not_over_data"])  # every variable and moment
    assert f["shardings_kept"]
    assert f["restored_on_mesh"] == dict(diff=0.0, devices=[8], shardings_kept=True)
    assert f["restored_on_one_device"]["diff"] == 0.0 and f["restored_on_one_device"]["devices"] == [1]
