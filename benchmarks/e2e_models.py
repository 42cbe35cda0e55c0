"""The models `mla-bench e2e` and `mla-bench serve` time and the engine sizing around them: each benchmark model's
`ModelConfig` (full size or tiny), its construction with random weights (dense, FP8 as DeepSeek-V3 releases them,
or straight into a mesh's shardings), the page pool a cell needs and the page formats the engine takes."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import ModelConfig, fp8_weights, initializers
from mla_jax.capacity import plan_kv_cache
from mla_jax.memory import check_weights_fit, device_bytes_limit
from mla_jax.sharding import model_shardings, shard_model
from mla_jax.weights_plan import weight_bytes
from models import DeepSeekModel
from pallas_kernels.page_format import NAMES as PAGE_FORMAT_NAMES

PAGE = 64  # tokens a page of the engine's pool
MODELS = ("v2-lite", "v3-cut")
KV_DTYPES = PAGE_FORMAT_NAMES  # what the engine's cache allocates


# What makes a model V2-Lite's kind rather than V3's, taken from its preset for the tiny CPU cells.
V2_LITE_KIND = (
    "q_lora_rank",
    "n_group",
    "topk_group",
    "scoring_func",
    "topk_method",
    "norm_topk_prob",
    "routed_scaling_factor",
    "num_mtp_layers",
    "model_type",
)


def model_config(name: str, *, config: str = "full", layers: int | None = None, kv_dtype: str = "bf16"):
    """The ModelConfig of a benchmark model.

    ``config="tiny"`` keeps each model's kind at `ModelConfig.tiny()` sizes (v2-lite: one query projection,
    softmax greedy routing, no MTP; v3-cut: tiny() itself), for a CPU run; with ``kv_dtype="fp8"`` its latent
    is 128 wide (fp8 pages scale the latent in blocks of 128; tiny()'s is 64). ``layers`` cuts any model to
    that many main layers (the V3 cut defaults to 5); its first dense layers stay (at most layers - 1, so that
    at least one MoE layer remains).
    """
    if config == "tiny":
        cfg = ModelConfig.tiny()
        if kv_dtype == "fp8":
            cfg = cfg.replace(kv_lora_rank=128)
        if name == "v2-lite":  # V2-Lite's kind (one query projection, its routing, no MTP) at tiny() sizes
            lite = ModelConfig.deepseek_v2_lite()
            cfg = cfg.replace(**{f: getattr(lite, f) for f in V2_LITE_KIND})
        if layers:
            cfg = cfg.replace(
                num_hidden_layers=layers, first_k_dense_replace=min(cfg.first_k_dense_replace, layers - 1)
            )
        return cfg
    if name == "v2-lite":
        cfg = ModelConfig.deepseek_v2_lite()
        if layers:
            cfg = cfg.replace(
                num_hidden_layers=layers, first_k_dense_replace=min(cfg.first_k_dense_replace, layers - 1)
            )
        return cfg
    if name == "v3-cut":
        n = layers or 5
        return ModelConfig.deepseek_v3().replace(num_hidden_layers=n, first_k_dense_replace=min(3, max(n - 1, 0)))
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def build_model(cfg, dtype, mesh=None, weights=None):
    """`DeepSeekModel` with random weights, built on the default device (the GPU) -> (model, seconds).

    Eager construction: every initializer is one device op, compiled once per distinct shape, so the cost
    does not grow with depth (a jitted init compiles a program as deep as the model) and no weight passes
    through the host.

    With a `mesh`, the model is built straight into its shardings (`mla_jax.sharding.model_shardings`: one
    jitted init whose outputs are placed, so a model that fits the mesh but not one device can be built)
    and then `shard_model` sets the MoE's parallel attributes. The values are the eager build's (the
    same keys), so the mesh's tokens can be compared with one device's.

    `weights="fp8"` (one device): `random_fp8_model`.

    On one device that reports its memory, bf16 or FP8 weights that alone exceed its planned share
    (`mla_jax.memory.check_weights_fit`) are refused before anything is built: `MemoryPlanError`, one line.
    """
    if mesh is None and (weights == "fp8" or jnp.dtype(dtype) == jnp.bfloat16):
        # one line before anything is allocated, where the weights alone cannot fit the device
        fmt = "fp8" if weights == "fp8" else "bf16"
        check_weights_fit(weight_bytes(cfg, fmt), device_bytes_limit(), what=f"the {fmt} weights")
    t0 = time.perf_counter()
    make = lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, weights=weights)  # noqa: E731
    if weights == "fp8":
        if mesh is not None:
            raise ValueError("--weights fp8 runs on one device (shard_model does not place FP8 variables yet)")
        with jax.default_device(jax.devices()[0]):
            model = random_fp8_model(make, cfg.initializer_range)
    elif mesh is None:
        with jax.default_device(jax.devices()[0]):
            model = make()
    else:
        abstract = nnx.eval_shape(make)
        graphdef, _ = nnx.split(abstract)
        state = jax.jit(lambda: nnx.state(make()), out_shardings=model_shardings(abstract, mesh))()
        model = shard_model(nnx.merge(graphdef, state), mesh)  # placed already: sets MoE.parallel only
    jax.block_until_ready(nnx.state(model))
    return model, time.perf_counter() - t0


FP8_SPREAD = 16.0  # random e4m3 values are N(0, 16^2): well inside e4m3's range (448), few subnormals


def random_fp8_model(make, std: float):
    """The FP8 model `make()` builds, without its init's quantization of a dense draw (`fp8_weights.random_blocks`,
    a slab at a time): the dense variables from one jitted init that leaves the FP8 ones out (XLA drops their
    quantization), every `Fp8Weight` drawn directly as e4m3 (N(0, FP8_SPREAD²), `mla_jax.initializers.normal`) and
    every `Fp8Scale` = std / FP8_SPREAD, so W = q · s has the init's spread."""
    fp8_kinds = (fp8_weights.Fp8Weight, fp8_weights.Fp8Scale)
    abstract = nnx.eval_shape(make)
    graphdef, fp8_state, _ = nnx.split(abstract, fp8_kinds, ...)
    rest = jax.jit(lambda: nnx.split(make(), fp8_kinds, ...)[2])()
    draw = initializers.normal(FP8_SPREAD)  # a large weight drawn a slab at a time: no float32 copy of a stack
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(fp8_state))))

    def fill(v):
        if isinstance(v, fp8_weights.Fp8Weight):
            return v.replace(draw(next(keys), v.shape, fp8_weights.FP8_DTYPE))
        return v.replace(jnp.full(v.shape, std / FP8_SPREAD, jnp.float32))

    fp8_state = jax.tree.map(fill, fp8_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, fp8_state, rest)


def model_weights(args):
    """`--weights` -> `DeepSeekModel`'s `weights=` (None: dense in --dtype)."""
    return "fp8" if args.weights == "fp8" else None


def weights_label(args) -> str:
    """The `weights` column: --weights, with a --fp8-impl other than auto after a slash."""
    return args.weights + (f"/{args.fp8_impl}" if args.weights == "fp8" and args.fp8_impl != "auto" else "")


def set_fp8_impl(model, impl: str) -> None:
    """Every `Fp8Linear` of `model` computes by `impl` (`mla_jax.fp8_weights.FP8_GEMM_IMPLS`) where it is called
    as a module: prefill-sized calls and projections the scan slices. The whole-stack decode path runs by the
    step's backend whatever this says."""
    for _, m in nnx.iter_modules(model):
        if isinstance(m, fp8_weights.Fp8Linear):
            m.impl = impl


def weights_bytes(model) -> int:
    """Bytes of every variable of `model` (its weights, scales and buffers)."""
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))


def kv_dtype_arg(name: str):
    """--kv-dtype -> the Engine's kv_dtype (a jnp dtype for the plain formats; "fp8" / "fp4" pass through as names)."""
    return {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}.get(name, name)


def kv_pages(cfg, batch: int, prompt: int, new_tokens: int) -> int:
    """Pages of a pool that holds every row's prompt + new tokens (+ the engine's draft room with an MTP head)."""
    draft = 3 if cfg.num_mtp_layers else 0  # models.serving.engine.MAX_DRAFT_TOKENS: room the engine keeps
    plan = plan_kv_cache(cfg, context_len=prompt + new_tokens, num_sequences=batch, page_size=PAGE, draft_tokens=draft)
    return batch * plan.pages_per_sequence


def sync_engine(engine) -> None:
    """Waits for the device work queued on `engine`'s page pool (the last step's writes)."""
    pages = getattr(getattr(engine, "cache", None), "pages", None)
    if pages is not None:
        jax.block_until_ready(pages)
