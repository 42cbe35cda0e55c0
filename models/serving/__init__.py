"""Serving: the engine and everything around its jitted steps.

engine.py     `Engine`, the public face
  options.py    its constructor's options, checked and resolved
  checks.py     its calls' arguments, checked
  pool.py       its page pool, sized by the memory plan and placed on the mesh
  handles.py    `GenerationResult`, `RequestHandle`, `RequestResult`
scheduler.py  the host scheduler, a thin class over its parts:
  pages.py      admission and the pages each row holds
  launches.py   what each call carries (prefill, mixed, decode, verify), built from the rows
  calls.py      the device calls and what stays on the device between them (the lane, the drafts)
  outputs.py    landing: tokens to their requests, stops, the end of a request, callbacks, stats
  warmup.py     compiling ahead (warm-up, the largest steps' temporaries)
requests.py   a request's own state, its slot's sequence bounds, a call in flight
steps.py      the jitted steps (prefill, mixed, decode and verify calls) and the device lane
sampling.py   `SamplingParams`, the samplers, speculative acceptance
stats.py      `GenerationStats`
cli.py        `mla-generate`
"""

from models.serving.engine import (
    CacheFullError,
    Engine,
    GenerationResult,
    GenerationStats,
    RequestHandle,
    RequestResult,
)
from models.serving.sampling import SamplingParams

__all__ = [
    "CacheFullError",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "RequestHandle",
    "RequestResult",
    "SamplingParams",
]
