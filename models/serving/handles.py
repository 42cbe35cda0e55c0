"""What a caller of the engine holds: a batch's `GenerationResult`, a submitted request's `RequestHandle` (its
tokens as they come, its cancellation) and, once it ended, its `RequestResult` (`models.serving.engine`)."""

from __future__ import annotations

import dataclasses
from typing import Iterator

from models.serving.requests import _Request
from models.serving.stats import GenerationStats
from models.serving.steps import trace_counts


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

    def __init__(self, engine, request: _Request):
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


def generation_result(
    reqs: list[_Request], stats: GenerationStats, t0: float, pages_used_peak: int
) -> GenerationResult:
    """The `GenerationResult` of a `generate` call begun at `t0` (`time.perf_counter()`) over `reqs`, its stats
    completed (time to the first token, the pool's peak pages, the step compilations, the failed requests)."""
    firsts = [r.token_times[0] for r in reqs if r.token_times]
    stats.ttft_s = min(firsts) - t0 if firsts else None
    stats.pages_used_peak = pages_used_peak
    stats.traces = trace_counts()
    stats.failed = sum(r.error is not None for r in reqs)
    return GenerationResult(
        [list(r.tokens) for r in reqs], stats, [r.finish_reason or "" for r in reqs], [r.error for r in reqs]
    )
