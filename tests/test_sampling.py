"""Sampler properties: filters never emit excluded tokens, seeds reproduce, temperature 0 is argmax,
and speculative rejection sampling leaves the target distribution exact (checked statistically)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.serving.sampling import (
    SamplingArrays,
    SamplingParams,
    filtered_probs,
    row_keys,
    sample,
    sample_from_probs,
    sampler_kind,
    speculative_accept,
)

V = 32
DRAWS = 16384  # one shape for every draw below: the sampler compiles once for the module


def _rows(params: SamplingParams, n: int) -> SamplingArrays:
    return SamplingArrays.from_params([params] * n)


def _keys(seed, n: int) -> jax.Array:
    return row_keys(jnp.broadcast_to(jax.random.PRNGKey(seed), (n, 2)), jnp.arange(n))


@jax.jit
def _sample_many(seed, logits_V, s: SamplingArrays):
    return sample(_keys(seed, DRAWS), jnp.broadcast_to(logits_V, (DRAWS, logits_V.shape[0])), s)


@pytest.fixture(scope="module")
def logits():
    return jax.random.normal(jax.random.PRNGKey(7), (V,), jnp.float32) * 2.0


def _draw(logits, params, seed=0):
    return np.asarray(_sample_many(jnp.uint32(seed), logits, _rows(params, DRAWS)))


# --- SamplingParams ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampler_kind():
    assert sampler_kind([SamplingParams(temperature=0.0)] * 2) == "greedy"
    assert sampler_kind([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]) == "random"
    assert sampler_kind([SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)]) == "filtered"


# --- greedy, seeds -------------------------------------------------------------------------------
def test_temperature_zero_is_argmax(logits):
    toks = _draw(logits, SamplingParams(temperature=0.0, top_k=5, top_p=0.5))
    assert (toks == int(jnp.argmax(logits))).all()
    # Ties go to the lowest index, like jnp.argmax.
    tied = jnp.zeros((V,)).at[3].set(1.0).at[9].set(1.0)
    assert (_draw(tied, SamplingParams(temperature=0.0)) == 3).all()


def test_fixed_seed_reproduces(logits):
    p = SamplingParams(temperature=1.0)
    a, b, c = _draw(logits, p, seed=1), _draw(logits, p, seed=1), _draw(logits, p, seed=2)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_temperature_matches_softmax(logits):
    toks = _draw(logits, SamplingParams(temperature=0.7))
    want = np.asarray(jax.nn.softmax(logits / 0.7))
    got = np.bincount(toks, minlength=V) / toks.size
    assert np.abs(got - want).max() < 0.02  # binomial std <= 0.004 at 16384 draws


# --- filters -------------------------------------------------------------------------------------
def test_top_k_never_emits_excluded(logits):
    for k in (1, 3, 10):
        toks = _draw(logits, SamplingParams(temperature=1.5, top_k=k))
        allowed = set(np.argsort(-np.asarray(logits))[:k].tolist())
        assert set(toks.tolist()) <= allowed
        if k > 1:
            assert len(set(toks.tolist())) > 1  # it does sample, not argmax


def test_top_p_never_emits_excluded(logits):
    T = 1.2
    p = np.asarray(jax.nn.softmax(logits / T), np.float64)
    order = np.argsort(-p)
    for top_p in (0.3, 0.75, 0.95):
        cum_before = np.cumsum(p[order]) - p[order]
        nucleus = set(order[cum_before < top_p].tolist())
        toks = _draw(logits, SamplingParams(temperature=T, top_p=top_p))
        assert set(toks.tolist()) <= nucleus
        assert set(toks.tolist()) == nucleus or len(nucleus) > 8  # small nuclei are fully visited


def test_min_p_never_emits_excluded(logits):
    p = np.asarray(jax.nn.softmax(logits), np.float64)
    for min_p in (0.05, 0.3):
        allowed = set(np.nonzero(p >= min_p * p.max())[0].tolist())
        toks = _draw(logits, SamplingParams(temperature=1.0, min_p=min_p))
        assert set(toks.tolist()) <= allowed


def test_filtered_probs_are_normalised_and_zero_outside(logits):
    s = SamplingArrays.from_params(
        [
            SamplingParams(temperature=1.0, top_k=4),
            SamplingParams(temperature=0.5, top_p=0.5),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=2.0),
        ]
    )
    probs = np.asarray(jax.jit(filtered_probs)(jnp.broadcast_to(logits, (4, V)), s))
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    assert (probs[0] > 0).sum() == 4
    assert (probs[2] == np.eye(V)[int(jnp.argmax(logits))]).all()
    assert (probs[3] > 0).all()
    # The unfiltered fast form equals the general one when no filter is on.
    fast = np.asarray(
        jax.jit(filtered_probs, static_argnames="filtered")(jnp.broadcast_to(logits, (4, V)), s, filtered=False)
    )
    np.testing.assert_allclose(fast[2:], probs[2:], rtol=1e-6)


def test_sample_from_probs_never_draws_zero_probability():
    probs = jnp.asarray([[0.0, 0.5, 0.0, 0.5]] * 2000)
    toks = np.asarray(jax.jit(sample_from_probs)(_keys(3, 2000), probs))
    assert set(toks.tolist()) == {1, 3}


# --- speculative rejection sampling ----------------------------------------------------------
def test_rejection_sampling_preserves_target_distribution():
    """d ~ q, accept with min(1, p/q), else resample from norm(max(p - q, 0)): the output is ~ p."""
    n, v = 200_000, 6
    p = jnp.asarray([0.05, 0.4, 0.1, 0.25, 0.2, 0.0])
    q = jnp.asarray([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])  # q puts mass where p has none
    k_d, k_a = jax.random.split(jax.random.PRNGKey(11))
    drafts = jax.random.categorical(k_d, jnp.log(q), shape=(n,)).astype(jnp.int32)
    keys = jax.random.split(k_a, n)
    acc, out = jax.jit(speculative_accept)(
        jax.random.key_data(keys) if keys.dtype != jnp.uint32 else keys,
        jnp.broadcast_to(p, (n, v)),
        jnp.broadcast_to(q, (n, v)),
        drafts,
    )
    out, acc = np.asarray(out), np.asarray(acc)
    hist = np.bincount(out, minlength=v) / n
    # Binomial std is <= 0.0012 here; 0.006 is five of them.
    assert np.abs(hist - np.asarray(p)).max() < 0.006, hist
    assert hist[5] == 0.0  # never a token p excludes
    # Acceptance rate is sum(min(p, q)).
    assert abs(acc.mean() - float(jnp.minimum(p, q).sum())) < 0.006
    # Accepted outputs are the drafts.
    assert (out[acc] == np.asarray(drafts)[acc]).all()


def test_rejection_sampling_greedy_is_exact():
    """One-hot p and q (temperature 0): accept iff the draft is the argmax, else emit the argmax."""
    v = 8
    p = jnp.asarray(np.eye(v, dtype=np.float32)[[2, 2, 5, 0]])
    drafts = jnp.asarray([2, 3, 5, 7], jnp.int32)
    q = jax.nn.one_hot(drafts, v)
    acc, out = jax.jit(speculative_accept)(_keys(0, 4), p, q, drafts)
    np.testing.assert_array_equal(np.asarray(acc), [True, False, True, False])
    np.testing.assert_array_equal(np.asarray(out), [2, 2, 5, 0])
