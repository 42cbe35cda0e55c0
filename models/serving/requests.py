"""The records the host scheduler (`models.serving.scheduler`) keeps: a request (`_Request`, shared with its handle), a
request in a slot (`_Seq`, with the bounds of its position while calls are in flight) and a launched call not read
yet (`_Flight`)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from models.serving.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "context", "error", "cancelled")


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
    """Host state of a request in a slot.

    `prefilled` counts the prompt tokens of every launched call; `cached` the tokens in the cache after
    the landed calls; `flying` maps each call in flight to the (most, fewest) tokens it adds to the cache
    (each added token is also a new one of the output, except a prompt's)."""

    req: int  # the request's id
    request: _Request
    end: int  # the last position a token of it may take: its length budget and the context
    prefilled: int = 0
    cached: int = 0
    flying: dict = dataclasses.field(default_factory=dict)

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

    def bounds(self) -> tuple[int, int]:
        """(lo, hi): the fewest and most tokens its cache holds once the calls in flight land, i.e. the
        position of its pending token then (never past `end` once decoding: no call writes past it)."""
        lo = self.cached + sum(n for _, n in self.flying.values())
        hi = self.cached + sum(n for n, _ in self.flying.values())
        return (min(lo, self.end), min(hi, self.end)) if self.decoding else (lo, hi)


@dataclasses.dataclass
class _Flight:
    """A launched call, not read yet. `outs`: its device outputs; `rows`: slot -> (request id, tokens the slot
    gains in the cache by prefill (0 for a decoding row), the row of its first token or -1); `steps`: model
    steps of the call; `t0` / `launch_s`: when it was enqueued and how long that took (compilation included
    when `compiled`); `compiled_beside`: how long the launch of the next call compiled while this one flew
    (a part of its wall time that is not its own; it is then timed as a call that compiled)."""

    id: int
    kind: str
    outs: tuple
    rows: dict
    steps: int
    t0: float
    launch_s: float
    compiled: bool
    prompt_tokens: int = 0
    compiled_beside: float = 0.0
