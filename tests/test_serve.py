"""The online engine API (`Engine.submit` / `step` / `RequestHandle` / `warm_up`), mixed steps (prompt chunks
and decode rows in one step) against the alternating scheduler, a soak of it (requests that arrive, stop and are
cancelled while others run: each one's greedy tokens equal to running it alone, every page back, no compilation
after warm-up), and `mla-bench serve --config tiny`.

One engine for the module, the one `mla-bench serve --config tiny` builds (a tiny float32 V2-Lite-kind model,
4 slots, 16-token pages, 32-token prefill chunks, mixed steps of 32 prompt tokens, 2 decode steps a call,
max_context 120): one prefill bucket, one block-table width, one mixed step shape, decode loops of 1 and 2 steps,
so the module compiles four step programs and the benchmark's run (last) finds them compiled. A request out of
pages fails alone through the same scheduler code as in `generate`
(tests/test_engine.py::test_out_of_pages_fails_one_request_and_spares_the_others).
"""

import json

import numpy as np
import pytest
from flax import nnx

from benchmarks import bench_serve
from mla_jax import ModelConfig
from models import DeepSeekModel
from models.serving.engine import Engine, RequestHandle, trace_counts

TINY_ARGS = ["--config", "tiny"]


def _args(extra=()):
    return bench_serve.resolve(bench_serve.parser().parse_args(TINY_ARGS + list(extra)))


@pytest.fixture(scope="module")
def engine():
    # NaN in never-written cache rows: a row read by the wrong request, or past its length, would show.
    return bench_serve.build_engine(_args(), cache_fill=float("nan"))[0]


VOCAB = ModelConfig.tiny().vocab_size


def _prompt(rng, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, VOCAB, n)]


@pytest.fixture(autouse=True)
def _no_request_left(engine):
    """A failed test leaves no request running into the next."""
    yield
    for rid in list(engine._sched.requests):
        engine._sched.abort(rid)


@pytest.fixture(scope="module")
def alone(engine):
    """Tokens of one request run alone through `engine.generate` (memoised per request)."""
    memo = {}

    def run(prompt, max_new_tokens, stops=()):
        key = (tuple(prompt), max_new_tokens, tuple(stops))
        if key not in memo:
            res = engine.generate([prompt], max_new_tokens=max_new_tokens, stop_tokens=stops)
            memo[key] = res.tokens[0]
        return memo[key]

    return run


def _pages_consistent(e: Engine) -> bool:
    """Every slot holds exactly the pages of a request in it (none for a free slot), and the pool's count
    agrees."""
    c, sched = e.cache, e._sched
    held = [len(c.pages_of(b)) for b in range(c.max_seqs)]
    return all(h == 0 for h, s in zip(held, sched.slots) if s is None) and sum(held) == c.pages_used


def test_requests_arriving_mid_batch_equal_their_runs_alone(engine, alone):
    """Requests submitted while others decode, each with its own length and stop ids, read three ways
    (iterator, callback, result()). Two copies of one prompt decode side by side, one with a stop id taken
    from their common output, and two copies of another with different lengths. Catches: one row's stop ids
    or token budget applied to another (the decode loop's per-row stops), a row admitted mid-batch writing
    over another's pages, a token delivered to the wrong callback or twice."""
    rng = np.random.default_rng(0)
    p0, p2, p3, p4, p5 = (_prompt(rng, n) for n in (5, 3, 9, 14, 2))
    stop = alone(p2, 16)[4]
    prompts = [p2, p2, p0, p0, p3, p4, p5]
    news = [16, 16, 12, 5, 9, 5, 20]
    stops = [(), (stop,), (), (), (), (), ()]
    want = [alone(p, n, s) for p, n, s in zip(prompts, news, stops)]
    assert want[1] == want[0][: want[0].index(stop) + 1] and len(want[0]) == 16 and want[3] == want[2][:5]
    seen = {}
    handles: list[RequestHandle] = []

    def submit(i):
        cb = seen.setdefault(i, []).append
        handles.append(engine.submit(prompts[i], max_new_tokens=news[i], stop_tokens=stops[i], on_token=cb))

    for i in range(4):
        submit(i)
    while not all(len(h.output) > 1 for h in handles):  # past their first token when the next arrive
        engine.step()
    for i in range(4, 7):  # they wait for slots, then run beside the first wave's survivors
        submit(i)
    assert engine.num_requests == 7 - sum(h.done for h in handles)
    streamed = list(handles[6].tokens())  # steps the engine until request 6 ends (it waited for a slot)
    results = [h.result() for h in handles]
    assert [r.tokens for r in results] == want
    assert streamed == want[6] and [seen[i] for i in range(7)] == want
    assert [r.finish_reason for r in results] == ["length", "stop"] + ["length"] * 5
    assert engine.num_requests == 0 and engine.cache.pages_used == 0 and not engine.step()


def test_cancel_frees_its_pages_and_spares_the_others(engine, alone):
    """A running request and a waiting one cancelled; a request stopped from its own callback. Catches: a
    cancelled slot keeping its pages (or its slot), a waiting request left in the queue, the next occupant of
    a cancelled slot reading the old request's state, a cancel that touched another request."""
    rng = np.random.default_rng(1)
    prompts = [_prompt(rng, n) for n in (6, 13, 4, 8, 10, 7)]
    n_new = 14
    h = [engine.submit(p, max_new_tokens=n_new) for p in prompts]  # 4 run, 2 wait
    while len(h[1].output) < 2:  # prefill (two chunks for the 13 tokens), then a decode call
        engine.step()
    running, waiting = h[1], h[5]
    held = len(engine.cache.pages_of(1))
    used = engine.cache.pages_used
    assert held > 0 and engine._sched.slots[1].request is running._r
    assert running.cancel() and waiting.cancel() and not running.cancel()
    assert engine.cache.pages_used == used - held and engine._sched.slots[1] is None
    assert running.finish_reason == waiting.finish_reason == "cancelled" and waiting.output == []
    cut = []

    def stop_after_3(tok):
        cut.append(tok)
        if len(cut) == 3:
            late.cancel()

    late = engine.submit(prompts[2], max_new_tokens=n_new, on_token=stop_after_3)
    engine.run_until_idle()
    ref = {i: alone(prompts[i], n_new) for i in range(6)}
    for i in (0, 2, 3, 4):
        assert h[i].result().tokens == ref[i], i
    assert running.output == ref[1][: len(running.output)] and 1 < len(running.output) < n_new
    assert late.finish_reason == "cancelled" and cut == ref[2][:3] and late.output[:3] == ref[2][:3]
    assert engine.cache.pages_used == 0 and _pages_consistent(engine)


def test_a_request_whose_callback_raises_ends_alone(engine, alone):
    """Catches: an exception from one request's callback that leaves the other rows of that step un-advanced
    (their tokens lost or repeated) or the failed request's pages held."""
    rng = np.random.default_rng(2)
    pa, pb = _prompt(rng, 5), _prompt(rng, 7)
    want = alone(pa, 6)

    def boom(tok):
        raise RuntimeError("consumer gone")

    a = engine.submit(pa, max_new_tokens=6)
    b = engine.submit(pb, max_new_tokens=6, on_token=boom)
    with pytest.raises(RuntimeError, match="consumer gone"):
        engine.run_until_idle()
    assert b.finish_reason == "error" and b.error == "on_token raised RuntimeError: consumer gone"
    assert len(b.output) == 1 and engine.cache.pages_of(1) == []
    assert a.result().tokens == want
    assert engine.cache.pages_used == 0


def test_generate_runs_beside_online_requests(engine, alone):
    """generate() queues into the same batch: an online request submitted before it advances during the call
    and both give their alone tokens. Catches: generate() resetting the scheduler (or the pool) under a
    running request."""
    rng = np.random.default_rng(3)
    p_online, p_batch = _prompt(rng, 9), [_prompt(rng, n) for n in (4, 6)]
    want_online, want_batch = alone(p_online, 20), [alone(p, 5) for p in p_batch]
    h = engine.submit(p_online, max_new_tokens=20)
    engine.step()
    res = engine.generate(p_batch, max_new_tokens=5)
    assert res.tokens == want_batch
    assert not h.done and len(h.output) > 1
    assert h.result().tokens == want_online and engine.cache.pages_used == 0


@pytest.fixture
def alternating(engine):
    """The engine with mixed steps off for the test (a prefill step makes the decoding rows wait)."""
    engine.mixed_steps = False
    yield engine
    engine.mixed_steps = True


def _sync_step(e: Engine) -> None:
    """One engine step, then its call read back (`drain`): the state a step leaves without the lane's overlap,
    where the step-by-step assertions below are made."""
    e.step()
    e._sched.drain()


def _prefilled(e: Engine, h: RequestHandle) -> int:
    """Prompt tokens of request h in the cache (it must be in a slot)."""
    return next(s.prefilled for s in e._sched.slots if s is not None and s.req == h.id)


def test_mixed_steps_feed_every_decoding_row_while_prompts_prefill(engine, alone):
    """A row decodes while a 70-token and a 10-token prompt arrive (the budget: 32 prompt tokens a step, in rows of
    MIXED_TILE = 4). Every step advances the decoding row by one token while the prompts prefill, first come first
    served: 32 + 32 tokens of the long one, then its last 6 and the short one's 10 in one step, where both make
    their first token. Catches: a decoding row left out of a step while a prompt prefills (starved), a budget
    exceeded or not shared in arrival order, a chunk cut over several rows that attends wrongly (its rows not
    seeing each other's latents, a piece's block table or positions off), a first token sampled from the wrong
    row, a decoding row's token from a padding query; and tokens that differ from the runs alone."""
    rng = np.random.default_rng(5)
    pa, pl, ps = _prompt(rng, 4), _prompt(rng, 70), _prompt(rng, 10)
    assert engine.prefill_budget == 32 and engine.mixed_steps
    a = engine.submit(pa, max_new_tokens=30)
    _sync_step(engine)  # its prefill (no row decodes: a prefill step)
    assert len(a.output) == 1
    long_, short = engine.submit(pl, max_new_tokens=5), engine.submit(ps, max_new_tokens=5)
    with engine.recording() as st:
        seen = []
        for _ in range(3):
            n = len(a.output)
            _sync_step(engine)
            seen.append((len(a.output) - n, _prefilled(engine, long_), _prefilled(engine, short)))
    assert seen == [(1, 32, 0), (1, 64, 0), (1, 70, 10)], seen
    assert len(long_.output) == len(short.output) == 1
    assert (st.mixed_steps, st.prefill_steps, st.decode_calls) == (3, 0, 0)
    assert st.prefill_tokens == 80 and st.decode_tokens == 3
    got = [h.result().tokens for h in (a, long_, short)]
    assert got == [alone(pa, 30), alone(pl, 5), alone(ps, 5)]
    assert engine.num_requests == 0 and engine.cache.pages_used == 0 and _pages_consistent(engine)


def test_alternating_steps_give_the_same_tokens(alternating, alone):
    """The same arrivals with `mixed_steps=False`: the decoding row waits through the three prefill steps of the
    70-token prompt (32-token chunks; the 10-token one beside its first chunk) and every token equals the mixed
    run's (both equal the runs alone). Catches: the option ignored, or the alternating scheduler broken by the
    mixed one (its prefill steps, its decode rows' pages)."""
    e = alternating
    rng = np.random.default_rng(5)
    pa, pl, ps = _prompt(rng, 4), _prompt(rng, 70), _prompt(rng, 10)
    a = e.submit(pa, max_new_tokens=30)
    _sync_step(e)
    long_, short = e.submit(pl, max_new_tokens=5), e.submit(ps, max_new_tokens=5)
    with e.recording() as st:
        waited = []
        for _ in range(3):
            n = len(a.output)
            _sync_step(e)
            waited.append(len(a.output) - n)
    assert waited == [0, 0, 0] and st.prefill_steps == 3 and st.mixed_steps == 0
    got = [h.result().tokens for h in (a, long_, short)]
    assert got == [alone(pa, 30), alone(pl, 5), alone(ps, 5)]
    assert e.cache.pages_used == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt=[]), r"^prompt is empty"),
        (dict(prompt=[1, VOCAB]), rf"^prompt holds token id {VOCAB} outside the vocabulary"),
        (dict(prompt="hi"), r"^prompt must be a list of token ids, got str$"),
        (dict(prompt=[1] * 121), r"^prompt has 121 tokens, beyond max_context=120$"),
        (dict(prompt=[1], max_new_tokens=0), r"^max_new_tokens must be an integer >= 1, got 0$"),
        (dict(prompt=[1], sampling=0.5), r"^sampling must be a SamplingParams, got 0.5$"),
        (dict(prompt=[1], stop_tokens=[1.5]), r"^stop_tokens must be integers, got 1.5$"),
        (dict(prompt=[1], stop_tokens=3), r"^stop_tokens must be a sequence of token ids, got 3$"),
        (dict(prompt=[1], on_token=3), r"^on_token must be a callable on_token\(token_id\), got 3$"),
        (dict(prompt=[1], mtp_draft_tokens=5), r"^mtp_draft_tokens must be an integer in \[1, 3\]"),
        (dict(prompt=[1], use_mtp=True), r"^use_mtp=True but the model has no MTP module"),
    ],
)
def test_bad_submit_arguments_are_one_line_naming_the_value(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.submit(**kwargs)
    assert engine.num_requests == 0


def test_one_mtp_setting_while_requests_run():
    """MTP drafts live per slot in one [B, k] state: a request with another k while others wait or run is
    refused (naming both), and accepted once the engine is idle. Catches: draft state reshaped under running
    rows. (A model with an MTP module, abstract: nothing runs.)"""
    model = nnx.eval_shape(lambda: DeepSeekModel(ModelConfig.tiny().replace(num_hidden_layers=2), rngs=nnx.Rngs(0)))
    e = Engine(model, page_size=4, num_pages=8, max_batch=2)
    h = e.submit([1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^use_mtp=True, mtp_draft_tokens=2 while 1 request\(s\) run with no MTP"):
        e.submit([1, 2], use_mtp=True, mtp_draft_tokens=2)
    with pytest.raises(ValueError, match="one MTP setting"):
        e.generate([[1, 2]], use_mtp=True)
    assert h.cancel() and e.num_requests == 0 and e.cache.pages_used == 0
    assert e.submit([1, 2], use_mtp=True, mtp_draft_tokens=2)._engine._sched.k == 2


def test_soak_arrivals_and_departures(engine, alone):
    """Engine steps with requests arriving (a random number each step; a prompt in five longer than a mixed step's
    budget), stopping and being cancelled through the online API, after `Engine.warm_up`; arrivals while others
    decode make mixed steps. Catches: a step shape warm_up misses (the mixed step's included) or one that drifts
    with the batch's make-up (a compilation after warm-up), a request whose tokens depend on what else runs (a
    slot's stale state, a page shared or freed early, a mixed step's piece rows), a page lost (the pool shrinking
    over time)."""
    rng = np.random.default_rng(4)
    engine.warm_up()  # every step shape, run on idle rows
    assert engine.warm_up() == 0 and engine.cache.pages_used == 0
    before = trace_counts()
    free0 = engine.cache.pages_used
    reqs = []  # (handle, prompt, max_new_tokens, stops)
    steps = 0
    with engine.recording() as stats:
        while len(reqs) < 20 or engine.num_requests:
            for _ in range(rng.poisson(0.35) if len(reqs) < 20 else 0):
                p = _prompt(rng, int(rng.integers(1, 24 if rng.random() < 0.8 else 90)))
                n = int(rng.integers(1, 24))
                stops = (int(rng.integers(0, VOCAB)),) if rng.random() < 0.5 else ()
                reqs.append((engine.submit(p, max_new_tokens=n, stop_tokens=stops), p, n, stops))
            if rng.random() < 0.04:
                running = [h for h, *_ in reqs if not h.done]
                if running:
                    running[int(rng.integers(len(running)))].cancel()
            engine.step()
            steps += 1
            assert _pages_consistent(engine)
    assert trace_counts() == before, "a step compiled after warm-up"
    assert stats.mixed_steps >= 5 and stats.prefill_steps >= 1 and stats.decode_calls >= 1, dict(stats)
    assert engine.cache.pages_used == free0 == 0
    cancelled = 0
    for h, p, n, stops in reqs:
        ref = alone(p, n, stops)
        if h.finish_reason == "cancelled":
            cancelled += 1
            assert h.output == ref[: len(h.output)]
        else:
            assert h.finish_reason in ("length", "stop") and h.output == ref, (h, p, n, stops)
    assert cancelled >= 1 and steps > 40
    print(f"soak: {steps} engine steps ({stats.mixed_steps} mixed), {len(reqs)} requests, {cancelled} cancelled")


def test_mla_bench_serve_tiny(tmp_path, engine):
    """`mla-bench serve --config tiny` end to end (after the tests above: its steps are compiled). Catches: a
    request lost, a request whose float32 greedy tokens differ from its run alone, a measured rate that
    compiled, a percentile or rate computed wrong (TTFT p50 > p99, no tokens), a missing output file; in its
    soak (--soak-steps): a compilation, a lost request, a page left held, a checked request unlike its run alone."""
    soak = ["--soak-steps", "60", "--soak-arrivals", "0.4", "--soak-check", "4"]
    rows = bench_serve.main(TINY_ARGS + ["--out", str(tmp_path), "--compile-cache", "off", *soak])
    assert [r["rate"] for r in rows] == [4.0, 16.0]
    for r in rows:
        assert r["lost"] == 0 and r["compiles"] == 0 and r["alone_match"] == "4/4" and r["alone_agree"] == 1.0, r
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and 0 <= r["itl_p50_ms"] <= r["itl_p99_ms"], r
        assert r["req_s"] > 0 and r["out_tok_s"] > r["req_s"] and r["decode_ms_step"] > 0, r
    report = json.loads((tmp_path / "serve.json").read_text())
    assert len(report["requests"]) == 12 and report["rows"][0]["requests"] == 12
    assert (tmp_path / "serve.csv").read_text().count("\n") == 3 and (tmp_path / "serve.png").stat().st_size > 0
    soaked = json.loads((tmp_path / "soak.json").read_text())
    assert soaked["engine_steps"] >= 60 and soaked["requests"] >= 10 and soaked["mixed_steps"] > 0, soaked
    assert soaked["compiles"] == soaked["lost"] == soaked["pages_in_use_after"] == 0 and soaked["compiled"] == [], (
        soaked
    )
    assert soaked["alone_match"] == "4/4" and soaked["alone_unexplained"] == soaked["alone_ties"] == 0, soaked
    assert soaked["complete"] is True, soaked


def test_near_tie_judge_tells_rounding_from_a_real_difference():
    """`NearTieJudge` on a tiny bf16 model: the nearest float32 competitor of the greedy token is a near tie (bf16
    rounding can order the two either way), a token ranked last is not. Catches a judge that calls every
    difference a tie (the bf16 soak would pass whatever the engine did), one that calls none (every bf16 run
    fails), or one that judges the wrong position (a teacher-forced prefix off by one)."""
    import jax.numpy as jnp

    from benchmarks.e2e_models import build_model

    cfg = ModelConfig.tiny()
    model, _ = build_model(cfg, jnp.bfloat16)
    judge = bench_serve.NearTieJudge(model, bucket=16)
    rng = np.random.default_rng(0)
    prompt = _prompt(rng, 11)
    ref = _prompt(rng, 6)  # teacher forcing takes any tokens as the run alone's
    j = 3
    ids = prompt + ref[:j]
    exact = judge.logits(ids, len(ids) - 1, exact=True)
    own = judge.logits(ids, len(ids) - 1, exact=False)
    err = float(np.max(np.abs(own - exact)))
    assert 0 < err < 0.1 * float(np.ptp(exact)), err  # bf16 differs from float32, by little
    order = np.argsort(exact)
    top, worst = int(order[-1]), int(order[0])
    k = int(np.argmin(np.diff(exact[order])))  # the two tokens closest in float32: far within bf16's error
    a, b = int(order[k + 1]), int(order[k])
    assert exact[a] - exact[b] < 0.1 * err
    ref = ref[:j] + [top] + ref[j + 1 :]
    assert judge(prompt, ref, list(ref)) is None
    far = judge(prompt, ref, ref[:j] + [worst] + ref[j + 1 :])
    assert far["position"] == j and not far["tie"] and far["logit_gap"] == pytest.approx(exact[top] - exact[worst])
    near = judge(prompt, ref[:j] + [a], ref[:j] + [b])
    assert near["position"] == j and near["tie"] and 0 <= near["logit_gap"] < near["logit_error"], near
    shifted = judge(prompt, ref[: j - 1] + [a, a], ref[: j - 1] + [b, a])  # the same tokens one position earlier
    assert shifted["position"] == j - 1
    checked = bench_serve.check_alone([(prompt, ref[:j] + [worst], ref[: j + 1])], judge)
    assert checked["alone_unexplained"] == 1 and checked["alone_ties"] == 0 and checked["alone_match"] == "0/1"
    unjudged = bench_serve.check_alone([(prompt, ref[:j] + [b], ref[:j] + [a])], None)
    assert unjudged["alone_unexplained"] == 1  # float32 runs: every difference counts


def _float32_twin(model):
    """A float32 copy of `model` (every weight upcast whole, float32 compute): the judge's former exact pass,
    cheap at the tiny config, the oracle of the one it has now."""
    import jax
    import jax.numpy as jnp

    make = lambda: DeepSeekModel(model.cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)  # noqa: E731
    graphdef = nnx.split(nnx.eval_shape(make))[0]
    up = lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    return nnx.merge(graphdef, jax.tree.map(up, nnx.state(model)))


@pytest.mark.full(
    "test_near_tie_judge_tells_rounding_from_a_real_difference (the verdicts) and "
    "test_near_tie_judge_holds_no_float32_copy_of_a_stack (the layer-at-a-time pass) run in the quick tier"
)
def test_near_tie_judge_equals_the_float32_twin():
    """The judge's exact pass (float32 compute over the model's bf16 weights, upcast a layer at a time) against a
    float32 twin of the model (its weights upcast whole, called as `model(ids)`, not through the judge): the same
    logit gaps to 1e-5 and the same verdicts, for a near tie, a far difference and one a position earlier. Catches
    an exact pass that computes anything in bf16 (its gaps off by bf16's error, verdicts flipped) or reads
    another position."""
    import jax.numpy as jnp

    from benchmarks.e2e_models import build_model

    model, _ = build_model(ModelConfig.tiny(), jnp.bfloat16)
    twin = _float32_twin(model)
    judge = bench_serve.NearTieJudge(model, bucket=16)
    rng = np.random.default_rng(1)
    prompt, ref = _prompt(rng, 9), _prompt(rng, 5)
    for j in (1, 3):
        ids = prompt + ref[:j]
        exact = np.asarray(twin(jnp.asarray([ids]))[0, -1], np.float64)
        own = np.asarray(model(jnp.asarray([ids]))[0, -1].astype(jnp.float32), np.float64)
        np.testing.assert_allclose(judge.logits(ids, len(ids) - 1, exact=True), exact, rtol=1e-5, atol=1e-6)
        err = float(np.max(np.abs(own - exact)))
        order = np.argsort(exact)
        k = int(np.argmin(np.diff(exact[order])))
        for a, b in ((int(order[k + 1]), int(order[k])), (int(order[-1]), int(order[0]))):
            verdict = judge(prompt, ref[:j] + [a], ref[:j] + [b])
            gap = exact[a] - exact[b]
            assert verdict["position"] == j and verdict["logit_gap"] == pytest.approx(gap, rel=1e-5, abs=1e-6)
            assert verdict["logit_error"] == pytest.approx(err, rel=1e-3) and verdict["tie"] == (abs(gap) <= 2 * err)


def test_near_tie_judge_holds_no_float32_copy_of_a_stack():
    """The judge's exact pass as compiled (XLA's memory analysis on the CPU), on a tiny bf16 model of 7 MoE
    layers: its arguments are the model's own bf16 weights, its temporaries less than half the MoE stack in
    float32 (one layer's weights upcast at a time, whatever the depth), its output the logits alone. Catches
    the float32 twin (twice the weights as arguments: V2-Lite's 63 GB, out of memory on an 80 GB H100), an
    upcast XLA hoists out of the scan (a whole stack in float32 among the temporaries) and a program that
    returns the model's state (nnx.jit's: a copy of every weight as output)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.e2e_models import build_model, model_config

    cfg = model_config("v2-lite", config="tiny", layers=8)
    model, _ = build_model(cfg, jnp.bfloat16)
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    stack_f32 = 2 * sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.moe_layers)))
    judge = bench_serve.NearTieJudge(model, bucket=16)
    m = judge.lower(16).compile().memory_analysis()
    assert m.argument_size_in_bytes <= weights + 1024, (m.argument_size_in_bytes, weights)
    assert m.temp_size_in_bytes < stack_f32 / 2, (m.temp_size_in_bytes, stack_f32)
    assert m.output_size_in_bytes <= 4 * cfg.vocab_size + 1024, m.output_size_in_bytes


def _serve_failing(tmp_path, monkeypatch, target: str, fail_on: int):
    """`mla-bench serve --config tiny` (two rates, 4 requests checked) whose `target` raises an out-of-memory
    error on its call number `fail_on` (1-based) -> (the SystemExit, serve.json or None, serve.csv's rows)."""
    real, calls = getattr(bench_serve, target), []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == fail_on:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 63.00GiB.\nmore detail")
        return real(*a, **k)

    monkeypatch.setattr(bench_serve, target, flaky)
    with pytest.raises(SystemExit) as exc:
        bench_serve.main(TINY_ARGS + ["--out", str(tmp_path), "--compile-cache", "off"])
    path = tmp_path / "serve.json"
    report = json.loads(path.read_text()) if path.exists() else None
    import benchmarks as bm

    rows = bm.read_csv(str(tmp_path / "serve.csv")) if (tmp_path / "serve.csv").exists() else []
    return exc.value, report, rows


def test_serve_check_that_fails_keeps_the_rates(tmp_path, monkeypatch, engine):
    """The greedy check against runs alone ran out of device memory on an 80 GB H100 (its float32 twin of
    V2-Lite), and the run died with a traceback before writing serve.json: every rate's figures were lost. Now
    serve.json holds both rates' rows and the check's error, and the run exits non-zero with one line."""
    err, report, rows = _serve_failing(tmp_path, monkeypatch, "check_alone", 1)
    assert isinstance(err.code, str) and "\n" not in err.code, err.code
    assert err.code.startswith(
        "serve: error: the greedy check against runs alone failed: RuntimeError: RESOURCE_EXHAUSTED: Out of memory"
    ), err.code
    assert report is not None and [r["rate"] for r in report["rows"]] == [4.0, 16.0]
    assert all(r["out_tok_s"] > 0 and r["lost"] == 0 for r in report["rows"]), report["rows"]
    assert report["check"]["error"].startswith("RuntimeError: RESOURCE_EXHAUSTED") and not report["complete"]
    assert [r["rate"] for r in rows] == [4.0, 16.0] and (tmp_path / "serve.png").stat().st_size > 0


def test_serve_rate_that_fails_keeps_the_rates_before(tmp_path, monkeypatch, engine):
    """A rate that fails (out of device memory in a step) after one that ran: serve.json and serve.csv hold the
    first rate's figures and the second's row with its error, and the run exits non-zero with one line naming
    the rate (it lost every figure with a traceback)."""
    err, report, rows = _serve_failing(tmp_path, monkeypatch, "serve", 2)
    assert isinstance(err.code, str) and "\n" not in err.code, err.code
    assert err.code.startswith("serve: error: rate 16/s failed: RuntimeError: RESOURCE_EXHAUSTED"), err.code
    first, failed = report["rows"]
    assert first["rate"] == 4.0 and first["out_tok_s"] > 0 and "error" not in first
    assert failed["rate"] == 16.0 and failed["error"].startswith("RuntimeError: RESOURCE_EXHAUSTED")
    assert report["check"] is None and [r["rate"] for r in rows] == [4.0, 16.0] and rows[1]["error"]


def test_decode_config_reaches_the_engine_by_name():
    """`--decode-config NAME` (a name of `mla-bench mla_decode --variants`) builds the engine with that decode-kernel
    config, and an unknown name is one line naming the known ones. Catches the flag parsed but not passed on."""
    engine, *_ = bench_serve.build_engine(_args(["--decode-config", "pieces4"]))
    assert engine.decode_config.schedule == "pieces" and engine.decode_config.pieces_per_share == 4
    assert bench_serve.build_engine(_args())[0].decode_config is None
    with pytest.raises(SystemExit, match=r"^unknown --decode-config 'scorer2'; known: plain, split_qk, .*pieces4"):
        bench_serve.build_engine(_args(["--decode-config", "scorer2"]))


def test_serve_on_a_model_too_large_for_the_device_is_one_line(tmp_path, monkeypatch):
    """`mla-bench serve` whose model's bf16 weights alone exceed the device (here 1 MiB): `serve: error: the bf16
    weights need ...` in one line before anything is built (a traceback). Catches the planner's refusal
    escaping as an exception."""
    from benchmarks import e2e_models

    monkeypatch.setattr(e2e_models, "device_bytes_limit", lambda *a: 1 << 20)
    with pytest.raises(SystemExit) as exc:
        bench_serve.main(TINY_ARGS + ["--dtype", "bf16", "--out", str(tmp_path), "--compile-cache", "off"])
    msg = exc.value.code
    assert isinstance(msg, str) and "\n" not in msg and msg.startswith("serve: error: the bf16 weights need "), msg
