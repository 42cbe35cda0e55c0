"""The device-memory plan of a serving engine: how many cache pages fit beside the weights and the steps.

A serving engine on a GPU holds three things in the device's memory: the model's weights, the page pool of
the latent cache, and while a step runs, that step's temporaries (activations, workspace). The pool gets what
the other two leave of a fraction of the device (vLLM's `gpu_memory_utilization`, SGLang's
`mem_fraction_static`):

    budget  = floor(device_bytes * fraction)
    room    = budget - weights - other bytes already in use - the largest step's temporaries
    pages   = room // page_bytes            (per data rank: every device of a rank holds the rank's pool)

`device_bytes` is what JAX's allocator may hand out on the device (`memory_stats()["bytes_limit"]`: with
JAX's default preallocation, 75 % of the card; `XLA_PYTHON_CLIENT_MEM_FRACTION` sets that share), so the
default fraction leaves a tenth of it to XLA (autotuning scratch, the sampler, what a caller runs beside the
engine). The temporaries are measured: the engine compiles its largest steps and reads
`compiled.memory_analysis()`. `page_bytes` is the capacity planner's arithmetic (`mla_jax.capacity.
plan_kv_cache`: bytes a token over every cached layer, times the page size), so `mla-capacity` and the engine
price a token alike.

`plan_pool` decides the pool: the pages asked for (an explicit `num_pages`) when they fit, else an error; by
default, the pages `max_batch` sequences of `max_context` tokens would use, or as many as fit when fewer do
(a request then waits for pages), and an error when not even one sequence of `max_context` tokens fits.
Each error is one line naming the bytes needed, the bytes there are and what to change.
"""

from __future__ import annotations

import dataclasses
import math

import jax

DEFAULT_MEMORY_FRACTION = 0.9

__all__ = [
    "DEFAULT_MEMORY_FRACTION",
    "MemoryPlan",
    "MemoryPlanError",
    "check_fraction",
    "check_weights_fit",
    "device_bytes_in_use",
    "device_bytes_limit",
    "plan_pool",
    "tree_device_bytes",
]


class MemoryPlanError(ValueError):
    """The engine's pool does not fit the device (one line: the bytes needed, the bytes there are, what to change)."""


def _gib(n: int) -> str:
    """Bytes in GiB with two decimals (MiB under a GiB), for one-line messages."""
    return f"{n / 1024**3:.2f} GiB" if abs(n) >= 1024**3 else f"{n / 1024**2:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One engine's memory on its most loaded device, in bytes.

    device_bytes: what the device offers (JAX's allocator limit, or the figure the caller gave);
    fraction: the share of it the engine plans for; weight_bytes: the model's variables on that device;
    other_bytes: memory already in use that is not the model's (other arrays the process holds);
    temp_bytes: the largest measured step's temporaries; page_bytes: one page of every cached layer;
    pages_per_sequence: one sequence of max_context tokens (and the MTP draft room); ranks: data ranks (a pool
    each; a device holds its rank's); num_pages: the pool, over all ranks."""

    device_bytes: int
    fraction: float
    weight_bytes: int
    other_bytes: int
    temp_bytes: int
    page_bytes: int
    pages_per_sequence: int
    ranks: int
    num_pages: int

    @property
    def budget_bytes(self) -> int:
        return math.floor(self.device_bytes * self.fraction)

    @property
    def room_bytes(self) -> int:
        """What the budget leaves for the pool on a device (negative: the weights and steps alone overflow it)."""
        return self.budget_bytes - self.weight_bytes - self.other_bytes - self.temp_bytes

    @property
    def max_pages(self) -> int:
        """The most pages the room holds, over all ranks."""
        return max(self.room_bytes, 0) // self.page_bytes * self.ranks

    @property
    def pool_bytes(self) -> int:
        """The pool on a device."""
        return self.num_pages // self.ranks * self.page_bytes

    def summary(self) -> str:
        """One line: the plan's terms and the pool it gives."""
        return (
            f"memory plan: {self.fraction:g} x {_gib(self.device_bytes)} = {_gib(self.budget_bytes)}: weights "
            f"{_gib(self.weight_bytes)}, step temporaries {_gib(self.temp_bytes)}, other {_gib(self.other_bytes)}, "
            f"page pool {_gib(self.pool_bytes)} ({self.num_pages} pages, "
            f"{self.num_pages // self.ranks // self.pages_per_sequence} sequences of max_context a rank)"
        )


def check_fraction(fraction, name: str = "memory_fraction") -> float:
    """A fraction in (0, 1] -> float; ValueError naming `name` otherwise."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def plan_pool(
    *,
    device_bytes: int,
    fraction: float,
    weight_bytes: int,
    temp_bytes: int,
    page_bytes: int,
    pages_per_sequence: int,
    max_batch: int,
    num_pages: int | None = None,
    other_bytes: int = 0,
    ranks: int = 1,
    max_context: int | None = None,
) -> MemoryPlan:
    """The pool that fits -> a `MemoryPlan` (see the module docstring); `MemoryPlanError` when it does not.

    num_pages: the pool asked for (over all ranks), checked; None: `max_batch` sequences' worth
    (`max_batch * pages_per_sequence`), or the multiple of `ranks` pages that fits when fewer do, as long as one
    sequence of `pages_per_sequence` pages fits a rank. `max_context` only names the sequence in messages."""
    fraction = check_fraction(fraction)
    for name, v in (("device_bytes", device_bytes), ("page_bytes", page_bytes), ("ranks", ranks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    wanted = max_batch * pages_per_sequence if num_pages is None else num_pages
    plan = MemoryPlan(
        device_bytes=device_bytes,
        fraction=fraction,
        weight_bytes=weight_bytes,
        other_bytes=other_bytes,
        temp_bytes=temp_bytes,
        page_bytes=page_bytes,
        pages_per_sequence=pages_per_sequence,
        ranks=ranks,
        num_pages=wanted,
    )
    terms = (
        f"weights {_gib(weight_bytes)} + step temporaries {_gib(temp_bytes)}"
        + (f" + other arrays {_gib(other_bytes)}" if other_bytes else "")
        + f" of the {_gib(plan.budget_bytes)} planned ({fraction:g} x {_gib(device_bytes)} on the device)"
    )
    seq = f"one sequence of max_context={max_context} tokens" if max_context else "one sequence"
    if num_pages is not None:
        if wanted > plan.max_pages:
            need = wanted // ranks * page_bytes
            raise MemoryPlanError(
                f"num_pages={num_pages} needs {_gib(need)} of pages a device beside {terms}; "
                f"{plan.max_pages} pages fit: lower num_pages, use fp8 pages (kv_dtype='fp8') or raise "
                f"memory_fraction"
            )
        return plan
    if plan.max_pages // ranks < pages_per_sequence:
        raise MemoryPlanError(
            f"{seq} needs {_gib(pages_per_sequence * page_bytes)} of pages beside {terms}; "
            f"{_gib(max(plan.room_bytes, 0))} is left: lower max_context or max_batch (the largest step's "
            "temporaries grow with max_batch x prefill_chunk), use fp8 pages (kv_dtype='fp8') or raise "
            "memory_fraction"
        )
    if wanted > plan.max_pages:
        plan = dataclasses.replace(plan, num_pages=plan.max_pages)
    return plan


def check_weights_fit(
    weight_bytes: int,
    device_bytes: int | None,
    fraction: float = DEFAULT_MEMORY_FRACTION,
    what: str = "the model's weights",
) -> None:
    """Before a model is built: `MemoryPlanError` in one line when its weights alone exceed the budget of a device
    of `device_bytes` (None: nothing to check, e.g. a CPU)."""
    if device_bytes is None:
        return
    budget = math.floor(device_bytes * check_fraction(fraction))
    if weight_bytes > budget:
        raise MemoryPlanError(
            f"{what} need {_gib(weight_bytes)}; the device offers {_gib(budget)} ({fraction:g} x "
            f"{_gib(device_bytes)}): fewer layers, FP8 weights or a mesh of several devices"
        )


def device_bytes_limit(device=None) -> int | None:
    """Bytes JAX's allocator may hand out on `device` (default: the first device); None where the device
    reports none (a CPU)."""
    stats = _stats(device)
    limit = stats.get("bytes_limit") if stats else None
    return int(limit) if limit else None


def device_bytes_in_use(device=None) -> int:
    """Bytes in use on `device` now (0 where the device reports none)."""
    stats = _stats(device)
    return int(stats.get("bytes_in_use", 0)) if stats else 0


def _stats(device):
    device = jax.devices()[0] if device is None else device
    try:
        return device.memory_stats()
    except Exception:  # backends without allocator statistics
        return None


def tree_device_bytes(tree) -> int:
    """Bytes the arrays of `tree` hold on the most loaded device (a sharded array counts its shards there)."""
    per: dict = {}
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        for s in x.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values(), default=0)
