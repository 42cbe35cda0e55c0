"""The paged latent KV cache of MLA: device page pools, a host-side page allocator, block tables.

Dimension letters: B sequences (slots), T tokens written in a step, P pages a sequence may hold
(block-table width), G = page_size tokens per page, C = L + R latent width (576 for V3),
N = num_pages.

Per layer the cache is one pool `[N, G, C]` of pages shared by all sequences (the main layers and
then the MTP layers, one pool each, all indexed by the same page ids: a token's page holds its
latent for every layer). The pools are ONE stacked array `[num_layers, N, G, C]`, so that a
scanned stack of layers carries it and updates it in place (a scan over per-layer pools as inputs
and outputs would copy the whole cache every step). A sequence owns a list of page ids, its block
table, in token order; token t of a sequence lives at row t % G of page block_table[t // G].

Three parts:
- `PagedLatentCache` (host side, mutable): the stacked pools, a free list, per-slot block tables
  and lengths. `reserve` grows a slot to a length, `truncate` rewinds it (speculative decoding),
  `release` returns its pages. `reserve` checks capacity first and raises `CacheFullError`
  before it changes anything, so a failure never touches another sequence.
- `KVCache` (a pytree, what a jitted step passes to `model(ids, positions, cache=cache)`): the
  stacked pools, the step's block table and lengths, the layer the next attention call uses, and
  the static choices (backend "kernel" | "interpret" | "reference", the decompressed-path
  threshold). `MLA` writes its latents through it and reads them back (`write`, `gather`, or the
  decode kernel straight on the pages via `map_pages`).
- `write_latents` / `gather_latents` (pure, jit-able): one pool's scatter and gather.

The page format is a property of the cache object, one `pallas_kernels.PageFormat`: bf16 by default,
float32 for exact tests, "fp8" (FlashMLA's 656-byte tokens: e4m3 latent, an fp32 scale per 128
values, bf16 rope) or "fp4" (416-byte tokens: e2m1 pairs, an e4m3 scale per 16 values, bf16 rope),
whose pools are uint8 [num_layers, N, G, W] with W the stored width. A write encodes (quantises) this
step's latents inside the same jitted step and scatters the stored rows; a gather decodes them to the
dtype the attention computes in (`paged_gather`'s fp8 / fp4 bodies on a kernel backend).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from pallas_kernels import paged_gather, paged_gather_problems
from pallas_kernels.backend import RESOLVED as BACKENDS  # "kernel" | "interpret" | "reference"
from pallas_kernels.latent_write import latent_rows_reference, latent_write, latent_write_problems
from pallas_kernels.mla_decode.config import checked_config
from pallas_kernels.page_format import PageFormat, page_format_of, resolve_page_format

# Why a pool per data rank is not read by the Pallas interpreter. jax 0.11.2's Mosaic GPU interpreter
# checks at the end of every kernel that no barrier of ANY device is still allocated, before the
# devices meet: two devices running a kernel at once fail that check whenever one finishes first
# (seen on 2 CPU devices, 1 run in 8). The compiled kernels ("kernel") have no such check.
INTERPRET_ON_DATA_RANKS = (
    "the Pallas interpreter cannot run a kernel on several devices at once (jax 0.11.2); "
    "use 'kernel' on GPUs or 'reference'"
)


class UnfinishedLatent(NamedTuple):
    """wkv_a's rows [B, T, K + R] (or their split-K `Partials`) with the latent's RMSNorm and the key's RoPE still to
    apply: what `MLA` hands `KVCache.write` where the cache writes them through `pallas_kernels.latent_write`
    (`KVCache.finishes_latents`), which sums, normalises, rotates and writes in one launch (XLA's partials sum, norm
    reduction and page update were three a layer). `norm_weight` [K] is kv_norm's weight, or a scanned stack's whole
    [L, K] with `norm_layer` the layer; `positions` [B, T] the rotation's (non-negative), `inv_freq` [R/2] and
    `rope_scale` its frequencies and factor (`mla_jax.rope`); `finish` the rows the kernel writes, in plain jnp."""

    kv: object
    norm_weight: jax.Array
    norm_layer: jax.Array | None
    eps: float
    positions: jax.Array
    inv_freq: np.ndarray
    rope_scale: float
    interleave: bool

    @property
    def widths(self) -> tuple[int, int]:
        """(K, R): the latent's and the rotary key's columns."""
        R = 2 * len(self.inv_freq)
        return self.kv.shape[-1] - R, R

    def finish(self, weight_apart: bool = False) -> jax.Array:
        """The latents [B, T, K + R] = [kv_norm(c) ; rope(k_pe)] in kv's dtype (``weight_apart``: `rms_norm`'s)."""
        kw = dict(eps=self.eps, interleave=self.interleave, rope_scale=self.rope_scale, norm_layer=self.norm_layer)
        args = (self.kv, self.norm_weight, self.positions, self.inv_freq)
        return latent_rows_reference(*args, weight_apart=weight_apart, **kw)


class CacheFullError(RuntimeError):
    """The page pool cannot hold what a sequence needs. Raised before anything is modified."""

    def __init__(self, message: str, *, pages_needed: int, pages_free: int, slot: int | None = None):
        super().__init__(message)
        self.pages_needed = pages_needed
        self.pages_free = pages_free
        self.slot = slot


class PagedLatentCache:
    """Page pools of `num_layers` layers, and which pages each of `max_seqs` slots holds.

    pages:        one device array [num_layers, num_pages, page_size, latent_dim] (dtype): the pool
                  of every layer (`pages[i]` is layer i's pool).
    block_tables: host int32 [max_seqs, max_pages_per_seq]; entries past a slot's pages are 0
                  (a valid page id, so a gather never goes out of bounds; masked by the length).
    lengths:      host int32 [max_seqs]: tokens each slot's pages are reserved for (`reserve` /
                  `truncate` set it; an engine may reserve ahead of what it has written).
    ranks:        data ranks (1 = one pool). With D > 1 the slots and the pages are split in D equal
                  parts: slot s belongs to rank s // (max_seqs / D), which owns pages
                  [r * N/D, (r + 1) * N/D) of the stacked array and allocates them from a free list of
                  its own; block tables hold ids LOCAL to the rank (0 .. N/D - 1), what each rank's
                  shard of the pool is indexed by (`KVCache.data_parallel`). A rank out of pages fails
                  its own reservation only.
    allocate=False: `pages` is a `jax.ShapeDtypeStruct` of the pool (nothing allocated), for tracing.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        latent_dim: int,
        max_seqs: int,
        max_pages_per_seq: int,
        page_format="bf16",
        fill_value: float = 0.0,
        rope_dim: int = 64,
        ranks: int = 1,
        dtype=None,
        allocate: bool = True,
    ):
        for name, v in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("latent_dim", latent_dim),
            ("max_seqs", max_seqs),
            ("max_pages_per_seq", max_pages_per_seq),
            ("ranks", ranks),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if max_seqs % ranks:
            raise ValueError(
                f"max_seqs={max_seqs} is not divisible by ranks={ranks} (each data rank gets max_seqs / ranks slots)"
            )
        if num_pages % ranks:
            raise ValueError(
                f"num_pages={num_pages} is not divisible by ranks={ranks} (each data rank gets num_pages / ranks pages)"
            )
        if dtype is not None:  # the earlier name of `page_format`
            page_format = dtype
        self._page_format = resolve_page_format(page_format, value_dim=latent_dim, rope_dim=rope_dim)
        self.rope_dim = self._page_format.rope_dim
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.latent_dim = latent_dim
        self.max_seqs = max_seqs
        self.max_pages_per_seq = max_pages_per_seq
        # `fill_value` lets tests poison never-written rows (NaN) to prove they are never read. In a
        # quantized format every row holds the encoded token of `fill_value`s, so it decodes to them
        # (NaN: e4m3 0x7F, a NaN scale and NaN rope, NaN in every value; 0: all-zero bytes, 0).
        shape = (num_layers, num_pages) + self._page_format.page_shape(page_size)
        fmt = self._page_format
        if not allocate:  # the pool's shape alone (an engine's memory plan traces its steps over it)
            self.pages = jax.ShapeDtypeStruct(shape, self.dtype)
        elif fmt.quantized:
            row = fmt.encode(jnp.full((latent_dim,), fill_value, jnp.float32))
            self.pages: jax.Array = jnp.broadcast_to(row, shape)
        else:
            self.pages = jnp.full(shape, fill_value, self.dtype)
        self.block_tables = np.zeros((max_seqs, max_pages_per_seq), np.int32)
        self.lengths = np.zeros((max_seqs,), np.int32)
        self._owned: list[list[int]] = [[] for _ in range(max_seqs)]
        self.ranks = ranks
        self.pages_per_rank = num_pages // ranks
        # One free list a rank, of its LOCAL page ids. Pop from the end: pages are handed out in
        # increasing id order from a fresh pool.
        self._free_lists: list[list[int]] = [list(range(self.pages_per_rank - 1, -1, -1)) for _ in range(ranks)]
        self.peak_pages_used = 0

    # --- properties -----------------------------------------------------------------------
    @property
    def dtype(self):
        """The element dtype of the pages: the format's storage dtype (bf16 by default; uint8 for fp8 / fp4)."""
        return self._page_format.storage_dtype

    @property
    def page_format(self) -> PageFormat:
        """The `PageFormat` of the pools, with this cache's latent and rope widths."""
        return self._page_format

    @property
    def nbytes(self) -> int:
        """Bytes the pools allocate on the device (all layers): num_layers * N * G * the format's token bytes."""
        return int(self.pages.size) * self.pages.dtype.itemsize

    @property
    def _free(self) -> list[int]:
        """Every rank's free list (local ids), concatenated: a copy."""
        return [p for free in self._free_lists for p in free]

    @property
    def num_free_pages(self) -> int:
        """Free pages over every rank (a slot can use only its own rank's: `free_pages_for`)."""
        return sum(len(free) for free in self._free_lists)

    @property
    def pages_used(self) -> int:
        return self.num_pages - self.num_free_pages

    def rank_of(self, slot: int) -> int:
        """The data rank slot `slot` belongs to: slot // (max_seqs / ranks)."""
        return slot // (self.max_seqs // self.ranks)

    def free_pages_for(self, slot: int) -> int:
        """Free pages of the pool slot `slot` allocates from (its rank's)."""
        return len(self._free_lists[self.rank_of(slot)])

    def pages_of(self, slot: int) -> list[int]:
        """The page ids slot `slot` holds, in token order (a copy): ids local to its rank's pool
        (rank r's page i is page r * pages_per_rank + i of the stacked array)."""
        return list(self._owned[slot])

    def pages_for(self, tokens: int) -> int:
        """Pages a sequence of `tokens` tokens holds."""
        return -(-tokens // self.page_size)

    # --- allocator ------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_seqs:
            raise ValueError(f"slot must be in [0, {self.max_seqs}), got {slot}")

    def reserve(self, slot: int, length: int) -> None:
        """Make slot `slot` hold enough pages for `length` tokens and set its length to `length`.

        Never frees pages (use `truncate` to shrink).

        Raises ValueError when `length` exceeds what a block table can address
        (max_pages_per_seq * page_size), and `CacheFullError` (naming pages needed and free)
        when the pool lacks pages; in both cases nothing has changed.
        """
        self._check_slot(slot)
        limit = self.max_pages_per_seq * self.page_size
        if not 0 <= length <= limit:
            raise ValueError(
                f"length {length} is outside [0, {limit}] "
                f"(max_pages_per_seq={self.max_pages_per_seq} x page_size={self.page_size})"
            )
        owned = self._owned[slot]
        free = self._free_lists[self.rank_of(slot)]
        need = self.pages_for(length) - len(owned)
        if need > len(free):
            pool = (
                f"only {len(free)} of {self.num_pages} are free"
                if self.ranks == 1
                else f"only {len(free)} of data rank {self.rank_of(slot)}'s {self.pages_per_rank} are free"
            )
            raise CacheFullError(
                f"KV cache full: slot {slot} needs {need} more page(s) for {length} tokens "
                f"but {pool} (page_size={self.page_size}); raise num_pages or lower max_batch",
                pages_needed=need,
                pages_free=len(free),
                slot=slot,
            )
        for _ in range(max(need, 0)):
            page = free.pop()
            self.block_tables[slot, len(owned)] = page
            owned.append(page)
        self.lengths[slot] = length
        self.peak_pages_used = max(self.peak_pages_used, self.pages_used)

    def truncate(self, slot: int, length: int) -> None:
        """Rewind slot `slot` to its first `length` tokens, freeing pages that become empty."""
        self._check_slot(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"truncate length {length} is outside [0, {int(self.lengths[slot])}] for slot {slot}")
        owned = self._owned[slot]
        keep = self.pages_for(length)
        while len(owned) > keep:
            self._free_lists[self.rank_of(slot)].append(owned.pop())
            self.block_tables[slot, len(owned)] = 0
        self.lengths[slot] = length

    def release(self, slot: int) -> None:
        """Free every page of slot `slot` (its sequence ended)."""
        self.truncate(slot, 0)


# ------------------------------------------------------------------------------------------
# Pure functions used inside jitted steps
# ------------------------------------------------------------------------------------------
def write_latents(
    pages_NGC: jax.Array, latent_BTC: jax.Array, positions_BT: jax.Array, block_table_BP: jax.Array, layer=None
) -> jax.Array:
    """Scatter the latents of T tokens per sequence into their pages -> the updated pages.

    pages_NGC: one pool [N,G,C], or with `layer` (a Python int or a traced scalar) the stacked pools
    [L,N,G,C], of which pool `layer` is written, indexed in place: never through a flattened view, which
    made XLA copy every pool of the stack at every layer of a step (a step's cost then grew with the pool,
    not with the tokens in it).
    positions_BT int32: the token's position in its sequence; negative = padding, not written
    (its update is sent out of bounds and dropped, so padding never touches a page).
    Positions beyond the block table are dropped as well. `latent_BTC` holds rows as the pool stores
    them: values for a plain pool (cast to its dtype), encoded bytes for a uint8 (fp8 / fp4) one
    (`PageFormat.encode`, as `KVCache.write` does).
    """
    if pages_NGC.dtype == jnp.uint8 and latent_BTC.dtype != jnp.uint8:
        raise ValueError(
            f"uint8 (fp8 / fp4) pages take encoded rows (PageFormat.encode the latents first), "
            f"got {latent_BTC.dtype} {latent_BTC.shape}"
        )
    N, G = pages_NGC.shape[-3:-1]
    P = block_table_BP.shape[1]
    valid = (positions_BT >= 0) & (positions_BT < P * G)
    pos = jnp.where(valid, positions_BT, 0)
    page_BT = jnp.take_along_axis(block_table_BP, pos // G, axis=1)
    rows = latent_BTC.astype(pages_NGC.dtype)
    if positions_BT.size == 1:
        # One row (a B = 1 decode step): an update of the row in place, the old row kept where it is padding. XLA
        # writes a one-row scatter as a bounds check, a read of the row and the write: three kernel launches a
        # layer; this is one.
        at = (page_BT[0, 0], pos[0, 0] % G) if layer is None else (layer, page_BT[0, 0], pos[0, 0] % G)
        at = tuple(jnp.asarray(i, jnp.int32) for i in at)
        old = jax.lax.dynamic_slice(pages_NGC, (*at, 0), (1,) * len(at) + (rows.shape[-1],))
        new = jnp.where(valid[0, 0], rows.reshape(old.shape), old)
        return jax.lax.dynamic_update_slice(pages_NGC, new, (*at, 0))
    page_BT = jnp.where(valid, page_BT, N)  # N is out of bounds: mode="drop" discards it
    index = (page_BT, pos % G) if layer is None else (layer, page_BT, pos % G)
    return pages_NGC.at[index].set(rows, mode="drop")


def gather_latents(
    pages_NGC: jax.Array,
    block_table_BP: jax.Array,
    lengths_B: jax.Array,
    *,
    impl: str = "reference",
    page_format: PageFormat | None = None,
    dtype=None,
    layer=None,
) -> tuple[jax.Array, jax.Array]:
    """Each sequence's cached tokens as a dense array, with their positions.

    pages_NGC: one pool [N,G,C], or with `layer` the stacked pools [L,N,G,C] (pool `layer` is read).

    Returns (latent [B, P*G, C], positions int32 [B, P*G]: s for s < length, else -1, the padding
    mark of `mla_jax.attention`). Rows at or past a sequence's length are zeroed: they may hold
    another sequence's stale data or never-written (even NaN) values, and a masked softmax weight
    of 0 times NaN is still NaN.
    page_format: the pool's `PageFormat` (None: read from the pool's dtype and width, `page_format_of`). A
    quantized format is decoded. dtype: the result's dtype (None: the pool's for plain pools; float32 for a
    quantized pool read by jnp, bf16 when `paged_gather`'s kernel decodes it).
    impl: "reference" (`pages[block_table]`, decoded in jnp) or "kernel" / "interpret"
    (`pallas_kernels.paged_gather` where it serves the pages, `paged_gather_problems`; else the jnp path).
    """
    N, G = pages_NGC.shape[-3:-1]
    B, P = block_table_BP.shape
    fmt = page_format_of(pages_NGC) if page_format is None else page_format
    if fmt.quantized and pages_NGC.dtype != fmt.storage_dtype:
        raise ValueError(f"{fmt.name} pages are {jnp.dtype(fmt.storage_dtype).name}, got {pages_NGC.dtype}")
    if impl != "reference" and not paged_gather_problems(fmt, G):
        pool, table = (pages_NGC, block_table_BP) if layer is None else _flat(pages_NGC, block_table_BP, layer)
        dense = paged_gather(pool, table, num_tokens=P * G, impl=impl, page_format=fmt)
    else:
        rows = pages_NGC[block_table_BP] if layer is None else pages_NGC[layer, block_table_BP]
        dense = rows.reshape(B, P * G, pages_NGC.shape[-1])
        if fmt.quantized:
            dense = fmt.decode(dense, dtype or jnp.float32)
    if dtype is not None:
        dense = dense.astype(dtype)
    s = jnp.arange(P * G, dtype=jnp.int32)[None, :]
    valid = s < lengths_B[:, None]
    dense = jnp.where(valid[..., None], dense, jnp.zeros((), dense.dtype))
    return dense, jnp.where(valid, s, -1)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1): the shape buckets of the jitted steps."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


# ------------------------------------------------------------------------------------------
# The cache a cached forward pass carries
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KVCache:
    """What `model(ids, positions, cache=cache)` reads and writes: a jax pytree.

    pages           [num_layers, N, G, C] the stacked pools (main layers, then MTP layers); the
                    step donates them and gets them back updated in place.
    block_table     int32 [B, P] page ids of each row (entries past a row's pages: any valid id).
    lengths         int32 [B] tokens in each row's cache AFTER this step's writes.
    layer           int32 scalar: the pool the next attention call uses (a scanned stack sets it
                    per layer; it is data, not a shape, so one compiled layer body serves all).
    impl            static: "kernel" | "interpret" | "reference", how attention reads the pages
                    (`pallas_kernels` kernels on the pages, in the interpreter, or plain jnp).
    decompressed_threshold
                    static: chunks of at least this many query tokens gather the prefix and use the
                    decompressed path; shorter ones (decode, MTP verify, short chunks) the absorbed one.
    page_format     static: the pools' `PageFormat`. `write` encodes with it (fp8 / fp4: quantises, in the
                    step), `gather` and the decode kernel decode it.
    data_parallel   static: None, or (mesh, mesh axes of the batch): a pool per data rank. The pages'
                    N axis and every [B, ...] array are split over those axes, the block table holds
                    page ids LOCAL to the row's rank, and `write` / `gather` run under `jax.shard_map`,
                    manual over those axes (each rank scatters into and gathers from its own N / D
                    pages; the other mesh axes stay GSPMD's). The kernels run there too, each on its
                    rank's pages, rows and local page ids: `gather`'s `paged_gather` and, through
                    `map_pages`, the layer's `mla_decode`.
    decode_config   static: the `pallas_kernels.mla_decode.MlaDecodeConfig` the decode kernel runs with
                    (None: its defaults).
    decode_plan     None, or what every layer's decode kernel call of this forward call shares
                    (`mla_jax.cache_paths.DecodePlan`: the kernel's lengths and, when ``decode_config``
                    asks for the pieces or "auto" schedule, its work plan): built once before the layers
                    run (`mla_jax.cache_paths.with_decode_plan`) and read by every layer's kernel call,
                    then dropped (`without_decode_plan`) when the call returns, since the next call's
                    lengths differ. With a pool per data rank its schedule stays None and each layer's
                    call plans its rank's rows.

    A query token at position p (negative = padding, never written, sees nothing) attends causally
    to the row's cached tokens at positions <= p, this step's own tokens included.
    """

    pages: jax.Array
    block_table: jax.Array
    lengths: jax.Array
    layer: jax.Array
    impl: str = "reference"
    decompressed_threshold: int = 256
    page_format: PageFormat | None = None
    data_parallel: tuple | None = None
    decode_config: object = None
    decode_plan: object = None

    def __post_init__(self):
        if self.impl not in BACKENDS:
            raise ValueError(f"KVCache impl must be one of {BACKENDS}, got {self.impl!r}")
        if not isinstance(self.page_format, PageFormat):
            raise ValueError(f"KVCache page_format must be a PageFormat, got {self.page_format!r}")
        if self.data_parallel is not None and self.impl == "interpret":
            raise ValueError("KVCache impl='interpret' with a pool per data rank: " + INTERPRET_ON_DATA_RANKS)
        if self.decode_config is not None:
            checked_config(self.decode_config, name="KVCache decode_config")

    @classmethod
    def create(
        cls,
        pages,
        block_table,
        lengths,
        *,
        impl: str = "reference",
        decompressed_threshold: int = 256,
        page_format: PageFormat | None = None,
        data_parallel: tuple | None = None,
        decode_config=None,
    ):
        """A cache at layer 0 over `pages` [num_layers, N, G, W] (int32 tables and lengths). `page_format`
        None reads the format from the pages (`pallas_kernels.page_format_of`: uint8 pages are fp8 or fp4
        by their width, rope 64; others plain values of their dtype).
        `data_parallel`: (mesh, the batch's mesh axes) for pools split per data rank (see the class);
        `decode_config`: the decode kernel's `MlaDecodeConfig` (None: its defaults)."""
        if page_format is None:
            page_format = page_format_of(pages)
        # Arrays already on the devices (an engine's rows placed on their data ranks) stay there.
        as_int32 = lambda x: x.astype(jnp.int32) if isinstance(x, jax.Array) else np.asarray(x, np.int32)  # noqa: E731
        return cls(
            pages,
            as_int32(block_table),
            as_int32(lengths),
            np.zeros((), np.int32),
            impl,
            decompressed_threshold,
            page_format,
            data_parallel,
            decode_config,
        )

    def at_layer(self, layer) -> "KVCache":
        """The same cache pointed at pool `layer` (a Python int or a traced scalar)."""
        return dataclasses.replace(self, layer=jnp.asarray(layer, jnp.int32))

    def with_lengths(self, lengths) -> "KVCache":
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def with_decode_plan(self, plan) -> "KVCache":
        """The same cache carrying this forward call's decode work plan (see the class)."""
        return dataclasses.replace(self, decode_plan=plan)

    def without_decode_plan(self) -> "KVCache":
        return dataclasses.replace(self, decode_plan=None)

    @property
    def num_pages(self) -> int:
        return self.pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.pages.shape[2]

    def map_pages(self, fn, *row_args):
        """`fn(pages, block_table, page_offset, *row_args)` on this layer's pages, e.g. the decode kernel: `pages`
        is every pool flat ([num_layers * N, G, W]: a free reshape, so a kernel reads the layer's pages where
        they are), `block_table` [B, P] the pool's own page ids, `page_offset` (int32 scalar, layer * N) where
        this layer's pool starts in `pages` (the kernel adds it as it reads the table: `mla_decode`'s
        page_offset), each row argument [B, ...]; `fn` returns an array [B, ...] or a tuple of them.

        With a pool per data rank (`data_parallel`), `fn` runs once a device under `jax.shard_map`,
        manual over every mesh axis: on its rank's own N / D pages, its rank's rows of the table (local
        page ids) and of `row_args` (whole on the rank: gathered over `tensor`, e.g. a head-split
        query), and its results are split over the data axes as the rows are, the same on every
        device of a rank.
        """

        def on_pool(pages, table, *rest):
            *args, layer = rest
            L, N = pages.shape[:2]
            return fn(pages.reshape((L * N,) + pages.shape[2:]), table, layer * N, *args)

        return self._per_rank(on_pool, batch_args=1 + len(row_args), pool_out=False, kernel=True)(
            self.pages, self.block_table, *row_args, self.layer
        )

    @property
    def quantized(self) -> bool:
        """Whether the pages hold a quantized format (their rows are bytes, not values)."""
        return self.page_format.quantized

    def finishes_latents(self, kv_lora_rank: int, rope_dim: int) -> bool:
        """Whether `write` takes an `UnfinishedLatent` of these widths and finishes it in `pallas_kernels.latent_write`
        as it writes: a kernel backend, pages of values (not encoded) that the kernel serves, one pool for all."""
        if self.impl == "reference" or self.quantized or self.data_parallel is not None:
            return False
        return not latent_write_problems(self.pages.dtype, kv_lora_rank, rope_dim)

    def write(self, latent_BTC, positions_BT: jax.Array) -> "KVCache":
        """Scatter this step's latents [B,T,C] into this layer's pages (padding, position < 0, dropped),
        encoded in the cache's page format (fp8 / fp4: quantised here, inside the step); an `UnfinishedLatent`
        (where `finishes_latents`) normalised, rotated and written by one kernel."""
        if isinstance(latent_BTC, UnfinishedLatent):
            u = latent_BTC
            if not self.finishes_latents(*u.widths):
                latent_BTC = u.finish()
            else:
                pages = latent_write(
                    self.pages,
                    u.kv,
                    positions_BT,
                    self.block_table,
                    u.norm_weight,
                    u.inv_freq,
                    eps=u.eps,
                    interleave=u.interleave,
                    rope_scale=u.rope_scale,
                    layer=self.layer,
                    norm_layer=u.norm_layer,
                    impl=self.impl,
                )
                return dataclasses.replace(self, pages=pages)
        rows = self.page_format.encode(latent_BTC) if self.quantized else latent_BTC
        write = self._per_rank(_write_pool, batch_args=3, pool_out=True)
        return dataclasses.replace(self, pages=write(self.pages, rows, positions_BT, self.block_table, self.layer))

    def gather(self, *, dtype=None) -> tuple[jax.Array, jax.Array]:
        """This layer's cached tokens per row, dense and decoded: (latent [B, P*G, C] in `dtype`,
        positions int32 [B, P*G], -1 past the row's length); see `gather_latents`."""
        gather = functools.partial(_gather_pool, impl=self.impl, page_format=self.page_format, dtype=dtype)
        per_rank = self._per_rank(gather, batch_args=2, pool_out=False, kernel=self.impl != "reference")
        return per_rank(self.pages, self.block_table, self.lengths, self.layer)

    def _per_rank(self, fn, *, batch_args: int, pool_out: bool, kernel: bool = False):
        """`fn(pages, *batch_args, layer)` as is, or under `jax.shard_map` over the data axes: the pool by
        its N axis, the batch arguments by B, the layer replicated; the result is the pool (`pool_out`)
        or [B, ...] arrays (one, or a tuple).

        `kernel`: `fn` calls a Pallas kernel, so the map is manual over EVERY mesh axis (each device
        runs the kernel on its rank's whole arrays; the arguments are gathered over the other axes, as
        GSPMD would gather them for a kernel it cannot partition). A partly automatic map would leave
        the kernel to GSPMD, and the interpreter's callbacks are refused there (jax 0.11: "callbacks
        are only supported ... when all mesh axes are partitioned manually")."""
        if self.data_parallel is None:
            return fn
        mesh, axes = self.data_parallel
        pool, rows = PartitionSpec(None, axes), PartitionSpec(axes)
        manual = set(mesh.axis_names) if kernel else set(axes)
        # No collective inside (each rank touches its own pages only), so nothing for check_vma to check.
        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=(pool,) + (rows,) * batch_args + (PartitionSpec(),),
            out_specs=pool if pool_out else rows,
            axis_names=manual,
            check_vma=False,
        )


def _flat(pages, block_table, layer):
    """(every pool as one [num_layers * N, G, C] array, the block table offset to pool `layer`)."""
    L, N = pages.shape[:2]
    return pages.reshape((L * N,) + pages.shape[2:]), block_table + layer * N


def _write_pool(pages, rows_BTC, positions_BT, block_table_BP, layer):
    return write_latents(pages, rows_BTC, positions_BT, block_table_BP, layer)


def _gather_pool(pages, block_table_BP, lengths_B, layer, *, impl, page_format, dtype):
    return gather_latents(
        pages, block_table_BP, lengths_B, impl=impl, page_format=page_format, dtype=dtype, layer=layer
    )


jax.tree_util.register_dataclass(
    KVCache,
    data_fields=["pages", "block_table", "lengths", "layer", "decode_plan"],
    meta_fields=["impl", "decompressed_threshold", "page_format", "data_parallel", "decode_config"],
)
