"""The engine's host scheduler: requests that come and go, a batch of slots, one device call at a time, overlapped.

Dimension letters: B slots (max_batch), T tokens a step, P block-table width (pages), G page size.

A request (`_Request`) is submitted at any time and waits; `_Generation.step()` runs one engine step:
- admission: a waiting prompt takes a free slot when its whole prompt fits in the page pool (on a
  mesh with data ranks: the pool of the slot's rank, see `models.serving.engine.Engine`'s `mesh`);
- reservation: before each call every row holds pages for the rows the call may write (an upper bound
  when MTP acceptance is not known yet; `rows_needed` is the draft-room arithmetic); a row that cannot get
  them fails alone;
- launch: the rows' inputs as bucketed arrays (B is always max_batch, idle rows padding; T and the
  block-table width P powers of two, so a long generation compiles a bounded number of times) and the
  jitted call (`models.serving.steps`), enqueued on the device;
- landing: the call launched one step earlier is read back, and its tokens go to their requests
  (emission: stop / length / context; finishing: the slot's pages back to the pool), then to their
  `on_token` callbacks.

**The lane.** A call's sampled tokens never go through the host on their way to the next call: each slot's
last token and its position stay on the device (`models.serving.steps.Lane`), and every call reads its decoding
rows' inputs from there. So the host enqueues call n + 1 before it reads call n: the device never waits for
the host, and each token reaches its request as its own call completes. What the host does not know yet it
bounds: a row's position after the calls in flight lies in [lo, hi] (`_Seq.bounds`; the same with plain
decoding unless a stop token came, wider with MTP, whose acceptance the device decides), pages are held
for `hi` and a row runs while `lo` (MTP) or `hi` (plain) is short of its end. A row that stops on a
stop token (or is cancelled, or fails) is found one call late: the call after it computed one more
token for it, which is dropped; its pages return when the stop is read, and the device calls that used
them came before any later owner's, so nothing of another row is touched.

A call is one of four kinds:
- prefill: no row decodes; every row still in its prompt prefills one chunk (up to `prefill_chunk` tokens);
- mixed (`mixing`: the engine's `mixed_steps`, no MTP, one data rank): some rows decode and some are in their
  prompts; every decoding row makes one token, and the prompts take up to the engine's prefill budget of
  tokens, first come first served, cut into `MIXED_TILE`-token rows of the step (`launch_mixed`);
- decode: every row decodes: up to `decode_steps` plain steps in one device call (`models.serving.steps.decode_call`);
- verify (MTP): up to `decode_steps` verify steps in one device call (`models.serving.steps.verify_call`).
Without `mixing`, a step with any row in its prompt is a prefill step and the decoding rows wait.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from mla_jax.attention import step_decode_config
from mla_jax.kv_cache import CacheFullError, KVCache, next_pow2
from mla_jax.sharding import shard_batch
from models.serving.requests import _Flight, _Request, _Seq
from models.serving.sampling import NonFiniteLogitsError, SamplingArrays, SamplingParams, sampler_kind
from models.serving.stats import GenerationStats
from models.serving.steps import MAX_DRAFT_TOKENS, NON_FINITE, StepInputs, new_lane, trace_counts

__all__ = ["FINISH_REASONS", "GenerationStats", "MIN_STOP_IDS", "MIXED_TILE", "rows_needed"]

FINISH_REASONS = ("stop", "length", "context", "error", "cancelled")
MIN_STOP_IDS = 4  # the smallest stop-id width of a decode call
# Query tokens a row of a mixed step carries: those of a verify step's row, so that the layers attend with the
# decode kernel straight on the pages (docs/ARCHITECTURE.md, "The engine and its host scheduler").
MIXED_TILE = MAX_DRAFT_TOKENS + 1
_PER_STEP = object()  # `_run`: the decode config from the step's own lengths


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
# The scheduler
# ------------------------------------------------------------------------------------------
class _Generation:
    """The host scheduler of an engine: explicit state and one method per act.

    `engine` gives the pool (`cache`), `max_batch`, `num_pages`, `cfg`, `max_context` (and, to run steps,
    its compiled steps and step settings). `k`: MTP drafts a step (0: plain decode), one value for every
    running request (`configure` changes it while idle).
    """

    def __init__(self, engine, k: int = 0):
        self.e = engine
        self.cache = engine.cache
        self.slots: list[_Seq | None] = [None] * engine.max_batch
        self.waiting: collections.deque[int] = collections.deque()
        self.requests: dict[int, _Request] = {}  # waiting or running, by id
        self.next_id = 0
        self.sinks: list[GenerationStats] = []  # the stats recording now (`Engine.recording`)
        self.events: list[tuple[_Request, int]] = []  # tokens landed in this step, not yet delivered
        self.stepping = False
        self.flight: _Flight | None = None  # the call launched and not read yet
        self.flights = 0
        self.landed_at = 0.0  # when the last call was read
        self.lane = new_lane(engine.max_batch)
        self._traced: list | None = None  # warm-up's traced calls, while it traces
        self.oracle = (
            None  # benchmarks only: a `models.serving.steps.DraftOracle` for the verify calls (`Engine.draft_oracle`)
        )
        self.configure(k)

    def configure(self, k: int) -> None:
        """MTP drafts a step for the requests to come; only while no request waits or runs."""
        if self.requests:
            raise RuntimeError(f"the scheduler has {len(self.requests)} request(s) in flight; k stays {self.k}")
        self.drain()
        self.k = k
        B = self.e.max_batch
        # The MTP draft state lives on the device between steps. Greedy drafts need no distribution: a
        # [B,k,1] placeholder keeps the steps' signature (`_match_draft_probs`).
        self.drafts = jnp.zeros((B, k), jnp.int32) if k else None
        self.draft_probs = jnp.zeros((B, k, 1), jnp.float32) if k else None

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
        """End request `rid` now, waiting or running (its slot and pages freed; its tokens so far kept; what a
        call in flight computes for it is dropped); False when it had already ended."""
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
        """Admit, launch the next call, then land the one before it and deliver its tokens; False when no
        request waits or runs and no call is in flight (nothing was done). An exception an `on_token` callback
        raised ends that request ("error") and is raised here once every other token of the step is
        delivered."""
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
        launched = self.launch()
        prev, self.flight = self.flight, launched
        if prev is not None:
            if launched is not None and launched.compiled:  # prev's wall time holds that compilation
                prev.compiled_beside = launched.launch_s
            self.land(prev)
        return launched is not None or prev is not None or bool(self.waiting)

    def drain(self) -> None:
        """Land the call in flight, if any (its tokens to their requests; the callbacks at the next step)."""
        prev, self.flight = self.flight, None
        if prev is not None:
            self.land(prev)

    def _runs(self, b: int) -> bool:
        """Whether slot b may still make tokens once the calls in flight land: with MTP while its fewest
        possible position is short of its end, else (known exactly, but for a stop token) its position."""
        seq = self.slots[b]
        lo, hi = seq.bounds()
        return (lo if self.k else hi) < seq.end

    def launch(self) -> _Flight | None:
        """The next call for the rows that can use one, enqueued; None when no row can."""
        live = self.live()
        if not live:
            return None
        self.sampler = sampler_kind([self.slots[b].params for b in live])
        self._match_draft_probs()
        prefilling = [b for b in live if not self.slots[b].decoding]
        if prefilling:
            decoding = [b for b in live if self.slots[b].decoding and self._runs(b)] if self.mixing else []
            if decoding:
                decoding = list(self.reserve_decode(decoding, max_steps=1))  # a row short of pages fails alone
            prefilling = [b for b in prefilling if self.slots[b] is not None]
            if decoding:
                return self.launch_mixed(prefilling, decoding)
            return self.launch_prefill(prefilling) if prefilling else None
        rows = [b for b in live if self._runs(b)]
        budget = self.reserve_decode(rows) if rows else {}
        if not budget:
            return None
        return self.launch_verify(budget) if self.k else self.launch_decode(budget)

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
            end = min(len(r.prompt) + r.max_new_tokens - 1, self.e.max_context)
            self.slots[b] = _Seq(r.id, r, end)
            if placed is None:
                self.fail(b, err)

    def _hold(self, b: int, length: int) -> None:
        """Make slot b hold pages for exactly `length` tokens (more pages reserved, or the ones past them
        freed). Callers pass at least what the call in flight may still write for it."""
        if length >= self.cache.lengths[b]:
            self.cache.reserve(b, length)
        else:
            self.cache.truncate(b, length)

    def reserve_decode(self, rows: list[int], max_steps: int | None = None) -> dict[int, tuple[int, int]]:
        """Pages for every decoding row's next call, up front -> {slot: (model steps, drafts a step)}: the
        engine's `decode_steps` (or `max_steps`) steps of k drafts with MTP, held for the row's most possible
        position; without MTP the steps left within its token and context budget. A row that cannot get
        those pages takes one step of no drafts if that fits, else fails alone."""
        budget = {}
        k = self.k
        for b in rows:
            seq = self.slots[b]
            _, hi = seq.bounds()
            if k:  # no call writes past end + k (`models.serving.steps.verify_loop`)
                n = max_steps or self.e.decode_steps
                want, need, least = (n, k), min(hi + n * (k + 1) + k, seq.end + k), hi + 1 + k
            else:  # step i writes position hi + i and makes the token at hi + i + 1 <= end
                n = min(max_steps or self.e.decode_steps, seq.end - hi)
                want, need, least = (n, 0), hi + n, hi + 1
            try:
                self._hold(b, need)
                budget[b] = want
            except CacheFullError as err:
                extra = self.cache.pages_for(least) - len(self.cache.pages_of(b))
                if need != least and extra <= self.cache.free_pages_for(b):
                    self._hold(b, least)
                    budget[b] = (1, 0)
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
    def warm_up(self, max_tokens: int, progress: bool = False) -> int:
        """Compile, then run once on idle rows (positions -1: nothing written, nothing attended), every call
        shape a request of up to `max_tokens` tokens can meet: each prefill chunk bucket and each decode-loop
        length (or the MTP verify) at each block-table width, and when `mixing` the mixed step at each of its
        widths, the decoding ones with each decode-kernel config a step can take (`_warm_decode_configs`), with the
        greedy sampler. The programs are traced one after another, then compiled in parallel threads (XLA
        compiles outside the GIL), with a progress bar when `progress`; the runs then find them compiled. Only
        while no request waits or runs. -> the step compilations it caused."""
        if self.requests:
            raise RuntimeError(f"warm_up needs an idle engine; {len(self.requests)} request(s) in flight")
        self.drain()
        traces0 = sum(trace_counts().values())
        saved = (self.cache.pages, self.lane, self.drafts, self.draft_probs)
        self._traced = []  # `_run` traces instead of running
        try:
            self._warm_calls(max_tokens)
        finally:
            traced, self._traced = self._traced, None
            self.cache.pages, self.lane, self.drafts, self.draft_probs = saved
        self._compile_all(traced, progress)
        self._warm_calls(max_tokens)  # each call once: compiled above, so only run
        jax.block_until_ready(self.cache.pages)
        return sum(trace_counts().values()) - traces0

    def step_temporaries(self, progress: bool = False) -> dict[str, int]:
        """Compile the calls with the largest temporaries an engine step can have and read their sizes ->
        {kind: temporary bytes} (`compiled.memory_analysis()`): the prefill at the largest chunk bucket over the
        widest block table (with the MTP block and one draft when the model has one), the decode call at the
        widest table and, when `mixing`, the mixed step there. A verify call's k + 1 query tokens a row are
        fewer than a prefill chunk's. The programs land in jit's cache, as warm-up's do; nothing runs. The pool
        may be abstract (a `jax.ShapeDtypeStruct`): nothing is allocated."""
        if self.requests:
            raise RuntimeError(f"step_temporaries needs an idle engine; {len(self.requests)} request(s) in flight")
        e, c, B = self.e, self.cache, self.e.max_batch
        k0, saved = self.k, (c.pages, self.lane)
        P = c.max_pages_per_seq
        idle = np.zeros((B,), np.int32)
        stop_ids = np.full((B, MIN_STOP_IDS), -1, np.int32)
        self._traced = []
        self.sampler = "greedy"
        try:
            if e.has_mtp:
                self.configure(1)
            inp = self._idle(next_pow2(max(e.min_chunk_bucket, e.prefill_chunk)), P)
            nxt = np.zeros_like(inp.ids) if self.k else None
            self._prefill_call("prefill", inp, np.zeros((B,), bool), idle - 1, nxt, np.zeros((B,), bool))
            self.configure(0)
            self._decode_call(self._idle(1, P), idle, stop_ids, e.decode_steps)
            if self.mixing:
                inp = self._idle(MIXED_TILE, P, list(range(B)) + [0] * e.mixed_rows)
                self._prefill_call("mixed", inp, np.zeros((B,), bool), idle - 1, None, None)
        finally:
            traced, self._traced = self._traced, None
            c.pages, self.lane = saved
            self.configure(k0)
        out: dict[str, int] = {}
        for (kind, _, _), compiled in zip(traced, self._compile_all(traced, progress, "memory plan: compiling")):
            out[kind] = max(out.get(kind, 0), int(compiled.memory_analysis().temp_size_in_bytes))
        return out

    def _compile_all(self, traced: list, progress: bool, desc: str = "warm-up: compiling") -> list:
        """Compile traced calls [(kind, bucket, jax.stages.Traced)] in parallel threads; each into jit's cache,
        which the calls' next runs find (and into `compile_log`) -> the compiled programs, in order."""
        if not traced:
            return []

        def compile_one(item):
            kind, bucket, t = item
            t0 = time.perf_counter()
            compiled = t.lower().compile()
            return compiled, dict(step=kind, bucket=bucket, seconds=time.perf_counter() - t0)

        workers = max(1, min(8, len(traced), os.cpu_count() or 1))
        out = []
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            done = pool.map(compile_one, traced)
            bar = tqdm.tqdm(done, total=len(traced), desc=desc, unit="program", disable=not progress)
            for compiled, entry in bar:
                self.e.compile_log.append(entry)
                out.append(compiled)
        return out

    def _warm_calls(self, max_tokens: int) -> None:
        e, c, B = self.e, self.cache, self.e.max_batch
        self.sampler = "greedy"
        self._match_draft_probs()
        longest = min(max_tokens, e.max_context)
        widths = self._widths(c.pages_for(longest + (e.draft_room if self.k else 0)))
        chunks = sorted({next_pow2(max(e.min_chunk_bucket, n)) for n in range(1, e.prefill_chunk + 1)})
        loops = sorted({min(e.decode_steps, next_pow2(n)) for n in range(1, e.decode_steps + 1)})
        configs = self._warm_decode_configs()  # each program a decoding step can take
        idle = np.zeros((B,), np.int32)
        if self.mixing:  # a mixed step's table also covers its rows' padding queries (`launch_mixed`)
            for P in self._widths(c.pages_for(longest - 1 + MIXED_TILE)):
                inp = self._idle(MIXED_TILE, P, list(range(B)) + [0] * e.mixed_rows)
                for dc in configs:
                    self._prefill_call("mixed", inp, np.zeros((B,), bool), idle - 1, None, None, decode_config=dc)
        for P in widths:
            for T in chunks:
                inp = self._idle(T, P)
                nxt = np.zeros_like(inp.ids) if self.k else None
                self._prefill_call("prefill", inp, np.zeros((B,), bool), idle - 1, nxt, np.zeros((B,), bool))
            stop_ids = np.full((B, MIN_STOP_IDS), -1, np.int32)
            for dc in configs:
                if self.k:
                    args = (idle, idle, idle, stop_ids)
                    self._verify_call(self._idle(self.k + 1, P), args, e.decode_steps, decode_config=dc)
                else:
                    for n in loops:
                        self._decode_call(self._idle(1, P), idle, stop_ids, n, decode_config=dc)

    def _idle(self, T: int, P: int, row_slots=None) -> StepInputs:
        ids, pos, lengths, last, keys, sp, bt = self._inputs([], T, P * self.cache.page_size, row_slots)
        return StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))

    def _widths(self, top: int) -> list[int]:
        """The block-table widths (pages) of the steps whose tables cover 1 .. `top` pages (`_inputs`' buckets)."""
        e, c = self.e, self.cache
        return sorted({min(next_pow2(max(e.min_table_pages, p)), c.max_pages_per_seq) for p in range(1, top + 1)})

    # --- calls: host arrays in, the jitted call enqueued ----------------------------------------
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

    def _run(self, kind: str, fn, inp: StepInputs, *args, decode_config=_PER_STEP, **static):
        """Enqueue one call on the device cache (the pool and the lane come back as its outputs, still on the
        device) -> (its other outputs, launch seconds, whether it compiled). The decode kernel's config is the
        call's (`_decode_config`) unless `decode_config` names one (warm-up compiles each)."""
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
        if self._traced is not None:  # warm-up's first pass: trace only; outputs are their shapes
            B, T = inp.ids.shape
            t = fn.trace(self.e.state, cache, inp, *args, **static)
            self._traced.append((kind, f"B={B} T={T} P={inp.block_table.shape[1]}", t))
            cache, *outs = t.out_info
            self.cache.pages = cache.pages
            return outs, 0.0, False
        cache, *outs = fn(self.e.state, cache, inp, *args, **static)
        self.cache.pages = cache.pages
        dt = time.perf_counter() - t0
        compiled = sum(trace_counts().values()) != traces0
        if compiled:
            B, T = inp.ids.shape
            self.e.compile_log.append(dict(step=kind, bucket=f"B={B} T={T} P={inp.block_table.shape[1]}", seconds=dt))
        return outs, dt, compiled

    def _prefill_call(self, kind, inp, feed_B, src_B, nxt, ends, decode_config=_PER_STEP):
        use_mtp = bool(self.k) and kind == "prefill"
        args = (nxt, ends, self.drafts, self.draft_probs) if use_mtp else (None, None, None, None)
        (tokens, self.lane, drafts, probs), dt, compiled = self._run(
            kind,
            self.e.steps.prefill_call,
            inp,
            self.lane,
            feed_B,
            src_B,
            *args,
            decode_config=decode_config,
            use_mtp=use_mtp,
            sampler=self.sampler,
        )
        if use_mtp:
            self.drafts, self.draft_probs = drafts, probs
        return (tokens,), dt, compiled

    def _decode_call(self, inp, steps_B, stop_ids, num_steps, decode_config=_PER_STEP):
        (tokens, count, self.lane), dt, compiled = self._run(
            "decode",
            self.e.steps.decode_call,
            inp,
            self.lane,
            steps_B,
            stop_ids,
            decode_config=decode_config,
            sampler=self.sampler,
            num_steps=num_steps,
        )
        return (tokens, count), dt, compiled

    def _verify_call(self, inp, args, num_steps, decode_config=_PER_STEP):
        (tokens, count, drafted, accepted, self.lane, self.drafts, self.draft_probs), dt, compiled = self._run(
            "verify",
            self.e.steps.verify_call,
            inp,
            self.lane,
            self.drafts,
            self.draft_probs,
            *args,
            self.oracle,
            decode_config=decode_config,
            sampler=self.sampler,
            num_steps=num_steps,
        )
        return (tokens, count, drafted, accepted), dt, compiled

    def _flight(self, kind, call, rows, steps, t0, prompt_tokens=0) -> _Flight:
        outs, dt, compiled = call
        self.flights += 1
        f = _Flight(self.flights, kind, tuple(outs), rows, steps, t0, dt, compiled, prompt_tokens)
        return f

    def _stop_ids(self, rows) -> np.ndarray:
        """Each row's stop ids, [B, S]: S a power of two >= `MIN_STOP_IDS` (requests with a few stop ids each
        share one compilation); -1 pads."""
        S = next_pow2(max(MIN_STOP_IDS, *(len(self.slots[b].request.stops) for b in rows)))
        stop_ids = np.full((self.e.max_batch, S), -1, np.int32)
        for b in rows:
            stops = sorted(self.slots[b].request.stops)
            stop_ids[b, : len(stops)] = stops
        return stop_ids

    def launch_prefill(self, rows: list[int]) -> _Flight:
        """One prompt chunk for each row in `rows` (`models.serving.steps.prefill_call`)."""
        t0 = time.perf_counter()
        B, slots = self.e.max_batch, self.slots
        chunk = {b: min(self.e.prefill_chunk, len(slots[b].prompt) - slots[b].prefilled) for b in rows}
        T = next_pow2(max(self.e.min_chunk_bucket, *chunk.values()))
        # The table covers every page a row holds: its whole prompt (and the draft chain's rows).
        need = max(len(self.cache.pages_of(b)) for b in rows) * self.cache.page_size
        ids, pos, lengths, last, keys, sp, bt = self._inputs(rows, T, need)
        nxt = np.zeros_like(ids)
        ends = np.zeros((B,), bool)
        src = np.full((B,), -1, np.int32)
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
            src[b] = b if ends[b] else -1
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        call = self._prefill_call("prefill", inp, np.zeros((B,), bool), src, nxt if self.k else None, ends)
        f = self._flight("prefill", call, {}, 1, t0, sum(chunk.values()))
        for b in rows:
            seq = slots[b]
            seq.prefilled += chunk[b]
            seq.flying[f.id] = (chunk[b], chunk[b])
            f.rows[b] = (seq.req, chunk[b], b if ends[b] else -1)
        return f

    def launch_mixed(self, prefilling: list[int], decoding: list[int]) -> _Flight:
        """One mixed step (`models.serving.steps.prefill_call` over [B + mixed_rows, MIXED_TILE]): the next token of
        every row in `decoding` (its pages reserved), and the next chunks of the prompts in `prefilling`.

        Rows 0 .. B-1 are the slots: row b carries slot b's pending token (from the lane) when it decodes, else
        nothing. The engine's `mixed_rows` rows after them carry the prompts' pieces: the prompts, first come
        first served, take MIXED_TILE consecutive tokens a row while rows are left, a chunk of one prompt over as
        many rows as it needs, each row with its slot's block table. Every layer writes the step's latents before
        any row attends, so a piece sees the pieces before it (by position, causally) as one chunk would. A
        prompt's first new token is sampled at its last piece, with the key and position a prefill step would
        use; a decoding row's at its one token, as in a decode step. The compute is (B + mixed_rows) x MIXED_TILE
        tokens whatever the prompts' lengths."""
        t0 = time.perf_counter()
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
        at = {b: slots[b].bounds()[1] for b in decoding}  # exact without MTP (mixing has none)
        # The table covers every page a row holds (a prompt's whole) and, as for a verify step, a row's padding
        # queries after its last token (the decode kernel counts them in: it sees seq_len = length + G - valid).
        reach = [at[b] + G for b in decoding] + [a + G for _, a, _ in pieces]
        held = [len(self.cache.pages_of(b)) * self.cache.page_size for b in [*chunk, *decoding]]
        ids, pos, lengths, last, keys, sp, bt = self._inputs(
            decoding + list(range(B, B + len(pieces))), G, max(reach + held), row_slots
        )
        feed = np.zeros((B,), bool)
        src = np.full((B,), -1, np.int32)
        for b in decoding:
            pos[b, 0] = at[b]
            lengths[b] = at[b] + 1
            feed[b], src[b] = True, b
        ends = {}  # slot -> the row of its prompt's last token
        for r, (b, a, n) in enumerate(pieces, start=B):
            prompt = slots[b].prompt
            ids[r, :n] = prompt[a : a + n]
            pos[r, :n] = np.arange(a, a + n)
            lengths[r] = a + n
            last[r] = n - 1
            if a + n == len(prompt):
                ends[b] = src[b] = r
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        call = self._prefill_call("mixed", inp, feed, src, None, None)
        f = self._flight("mixed", call, {}, 1, t0, sum(chunk.values()))
        for b in decoding:
            slots[b].flying[f.id] = (1, 1)
            f.rows[b] = (slots[b].req, 0, b)
        for b, n in chunk.items():
            slots[b].prefilled += n
            slots[b].flying[f.id] = (n, n)
            f.rows[b] = (slots[b].req, n, ends.get(b, -1))
        return f

    def launch_decode(self, budget: dict[int, tuple[int, int]]) -> _Flight:
        """Up to `budget[b]` plain decode steps for each row in one device call (`steps.decode_call`): the
        loop's length is a power of two <= the engine's `decode_steps` (a bounded number of compilations), the
        table covers every row's pages for its steps, stops are found on the device."""
        t0 = time.perf_counter()
        rows = list(budget)
        num_steps = min(self.e.decode_steps, next_pow2(max(n for n, _ in budget.values())))
        at = {b: self.slots[b].bounds()[1] for b in rows}
        ids, pos, lengths, last, keys, sp, bt = self._inputs(rows, 1, max(at[b] + budget[b][0] for b in rows))
        steps_B = np.zeros((self.e.max_batch,), np.int32)
        for b in rows:
            pos[b, 0] = at[b]  # what the kernel config is chosen from; the call reads the lane's positions
            lengths[b] = at[b] + 1
            steps_B[b] = budget[b][0]
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        call = self._decode_call(inp, steps_B, self._stop_ids(rows), num_steps)
        f = self._flight("decode", call, {}, num_steps, t0)
        for b in rows:
            n = budget[b][0]
            self.slots[b].flying[f.id] = (n, n)
            f.rows[b] = (self.slots[b].req, 0, b)
        return f

    def launch_verify(self, budget: dict[int, tuple[int, int]]) -> _Flight:
        """Up to the engine's `decode_steps` MTP verify steps for each row in one device call
        (`models.serving.steps.verify_call`): positions, lengths and drafts from the device; pages held for the most a
        row may reach (`reserve_decode`)."""
        t0 = time.perf_counter()
        k, B = self.k, self.e.max_batch
        rows = list(budget)
        num_steps = self.e.decode_steps
        need = max(int(self.cache.lengths[b]) for b in rows)
        ids, pos, lengths, last, keys, sp, bt = self._inputs(rows, k + 1, need)
        steps_B, spec_B, end_B = (np.zeros((B,), np.int32) for _ in range(3))
        for b in rows:
            seq = self.slots[b]
            lo, hi = seq.bounds()
            pos[b, 0] = hi  # what the kernel config is chosen from; the call reads the lane's positions
            lengths[b] = hi + 1 + k
            steps_B[b], spec_B[b] = budget[b]
            end_B[b] = seq.end
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        call = self._verify_call(inp, (steps_B, spec_B, end_B, self._stop_ids(rows)), num_steps)
        f = self._flight("verify", call, {}, num_steps, t0)
        for b in rows:
            n, spec = budget[b]
            self.slots[b].flying[f.id] = (n * (1 + spec), n)  # each active step keeps 1 .. spec + 1 tokens
            f.rows[b] = (self.slots[b].req, 0, b)
        return f

    # --- landing: a call's outputs to the host, its tokens to their requests ---------------------
    def land(self, f: _Flight) -> None:
        """Read call `f` (waiting for it) and hand its tokens to the requests it served that still run."""
        host = [np.asarray(o) for o in f.outs]
        now = time.perf_counter()
        # A call's time: from when the device could start it (the previous call read, or its launch) to its end.
        seconds = now - f.t0 if f.compiled else now - max(f.t0 + f.launch_s, self.landed_at)
        seconds = max(0.0, seconds - f.compiled_beside)  # the next call's compilation: counted as that call's
        compiled = f.compiled or f.compiled_beside > 0  # the rest is no warm call's time either
        self.landed_at = now
        tokens = host[0]
        counts = host[1] if f.kind in ("decode", "verify") else None
        emitted, steps, drafted, accepted = 0, 0, 0, 0
        for b, (rid, prompt_n, row) in f.rows.items():
            seq = self.slots[b]
            if seq is None or seq.req != rid:
                continue  # ended while the call ran: what it computed for the slot is dropped
            seq.flying.pop(f.id, None)
            if prompt_n:  # a prompt chunk; its last one samples the first new token
                seq.cached += prompt_n
                if row >= 0:
                    self.emit(b, int(tokens[row]), seq.cached)
                continue
            if counts is None:  # a mixed step's decoding row: one token
                toks = [int(tokens[row])]
            else:
                toks = [int(t) for t in tokens[b, : int(counts[b])]]
                if f.kind == "verify":
                    drafted += int(host[2][b])
                    accepted += int(host[3][b])
            emitted += len(toks)
            steps = max(steps, len(toks))
            first = seq.cached + 1  # position of the first new token
            seq.cached += len(toks)
            for i, tok in enumerate(toks):
                if self.emit(b, tok, first + i):
                    break
        for st in self.sinks:
            if f.kind == "mixed":
                st.record_mixed(f.prompt_tokens, emitted, seconds, compiled)
            elif f.kind == "prefill":
                st.record("prefill", f.prompt_tokens, seconds, compiled)
            else:
                # model steps: a plain row makes one token a step (its longest row's count); a verify call's
                # rows step together (its trip count, when it served a row).
                st.record(
                    "decode",
                    emitted,
                    seconds,
                    compiled,
                    steps=steps if f.kind == "decode" else f.steps * (emitted > 0),
                )
                st.mtp_drafted += drafted
                st.mtp_accepted += accepted
