"""The decode kernel's query in one launch (`pallas_kernels.head_matmul.absorbed_query`: W_UK's product, q_pe's RoPE
and the rows padded as `mla_decode` takes them, Pallas Triton backend) against its jnp reference and the model's
own query: interpret mode on CPU, cross-lowered for sm_90, in a scanned model's decode step, and compiled on a
Hopper GPU."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax.config import ModelConfig
from mla_jax.rope import apply_rope, attention_factor, inv_frequencies, rope_cos_sin
from pallas_kernels.head_matmul import (
    absorbed_query,
    absorbed_query_problems,
    absorbed_query_reference,
    stacked_head_matmul_reference,
)
from pallas_kernels.mla_decode import QueryRows, mla_decode
from pallas_kernels.stacked_matmul import Partials
from tests.tiers import full, gpu_full

YARN = ModelConfig.deepseek_v2_lite()  # YaRN frequencies and attention factor, V2-Lite's R = 64
N, R, L, V = 128, 64, 512, 128


def _inputs(B, s_q, H, S, *, layers=3, seed=0, extra_rows=1):
    """The per-head query rows [B·s_q + extra, H·(N + R)] (bf16, or S fp32 split-K partials of them, rounded to bf16),
    a stack of `layers` wkv_b kernels [layers, L, H·(N + V)] (each layer's different), positions (the last of
    several negative: padding, rotated as 0), the frequencies and YaRN's factor."""
    k = jax.random.split(jax.random.key(seed), 3)
    M = B * s_q + extra_rows
    x = 2.0 * jax.random.normal(k[0], (S or 1, M, H * (N + R)), jnp.float32) / max(S, 1)
    q = Partials(x, (M, H * (N + R)), jnp.dtype(jnp.bfloat16)) if S else x[0].astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(k[1], (layers, L, H * (N + V)), jnp.float32)).astype(jnp.bfloat16)
    pos = np.array(jax.random.randint(k[2], (B, s_q), 1, 5000), np.int32)
    if B * s_q > 1:
        pos[-1, -1] = -1
    return q, w, jnp.asarray(pos), inv_frequencies(YARN), attention_factor(YARN)


def _f32(x):
    return np.asarray(x.rows if isinstance(x, QueryRows) else x, np.float32)


@pytest.mark.parametrize(
    "B, s_q, H, S, interleave",
    full(
        [
            (1, 1, 16, 4, True),  # a V2-Lite decode step: wq's 4 partials, one token
            (1, 3, 16, 0, False),  # a verify step's rows as an array, halves
            (2, 2, 16, 2, True),  # two sequences: the padded rows of each
            (1, 2, 64, 0, True),  # 64 heads: no padding at s_q = 1, one block a token
            (1, 1, 128, 3, False),  # 128 heads: two blocks of rows
        ],
        [(1, 1, 16, 4, True), (2, 2, 16, 2, True), (1, 3, 16, 0, False)],
        "the quick tier runs the one-token partials, two-sequence and verify-halves cases",
    ),
)
def test_interpret_equals_reference(B, s_q, H, S, interleave):
    """The kernel in the interpreter against `absorbed_query_reference` with W_UK of layer 1 of 3: every real row
    where `mla_decode` reads it (row t·H + h of its sequence), the padding rows zero. Catches a head or token written
    to another row, another layer's W_UK, the partials not summed, the rotary pairs' halves swapped or a sign, the
    padding rows left unwritten (garbage the decode kernel would attend with)."""
    q, w, pos, freqs, scale = _inputs(B, s_q, H, S)
    kw = dict(heads=H, nope=N, rope_scale=scale, interleave=interleave)
    got = absorbed_query(q, w, jnp.int32(1), pos, freqs, impl="interpret", **kw)
    want = absorbed_query_reference(q, w, jnp.int32(1), pos, freqs, **kw)
    Rp = QueryRows.padded(s_q, H)
    assert got.rows.shape == want.rows.shape == (B, Rp, L + R) and got.rows.dtype == jnp.bfloat16
    assert (got.s_q, got.heads) == (s_q, H)
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=1e-2, atol=1e-2)  # a bf16 step apart at most
    assert not _f32(got)[:, s_q * H :].any()


def test_reference_is_the_models_query():
    """The reference's rows are the query `MLA.absorb_query` made before the kernel: q_nope · W_UK (the stack's
    layer, `stacked_head_matmul_reference`) rounded to q's dtype, then q_pe rotated by `rope_cos_sin` of the
    positions clamped at 0 (`apply_rope`), concatenated, bf16; laid out as rows t·H + h and zero-padded to 64.
    Catches a reference (and so a kernel) whose arithmetic drifted from the model's."""
    B, s_q, H = 2, 2, 16
    q, w, pos, freqs, scale = _inputs(B, s_q, H, 2)
    got = absorbed_query_reference(q, w, jnp.int32(2), pos, freqs, heads=H, nope=N, rope_scale=scale)
    x = q.total()[: B * s_q].reshape(B, s_q, H, N + R)
    q_lat = stacked_head_matmul_reference(
        x[..., :N].reshape(-1, H, N), w, jnp.int32(2), col_offset=0, contract_rows=False
    )
    cos, sin = rope_cos_sin(YARN, jnp.maximum(pos, 0))
    query = jnp.concatenate([q_lat.reshape(B, s_q, H, L).astype(x.dtype), apply_rope(x[..., N:], cos, sin)], -1)
    np.testing.assert_array_equal(_f32(got.unpadded()), np.asarray(query.astype(jnp.bfloat16), np.float32))
    rows = _f32(got)
    np.testing.assert_array_equal(rows[:, : s_q * H], np.asarray(query, np.float32).reshape(B, s_q * H, L + R))
    assert rows.shape == (B, 64, L + R) and not rows[:, s_q * H :].any()


def test_the_decode_kernel_takes_query_rows_as_the_query_they_pad():
    """`mla_decode` given `QueryRows` attends as given the query they hold (interpret kernel and reference), and
    refuses rows of the wrong count in one line. Catches the kernel padding the rows again (misreading them) or the
    reference reading the padded rows as tokens."""
    B, s_q, H = 2, 2, 16
    k = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(k[0], (B, s_q, H, L + R), jnp.float32).astype(jnp.bfloat16)
    pages = jax.random.normal(k[1], (6, 64, L + R), jnp.float32).astype(jnp.bfloat16)
    table, lens = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32), jnp.asarray([70, 150], jnp.int32)
    kw = dict(softmax_scale=0.07, causal=True)
    for impl in ("interpret", "reference"):
        want = mla_decode(q, pages, table, lens, impl=impl, **kw)
        got = mla_decode(QueryRows.of(q), pages, table, lens, impl=impl, **kw)
        chex.assert_trees_all_close(got, want, rtol=0, atol=0)
    short = QueryRows(QueryRows.of(q).rows[:, :48], s_q, H)
    with pytest.raises(ValueError, match=r"^QueryRows of s_q=2, H=16 need 64 rows, got 48$"):
        mla_decode(short, pages, table, lens, **kw)


def test_what_it_cannot_serve_is_one_line_each():
    """Rows past one 16-row tile, widths off its loads: one line each; "interpret" refuses naming the problem; bad
    shapes are refused naming the value."""
    assert absorbed_query_problems(4, 1, 16, N, R, L) == []
    assert absorbed_query_problems(5, 1, 16, N, R, L) == [
        "B·4 = 20 padded query rows a head: more than one 16-row tile"
    ]
    assert absorbed_query_problems(1, 1, 16, 96, R, L) == [
        "N = 96 nope columns is not a power of two >= 16 (one dot's contraction)"
    ]
    assert absorbed_query_problems(1, 1, 16, N, 24, L) == [
        "R = 24 rotary columns is not twice a power of two (a load a half)"
    ]
    assert absorbed_query_problems(1, 1, 16, N, R, 528) == ["L = 528 latent columns is not a multiple of 32"]
    q, w, pos, freqs, _ = _inputs(5, 1, 16, 0)
    with pytest.raises(ValueError, match=r"^absorbed_query impl='interpret': the kernels cannot serve this: B·4 = 20"):
        absorbed_query(q, w, 0, pos, freqs, heads=16, nope=N, impl="interpret")
    with pytest.raises(ValueError, match=r"^absorbed_query: q must be rows \[>= B·s_q = 5, H·\(N \+ R\) = 3072\]"):
        absorbed_query(q[:, :3000], w, 0, pos, freqs, heads=16, nope=N)
    wide = jnp.zeros((5, 32 * (192 + R)), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^absorbed_query: w's 4096 columns do not hold H = 32 heads of >= N = 192"):
        absorbed_query(wide, w, 0, pos, freqs, heads=32, nope=192)


@pytest.mark.parametrize("B, s_q, S", [(1, 1, 4), (1, 2, 0)])
def test_cross_lowers_for_sm90(B, s_q, S):
    """Traced and lowered for an H100 on a CPU host at V2-Lite's shapes (16 heads, 27 layers of wkv_b; one token from
    wq's 4 partials, a verify step's two as bf16 rows): one Triton call and no XLA pad, concatenation or reduction
    beside it (catches an op the Triton lowering refuses, or the rope or the padding left to XLA)."""
    from jax._src import mesh as mesh_lib

    H = 16
    freqs, scale = inv_frequencies(YARN), attention_factor(YARN)

    def f(x, w, layer, pos):
        q = Partials(x, (B * s_q, H * (N + R)), jnp.dtype(jnp.bfloat16)) if S else x
        return absorbed_query(q, w, layer, pos, freqs, heads=H, nope=N, rope_scale=scale, impl="kernel").rows

    x = ((S, 8, H * (N + R)), jnp.float32) if S else ((B * s_q, H * (N + R)), jnp.bfloat16)
    args = [x, ((27, L, H * (N + V)), jnp.bfloat16), ((), jnp.int32), ((B, s_q), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in args]
    h100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h100)):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    for op in ("stablehlo.pad", "stablehlo.concatenate", "stablehlo.reduce"):
        assert op not in text, op


def test_a_decode_step_on_bf16_pages_makes_its_query_in_one_launch():
    """A scanned model's decode step of two rows on bf16 pages of 64 tokens, interpret backend: each layer's query
    comes from one `absorbed_query` call (one a stack's scan body) reading W_UK out of the whole stack, and the
    step's logits equal the reference backend's (the query by XLA: W_UK's product, the rope, the concatenation, the
    padding). Catches the kernel fed another layer's W_UK (each layer's differ), the positions or the partials of
    another row, and the path not taken."""
    from micro_configs import narrow_v2_lite

    from mla_jax.kv_cache import KVCache
    from models import DeepSeekModel, Engine

    cfg = narrow_v2_lite(3).replace(hidden_size=128, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=8)
    cfg = cfg.replace(num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(2))
    e = Engine(model, page_size=64, num_pages=4, max_batch=2, kv_dtype=jnp.bfloat16)
    B, S = 2, 70
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (B, S)), jnp.int32)
    table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    fwd = jax.jit(lambda ids, positions, cache: model(ids, positions, cache=cache))
    cache = KVCache.create(e.cache.pages, table, jnp.full((B,), S - 1, jnp.int32))  # lengths after the writes
    _, cache = fwd(ids[:, :-1], jnp.broadcast_to(jnp.arange(S - 1), (B, S - 1)), cache)  # by the reference backend
    out = {}
    for impl in ("interpret", "reference"):
        step = KVCache.create(cache.pages, table, jnp.full((B,), S, jnp.int32), impl=impl)
        last = (ids[:, -1:], jnp.full((B, 1), S - 1, jnp.int32), step)
        out[impl] = fwd(*last)[0], str(jax.make_jaxpr(fwd)(*last))
    (got, jaxpr), (want, ref_jaxpr) = out["interpret"], out["reference"]
    assert jaxpr.count("name=absorbed_query") == 2 and ref_jaxpr.count("name=absorbed_query") == 0
    chex.assert_trees_all_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", gpu_full(["v2_lite", "verify", "v3"], ["v2_lite", "verify"]))
def test_gpu_kernel_equals_the_reference(name):
    """The compiled kernel against the jnp reference at V2-Lite's widths: a B = 1 decode step (wq's 4 partials), a
    verify step of 3 tokens (rows); V3's 128 heads at one token."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    B, s_q, H, S = {"v2_lite": (1, 1, 16, 4), "verify": (1, 3, 16, 0), "v3": (1, 1, 128, 0)}[name]
    q, w, pos, freqs, scale = _inputs(B, s_q, H, S, layers=27)
    kw = dict(heads=H, nope=N, rope_scale=scale, interleave=True)
    got = jax.jit(lambda w, i: absorbed_query(q, w, i, pos, freqs, impl="kernel", **kw).rows)(w, jnp.int32(26))
    want = absorbed_query_reference(q, w, jnp.int32(26), pos, freqs, **kw)
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=1e-2, atol=1e-2)
    assert not _f32(got)[:, s_q * H :].any()
