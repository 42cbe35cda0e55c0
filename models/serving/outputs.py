"""The host scheduler's outputs: a landed call's tokens to their requests (stop tokens, lengths, the context,
non-finite logits), the end of a request (its slot and pages freed), the `on_token` callbacks and the stats
(`models.serving.scheduler`).
"""

from __future__ import annotations

import time

import numpy as np

from mla_jax.kv_cache import CacheFullError
from models.serving.requests import _Flight
from models.serving.sampling import NonFiniteLogitsError
from models.serving.steps import NON_FINITE


class _Outputs:
    """Landing and ending: reads a `_Flight`'s outputs (waiting for the device), appends tokens to their `_Request`
    (`tokens`, `token_times`) and ends it (`finish_reason`, `error`), its slot and pages freed and its record
    dropped from `requests` / `waiting`; queues the step's tokens for the callbacks (`events`) and delivers them;
    records each call in the stats recording now (`sinks`, `GenerationStats`; `landed_at` times the calls)."""

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
        self.mtp_seen[0] += drafted
        self.mtp_seen[1] += accepted
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
