"""The paged latent cache: allocator, CacheFullError before any change, byte count = the planner's,
and the pure write / gather functions against a numpy reference (permuted pages, NaN poison)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.capacity import mla_kv_bytes, plan_kv_cache
from mla_jax.config import ModelConfig
from mla_jax.kv_cache import CacheFullError, PagedLatentCache, gather_latents, next_pow2, write_latents
from pallas_kernels import paged_gather_problems


def _cache(**kw):
    args = dict(num_layers=2, num_pages=8, page_size=4, latent_dim=6, max_seqs=3, max_pages_per_seq=4)
    args.update(kw)
    return PagedLatentCache(**args)


def test_reserve_truncate_release():
    c = _cache()
    c.reserve(0, 5)  # 2 pages
    c.reserve(1, 4)  # 1 page
    assert c.pages_of(0) == [0, 1] and c.pages_of(1) == [2]
    np.testing.assert_array_equal(c.block_tables[0, :2], [0, 1])
    assert c.pages_used == 3 and c.num_free_pages == 5 and list(c.lengths) == [5, 4, 0]
    c.reserve(0, 9)  # grows to 3 pages
    assert c.pages_of(0) == [0, 1, 3] and c.peak_pages_used == 4
    c.truncate(0, 8)  # 8 tokens still need 2 pages: the third is freed
    assert c.pages_of(0) == [0, 1] and c.lengths[0] == 8 and c.block_tables[0, 2] == 0
    c.truncate(0, 7)  # same page count: nothing freed
    assert c.pages_of(0) == [0, 1]
    c.release(1)
    assert c.pages_of(1) == [] and c.lengths[1] == 0 and c.pages_used == 2
    assert c.peak_pages_used == 4
    with pytest.raises(ValueError, match="truncate length 9"):
        c.truncate(0, 9)
    with pytest.raises(ValueError, match="slot must be in"):
        c.reserve(3, 1)
    with pytest.raises(ValueError, match="outside"):
        c.reserve(0, 17)  # beyond max_pages_per_seq * page_size = 16


def test_cache_full_changes_nothing():
    c = _cache()
    c.reserve(0, 16)  # 4 pages
    c.reserve(1, 12)  # 3 pages -> 1 free
    before = (list(c._free), c.block_tables.copy(), c.lengths.copy(), [c.pages_of(s) for s in range(3)], id(c.pages))
    with pytest.raises(CacheFullError, match=r"needs 2 more page\(s\).*only 1 of 8 are free") as e:
        c.reserve(2, 5)
    assert isinstance(e.value, RuntimeError)
    assert (e.value.pages_needed, e.value.pages_free, e.value.slot) == (2, 1, 2)
    after = (list(c._free), c.block_tables.copy(), c.lengths.copy(), [c.pages_of(s) for s in range(3)], id(c.pages))
    assert before[0] == after[0] and before[3] == after[3] and before[4] == after[4]
    np.testing.assert_array_equal(before[1], after[1])
    np.testing.assert_array_equal(before[2], after[2])
    c.reserve(2, 4)  # one page still fits
    assert c.num_free_pages == 0


def test_a_pool_per_data_rank():
    """ranks=2: slots 0-1 allocate from rank 0's 4 pages, slots 2-3 from rank 1's, each by LOCAL ids
    0..3 (what each rank's shard of the pool is indexed by); rank 0 out of pages raises for its slot
    alone, naming the rank, and changes nothing of either rank; a freed page goes back to its own
    rank. Catches block tables with global ids (rank 1's first page as 4: beyond its shard), one free
    list for both ranks (slot 2 taking rank 0's pages), and a freed page handed to the other rank."""
    c = _cache(max_seqs=4, ranks=2)
    assert [c.rank_of(s) for s in range(4)] == [0, 0, 1, 1] and c.pages_per_rank == 4
    c.reserve(0, 12)  # 3 pages of rank 0
    c.reserve(2, 5)  # 2 pages of rank 1
    assert c.pages_of(0) == [0, 1, 2] and c.pages_of(2) == [0, 1]
    np.testing.assert_array_equal(c.block_tables[2, :2], [0, 1])
    assert (c.free_pages_for(1), c.free_pages_for(3), c.num_free_pages, c.pages_used) == (1, 2, 3, 5)
    before = (c.block_tables.copy(), c.lengths.copy(), [c.pages_of(s) for s in range(4)], c._free)
    with pytest.raises(CacheFullError, match=r"slot 1 needs 2 more page\(s\) .*only 1 of data rank 0's 4 are free"):
        c.reserve(1, 8)
    assert (c.block_tables.tolist(), c.lengths.tolist(), [c.pages_of(s) for s in range(4)], c._free) == (
        before[0].tolist(),
        before[1].tolist(),
        before[2],
        before[3],
    )
    c.reserve(3, 8)  # rank 1 still has 2
    assert c.pages_of(3) == [2, 3] and c.free_pages_for(2) == 0
    c.release(0)
    assert c.free_pages_for(1) == 4 and c.free_pages_for(3) == 0
    c.reserve(1, 16)  # all of rank 0 again
    assert sorted(c.pages_of(1)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="max_seqs=3 is not divisible by ranks=2"):
        _cache(ranks=2)
    with pytest.raises(ValueError, match="num_pages=8 is not divisible by ranks=3"):
        _cache(max_seqs=3, ranks=3)


def test_dtype_is_a_property_of_the_cache():
    assert _cache().dtype == jnp.bfloat16 and _cache().page_format.name == "bf16"
    c = _cache(dtype=jnp.float32)
    assert c.page_format.name == "fp32" and all(p.dtype == jnp.float32 for p in c.pages)
    with pytest.raises(ValueError, match="page format int8 is unknown"):
        _cache(dtype=jnp.int8)
    with pytest.raises(ValueError, match="num_pages must be a positive integer"):
        _cache(num_pages=0)


# Hand-computed: layers (main + the MTP layer's own cache) x (kv_lora_rank + rope) x 2 bytes (bf16) x tokens.
#   tiny: 4 + 1 layers, 64 + 16 = 80 values:  5 * 80 * 2 * (29 * 64) = 1,484,800;  5 * 80 * 2 * (10 * 8) = 64,000
#   V3:  61 + 1 layers, 512 + 64 = 576:       62 * 576 * 2 * (3 * 64) = 13,713,408
@pytest.mark.parametrize(
    "cfg_name, num_pages, page_size, expected",
    [("tiny", 29, 64, 1_484_800), ("tiny", 10, 8, 64_000), ("v3", 3, 64, 13_713_408)],
)
def test_pool_bytes_equal_the_planner(cfg_name, num_pages, page_size, expected):
    """Guards: a byte count that is off (a forgotten MTP layer, the rope part, 4-byte elements) in the pool
    or in the planner: both are compared to numbers computed by hand, not to the formula again."""
    cfg = ModelConfig.tiny() if cfg_name == "tiny" else ModelConfig.deepseek_v3()
    layers = cfg.num_hidden_layers + cfg.num_mtp_layers
    c = PagedLatentCache(
        num_layers=layers,
        num_pages=num_pages,
        page_size=page_size,
        latent_dim=cfg.latent_dim,
        max_seqs=1,
        max_pages_per_seq=num_pages,
    )
    tokens = num_pages * page_size
    assert c.nbytes == expected
    assert mla_kv_bytes(layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 2, tokens) == expected
    plan = plan_kv_cache(cfg, context_len=tokens, page_size=page_size, include_mtp=True)
    assert plan.mla.allocated_bytes == plan.mla.logical_bytes == expected


@pytest.mark.parametrize("mtp_layers", [1, 0])
@pytest.mark.parametrize("max_batch, max_context, page_size", [(3, 300, 64), (2, 61, 8), (1, 2048, 64)])
def test_engine_pool_equals_the_planner(mtp_layers, max_batch, max_context, page_size):
    """The pool an Engine allocates by default is what the planner predicts for the same settings:
    with an MTP head, its block's cache and the 3 tokens of draft room; without one, neither."""
    from flax import nnx

    from models import DeepSeekModel
    from models.serving.engine import Engine

    cfg = ModelConfig.tiny().replace(num_hidden_layers=2, num_mtp_layers=mtp_layers)
    model = nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0)))  # the pool needs no weights
    e = Engine(model, page_size=page_size, max_batch=max_batch, max_context=max_context)
    plan = plan_kv_cache(
        cfg,
        context_len=max_context,
        num_sequences=max_batch,
        page_size=page_size,
        include_mtp=mtp_layers > 0,
        draft_tokens=3 if mtp_layers else 0,
    )
    assert e.cache.nbytes == plan.mla.allocated_bytes
    layers = cfg.num_hidden_layers + mtp_layers
    pages = max_batch * -(-(max_context + (3 if mtp_layers else 0)) // page_size)
    assert e.cache.nbytes == mla_kv_bytes(layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 2, pages * page_size)


def test_write_and_gather_match_numpy():
    rng = np.random.default_rng(0)
    N, G, C, B, P = 10, 4, 6, 3, 3
    pool = jnp.full((N, G, C), jnp.nan, jnp.float32)  # never-written rows are NaN
    table = np.zeros((B, P), np.int32)
    perm = rng.permutation(N)  # pages of each row in a shuffled order
    table[0, :3], table[1, :2], table[2, :1] = perm[:3], perm[3:5], perm[5:6]
    lengths = np.array([11, 6, 3], np.int32)
    # Write every row's tokens in two steps, the second ragged with padding (-1).
    ref = np.full((N, G, C), np.nan, np.float32)
    for start, T in ((0, 5), (5, 6)):
        pos = np.full((B, T), -1, np.int32)
        lat = rng.normal(size=(B, T, C)).astype(np.float32)
        for b in range(B):
            n = max(0, min(T, lengths[b] - start))
            pos[b, :n] = np.arange(start, start + n)
            for t in range(n):
                p = pos[b, t]
                ref[table[b, p // G], p % G] = lat[b, t]
        pool = jax.jit(write_latents)(pool, jnp.asarray(lat), jnp.asarray(pos), jnp.asarray(table))
    np.testing.assert_array_equal(np.asarray(pool), ref)  # NaN where untouched, exact elsewhere
    dense, kv_pos = gather_latents(pool, jnp.asarray(table), jnp.asarray(lengths))
    dense, kv_pos = np.asarray(dense), np.asarray(kv_pos)
    for b in range(B):
        for s in range(P * G):
            if s < lengths[b]:
                np.testing.assert_array_equal(dense[b, s], ref[table[b, s // G], s % G])
                assert kv_pos[b, s] == s
            else:  # masked rows are zero, never the pool's NaN
                assert kv_pos[b, s] == -1 and (dense[b, s] == 0).all()


@pytest.mark.parametrize("stacked", [False, True])
def test_a_single_row_writes_in_place_and_padding_writes_nothing(stacked):
    """One row (a B = 1 decode step: `write_latents`' in-place update, not the scatter) lands where the scatter puts
    it, in the named pool of a stack; a padding position (-1) and one past the block table leave every page as it
    was, NaN included (catches the in-place update writing its row whatever the position, writing the clamped
    index's row where it is padding, or into the wrong pool)."""
    rng = np.random.default_rng(1)
    L, N, G, C = 3, 6, 4, 5
    pool = jnp.asarray(rng.normal(size=(L, N, G, C)).astype(np.float32)).at[:, 2].set(jnp.nan)
    table = jnp.asarray([[4, 2, 0]], jnp.int32)
    for p in (0, 6, 11, -1, 12, -5):
        lat = jnp.asarray(rng.normal(size=(1, 1, C)).astype(np.float32))
        pos = jnp.asarray([[p]], jnp.int32)
        if stacked:
            got = jax.jit(write_latents)(pool, lat, pos, table, jnp.int32(1))
        else:
            got = jax.jit(write_latents)(pool[1], lat, pos, table)
        # the scatter path's answer: the same row written beside a padding row (two rows: not the one-row update)
        lat2, pos2 = jnp.concatenate([lat, lat], 0), jnp.asarray([[p], [-1]], jnp.int32)
        table2 = jnp.concatenate([table, table], 0)
        want = write_latents(pool[1], lat2, pos2, table2)
        np.testing.assert_array_equal(np.asarray(got[1] if stacked else got), np.asarray(want))
        if stacked:
            np.testing.assert_array_equal(np.asarray(got)[[0, 2]], np.asarray(pool)[[0, 2]])
        if not 0 <= p < 12:
            np.testing.assert_array_equal(np.asarray(want), np.asarray(pool[1]))  # NaN pages compare equal


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


# --- fp8 pages --------------------------------------------------------------------------------------
def test_fp8_cache_format_shape_and_bytes():
    """Guards: a format name taken for a dtype (or refused), pools allocated as [.., C] values instead
    of [.., W] bytes, nbytes counting elements of the wrong size, the rope width ignored."""
    from pallas_kernels import FP8_PAGES, PageFormat

    c = _cache(dtype="fp8", latent_dim=576, rope_dim=64)
    assert c.page_format.name == "fp8" and c.dtype == jnp.uint8 and c.rope_dim == 64
    assert c.page_format == FP8_PAGES
    assert c.pages.shape == (2, 8, 4, 656) and c.pages.dtype == jnp.uint8
    assert c.nbytes == 2 * 8 * 4 * 656 == 41_984
    assert _cache(dtype=FP8_PAGES, latent_dim=576).page_format.name == "fp8"
    with pytest.raises(ValueError, match="uint8 is the storage of both quantized page formats"):
        _cache(dtype=jnp.uint8, latent_dim=576)  # fp8 or fp4? a dtype does not say
    # other widths: L = 256, R = 32 -> 256 + 8 + 64 bytes; not the kernels' shape
    odd = _cache(dtype="fp8", latent_dim=288, rope_dim=32)
    assert odd.page_format == PageFormat("fp8", latent_dim=256, rope_dim=32)
    assert paged_gather_problems(odd.page_format) and not paged_gather_problems(c.page_format)
    assert odd.pages.shape[-1] == 328 and odd.nbytes == 2 * 8 * 4 * 328
    for name, dt in (("bf16", jnp.bfloat16), ("fp16", jnp.float16), ("fp32", jnp.float32)):
        assert _cache(dtype=name).dtype == dt and _cache(dtype=name).page_format.name == name
    with pytest.raises(ValueError, match="fp8 pages need latent_dim a positive multiple of 128.* got 64"):
        _cache(dtype="fp8", latent_dim=80, rope_dim=16)  # ModelConfig.tiny()'s latent


def test_fp8_cache_holds_1_75x_the_tokens_of_bf16_in_the_same_bytes():
    """1152 / 656 = 1.756: in (at most) the bytes of a bf16 pool, an fp8 pool holds >= 1.75x the
    pages. Guards: fp8 pages that are not smaller (values stored, scales per value)."""
    kw = dict(num_layers=3, page_size=64, latent_dim=576, max_seqs=1, max_pages_per_seq=4)
    bf16 = PagedLatentCache(num_pages=100, **kw)
    fp8 = PagedLatentCache(num_pages=100 * 1152 // 656, dtype="fp8", **kw)
    assert fp8.nbytes <= bf16.nbytes
    assert fp8.num_pages * fp8.page_size >= 1.75 * bf16.num_pages * bf16.page_size
    assert fp8.nbytes == 3 * 175 * 64 * 656 and bf16.nbytes == 3 * 100 * 64 * 1152


# --- fp4 pages --------------------------------------------------------------------------------------
def test_fp4_cache_format_shape_bytes_and_the_planner():
    """A "fp4" cache allocates uint8 [layers, N, G, 416] pools (L=512, R=64), whose bytes are the capacity
    planner's fp4 row; in the bytes of a bf16 pool it holds 1152 / 416 = 2.77x the tokens. Guards: the
    format name refused (it was a planner-only row), pools of values instead of bytes, the planner and
    the allocation counting fp4 tokens with two formulas, uint8 pages of 416 read as fp8."""
    from mla_jax.kv_cache import KVCache
    from pallas_kernels import FP4_PAGES

    c = _cache(dtype="fp4", latent_dim=576, rope_dim=64)
    assert c.page_format.name == "fp4" and c.dtype == jnp.uint8 and c.page_format == FP4_PAGES
    assert c.pages.shape == (2, 8, 4, 416) and c.nbytes == 2 * 8 * 4 * 416
    assert _cache(dtype=FP4_PAGES, latent_dim=576).page_format.name == "fp4"
    assert KVCache.create(c.pages, np.zeros((1, 1)), [0]).page_format == FP4_PAGES  # told from fp8 by width
    tiny = _cache(dtype="fp4", latent_dim=80, rope_dim=16)  # ModelConfig.tiny()'s latent: 64 + 16
    assert tiny.pages.shape[-1] == 32 + 4 + 32 and paged_gather_problems(tiny.page_format)
    kw = dict(num_layers=3, page_size=64, latent_dim=576, max_seqs=1, max_pages_per_seq=4)
    bf16 = PagedLatentCache(num_pages=100, **kw)
    fp4 = PagedLatentCache(num_pages=100 * 1152 // 416, dtype="fp4", **kw)
    assert fp4.nbytes <= bf16.nbytes and fp4.num_pages == 276
    assert fp4.num_pages * fp4.page_size >= 2.76 * bf16.num_pages * bf16.page_size
    cfg = ModelConfig.tiny().replace(num_hidden_layers=3, num_mtp_layers=0, kv_lora_rank=512, qk_rope_head_dim=64)
    plan = plan_kv_cache(cfg, context_len=4 * 64, num_sequences=1, page_size=64, kv_dtype="fp4")
    assert plan.mla.bytes_per_token_layer == FP4_PAGES.token_bytes == 416
    one = PagedLatentCache(num_pages=4, dtype="fp4", **kw)
    assert one.nbytes == plan.mla.allocated_bytes == 3 * 4 * 64 * 416


def test_fp4_write_and_gather_match_numpy():
    """The cache's write quantises inside the jitted step and scatters the bytes where numpy says; its
    gather decodes them and zeroes rows past each length; never-written rows are the encoded NaN token.
    Expected bytes and values: tests/fp4_numpy.py. Guards: fp4 rows written as fp8 (or as values), the
    gather decoding them with the fp8 layout, a NaN row read as zeros (the NaN rides on the scale)."""
    from fp4_numpy import fp4_bytes, fp4_values

    from mla_jax.kv_cache import KVCache

    rng = np.random.default_rng(2)
    c = PagedLatentCache(
        num_layers=1,
        num_pages=4,
        page_size=4,
        latent_dim=80,
        max_seqs=2,
        max_pages_per_seq=2,
        dtype="fp4",
        fill_value=float("nan"),
        rope_dim=16,
    )
    assert np.isnan(fp4_values(c.pages, rope_dim=16)).all()
    table = np.array([[3, 1], [0, 2]], np.int32)
    pos = np.array([[3, 4], [0, 1]], np.int32)
    lat = (rng.standard_normal((2, 2, 80)) * 3).astype(np.float32)
    step = jax.jit(lambda kv, x, p: kv.write(x, p).gather(dtype=jnp.float32) + (kv.write(x, p).pages,))
    dense, _, pages = step(
        KVCache.create(c.pages, table, [5, 2], page_format=c.page_format), jnp.asarray(lat), jnp.asarray(pos)
    )
    want = np.asarray(c.pages).copy()
    for b in range(2):
        for t in range(2):
            want[0, table[b, pos[b, t] // 4], pos[b, t] % 4] = fp4_bytes(lat[b, t], rope_dim=16)
    np.testing.assert_array_equal(np.asarray(pages), want)
    dense = np.asarray(dense)
    np.testing.assert_array_equal(dense[0, 3:5], fp4_values(fp4_bytes(lat[0], rope_dim=16), rope_dim=16))
    np.testing.assert_array_equal(dense[1, :2], fp4_values(fp4_bytes(lat[1], rope_dim=16), rope_dim=16))
    assert np.isnan(dense[0, :3]).all() and (dense[0, 5:] == 0).all() and (dense[1, 2:] == 0).all()


@pytest.mark.parametrize("mtp_layers", [1, 0])
def test_fp8_engine_pool_equals_the_planner(mtp_layers):
    """The planner's fp8 bytes for an engine's config are the bytes its cache allocates (and each
    token takes 656 bytes a layer, counted by hand)."""
    from flax import nnx

    from models import DeepSeekModel
    from models.serving.engine import Engine

    cfg = ModelConfig.tiny().replace(
        num_hidden_layers=2, num_mtp_layers=mtp_layers, kv_lora_rank=512, qk_rope_head_dim=64
    )
    e = Engine(DeepSeekModel(cfg, rngs=nnx.Rngs(0)), page_size=64, max_batch=2, max_context=300, kv_dtype="fp8")
    plan = plan_kv_cache(
        cfg,
        context_len=300,
        num_sequences=2,
        page_size=64,
        kv_dtype="fp8",
        include_mtp=mtp_layers > 0,
        draft_tokens=3 if mtp_layers else 0,
    )
    assert plan.mla.bytes_per_token_layer == 656
    assert e.cache.nbytes == plan.mla.allocated_bytes == (2 + mtp_layers) * 2 * 5 * 64 * 656  # 5 pages a row


def test_fp8_write_and_gather_match_numpy():
    """The cache's write encodes inside the jitted step and scatters the bytes where numpy says; its
    gather decodes them (jnp, float32) and zeroes rows past each length. Every never-written row is
    the encoded NaN token (fill_value=nan): a row read by mistake would show. Expected bytes and
    values: tests/fp8_numpy.py."""
    from fp8_numpy import fp8_bytes, fp8_values

    from mla_jax.kv_cache import KVCache

    rng = np.random.default_rng(1)
    c = PagedLatentCache(
        num_layers=2,
        num_pages=6,
        page_size=4,
        latent_dim=576,
        max_seqs=2,
        max_pages_per_seq=3,
        dtype="fp8",
        fill_value=float("nan"),
    )
    assert np.isnan(fp8_values(c.pages)).all()
    table = np.array([[4, 1, 3], [0, 5, 2]], np.int32)
    lengths = np.array([9, 3], np.int32)
    pos = np.array([[6, 7, 8], [0, 1, 2]], np.int32)  # row 0 adds tokens 6..8, row 1 its first 3
    lat = (rng.standard_normal((2, 3, 576)) * 3).astype(np.float32)
    write = jax.jit(lambda kv, x, p: kv.at_layer(1).write(x, p))
    kv = write(KVCache.create(c.pages, table, lengths, page_format=c.page_format), jnp.asarray(lat), jnp.asarray(pos))
    pages = np.asarray(kv.pages)
    want = np.asarray(c.pages).copy()
    for b in range(2):
        for t in range(3):
            p = pos[b, t]
            want[1, table[b, p // 4], p % 4] = fp8_bytes(lat[b, t])
    np.testing.assert_array_equal(pages, want)  # layer 0 untouched, NaN rows elsewhere
    dense, kv_pos = kv.at_layer(1).gather(dtype=jnp.float32)
    dense = np.asarray(dense)
    assert dense.shape == (2, 12, 576) and dense.dtype == np.float32
    np.testing.assert_array_equal(dense[0, 6:9], fp8_values(fp8_bytes(lat[0])))
    np.testing.assert_array_equal(dense[1, :3], fp8_values(fp8_bytes(lat[1])))
    assert np.isnan(dense[0, :6]).all()  # never written, inside the length: NaN shows
    assert (dense[0, 9:] == 0).all() and (dense[1, 3:] == 0).all()  # past the length: zero, not NaN
    np.testing.assert_array_equal(np.asarray(kv_pos)[1], np.where(np.arange(12) < 3, np.arange(12), -1))
    with pytest.raises(ValueError, match="uint8 .fp8 / fp4. pages take encoded rows"):
        write_latents(kv.pages[0], jnp.asarray(lat), jnp.asarray(pos), jnp.asarray(table))


def test_the_interpreter_is_refused_on_a_pool_per_data_rank():
    """KVCache(impl="interpret") with data ranks: one line, before any step runs (jax 0.11.2's Mosaic GPU
    interpreter fails, 1 run in 8 on two CPU devices, when two devices run a kernel at once);
    "kernel" and "reference" are taken. Catches the refusal lost (a flaky CI) or applied to the compiled
    kernels too (data-parallel attention back on the jnp path on GPUs)."""
    from jax.sharding import AbstractMesh

    from mla_jax.kv_cache import KVCache
    from mla_jax.sharding import MESH_AXES

    dp = (AbstractMesh((2, 1, 1), MESH_AXES), ("data",))
    args = (jnp.zeros((1, 4, 64, 576), jnp.bfloat16), np.zeros((2, 2), np.int32), np.zeros(2, np.int32))
    with pytest.raises(
        ValueError,
        match=r"^KVCache impl='interpret' with a pool per data rank: the Pallas "
        r"interpreter cannot run a kernel on several devices at once",
    ):
        KVCache.create(*args, impl="interpret", data_parallel=dp)
    for impl in ("kernel", "reference"):
        assert KVCache.create(*args, impl=impl, data_parallel=dp).data_parallel == dp
