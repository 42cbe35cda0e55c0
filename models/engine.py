"""Generation engine: a host scheduler over the jitted steps of `models.steps`, with a paged
latent KV cache, continuous batching, stop tokens, streaming and MTP speculative decoding.

Dimension letters: B slots (max_batch), T tokens a step, P block-table width (pages), G page size.

The engine never opens a layer: the forward pass (cache writes, attention path, MTP block) is the
model's (`model(ids, positions, cache=cache)`), the steps are pure functions in `models.steps`.
What lives here is scheduling, on the host:
- admission: a waiting prompt takes a free slot when its whole prompt fits in the page pool (on a
  mesh with data ranks: the pool of the slot's rank, see `Engine`'s `mesh`);
- reservation: before each step every row holds pages for the rows the step may write
  (`rows_needed`, the one draft-room function); a row that cannot get them fails alone;
- a step: the rows' inputs as bucketed arrays (B is always max_batch, idle rows padding; T and the
  block-table width P powers of two, so a long generation compiles a bounded number of times),
  the jitted step, its tokens back on the host;
- emission: new tokens to the request's output and the stream, then stop / length / context;
- finishing: the slot's pages back to the pool (rejected drafts' rows are rewound after each step).
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mla_jax.attention import CACHE_IMPLS, cache_kernel_problems, resolve_cache_impl, resolve_decompressed_impl
from mla_jax.kv_cache import INTERPRET_ON_DATA_RANKS, CacheFullError, KVCache, PagedLatentCache, next_pow2
from mla_jax.sharding import batch_axes, shard_batch, shard_model
from models.sampling import NonFiniteLogitsError, SamplingArrays, SamplingParams, sampler_kind
from models.steps import (
    MAX_DRAFT_TOKENS,
    NON_FINITE,
    StepInputs,
    compiled_steps,
    decode_step,
    prefill_step,
    trace_counts,
    verify_step,
)

ATTENTION_IMPLS = CACHE_IMPLS  # "auto" | "kernel" | "interpret" | "reference" (`pallas_kernels.backend`)
ON_CACHE_FULL = ("fail_request", "raise")
# The default prefill chunk (docs/NOTES.md "Flash prefill over the cached prefix"). With the jnp attention a
# chunk's fp32 scores are B x H x T x S, so chunks stay at PREFILL_CHUNK. With the flash forward over the prefix
# nothing grows with T x S, and a step's matmuls want many rows: every chunk reads every weight once, and a
# routed expert gets about tokens * K / E of the step's rows. So a step's tokens get a budget,
# FLASH_PREFILL_TOKENS over max_batch rows, a power of two per row within [PREFILL_CHUNK, FLASH_PREFILL_CHUNK].
PREFILL_CHUNK = 512
FLASH_PREFILL_TOKENS = 16384
FLASH_PREFILL_CHUNK = 8192

__all__ = [
    "ATTENTION_IMPLS",
    "CacheFullError",
    "Engine",
    "GenerationResult",
    "GenerationStats",
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


def rows_needed(cached: int, k: int, n_spec: int = 0) -> int:
    """The draft-room arithmetic, in one place: cache rows (positions 0 .. n-1) a step over a
    sequence of `cached` tokens may address, with `k` MTP drafts a step (0 without MTP) of which
    `n_spec` are verified.

    Without MTP a step writes t_n at `cached`: cached + 1. With MTP it keeps tokens up to
    cached + n_spec, and its draft chain writes k - 1 rows past the last kept one; a verify step's
    k + 1 queries also reach cached + k (the decode kernel counts the padding ones in). A prefill
    whose last prompt token is at position p needs `rows_needed(p, k)`.
    """
    if k == 0:
        return cached + 1
    return max(cached + n_spec + k, cached + 1 + k)


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
# Results
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class GenerationStats(collections.abc.Mapping):
    """Counters and timings of one `generate` call (also a read-only mapping: `stats["name"]`,
    `dict(stats)`).

    Times are wall clock on the host. Steps that compiled are kept apart (`compile_s`); `prefill_s`
    and `decode_s` sum the steps that did not, and the tokens/s figures are over those (over all
    steps when every step compiled). `ttft_s`: from the call to the first new token of any request.
    decode_tokens counts tokens computed by decode steps, including tokens cut off by a stop;
    decode_steps the model steps (a device call of several steps counts its longest row's), decode_calls
    the device calls.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_calls: int = 0
    mtp_drafted: int = 0
    mtp_accepted: int = 0
    use_mtp: bool = False
    compile_s: float = 0.0
    ttft_s: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    _warm_tokens: dict = dataclasses.field(default_factory=lambda: {"prefill": 0, "decode": 0}, repr=False)
    _all: dict = dataclasses.field(default_factory=lambda: {"prefill": [0, 0.0], "decode": [0, 0.0]}, repr=False)
    pages_used_peak: int = 0
    pages_total: int = 0
    traces: dict = dataclasses.field(default_factory=dict)
    failed: int = 0

    def record(self, kind: str, n_tokens: int, seconds: float, compiled: bool, steps: int = 1) -> None:
        setattr(self, f"{kind}_tokens", getattr(self, f"{kind}_tokens") + n_tokens)
        setattr(self, f"{kind}_steps", getattr(self, f"{kind}_steps") + steps)
        if kind == "decode":
            self.decode_calls += 1
        self._all[kind][0] += n_tokens
        self._all[kind][1] += seconds
        if compiled:
            self.compile_s += seconds
        else:
            self._warm_tokens[kind] += n_tokens
            setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds)

    def _rate(self, kind: str) -> float:
        n, t = self._warm_tokens[kind], getattr(self, f"{kind}_s")
        if t <= 0:
            n, t = self._all[kind]
        return n / t if t > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self._rate("prefill")

    @property
    def decode_tok_s(self) -> float:
        return self._rate("decode")

    @property
    def mtp_acceptance(self) -> float | None:
        if not self.use_mtp:
            return None
        return self.mtp_accepted / self.mtp_drafted if self.mtp_drafted else 0.0

    _KEYS = (
        "prefill_tok_s",
        "decode_tok_s",
        "compile_s",
        "ttft_s",
        "prefill_s",
        "decode_s",
        "prefill_tokens",
        "decode_tokens",
        "prefill_steps",
        "decode_steps",
        "decode_calls",
        "mtp_drafted",
        "mtp_accepted",
        "mtp_acceptance",
        "pages_used_peak",
        "pages_total",
        "traces",
        "failed",
    )

    def __getitem__(self, key: str):
        if key not in self._KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)


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
class _Seq:
    """Host state of one running request."""

    req: int
    prompt: list[int]
    params: SamplingParams
    key: np.ndarray  # uint32 [2]
    prefilled: int = 0  # prompt tokens in the cache
    cached: int = 0  # tokens in the cache
    pending: int = -1  # last sampled token, not yet in the cache
    out: list[int] = dataclasses.field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


# ------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------
class Engine:
    """Generation with a paged latent KV cache.

    Args:
      model: a `models.DeepSeekModel` (its weights are captured at construction).
      page_size: tokens a page (the decode kernel reads 64; tests use small pages on the jnp path).
      num_pages: pages in the pool; None = enough for max_batch sequences of max_context tokens
        (plus the MTP draft room), what `mla_jax.capacity.plan_kv_cache` predicts.
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
      decode_steps: plain decode steps (no MTP) one device call runs, sampling, feeding tokens back and
        finding stops on the device (`models.steps.decode_loop`); the host sees the tokens once a call.
        Pages for them are reserved up front; a row that stops early idles until the call ends.
      mesh: a `jax.sharding.Mesh` (`mla_jax.sharding.make_mesh`): the weights are placed by
        `mla_jax.sharding.shard_model`; the steps are partitioned by GSPMD. With `data` = 1 the page pools
        are replicated on every device. With `data` = D > 1 (the batch's mesh axes), a page pool per data
        rank: slot s belongs to rank s // (max_batch / D), which owns num_pages / D pages (max_batch and
        num_pages must be multiples of D); block tables hold page ids local to the rank; a request goes to
        a rank with a free slot and room for its prompt; a rank out of pages fails its own request only;
        the cache write, gather and decode kernel run per rank (`KVCache.data_parallel`). "interpret" is
        refused with data ranks (`mla_jax.kv_cache.INTERPRET_ON_DATA_RANKS`).

    `compile_log`: one dict per step that compiled, {"step", "bucket", "seconds"} (wall time of that
    call, compilation included).
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
        decode_steps: int = 8,
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
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"Engine {name} must be an integer >= {lo}, got {v!r}")
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
        # A model with an MTP head may address up to MAX_DRAFT_TOKENS rows past max_context
        # (`rows_needed`); the default pool is what `plan_kv_cache(cfg, context_len=max_context,
        # num_sequences=max_batch, include_mtp=True, draft_tokens=self.draft_room)` predicts.
        self.draft_room = rows_needed(max_context - 1, MAX_DRAFT_TOKENS) - max_context if self.has_mtp else 0
        pages_per_seq = -(-(max_context + self.draft_room) // page_size)
        if num_pages is None:
            num_pages = max_batch * pages_per_seq
        self.cfg = cfg
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.decompressed_threshold = decompressed_threshold
        self.decode_steps = decode_steps
        self.max_context = max_context
        self.min_chunk_bucket = min_chunk_bucket
        self.min_table_pages = -(-min_table_tokens // page_size)
        if mesh is not None:
            model = shard_model(model, mesh)  # a no-op for a model already placed on this mesh
        self.mesh = mesh
        graphdef, self.state = nnx.split(model)
        self.steps = compiled_steps(graphdef)
        self.cache = PagedLatentCache(
            num_layers=cfg.num_hidden_layers + (1 if self.has_mtp else 0),
            num_pages=num_pages,
            page_size=page_size,
            latent_dim=cfg.latent_dim,
            max_seqs=max_batch,
            max_pages_per_seq=next_pow2(pages_per_seq),
            page_format=kv_dtype,
            fill_value=cache_fill,
            rope_dim=cfg.qk_rope_head_dim,
            ranks=D,
        )
        if mesh is not None:
            # The latent has no head axis to split: every device of a data rank holds all of that rank's
            # pages (the whole pool when data = 1); the pool's N axis is split over the data ranks.
            pool = PartitionSpec(None, self.data_axes) if D > 1 else PartitionSpec()
            self.cache.pages = jax.device_put(self.cache.pages, NamedSharding(mesh, pool))
        self.attention_impl = attention_impl
        self.compile_log: list[dict] = []

    # --- input checking ---------------------------------------------------------------------
    def _check_request(
        self, prompts, max_new_tokens, sampling, use_mtp, stop_tokens, stream, on_cache_full, mtp_draft_tokens
    ):
        V = self.cfg.vocab_size
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise ValueError(
                f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__} "
                f"of length {len(prompts) if hasattr(prompts, '__len__') else '?'}"
            )
        clean = []
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
                raise ValueError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
            if len(p) > self.max_context:
                raise ValueError(f"prompt {i} has {len(p)} tokens, beyond max_context={self.max_context}")
            ids = []
            for t in p:
                if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                    raise ValueError(f"prompt {i} holds a non-integer token {t!r}")
                if not 0 <= int(t) < V:
                    raise ValueError(f"prompt {i} holds token id {int(t)} outside the vocabulary [0, {V})")
                ids.append(int(t))
            clean.append(ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
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
        stops = set()
        for t in stop_tokens:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"stop_tokens must be integers, got {t!r}")
            stops.add(int(t))
        if stream is not None and not callable(stream):
            raise ValueError(f"stream must be a callable stream(request_index, token_id), got {stream!r}")
        if on_cache_full not in ON_CACHE_FULL:
            raise ValueError(f"on_cache_full must be one of {ON_CACHE_FULL}, got {on_cache_full!r}")
        return clean, params, [np.asarray(k, np.uint32) for k in keys], stops

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
        """
        prompts, params, keys, stops = self._check_request(
            prompts, max_new_tokens, sampling, use_mtp, stop_tokens, stream, on_cache_full, mtp_draft_tokens
        )
        run = _Generation(
            self,
            prompts,
            params,
            keys,
            stops,
            max_new_tokens,
            mtp_draft_tokens if use_mtp else 0,
            stream,
            on_cache_full,
        )
        try:
            while run.step():
                pass
        finally:
            # Whatever ended the loop (an error raised, a stream callback that threw), no slot keeps
            # its pages: the next call starts from a clean pool.
            run.release_all()
        return run.result()


class _Generation:
    """The host scheduler of one `Engine.generate` call: explicit state and one method per act."""

    def __init__(
        self, engine: Engine, prompts, params, keys, stops, max_new_tokens: int, k: int, stream, on_cache_full: str
    ):
        self.e = engine
        self.cache = engine.cache
        self.prompts, self.params, self.keys, self.stops = prompts, params, keys, stops
        self.max_new_tokens, self.k, self.stream, self.on_cache_full = max_new_tokens, k, stream, on_cache_full
        n, B = len(prompts), engine.max_batch
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.reasons = [""] * n
        self.errors: list[str | None] = [None] * n
        self.waiting = collections.deque(range(n))
        self.slots: list[_Seq | None] = [None] * B
        self.stats = GenerationStats(use_mtp=k > 0, pages_total=engine.num_pages)
        self.sampler = sampler_kind(params)
        self.t_start = time.perf_counter()
        self.cache.peak_pages_used = self.cache.pages_used
        # The MTP draft state lives on the device between steps. Greedy drafts need no
        # distribution: a [B,k,1] placeholder keeps the steps' signature.
        V = engine.cfg.vocab_size if self.sampler != "greedy" else 1
        self.drafts = jnp.zeros((B, k), jnp.int32) if k else None
        self.draft_probs = jnp.zeros((B, k, V), jnp.float32) if k else None

    # --- the loop ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, then run one prefill or decode step; False when every request has ended."""
        self.admit()
        live = self.live()
        if not live:
            return bool(self.waiting)
        prefilling = [b for b in live if not self.slots[b].decoding]
        if prefilling:
            self.run_prefill(prefilling)
            return True
        spec = self.reserve_decode(live)
        live = self.live()
        if live:
            self.run_verify(live, spec) if self.k else self.run_decode(live, spec)
        return True

    def live(self) -> list[int]:
        return [b for b, s in enumerate(self.slots) if s is not None]

    def admit(self) -> None:
        """Waiting prompts, in order, into free slots while their whole prompt (and draft chain) fits the
        pool of the slot's data rank: the first free slot of each rank with a free slot, the ranks with
        the most free pages first (one rank: the first free slot). A prompt that fits no rank waits for a
        running request to free pages, or fails when none runs."""
        while self.waiting:
            first: dict[int, int] = {}
            for b, seq in enumerate(self.slots):
                if seq is None:
                    first.setdefault(self.cache.rank_of(b), b)
            if not first:
                return
            r = self.waiting[0]
            placed, err = None, None
            for b in sorted(first.values(), key=lambda b: -self.cache.free_pages_for(b)):
                try:
                    self.cache.reserve(b, rows_needed(len(self.prompts[r]) - 1, self.k))
                    placed = b
                    break
                except CacheFullError as e:
                    err = err or e
            if placed is None and self.live():
                return  # wait for a running request to free pages
            b = placed if placed is not None else min(first.values())
            self.waiting.popleft()
            self.slots[b] = _Seq(r, self.prompts[r], self.params[r], self.keys[r])
            if placed is None:
                self.fail(b, err)

    def reserve_decode(self, live: list[int]) -> dict[int, int]:
        """Pages for every decoding row's next device call, up front -> {slot: its budget}: with MTP the
        drafts it verifies, else the decode steps it may take (up to the engine's `decode_steps`, within its
        token and context budget). A row that cannot get those pages takes one token's worth (no draft, one
        step) if that fits, else fails alone."""
        budget = {}
        for b in live:
            seq = self.slots[b]
            if self.k:  # drafts only where their tokens could be kept (draft j is new token out + j)
                n = max(0, min(self.k, self.max_new_tokens - len(seq.out), self.e.max_context - seq.cached - 1))
                need, fallback, least = rows_needed(seq.cached, self.k, n), rows_needed(seq.cached, self.k, 0), 0
            else:  # step i writes position cached + i and makes the token at cached + i + 1 <= max_context
                n = min(self.e.decode_steps, self.max_new_tokens - len(seq.out), self.e.max_context - seq.cached)
                need, fallback, least = seq.cached + n, seq.cached + 1, 1
            try:
                self.cache.reserve(b, need)
                budget[b] = n
            except CacheFullError as err:
                extra = self.cache.pages_for(fallback) - len(self.cache.pages_of(b))
                if need != fallback and extra <= self.cache.free_pages_for(b):
                    self.cache.reserve(b, fallback)
                    budget[b] = least
                else:
                    self.fail(b, err)
        return budget

    # --- emission and the end of a request ----------------------------------------------------
    def emit(self, b: int, tok: int, position: int) -> bool:
        """Record slot b's new token (at `position` of its sequence); True when the request is done
        (and its slot freed). A `NON_FINITE` token ends the request with an error, emitting nothing."""
        seq = self.slots[b]
        if tok == NON_FINITE:
            err = NonFiniteLogitsError(
                f"request {seq.req}: the model produced NaN or infinite logits at position {position} (its weights "
                "or activations are not finite: a corrupt or mis-converted checkpoint, or a dtype that overflows)"
            )
            self.errors[seq.req] = str(err)
            self.finish(b, "error")
            return True
        if self.stats.ttft_s is None:
            self.stats.ttft_s = time.perf_counter() - self.t_start
        seq.out.append(tok)
        self.tokens[seq.req].append(tok)
        if self.stream is not None:
            self.stream(seq.req, tok)
        if tok in self.stops:
            self.finish(b, "stop")
        elif len(seq.out) >= self.max_new_tokens:
            self.finish(b, "length")
        elif position >= self.e.max_context:  # the new token could not be fed back
            self.finish(b, "context")
        else:
            seq.pending = tok
            return False
        return True

    def finish(self, b: int, reason: str) -> None:
        self.reasons[self.slots[b].req] = reason
        self.cache.release(b)
        self.slots[b] = None

    def fail(self, b: int, err: CacheFullError) -> None:
        self.errors[self.slots[b].req] = str(err)
        self.finish(b, "error")
        if self.on_cache_full == "raise":
            err.partial_result = self.result()
            raise err

    def release_all(self) -> None:
        for b, seq in enumerate(self.slots):
            if seq is not None:
                self.cache.release(b)
                self.slots[b] = None

    def result(self) -> GenerationResult:
        st = self.stats
        st.pages_used_peak = self.cache.peak_pages_used
        st.traces = trace_counts()
        st.failed = sum(e is not None for e in self.errors)
        return GenerationResult(self.tokens, st, self.reasons, self.errors)

    # --- steps: host arrays in, the jitted step, host results out ------------------------------
    def _inputs(self, rows, T: int, table_tokens: int):
        """Padding inputs for every slot (idle rows: position -1) and the cache over a block table
        covering `table_tokens` tokens (bucketed to a power of two of pages)."""
        B, c = self.e.max_batch, self.cache
        P = min(next_pow2(max(self.e.min_table_pages, c.pages_for(table_tokens))), c.max_pages_per_seq)
        ids = np.zeros((B, T), np.int32)
        pos = np.full((B, T), -1, np.int32)
        lengths = np.zeros((B,), np.int32)
        last = np.zeros((B,), np.int32)
        keys = np.zeros((B, 2), np.uint32)
        sp = [SamplingParams(temperature=0.0)] * B
        for b in rows:
            keys[b] = self.slots[b].key
            sp[b] = self.slots[b].params
        return ids, pos, lengths, last, keys, sp, c.block_tables[:, :P].copy()

    def _call(self, kind: str, fn, inp: StepInputs, *args, n_host: int = 1, **static):
        """Run one step on the device cache; the cache comes back updated, its first `n_host`
        outputs as numpy (the rest, the MTP draft state, stays on the device)."""
        traces0 = sum(trace_counts().values())
        t0 = time.perf_counter()
        dp = None
        if self.e.data_ranks > 1:  # the rows (and their local block tables) to their data ranks
            dp = (self.e.mesh, self.e.data_axes)
            inp, args = shard_batch((inp, args), self.e.mesh)
        cache = KVCache.create(
            self.cache.pages,
            inp.block_table,
            inp.lengths,
            impl=self.e.backend,
            decompressed_threshold=self.e.decompressed_threshold,
            page_format=self.cache.page_format,
            data_parallel=dp,
        )
        cache, *outs = fn(self.e.state, cache, inp, *args, **static)
        self.cache.pages = cache.pages
        host = [np.asarray(o) if i < n_host else o for i, o in enumerate(outs)]
        dt = time.perf_counter() - t0
        compiled = sum(trace_counts().values()) != traces0
        if compiled:
            B, T = inp.ids.shape
            self.e.compile_log.append(dict(step=kind, bucket=f"B={B} T={T} P={inp.block_table.shape[1]}", seconds=dt))
        return host, dt, compiled

    def run_prefill(self, rows: list[int]) -> None:
        slots = self.slots
        chunk = {b: min(self.e.prefill_chunk, len(slots[b].prompt) - slots[b].prefilled) for b in rows}
        T = next_pow2(max(self.e.min_chunk_bucket, *chunk.values()))
        # The table covers every page a row holds: its whole prompt (and the draft chain's rows).
        need = max(len(self.cache.pages_of(b)) for b in rows) * self.cache.page_size
        ids, pos, lengths, last, keys, sp, bt = self._inputs(rows, T, need)
        nxt = np.zeros_like(ids)
        ends = np.zeros((self.e.max_batch,), bool)
        for b in rows:
            seq, c = slots[b], chunk[b]
            a = seq.prefilled
            ids[b, :c] = seq.prompt[a : a + c]
            pos[b, :c] = np.arange(a, a + c)
            follow = seq.prompt[a + 1 : a + c + 1]
            nxt[b, : len(follow)] = follow
            lengths[b] = a + c
            last[b] = c - 1
            ends[b] = a + c == len(seq.prompt)
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        if self.k:
            (toks, self.drafts, self.draft_probs), dt, compiled = self._call(
                "prefill",
                self.e.steps.prefill,
                inp,
                nxt,
                ends,
                self.drafts,
                self.draft_probs,
                use_mtp=True,
                sampler=self.sampler,
            )
        else:
            (toks, _, _), dt, compiled = self._call(
                "prefill", self.e.steps.prefill, inp, None, None, None, None, use_mtp=False, sampler=self.sampler
            )
        self.stats.record("prefill", sum(chunk.values()), dt, compiled)
        for b in rows:
            seq = slots[b]
            seq.prefilled += chunk[b]
            seq.cached = seq.prefilled
            if ends[b]:
                self.emit(b, int(toks[b]), seq.cached)

    def run_decode(self, rows: list[int], steps: dict[int, int]) -> None:
        """Up to `steps[b]` decode steps for each row in one device call (`models.steps.decode_loop`): the
        loop's length is a power of two <= the engine's `decode_steps` (a bounded number of compilations),
        the table covers every row's pages for its steps, stops are found on the device."""
        B = self.e.max_batch
        num_steps = min(self.e.decode_steps, next_pow2(max(steps[b] for b in rows)))
        ids, pos, lengths, last, keys, sp, bt = self._inputs(
            rows, 1, max(self.slots[b].cached + steps[b] for b in rows)
        )
        steps_B = np.zeros((B,), np.int32)
        stop_ids = np.full((B, max(1, len(self.stops))), -1, np.int32)
        for b in rows:
            seq = self.slots[b]
            ids[b, 0] = seq.pending
            pos[b, 0] = seq.cached
            lengths[b] = seq.cached + 1
            steps_B[b] = steps[b]
            stop_ids[b, : len(self.stops)] = sorted(self.stops)
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        (toks, count), dt, compiled = self._call(
            "decode",
            self.e.steps.decode_loop,
            inp,
            steps_B,
            stop_ids,
            n_host=2,
            sampler=self.sampler,
            num_steps=num_steps,
        )
        self.stats.record("decode", int(count.sum()), dt, compiled, steps=int(count.max()))
        for b in rows:
            n = int(count[b])
            self._advance(b, [int(t) for t in toks[b, :n]], n - 1)

    def run_verify(self, rows: list[int], spec: dict[int, int]) -> None:
        k = self.k
        # The table covers what the step addresses (`rows_needed`): the kernel sees seq_len =
        # cached + 1 + k with the padding queries counted in, even where fewer drafts are verified.
        need = max(
            max(len(self.cache.pages_of(b)) * self.cache.page_size, rows_needed(self.slots[b].cached, k)) for b in rows
        )
        ids, pos, lengths, last, keys, sp, bt = self._inputs(rows, k + 1, need)
        n_spec = np.zeros((self.e.max_batch,), np.int32)
        for b in rows:
            seq = self.slots[b]
            ids[b, 0] = seq.pending
            pos[b, : 1 + spec[b]] = np.arange(seq.cached, seq.cached + 1 + spec[b])
            lengths[b] = seq.cached + 1 + spec[b]
            n_spec[b] = spec[b]
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        (toks, acc, self.drafts, self.draft_probs), dt, compiled = self._call(
            "verify", self.e.steps.verify, inp, self.drafts, self.draft_probs, n_spec, n_host=2, sampler=self.sampler
        )
        self.stats.record("decode", sum(1 + int(acc[b]) for b in rows), dt, compiled)
        for b in rows:
            self.stats.mtp_drafted += spec[b]
            self.stats.mtp_accepted += int(acc[b])
            self._advance(b, [int(t) for t in toks[b, : 1 + int(acc[b])]], int(acc[b]))

    def _advance(self, b: int, toks: list[int], accepted: int) -> None:
        """A decode / verify call's new tokens for slot b: the cache keeps t_n and the `accepted` tokens after
        it (accepted drafts, or the later tokens of a multi-step decode; the rows reserved past them are
        rewound, a page freed if emptied), then the tokens are emitted."""
        seq = self.slots[b]
        first = seq.cached + 1  # position of the first new token
        seq.cached += 1 + accepted
        self.cache.truncate(b, seq.cached)
        for i, tok in enumerate(toks):
            if self.emit(b, tok, first + i):
                break
