"""Training: the loss goes down, every parameter learns, the router bias moves only by its rule, padding is inert."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from micro_configs import MICRO_V3  # noqa: E402

from models import DeepSeekModel, RouterBias, RouterOutput
from models.training.step import (
    TrainConfig,
    chunked_cross_entropy,
    init_train_state,
    loss_fn,
    make_train_step,
    moe_modules,
    positions_from_mask,
    sequence_balance_loss,
)

CFG = MICRO_V3.replace(vocab_size=48)
B, T = 2, 16
GAMMA = 1e-3
TC = TrainConfig(mtp_weight=0.3, balance_alpha=1e-2, bias_update_rate=GAMMA)


def init_model(cfg, seed=0, **model_kw):
    """Random weights without paying for a compiled init: norms 1, bias 0, matrices N(0, 1/fan_in).
    `model_kw` go to DeepSeekModel (dtype, param_dtype)."""
    abstract = nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0), **model_kw))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)

    def fill(path, s):
        name = jax.tree_util.keystr(path)
        if "e_score_correction_bias" in name:
            return jnp.zeros(s.shape, s.dtype)
        if len(s.shape) == 1:
            return jnp.ones(s.shape, s.dtype)
        scale = 1.0 if "embedding" in name else 1.0 / np.sqrt(s.shape[-2])
        return jnp.asarray(rng.standard_normal(s.shape) * scale, s.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def make_batch(seed=0):
    ids = jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size, dtype=jnp.int32)
    mask = jnp.ones((B, T), jnp.int32).at[1, -3:].set(0)  # row 1 right-padded by 3
    return {"input_ids": ids, "attention_mask": mask}


def biases(state):
    """Each MoE layer's router bias [E], in the order of the loss's routers (the stacked main MoE
    layers' [n, E] row by row, then the MTP block's)."""
    leaves = jax.tree.leaves(nnx.state(nnx.merge(*state), RouterBias))
    # copies: a numpy view of a CPU buffer would pin it, and the next step could not donate it
    return [row for v in leaves for row in np.array(v, copy=True).reshape(-1, CFG.n_routed_experts)]


@pytest.fixture(scope="module")
def run():
    """Five steps of adamw (with weight decay, which would move the bias if the optimizer saw it)."""
    model = init_model(CFG)
    tx = optax.adamw(3e-3, weight_decay=0.1)
    graphdef, state, opt_state = init_train_state(model, tx)
    step = make_train_step(tx, TC)
    batch = make_batch()
    history = []
    passed_in = jax.tree.leaves((state, opt_state))
    donated = None
    for i in range(5):
        if i == 1:  # what the first step was given: donated, so deleted by the call
            donated = [x.is_deleted() for x in passed_in]
        before = biases((graphdef, state))
        state, opt_state, metrics = step(graphdef, state, opt_state, batch)
        history.append((before, biases((graphdef, state)), jax.device_get(metrics)))
    return graphdef, state, opt_state, history, batch, donated


def test_train_steps_lower_the_loss(run):
    graphdef, state, opt_state, history, batch, _ = run
    losses = [float(m["loss"]) for _, _, m in history]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], losses
    m = history[0][2]
    assert set(m) >= {"loss", "ce", "mtp_loss", "balance_loss", "expert_load", "grad_norm"}
    assert m["mtp_loss"] > 0 and m["balance_loss"] > 0
    # Loads count only real tokens: K per valid token (main MoE layer), K per valid MTP position.
    valid = int(batch["attention_mask"].sum())
    K = CFG.num_experts_per_tok
    assert m["expert_load"].shape == (2, CFG.n_routed_experts)  # 1 main MoE layer + the MTP block
    assert m["expert_load"][0].sum() == K * valid
    assert m["expert_load"][1].sum() == K * (valid - B)
    # The optimizer state holds no router bias.
    n_bias = sum(int(np.prod(b.shape)) for b in history[0][0])
    n_params = sum(x.size for x in jax.tree.leaves(nnx.split_state(state, nnx.Param, ...)[0]))
    assert sum(x.size for x in jax.tree.leaves(opt_state)) == 2 * n_params + 1  # adam mu, nu, count
    assert n_bias == 2 * CFG.n_routed_experts


def test_train_step_donates_state_and_opt_state(run):
    """The jitted step donates the model state and the optimizer state (their buffers become the updated
    ones): catches `donate_argnums` dropped from `make_train_step`, which keeps two copies of the
    parameters and the AdamW moments alive across the step."""
    donated = run[-1]
    assert donated and all(donated), donated


def test_router_bias_moves_only_by_the_update_rule(run):
    *_, history, _, _ = run
    moved = 0
    for before, after, m in history:
        assert all(a.dtype == np.float32 for a in after)
        for b0, b1, load in zip(before, after, m["expert_load"]):
            want = b0 + np.float32(GAMMA) * np.sign(load.mean() - load).astype(np.float32)
            np.testing.assert_array_equal(b1, want)
            step = np.abs(b1 - b0)
            assert np.all(np.isclose(step, GAMMA, rtol=1e-3) | (step == 0))
            moved += int(np.count_nonzero(step))
    assert moved > 0


def test_every_trainable_parameter_gets_a_gradient(run):
    """Every Param's AdamW first moment (an average of its gradients over the run's five steps) is
    nonzero somewhere: a parameter the loss does not reach keeps mu = 0 exactly. (The run's own step
    computes the gradients: no second backward pass is compiled.)"""
    graphdef, state, opt_state, history, _, _ = run
    # Precondition: every expert of every MoE layer got a token (else its zero gradient is right).
    loads = sum(np.asarray(m["expert_load"]) for *_, m in history)
    assert np.all(loads > 0), loads
    params = nnx.split_state(state, nnx.Param, ...)[0]
    (mu,) = [
        s.mu
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    flat = jax.tree_util.tree_leaves_with_path(mu)
    assert len(flat) == len(jax.tree.leaves(params))
    dead = [jax.tree_util.keystr(p) for p, g in flat if not np.any(np.asarray(g) != 0)]
    assert not dead, dead


def test_padding_is_inert():
    """Left vs right padding, and whatever token ids fill the pads, give the same losses and loads."""
    model = init_model(CFG, seed=2)
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda s, b: loss_fn(nnx.merge(graphdef, s), b, TC)[1])
    ids = jax.random.randint(jax.random.key(3), (B, T), 0, CFG.vocab_size, dtype=jnp.int32)
    n = T - 5
    right = ids.at[1, n:].set(7)
    left = ids.at[1].set(jnp.concatenate([jnp.full((T - n,), 11, jnp.int32), ids[1, :n]]))
    mask_r = jnp.ones((B, T), jnp.int32).at[1, n:].set(0)
    mask_l = jnp.ones((B, T), jnp.int32).at[1, : T - n].set(0)
    a = f(state, {"input_ids": right, "attention_mask": mask_r, "loss_mask": mask_r})
    b = f(state, {"input_ids": left, "attention_mask": mask_l, "loss_mask": jnp.ones((B, T), jnp.int32)})
    for k in ("ce", "mtp_loss", "balance_loss", "expert_load"):
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=2e-5, atol=1e-6, err_msg=k)
    # A loss mask (e.g. prompt tokens) drops targets from the CE/MTP losses, not tokens from routing.
    c = f(state, {"input_ids": right, "attention_mask": mask_r, "loss_mask": mask_r.at[:, : T // 2].set(0)})
    np.testing.assert_array_equal(np.asarray(c["expert_load"]), np.asarray(a["expert_load"]))
    np.testing.assert_array_equal(np.asarray(c["balance_loss"]), np.asarray(a["balance_loss"]))
    assert abs(float(c["ce"]) - float(a["ce"])) > 1e-4
    np.testing.assert_array_equal(np.asarray(positions_from_mask(mask_l[1:])), [[-1] * (T - n) + list(range(n))])


def test_ce_and_mtp_loss_match_numpy_on_a_padded_batch():
    """Guards: the CE scored against token t (or t+2) instead of t+1, the MTP head against t+1 (or t+3)
    instead of t+2, padding counted as a target, λ left out of mtp_loss, a term dropped from the loss.
    Both terms are recomputed in numpy from the model's own logits on a hand-made right-padded batch."""
    graphdef, state = nnx.split(init_model(CFG))
    ids = np.array([[5, 9, 3, 7, 1, 2, 8, 4], [6, 2, 2, 9, 11, 0, 0, 0]], np.int32)
    mask = np.array([[1] * 8, [1] * 5 + [0] * 3], np.int32)  # row 1: 5 real tokens, then padding

    @jax.jit  # one compile for both (eager dispatch of two forwards costs several times more)
    def metrics_and_logits(state, ids, mask):
        model = nnx.merge(graphdef, state)
        _, m = loss_fn(model, {"input_ids": ids, "attention_mask": mask}, TC)
        # causal, and no routing capacity: a real token's logits do not depend on the padding after it
        return m, model(ids, with_mtp=True)

    m, logits_pair = metrics_and_logits(state, jnp.asarray(ids), jnp.asarray(mask))
    logits, mtp_logits = (np.asarray(x, np.float64) for x in logits_pair)

    def nll(lg, target):
        return np.log(np.sum(np.exp(lg - lg.max()))) + lg.max() - lg[target]

    # position t predicts token t+1 (main head) and token t+2 (MTP head), for real targets only
    ce = np.mean([nll(logits[b, t], ids[b, t + 1]) for b in range(2) for t in range(7) if mask[b, t + 1]])
    mtp = np.mean([nll(mtp_logits[b, t], ids[b, t + 2]) for b in range(2) for t in range(6) if mask[b, t + 2]])
    assert sum(mask[b, t + 1] for b in range(2) for t in range(7)) == 11  # 7 + 4 targets
    np.testing.assert_allclose(float(m["ce"]), ce, rtol=1e-5)
    np.testing.assert_allclose(float(m["mtp_loss"]), TC.mtp_weight * mtp, rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), ce + TC.mtp_weight * mtp + float(m["balance_loss"]), rtol=1e-5)


def test_balance_loss_matches_numpy():
    rng = np.random.default_rng(4)
    Bq, Tq, E, K = 3, 7, 6, 2
    scores = rng.uniform(0.05, 1.0, (Bq * Tq, E)).astype(np.float32)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(Bq * Tq)]).astype(np.int32)
    mask = np.ones((Bq, Tq), np.float32)
    mask[2, 4:] = 0
    r = RouterOutput(jnp.ones((Bq * Tq, K)), jnp.asarray(idx), jnp.asarray(scores))
    got = float(sequence_balance_loss(r, jnp.asarray(mask), E, K))
    per_seq = []
    for b in range(Bq):
        rows = [b * Tq + t for t in range(Tq) if mask[b, t]]
        f = np.zeros(E)
        for t in rows:
            f[idx[t]] += 1
        f *= E / (K * len(rows))
        p = sum(scores[t] / scores[t].sum() for t in rows) / len(rows)
        per_seq.append(np.sum(f * p))
    np.testing.assert_allclose(got, np.mean(per_seq), rtol=1e-6)


def test_chunked_cross_entropy_matches_numpy_and_its_gradient():
    """`chunked_cross_entropy` against the mean NLL and its gradient computed in numpy (a linear head W),
    for block sizes that divide the 10 tokens, leave a padded last block (3, 4) and exceed them (16).
    Catches a padded token counted (weight not 0), a block left out or counted twice, targets of one
    block paired with another block's logits, and a gradient that misses a block (the backward pass
    through jax.checkpoint in the scan)."""
    rng = np.random.default_rng(0)
    Bq, Tq, D, V = 2, 5, 6, 11
    h = rng.standard_normal((Bq, Tq, D)).astype(np.float32)
    w = rng.standard_normal((D, V)).astype(np.float32)
    t = rng.integers(0, V, (Bq, Tq)).astype(np.int32)
    m = np.ones((Bq, Tq), np.float32)
    m[1, 3:] = 0
    logits = (h @ w).astype(np.float64)  # [B,T,V]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    nll = -np.log(np.take_along_axis(p, t[..., None], -1))[..., 0]
    want = np.sum(nll * m) / m.sum()
    # d/dlogits of the mean NLL = (p - onehot(t)) * m / sum(m); through logits = h @ w
    g_logits = (p - np.eye(V)[t]) * m[..., None] / m.sum()
    want_gh, want_gw = g_logits @ w.T, np.einsum("btd,btv->dv", h, g_logits)
    for chunk in (1, 3, 4, 5, 16):
        f = jax.jit(
            lambda hh, ww, c=chunk: chunked_cross_entropy(
                lambda w_, x: x @ w_, hh, jnp.asarray(t), jnp.asarray(m), c, ww
            )
        )
        got, (gh, gw) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
        np.testing.assert_allclose(float(got), want, rtol=1e-5, err_msg=f"chunk={chunk}")
        np.testing.assert_allclose(np.asarray(gh), want_gh, rtol=1e-4, atol=1e-6, err_msg=f"chunk={chunk}")
        np.testing.assert_allclose(np.asarray(gw), want_gw, rtol=1e-4, atol=1e-6, err_msg=f"chunk={chunk}")


def test_chunked_cross_entropy_sums_a_bf16_head_gradient_in_fp32():
    """bf16 parameters, 256 one-token blocks: the LM head's gradient through `lm_head_fn`'s fp32 copies is
    within bf16 rounding of the exact one (float64 from the same bf16 values), several times closer than
    the same blocks summed in bf16 (the weights handed to the scan as they are), which the test also
    measures so that it shows the difference it guards. Catches `lm_head_fn` passing the bf16 weights."""
    from models.training.step import lm_head_fn

    bf16 = jnp.bfloat16
    model = init_model(CFG.replace(num_mtp_layers=0), seed=3, dtype=bf16, param_dtype=bf16)
    n = 256
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((1, n, CFG.hidden_size)), bf16)
    t = jnp.asarray(rng.integers(0, CFG.vocab_size, (1, n)), jnp.int32)
    m = jnp.ones((1, n), jnp.float32)
    head, w32 = lm_head_fn(model)
    w = nnx.state(model.lm_head).kernel[...]
    assert w.dtype == bf16 and jax.tree.leaves(w32)[0].dtype == jnp.float32
    hf, wf = np.asarray(h[0], np.float64), np.asarray(w, np.float64)
    logits = hf @ wf
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = hf.T @ (p - np.eye(wf.shape[1])[np.asarray(t[0])]) / n  # d(mean NLL)/dW

    def rel_err(weights):
        g = jax.grad(lambda w_: chunked_cross_entropy(head, h, t, m, 1, w_))(weights)
        g = np.asarray(jax.tree.leaves(g)[0].astype(bf16), np.float64)
        return np.linalg.norm(g - want) / np.linalg.norm(want)

    fp32_sum, bf16_sum = rel_err(w32), rel_err(jax.tree.map(lambda a: a.astype(bf16), w32))
    assert fp32_sum < 6e-3 and bf16_sum > 2 * fp32_sum, (fp32_sum, bf16_sum)


def _checkpoints(jaxpr: str) -> int:
    """jax.checkpoint regions in a printed jaxpr (the primitive is `remat2` in jax 0.11, `checkpoint` elsewhere)."""
    return jaxpr.count("remat2[") + jaxpr.count("checkpoint[")


def _loss_and_grads(tc):
    """(metrics, grads, the printed jaxpr of the traced step) of loss_fn on the padded batch."""
    graphdef, state = nnx.split(init_model(CFG, seed=1))
    params, rest = nnx.split_state(state, nnx.Param, ...)
    batch = make_batch()
    f = jax.jit(jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch, tc), has_aux=True))
    traced = f.trace(params)  # one trace serves the jaxpr check and the compile
    (_, metrics), grads = traced.lower().compile()(params)
    return metrics, grads, str(traced.jaxpr)


def test_memory_options_leave_loss_and_gradients_unchanged():
    """Chunked LM-head CE and rematerialised layers change what is stored, not what is computed: the
    losses and every parameter's gradient equal the plain step's (fp32, CPU; the batch is padded, and at
    chunks of 8 both heads' last block is padded: 30 main targets, 28 MTP). Catches a chunk's padding
    counted as a target, the MTP head's chunks paired with the main head's targets, a remat that drops a
    layer's gradient; and (the jaxpr) an option silently ignored or mapped to another policy: the plain
    step has no jax.checkpoint, this one one per LM head (main, MTP) and one per scanned stack (dense,
    MoE), the stacks' with the named policy. (One variant: each compile of the step costs ~15 s of CPU.)"""
    tc = dataclasses.replace(TC, ce_chunk=8, remat="dots_with_no_batch_dims_saveable")
    want_m, want_g, plain_jaxpr = _loss_and_grads(TC)
    got_m, got_g, jaxpr = _loss_and_grads(tc)
    for k in ("loss", "ce", "mtp_loss", "balance_loss", "expert_load"):
        np.testing.assert_allclose(np.asarray(got_m[k]), np.asarray(want_m[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    chex.assert_trees_all_close(got_g, want_g, rtol=1e-4, atol=1e-7)
    assert (_checkpoints(plain_jaxpr), _checkpoints(jaxpr)) == (0, 2 + 2)
    named = f"policy={jax.checkpoint_policies.dots_with_no_batch_dims_saveable!r}"
    assert jaxpr.count(named) == 2, "the stacks' policy is not the one named"


def test_train_config_validates():
    with pytest.raises(ValueError, match="bias_update_rate"):
        TrainConfig(bias_update_rate=-1.0)
    with pytest.raises(ValueError, match=r"TrainConfig.remat='dots': must be one of \('none', 'full'"):
        TrainConfig(remat="dots")
    with pytest.raises(ValueError, match=r"TrainConfig.ce_chunk=-1: must be an integer >= 0"):
        TrainConfig(ce_chunk=-1)
    assert len(moe_modules(init_model(CFG))) == 2
