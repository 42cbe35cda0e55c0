"""The engine's constructor options (the Args of `models.serving.engine.Engine`): checked, each bad value a one-line
ValueError naming it, and resolved to what the engine runs with (the data ranks, how attention reads the cache, the
defaults that depend on the model, the device and the mesh)."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from mla_jax.attention import resolve_decompressed_impl
from mla_jax.cache_paths import CACHE_IMPLS, check_decode_config, resolve_cache_impl
from mla_jax.kv_cache import INTERPRET_ON_DATA_RANKS, resolve_page_format
from mla_jax.memory import check_fraction
from mla_jax.sharding import batch_axes
from models.serving.launches import MIXED_TILE
from models.serving.pages import rows_needed
from models.serving.steps import MAX_DRAFT_TOKENS

ATTENTION_IMPLS = CACHE_IMPLS  # "auto" | "kernel" | "interpret" | "reference" (`pallas_kernels.backend`)
# The default prefill chunk (docs/PERFORMANCE.md, "Prefill"). With the jnp attention a
# chunk's fp32 scores are B x H x T x S, so chunks stay at PREFILL_CHUNK. With the flash forward over the prefix
# nothing grows with T x S, and a step's matmuls want many rows: every chunk reads every weight once, and a
# routed expert gets about tokens * K / E of the step's rows. So a step's tokens get a budget,
# FLASH_PREFILL_TOKENS over max_batch rows, a power of two per row within [PREFILL_CHUNK, FLASH_PREFILL_CHUNK].
PREFILL_CHUNK = 512
FLASH_PREFILL_TOKENS = 16384
FLASH_PREFILL_CHUNK = 8192
# Prompt tokens a mixed step carries by default (`Engine(prefill_budget=...)`): measured on V2-Lite at B=32 (one
# H200), the inter-token latency p99 under arrivals is 2.4-2.6x the median decode step with 256 and 2.9-3.1x
# with 512 (docs/PERFORMANCE.md, "Serving").
PREFILL_BUDGET = 256


def default_prefill_chunk(flash_prefill: bool, max_batch: int) -> int:
    """Prompt tokens a row prefills per step by default: `PREFILL_CHUNK` with the jnp attention; with the flash
    forward over the cached prefix (`flash_prefill`), the largest power of two <= FLASH_PREFILL_TOKENS /
    max_batch, clipped to [PREFILL_CHUNK, FLASH_PREFILL_CHUNK] (8192 at max_batch 1 and 2, 2048 at 8)."""
    if not flash_prefill:
        return PREFILL_CHUNK
    per_row = 1 << max(0, (FLASH_PREFILL_TOKENS // max(1, max_batch)).bit_length() - 1)
    return min(FLASH_PREFILL_CHUNK, max(PREFILL_CHUNK, per_row))


class EngineOptions(NamedTuple):
    """What an engine runs with beyond its options as given.

    data_axes, data_ranks: the batch's mesh axes and their total size D (((), 1) without a mesh or a split batch);
    backend: how attention reads the cache, "kernel" | "interpret" | "reference"; prefill_attention: what the cached
    path's long chunks attend with (`mla_jax.attention.resolve_decompressed_impl`); prefill_chunk, max_context,
    decompressed_threshold: the options, or their defaults; has_mtp: whether the model has an MTP head; draft_room:
    the rows past max_context a sequence may address (0 without MTP); page_format: the pages' `PageFormat`;
    mixed_rows: a mixed step's rows of prompt pieces; prefill_budget: the option rounded up to whole rows;
    min_table_pages: the smallest block-table width, in pages."""

    data_axes: tuple
    data_ranks: int
    backend: str
    prefill_attention: str
    prefill_chunk: int
    max_context: int
    decompressed_threshold: int
    has_mtp: bool
    draft_room: int
    page_format: object
    mixed_rows: int
    prefill_budget: int
    min_table_pages: int


def engine_options(
    model,
    mesh,
    *,
    page_size,
    num_pages,
    max_batch,
    prefill_chunk,
    decompressed_threshold,
    naive_threshold,
    attention_impl,
    max_context,
    kv_dtype,
    min_chunk_bucket,
    min_table_tokens,
    decode_steps,
    mixed_steps,
    prefill_budget,
    decode_config,
    memory_fraction,
    device_memory,
) -> EngineOptions:
    """The `Engine` options for `model` on `mesh` (None: one device), checked -> the `EngineOptions` they resolve
    to."""
    cfg = model.cfg
    if naive_threshold is not None:  # the earlier name
        decompressed_threshold = naive_threshold
    for name, v, lo in (
        ("page_size", page_size, 1),
        ("max_batch", max_batch, 1),
        ("prefill_chunk", 1 if prefill_chunk is None else prefill_chunk, 1),
        ("decompressed_threshold", decompressed_threshold, 1),
        ("min_chunk_bucket", min_chunk_bucket, 1),
        ("min_table_tokens", min_table_tokens, 1),
        ("decode_steps", decode_steps, 1),
        ("prefill_budget", prefill_budget, 1),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"Engine {name} must be an integer >= {lo}, got {v!r}")
    if not isinstance(mixed_steps, bool):
        raise ValueError(f"Engine mixed_steps must be True or False, got {mixed_steps!r}")
    if num_pages is not None and (isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1):
        raise ValueError(f"Engine num_pages must be a positive integer or None, got {num_pages!r}")
    if max_context is not None and (
        isinstance(max_context, bool)
        or not isinstance(max_context, int)
        or not 1 <= max_context <= cfg.max_position_embeddings
    ):
        raise ValueError(
            f"Engine max_context must be an integer in [1, max_position_embeddings="
            f"{cfg.max_position_embeddings}], got {max_context!r}"
        )
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"Engine attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    check_decode_config(decode_config, name="Engine decode_config")
    check_fraction(memory_fraction, "Engine memory_fraction")
    if device_memory is not None and (
        isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory < 1
    ):
        raise ValueError(f"Engine device_memory must be a positive number of bytes or None, got {device_memory!r}")
    # Data-parallel attention: D > 1 data ranks (the batch's mesh axes) each own max_batch / D slots
    # and num_pages / D pages.
    data_axes, D = batch_axes(mesh)
    if max_batch % D:
        raise ValueError(f"Engine max_batch={max_batch} is not divisible by the mesh's data ranks ({D})")
    if num_pages is not None and num_pages % D:
        raise ValueError(f"Engine num_pages={num_pages} is not divisible by the mesh's data ranks ({D})")
    if D > 1 and attention_impl == "interpret":
        raise ValueError(f"Engine attention_impl='interpret' with data ranks ({D}): " + INTERPRET_ON_DATA_RANKS)
    # how attention reads the cache: "kernel" | "interpret" | "reference"
    backend = resolve_cache_impl(attention_impl, cfg, page_size, kv_dtype, name="Engine attention_impl")
    # What the cached path's long chunks attend with (the layer asks the same question per call).
    prefill_attention = resolve_decompressed_impl(
        "auto", dtype=getattr(model, "dtype", jnp.float32), on_mesh=D > 1, cache_impl=backend
    )
    if prefill_chunk is None:
        prefill_chunk = default_prefill_chunk(prefill_attention == "mgpu", max_batch)
    if max_context is None:
        cap = 2048 if num_pages is None else num_pages // D * page_size  # a sequence holds its rank's pages
        max_context = min(cfg.max_position_embeddings, cap)
    has_mtp = len(model.mtp) > 0
    # A model with an MTP head may address up to MAX_DRAFT_TOKENS rows past max_context (`rows_needed`).
    draft_room = rows_needed(max_context - 1, MAX_DRAFT_TOKENS) - max_context if has_mtp else 0
    page_format = resolve_page_format(kv_dtype, value_dim=cfg.latent_dim, rope_dim=cfg.qk_rope_head_dim)
    mixed_rows = -(-prefill_budget // MIXED_TILE)  # a mixed step's rows of prompt pieces
    return EngineOptions(
        data_axes=data_axes,
        data_ranks=D,
        backend=backend,
        prefill_attention=prefill_attention,
        prefill_chunk=prefill_chunk,
        max_context=max_context,
        decompressed_threshold=decompressed_threshold,
        has_mtp=has_mtp,
        draft_room=draft_room,
        page_format=page_format,
        mixed_rows=mixed_rows,
        prefill_budget=mixed_rows * MIXED_TILE,
        min_table_pages=-(-min_table_tokens // page_size),
    )
