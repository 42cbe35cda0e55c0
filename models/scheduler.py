"""The engine's host scheduler: requests that come and go, a batch of slots, one step at a time.

Dimension letters: B slots (max_batch), T tokens a step, P block-table width (pages), G page size.

A request (`_Request`) is submitted at any time and waits; `_Generation.step()` runs one engine step:
- admission: a waiting prompt takes a free slot when its whole prompt fits in the page pool (on a
  mesh with data ranks: the pool of the slot's rank, see `models.engine.Engine`'s `mesh`);
- reservation: before each step every row holds pages for the rows the step may write
  (`rows_needed`, the one draft-room function); a row that cannot get them fails alone;
- a step: the rows' inputs as bucketed arrays (B is always max_batch, idle rows padding; T and the
  block-table width P powers of two, so a long generation compiles a bounded number of times),
  the jitted step (`models.steps`), its tokens back on the host;
- emission: new tokens to the request's output, then stop / length / context;
- finishing: the slot's pages back to the pool (rejected drafts' rows are rewound after each step);
- delivery: once the step's bookkeeping is done, each new token to its request's `on_token` callback.
A request can be cancelled between steps (or from a callback); ending a request, for any reason, touches
only its own slot and pages.

A step is one of three kinds:
- prefill: no row decodes; every row still in its prompt prefills one chunk (up to `prefill_chunk` tokens);
- mixed (`mixing`: the engine's `mixed_steps`, no MTP, one data rank): some rows decode and some are in their
  prompts; every decoding row makes one token, and the prompts take up to the engine's prefill budget of
  tokens, first come first served, cut into `MIXED_TILE`-token rows of the step (`run_mixed`);
- decode: every row decodes: up to `decode_steps` tokens in one device call, or one MTP verify.
Without `mixing`, a step with any row in its prompt is a prefill step and the decoding rows wait.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.attention import step_decode_config
from mla_jax.kv_cache import CacheFullError, KVCache, next_pow2
from mla_jax.sharding import shard_batch
from models.sampling import NonFiniteLogitsError, SamplingArrays, SamplingParams, sampler_kind
from models.steps import MAX_DRAFT_TOKENS, NON_FINITE, StepInputs, trace_counts

FINISH_REASONS = ("stop", "length", "context", "error", "cancelled")
MIN_STOP_IDS = 4  # the smallest stop-id width of a decode call
# Query tokens a row of a mixed step carries: those of a verify step's row, so that the layers attend with the
# decode kernel straight on the pages (docs/NOTES.md, "Mixed steps", has the cost arithmetic).
MIXED_TILE = MAX_DRAFT_TOKENS + 1
_PER_STEP = object()  # `_call`: the decode config from the step's own lengths


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


# ------------------------------------------------------------------------------------------
# Counters
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class GenerationStats(collections.abc.Mapping):
    """Counters and timings of the steps run while it was recording (one `generate` call, or an
    `Engine.recording()` block); also a read-only mapping: `stats["name"]`, `dict(stats)`.

    Times are wall clock on the host. Steps that compiled are kept apart (`compile_s`); `prefill_s`
    and `decode_s` sum the steps that did not, and the tokens/s figures are over those (over all
    steps when every step compiled). `ttft_s`: from the call to the first new token of any of its
    requests (None outside `generate`). decode_tokens counts tokens computed by decode steps, including
    tokens cut off by a stop; decode_steps the model steps (a device call of several steps counts its
    longest row's), decode_calls the device calls. `decode_call_ms_per_step`: per decode call that did not
    compile, its wall time / its steps (not part of the mapping). Mixed steps (prompt chunks and decode rows
    in one step) count in `mixed_steps`, their time in `mixed_s` (or `compile_s`), their prompt tokens in
    prefill_tokens and their decode rows' tokens in decode_tokens; the tok/s figures are over the prefill and
    decode steps only, and prefill_steps / decode_steps / decode_calls leave mixed steps out.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_calls: int = 0
    mixed_steps: int = 0
    mtp_drafted: int = 0
    mtp_accepted: int = 0
    use_mtp: bool = False
    compile_s: float = 0.0
    ttft_s: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    mixed_s: float = 0.0
    _warm_tokens: dict = dataclasses.field(default_factory=lambda: {"prefill": 0, "decode": 0}, repr=False)
    _all: dict = dataclasses.field(default_factory=lambda: {"prefill": [0, 0.0], "decode": [0, 0.0]}, repr=False)
    pages_used_peak: int = 0
    pages_total: int = 0
    traces: dict = dataclasses.field(default_factory=dict)
    failed: int = 0
    decode_call_ms_per_step: list = dataclasses.field(default_factory=list, repr=False)

    def record(self, kind: str, n_tokens: int, seconds: float, compiled: bool, steps: int = 1) -> None:
        """One step of `kind` ("prefill" or "decode") that computed `n_tokens` tokens in `steps` model steps."""
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
            if kind == "decode" and steps > 0:
                self.decode_call_ms_per_step.append(seconds * 1e3 / steps)

    def record_mixed(self, prompt_tokens: int, decode_tokens: int, seconds: float, compiled: bool) -> None:
        """One mixed step: `prompt_tokens` prompt tokens and `decode_tokens` decode rows' tokens."""
        self.mixed_steps += 1
        self.prefill_tokens += prompt_tokens
        self.decode_tokens += decode_tokens
        if compiled:
            self.compile_s += seconds
        else:
            self.mixed_s += seconds

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
        "mixed_s",
        "prefill_tokens",
        "decode_tokens",
        "prefill_steps",
        "decode_steps",
        "decode_calls",
        "mixed_steps",
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


# ------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Request:
    """One request's record, shared by the scheduler (while it waits or runs) and its handle.

    tokens: its new tokens so far (the stop token included when one ended it); token_times: the host's
    `time.perf_counter()` when each came back from the device; finish_reason: None while it waits or
    runs, then one of `FINISH_REASONS`; error: the message of what ended it with "error"."""

    id: int
    prompt: list[int]
    params: SamplingParams
    key: np.ndarray  # uint32 [2]
    stops: frozenset
    max_new_tokens: int
    on_token: Callable[[int], None] | None = None
    raise_on_full: bool = False  # a CacheFullError ending it propagates out of the step
    submitted_at: float = 0.0
    tokens: list[int] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _Seq:
    """Host state of a request in a slot."""

    req: int  # the request's id
    request: _Request
    prefilled: int = 0  # prompt tokens in the cache
    cached: int = 0  # tokens in the cache
    pending: int = -1  # last sampled token, not yet in the cache

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def out(self) -> list[int]:
        return self.request.tokens

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


# ------------------------------------------------------------------------------------------
# The scheduler
# ------------------------------------------------------------------------------------------
class _Generation:
    """The host scheduler of an engine: explicit state and one method per act.

    `engine` gives the pool (`cache`), `max_batch`, `num_pages`, `cfg`, `max_context` (and, to run steps,
    its compiled steps and step settings). `k`: MTP drafts a step (0: plain decode), one value for every
    running request (`configure` changes it while idle). The `prompts` given here (with their `params`,
    `keys`, shared `stops`, `max_new_tokens`, `stream(index, token)` and `on_cache_full`) are submitted
    at once as requests 0 .. n-1; `tokens`, `reasons`, `errors` are theirs, in order.
    """

    def __init__(
        self,
        engine,
        prompts=(),
        params=(),
        keys=(),
        stops=frozenset(),
        max_new_tokens: int = 1,
        k: int = 0,
        stream=None,
        on_cache_full: str = "fail_request",
    ):
        self.e = engine
        self.cache = engine.cache
        self.slots: list[_Seq | None] = [None] * engine.max_batch
        self.waiting: collections.deque[int] = collections.deque()
        self.requests: dict[int, _Request] = {}  # waiting or running, by id
        self.next_id = 0
        self.sinks: list[GenerationStats] = []  # the stats recording now (`Engine.recording`)
        self.events: list[tuple[_Request, int]] = []  # tokens of this step, not yet delivered
        self.stepping = False
        self.configure(k)
        self.batch = [
            self.add(
                p,
                sp,
                key,
                frozenset(stops),
                max_new_tokens,
                on_token=None if stream is None else (lambda t, i=i: stream(i, t)),
                raise_on_full=on_cache_full == "raise",
            )
            for i, (p, sp, key) in enumerate(zip(prompts, params, keys))
        ]

    def configure(self, k: int) -> None:
        """MTP drafts a step for the requests to come; only while no request waits or runs."""
        if self.requests:
            raise RuntimeError(f"the scheduler has {len(self.requests)} request(s) in flight; k stays {self.k}")
        self.k = k
        B = self.e.max_batch
        # The MTP draft state lives on the device between steps. Greedy drafts need no distribution: a
        # [B,k,1] placeholder keeps the steps' signature (`_match_draft_probs`).
        self.drafts = jnp.zeros((B, k), jnp.int32) if k else None
        self.draft_probs = jnp.zeros((B, k, 1), jnp.float32) if k else None

    # --- the constructor's requests -------------------------------------------------------------
    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.batch]

    @property
    def reasons(self) -> list[str]:
        return [r.finish_reason or "" for r in self.batch]

    @property
    def errors(self) -> list[str | None]:
        return [r.error for r in self.batch]

    # --- requests in and out ------------------------------------------------------------------
    def add(
        self, prompt, params, key, stops, max_new_tokens: int, on_token=None, raise_on_full: bool = False
    ) -> _Request:
        """Queue a request (arguments already checked) -> its record; it is admitted by a later `step`."""
        r = _Request(
            self.next_id,
            list(prompt),
            params,
            key,
            frozenset(stops),
            max_new_tokens,
            on_token,
            raise_on_full,
            submitted_at=time.perf_counter(),
        )
        self.next_id += 1
        self.requests[r.id] = r
        self.waiting.append(r.id)
        return r

    def abort(self, rid: int, reason: str = "cancelled", error: str | None = None) -> bool:
        """End request `rid` now, waiting or running (its slot and pages freed; its tokens so far kept);
        False when it had already ended."""
        r = self.requests.get(rid)
        if r is None:
            return False
        for b, seq in enumerate(self.slots):
            if seq is not None and seq.req == rid:
                r.error = error
                self.finish(b, reason)
                return True
        self.waiting.remove(rid)
        r.error, r.finish_reason = error, reason
        del self.requests[rid]
        return True

    # --- the loop ---------------------------------------------------------------------------
    @property
    def mixing(self) -> bool:
        """Whether a step may carry prompt chunks and decode rows together: the engine's `mixed_steps`, without
        MTP (a decoding row there is a verify step's k + 1 tokens and the draft state is per slot) and on one
        data rank (a mixed step's rows are not slots, and rows go to data ranks by index)."""
        return self.e.mixed_steps and not self.k and self.e.data_ranks == 1

    def step(self) -> bool:
        """Admit, then run one prefill, mixed or decode step, then deliver its tokens; False when no request
        waits or runs (nothing was done). An exception an `on_token` callback raised ends that request
        ("error") and is raised here once every other token of the step is delivered."""
        if self.stepping:
            raise RuntimeError("Engine.step() called from inside a step (an on_token callback)")
        self.stepping = True
        try:
            try:
                return self._step()
            finally:
                self.deliver()  # also when the step raised: the tokens it emitted are in their requests
        finally:
            self.stepping = False

    def _step(self) -> bool:
        self.admit()
        live = self.live()
        if not live:
            return bool(self.waiting)
        self.sampler = sampler_kind([self.slots[b].params for b in live])
        self._match_draft_probs()
        prefilling = [b for b in live if not self.slots[b].decoding]
        if prefilling:
            decoding = [b for b in live if self.slots[b].decoding] if self.mixing else []
            if decoding:
                decoding = list(self.reserve_decode(decoding, max_steps=1))  # a row short of pages fails alone
            if decoding:
                self.run_mixed(prefilling, decoding)
            else:
                self.run_prefill(prefilling)
            return True
        spec = self.reserve_decode(live)
        live = self.live()
        if live:
            self.run_verify(live, spec) if self.k else self.run_decode(live, spec)
        return True

    def _match_draft_probs(self) -> None:
        """The draft distributions' width for this step's sampler: [B,k,V] when any row samples, a [B,k,1]
        placeholder when all are greedy. A greedy row's draft distribution is one-hot at its draft, so
        widening is exact for the rows already drafting."""
        if not self.k:
            return
        V = self.e.cfg.vocab_size if self.sampler != "greedy" else 1
        if self.draft_probs.shape[-1] != V:
            if V == 1:
                self.draft_probs = jnp.zeros(self.draft_probs.shape[:2] + (1,), jnp.float32)
            else:
                self.draft_probs = jax.nn.one_hot(self.drafts, V, dtype=jnp.float32)

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
            r = self.requests[self.waiting[0]]
            placed, err = None, None
            for b in sorted(first.values(), key=lambda b: -self.cache.free_pages_for(b)):
                try:
                    self.cache.reserve(b, rows_needed(len(r.prompt) - 1, self.k))
                    placed = b
                    break
                except CacheFullError as e:
                    err = err or e
            if placed is None and self.live():
                return  # wait for a running request to free pages
            b = placed if placed is not None else min(first.values())
            self.waiting.popleft()
            self.slots[b] = _Seq(r.id, r)
            if placed is None:
                self.fail(b, err)

    def reserve_decode(self, live: list[int], max_steps: int | None = None) -> dict[int, int]:
        """Pages for every decoding row's next device call, up front -> {slot: its budget}: with MTP the
        drafts it verifies, else the decode steps it may take (up to `max_steps`, default the engine's
        `decode_steps`, within its token and context budget). A row that cannot get those pages takes one
        token's worth (no draft, one step) if that fits, else fails alone."""
        budget = {}
        for b in live:
            seq = self.slots[b]
            left = seq.request.max_new_tokens - len(seq.out)
            if self.k:  # drafts only where their tokens could be kept (draft j is new token out + j)
                n = max(0, min(self.k, left, self.e.max_context - seq.cached - 1))
                need, fallback, least = rows_needed(seq.cached, self.k, n), rows_needed(seq.cached, self.k, 0), 0
            else:  # step i writes position cached + i and makes the token at cached + i + 1 <= max_context
                n = min(max_steps or self.e.decode_steps, left, self.e.max_context - seq.cached)
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
        r = seq.request
        if tok == NON_FINITE:
            err = NonFiniteLogitsError(
                f"request {seq.req}: the model produced NaN or infinite logits at position {position} (its weights "
                "or activations are not finite: a corrupt or mis-converted checkpoint, or a dtype that overflows)"
            )
            r.error = str(err)
            self.finish(b, "error")
            return True
        r.tokens.append(tok)
        r.token_times.append(time.perf_counter())
        if r.on_token is not None:
            self.events.append((r, tok))
        if tok in r.stops:
            self.finish(b, "stop")
        elif len(r.tokens) >= r.max_new_tokens:
            self.finish(b, "length")
        elif position >= self.e.max_context:  # the new token could not be fed back
            self.finish(b, "context")
        else:
            seq.pending = tok
            return False
        return True

    def finish(self, b: int, reason: str) -> None:
        r = self.slots[b].request
        r.finish_reason = reason
        self.requests.pop(r.id, None)
        self.cache.release(b)
        self.slots[b] = None

    def fail(self, b: int, err: CacheFullError) -> None:
        r = self.slots[b].request
        r.error = str(err)
        self.finish(b, "error")
        if r.raise_on_full:
            raise err

    def deliver(self) -> None:
        """The step's tokens to their requests' `on_token`, in order per request. A callback that raises
        ends its own request ("error", its later tokens not delivered); the first such exception is
        raised once the other tokens are delivered."""
        events, self.events = self.events, []
        failed, first = set(), None
        for r, tok in events:
            if r.id in failed or r.finish_reason == "cancelled":
                continue
            try:
                r.on_token(tok)
            except BaseException as exc:  # KeyboardInterrupt included: the consumer stopped
                failed.add(r.id)
                self.abort(r.id, "error", f"on_token raised {type(exc).__name__}: {exc}")
                first = first or exc
        if first is not None:
            raise first

    # --- compiling ahead ----------------------------------------------------------------------
    def warm_up(self, max_tokens: int) -> int:
        """Run every step shape a request of up to `max_tokens` tokens can meet once, on idle rows (positions
        -1: nothing written, nothing attended): each prefill chunk bucket and each decode-loop length (or the
        MTP verify) at each block-table width, and when `mixing` the mixed step at each of its widths, the
        decoding ones with each decode-kernel config a step can take (`_warm_decode_configs`), with the greedy
        sampler. Only while no request waits or runs. -> the step compilations it caused."""
        if self.requests:
            raise RuntimeError(f"warm_up needs an idle engine; {len(self.requests)} request(s) in flight")
        e, c = self.e, self.cache
        traces0 = sum(trace_counts().values())
        self.sampler = "greedy"
        self._match_draft_probs()
        longest = min(max_tokens, e.max_context)
        widths = self._widths(c.pages_for(longest + (e.draft_room if self.k else 0)))
        chunks = sorted({next_pow2(max(e.min_chunk_bucket, n)) for n in range(1, e.prefill_chunk + 1)})
        loops = sorted({min(e.decode_steps, next_pow2(n)) for n in range(1, e.decode_steps + 1)})
        B = e.max_batch
        decode_configs = self._warm_decode_configs()  # each program a decoding step can take
        if self.mixing:  # a mixed step's table also covers its rows' padding queries (`run_mixed`)
            for P in self._widths(c.pages_for(longest - 1 + MIXED_TILE)):
                rows = list(range(B)) + [0] * e.mixed_rows
                ids, pos, lengths, last, keys, sp, bt = self._inputs([], MIXED_TILE, P * c.page_size, rows)
                inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
                for dc in decode_configs:
                    args = (None, None, None, None)
                    self._call("mixed", e.steps.prefill, inp, *args, use_mtp=False, sampler="greedy", decode_config=dc)
        for P in widths:
            for T in chunks:
                ids, pos, lengths, last, keys, sp, bt = self._inputs([], T, P * c.page_size)
                inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
                if self.k:
                    nxt, ends = np.zeros_like(ids), np.zeros((B,), bool)
                    args = (nxt, ends, self.drafts, self.draft_probs)
                    (_, self.drafts, self.draft_probs), _, _ = self._call(
                        "prefill", e.steps.prefill, inp, *args, use_mtp=True, sampler=self.sampler
                    )
                else:
                    args = (None, None, None, None)
                    self._call("prefill", e.steps.prefill, inp, *args, use_mtp=False, sampler=self.sampler)
            if self.k:
                ids, pos, lengths, last, keys, sp, bt = self._inputs([], self.k + 1, P * c.page_size)
                inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
                n_spec = np.zeros((B,), np.int32)
                for dc in decode_configs:
                    (_, _, self.drafts, self.draft_probs), _, _ = self._call(
                        "verify",
                        e.steps.verify,
                        inp,
                        self.drafts,
                        self.draft_probs,
                        n_spec,
                        n_host=2,
                        sampler="greedy",
                        decode_config=dc,
                    )
                continue
            for n in loops:
                ids, pos, lengths, last, keys, sp, bt = self._inputs([], 1, P * c.page_size)
                inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
                stop_ids = np.full((B, MIN_STOP_IDS), -1, np.int32)
                steps_B = np.zeros((B,), np.int32)
                for dc in decode_configs:
                    self._call(
                        "decode",
                        e.steps.decode_loop,
                        inp,
                        steps_B,
                        stop_ids,
                        n_host=2,
                        sampler="greedy",
                        num_steps=n,
                        decode_config=dc,
                    )
        return sum(trace_counts().values()) - traces0

    def _widths(self, top: int) -> list[int]:
        """The block-table widths (pages) of the steps whose tables cover 1 .. `top` pages (`_inputs`' buckets)."""
        e, c = self.e, self.cache
        return sorted({min(next_pow2(max(e.min_table_pages, p)), c.max_pages_per_seq) for p in range(1, top + 1)})

    # --- steps: host arrays in, the jitted step, host results out ------------------------------
    def _inputs(self, rows, T: int, table_tokens: int, row_slots=None):
        """Padding inputs for every row of a step (idle rows: position -1) and the cache over a block table
        covering `table_tokens` tokens (bucketed to a power of two of pages). Row r serves slot `row_slots[r]`
        (its block table, key and sampling); by default the B rows are the B slots. `rows`: the rows that carry
        tokens."""
        B, c = self.e.max_batch, self.cache
        row_slots = list(range(B)) if row_slots is None else row_slots
        R = len(row_slots)
        P = min(next_pow2(max(self.e.min_table_pages, c.pages_for(table_tokens))), c.max_pages_per_seq)
        ids = np.zeros((R, T), np.int32)
        pos = np.full((R, T), -1, np.int32)
        lengths = np.zeros((R,), np.int32)
        last = np.zeros((R,), np.int32)
        keys = np.zeros((R, 2), np.uint32)
        sp = [SamplingParams(temperature=0.0)] * R
        for r in rows:
            seq = self.slots[row_slots[r]]
            keys[r] = seq.request.key
            sp[r] = seq.params
        return ids, pos, lengths, last, keys, sp, c.block_tables[row_slots, :P]

    def _record(self, kind: str, n_tokens: int, seconds: float, compiled: bool, steps: int = 1) -> None:
        for st in self.sinks:
            st.record(kind, n_tokens, seconds, compiled, steps)

    def _decode_config(self, kind: str, lengths):
        """The decode kernel's config of a step (`step_decode_config`: "auto", and the default, picked from the
        rows' lengths). One program, whatever the lengths, for a prefill step (no retrace when its lengths
        spread) and, with the default config, where no decode kernel runs (the reference backend) or where the
        model does not build the plan once a step (a pool per data rank: each layer would plan)."""
        chooses = kind != "prefill" and (
            self.e.decode_config is not None or (self.e.backend != "reference" and self.e.data_ranks == 1)
        )
        return step_decode_config(self.e.decode_config, lengths if chooses else None)

    def _warm_decode_configs(self) -> list:
        """The decode kernel configs a decoding step can take (`_decode_config`): the near-equal lengths' one,
        and the ragged one where it differs (one row two kernel pages long beside idle rows)."""
        B = self.e.max_batch
        ragged = np.zeros((B,), np.int32)
        ragged[0] = 128
        configs = [self._decode_config("decode", np.zeros((B,), np.int32))]
        picked = self._decode_config("decode", ragged)
        return configs + ([picked] if picked != configs[0] else [])

    def _call(self, kind: str, fn, inp: StepInputs, *args, n_host: int = 1, decode_config=_PER_STEP, **static):
        """Run one step on the device cache; the cache comes back updated, its first `n_host`
        outputs as numpy (the rest, the MTP draft state, stays on the device). The decode kernel's config is
        the step's (`_decode_config`) unless `decode_config` names one (warm-up compiles each)."""
        traces0 = sum(trace_counts().values())
        t0 = time.perf_counter()
        if decode_config is _PER_STEP:
            decode_config = self._decode_config(kind, inp.lengths)
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
            decode_config=decode_config,
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
        self._record("prefill", sum(chunk.values()), dt, compiled)
        for b in rows:
            seq = slots[b]
            seq.prefilled += chunk[b]
            seq.cached = seq.prefilled
            if ends[b]:
                self.emit(b, int(toks[b]), seq.cached)

    def run_mixed(self, prefilling: list[int], decoding: list[int]) -> None:
        """One mixed step (`models.steps.prefill_step` over [B + mixed_rows, MIXED_TILE]): the next token of
        every row in `decoding` (its pages reserved), and the next chunks of the prompts in `prefilling`.

        Rows 0 .. B-1 are the slots: row b carries slot b's last sampled token when it decodes, else nothing.
        The engine's `mixed_rows` rows after them carry the prompts' pieces: the prompts, first come first
        served, take MIXED_TILE consecutive tokens a row while rows are left, a chunk of one prompt over as many
        rows as it needs, each row with its slot's block table. Every layer writes the step's latents before any
        row attends, so a piece sees the pieces before it (by position, causally) as one chunk would. A prompt's
        first new token is sampled at its last piece, with the key and position a prefill step would use; a
        decoding row's at its one token, as in a decode step. The compute is (B + mixed_rows) x MIXED_TILE
        tokens whatever the prompts' lengths."""
        B, G, slots = self.e.max_batch, MIXED_TILE, self.slots
        pieces = []  # (slot, first position, tokens) a row
        chunk = {}  # slot -> prompt tokens this step
        free_rows = self.e.mixed_rows
        for b in sorted(prefilling, key=lambda b: slots[b].req):
            seq = slots[b]
            take = min(len(seq.prompt) - seq.prefilled, free_rows * G)
            if take == 0:
                break
            end = seq.prefilled + take
            pieces += [(b, a, min(G, end - a)) for a in range(seq.prefilled, end, G)]
            chunk[b] = take
            free_rows -= -(-take // G)
        row_slots = list(range(B)) + [b for b, _, _ in pieces] + [0] * free_rows
        # The table covers every page a row holds (a prompt's whole) and, as for a verify step, a row's padding
        # queries after its last token (the decode kernel counts them in: it sees seq_len = length + G - valid).
        reach = [slots[b].cached + G for b in decoding] + [a + G for _, a, _ in pieces]
        held = [len(self.cache.pages_of(b)) * self.cache.page_size for b in [*chunk, *decoding]]
        ids, pos, lengths, last, keys, sp, bt = self._inputs(
            decoding + list(range(B, B + len(pieces))), G, max(reach + held), row_slots
        )
        for b in decoding:
            seq = slots[b]
            ids[b, 0] = seq.pending
            pos[b, 0] = seq.cached
            lengths[b] = seq.cached + 1
        ends = {}  # slot -> the row of its prompt's last token
        for r, (b, a, n) in enumerate(pieces, start=B):
            prompt = slots[b].prompt
            ids[r, :n] = prompt[a : a + n]
            pos[r, :n] = np.arange(a, a + n)
            lengths[r] = a + n
            last[r] = n - 1
            if a + n == len(prompt):
                ends[b] = r
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        (toks, _, _), dt, compiled = self._call(
            "mixed", self.e.steps.prefill, inp, None, None, None, None, use_mtp=False, sampler=self.sampler
        )
        for st in self.sinks:
            st.record_mixed(sum(chunk.values()), len(decoding), dt, compiled)
        for b in decoding:
            self._advance(b, [int(toks[b])], 0)
        for b, n in chunk.items():
            seq = slots[b]
            seq.prefilled += n
            seq.cached = seq.prefilled
            if b in ends:
                self.emit(b, int(toks[ends[b]]), seq.cached)

    def run_decode(self, rows: list[int], steps: dict[int, int]) -> None:
        """Up to `steps[b]` decode steps for each row in one device call (`models.steps.decode_loop`): the
        loop's length is a power of two <= the engine's `decode_steps` (a bounded number of compilations),
        the table covers every row's pages for its steps, stops are found on the device (each row's own
        stop ids, in a [B, S] array: S a power of two >= `MIN_STOP_IDS`, so requests with a few stop ids each
        share one compilation)."""
        B = self.e.max_batch
        num_steps = min(self.e.decode_steps, next_pow2(max(steps[b] for b in rows)))
        ids, pos, lengths, last, keys, sp, bt = self._inputs(
            rows, 1, max(self.slots[b].cached + steps[b] for b in rows)
        )
        steps_B = np.zeros((B,), np.int32)
        S = next_pow2(max(MIN_STOP_IDS, *(len(self.slots[b].request.stops) for b in rows)))
        stop_ids = np.full((B, S), -1, np.int32)
        for b in rows:
            seq = self.slots[b]
            ids[b, 0] = seq.pending
            pos[b, 0] = seq.cached
            lengths[b] = seq.cached + 1
            steps_B[b] = steps[b]
            stops = sorted(seq.request.stops)
            stop_ids[b, : len(stops)] = stops
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
        self._record("decode", int(count.sum()), dt, compiled, steps=int(count.max()))
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
        self._record("decode", sum(1 + int(acc[b]) for b in rows), dt, compiled)
        for st in self.sinks:
            st.mtp_drafted += sum(spec[b] for b in rows)
            st.mtp_accepted += sum(int(acc[b]) for b in rows)
        for b in rows:
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
