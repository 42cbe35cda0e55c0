"""The jitted generation steps: prefill (a prompt chunk), decode (one token), MTP verify.

Dimension letters: B slots (max_batch), T tokens a step, P block-table width (pages), V vocab,
k MTP drafts a step.

Each step is a small pure function over explicit state, `(model state, KVCache, inputs) ->
(KVCache, outputs)`; it calls only the model (`model(ids, positions, cache=...)`'s pieces:
`hidden_states`, `norm`, `logits_from_hidden`, `mtp_source`, `mtp_block`, `mtp_head`): the
forward pass, the cache writes and the choice of attention path live in the model and its MLA
layers. `compiled_steps(graphdef)` jits them once per model structure with the graphdef closed
over (hashed once, not at every call) and the cache donated, so XLA updates the pools in place.

MTP speculative decoding (DEEPSEEK_SEMANTICS.md §3.3): after the main model samples t_{n+1} from
h_n, the MTP module drafts t_{n+2} from (h_n, t_{n+1}); with k > 1 drafts a step it is chained
on its own output (draft j+1 from (o_j, draft j)), one module reused. The next step runs the main
model on [t_{n+1}, d_1 .. d_k] (s_q = k + 1 <= 4, causal) and accepts drafts in order by rejection
sampling (`models.serving.sampling.speculative_accept`: exact for greedy and for temperature > 0), then
emits the replacement of the first rejected one or a bonus token. The MTP block keeps its own
latent pool (after the main layers' pools, same page ids): its row i holds the pair (h_i, t_{i+1}),
rewritten from the main model's hiddens for every kept position, so after every step the MTP cache
and the main cache have the same length.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.kv_cache import KVCache
from models.serving.sampling import (
    SamplingArrays,
    filtered_probs,
    finite_rows,
    row_keys,
    sample_from_probs,
    speculative_accept,
)

NON_FINITE = -1  # the token a row gets when its logits are not finite (NaN weights, overflow)

MAX_DRAFT_TOKENS = 3  # a verify step has s_q = k + 1 <= 4 queries: what `mla_decode` takes

# Draws of one position never share a key: the main model's token uses stream 0, the verify
# step's bonus draw stream 2, the draft at chain index j stream 16 + j.
_BONUS_STREAM = 2
_DRAFT_STREAM = 16


# The verify step's bookkeeping reduces axes of k + 1 <= 4 tokens and of a few stop ids: unrolled into elementwise
# ops, XLA fuses it with its neighbours, where each reduction or scatter was a kernel launch of its own (the
# built-in model's verify step is launch-bound: a launch costs more than its work).
_UNROLL = 8  # the widest stop-id axis compared by unrolled ops


def _columns(x_BN):
    return [x_BN[:, c] for c in range(x_BN.shape[1])]


def _count(x_BN):
    """int32 [B]: the True entries of each row of bool x [B, N]."""
    return functools.reduce(
        jnp.add, [c.astype(jnp.int32) for c in _columns(x_BN)], jnp.zeros(x_BN.shape[:1], jnp.int32)
    )


def _leading(x_BN):
    """int32 [B]: how many of each row's first entries are all True (the drafts accepted in order)."""
    run, n = jnp.ones(x_BN.shape[:1], bool), jnp.zeros(x_BN.shape[:1], jnp.int32)
    for c in _columns(x_BN):
        run = run & c
        n = n + run
    return n


def _any(x_BN):
    """bool [B]: a row of bool x [B, N] holds a True."""
    return functools.reduce(jnp.logical_or, _columns(x_BN), jnp.zeros(x_BN.shape[:1], bool))


def _is_stop(tok, stop_ids_BS):
    """bool, tok's shape ([B] or [B, N]): tok is one of its row's stop ids (stop_ids_BS int32 [B, S], -1 where
    a row has fewer)."""
    ids = stop_ids_BS if tok.ndim == 1 else stop_ids_BS[:, None, :]
    if stop_ids_BS.shape[1] > _UNROLL:
        return jnp.any(tok[..., None] == ids, axis=-1)
    return functools.reduce(
        jnp.logical_or, [tok == ids[..., s] for s in range(ids.shape[-1])], jnp.zeros(tok.shape, bool)
    )


def _pick(x_BN, i_B, other_B):
    """x[b, i_B[b]] where 0 <= i_B[b] < N, else other_B[b]: N selects, where a gather was a launch."""
    out = other_B
    for c, col in enumerate(_columns(x_BN)):
        out = jnp.where(i_B == c, col, out)
    return out


class StepInputs(NamedTuple):
    """Arrays of one step (B = max_batch rows; idle rows are all padding).

    ids         int32 [B,T]  token ids (0 for padding)
    positions   int32 [B,T]  position of each token in its sequence; -1 = padding
    block_table int32 [B,P]  page ids per row
    lengths     int32 [B]    tokens in the row's cache after this step's writes
    last_idx    int32 [B]    index along T of the token whose logits are sampled
    base_keys   uint32 [B,2] the row's request key (sampling folds the position in)
    sampling    SamplingArrays of the rows
    """

    ids: jax.Array
    positions: jax.Array
    block_table: jax.Array
    lengths: jax.Array
    last_idx: jax.Array
    base_keys: jax.Array
    sampling: SamplingArrays


class Lane(NamedTuple):
    """What a slot carries from one device call to the next without the host (B = max_batch slots).

    pending int32 [B]: the slot's last sampled token, not yet in the cache (the next call's input);
    pos     int32 [B]: its position, i.e. the tokens the slot's cache holds.
    Every call that samples a slot's token updates its entries; the others keep them. The host never reads
    them: it reads each call's tokens one call later (`models.serving.scheduler`), so call n + 1 is enqueued first."""

    pending: jax.Array
    pos: jax.Array


def new_lane(B: int) -> Lane:
    return Lane(jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32))


def _feed(inp: StepInputs, lane: Lane, feed_B) -> StepInputs:
    """Column 0 of row b < B takes the slot's pending token where feed_B[b] (a decoding row of a mixed step)."""
    B = lane.pending.shape[0]
    col = jnp.where(feed_B, lane.pending, inp.ids[:B, 0])
    return inp._replace(ids=inp.ids.at[:B, 0].set(col))


def _settle(lane: Lane, src_B, tokens_R, next_pos_R) -> Lane:
    """Slot b's pending token and position from row src_B[b] of the call (-1: unchanged)."""
    ok = src_B >= 0
    i = jnp.maximum(src_B, 0)
    return Lane(jnp.where(ok, tokens_R[i], lane.pending), jnp.where(ok, next_pos_R[i], lane.pos))


def _sample(logits_BV, inp: StepInputs, counter_B, sampler: str, stream: int = 0):
    """Draw one token per row -> (int32 [B], the distribution f32 [B,V] or None when greedy)."""
    if sampler == "greedy":
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None
    probs = filtered_probs(logits_BV, inp.sampling, filtered=sampler == "filtered")
    return sample_from_probs(row_keys(inp.base_keys, counter_B, stream), probs), probs


def _finite(logits, tokens, sampler: str):
    """`finite_rows(logits)` for rows that drew `tokens`. Greedy: the drawn token's own logit is finite, which
    says the same (an argmax picks a NaN first, then a +inf, and leaves -inf only where all are) with no second
    reduction over the vocabulary (a launch of its own, which XLA does not fuse with the argmax)."""
    if sampler == "greedy":
        return jnp.isfinite(jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0])
    return finite_rows(logits)


def _draft_chain(model, cache: KVCache, o_BD, pos_B, active_B, inp: StepInputs, k: int, sampler: str):
    """k drafts from the MTP block output o at position pos (the pair (h_pos, t_{pos+1})).

    Draft 1 = head(o) predicts t_{pos+2}; draft j+1 reuses the module on (its own output, draft j)
    at position pos + j (DeepSeek-V3 §2.2 depth chaining with one module), writing that chain row
    into the MTP pool; the next verify step overwrites the rows it keeps with true pairs.
    -> (drafts int32 [B,k], their distributions f32 [B,k,V] or None when greedy, cache).
    """
    ds, qs = [], []
    for j in range(k):
        d, q = _sample(model.mtp_head(o_BD), inp, pos_B + 2 + j, sampler, stream=_DRAFT_STREAM + j)
        ds.append(d)
        qs.append(q)
        if j + 1 < k:
            p = pos_B + 1 + j
            o, cache = model.mtp_block(
                o_BD[:, None],
                d[:, None],
                jnp.where(active_B, p, -1)[:, None],
                cache=cache.with_lengths(jnp.where(active_B, p + 1, 0)),
            )
            o_BD = o[:, 0]
    return jnp.stack(ds, axis=1), (None if qs[0] is None else jnp.stack(qs, axis=1)), cache


def prefill_step(
    model,
    cache: KVCache,
    inp: StepInputs,
    mtp_next_ids,
    prompt_ends,
    drafts,
    draft_probs,
    *,
    use_mtp: bool,
    sampler: str,
):
    """One prefill chunk (or a plain decode step: T = 1) for every row; samples at `last_idx`.

    mtp_next_ids int32 [B,T]: t_{i+1} for each token i (ignored unless `use_mtp`); prompt_ends
    bool [B]: the chunk holds the row's last prompt token, whose MTP pair takes the token sampled
    here; drafts int32 [B,k] / draft_probs f32 [B,k,V]: the MTP draft state, replaced in the rows
    that end their prompt (draft_probs is passed through when `sampler` is "greedy", see
    `models.serving.sampling.sampler_kind`). Returns (cache, tokens int32 [B], drafts, draft_probs); a row
    whose logits are not finite (NaN weights, an overflow) gets the token `NON_FINITE`.
    """
    B, T = inp.ids.shape
    rows = jnp.arange(B)
    h_pre, cache = model.hidden_states(inp.ids, inp.positions, pre_norm=True, cache=cache)
    h_post = model.norm(h_pre)
    logits = model.logits_from_hidden(h_post[rows, inp.last_idx])
    last_pos = inp.positions[rows, inp.last_idx]
    tokens, _ = _sample(logits, inp, last_pos + 1, sampler)
    tokens = jnp.where(_finite(logits, tokens, sampler), tokens, NON_FINITE)
    if use_mtp:
        at_end = prompt_ends[:, None] & (jnp.arange(T)[None, :] == inp.last_idx[:, None])
        nxt = jnp.where(at_end, tokens[:, None], mtp_next_ids)
        o, cache = model.mtp_block(model.mtp_source(h_pre, h_post), nxt, inp.positions, cache=cache)
        d, q, cache = _draft_chain(
            model, cache, o[rows, inp.last_idx], last_pos, prompt_ends, inp, drafts.shape[1], sampler
        )
        drafts = jnp.where(prompt_ends[:, None], d, drafts)
        if q is not None:
            draft_probs = jnp.where(prompt_ends[:, None, None], q, draft_probs)
    return cache, tokens, drafts, draft_probs


def decode_step(model, cache: KVCache, inp: StepInputs, *, sampler: str):
    """One plain decode step (T = 1): -> (cache, the next token int32 [B])."""
    cache, tokens, _, _ = prefill_step(model, cache, inp, None, None, None, None, use_mtp=False, sampler=sampler)
    return cache, tokens


def decode_loop(model, cache: KVCache, inp: StepInputs, steps_B, stop_ids_BS, *, sampler: str, num_steps: int):
    """Up to `num_steps` plain decode steps in one device program (a loop of static trip count): each row
    feeds its token back, advances its position and length, and stops on the device.

    inp: the first step's inputs (ids [B,1] = each row's last sampled token, not yet cached; positions [B,1]
    = where it goes; a block table covering every row's positions + `steps_B` - 1; lengths, last_idx are
    recomputed). steps_B int32 [B]: steps row b may take (its token and context budget; 0: an idle row).
    stop_ids_BS int32 [B,S]: tokens that end row b once sampled (-1: none). A row stops after its
    `steps_B` steps, after sampling a stop token (kept), or on non-finite logits (token `NON_FINITE`);
    a stopped row is padding for the rest of the loop (position -1: no write, no attention).
    Draws use the same keys as `decode_step` (the row's key folded with the token's position), so the tokens
    equal `num_steps` calls of it. -> (cache, tokens int32 [B, num_steps] (-1 past a row's last), count [B],
    last int32 [B] (the row's last token, else its input token)).
    """
    B = inp.ids.shape[0]
    zero_B = jnp.zeros((B,), jnp.int32)

    def step(i, carry):
        cache, ids_B, pos_B, done_B, out_BK, count_B = carry
        active = (i < steps_B) & ~done_B
        positions = jnp.where(active, pos_B, -1)
        lengths = jnp.where(active, pos_B + 1, 0)
        step_inp = inp._replace(ids=ids_B[:, None], positions=positions[:, None], lengths=lengths, last_idx=zero_B)
        cache, tok_B, _, _ = prefill_step(
            model, cache.with_lengths(lengths), step_inp, None, None, None, None, use_mtp=False, sampler=sampler
        )
        tok_B = jnp.where(active, tok_B, -1)
        stop = _is_stop(tok_B, stop_ids_BS) | (tok_B == NON_FINITE)
        out_BK = jax.lax.dynamic_update_slice_in_dim(out_BK, tok_B[:, None], i, axis=1)
        return (
            cache,
            jnp.where(active, tok_B, ids_B),
            pos_B + active,
            done_B | (active & stop),
            out_BK,
            count_B + active,
        )

    init = (
        cache,
        inp.ids[:, 0],
        inp.positions[:, 0],
        jnp.zeros((B,), bool),
        jnp.full((B, num_steps), -1, jnp.int32),
        zero_B,
    )
    if num_steps == 1:  # no loop: a while loop costs a device-to-host read of its predicate per trip
        cache, last, _, _, tokens, count = step(0, init)
    else:
        cache, last, _, _, tokens, count = jax.lax.fori_loop(0, num_steps, step, init)
    return cache, tokens, count, last


def verify_step(model, cache: KVCache, inp: StepInputs, drafts, draft_probs, n_spec, *, sampler: str):
    """MTP decode step: verify [t_n, d_1 .. d_k] (T = k + 1, causal) and draft again.

    inp.ids[:, 0] = t_n (the last sampled token, not yet cached) at inp.positions[:, 0] = n; drafts
    int32 [B,k] sit at n+1 .. n+k, of which the first n_spec [B] are verified (the positions of the
    others are padding, -1). Draft j is accepted by rejection sampling against the main model's
    distribution, in order, until the first rejection, which emits a replacement from the residual;
    when all n_spec are accepted a bonus token is drawn from the next distribution. Greedy: the
    accepted drafts are those equal to the argmax. Returns (cache, tokens int32 [B,k+1] of which
    the first accepted + 1 are new, accepted int32 [B], drafts [B,k], draft_probs). A row whose
    logits are not finite gets tokens `NON_FINITE` (as in the other steps).
    """
    B, k = drafts.shape
    n = inp.positions[:, 0]
    active = n >= 0
    rows = jnp.arange(B)
    ids = jnp.concatenate([inp.ids[:, :1], drafts], axis=1)
    h_pre, cache = model.hidden_states(ids, inp.positions, pre_norm=True, cache=cache)
    h_post = model.norm(h_pre)
    logits = model.logits_from_hidden(h_post)  # [B,k+1,V]
    V = logits.shape[-1]
    j = jnp.arange(k + 1)[None, :]
    verifiable = (j[:, :k] < n_spec[:, None]) & active[:, None]  # [B,k]
    counters = (n[:, None] + 1 + j).reshape(-1)  # position of the token each logit row decides
    if sampler == "greedy":  # one-hot p and q: a draft is accepted iff it is the argmax
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B,k+1]
        ok = (best[:, :k] == drafts) & verifiable
        accepted = _leading(ok)
        tokens = best  # tokens before `accepted` equal the drafts; the one at `accepted` is the argmax
        finite_BT = _finite(logits, best, sampler)
    else:
        keys = jnp.repeat(inp.base_keys, k + 1, axis=0)
        flat = StepInputs(
            *inp[:5], base_keys=keys, sampling=SamplingArrays(*(jnp.repeat(a, k + 1) for a in inp.sampling))
        )
        bonus, p = _sample(logits.reshape(B * (k + 1), V), flat, counters, sampler, stream=_BONUS_STREAM)
        p = p.reshape(B, k + 1, V)
        acc, repl = speculative_accept(
            row_keys(keys, counters).reshape(B, k + 1, 2)[:, :k].reshape(B * k, 2),
            p[:, :k].reshape(B * k, V),
            draft_probs.reshape(B * k, V),
            drafts.reshape(B * k),
        )
        ok = acc.reshape(B, k) & verifiable
        accepted = _leading(ok)
        repl = jnp.concatenate([repl.reshape(B, k), jnp.zeros((B, 1), jnp.int32)], axis=1)
        # At index `accepted`: the residual replacement after a rejection, else (all verified
        # drafts accepted) the bonus token drawn from p.
        last = jnp.where(accepted < n_spec, repl[rows, accepted], bonus.reshape(B, k + 1)[rows, accepted])
        tokens = jnp.where(j < accepted[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1), last[:, None])
        finite_BT = finite_rows(logits)
    finite = ~_any(~finite_BT)
    tokens = jnp.where(finite[:, None], tokens, NON_FINITE)
    # MTP pairs (h_{n+i}, t_{n+i+1}) for the kept positions i = 0 .. accepted (rows of rejected drafts
    # and chain rows of the last step are overwritten or left past the length).
    kept = (j <= accepted[:, None]) & active[:, None]
    mtp_pos = jnp.where(kept, n[:, None] + j, -1)
    mtp_len = jnp.where(active, n + 1 + accepted, 0)
    o, cache = model.mtp_block(model.mtp_source(h_pre, h_post), tokens, mtp_pos, cache=cache.with_lengths(mtp_len))
    d, q, cache = _draft_chain(model, cache, o[rows, accepted], n + accepted, active, inp, k, sampler)
    return cache, tokens, accepted, d, draft_probs if q is None else q


class DraftOracle(NamedTuple):
    """Drafts that are right at a chosen rate, for benchmarks on random weights (`verify_loop`'s `oracle`).

    tokens_BL int32 [B, L]: each slot's sequence by position (prompt, then the tokens plain greedy decoding makes);
    accept float32 []: the probability a draft is the sequence's token (else that token + 1, wrong); key uint32
    [2]: the draws' key (folded with the row and the position)."""

    tokens_BL: jax.Array
    accept: jax.Array
    key: jax.Array

    @classmethod
    def of(cls, sequences, accept: float, seed: int, *, slots: int, length: int) -> DraftOracle:
        """The oracle of `sequences[b]` (token ids: slot b's whole sequence; at most `slots` of them), each cut or
        zero-padded to `length` positions, drafts right at the rate `accept` in [0, 1], draws from PRNGKey(seed)."""
        if not 0.0 <= accept <= 1.0:
            raise ValueError(f"draft_oracle accept must be in [0, 1], got {accept!r}")
        if len(sequences) > slots:
            raise ValueError(f"draft_oracle got {len(sequences)} sequences for {slots} slots")
        table = np.zeros((slots, length), np.int32)
        for b, seq in enumerate(sequences):
            table[b, : min(len(seq), length)] = list(seq)[:length]
        key = np.asarray(jax.random.PRNGKey(seed), np.uint32)
        return cls(jnp.asarray(table), jnp.float32(accept), jnp.asarray(key))

    def drafts(self, pos_B, k: int):
        """Drafts for the k positions after each row's pending token at `pos_B` -> int32 [B, k]."""
        B, L = self.tokens_BL.shape
        q = pos_B[:, None] + 1 + jnp.arange(k)[None, :]  # [B, k] positions the drafts stand for
        true = jnp.take_along_axis(self.tokens_BL, jnp.clip(q, 0, L - 1), axis=1)
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], q.shape)
        fold = lambda b, p: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(self.key, b), p))  # noqa: E731
        u = jax.vmap(jax.vmap(fold))(rows, q)
        return jnp.where(u < self.accept, true, true + 1).astype(jnp.int32)

    def verify(self, drafts_Bk, pos_B, n_spec_B):
        """Teacher-forced verification of the drafts after the pending tokens at `pos_B`: the leading drafts that
        are the sequence's tokens are accepted (of the first `n_spec_B`), and the tokens emitted are the sequence's
        -> (tokens int32 [B, k + 1], accepted int32 [B])."""
        B, L = self.tokens_BL.shape
        k = drafts_Bk.shape[1]
        q = pos_B[:, None] + 1 + jnp.arange(k + 1)[None, :]
        true = jnp.take_along_axis(self.tokens_BL, jnp.clip(q, 0, L - 1), axis=1)
        ok = (drafts_Bk == true[:, :k]) & (jnp.arange(k)[None, :] < n_spec_B[:, None])
        accepted = _leading(ok)
        return true, accepted


def verify_loop(
    model,
    cache: KVCache,
    inp: StepInputs,
    drafts,
    draft_probs,
    steps_B,
    spec_B,
    end_B,
    stop_ids_BS,
    oracle=None,
    *,
    sampler,
    num_steps,
):
    """Up to `num_steps` MTP verify steps (`verify_step`) in one device program: each row verifies its drafts
    from its pending token at `inp.positions[:, 0]`, keeps the accepted ones and the next token, drafts again,
    and stops on the device; the positions, lengths and the number of drafts verified are found there.

    inp: ids[:, 0] = each row's pending token, positions[:, 0] = its position n (the rest is recomputed).
    steps_B int32 [B]: verify steps row b may take (0: idle); spec_B int32 [B]: drafts a step of row b may verify
    (k, or 0 for a row the pool has no room for drafts); end_B int32 [B]: the last position a token of row b may
    take (its length budget and the context): a step verifies min(spec, end - n - 1) drafts, so no position
    passes end, and a row with n >= end is done. stop_ids_BS as in `decode_loop` (a stop token is kept, the
    tokens after it are not emitted). Draws use the keys of `verify_step`, so the tokens equal a sequence of its calls.
    oracle: None, or (benchmarks only) a `DraftOracle`: the row's known sequence is teacher-forced (the drafts that
    are its tokens are accepted, the tokens emitted are its own), and each step's new drafts are its tokens, each
    kept with probability `accept` and made wrong otherwise. The model, the MTP module and the verification still
    run: a verify step's cost timed at a chosen acceptance on a model whose own drafts are noise.
    -> (cache, tokens int32 [B, num_steps * (k + 1)] (-1 past a row's last), count [B] (its new tokens, the
    tokens its cache gained), last [B] (the row's last new token, else its pending one), drafted [B], accepted [B],
    drafts, draft_probs).
    """
    B, k = drafts.shape
    W = num_steps * (k + 1)
    j = jnp.arange(k + 1)[None, :]
    zero_B = jnp.zeros((B,), jnp.int32)

    def step(i, carry):
        cache, pend_B, pos_B, done_B, out, count_B, drafted_B, accepted_B, drafts, draft_probs = carry
        active = (i < steps_B) & ~done_B & (pos_B < end_B)
        n_spec = jnp.where(active, jnp.clip(jnp.minimum(spec_B, end_B - pos_B - 1), 0, k), 0)
        positions = jnp.where(active[:, None] & (j <= n_spec[:, None]), pos_B[:, None] + j, -1)
        lengths = jnp.where(active, pos_B + 1 + n_spec, 0)
        ids = jnp.concatenate([pend_B[:, None], jnp.zeros((B, k), jnp.int32)], axis=1)
        step_inp = inp._replace(ids=ids, positions=positions, lengths=lengths)
        cache, toks, acc, d, q = verify_step(
            model, cache.with_lengths(lengths), step_inp, drafts, draft_probs, n_spec, sampler=sampler
        )
        if oracle is not None:  # teacher forcing: the oracle's sequence decides what is kept and emitted
            toks, acc = oracle.verify(drafts, pos_B, n_spec)
        acc = jnp.where(active, acc, 0)
        if oracle is not None:
            d = oracle.drafts(pos_B + 1 + acc, k)
        emit = active[:, None] & (j <= acc[:, None])
        stop = (_is_stop(toks, stop_ids_BS) | (toks == NON_FINITE)) & emit
        before, cols = jnp.zeros((B,), bool), []  # nothing after the first stop
        for c in range(k + 1):
            cols.append(emit[:, c] & ~before)
            before |= stop[:, c]
        emit = jnp.stack(cols, axis=1)
        n_emit = _count(emit)
        dest = jnp.arange(W)[None, :] - count_B[:, None]  # output column w takes the token of index w - count
        for c in range(k + 1):
            out = jnp.where((dest == c) & emit[:, c : c + 1], toks[:, c : c + 1], out)
        return (
            cache,
            _pick(toks, n_emit - 1, pend_B),
            pos_B + jnp.where(active, 1 + acc, 0),
            done_B | _any(stop),
            out,
            count_B + n_emit,
            drafted_B + n_spec,
            accepted_B + acc,
            jnp.where(active[:, None], d, drafts),
            jnp.where(active[:, None, None], q, draft_probs),
        )

    init = (
        cache,
        inp.ids[:, 0],
        inp.positions[:, 0],
        jnp.zeros((B,), bool),
        jnp.full((B, W), -1, jnp.int32),
        zero_B,
        zero_B,
        zero_B,
        drafts,
        draft_probs,
    )
    if num_steps == 1:
        carry = step(0, init)
    else:
        carry = jax.lax.fori_loop(0, num_steps, step, init)
    cache, last, _, _, tokens, count, drafted, accepted, drafts, draft_probs = carry
    return cache, tokens, count, last, drafted, accepted, drafts, draft_probs


# ------------------------------------------------------------------------------------------
# The lane: the calls the scheduler makes, each carrying the slots' `Lane` on the device
# ------------------------------------------------------------------------------------------
def prefill_call(
    model, cache, inp, lane, feed_B, src_B, mtp_next_ids, prompt_ends, drafts, draft_probs, *, use_mtp, sampler
):
    """`prefill_step` over rows whose token 0 may be a slot's pending token (feed_B [B]: rows b < B) and whose
    sampled token becomes slot b's pending one at row src_B[b] (-1: none): a prefill chunk, a plain decode step
    or a mixed step. -> (cache, tokens [R], lane, drafts, draft_probs)."""
    inp = _feed(inp, lane, feed_B)
    cache, tokens, drafts, draft_probs = prefill_step(
        model, cache, inp, mtp_next_ids, prompt_ends, drafts, draft_probs, use_mtp=use_mtp, sampler=sampler
    )
    next_pos = inp.positions[jnp.arange(inp.ids.shape[0]), inp.last_idx] + 1
    return cache, tokens, _settle(lane, src_B, tokens, next_pos), drafts, draft_probs


def decode_call(model, cache, inp, lane, steps_B, stop_ids_BS, *, sampler, num_steps):
    """`decode_loop` from the slots' pending tokens and positions (the lane): -> (cache, tokens [B, num_steps],
    count [B], lane)."""
    inp = inp._replace(ids=lane.pending[:, None], positions=lane.pos[:, None])
    cache, tokens, count, last = decode_loop(
        model, cache, inp, steps_B, stop_ids_BS, sampler=sampler, num_steps=num_steps
    )
    return cache, tokens, count, Lane(last, lane.pos + count)


def verify_call(model, cache, inp, lane, drafts, draft_probs, *loop_args, sampler, num_steps):
    """`verify_loop` from the slots' pending tokens and positions (the lane); `loop_args`: its steps_B, spec_B,
    end_B, stop_ids_BS and oracle. -> (cache, tokens, count, drafted, accepted, lane, drafts, draft_probs)."""
    inp = inp._replace(ids=lane.pending[:, None], positions=lane.pos[:, None])
    cache, tokens, count, last, drafted, accepted, drafts, draft_probs = verify_loop(
        model, cache, inp, drafts, draft_probs, *loop_args, sampler=sampler, num_steps=num_steps
    )
    lane = Lane(last, lane.pos + count)
    return cache, tokens, count, drafted, accepted, lane, drafts, draft_probs


# ------------------------------------------------------------------------------------------
# Compilation: one set of jitted steps per model structure
# ------------------------------------------------------------------------------------------
TRACE_COUNTS: collections.Counter = collections.Counter()


def trace_counts() -> dict[str, int]:
    """How many times each step kind ("prefill", "decode", "verify") has been traced (= compiled)
    in this process."""
    return dict(TRACE_COUNTS)


class Steps(NamedTuple):
    """The jitted steps of one model structure: the scheduler's calls over the lane, `prefill_call`,
    `decode_call`, `verify_call` (their functions above, the model replaced by its state), and the plain
    `prefill(state, cache, inp, mtp_next_ids, prompt_ends, drafts, draft_probs, *, use_mtp, sampler)` and
    `decode(state, cache, inp, *, sampler)` whose programs the tests inspect (the calls' bodies); the cache, the
    lane and the draft state donated."""

    prefill: object
    decode: object
    prefill_call: object
    decode_call: object
    verify_call: object


def _bind(kind: str, step, graphdef):
    def traced(state, *args, **kwargs):
        TRACE_COUNTS[kind] += 1  # runs once per trace, i.e. once per compilation
        return step(nnx.merge(graphdef, state), *args, **kwargs)

    return traced


# XLA options the steps' programs compile with on a GPU (none elsewhere).
GPU_COMPILER_OPTIONS: dict = {}


def compiler_options() -> dict:
    """The XLA options of the steps' programs on this backend (`GPU_COMPILER_OPTIONS` on a GPU)."""
    return dict(GPU_COMPILER_OPTIONS) if jax.default_backend() == "gpu" else {}


@functools.lru_cache(maxsize=16)
def compiled_steps(graphdef) -> Steps:
    """The steps of models with this graphdef, jitted with the graphdef closed over: a step call
    hashes only its small static choices, and engines over equal model structures share compilations."""
    jit = functools.partial(jax.jit, compiler_options=compiler_options() or None)
    return Steps(
        prefill=jit(
            _bind("prefill", prefill_step, graphdef), static_argnames=("use_mtp", "sampler"), donate_argnums=(1, 5, 6)
        ),
        decode=jit(_bind("decode", decode_step, graphdef), static_argnames=("sampler",), donate_argnums=(1,)),
        prefill_call=jit(
            _bind("prefill", prefill_call, graphdef),
            static_argnames=("use_mtp", "sampler"),
            donate_argnums=(1, 3, 8, 9),
        ),
        decode_call=jit(
            _bind("decode", decode_call, graphdef), static_argnames=("sampler", "num_steps"), donate_argnums=(1, 3)
        ),
        verify_call=jit(
            _bind("verify", verify_call, graphdef),
            static_argnames=("sampler", "num_steps"),
            donate_argnums=(1, 3, 4, 5),
        ),
    )
