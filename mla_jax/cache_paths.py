"""Attention over the latent cache, the choices around the MLA layer (`mla_jax.attention.MLA`): which implementation
reads the cache (`resolve_cache_impl` over `CACHE_IMPLS`, the kernels' limits `cache_kernel_problems`), which path
a cached call takes (`cached_path`), and the decode kernel's config and work plan of a step (`step_decode_config`,
`with_decode_plan`).

Dimension letters: B batch, T query tokens a row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mla_jax.config import ModelConfig
from pallas_kernels import backend, mla_decode_problems, paged_gather_problems
from pallas_kernels.mla_decode import host_config, mla_decode_schedule
from pallas_kernels.mla_decode.config import MlaDecodeConfig, checked_config
from pallas_kernels.page_format import PageFormat, resolve_page_format

CACHE_IMPLS = backend.IMPLS  # how attention reads the cache: "auto" | "kernel" | "interpret" | "reference"
CACHED_PATHS = ("decode_kernel", "absorbed", "decompressed")  # what `MLA.cached_path` returns
SEQ_LENS_SCOPE = "kernel_seq_lens"  # the name scope of `kernel_seq_lens`'s ops (a test finds where they run)


def cache_kernel_problems(cfg: ModelConfig, page_size: int, page_format) -> list[str]:
    """Why the kernels cannot serve a latent cache of this model ([] when they can): the decode kernel's
    limits on the model's heads, pages and token widths (`mla_decode_problems`), and the gather kernel's on
    the page format (`paged_gather_problems`). A format the decode kernel does not read (fp4) is read through
    the gather kernel and the jnp absorbed attention (`MLA.cached_path`). `page_format`: a `PageFormat` or
    what `pallas_kernels.resolve_page_format` names one by (a name, a plain dtype), at the model's widths."""
    page_format = resolve_page_format(page_format, value_dim=cfg.latent_dim, rope_dim=cfg.qk_rope_head_dim)
    shape = PageFormat("bf16", latent_dim=page_format.latent_dim, rope_dim=page_format.rope_dim)
    return mla_decode_problems(cfg.num_attention_heads, page_size, shape) + paged_gather_problems(
        page_format, page_size
    )


def resolve_cache_impl(impl: str, cfg: ModelConfig, page_size: int, page_format, *, name: str = "impl") -> str:
    """`impl` of `CACHE_IMPLS` -> the backend a `KVCache` reads with: "kernel" | "interpret" | "reference".

    "auto": the kernels on a Hopper GPU when they serve this model's cache (`cache_kernel_problems`), else
    the jnp reference. "kernel" (on a Hopper GPU) and "interpret" (the Pallas interpreter) raise ValueError
    naming every limit the model breaks; "kernel" without a Hopper GPU raises too."""
    problems = cache_kernel_problems(cfg, page_size, page_format)
    if impl == "kernel" and not backend.on_hopper():
        where = jax.default_backend() + (f" ({jax.devices()[0].device_kind})" if jax.default_backend() == "gpu" else "")
        problems = [f"no Hopper GPU: jax's backend is {where} (use 'auto', 'reference' or 'interpret')", *problems]
    return backend.choose(impl, problems, name=name)


def cached_path(cfg: ModelConfig, T: int, cache) -> str:
    """The path a cached MLA call of T query tokens a row takes (one of `CACHED_PATHS`):
    - "decompressed": T >= cache.decompressed_threshold (long prefill chunks): gather the prefix
      (`paged_gather` unless the backend is "reference") and attend decompressed, with the flash
      forward over the prefix (`flash_attention_prefill`) where `resolve_decompressed_impl` picks it
      for the cache's backend (a kernel backend, bf16 compute, one pool), else the jnp attention;
    - "decode_kernel": a kernel backend and a call the decode kernel serves (decode, MTP verify:
      T <= `MAX_QUERY_LEN`; the model's heads, the cache's pages and format: `mla_decode_problems`):
      absorbed attention by `pallas_kernels.mla_decode` straight on the pages;
    - "absorbed": otherwise (short chunks, the "reference" backend, a format the decode kernel does not
      read): gather (decoding the page format) + absorbed attention in jnp."""
    if T >= cache.decompressed_threshold:
        return "decompressed"
    if cache.impl != "reference" and not mla_decode_problems(
        cfg.num_attention_heads, cache.page_size, cache.page_format, T
    ):
        return "decode_kernel"
    return "absorbed"


def kernel_seq_lens(cache, positions_BT: jax.Array) -> jax.Array:
    """The decode kernel's lengths for a call: it places query j at seq_len - T + j. Valid tokens are a prefix of
    T here (decode, verify), so padding queries at the end are counted in: the valid ones land on their positions
    and the padding ones' outputs are discarded."""
    with jax.named_scope(SEQ_LENS_SCOPE):
        T = positions_BT.shape[1]
        # a decode or verify step's few columns summed by elementwise adds, which fuse with their neighbours
        # (a reduction is a launch of its own)
        valid = [(positions_BT[:, t] >= 0).astype(jnp.int32) for t in range(T)] if T <= 8 else None
        n_valid = sum(valid[1:], valid[0]) if valid else jnp.sum(positions_BT >= 0, axis=1).astype(jnp.int32)
        return cache.lengths + T - n_valid


def check_decode_config(config, *, name: str = "decode_config"):
    """`config` when it is None (the decode kernel's defaults) or a `pallas_kernels.MlaDecodeConfig`; else a
    one-line ValueError naming it (``name``: how the caller calls the argument)."""
    return None if config is None else checked_config(config, name=name)


_AUTO = MlaDecodeConfig(schedule="auto")


def step_decode_config(config, lengths_B):
    """The decode kernel's config for one step whose rows' lengths the caller holds on the host (numpy; None for
    a step that keeps one program: a prefill step, which does not decode, or one whose kernel would not plan):
    ``schedule="auto"`` becomes the program its rule picks from these lengths (`pallas_kernels.mla_decode.
    host_config`), and so do the defaults (None): None on near-equal lengths, the pieces schedule on ragged ones
    (`prefers_pieces`); any other config as it is. A serving loop chooses per step, with no conditional on the
    device; each program compiles when first taken."""
    if config is None:
        picked = host_config(_AUTO, lengths_B)
        return None if picked.schedule == "per_sequence" else picked
    return host_config(config, lengths_B)


class DecodePlan(NamedTuple):
    """What every layer's decode kernel call of one forward call shares, built once before the layers run
    (`with_decode_plan`): a layer would otherwise compute it again, a kernel launch or more a layer.

    seq_lens  int32 [B], the kernel's lengths (`kernel_seq_lens`);
    schedule  the kernel's work plan (`pallas_kernels.mla_decode.PieceSchedule` or `AutoSchedule`) when the
              cache's config plans on the device (`mla_decode_schedule`), else None (per sequence, or a pool
              per data rank, whose layer calls plan their rank's rows)."""

    seq_lens: jax.Array
    schedule: object = None


def with_decode_plan(cfg: ModelConfig, cache, positions_BT: jax.Array):
    """`cache` carrying the decode kernel's `DecodePlan` for a forward call over these positions
    (`KVCache.decode_plan`), built once here for every layer, when the call takes the decode kernel
    (`cached_path`); else `cache` as is. The plan depends on the lengths, heads and s_q only, which every
    main layer of the call shares."""
    T = positions_BT.shape[1]
    if cached_path(cfg, T, cache) != "decode_kernel":
        return cache
    seq_lens = kernel_seq_lens(cache, positions_BT)
    schedule = None
    if cache.data_parallel is None:
        schedule = mla_decode_schedule(seq_lens, heads=cfg.num_attention_heads, query_len=T, config=cache.decode_config)
    return cache.with_decode_plan(DecodePlan(seq_lens, schedule))
