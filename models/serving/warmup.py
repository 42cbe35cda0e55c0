"""The host scheduler's compiling ahead: warm-up (every call shape a request can meet, traced, compiled in parallel
threads, then run once on idle rows) and the largest steps' temporaries the engine's memory plan reads
(`models.serving.scheduler`).

Dimension letters: B slots (max_batch), T tokens a step, P block-table width (pages).
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import jax
import numpy as np
import tqdm

from mla_jax.kv_cache import next_pow2
from models.serving.launches import MIN_STOP_IDS, MIXED_TILE
from models.serving.sampling import SamplingArrays
from models.serving.steps import StepInputs, trace_counts


class _WarmUp:
    """Compiling ahead: the device part's calls (`_prefill_call`, `_decode_call`, `_verify_call`) over idle rows
    (positions -1: nothing written, nothing attended), traced first (`_traced` set) and compiled together, the
    pool's pages and the device state they touch restored after tracing. Only while no request waits or runs."""

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

    def _warm_decode_configs(self) -> list:
        """The decode kernel configs a decoding step can take (`_decode_config`): the near-equal lengths' one,
        and the ragged one where it differs (one row two kernel pages long beside idle rows)."""
        B = self.e.max_batch
        ragged = np.zeros((B,), np.int32)
        ragged[0] = 128
        configs = [self._decode_config("decode", np.zeros((B,), np.int32))]
        picked = self._decode_config("decode", ragged)
        return configs + ([picked] if picked != configs[0] else [])
