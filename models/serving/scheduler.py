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
for `hi` and a row runs while `hi` (plain) is short of its end, with MTP while `lo` and its expected position
(the drafts accepted at the rate seen so far) are. A row that stops on a
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

The scheduler is a thin class over its parts, one module each (a class per part, sharing the scheduler's state):
`models.serving.pages` (admission, reservation), `models.serving.launches` (what each call carries),
`models.serving.calls` (the device calls and the state they keep on the device), `models.serving.outputs`
(landing, emission, the end of a request, callbacks) and `models.serving.warmup` (compiling ahead); a request's
own records are `models.serving.requests`.
"""

from __future__ import annotations

import collections
import time

import jax.numpy as jnp

from models.serving.calls import _Calls
from models.serving.launches import _Launches
from models.serving.outputs import _Outputs
from models.serving.pages import _Pages
from models.serving.requests import _Flight, _Request, _Seq
from models.serving.sampling import sampler_kind
from models.serving.stats import GenerationStats
from models.serving.steps import new_lane
from models.serving.warmup import _WarmUp


class _Generation(_Pages, _Launches, _Calls, _Outputs, _WarmUp):
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
        self.mtp_seen = [0, 0]  # drafts verified and accepted by the verify calls landed so far
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
        """Whether slot b gets a row in the next call: without MTP while its position after the calls in flight
        (known exactly, but for a stop token) is short of its end; with MTP while its fewest possible position
        is, and its expected one too (`_expected`): a call launched behind one that is expected to end the row
        would most likely run its steps for nothing, so the row waits for that call to land instead (if it
        did not end the row, the next call takes it)."""
        seq = self.slots[b]
        lo, hi = seq.bounds()
        if not self.k:
            return hi < seq.end
        return lo < seq.end and self._expected(seq) < seq.end

    def _expected(self, seq: _Seq) -> float:
        """Slot `seq`'s expected position once the calls in flight land: each verify call in flight adds its
        fewest tokens (one a step) and its drafts at the acceptance rate seen so far (`mtp_seen`; none seen: the
        fewest, as `bounds` has it)."""
        drafted, accepted = self.mtp_seen
        rate = accepted / drafted if drafted else 0.0
        return seq.cached + sum(lo + (hi - lo) * rate for hi, lo in seq.flying.values())

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

    def live(self) -> list[int]:
        return [b for b, s in enumerate(self.slots) if s is not None]
