"""The host scheduler's launches: each kind of call (prefill, mixed, decode, MTP verify) built from its rows' host
state as bucketed arrays, enqueued on the device (`models.serving.calls`), and recorded as a `_Flight` and in its
rows (`models.serving.scheduler`).

Dimension letters: B slots (max_batch), T tokens a step, P block-table width (pages), G tokens a row of a mixed
step (`MIXED_TILE`), S stop ids a row.
"""

from __future__ import annotations

import time

import numpy as np

from mla_jax.kv_cache import next_pow2
from models.serving.requests import _Flight
from models.serving.sampling import SamplingArrays, SamplingParams
from models.serving.steps import MAX_DRAFT_TOKENS, StepInputs

MIN_STOP_IDS = 4  # the smallest stop-id width of a decode call
# Query tokens a row of a mixed step carries: those of a verify step's row, so that the layers attend with the
# decode kernel straight on the pages (docs/ARCHITECTURE.md, "The engine and its host scheduler").
MIXED_TILE = MAX_DRAFT_TOKENS + 1


class _Launches:
    """What each call carries: its inputs from the rows' state (B always max_batch, idle rows padding; T and the
    block-table width P powers of two, so a long generation compiles a bounded number of times), and what the
    rows expect of it (`_Seq.prefilled` and `flying`, `_Flight.rows`).

    Reads the scheduler's `slots`, `k`, the pool's block tables and the engine's step settings; enqueues through
    the device part (`_prefill_call`, `_decode_call`, `_verify_call`); counts its calls in `flights`."""

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

    def _stop_ids(self, rows) -> np.ndarray:
        """Each row's stop ids, [B, S]: S a power of two >= `MIN_STOP_IDS` (requests with a few stop ids each
        share one compilation); -1 pads."""
        S = next_pow2(max(MIN_STOP_IDS, *(len(self.slots[b].request.stops) for b in rows)))
        stop_ids = np.full((self.e.max_batch, S), -1, np.int32)
        for b in rows:
            stops = sorted(self.slots[b].request.stops)
            stop_ids[b, : len(stops)] = stops
        return stop_ids

    def _flight(self, kind, call, rows, steps, t0, prompt_tokens=0) -> _Flight:
        outs, dt, compiled = call
        self.flights += 1
        f = _Flight(self.flights, kind, tuple(outs), rows, steps, t0, dt, compiled, prompt_tokens)
        return f

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
