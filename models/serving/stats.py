"""Counters and timings of the engine's steps (`GenerationStats`): what `Engine.generate` returns in
`result.stats`, and what an `Engine.recording()` block collects."""

from __future__ import annotations

import collections.abc
import dataclasses


@dataclasses.dataclass
class GenerationStats(collections.abc.Mapping):
    """Counters and timings of the steps run while it was recording (one `generate` call, or an
    `Engine.recording()` block); also a read-only mapping: `stats["name"]`, `dict(stats)`.

    Times are wall clock on the host; with calls overlapped (`models.serving.scheduler`), a call's time runs from when
    the device could start it (the previous call read, or its launch if later) to when it was read. Steps that
    compiled are kept apart (`compile_s`), and so is a call in flight while the next one compiled (the rest of
    its time: the compilation is the next call's); `prefill_s`
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
