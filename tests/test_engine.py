"""The generation engine against the full forward pass (teacher forcing), MTP speculation against
plain greedy, chunked against one-shot prefill, cache pressure, bad input, compile counts.

Every engine here uses a float32 cache (bit-comparable to the float32 model) and, unless a test
says otherwise, the same shapes (page 4, 64 pages, 4 slots), so that the steps compile once for
the module: the jitted steps are shared by engines over equal model structures and pool shapes.
"""

import collections
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import ModelConfig
from mla_jax.cache_paths import SEQ_LENS_SCOPE, with_decode_plan
from mla_jax.kv_cache import CacheFullError, KVCache, write_latents
from models import DeepSeekModel
from models.serving.engine import Engine, GenerationResult, trace_counts
from models.serving.sampling import SamplingParams
from pallas_kernels.mla_decode import (
    SCHEDULE_SCOPE,
    AutoSchedule,
    MlaDecodeConfig,
    PieceSchedule,
    mla_decode_schedule,
)
from tests.tiers import full
from tests.xla_opt import optimized

CFG = ModelConfig.tiny().replace(num_hidden_layers=2)  # one dense layer, one MoE layer, one MTP module
STD = dict(page_size=4, num_pages=64, max_batch=4, prefill_chunk=8, kv_dtype=jnp.float32)
# The MTP verify loop's shapes (a 40-token context, 3 steps a call): the sampled-MTP tests and the context-limit
# test run engines of these shapes too, so that their steps (greedy and sampled) compile once for the module.
LOOP = {**STD, "max_context": 40, "decode_steps": 3}
# One slot, 8 steps a call: the late-verify-call test's shapes, shared by the MTP prefill-state test.
ONE_SLOT = {**STD, "max_batch": 1, "decode_steps": 8}


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, CFG.vocab_size, n)] for n in lengths]


@functools.partial(jax.jit, static_argnums=0)
def _forward_argmax(graphdef, state, ids_BT):
    return jnp.argmax(nnx.merge(graphdef, state)(ids_BT), axis=-1)


def _full_argmax(model, seqs, width=128) -> np.ndarray:
    """argmax of the full forward (decompressed attention, no cache) of each sequence, right-padded to one
    shape (causal: padding after a token cannot change it) -> [len(seqs), width]."""
    ids = np.zeros((8, width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    return np.asarray(_forward_argmax(*nnx.split(model), jnp.asarray(ids)))[: len(seqs)]


def _assert_teacher_forced(model, prompts, outs) -> None:
    """Each generated token is the argmax of the full forward over the prompt + the tokens before it."""
    am = _full_argmax(model, [p + o for p, o in zip(prompts, outs)])
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert am[i, len(p) - 1 : len(p) + len(o) - 1].tolist() == o, f"request {i}"


@pytest.fixture(scope="module")
def model():
    return DeepSeekModel(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def spec_model():
    """A model whose MTP drafts are often, not always, right: a strong bigram LM head (token a ->
    perm[a]) that the MTP module reproduces from its embedding input, with attention scaled up so
    that context overrides the bigram now and then (a rejected draft)."""
    m = DeepSeekModel(CFG, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    V, D = CFG.vocab_size, CFG.hidden_size
    emb = rng.normal(size=(V, D)).astype(np.float32)
    inv = np.argsort(rng.permutation(V))
    m.embed_tokens.embedding[...] = jnp.asarray(emb)
    m.lm_head.kernel[...] = jnp.asarray(emb[inv].T * 0.1)
    m.mtp[0].eh_proj.kernel[...] = jnp.asarray(np.concatenate([np.eye(D), np.zeros((D, D))]).astype(np.float32))
    for stack in (m.dense_layers, m.moe_layers):  # every main layer (the stacks' leading axis)
        stack.self_attn.wo.kernel[...] = stack.self_attn.wo.kernel[...] * 110.0
    return m


@pytest.fixture(scope="module")
def engine(model):
    # NaN in never-written cache rows: a masked row that leaked into attention would show.
    return Engine(model, **STD, cache_fill=float("nan"))


@pytest.fixture(scope="module")
def wide_engine(spec_model):
    """Room for 64 requests a step: the distribution tests' 2000 requests (full tier) take few steps."""
    return Engine(spec_model, **{**STD, "max_batch": 64, "num_pages": 256})


# --- equivalence with the full forward -----------------------------------------------------------
def test_greedy_matches_teacher_forcing_ragged(engine, model):
    # 6 prompts > 4 slots (continuous batching), ragged, crossing page boundaries (page 4).
    prompts = _prompts(0, [1, 3, 9, 14, 5, 6])
    streamed = {}
    res = engine.generate(prompts, max_new_tokens=9, stream=lambda i, t: streamed.setdefault(i, []).append(t))
    assert isinstance(res, GenerationResult)
    assert [len(t) for t in res.tokens] == [9] * 6
    assert res.finish_reasons == ["length"] * 6 and res.errors == [None] * 6
    _assert_teacher_forced(model, prompts, res.tokens)
    assert [streamed[i] for i in range(6)] == res.tokens
    st = res.stats
    assert st["prefill_tokens"] == sum(map(len, prompts)) and st["decode_tokens"] == 6 * 8
    assert st["prefill_tok_s"] > 0 and st["decode_tok_s"] > 0 and st["mtp_acceptance"] is None
    assert 0 < st["pages_used_peak"] <= STD["num_pages"]
    assert engine.cache.pages_used == 0  # every page went back to the pool


def test_greedy_matches_teacher_forcing_page64(model):
    e = Engine(model, page_size=64, num_pages=8, max_batch=2, prefill_chunk=64, kv_dtype=jnp.float32)
    prompts = _prompts(1, [70, 5])  # the first spans two pages, the second crosses none
    res = e.generate(prompts, max_new_tokens=6)
    _assert_teacher_forced(model, prompts, res.tokens)


def test_bf16_cache_stays_close(model):
    """The default bf16 page format: the first token's logits-argmax still match the fp32 model
    on most requests (bf16 rounding of the latent may flip near-ties, so this is a smoke check)."""
    e = Engine(model, page_size=4, num_pages=64, max_batch=4, prefill_chunk=8)
    assert e.cache.dtype == jnp.bfloat16
    prompts = _prompts(2, [3, 9, 14, 5])
    res = e.generate(prompts, max_new_tokens=1)
    am = _full_argmax(model, prompts)
    ref = [int(am[i, len(p) - 1]) for i, p in enumerate(prompts)]
    assert sum(a == [b] for a, b in zip(res.tokens, ref)) >= 3


def test_stop_tokens_and_streaming(engine):
    prompts = _prompts(3, [4, 7])
    base = engine.generate(prompts, max_new_tokens=8).tokens
    stop = base[0][2]
    seen = []
    res = engine.generate(prompts, max_new_tokens=8, stop_tokens=(stop,), stream=lambda i, t: seen.append((i, t)))
    cut = base[0].index(stop) + 1
    assert res.tokens[0] == base[0][:cut] and res.finish_reasons[0] == "stop"
    if stop in base[1]:
        assert res.tokens[1] == base[1][: base[1].index(stop) + 1]
    else:
        assert res.tokens[1] == base[1] and res.finish_reasons[1] == "length"
    for i in range(2):
        assert [t for j, t in seen if j == i] == res.tokens[i]


def test_max_context_ends_a_sequence(model):
    e = Engine(model, **LOOP)  # max_context 40; the verify loop's shapes, whose plain steps are compiled
    res = e.generate(_prompts(4, [37, 40]), max_new_tokens=8)
    # Tokens at positions 37..40 for the first (40 = max_context cannot be fed back), one for the second.
    assert [len(t) for t in res.tokens] == [4, 1]
    assert res.finish_reasons == ["context", "context"]


# --- MTP speculative decoding ----------------------------------------------------------------------
# k = 1 (one draft) and k = 3 (a chain: the middle draft is both drafted from a draft and drafts the next);
# k = 2 runs the same code with a shorter chain; dropped for the suite's time (24 + 9 s of CPU).
@pytest.mark.parametrize(
    "k",
    full(
        (1, 3),
        (),
        "test_interpret_kernels_match_reference: greedy with MTP (k = 3, a chain) through the kernels gives plain "
        "greedy's tokens",
    ),
)
def test_mtp_greedy_equals_plain_greedy(spec_model, k):
    """k drafts a step (k > 1 chains the MTP module), verified with s_q = k + 1."""
    e = Engine(spec_model, **STD)
    prompts = _prompts(5, [3, 9, 14, 5, 1, 6])
    plain = e.generate(prompts, max_new_tokens=20)
    held = []

    def check_pages(i, t):  # after every step: rewound slots hold exactly the pages their length needs
        c = e.cache
        held.append(all(len(c.pages_of(b)) == c.pages_for(int(c.lengths[b])) for b in range(c.max_seqs)))

    spec = e.generate(prompts, max_new_tokens=20, use_mtp=True, mtp_draft_tokens=k, stream=check_pages)
    assert held and all(held)
    assert spec.tokens == plain.tokens
    _assert_teacher_forced(spec_model, prompts, spec.tokens)
    st = spec.stats
    # Some drafts accepted, some rejected (and rewound): both paths of the verify step ran.
    assert 0 < st["mtp_accepted"] < st["mtp_drafted"] <= k * st["decode_steps"] * len(prompts), st
    assert st["decode_steps"] < plain.stats["decode_steps"]
    # The accepted count against what one request's output shows: each verify step emits its t_n plus
    # the drafts it accepted (the last step may be cut by max_new_tokens, by at most k tokens).
    one = e.generate(prompts[:1], max_new_tokens=20, use_mtp=True, mtp_draft_tokens=k).stats
    by_decode = 20 - 1  # the prefill emitted the first token
    assert by_decode - one["decode_steps"] <= one["mtp_accepted"] <= by_decode - one["decode_steps"] + k, one
    assert e.cache.pages_used == 0
    print(
        f"k={k}: MTP acceptance {st['mtp_acceptance']:.3f} ({st['mtp_accepted']}/{st['mtp_drafted']}), "
        f"decode steps {st['decode_steps']} vs {plain.stats['decode_steps']}"
    )


# --- the lane: each call enqueued before the one before it is read ---------------------------------------
def _sync_generate(e: Engine, prompts, **kw) -> list[list[int]]:
    """The prompts through the online API with every call read back before the next is launched."""
    hs = [e.submit(p, **kw) for p in prompts]
    while e.num_requests:
        e.step()
        e._sched.drain()
    return [h.output for h in hs]


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_overlapped_calls_give_the_tokens_of_synchronous_ones(model, decode_steps):
    """Six ragged prompts on four slots, one stop id that ends one request early (a waiting one then takes its
    slot): the overlapped engine (call n + 1 enqueued before call n is read, tokens fed back on the device) and
    the same engine read back after every call give the same greedy tokens, equal to teacher forcing, with every
    page back. Catches: a row fed another slot's token or a stale one from the lane, a position off by the call
    in flight, a late stop whose extra token is emitted, a slot reused before its old call's writes."""
    e = Engine(model, **STD, decode_steps=decode_steps, cache_fill=float("nan"))
    prompts = _prompts(31, [3, 9, 14, 5, 1, 6])
    free = e.generate(prompts, max_new_tokens=18).tokens
    stop = free[1][4]
    want = [t[: t.index(stop) + 1] if stop in t else t for t in free]
    overlapped = e.generate(prompts, max_new_tokens=18, stop_tokens=[stop]).tokens
    assert overlapped == want and _sync_generate(e, prompts, max_new_tokens=18, stop_tokens=[stop]) == want
    _assert_teacher_forced(model, prompts, free)
    e.run_until_idle()
    assert e.cache.pages_used == 0


def test_a_stop_found_one_call_late_returns_its_pages_and_spares_the_others(model):
    """Row 0 samples a stop token; the next call, already enqueued, computes one more token for it. After the
    step that reads the stop: the request holds its tokens up to the stop (the extra one dropped), its slot and
    pages are free, and the other rows' tokens go on equal to their runs alone; a request admitted into the freed
    slot runs beside the call that still carries the old row. Catches: the dropped token emitted, the pages held
    until the extra call lands (or freed before the call that reads them was enqueued), the new occupant
    reading the old row's lane entry."""
    e = Engine(model, **STD, cache_fill=float("nan"))  # the `engine` fixture's shapes: its steps compiled
    p0, p1, p2 = _prompts(32, [4, 6, 5])
    alone = [e.generate([p], max_new_tokens=12).tokens[0] for p in (p0, p1, p2)]
    stop = alone[0][2]
    cut0 = alone[0][: alone[0].index(stop) + 1]
    h0, h1 = e.submit(p0, max_new_tokens=12, stop_tokens=[stop]), e.submit(p1, max_new_tokens=12)
    while not h0.done:
        e.step()
    assert h0.output == cut0 and h0.finish_reason == "stop"
    assert e.cache.pages_of(0) == [] and e._sched.slots[0] is None
    assert e._sched.flight is not None and 0 in e._sched.flight.rows  # the call one step late, still in flight
    h2 = e.submit(p2, max_new_tokens=12)
    e.step()
    assert e._sched.slots[0] is not None and e._sched.slots[0].req == h2.id  # the freed slot, the first free
    e.run_until_idle()
    assert h0.output == cut0 and h1.output == alone[1] and h2.output == alone[2]
    assert e.cache.pages_used == 0


def test_cancel_while_iterating_ends_the_iterator_at_once(model):
    """Reading a request's tokens three at a time out of 4-step calls, a cancel after the third: the iterator
    ends there, even though its call already brought more. Catches the iterator yielding the rest of a landed
    call after a cancel (it yielded up to 9 tokens after reading 3)."""
    e = Engine(model, **STD, decode_steps=4)
    h = e.submit(_prompts(34, [5])[0], max_new_tokens=30)
    it = h.tokens()
    got = [next(it) for _ in range(3)]
    assert h.cancel() and h.finish_reason == "cancelled"
    assert list(it) == [] and h.output[:3] == got
    e.run_until_idle()
    assert e.cache.pages_used == 0


def test_mtp_verify_loop_equals_plain_greedy_and_warm_up_covers_it(spec_model):
    """MTP with 2 drafts a step and 3 verify steps a device call (`models.serving.steps.verify_call`: positions,
    lengths and the drafts verified found on the device), overlapped, after `warm_up(use_mtp=True)`: the tokens
    of plain greedy (with a stop id ending one request early and length budgets that end others mid-call), no
    compilation, every page back. Catches: a verify step past a row's budget or context (end_B), a draft
    accepted past a stop, an acceptance count that moves the lane's position wrongly, a verify shape warm-up
    misses."""
    e = Engine(spec_model, **LOOP)
    prompts = _prompts(35, [3, 9, 14, 5, 1, 6])
    news = [20, 7, 13, 20, 2, 16]
    plain = [e.generate([p], max_new_tokens=n).tokens[0] for p, n in zip(prompts, news)]
    stop = plain[0][6]
    want = [t[: t.index(stop) + 1] if stop in t else t for t in plain]
    assert e.warm_up(use_mtp=True, mtp_draft_tokens=2) > 0
    before = trace_counts()
    hs = [
        e.submit(p, max_new_tokens=n, stop_tokens=[stop], use_mtp=True, mtp_draft_tokens=2)
        for p, n in zip(prompts, news)
    ]
    with e.recording(use_mtp=True) as st:
        e.run_until_idle()
    assert [h.output for h in hs] == want
    assert trace_counts() == before, "a call compiled after warm_up"
    assert 0 < st.mtp_accepted < st.mtp_drafted and e.cache.pages_used == 0


def test_mtp_rejection_sampling_path_with_one_hot_distributions(spec_model):
    """temperature 1 with top_k = 1 runs the sampling code (rejection sampling, residual and bonus
    draws, per-position keys) on one-hot p and q, where its result is known: the greedy tokens.
    (The verify loop's shapes: its greedy steps, and the sampled ones of the test below, compile once.)"""
    prompts = _prompts(5, [3, 9, 14, 5, 1, 6])
    e = Engine(spec_model, **LOOP)
    greedy = e.generate(prompts, max_new_tokens=10)
    res = e.generate(
        prompts,
        max_new_tokens=10,
        use_mtp=True,
        mtp_draft_tokens=2,
        sampling=SamplingParams(temperature=1.0, top_k=1, seed=5),
    )
    assert res.tokens == greedy.tokens
    assert 0 < res.stats["mtp_accepted"] < res.stats["mtp_drafted"]


def test_sampled_generation_reproduces_and_ignores_batching(spec_model):
    """temperature > 0 with MTP (rejection sampling, 2 drafts a step: the steps of the test above): a
    seed reproduces, and a request's tokens do not depend on which other requests share its batch (the
    keys fold in positions, not slots; five requests on four slots: the fifth runs in another slot beside
    other rows)."""
    e = Engine(spec_model, **LOOP)
    mtp = dict(use_mtp=True, mtp_draft_tokens=2)
    prompts = _prompts(6, [3, 9, 5, 6, 2])
    sp = SamplingParams(temperature=0.9, top_k=40, seed=3)
    a = e.generate(prompts, max_new_tokens=6, sampling=sp, **mtp)
    b = e.generate(prompts, max_new_tokens=6, sampling=sp, **mtp)
    assert a.tokens == b.tokens
    assert all(0 <= t < CFG.vocab_size for out in a.tokens for t in out)
    per_request = [SamplingParams(temperature=0.9, top_k=40, seed=100 + i) for i in range(len(prompts))]
    together = e.generate(prompts, max_new_tokens=6, sampling=per_request, **mtp).tokens
    alone = [
        e.generate([p], max_new_tokens=6, sampling=[s], **mtp).tokens[0] for p, s in zip(prompts[:2], per_request[:2])
    ]
    assert together[:2] == alone
    c = e.generate(prompts, max_new_tokens=6, sampling=SamplingParams(temperature=0.9, top_k=40, seed=4), **mtp)
    assert c.tokens != a.tokens
    assert 0.0 <= a.stats["mtp_acceptance"] <= 1.0


def _layer_cache(pool_NGC, table, lengths, absorbed: bool) -> KVCache:
    """A one-layer cache over `pool` whose threshold makes T-token chunks take the asked-for path."""
    return KVCache.create(
        pool_NGC[None], table, lengths, impl="reference", decompressed_threshold=1000 if absorbed else 1
    )


@pytest.mark.parametrize("absorbed", [True, False])
def test_bf16_cache_attention_within_design_tolerance(model, absorbed):
    """The default bf16 page format, one cached attention step against the fp32 forward of the
    layer: ||out - ref|| / ||ref|| < 1e-2 (DESIGN.md's bound for bf16 paths)."""
    mla = model.layer(1).self_attn
    B, S, T, G, N = 2, 13, 3, 4, 16
    x = jax.random.normal(jax.random.PRNGKey(3), (B, S + T, CFG.hidden_size), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(S + T, dtype=jnp.int32), (B, S + T))
    table = jnp.asarray(np.random.default_rng(3).permutation(N)[: B * 5].reshape(B, 5).astype(np.int32))
    pool = jnp.full((N, G, CFG.latent_dim), jnp.nan, jnp.bfloat16)
    # jitted: one compile a call instead of one an op
    pool = write_latents(
        pool, nnx.jit(lambda m, x, p: m.project_kv(x, p))(mla, x[:, :S], pos[:, :S]), pos[:, :S], table
    )
    assert pool.dtype == jnp.bfloat16
    out, cache = nnx.jit(lambda m, x, p, c: m(x, p, cache=c))(
        mla, x[:, S:], pos[:, S:], _layer_cache(pool, table, jnp.full((B,), S + T, jnp.int32), absorbed)
    )
    assert cache.pages.dtype == jnp.bfloat16
    want = nnx.jit(lambda m, x, p: m(x, p))(mla, x, pos)[:, S:]
    rel = float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))
    assert 0 < rel < 1e-2, rel


# --- one cached attention step against the layer's own forward -------------------------------------
@pytest.mark.parametrize("absorbed", [True, False])
def test_cached_attention_equals_mla_forward(model, absorbed):
    """Writing a chunk into a (NaN-poisoned, permuted) paged cache that already holds the prefix and
    attending over it gives MLA's full causal forward of prefix + chunk, for both paths."""
    import chex

    mla = model.layer(0).self_attn
    B, S, T, G, N = 2, 11, 5, 4, 16
    x = jax.random.normal(jax.random.PRNGKey(0), (B, S + T, CFG.hidden_size), jnp.float32)
    lens = np.array([S + T, S + 2])  # row 1: a shorter sequence whose chunk ends in padding
    pos = np.where(np.arange(S + T)[None] < lens[:, None], np.arange(S + T)[None], -1).astype(np.int32)
    table = np.random.default_rng(0).permutation(N)[: 2 * 5].reshape(B, 5).astype(np.int32)
    pool = jnp.full((N, G, CFG.latent_dim), jnp.nan, jnp.float32)
    pool = write_latents(
        pool, mla.project_kv(x[:, :S], jnp.maximum(pos[:, :S], 0)), jnp.asarray(pos[:, :S]), jnp.asarray(table)
    )
    step = jax.jit(lambda cache, x, pos: mla(x, pos, cache=cache))
    out, cache = step(
        _layer_cache(pool, table, jnp.asarray(lens, jnp.int32), absorbed), x[:, S:], jnp.asarray(pos[:, S:])
    )
    want = jax.jit(lambda x, pos: mla(x, pos))(x, jnp.asarray(pos))[:, S:]
    chex.assert_trees_all_close(out[0], want[0], rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(out[1, :2], want[1, :2], rtol=1e-5, atol=1e-5)  # its valid tokens
    assert not np.isnan(np.asarray(out)).any()
    # The chunk's latents landed in the rows of its pages (padding wrote nothing).
    rows = np.asarray(cache.pages[0])[table[0]].reshape(-1, CFG.latent_dim)[S : S + T]
    np.testing.assert_allclose(
        rows, np.asarray(mla.project_kv(x[:1, S:], jnp.asarray(pos[:1, S:])))[0], rtol=1e-6, atol=1e-6
    )


# The distribution tests: many requests of one prompt (per-request keys).
DIST_N = 2000
DIST_PROMPT = _prompts(16, [6])[0]
DIST_SAMPLING = SamplingParams(temperature=1.0, top_k=3, seed=31)  # 3 outcomes a token: well sampled


@pytest.fixture(scope="module")
def plain_draws(wide_engine):
    """The first three new tokens of DIST_N requests sampled without MTP."""
    with optimized():  # many steps (see the xla_optimized marker)
        return wide_engine.generate([DIST_PROMPT] * DIST_N, max_new_tokens=3, sampling=DIST_SAMPLING).tokens


@pytest.mark.xla_optimized  # 2000 requests a case
# k = 2: the same chain code as k = 3, shorter (see above); k = 1 and 3 in the full tier (tests/tiers.py)
@pytest.mark.parametrize(
    "k",
    full(
        (1, 3),
        (),
        "tests/test_sampling.py's rejection-sampling distribution (the acceptance rule and its residual, 200 000 "
        "draws) and test_mtp_rejection_sampling_path_with_one_hot_distributions (the engine's chain through it)",
    ),
)
def test_mtp_sampling_keeps_the_output_distribution(wide_engine, plain_draws, k):
    """With temperature > 0, accepting drafts by rejection sampling (k > 1: a prefix of the MTP
    module's chain on its own drafts) must keep plain sampling's distribution: the joint
    frequencies of the first two new tokens (the first verified one: an accepted draft or the
    residual replacement) and of the first three (9 and 27 outcomes, DIST_N requests) agree with
    plain sampling's, and MTP never produces an outcome that plain sampling makes rare."""
    spec = wide_engine.generate(
        [DIST_PROMPT] * DIST_N,
        max_new_tokens=3,
        sampling=dataclasses.replace(DIST_SAMPLING, seed=32 + k),
        use_mtp=True,
        mtp_draft_tokens=k,
    )
    assert 0 < spec.stats["mtp_accepted"] < spec.stats["mtp_drafted"]  # accept and reject both ran
    assert all(len(t) == 3 for t in spec.tokens)

    def freq(tokens, width):
        c = collections.Counter(tuple(t[:width]) for t in tokens)
        return {key: v / DIST_N for key, v in c.items()}

    for width in (2, 3):
        fp, fs = freq(plain_draws, width), freq(spec.tokens, width)
        assert len(fp) <= 3**width
        assert all(fs[key] < 0.01 for key in set(fs) - set(fp)), (width, fp, fs)
        worst = max(abs(fp.get(key, 0.0) - fs.get(key, 0.0)) for key in set(fp) | set(fs))
        # each difference of two frequencies has std <= sqrt(2 * 0.25 / 2000) = 0.016; bugs in the
        # acceptance rule moved k = 1 frequencies by 0.09-0.33 in a mutation check, and a
        # replacement drawn from max(p - q/2, 0) instead of the residual by 0.061-0.064 (every k)
        assert worst < 0.06, (k, width, worst, fp, fs)


# --- chunked prefill -------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk, threshold", [(5, 1000), (16, 1000), (5, 1), (16, 1), (32, 1)])
def test_chunked_prefill_equals_one_shot(model, chunk, threshold):
    """Prefill in chunks (absorbed path; decompressed with threshold 1) = one absorbed chunk.

    A fresh pool hands out pages from id 0 in order, so the prompt's latents of every layer sit in
    the same rows in both runs and can be compared directly, as well as the generated tokens."""
    prompt = _prompts(7, [27])

    def run(c, t):
        e = Engine(model, **{**STD, "prefill_chunk": c, "decompressed_threshold": t})
        res = e.generate(prompt, max_new_tokens=3)
        rows = [np.asarray(p).reshape(-1, CFG.latent_dim)[:27] for p in e.cache.pages]
        return res, rows

    ref, ref_rows = run(32, 1000)
    got, rows = run(chunk, threshold)
    assert got.tokens == ref.tokens
    assert got.stats["prefill_steps"] == -(-27 // chunk)
    for a, b in zip(rows, ref_rows):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


# --- cache pressure --------------------------------------------------------------------------------
@pytest.mark.parametrize("decode_steps", [1, 8])
def test_out_of_pages_fails_one_request_and_spares_the_others(model, decode_steps):
    """Three requests need 17 pages, the pool has 11: the middle one fails alone, the others' tokens are those
    they make alone; with 8 decode steps a call (pages reserved for them up front, one step's worth when short)
    as with one."""
    small = {**STD, "num_pages": 11, "max_context": 64, "decode_steps": decode_steps}
    a_b = _prompts(8, [2, 3])
    greedy_c = _prompts(9, [12])
    e = Engine(model, **small)
    alone = e.generate(a_b, max_new_tokens=16)
    assert alone.errors == [None, None]
    mixed = e.generate([a_b[0], greedy_c[0], a_b[1]], max_new_tokens=16)
    assert mixed.errors[0] is None and mixed.errors[2] is None
    assert mixed.tokens[0] == alone.tokens[0] and mixed.tokens[2] == alone.tokens[1]
    assert mixed.finish_reasons[1] == "error"
    assert "KV cache full" in mixed.errors[1] and "free" in mixed.errors[1]
    assert 0 < len(mixed.tokens[1]) < 16  # it ran, then stopped where the pool ran out
    assert mixed.stats["failed"] == 1 and mixed.stats["pages_used_peak"] == 11
    assert e.cache.pages_used == 0
    with pytest.raises(CacheFullError, match="KV cache full") as err:
        e.generate([a_b[0], greedy_c[0], a_b[1]], max_new_tokens=16, on_cache_full="raise")
    assert err.value.pages_needed >= 1 and err.value.pages_free == 0
    assert err.value.partial_result.tokens[1] == mixed.tokens[1]
    assert err.value.partial_result.errors[1] == str(err.value)
    assert e.cache.pages_used == 0  # the aborted call left no page reserved
    # ... and the engine still serves the same requests identically afterwards.
    assert e.generate(a_b, max_new_tokens=16).tokens == alone.tokens


def test_a_throwing_stream_callback_frees_every_page(engine):
    def stream(i, t):
        if i == 1:
            raise KeyboardInterrupt  # e.g. the user stops a stream

    with pytest.raises(KeyboardInterrupt):
        engine.generate(_prompts(15, [3, 6, 9]), max_new_tokens=4, stream=stream)
    assert engine.cache.pages_used == 0


def test_prompt_larger_than_the_pool_fails_alone(model):
    # 44 tokens of pool: the shapes of the out-of-pages test (decode_steps 1), whose steps are compiled
    e = Engine(model, **{**STD, "num_pages": 11, "max_context": 64})
    res = e.generate(_prompts(10, [60, 3]), max_new_tokens=2)
    assert res.finish_reasons[0] == "error" and "needs 15 more page(s)" in res.errors[0]
    assert res.errors[1] is None and len(res.tokens[1]) == 2


def test_admission_goes_to_a_data_rank_with_pages():
    """The scheduler over a pool per data rank (2 ranks of 2 slots and 4 pages of 4 tokens; host only, no
    step runs): a prompt goes to the rank with the most free pages that has a free slot, so the 8-token
    prompts land on rank 1 next to rank 0's 12-token one (not on rank 0's last page, where the first
    free slot is: a scheduler that tried only that slot would make them wait or fail); a 20-token
    prompt that fits no rank waits while requests run, then fails alone, naming the rank."""
    import types

    from mla_jax.kv_cache import PagedLatentCache
    from models.serving.scheduler import _Generation

    cache = PagedLatentCache(
        num_layers=1,
        num_pages=8,
        page_size=4,
        latent_dim=4,
        max_seqs=4,
        max_pages_per_seq=8,
        dtype=jnp.float32,
        ranks=2,
    )
    stub = types.SimpleNamespace(cache=cache, max_batch=4, num_pages=8, cfg=CFG, max_context=32)
    prompts = [[1] * 12, [2] * 8, [3] * 8, [4] * 20]
    g = _Generation(stub)
    reqs = [g.add(p, SamplingParams(temperature=0.0), np.zeros(2, np.uint32), set(), 4) for p in prompts]
    g.admit()
    assert [s and s.req for s in g.slots] == [0, None, 1, 2] and list(g.waiting) == [3]
    assert (cache.pages_of(0), cache.pages_of(2), cache.pages_of(3)) == ([0, 1, 2], [0, 1], [2, 3])
    for b in (0, 2, 3):
        g.finish(b, "length")
    g.admit()
    assert reqs[3].finish_reason == "error" and "only 4 of data rank 0's 4 are free" in reqs[3].error
    assert [r.error for r in reqs[:3]] == [None] * 3 and cache.pages_used == 0 and not g.waiting


def test_data_rank_arguments():
    """max_batch or num_pages not divisible by the mesh's data ranks, and the Pallas interpreter with data
    ranks (jax 0.11.2's interpreter fails when two devices run a kernel at once, kv_cache's
    INTERPRET_ON_DATA_RANKS): one line each naming the values (an AbstractMesh: no devices, no weights),
    before anything is placed. The compiled kernels are allowed there now ("kernel")."""
    from jax.sharding import AbstractMesh

    from mla_jax.sharding import MESH_AXES

    model = nnx.eval_shape(lambda: DeepSeekModel(CFG, rngs=nnx.Rngs(0)))
    mesh = AbstractMesh((2, 1, 1), MESH_AXES)
    with pytest.raises(ValueError, match=r"^Engine max_batch=3 is not divisible by the mesh's data ranks \(2\)$"):
        Engine(model, max_batch=3, mesh=mesh)
    with pytest.raises(ValueError, match=r"^Engine num_pages=7 is not divisible by the mesh's data ranks \(2\)$"):
        Engine(model, max_batch=2, num_pages=7, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"^Engine attention_impl='interpret' with data ranks \(2\): the Pallas "
        r"interpreter cannot run a kernel on several devices at once",
    ):
        Engine(model, max_batch=2, attention_impl="interpret", mesh=mesh)


# --- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[]), "non-empty list"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[[1] * 257]), "257 tokens, beyond max_context=256"),
        (dict(prompts=[[1, CFG.vocab_size]]), f"token id {CFG.vocab_size} outside the vocabulary"),
        (dict(prompts=[[-1]]), "token id -1 outside"),
        (dict(prompts=["hello"]), "list of token ids"),
        (dict(prompts=[[1.5]]), "non-integer token"),
        (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(prompts=[[1]], sampling=[SamplingParams()] * 2), "one SamplingParams per prompt"),
        (dict(prompts=[[1]], stream=5), "stream must be a callable"),
        (dict(prompts=[[1]], on_cache_full="ignore"), "on_cache_full"),
        (dict(prompts=[[1]], use_mtp=True, mtp_draft_tokens=4), r"mtp_draft_tokens must be an integer in \[1, 3\]"),
        (dict(prompts=[[1]], use_mtp=True, mtp_draft_tokens=0), "mtp_draft_tokens"),
    ],
)
def test_bad_generate_arguments(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)


def test_bad_engine_arguments(model):
    with pytest.raises(ValueError, match="page_size must be an integer >= 1"):
        Engine(model, page_size=0)
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        Engine(model, attention_impl="fast")
    with pytest.raises(ValueError, match=r"max_context must be an integer in \[1, max_position_embeddings=2048\]"):
        Engine(model, max_context=4096)
    with pytest.raises(ValueError, match=r"^Engine prefill_budget must be an integer >= 1, got 0$"):
        Engine(model, prefill_budget=0)
    with pytest.raises(ValueError, match=r"^Engine mixed_steps must be True or False, got 'yes'$"):
        Engine(model, mixed_steps="yes")
    # The Pallas kernels serve the 576-wide latent, page 64, H in {16,32,64,128}; the message names each
    # limit the model breaks (the interpreter runs them, so no GPU is needed to be refused this way).
    with pytest.raises(ValueError, match=r"attention_impl='interpret': .*heads = 4 .*page_size = 4 .*64 latent"):
        Engine(model, page_size=4, attention_impl="interpret")
    no_mtp = DeepSeekModel(CFG.replace(num_mtp_layers=0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no MTP module"):
        Engine(no_mtp, **STD).generate([[1, 2]], use_mtp=True)


# --- compilation count -----------------------------------------------------------------------------
def test_long_generation_compiles_a_bounded_number_of_times(model):
    """Also guards the decode step's block table: with the smallest table bucket (1 page) the table
    is exactly as wide as the pages in use, so a table one page short (the step's token written
    nowhere, its attention missing the last page) diverges from the full forward pass at the
    power-of-two page boundaries this generation crosses."""
    # A batch shape no other test uses (fresh compilations), and the smallest table bucket (1 page).
    e = Engine(model, **{**STD, "max_batch": 2}, min_table_tokens=1)
    before = trace_counts()
    prompts = _prompts(11, [5, 2])
    res = e.generate(prompts, max_new_tokens=56)
    assert [len(t) for t in res.tokens] == [56, 56]
    _assert_teacher_forced(model, prompts, res.tokens)
    new = {k: v - before.get(k, 0) for k, v in trace_counts().items()}
    # 55 decode steps, one a call, each call's table covering its step: 6..60 tokens = 2..15 pages of 4:
    # table widths 2, 4, 8, 16 -> 4 compilations.
    assert new.get("decode", 0) == 4 and new.get("prefill", 0) == 1, new
    again = e.generate(_prompts(12, [7, 3]), max_new_tokens=56)
    assert trace_counts() == {k: before.get(k, 0) + new.get(k, 0) for k in trace_counts()}  # nothing new
    assert again.stats["decode_steps"] == 55


def test_a_call_in_flight_while_the_next_one_compiles_is_not_timed_as_warm(model):
    """Guards the tokens/s figures against compilation: the lane launches call n + 1 (compiling it there when
    it is new) before it reads call n, and call n's time ran to that read, so a warm prefill call was charged
    the next decode call's compilation (`mla-generate` printed prefill 21 tok/s where the step runs at ~1 900,
    its warm-up having compiled the 1-step decode call only). Such a call's time goes to `compile_s`, the
    warm figures keep only calls timed alone."""
    e = Engine(model, **{**STD, "max_batch": 3}, decode_steps=8)  # a shape no other test uses: it compiles here
    prompt = _prompts(14, [5])
    e.generate(prompt, max_new_tokens=2)  # compiles the prefill call and the 1-step decode call only
    before = sum(trace_counts().values())
    # 1 token from the prefill call, then decode calls of 8 steps and of 3 (a 4-step loop): both compile at
    # their launch, while the call before each is in flight
    res = e.generate(prompt, max_new_tokens=12)
    assert sum(trace_counts().values()) - before == 2
    st = res.stats
    assert st["prefill_s"] == 0.0 and st["decode_s"] == 0.0 and st["compile_s"] > 0, dict(st)
    again = e.generate(prompt, max_new_tokens=12).stats  # nothing compiles: every call is timed
    assert again["compile_s"] == 0.0 and again["prefill_s"] > 0 and again["decode_s"] > 0, dict(again)
    assert again["decode_tokens"] == 11 and again["decode_calls"] == 2


def test_a_cancelled_handle_keeps_the_tokens_that_reached_the_host(model):
    """`RequestHandle.output` is what was generated and read back, a whole device call at a time, not what
    `tokens()` yielded: cancelled after 3 tokens were read with 8 steps a call, it holds 9 (the prefill's and a
    decode call's), the first of the request run alone. Catches: an output cut to the tokens yielded, or the
    landed call's tokens dropped at cancel, either way against its docstring."""
    e = Engine(model, **{**STD, "max_batch": 3}, decode_steps=8)  # the shapes of the test above
    prompt = _prompts(14, [5])[0]
    alone = e.generate([prompt], max_new_tokens=12).tokens[0]
    h = e.submit(prompt, max_new_tokens=12)
    stream = h.tokens()
    read = [next(stream) for _ in range(3)]
    assert h.cancel() and list(stream) == [] and h.finish_reason == "cancelled"
    assert read == alone[:3] and h.output == alone[:9]
    assert e.cache.pages_used == 0


# --- the Pallas kernels (interpret mode on CPU, the real kernels on a Hopper GPU) -------------------
KERNEL_CFG = ModelConfig.tiny().replace(  # the kernels' shape: latent 512 + rope 64, 16 heads
    num_hidden_layers=1,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    num_attention_heads=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    hidden_size=64,
    q_lora_rank=None,
)


def _kernel_vs_reference(
    impl, prompts, max_new_tokens, max_batch, plain=True, k=1, kv_dtype=jnp.bfloat16, mesh=None, decode_config=None
):
    """Tokens of the kernel paths = tokens of the jnp paths, greedy, with MTP (k drafts) and, if
    `plain`, without; both on `mesh` when given."""
    m = DeepSeekModel(KERNEL_CFG, rngs=nnx.Rngs(0))
    runs = {}
    for name in ("reference", impl):
        # decompressed_threshold 32: a 64-token chunk takes the decompressed path (paged_gather kernel),
        # shorter ones the absorbed path; decode and MTP verify (s_q = 2) call mla_decode.
        e = Engine(
            m,
            page_size=64,
            num_pages=4 * max_batch,
            max_batch=max_batch,
            prefill_chunk=64,
            decompressed_threshold=32,
            attention_impl=name,
            kv_dtype=kv_dtype,
            mesh=mesh,
            decode_config=decode_config,
        )
        assert e.backend == name
        is_ref = name == "reference"
        runs[name] = (
            e.generate(prompts, max_new_tokens=max_new_tokens) if plain or is_ref else None,
            e.generate(prompts, max_new_tokens=max_new_tokens, use_mtp=True, mtp_draft_tokens=k)
            if plain or not is_ref
            else None,
        )
    (ref, ref_mtp), (got, got_mtp) = runs["reference"], runs[impl]
    # Both read the same bf16 cache; the kernel also rounds the absorbed query to bf16, so compare
    # tokens (the tiny random model's top logits are far apart next to that rounding).
    assert got_mtp.tokens == ref.tokens
    if plain:
        assert ref_mtp.tokens == ref.tokens
    if plain:
        assert got.tokens == ref.tokens


@pytest.mark.full(
    "test_interpret_kernels_match_reference_logits_on_the_builtin_model runs the cached forward's decode "
    "(s_q = 1) and a verify-shaped step (s_q = 3) through the interpret kernels; "
    "test_verify_step_table_covers_the_kernel_seq_len the verify step's table and lengths"
)
def test_interpret_kernels_match_reference():
    # MTP only (the interpreter is slow): prefill through paged_gather, verify through mla_decode
    # with s_q = 4 (3 drafts), the draft chain with s_q = 1, and the last verifies with fewer drafts
    # than k (padding queries at the end).
    _kernel_vs_reference("interpret", _prompts(13, [5, 70]), max_new_tokens=5, max_batch=2, plain=False, k=3)


PIECES = MlaDecodeConfig(schedule="pieces", target_ctas=4, min_pages_per_split=1, min_piece_pages=1)


@pytest.mark.full("test_decode_plan_is_built_once_a_forward_call_not_per_layer checks the plan's lengths and place")
def test_interpret_pieces_schedule_engine_matches_reference():
    """An engine whose decode kernel runs the pieces schedule (planned once a step) gives the jnp path's greedy
    tokens on a ragged batch: a one-token prompt and one two tokens short of a page decoding together, beside a
    two-page prompt's chunks in mixed steps (whose decoding rows carry padding queries past the page end).
    Catches a step that hands the kernel a plan of other rows' lengths (the rows' lengths reversed: it fails)
    and the plan not reaching the kernel through the engine's cache."""
    _kernel_vs_reference("interpret", _prompts(17, [1, 62, 130]), max_new_tokens=3, max_batch=3, decode_config=PIECES)


def test_auto_decode_config_is_chosen_on_the_host_each_step(model, monkeypatch):
    """`Engine(decode_config=MlaDecodeConfig(schedule="auto"))`: each step's cache carries the program the rule
    picks from the step's lengths on the host (`step_decode_config`), never "auto" itself (whose device
    conditional cost 3-16 µs a kernel call on the H200): four equal rows decode per sequence; a 2-token prompt
    beside a 40-token one (1 and 10 pages of 4) decodes in pieces. Catches the engine passing "auto" through and
    a choice from stale or other rows' lengths, and a prefill step that compiles twice."""
    import models.serving.calls as calls

    real, seen = calls.step_decode_config, []

    def spy(config, lengths):
        seen.append((real(config, lengths), None if lengths is None else np.array(lengths)))
        return seen[-1][0]

    monkeypatch.setattr(calls, "step_decode_config", spy)
    e = Engine(model, **{**STD, "decode_config": MlaDecodeConfig(schedule="auto")})
    e.generate(_prompts(3, [20, 20, 20, 20]), max_new_tokens=3)
    assert {c.schedule for c, _ in seen} == {"per_sequence"}
    seen.clear()
    e.generate(_prompts(4, [2, 40]), max_new_tokens=3)
    assert all(c.schedule != "auto" for c, _ in seen)
    decode = [(c.schedule, lens) for c, lens in seen if lens is not None and (lens > 0).sum() == 2 and lens.max() > 40]
    assert decode and all(s == "pieces" for s, _ in decode), decode
    # prefill steps (lengths None) keep the per-sequence program: a ragged prompt batch does not retrace them
    assert {c.schedule for c, lens in seen if lens is None} == {"per_sequence"}


def test_default_decode_config_takes_pieces_on_ragged_rows_where_the_kernel_runs():
    """The engine's default (decode_config None) chooses each decoding step's schedule as "auto" does, where a
    decode kernel runs: per sequence (None, the kernel's defaults) on near-equal lengths, pieces on ragged ones;
    a prefill step and the reference backend (no kernel: a second program would only retrace) keep one
    program; `warm_up` compiles both where both can be taken. Catches the default left per sequence on ragged
    rows (such a V2-Lite step measured 12 % slower), a retrace on the reference backend,
    and a warm-up that leaves the ragged program to compile mid-serving."""
    m = DeepSeekModel(KERNEL_CFG, rngs=nnx.Rngs(0))
    ragged, even = np.asarray([64, 0, 0, 4096], np.int32), np.asarray([4096, 4000, 4090, 4096], np.int32)
    kw = dict(page_size=64, num_pages=16, max_batch=4, prefill_chunk=64)
    e = Engine(m, attention_impl="interpret", **kw)
    sched = e._sched
    assert e.decode_config is None and sched._decode_config("decode", even) is None
    assert sched._decode_config("decode", ragged) == MlaDecodeConfig(schedule="pieces")
    assert sched._decode_config("mixed", ragged).schedule == "pieces"
    assert sched._decode_config("prefill", ragged) is None
    assert sched._warm_decode_configs() == [None, MlaDecodeConfig(schedule="pieces")]
    ref = Engine(m, attention_impl="reference", **kw)._sched
    assert ref._decode_config("decode", ragged) is None and ref._warm_decode_configs() == [None]
    one = Engine(m, attention_impl="interpret", **{**kw, "max_batch": 1})._sched
    assert one._warm_decode_configs() == [None]  # a single row is never ragged
    # an explicit config is kept as it is, "auto" chosen on any backend (the caller asked for it)
    fixed = Engine(m, attention_impl="interpret", decode_config=MlaDecodeConfig(), **kw)._sched
    assert fixed._decode_config("decode", ragged) == MlaDecodeConfig()
    auto = Engine(m, attention_impl="reference", decode_config=MlaDecodeConfig(schedule="auto"), **kw)._sched
    assert auto._decode_config("decode", ragged).schedule == "pieces"


def _schedule_ops(jaxpr, in_scan=False, counts=None, scope=SCHEDULE_SCOPE):
    """{inside a scan: number of equations in name scope `scope` (the decode plan's)} over a jaxpr and its
    sub-jaxprs."""
    counts = {False: 0, True: 0} if counts is None else counts
    for eqn in jaxpr.eqns:
        if scope in str(eqn.source_info.name_stack):
            counts[in_scan] += 1
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _schedule_ops(sub, in_scan or eqn.primitive.name == "scan", counts, scope)
    return counts


def test_decode_plan_is_built_once_a_forward_call_not_per_layer():
    """The pieces schedule's plan depends on the step's lengths only: the model builds it once, before its
    scanned layers, and each layer's kernel call reads it (`KVCache.decode_plan`). Counted in the traced step:
    the plan's ops sit outside every scan, none inside a layer body (which runs once a layer). Catches the plan
    built inside the layer (the mutation: `with_decode_plan` not called by the model), the kernel's lengths
    computed again in each layer (`MLA.cached_attention` ignoring `DecodePlan.seq_lens`: one kernel launch a
    layer on the GPU), and the plan leaking out of the call (its lengths are stale for the next one)."""
    cfg = KERNEL_CFG.replace(num_hidden_layers=3, first_k_dense_replace=1)  # a dense scan and a MoE scan
    # abstract weights: the model is only traced here (its state an argument of the traced forward)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0))))
    pages = jnp.zeros((3, 8, 64, 576), jnp.bfloat16)
    table = jnp.arange(8, dtype=jnp.int32).reshape(4, 2)
    lens = np.array([1, 63, 66, 100], np.int32)  # after this step's writes
    cache = KVCache.create(pages, table, lens, impl="interpret", decode_config=PIECES)
    # A mixed step's shape: 4 query slots a row, valid ones first, padding (-1) after them.
    pos = jnp.asarray([[0, -1, -1, -1], [62, -1, -1, -1], [64, 65, -1, -1], [96, 97, 98, 99]], jnp.int32)
    ids = jnp.zeros((4, 4), jnp.int32)

    def forward(c):  # the traced step's jaxpr
        return jax.make_jaxpr(lambda st, c: nnx.merge(graphdef, st)(ids, pos, cache=c))(state, c).jaxpr

    # The kernel counts padding queries in (query j at seq_len - 4 + j): lengths 1+3, 63+3, 66+2, 100+0, so
    # row 1's plan covers two pages, not one.
    want = mla_decode_schedule(jnp.asarray([4, 66, 68, 100], jnp.int32), heads=16, query_len=4, config=PIECES)
    plan = with_decode_plan(cfg, cache, pos).decode_plan
    chex.assert_trees_all_equal(plan.schedule, want)
    np.testing.assert_array_equal(plan.seq_lens, [4, 66, 68, 100])
    out = jax.eval_shape(lambda st, c: nnx.merge(graphdef, st)(ids, pos, cache=c)[1], state, cache)
    assert out.decode_plan is None  # dropped when the call returns
    counts = _schedule_ops(forward(cache))
    assert counts[True] == 0 and counts[False] > 0, counts
    assert isinstance(want, PieceSchedule)
    # "auto" (its plan: the pieces one and the rule's choice): built once the same way
    other = dataclasses.replace(cache, decode_config=MlaDecodeConfig(schedule="auto", target_ctas=4))
    assert isinstance(with_decode_plan(cfg, other, pos).decode_plan.schedule, AutoSchedule)
    counts = _schedule_ops(forward(other))
    assert counts[True] == 0 and counts[False] > 0, counts
    # the same model on the per-sequence schedule plans nothing on the device, but still hands every layer the
    # kernel's lengths computed once (a layer computing them again was a kernel launch a layer)
    plain = dataclasses.replace(cache, decode_config=None)
    assert _schedule_ops(forward(plain)) == {False: 0, True: 0}
    assert with_decode_plan(cfg, plain, pos).decode_plan.schedule is None
    lens_ops = _schedule_ops(forward(plain), scope=SEQ_LENS_SCOPE)
    assert lens_ops[True] == 0 and lens_ops[False] > 0, lens_ops
    # a config that is not one: one line naming the argument, at construction
    with pytest.raises(ValueError, match=r"^Engine decode_config must be an MlaDecodeConfig or None, got str: 'pie"):
        Engine(nnx.merge(graphdef, state), decode_config="pieces")
    with pytest.raises(ValueError, match=r"^KVCache decode_config must be an MlaDecodeConfig or None, got dict"):
        dataclasses.replace(cache, decode_config={"schedule": "pieces"})


@pytest.mark.gpu
def test_gpu_kernels_match_reference():
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    prompts = _prompts(14, [5, 70, 130, 1, 64, 200])
    _kernel_vs_reference("kernel", prompts, max_new_tokens=24, max_batch=4)


@pytest.mark.gpu
@pytest.mark.full(
    "the GPU quick tier runs the engine's MTP verify through the kernels at k = 1 (s_q = 2) in "
    "test_gpu_kernels_match_reference and the kernel at s_q = 4 in test_mla_decode"
)
def test_gpu_kernels_match_reference_with_three_drafts():
    """The compiled engine's MTP verify with three drafts a step (s_q = 4 through `mla_decode`): the jnp path's
    greedy tokens. Catches a verify step whose queries past the second are mis-ordered or mis-masked."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    prompts = _prompts(14, [5, 70, 130, 1, 64, 200])
    _kernel_vs_reference("kernel", prompts, max_new_tokens=24, max_batch=4, plain=False, k=3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "plan",
    full(
        [dict(schedule="auto"), dict(schedule="pieces")],
        [],
        "the GPU quick tier runs the pieces kernel in test_mla_decode and the engine in "
        "test_gpu_kernels_match_reference",
    ),
    ids=["auto", "pieces"],
)
def test_gpu_planned_schedule_engine_matches_reference(plan):
    """The compiled engine on the pieces schedule (planned once a step, at the GPU's CTA count; "auto" picks it
    for ragged rows): the jnp path's greedy tokens on ragged prompts, plain decode and MTP verify. Catches what
    interpret mode cannot: the plan handed through the compiled, scanned step to the kernel."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    prompts = _prompts(14, [5, 70, 130, 1, 64, 200])
    config = MlaDecodeConfig(**plan)
    _kernel_vs_reference("kernel", prompts, max_new_tokens=16, max_batch=4, k=3, decode_config=config)


@pytest.mark.gpu
def test_gpu_flash_prefill_engine_matches_reference():
    """A bf16 model on a Hopper GPU: the engine's long prefill chunks (256 tokens, the decompressed path) run
    the flash forward with query offsets (`Engine.prefill_attention == "mgpu"`): chunks after prefixes of 256
    and 512 tokens, a last chunk of 188, rows of different prefixes in one step, an idle row; the greedy
    tokens equal the jnp engine's (`attention_impl="reference"`). Catches the offset kernel's output wrong in
    the compiled engine step (the prefix ignored, rows mixed), which the layer test checks at one chunk."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    m = DeepSeekModel(KERNEL_CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    prompts = _prompts(17, [700, 300, 5])
    tokens = {}
    for impl in ("reference", "kernel"):
        e = Engine(m, page_size=64, num_pages=64, max_batch=4, prefill_chunk=256, attention_impl=impl)
        assert e.prefill_attention == ("mgpu" if impl == "kernel" else "xla")
        tokens[impl] = e.generate(prompts, max_new_tokens=8).tokens
    assert tokens["kernel"] == tokens["reference"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kv_dtype",
    full(
        ["fp8", "fp4"],
        [],
        "the GPU quick tier runs the fp8 decode bodies in test_mla_decode_fp8, the quantized gathers in "
        "test_paged_gather and the engine in test_gpu_kernels_match_reference",
    ),
)
def test_gpu_quantized_kernels_match_reference(kv_dtype):
    """fp8 / fp4 pages on the GPU: paged_gather's quantized bodies (prefill prefixes; fp4 decode too) and
    mla_decode's fp8 body against the jnp path over the same bytes. Catches a body that is bit-exact in
    the interpreter but wrong compiled (the fp4 body's first GPU run was this test's)."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    prompts = _prompts(14, [5, 70, 130, 1, 64, 200])
    _kernel_vs_reference("kernel", prompts, max_new_tokens=24, max_batch=4, kv_dtype=kv_dtype)
    _kernel_vs_reference("kernel", prompts, max_new_tokens=24, max_batch=4, plain=False, k=3, kv_dtype=kv_dtype)


@pytest.mark.gpu
def test_gpu_kernels_on_data_ranks_match_reference():
    """Two Hopper GPUs, data=2: a page pool a rank, the kernels on each rank's own pages and rows
    (`KVCache.map_pages`, the gather's shard_map) give the jnp path's tokens on the same mesh, bf16 and
    fp8 pages. Catches what the CPU maps cannot run: the compiled kernels inside a map manual over
    every mesh axis, fed local page ids."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper() or jax.device_count() < 2:
        pytest.skip("needs two Hopper GPUs")
    from mla_jax.sharding import make_mesh

    prompts = _prompts(16, [5, 70, 130, 1])
    for kv_dtype in (jnp.bfloat16, "fp8"):
        _kernel_vs_reference(
            "kernel",
            prompts,
            max_new_tokens=16,
            max_batch=4,
            plain=False,
            k=3,
            kv_dtype=kv_dtype,
            mesh=make_mesh(data=2),
        )


def test_fp8_pages_through_the_interpret_kernels_match_the_jnp_path():
    """An fp8 cache on the kernel backend (interpret mode): the prefill chunk's prefix through
    paged_gather's fp8 body, decode through the decode kernel when it reads fp8 pages, else
    paged_gather + jnp; the same greedy tokens as the fp8 cache on the jnp path, which decodes the
    same bytes in fp32. Guards: fp8 pages handed to a decode kernel without an fp8 body, the cache's
    format lost between steps (uint8 rows read as values), the engine refusing the kernel backend
    for fp8."""
    m = DeepSeekModel(KERNEL_CFG, rngs=nnx.Rngs(0))
    prompts = _prompts(15, [9, 3])
    runs = {}
    for impl in ("reference", "interpret"):
        e = Engine(
            m, page_size=64, num_pages=4, max_batch=2, attention_impl=impl, kv_dtype="fp8", cache_fill=float("nan")
        )
        assert e.cache.pages.dtype == jnp.uint8 and e.cache.page_format.name == "fp8"
        assert e.backend == impl
        runs[impl] = e.generate(prompts, max_new_tokens=2).tokens
    assert runs["interpret"] == runs["reference"]


def test_fp4_decode_routes_through_paged_gather_never_mla_decode(monkeypatch):
    """The cached decode step on fp4 pages with a kernel backend gathers them through `paged_gather`
    (fp4 format, the kernel backend's impl) and attends in jnp; `mla_decode` is never called (it has no
    fp4 body: `mla_decode_problems` says so, and `MLA.cached_path` asks it). Its output equals the jnp
    backend's, bit for bit (fp4 values are exact in bf16). paged_gather's fp4 body itself:
    tests/test_paged_gather.py. Guards: fp4 pages handed to mla_decode (its fp8 body would read 416-byte
    rows as 656-byte ones), the format or the backend lost on the way to the gather."""
    import pallas_kernels
    from mla_jax import attention, kv_cache
    from mla_jax.attention import MLA
    from mla_jax.kv_cache import PagedLatentCache
    from pallas_kernels import FP4_PAGES

    calls = []

    def fake_decode(*args, **kw):
        calls.append("mla_decode")
        raise AssertionError("mla_decode called on fp4 pages")

    def fake_gather(kv_pages, block_table, *, num_tokens, impl=None, page_format=None, **kw):
        calls.append((impl, page_format, kv_pages.shape[-1]))
        return pallas_kernels.paged_gather_reference(
            kv_pages, block_table, num_tokens=num_tokens, page_format=page_format
        )

    monkeypatch.setattr(attention, "mla_decode", fake_decode)
    monkeypatch.setattr(kv_cache, "paged_gather", fake_gather)
    mla = MLA(KERNEL_CFG, rngs=nnx.Rngs(0))
    c = PagedLatentCache(
        num_layers=1, num_pages=2, page_size=64, latent_dim=576, max_seqs=1, max_pages_per_seq=2, page_format="fp4"
    )
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 41, KERNEL_CFG.hidden_size))
    step = nnx.jit(lambda m, x, p, c: m(x, p, cache=c))
    _, kv = step(mla, x[:, :40], jnp.arange(40)[None], KVCache.create(c.pages, [[1, 0]], [40]))
    outs = {}
    for impl in ("interpret", "reference"):
        outs[impl], _ = step(mla, x[:, 40:], jnp.asarray([[40]]), dataclasses.replace(kv.with_lengths([41]), impl=impl))
    assert calls == [("interpret", FP4_PAGES, 416)], calls
    np.testing.assert_array_equal(np.asarray(outs["interpret"]), np.asarray(outs["reference"]))


def test_fp8_decode_routes_through_mla_decode_on_a_kernel_backend(monkeypatch):
    """The cached decode step on fp8 pages with a kernel backend calls `mla_decode` on the pages (with their
    `PageFormat`), and gives the output of the gather + jnp route of the "reference" backend (the decode
    kernel stood in for by its reference, which dequantises to bf16 as the kernel does). Guards: fp8
    pages routed away from the decode kernel that reads them, or handed to it without their format."""
    import pallas_kernels
    from mla_jax import attention
    from mla_jax.attention import MLA
    from mla_jax.kv_cache import PagedLatentCache
    from pallas_kernels import FP8_PAGES

    calls = []

    def fake_decode(q, kv_pages, *args, **kw):
        calls.append((kv_pages.dtype, kw.get("page_format")))
        kw.pop("impl", None)
        return pallas_kernels.mla_decode_reference(q, kv_pages, *args, **kw)

    monkeypatch.setattr(attention, "mla_decode", fake_decode)
    mla = MLA(KERNEL_CFG, rngs=nnx.Rngs(0))  # the layer that picks the route
    c = PagedLatentCache(
        num_layers=1, num_pages=2, page_size=64, latent_dim=576, max_seqs=1, max_pages_per_seq=2, page_format="fp8"
    )
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 41, KERNEL_CFG.hidden_size))
    kv = KVCache.create(c.pages, [[1, 0]], [40], page_format=c.page_format)
    # a fresh jitted wrapper each time, so that each call is traced again (the route is chosen, and the
    # fake records, at trace time)
    run = lambda: nnx.jit(lambda m, x, p, c: m(x, p, cache=c))  # noqa: E731
    _, kv = run()(mla, x[:, :40], jnp.arange(40)[None], kv)  # 40 tokens: gather + jnp, no decode call
    assert calls == []
    outs = {}
    for impl in ("reference", "interpret"):
        step = dataclasses.replace(kv.with_lengths([41]), impl=impl)
        outs[impl], _ = run()(mla, x[:, 40:], jnp.asarray([[40]]), step)
    assert calls == [(jnp.uint8, FP8_PAGES)], calls
    a, b = (np.asarray(outs[f], np.float32) for f in ("reference", "interpret"))
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 1e-2  # bf16 queries in the kernel route


def test_engine_kv_dtype_names_and_errors(model):
    """Engine(kv_dtype=...) takes the format names as well as dtypes; fp8 needs a latent width the
    format can store, and names the limit."""
    assert Engine(model, **{**STD, "kv_dtype": "fp32"}).cache.page_format.name == "fp32"
    assert Engine(model, **{**STD, "kv_dtype": "bf16"}).cache.dtype == jnp.bfloat16
    assert Engine(model, **{**STD, "kv_dtype": jnp.float16}).cache.page_format.name == "fp16"
    with pytest.raises(ValueError, match="fp8 pages need latent_dim a positive multiple of 128.* got 64"):
        Engine(model, **{**STD, "kv_dtype": "fp8"})  # tiny: kv_lora_rank 64
    fp4 = Engine(model, **{**STD, "kv_dtype": "fp4"})  # tiny: kv_lora_rank 64, a multiple of 32
    assert fp4.cache.page_format.name == "fp4" and fp4.cache.pages.shape[-2:] == (4, 32 + 4 + 32)
    with pytest.raises(ValueError, match="page format 'fp6' is unknown"):
        Engine(model, **{**STD, "kv_dtype": "fp6"})
    from models.serving.engine import kernel_problems
    from pallas_kernels import BF16_PAGES, FP8_PAGES, mla_decode_problems

    # the kernels' own limits decide: the decode kernel reads fp8 pages of the 512 + 64 latent
    assert kernel_problems(KERNEL_CFG, 64, "fp8") == [] == mla_decode_problems(16, 64, FP8_PAGES)
    assert kernel_problems(KERNEL_CFG, 32, "bf16") == [
        "page_size = 32 (the decode kernel reads 64-token pages)",
        "page_size = 32 (the gather kernel reads 64-token pages)",
    ]
    assert mla_decode_problems(16, 32, BF16_PAGES) == kernel_problems(KERNEL_CFG, 32, "bf16")[:1]


def test_verify_step_table_covers_the_kernel_seq_len(monkeypatch):
    """Regression: a verify step with fewer drafts than k (here at the context limit) still hands
    the decode kernel seq_len = cached + 1 + k (padding queries counted in); the block table must
    cover that many tokens, or the kernel would read past the table (`mla_decode` precondition
    1 <= seq_len <= 64 * max_pages). The kernels are replaced by their references, recording
    what they receive."""
    import pallas_kernels

    seen = []

    def fake_decode(q, kv_pages, block_table, seq_lens, *, softmax_scale, causal, impl=None, **kw):
        width = block_table.shape[1]
        jax.debug.callback(lambda s: seen.append((np.asarray(s).tolist(), width)), seq_lens)
        return pallas_kernels.mla_decode_reference(
            q, kv_pages, block_table, seq_lens, softmax_scale=softmax_scale, causal=causal, **kw
        )

    def fake_gather(kv_pages, block_table, *, num_tokens, impl=None, **kw):
        return pallas_kernels.paged_gather_reference(kv_pages, block_table, num_tokens=num_tokens)

    from mla_jax import attention, kv_cache

    monkeypatch.setattr(attention, "mla_decode", fake_decode)
    monkeypatch.setattr(kv_cache, "paged_gather", fake_gather)
    # The steps must be traced with the fakes in place: a config no other test uses (its dense MLP's
    # width) has steps of its own (`compiled_steps` is per graphdef), jitted anew here, so neither
    # another test's compiled steps nor, later, another test gets the fakes (no jax.clear_caches,
    # which would make every later test of the process compile again).
    m = DeepSeekModel(KERNEL_CFG.replace(intermediate_size=72), rngs=nnx.Rngs(0))
    e = Engine(m, page_size=64, num_pages=16, max_batch=1, max_context=256, attention_impl="interpret")
    res = e.generate(_prompts(1, [250]), max_new_tokens=20, use_mtp=True, mtp_draft_tokens=1)
    # positions 250..256 are emitted; the token at 256 = max_context is not fed back
    assert res.finish_reasons == ["context"] and len(res.tokens[0]) == 256 - 250 + 1
    assert seen, "the decode kernel was never called"
    assert any(s[0] == 257 for s, _ in seen)  # the step at the context limit ran
    for s, width in seen:
        assert max(s) <= 64 * width, (s, width)


def test_prefill_mtp_state_equals_the_uncached_mtp_forward(model):
    """The MTP pool rows a prefill writes are the pairs (h_i, t_{i+1}), and the first draft's
    distribution is the uncached MTP forward over the prompt's pairs and (h_{n-1}, t_n). Guards
    against the pairs shifted by one (then the draft attends over wrong rows; greedy output would
    not show it, only the acceptance rate would drop)."""
    from models.serving.sampling import SamplingArrays
    from models.serving.steps import StepInputs

    e = Engine(model, page_size=4, num_pages=16, max_batch=1, kv_dtype=jnp.float32)
    prompt = _prompts(21, [11])[0]
    n, T = len(prompt), 16
    e.cache.reserve(0, n + 1)
    ids = np.zeros((1, T), np.int32)
    ids[0, :n] = prompt
    pos = np.where(np.arange(T) < n, np.arange(T), -1)[None].astype(np.int32)
    nxt = np.zeros((1, T), np.int32)
    nxt[0, : n - 1] = prompt[1:]
    sp = SamplingArrays(*(np.asarray(v) for v in ([1.0], [0], [1.0], [0.0])))  # temperature 1: q = softmax
    inp = StepInputs(
        ids,
        pos,
        e.cache.block_tables[:, :4].copy(),
        np.array([n], np.int32),
        np.array([n - 1], np.int32),
        np.zeros((1, 2), np.uint32),
        sp,
    )
    cache = KVCache.create(e.cache.pages, inp.block_table, inp.lengths)
    _, tok, _, q = e.steps.prefill(
        e.state,
        cache,
        inp,
        nxt,
        np.array([True]),
        jnp.zeros((1, 1), jnp.int32),
        jnp.zeros((1, 1, CFG.vocab_size), jnp.float32),
        use_mtp=True,
        sampler="random",
    )
    # the uncached reference: the main token t_n sampled from the same keys, then MTP over all pairs
    x = jnp.asarray([prompt])
    pairs_next = jnp.asarray([prompt[1:] + [int(tok[0])]])
    mtp = nnx.jit(lambda m, x, nxt: m.mtp_logits(m.hidden_states(x), nxt))  # one compile, not one an op
    want = jax.nn.softmax(mtp(model, x, pairs_next)[0, n - 1])
    np.testing.assert_allclose(np.asarray(q[0, 0]), np.asarray(want), rtol=1e-4, atol=1e-6)
    # ... and the engine hands the step those pairs, across chunk boundaries (chunks of 8 here):
    # row i of a chunk pairs token i with prompt token i + 1. (The late-verify-call test's shapes: their
    # steps compile once.)
    e = Engine(model, **ONE_SLOT)
    seen = []
    real = e.steps.prefill_call

    def recording(state, cache, inp, lane, feed, src, mtp_next_ids, *args, **kw):
        seen.append((np.asarray(inp.positions[0]), np.asarray(mtp_next_ids[0])))
        return real(state, cache, inp, lane, feed, src, mtp_next_ids, *args, **kw)

    e.steps = e.steps._replace(prefill_call=recording)
    e.generate([prompt], max_new_tokens=1, use_mtp=True)  # the prefill alone: no verify call to compile
    assert len(seen) == 2  # 11 prompt tokens in chunks of 8
    for positions, nxt_ids in seen:
        for j, p in enumerate(positions):
            if 0 <= p < n - 1:
                assert nxt_ids[j] == prompt[p + 1], (p, nxt_ids[j], prompt[p + 1])


def _cached_logits_through(model, impl: str, ids, table) -> list[np.ndarray]:
    """The model's cached forward over a prompt chunk (64 tokens: the decompressed path, its prefix
    through `paged_gather`), then one decode token and a 3-token verify-shaped step (absorbed, through
    `mla_decode` with s_q = 1 and 3), with `impl` as the cache's backend -> each step's logits."""
    L = model.cfg.num_hidden_layers + len(model.mtp)
    pages = jnp.full((L, 8, 64, model.cfg.latent_dim), jnp.nan, jnp.bfloat16)  # unwritten rows are NaN
    out, start = [], 0
    step = nnx.jit(lambda m, ids, pos, cache: m(ids, pos, cache=cache))  # one compile a shape, not one an op
    for T in (64, 1, 3):
        pos = jnp.arange(start, start + T, dtype=jnp.int32)[None]
        cache = KVCache.create(pages, table, np.array([start + T], np.int32), impl=impl, decompressed_threshold=64)
        logits, cache = step(model, jnp.asarray(ids[None, start : start + T]), pos, cache)
        pages, start = cache.pages, start + T
        out.append(np.asarray(logits[0], np.float32))
    return out


@pytest.mark.full(
    "the interpreted kernels' outputs against their references: test_mla_decode; the engine through them: "
    "test_fp8_pages_through_the_interpret_kernels_match_the_jnp_path"
)
def test_interpret_kernels_match_reference_logits_on_the_builtin_model():
    """The kernel-backed cached forward (interpret mode) against the jnp one, on the trained built-in
    model (kernel-shaped: latent 576, 16 heads) and real text, by logits: a kernel bug that leaves a
    tiny random model's greedy tokens alone (its output repeats) still moves these (the kernel given
    seq_len one short, its last key dropped, moved them by 3.6e-2 in a mutation check)."""
    from models import load_hf_checkpoint
    from models.builtin import BUILTIN_DIR
    from models.tokenizer import load_tokenizer

    model, tok = load_hf_checkpoint(BUILTIN_DIR), load_tokenizer(BUILTIN_DIR)
    ids = np.asarray(
        tok.encode(
            "Once upon a time, there was a little girl named Lily. She loved to play "
            "in the garden with her dog, and every morning they ran to the old tree by "
            "the river."
        ),
        np.int32,
    )[:68]
    assert len(ids) == 68
    table = np.array([[5, 2, 7, 0]], np.int32)  # a permuted table over NaN-poisoned pages
    ref = _cached_logits_through(model, "reference", ids, table)
    got = _cached_logits_through(model, "interpret", ids, table)
    for step, (a, b) in enumerate(zip(got, ref)):
        assert np.isfinite(a).all(), step
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < 1e-2, (step, rel)  # bf16 query and pages in both; the kernels sum in another order
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9, step
    # and the cached forward is the full forward: its next-token logits match the plain model's
    full = np.asarray(model(jnp.asarray(ids[None]))[0], np.float32)
    rel = np.linalg.norm(ref[1][0] - full[64]) / np.linalg.norm(full[64])
    assert rel < 2e-2, rel  # the cache holds bf16 latents; the plain forward keeps them fp32


def test_default_prefill_chunk_rule(model):
    """`Engine(prefill_chunk=None)`'s rule: 512 with the jnp attention (what a CPU engine gets, fp32 or
    reference backend); with the flash prefill a 16384-token step budget over max_batch rows, a power of two
    in [512, 8192]. Catches the flash chunk given to the jnp attention (its fp32 scores grow with T x S) and
    the budget dropped (B=8 x 8192-token chunks: 65536 tokens a step)."""
    from models.serving.options import default_prefill_chunk

    assert [default_prefill_chunk(True, b) for b in (1, 2, 3, 8, 32, 64)] == [8192, 8192, 4096, 2048, 512, 512]
    assert default_prefill_chunk(False, 1) == 512
    e = Engine(model, **{**STD, "prefill_chunk": None})
    assert (e.prefill_attention, e.prefill_chunk) == ("xla", 512)


def test_no_verify_call_behind_one_expected_to_end_the_row(model):
    """Guards: with MTP the host launched the next verify call while the row's fewest position after the call in
    flight (one token a step) was short of its end, though that call was expected to end the row: with every
    draft right, the first call of 8 verify steps makes ~15 tokens, and the second call behind it ran its 8
    steps for nothing (a prefill and two verify calls launched for 14 new tokens, the second landing after the
    request ended, in no one's stats; about half of all lengths end in such a call). The calls in flight are now
    credited with the acceptance seen so far."""
    e = Engine(model, **ONE_SLOT)
    prompt = _prompts(37, [5])
    plain = e.generate(prompt, max_new_tokens=40).tokens
    e.draft_oracle([prompt[0] + plain[0]], accept=1.0)
    seen = e.generate(prompt, max_new_tokens=40, use_mtp=True)  # the acceptance the engine has seen: ~1
    launched = e._sched.flights
    res = e.generate(prompt, max_new_tokens=14, use_mtp=True)
    e.draft_oracle(None)
    assert seen.tokens == plain and res.tokens == [plain[0][:14]]
    assert e._sched.flights - launched == 2  # the prefill and one verify call


@pytest.mark.full(
    "test_no_verify_call_behind_one_expected_to_end_the_row runs the oracle at accept 1 (its drafts accepted, the "
    "teacher-forced tokens kept) in the quick tier"
)
def test_draft_oracle_sets_the_acceptance_and_keeps_the_tokens(model):
    """The benchmark's oracle drafts (`Engine.draft_oracle`) on a random model, whose own drafts are noise: with
    every draft right (accept 1) nearly all are accepted, with none right almost none, and the tokens are the
    teacher-forced sequence's (plain greedy's) either way. Catches: oracle drafts standing for the wrong positions
    (acceptance near 0 at accept 1), a teacher-forced token taken from the wrong position."""
    e = Engine(model, **STD, decode_steps=2)
    prompts = _prompts(36, [3, 9, 5])
    plain = e.generate(prompts, max_new_tokens=16).tokens
    e.draft_oracle([p + t for p, t in zip(prompts, plain)], accept=1.0)
    right = e.generate(prompts, max_new_tokens=16, use_mtp=True)
    e.draft_oracle([p + t for p, t in zip(prompts, plain)], accept=0.0)
    wrong = e.generate(prompts, max_new_tokens=16, use_mtp=True)
    e.draft_oracle(None)
    assert right.tokens == plain and wrong.tokens == plain
    # the first drafts of a request come from the prefill (the model's own), the rest from the oracle
    assert right.stats["mtp_acceptance"] > 0.85, right.stats
    assert wrong.stats["mtp_acceptance"] < 0.15, wrong.stats
    with pytest.raises(ValueError, match="accept must be in"):
        e.draft_oracle([prompts[0]], accept=1.5)
