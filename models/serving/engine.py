"""Generation engine: continuous batching over the jitted steps of `models.serving.steps`, with a paged latent
KV cache, stop tokens, streaming, MTP speculative decoding, and an online API.

Dimension letters: B slots (max_batch), T tokens a step, P block-table width (pages), G page size.

The engine never opens a layer: the forward pass (cache writes, attention path, MTP block) is the
model's (`model(ids, positions, cache=cache)`), the steps are pure functions in `models.serving.steps`, and the
host scheduler around them (admission, page reservation, steps, emission, stops) is `models.serving.scheduler`.
What lives here is the public face:
- `Engine.generate(prompts, ...)`: a batch of prompts to their outputs;
- the online API it is built on: `Engine.submit(prompt, ...)` -> a `RequestHandle` at any time (its tokens
  as they come: `handle.tokens()` or an `on_token` callback; `handle.cancel()`; `handle.result()`), and
  `Engine.step()`, one engine step for every running request (`handle.tokens()` / `.result()` step the
  engine themselves while they wait). One thread drives an engine.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mla_jax.attention import (
    CACHE_IMPLS,
    cache_kernel_problems,
    check_decode_config,
    resolve_cache_impl,
    resolve_decompressed_impl,
)
from mla_jax.capacity import plan_kv_cache
from mla_jax.kv_cache import (
    INTERPRET_ON_DATA_RANKS,
    CacheFullError,
    PagedLatentCache,
    next_pow2,
    resolve_page_format,
)
from mla_jax.memory import (
    DEFAULT_MEMORY_FRACTION,
    MemoryPlanError,
    check_fraction,
    device_bytes_in_use,
    device_bytes_limit,
    plan_pool,
    tree_device_bytes,
)
from mla_jax.sharding import batch_axes, shard_model
from models.serving.launches import MIXED_TILE
from models.serving.pages import rows_needed
from models.serving.requests import FINISH_REASONS, _Request
from models.serving.sampling import SamplingParams
from models.serving.scheduler import _Generation
from models.serving.stats import GenerationStats
from models.serving.steps import (
    MAX_DRAFT_TOKENS,
    DraftOracle,
    StepInputs,
    compiled_steps,
    decode_step,
    prefill_step,
    trace_counts,
    verify_step,
)

ATTENTION_IMPLS = CACHE_IMPLS  # "auto" | "kernel" | "interpret" | "reference" (`pallas_kernels.backend`)
ON_CACHE_FULL = ("fail_request", "raise")
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

__all__ = [
    "ATTENTION_IMPLS",
    "CacheFullError",
    "Engine",
    "FINISH_REASONS",
    "GenerationResult",
    "GenerationStats",
    "MIXED_TILE",
    "MemoryPlanError",
    "PREFILL_BUDGET",
    "RequestHandle",
    "RequestResult",
    "SamplingParams",
    "StepInputs",
    "decode_step",
    "default_prefill_chunk",
    "kernel_problems",
    "prefill_step",
    "rows_needed",
    "trace_counts",
    "verify_step",
]


def default_prefill_chunk(flash_prefill: bool, max_batch: int) -> int:
    """Prompt tokens a row prefills per step by default: `PREFILL_CHUNK` with the jnp attention; with the flash
    forward over the cached prefix (`flash_prefill`), the largest power of two <= FLASH_PREFILL_TOKENS /
    max_batch, clipped to [PREFILL_CHUNK, FLASH_PREFILL_CHUNK] (8192 at max_batch 1 and 2, 2048 at 8)."""
    if not flash_prefill:
        return PREFILL_CHUNK
    per_row = 1 << max(0, (FLASH_PREFILL_TOKENS // max(1, max_batch)).bit_length() - 1)
    return min(FLASH_PREFILL_CHUNK, max(PREFILL_CHUNK, per_row))


def kernel_problems(cfg, page_size: int, page_format) -> list[str]:
    """Why the Pallas kernels cannot serve this model's cache of `page_size`-token pages in `page_format`
    (a name, a jnp dtype or a `PageFormat`): [] when they can (`mla_jax.attention.cache_kernel_problems`)."""
    return cache_kernel_problems(cfg, page_size, page_format)


# ------------------------------------------------------------------------------------------
# Results and handles
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class GenerationResult:
    """tokens: the new tokens of each prompt (stop token included when one ended it).
    stats: a `GenerationStats`.
    finish_reasons: per prompt "stop" | "length" (max_new_tokens) | "context" (max_context) | "error".
    errors: per prompt None, or the message of the error that ended it (e.g. a `CacheFullError`)."""

    tokens: list[list[int]]
    stats: GenerationStats
    finish_reasons: list[str]
    errors: list[str | None]


@dataclasses.dataclass
class RequestResult:
    """One submitted request, ended. tokens: its new tokens (the stop token included when one ended it);
    finish_reason: one of `FINISH_REASONS` ("stop", "length", "context", "error", "cancelled"); error: None,
    or the message of what ended it with "error" (a `CacheFullError`, non-finite logits, a callback that
    raised)."""

    tokens: list[int]
    finish_reason: str
    error: str | None


class RequestHandle:
    """A request submitted with `Engine.submit`: its tokens so far, its end, its cancellation.

    `tokens()` iterates over its new tokens as they come, one engine step at a time (each token as the device
    call that made it is read, one step after it was launched), running steps (for every running request)
    while none is ready; it ends when the request does, and at once after `cancel()`. `result()` runs steps
    until it ends. Neither may be called from an `on_token` callback (a step is running then). Timing:
    `submitted_at` and `token_times` are `time.perf_counter()` values (when it was submitted; when each token
    reached the host).
    """

    def __init__(self, engine: Engine, request: _Request):
        self._engine = engine
        self._r = request

    @property
    def id(self) -> int:
        return self._r.id

    @property
    def output(self) -> list[int]:
        """Its new tokens that reached the host so far (a copy): a device call's at a time, so with `decode_steps`
        > 1 up to that many ahead of what `tokens()` has yielded, and after `cancel()` every token read back,
        yielded or not (what was generated, not only what was delivered)."""
        return list(self._r.tokens)

    @property
    def done(self) -> bool:
        return self._r.done

    @property
    def finish_reason(self) -> str | None:
        """None while it waits or runs, then one of `FINISH_REASONS`."""
        return self._r.finish_reason

    @property
    def error(self) -> str | None:
        return self._r.error

    @property
    def submitted_at(self) -> float:
        return self._r.submitted_at

    @property
    def token_times(self) -> list[float]:
        return list(self._r.token_times)

    def tokens(self) -> Iterator[int]:
        """Every new token of the request, in order, as it comes (engine steps run while none is ready);
        ends when the request does (whatever the reason: see `finish_reason`)."""
        i = 0
        while True:
            while i < len(self._r.tokens) and self._r.finish_reason != "cancelled":
                yield self._r.tokens[i]
                i += 1
            if self._r.done:
                return
            self._step()

    def result(self) -> RequestResult:
        """Run engine steps until the request ends -> its `RequestResult`."""
        while not self._r.done:
            self._step()
        return RequestResult(list(self._r.tokens), self._r.finish_reason, self._r.error)

    def _step(self) -> None:
        if not self._engine.step() and not self._r.done:  # the scheduler lost it: never wait forever
            raise RuntimeError(f"request {self.id} neither waits nor runs, yet has not ended")

    def cancel(self) -> bool:
        """End the request now (finish reason "cancelled", its tokens so far kept in `output`, `tokens()` ends, its
        pages back to the pool; no other request is touched); False when it had already ended."""
        return self._engine._sched.abort(self._r.id)

    def __repr__(self) -> str:
        state = self._r.finish_reason or "running"
        return f"RequestHandle(id={self.id}, tokens={len(self._r.tokens)}, {state})"


# ------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------
class Engine:
    """Generation with a paged latent KV cache.

    Args:
      model: a `models.DeepSeekModel` (its weights are captured at construction).
      page_size: tokens a page (the decode kernel reads 64; tests use small pages on the jnp path).
      num_pages: pages in the pool; None = enough for max_batch sequences of max_context tokens (plus the MTP
        draft room, `mla_jax.capacity.plan_kv_cache`'s pages a sequence), or, where the device holds fewer beside
        the weights and the steps, as many as fit (a request then waits for pages). Checked against the device's
        memory when there is a plan (`memory_fraction`).
      max_batch: slots decoded together (B of every step).
      prefill_chunk: prompt tokens a row prefills per step; None = `default_prefill_chunk` (512 with the jnp
        attention; up to 8192 when long chunks run the flash forward over the prefix: a Hopper GPU, bf16).
      decompressed_threshold: prefill chunks of at least this many tokens use the decompressed path
        (`naive_threshold` is its earlier name, still accepted).
      attention_impl: how attention reads the cache, one of `ATTENTION_IMPLS` (`mla_jax.attention.
        resolve_cache_impl`): "auto" (the Pallas kernels on a Hopper GPU when they serve the model's
        cache, else jnp), "reference" (jnp), "kernel" or "interpret" (the kernels; ValueError naming every
        limit the model or pages break).
      max_context: tokens a sequence may hold (prompt + generated); None = min(the model's
        max_position_embeddings, num_pages * page_size) (2048 when num_pages is None too).
      kv_dtype: the page format: a name ("bf16", "fp16", "fp32", "fp8", "fp4"), a jnp dtype of a plain
        format (bf16 default; float32 for exact comparisons) or a `pallas_kernels.PageFormat`
        (`pallas_kernels.page_format` has the byte layouts). The decode kernel reads bf16 and fp8 pages;
        fp4 pages are read through `paged_gather`'s fp4 body and the jnp absorbed attention.
      cache_fill: value of never-written cache rows (tests poison them with NaN).
      min_chunk_bucket: the smallest prefill chunk shape (tokens); chunk shapes are powers of two.
      min_table_tokens: the smallest block-table width, in tokens (rounded up to whole pages);
        widths are powers of two of pages. Larger minimums mean fewer compilations and a little
        padded work on short sequences.
      decode_steps: model steps one decode device call runs: plain decode steps, or MTP verify steps with
        `use_mtp` (`models.serving.steps.decode_call`, `verify_call`), sampling, feeding tokens back and finding stops
        on the device. Every call is enqueued before the host reads the one before it (the lane:
        `models.serving.scheduler`), so with 1 (the default) each token streams as its step completes; more steps a
        call make the host's share smaller where it, not the device, sets a step's time (docs/PERFORMANCE.md,
        "MTP speculative decoding"), at the price of tokens arriving `decode_steps` at a time. Pages are held up
        front; a row that stops early idles until the call ends.
      mixed_steps: while some rows decode and others are in their prompts, one step carries both (`models.
        scheduler`): every decoding row's next token and up to `prefill_budget` prompt tokens, so a long prompt
        never stops the decoding rows. Not with MTP (`use_mtp`) nor with data ranks > 1: there, and with
        `mixed_steps=False`, such a step is a prefill step and the decoding rows wait for it. Greedy tokens are
        the same either way. Read at every step (may be changed between steps).
      prefill_budget: prompt tokens a mixed step carries, first come first served over the prompts (rounded up
        to a multiple of `MIXED_TILE`, the tokens a row of a mixed step holds): a mixed step computes
        (max_batch + prefill_budget / MIXED_TILE) x MIXED_TILE tokens.
      mesh: a `jax.sharding.Mesh` (`mla_jax.sharding.make_mesh`): the weights are placed by
        `mla_jax.sharding.shard_model`; the steps are partitioned by GSPMD. With `data` = 1 the page pools
        are replicated on every device. With `data` = D > 1 (the batch's mesh axes), a page pool per data
        rank: slot s belongs to rank s // (max_batch / D), which owns num_pages / D pages (max_batch and
        num_pages must be multiples of D); block tables hold page ids local to the rank; a request goes to
        a rank with a free slot and room for its prompt; a rank out of pages fails its own request only;
        the cache write, gather and decode kernel run per rank (`KVCache.data_parallel`). "interpret" is
        refused with data ranks (`mla_jax.kv_cache.INTERPRET_ON_DATA_RANKS`).
      memory_fraction: the share of the device's memory the engine plans for (vLLM's `gpu_memory_utilization`):
        the weights, the largest step's temporaries (measured: the largest steps are compiled at construction and
        their `memory_analysis()` read) and the page pool must fit in it (`mla_jax.memory.plan_pool`;
        `memory_plan` holds the result). A pool that cannot hold one sequence of `max_context` tokens, or an
        explicit `num_pages` that does not fit, raises `MemoryPlanError` (a ValueError) in one line naming the
        bytes. The device's memory is what JAX's allocator may use (`memory_stats()["bytes_limit"]`); a device
        that reports none (a CPU) has no plan unless `device_memory` is given.
      device_memory: bytes to plan for instead of what the device reports (None: the device's own).
      decode_config: the decode kernel's `pallas_kernels.MlaDecodeConfig` for every step. None (the default):
        its defaults, with the schedule chosen on the host before each decoding step from the rows' lengths, as
        ``schedule="auto"`` does (`mla_jax.attention.step_decode_config`): per sequence on near-equal lengths,
        in pieces on ragged ones (the longest row more than 1.5x the mean pages), each program compiled when
        first taken or by `warm_up`, no conditional on the device; one program where no decode kernel runs or
        with data ranks. A step on the pieces schedule plans the kernel's work once from its
        lengths and every layer's call reads that plan (`mla_jax.attention.with_decode_plan`).

    `compile_log`: one dict per step that compiled, {"step", "bucket", "seconds"} (wall time of that
    call, compilation included). `memory_plan`: the `mla_jax.memory.MemoryPlan` the pool was sized by (None
    without one); `step_temporaries`: {step kind: temporary bytes} of the programs it measured.
    """

    def __init__(
        self,
        model,
        page_size: int = 64,
        num_pages: int | None = None,
        max_batch: int = 8,
        prefill_chunk: int | None = None,
        decompressed_threshold: int = 256,
        attention_impl: str = "auto",
        max_context: int | None = None,
        kv_dtype=jnp.bfloat16,
        cache_fill: float = 0.0,
        min_chunk_bucket: int = 16,
        min_table_tokens: int = 256,
        mesh=None,
        naive_threshold: int | None = None,
        decode_steps: int = 1,
        mixed_steps: bool = True,
        prefill_budget: int = PREFILL_BUDGET,
        decode_config=None,
        memory_fraction: float = DEFAULT_MEMORY_FRACTION,
        device_memory: int | None = None,
    ):
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
        self.data_axes, self.data_ranks = batch_axes(mesh)
        D = self.data_ranks
        if max_batch % D:
            raise ValueError(f"Engine max_batch={max_batch} is not divisible by the mesh's data ranks ({D})")
        if num_pages is not None and num_pages % D:
            raise ValueError(f"Engine num_pages={num_pages} is not divisible by the mesh's data ranks ({D})")
        if D > 1 and attention_impl == "interpret":
            raise ValueError(f"Engine attention_impl='interpret' with data ranks ({D}): " + INTERPRET_ON_DATA_RANKS)
        # how attention reads the cache: "kernel" | "interpret" | "reference"
        self.backend = resolve_cache_impl(attention_impl, cfg, page_size, kv_dtype, name="Engine attention_impl")
        # What the cached path's long chunks attend with (the layer asks the same question per call).
        self.prefill_attention = resolve_decompressed_impl(
            "auto", dtype=getattr(model, "dtype", jnp.float32), on_mesh=D > 1, cache_impl=self.backend
        )
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(self.prefill_attention == "mgpu", max_batch)
        if max_context is None:
            cap = 2048 if num_pages is None else num_pages // D * page_size  # a sequence holds its rank's pages
            max_context = min(cfg.max_position_embeddings, cap)
        self.has_mtp = len(model.mtp) > 0
        # A model with an MTP head may address up to MAX_DRAFT_TOKENS rows past max_context (`rows_needed`).
        self.draft_room = rows_needed(max_context - 1, MAX_DRAFT_TOKENS) - max_context if self.has_mtp else 0
        page_format = resolve_page_format(kv_dtype, value_dim=cfg.latent_dim, rope_dim=cfg.qk_rope_head_dim)
        # The capacity planner's arithmetic: pages a sequence holds, bytes a token over every cached layer.
        kv_plan = plan_kv_cache(
            cfg,
            context_len=max_context,
            num_sequences=max_batch,
            page_size=page_size,
            kv_dtype=page_format.name,
            include_mtp=self.has_mtp,
            draft_tokens=self.draft_room,
        )
        self.cfg = cfg
        self.page_size = page_size
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.decompressed_threshold = decompressed_threshold
        self.decode_steps = decode_steps
        self.decode_config = decode_config
        self.mixed_steps = mixed_steps
        self.mixed_rows = -(-prefill_budget // MIXED_TILE)  # a mixed step's rows of prompt pieces
        self.prefill_budget = self.mixed_rows * MIXED_TILE
        self.max_context = max_context
        self.min_chunk_bucket = min_chunk_bucket
        self.min_table_pages = -(-min_table_tokens // page_size)
        if mesh is not None:
            model = shard_model(model, mesh)  # a no-op for a model already placed on this mesh
        self.mesh = mesh
        graphdef, self.state = nnx.split(model)
        self.steps = compiled_steps(graphdef)
        self.attention_impl = attention_impl
        self.compile_log: list[dict] = []
        self.step_temporaries: dict[str, int] = {}
        make_cache = functools.partial(
            PagedLatentCache,
            num_layers=cfg.num_hidden_layers + (1 if self.has_mtp else 0),
            page_size=page_size,
            latent_dim=cfg.latent_dim,
            max_seqs=max_batch,
            # A block table also covers the padding queries a verify or mixed step's row has past its last
            # token (the decode kernel counts them in), up to MIXED_TILE - 1 = MAX_DRAFT_TOKENS past max_context.
            max_pages_per_seq=next_pow2(-(-(max_context + MIXED_TILE - 1) // page_size)),
            page_format=page_format,
            fill_value=cache_fill,
            rope_dim=cfg.qk_rope_head_dim,
            ranks=D,
        )
        wanted = max_batch * kv_plan.pages_per_sequence if num_pages is None else num_pages
        self.memory_plan = self._plan_memory(
            make_cache, kv_plan, wanted, num_pages, memory_fraction, device_memory, mesh
        )
        self.num_pages = wanted if self.memory_plan is None else self.memory_plan.num_pages
        self.cache = make_cache(num_pages=self.num_pages)
        if mesh is not None:
            # The latent has no head axis to split: every device of a data rank holds all of that rank's
            # pages (the whole pool when data = 1); the pool's N axis is split over the data ranks.
            pool = PartitionSpec(None, self.data_axes) if D > 1 else PartitionSpec()
            self.cache.pages = jax.device_put(self.cache.pages, NamedSharding(mesh, pool))
        self._sched = _Generation(self)  # the one scheduler: generate() and submit() both queue into it

    def _plan_memory(self, make_cache, kv_plan, wanted, num_pages, fraction, device_memory, mesh):
        """The pool that fits the device (`mla_jax.memory.plan_pool`) -> a `MemoryPlan`, or None where the device
        reports no memory and none was given (a CPU). The largest steps are compiled over an abstract pool of
        `wanted` pages to measure their temporaries (`_Generation.step_temporaries`); those programs are the
        ones the engine runs when the plan keeps `wanted` pages."""
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        limit = device_memory if device_memory is not None else device_bytes_limit(device)
        if limit is None:
            return None
        self.cache = make_cache(num_pages=wanted, allocate=False)
        probe = _Generation(self)
        try:
            self.step_temporaries = probe.step_temporaries()
        finally:
            del self.cache
        weights = tree_device_bytes(self.state)
        in_use = device_bytes_in_use(device) if device_memory is None else weights
        return plan_pool(
            device_bytes=limit,
            fraction=fraction,
            weight_bytes=weights,
            other_bytes=max(0, in_use - weights),
            temp_bytes=max(self.step_temporaries.values()),
            page_bytes=kv_plan.mla.bytes_per_token * self.page_size,
            pages_per_sequence=kv_plan.pages_per_sequence,
            max_batch=self.max_batch,
            num_pages=num_pages,
            ranks=self.data_ranks,
            max_context=self.max_context,
        )

    # --- input checking ---------------------------------------------------------------------
    def _check_prompt(self, p, name: str) -> list[int]:
        V = self.cfg.vocab_size
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
            raise ValueError(f"{name} must be a list of token ids, got {type(p).__name__}")
        if len(p) == 0:
            raise ValueError(f"{name} is empty; a prompt needs at least one token")
        if len(p) > self.max_context:
            raise ValueError(f"{name} has {len(p)} tokens, beyond max_context={self.max_context}")
        ids = []
        for t in p:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"{name} holds a non-integer token {t!r}")
            if not 0 <= int(t) < V:
                raise ValueError(f"{name} holds token id {int(t)} outside the vocabulary [0, {V})")
            ids.append(int(t))
        return ids

    def _check_options(self, max_new_tokens, use_mtp, mtp_draft_tokens, stop_tokens) -> tuple[int, frozenset]:
        """-> (k, the stop ids): the arguments generate() and submit() share."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if use_mtp and not self.has_mtp:
            raise ValueError("use_mtp=True but the model has no MTP module (cfg.num_mtp_layers == 0)")
        if (
            isinstance(mtp_draft_tokens, bool)
            or not isinstance(mtp_draft_tokens, int)
            or not 1 <= mtp_draft_tokens <= MAX_DRAFT_TOKENS
        ):
            raise ValueError(
                f"mtp_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}] (a verify step "
                f"attends with s_q = k + 1 <= 4 queries), got {mtp_draft_tokens!r}"
            )
        if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, collections.abc.Iterable):
            raise ValueError(f"stop_tokens must be a sequence of token ids, got {stop_tokens!r}")
        stops = set()
        for t in stop_tokens:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"stop_tokens must be integers, got {t!r}")
            stops.add(int(t))
        k = mtp_draft_tokens if use_mtp else 0
        sched = self._sched
        if k != sched.k and sched.requests:
            raise ValueError(
                f"use_mtp={bool(k)}, mtp_draft_tokens={mtp_draft_tokens} while {len(sched.requests)} request(s) "
                f"run with {'MTP, ' + str(sched.k) + ' draft(s) a step' if sched.k else 'no MTP'}: one MTP setting "
                "for every running request"
            )
        return k, frozenset(stops)

    def _check_request(
        self, prompts, max_new_tokens, sampling, use_mtp, stop_tokens, stream, on_cache_full, mtp_draft_tokens
    ):
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise ValueError(
                f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__} "
                f"of length {len(prompts) if hasattr(prompts, '__len__') else '?'}"
            )
        clean = [self._check_prompt(p, f"prompt {i}") for i, p in enumerate(prompts)]
        if isinstance(sampling, SamplingParams):
            params = [sampling] * len(clean)
            keys = [jax.random.fold_in(jax.random.PRNGKey(sampling.seed), i) for i in range(len(clean))]
        else:
            params = list(sampling) if isinstance(sampling, (list, tuple)) else None
            if params is None or len(params) != len(clean) or not all(isinstance(s, SamplingParams) for s in params):
                raise ValueError(
                    "sampling must be a SamplingParams or a list of one SamplingParams per prompt "
                    f"({len(clean)}), got {sampling!r}"
                )
            keys = [jax.random.PRNGKey(s.seed) for s in params]
        k, stops = self._check_options(max_new_tokens, use_mtp, mtp_draft_tokens, stop_tokens)
        if stream is not None and not callable(stream):
            raise ValueError(f"stream must be a callable stream(request_index, token_id), got {stream!r}")
        if on_cache_full not in ON_CACHE_FULL:
            raise ValueError(f"on_cache_full must be one of {ON_CACHE_FULL}, got {on_cache_full!r}")
        return clean, params, [np.asarray(key, np.uint32) for key in keys], k, stops

    # --- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 32,
        sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(temperature=0.0),
        use_mtp: bool = False,
        stop_tokens: Sequence[int] = (),
        stream: Callable[[int, int], None] | None = None,
        on_cache_full: str = "fail_request",
        mtp_draft_tokens: int = 1,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` new tokens for each prompt (ragged lengths).

        At most `max_batch` prompts run at once; a finished one's slot takes the next waiting
        prompt. A request ends at a stop token (included in its output), after `max_new_tokens`,
        or when it fills `max_context`. `stream(request_index, token_id)` is called for every new
        token, in order per request. With a single `SamplingParams`, request i draws with the key
        fold_in(PRNGKey(seed), i); with a list, request i uses PRNGKey(its own seed); every draw
        folds in the token's position, so the output does not depend on batching.

        `use_mtp`: speculative decoding with the model's MTP module drafting `mtp_draft_tokens`
        (k in [1, 3]) tokens a step (k > 1 chains the one module on its own output); the output is
        the same as without it (greedy: identical tokens; sampling: the same distribution).

        When the pool runs out of pages for a request, `on_cache_full="fail_request"` ends that
        request (finish reason "error", the message in `errors`) and the others go on untouched;
        "raise" raises the `CacheFullError` (with `.partial_result`). A request whose logits turn
        NaN / infinite ends the same way (error, no token emitted). Bad arguments raise ValueError.

        The prompts are submitted as online requests (`submit`) and the engine steps until they end;
        requests submitted before (and still running) advance with them, and the stats count those
        steps. Whatever ends the call early (an exception, a `stream` that raises), its requests are
        cancelled and their pages freed.
        """
        prompts, params, keys, k, stops = self._check_request(
            prompts, max_new_tokens, sampling, use_mtp, stop_tokens, stream, on_cache_full, mtp_draft_tokens
        )
        sched = self._sched
        if not sched.requests:
            sched.configure(k)
        self.cache.peak_pages_used = self.cache.pages_used
        t0 = time.perf_counter()
        with self.recording(use_mtp=k > 0) as stats:
            reqs = [
                sched.add(
                    p,
                    sp,
                    key,
                    stops,
                    max_new_tokens,
                    on_token=None if stream is None else (lambda t, i=i: stream(i, t)),
                    raise_on_full=on_cache_full == "raise",
                )
                for i, (p, sp, key) in enumerate(zip(prompts, params, keys))
            ]
            try:
                while not all(r.done for r in reqs) and sched.step():
                    pass
            except CacheFullError as err:
                sched.drain()  # the call in flight's tokens into the partial result
                err.partial_result = self._result(reqs, stats, t0)
                raise
            finally:
                for r in reqs:  # no-op for those that ended
                    sched.abort(r.id)
        return self._result(reqs, stats, t0)

    def _result(self, reqs: list[_Request], stats: GenerationStats, t0: float) -> GenerationResult:
        firsts = [r.token_times[0] for r in reqs if r.token_times]
        stats.ttft_s = min(firsts) - t0 if firsts else None
        stats.pages_used_peak = self.cache.peak_pages_used
        stats.traces = trace_counts()
        stats.failed = sum(r.error is not None for r in reqs)
        return GenerationResult(
            [list(r.tokens) for r in reqs], stats, [r.finish_reason or "" for r in reqs], [r.error for r in reqs]
        )

    # --- online use -------------------------------------------------------------------------
    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int = 32,
        sampling: SamplingParams = SamplingParams(temperature=0.0),
        stop_tokens: Sequence[int] = (),
        on_token: Callable[[int], None] | None = None,
        use_mtp: bool = False,
        mtp_draft_tokens: int = 1,
    ) -> RequestHandle:
        """Queue one request now -> its `RequestHandle`; it is admitted by a later `step` (in submission order,
        when a slot and its prompt's pages are free) and runs alongside the others.

        prompt: token ids (1 .. max_context of them); it ends as in `generate` (a stop token, included;
        `max_new_tokens`; `max_context`; an error). Its draws use the key PRNGKey(sampling.seed), folded with
        each token's position (its tokens do not depend on what else runs). `on_token(token_id)` is called for
        each new token, in order, at the end of the step that made it; a callback that raises ends its own
        request ("error") and the exception comes out of that `step`. `use_mtp` / `mtp_draft_tokens` as in
        `generate`: one setting for all running requests (ValueError naming both otherwise). Bad arguments
        raise ValueError naming the value.
        """
        ids = self._check_prompt(prompt, "prompt")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {sampling!r}")
        if on_token is not None and not callable(on_token):
            raise ValueError(f"on_token must be a callable on_token(token_id), got {on_token!r}")
        k, stops = self._check_options(max_new_tokens, use_mtp, mtp_draft_tokens, stop_tokens)
        if not self._sched.requests:
            self._sched.configure(k)
        key = np.asarray(jax.random.PRNGKey(sampling.seed), np.uint32)
        return RequestHandle(self, self._sched.add(ids, sampling, key, stops, max_new_tokens, on_token=on_token))

    def step(self) -> bool:
        """One engine step for every running request (admission first: waiting requests take free slots):
        while rows are in their prompts, a mixed step (one token for every decoding row and up to
        `prefill_budget` prompt tokens) or, when no row decodes (or without mixed steps), a prefill step (a chunk
        for each row in its prompt); else up to `decode_steps` decode (or MTP verify) steps for every row. That
        call is enqueued, then the call of the step before is read: its new tokens go to their requests and
        their `on_token` callbacks. -> whether any request still waits or runs, or a call is in flight (False:
        nothing was done)."""
        return self._sched.step()

    def run_until_idle(self) -> None:
        """`step` until no request waits or runs."""
        while self.step():
            pass

    def warm_up(
        self, max_tokens: int | None = None, use_mtp: bool = False, mtp_draft_tokens: int = 1, progress: bool = False
    ) -> int:
        """Compile, ahead of any request, the steps of every shape a request of up to `max_tokens` tokens
        (prompt + new; default `max_context`) can meet: each prefill chunk bucket and each decode-loop length
        (with `use_mtp`: the MTP verify) at each block-table width, and the mixed step at each of its widths
        (when `mixed_steps` serves: no MTP, one data rank), the decoding ones with each decode-kernel program a
        step can take (`decode_config`: near-equal and ragged lengths), greedy sampling (another sampler compiles
        on first use). The programs compile in parallel threads (`progress`: a progress bar on stderr), then
        each runs once on idle rows, which write and read nothing. Only while no request waits or runs
        (ValueError otherwise). -> the step compilations it caused (0 when all were compiled)."""
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be a positive integer or None, got {max_tokens!r}")
        if self._sched.requests:
            raise ValueError(f"warm_up needs an idle engine; {len(self._sched.requests)} request(s) wait or run")
        k, _ = self._check_options(1, use_mtp, mtp_draft_tokens, ())
        self._sched.configure(k)
        return self._sched.warm_up(self.max_context if max_tokens is None else max_tokens, progress=progress)

    def draft_oracle(self, sequences: Sequence[Sequence[int]] | None, accept: float = 0.8, seed: int = 0) -> None:
        """Benchmarks only: MTP drafts that are right at the rate `accept`, for timing the verify path on a model
        whose own drafts are noise (random weights). `sequences[b]`: the whole token sequence (prompt, then the
        tokens plain greedy decoding makes) of the request that will sit in slot b (a `generate` call's prompts
        take slots 0, 1, ... in order on an idle engine). Verify steps are teacher-forced on those sequences (the
        drafts that are their tokens are accepted; the tokens emitted are theirs) and their new drafts become
        those tokens, each kept with probability `accept` and made wrong otherwise; the model and the MTP
        module still run. None: the model's own drafts and verification again."""
        if sequences is None:
            self._sched.oracle = None
            return
        if not 0.0 <= accept <= 1.0:
            raise ValueError(f"draft_oracle accept must be in [0, 1], got {accept!r}")
        if len(sequences) > self.max_batch:
            raise ValueError(f"draft_oracle got {len(sequences)} sequences for {self.max_batch} slots")
        L = self.max_context + MIXED_TILE
        table = np.zeros((self.max_batch, L), np.int32)
        for b, seq in enumerate(sequences):
            table[b, : min(len(seq), L)] = list(seq)[:L]
        key = np.asarray(jax.random.PRNGKey(seed), np.uint32)
        self._sched.oracle = DraftOracle(jnp.asarray(table), jnp.float32(accept), jnp.asarray(key))

    @property
    def num_requests(self) -> int:
        """Requests that wait or run."""
        return len(self._sched.requests)

    @contextlib.contextmanager
    def recording(self, use_mtp: bool = False) -> Iterator[GenerationStats]:
        """`with engine.recording() as stats:` counts every step run inside the block (whichever requests
        it serves) into a fresh `GenerationStats`."""
        stats = GenerationStats(use_mtp=use_mtp, pages_total=self.num_pages)
        self._sched.sinks.append(stats)
        try:
            yield stats
        finally:
            self._sched.sinks.remove(stats)
