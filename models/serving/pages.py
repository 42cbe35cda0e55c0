"""The host scheduler's pages: waiting prompts admitted into slots, and the pages every row holds for what its next
call may write (`models.serving.scheduler`).
"""

from __future__ import annotations

from mla_jax.kv_cache import CacheFullError
from models.serving.requests import _Seq


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


class _Pages:
    """Admission and reservation, the scheduler's part over the page pool (`cache`, a `PagedLatentCache`).

    Reads the scheduler's `waiting`, `requests`, `k` and the engine's `max_context` and `decode_steps`; fills
    `slots` with the admitted requests' `_Seq`s, takes pages from the pool and gives back the ones a row no longer
    needs. A row that cannot get pages fails alone (`fail`, the outputs' part)."""

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
