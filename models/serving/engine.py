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
Beside it: the constructor's options checked and resolved (`models.serving.options`), the calls' arguments checked
(`models.serving.checks`), the page pool sized and placed (`models.serving.pool`), the results and handles a caller
holds (`models.serving.handles`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.cache_paths import cache_kernel_problems
from mla_jax.kv_cache import CacheFullError
from mla_jax.memory import DEFAULT_MEMORY_FRACTION, MemoryPlanError
from mla_jax.sharding import shard_model
from models.serving.checks import check_request, check_submit, check_warm_up
from models.serving.handles import GenerationResult, RequestHandle, RequestResult, generation_result
from models.serving.launches import MIXED_TILE
from models.serving.options import ATTENTION_IMPLS, PREFILL_BUDGET, default_prefill_chunk, engine_options
from models.serving.pages import rows_needed
from models.serving.pool import page_pool
from models.serving.requests import FINISH_REASONS
from models.serving.sampling import SamplingParams
from models.serving.scheduler import _Generation
from models.serving.stats import GenerationStats
from models.serving.steps import (
    DraftOracle,
    StepInputs,
    compiled_steps,
    decode_step,
    prefill_step,
    trace_counts,
    verify_step,
)

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


def kernel_problems(cfg, page_size: int, page_format) -> list[str]:
    """Why the Pallas kernels cannot serve this model's cache of `page_size`-token pages in `page_format`
    (a name, a jnp dtype or a `PageFormat`): [] when they can (`mla_jax.cache_paths.cache_kernel_problems`)."""
    return cache_kernel_problems(cfg, page_size, page_format)


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
        attention; up to 8192 when long chunks run the flash forward over the prefix: a Hopper GPU, bf16), halved
        by the memory plan (down to 64) while the largest prefill step's temporaries leave no room for the pages.
      decompressed_threshold: prefill chunks of at least this many tokens use the decompressed path
        (`naive_threshold` is its earlier name, still accepted).
      attention_impl: how attention reads the cache, one of `ATTENTION_IMPLS` (`mla_jax.cache_paths.
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
        ``schedule="auto"`` does (`mla_jax.cache_paths.step_decode_config`): per sequence on near-equal lengths,
        in pieces on ragged ones (the longest row more than 1.5x the mean pages), each program compiled when
        first taken or by `warm_up`, no conditional on the device; one program where no decode kernel runs or
        with data ranks. A step on the pieces schedule plans the kernel's work once from its
        lengths and every layer's call reads that plan (`mla_jax.cache_paths.with_decode_plan`).

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
        o = engine_options(
            model,
            mesh,
            page_size=page_size,
            num_pages=num_pages,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            decompressed_threshold=decompressed_threshold,
            naive_threshold=naive_threshold,
            attention_impl=attention_impl,
            max_context=max_context,
            kv_dtype=kv_dtype,
            min_chunk_bucket=min_chunk_bucket,
            min_table_tokens=min_table_tokens,
            decode_steps=decode_steps,
            mixed_steps=mixed_steps,
            prefill_budget=prefill_budget,
            decode_config=decode_config,
            memory_fraction=memory_fraction,
            device_memory=device_memory,
        )
        self.data_axes, self.data_ranks = o.data_axes, o.data_ranks
        self.backend, self.prefill_attention = o.backend, o.prefill_attention
        self.has_mtp, self.draft_room = o.has_mtp, o.draft_room
        self.cfg = model.cfg
        self.page_size = page_size
        self.max_batch = max_batch
        self.prefill_chunk = o.prefill_chunk
        self.decompressed_threshold = o.decompressed_threshold
        self.decode_steps = decode_steps
        self.decode_config = decode_config
        self.mixed_steps = mixed_steps
        self.mixed_rows, self.prefill_budget = o.mixed_rows, o.prefill_budget
        self.max_context = o.max_context
        self.min_chunk_bucket = min_chunk_bucket
        self.min_table_pages = o.min_table_pages
        if mesh is not None:
            model = shard_model(model, mesh)  # a no-op for a model already placed on this mesh
        self.mesh = mesh
        graphdef, self.state = nnx.split(model)
        self.steps = compiled_steps(graphdef)
        self.attention_impl = attention_impl
        self.compile_log: list[dict] = []
        self.cache, self.memory_plan, self.step_temporaries = page_pool(
            self, o.page_format, num_pages, cache_fill, memory_fraction, device_memory, prefill_chunk is None
        )
        self.num_pages = self.cache.num_pages
        self._sched = _Generation(self)  # the one scheduler: generate() and submit() both queue into it

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
        prompts, params, keys, k, stops = check_request(
            self, prompts, max_new_tokens, sampling, use_mtp, stop_tokens, stream, on_cache_full, mtp_draft_tokens
        )
        sched = self._sched
        if not sched.requests:
            sched.configure(k)
        self.cache.peak_pages_used = self.cache.pages_used
        t0 = time.perf_counter()
        with self.recording(use_mtp=k > 0) as stats:
            reqs = []
            for i, (p, sp, key) in enumerate(zip(prompts, params, keys)):
                on_token = None if stream is None else (lambda t, i=i: stream(i, t))
                reqs.append(sched.add(p, sp, key, stops, max_new_tokens, on_token, on_cache_full == "raise"))
            try:
                while not all(r.done for r in reqs) and sched.step():
                    pass
            except CacheFullError as err:
                sched.drain()  # the call in flight's tokens into the partial result
                err.partial_result = generation_result(reqs, stats, t0, self.cache.peak_pages_used)
                raise
            finally:
                for r in reqs:  # no-op for those that ended
                    sched.abort(r.id)
        return generation_result(reqs, stats, t0, self.cache.peak_pages_used)

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
        ids, k, stops = check_submit(
            self, prompt, max_new_tokens, sampling, stop_tokens, on_token, use_mtp, mtp_draft_tokens
        )
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
        self._sched.configure(check_warm_up(self, max_tokens, use_mtp, mtp_draft_tokens))
        return self._sched.warm_up(self.max_context if max_tokens is None else max_tokens, progress=progress)

    def draft_oracle(self, sequences: Sequence[Sequence[int]] | None, accept: float = 0.8, seed: int = 0) -> None:
        """Benchmarks only: MTP drafts that are right at the rate `accept`, for timing the verify path on a model
        whose own drafts are noise (random weights). `sequences[b]`: the whole token sequence (prompt, then the
        tokens plain greedy decoding makes) of the request that will sit in slot b (a `generate` call's prompts
        take slots 0, 1, ... in order on an idle engine). Verify steps are teacher-forced on those sequences (the
        drafts that are their tokens are accepted; the tokens emitted are theirs) and their new drafts become
        those tokens, each kept with probability `accept` and made wrong otherwise; the model and the MTP
        module still run. None: the model's own drafts and verification again."""
        length = self.max_context + MIXED_TILE  # a verify step's positions reach MIXED_TILE - 1 past max_context
        B = self.max_batch
        self._sched.oracle = (
            None if sequences is None else DraftOracle.of(sequences, accept, seed, slots=B, length=length)
        )

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
