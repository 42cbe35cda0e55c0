"""The host scheduler's device calls: a jitted step (`models.serving.steps`) enqueued on the page pool with the
state the device keeps between calls (the lane, the MTP drafts), and the decode kernel's config of each call
(`models.serving.scheduler`).

Dimension letters: B slots (max_batch), k MTP drafts a step, V vocab.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from mla_jax.cache_paths import step_decode_config
from mla_jax.kv_cache import KVCache
from mla_jax.sharding import shard_batch
from models.serving.steps import StepInputs, trace_counts

_PER_STEP = object()  # `_run`: the decode config from the step's own lengths


class _Calls:
    """One device call at a time, enqueued and not waited for.

    Owns what stays on the device from one call to the next: `lane` (each slot's pending token and position),
    with MTP `drafts` and `draft_probs`, and the pool's pages (`cache.pages`, as each call returns them donated);
    and `sampler` (the step's sampler kind), `oracle` (benchmarks' drafts), `_traced` (warm-up's traced calls,
    while it traces). Reads the engine's compiled `steps`, its `state`, backend, mesh and decode settings; appends
    each call that compiled to the engine's `compile_log`."""

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

    def _decode_config(self, kind: str, lengths):
        """The decode kernel's config of a step (`step_decode_config`: "auto", and the default, picked from the
        rows' lengths). One program, whatever the lengths, for a prefill step (no retrace when its lengths
        spread) and, with the default config, where no decode kernel runs (the reference backend) or where the
        model does not build the plan once a step (a pool per data rank: each layer would plan)."""
        chooses = kind != "prefill" and (
            self.e.decode_config is not None or (self.e.backend != "reference" and self.e.data_ranks == 1)
        )
        return step_decode_config(self.e.decode_config, lengths if chooses else None)

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
