"""Generation engine: jitted prefill / decode / MTP-verify steps over the paged latent cache, and a
host loop with continuous batching, stop tokens, streaming and speculative decoding.

Dimension letters: B slots (max_batch), T tokens a step, P block-table width (pages), G page size,
C = L + R latent width, D hidden, V vocab.

Steps are small pure functions over explicit state: (graphdef, model state, page pools, a
`StepInputs` of arrays) -> (page pools, outputs). The pools are donated, so XLA updates the
cache in place. Shapes are bucketed so that a long generation compiles a bounded number of
times: B is always max_batch (idle slots are padding, position -1), T and P are powers of two.

Attention over the cache (`_cached_attention`), per layer:
- the step's latents are written into the pages first, then the step attends over the cache
  (prefix + itself), causally by position;
- prefill chunks of >= `naive_threshold` tokens use the decompressed path (gather the prefix,
  `MLA.attend(absorbed=False)`); shorter chunks and decode use the absorbed path;
- decode / verify with `attention_impl` resolving to a kernel call `pallas_kernels.mla_decode`
  straight on the pages; otherwise the pages are gathered and `mla_absorbed_attention` runs
  (the same semantics; `attention_impl="reference"`).

MTP speculative decoding (DEEPSEEK_SEMANTICS.md §3.3): after the main model samples t_{n+1} from
h_n, the MTP module drafts t_{n+2} from (h_n, t_{n+1}); with k > 1 drafts a step it is chained
on its own output (draft j+1 from (o_j, draft j)), one module reused. The next step runs the main
model on [t_{n+1}, d_1 .. d_k] (s_q = k + 1 <= 4, causal) and accepts drafts in order by rejection
sampling (`models.sampling.speculative_accept`: exact for greedy and for temperature > 0), then
emits the replacement of the first rejected one or a bonus token. Rejected drafts' cache rows are
rewound on the host (length decremented, emptied pages freed). The MTP block keeps its own latent
cache (one more pool, same page ids): its row i holds the pair (h_i, t_{i+1}), rewritten from the
main model's hiddens for every kept position, so after every step the MTP cache and the main cache
have the same length.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.kv_cache import CacheFullError, PagedLatentCache, gather_latents, next_pow2, write_latents
from models.sampling import (SamplingArrays, SamplingParams, filtered_probs, row_keys, sample_from_probs,
                             sampler_kind, speculative_accept)

ATTENTION_IMPLS = ("auto", "reference", "kernel", "interpret")
MAX_DRAFT_TOKENS = 3  # a verify step has s_q = k + 1 <= 4 queries: what `mla_decode` takes
ON_CACHE_FULL = ("fail_request", "raise")

# What `pallas_kernels.mla_decode` / `paged_gather` support (their docstrings).
KERNEL_LATENT_DIM = 576
KERNEL_PAGE_SIZE = 64
KERNEL_HEADS = (16, 32, 64, 128)

__all__ = [
    "ATTENTION_IMPLS", "CacheFullError", "Engine", "GenerationResult", "SamplingParams", "StepInputs",
    "decode_step", "prefill_step", "trace_counts", "verify_step",
]


# ------------------------------------------------------------------------------------------
# Step inputs and the pure step functions
# ------------------------------------------------------------------------------------------
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


class AttnMode(NamedTuple):
    """Static attention choices of a step: `absorbed` path or not; `kernel` = the impl passed to
    `pallas_kernels.mla_decode` ("kernel" / "interpret"; decode and verify steps only) or None for
    the jnp path; `gather` = the impl of the prefix gather ("reference" / "kernel" / "interpret")."""

    absorbed: bool
    kernel: str | None
    gather: str


def _cached_attention(mla, pool_NGC, x_BTD, positions_BT, block_table_BP, lengths_B, mode: AttnMode):
    """Write this step's latents into `pool`, then attend over the row's cache -> (out [B,T,D], pool)."""
    cfg = mla.cfg
    rope_pos = jnp.maximum(positions_BT, 0)  # padding rows get any valid rope position; never seen
    q_nope, q_pe = mla.project_q(x_BTD, rope_pos)
    pool_NGC = write_latents(pool_NGC, mla.project_kv(x_BTD, rope_pos), positions_BT, block_table_BP)
    if mode.kernel is not None and mode.absorbed:
        from pallas_kernels import mla_decode
        T = x_BTD.shape[1]
        # The kernel places query j at seq_len - T + j. Valid tokens are a prefix of T here (decode,
        # verify), so padding queries at the end are counted in: the valid ones land on their
        # positions and the padding ones' outputs are discarded.
        n_valid = jnp.sum(positions_BT >= 0, axis=1).astype(jnp.int32)
        seq_lens = lengths_B + T - n_valid
        q_BTHC = mla.absorb_query(q_nope, q_pe).astype(pool_NGC.dtype)
        o_lat, _ = mla_decode(q_BTHC, pool_NGC, block_table_BP, seq_lens, softmax_scale=cfg.softmax_scale,
                              causal=True, impl=mode.kernel)
        return mla.output_from_latent(o_lat.astype(x_BTD.dtype)), pool_NGC
    ctx_BSC, kv_pos_BS = gather_latents(pool_NGC, block_table_BP, lengths_B, impl=mode.gather)
    out = mla.attend(q_nope, q_pe, ctx_BSC.astype(x_BTD.dtype), positions_BT, kv_pos_BS, absorbed=mode.absorbed)
    return out, pool_NGC


def _trunk(model, pools, ids_BT, positions_BT, block_table_BP, lengths_B, mode: AttnMode):
    """Main layers over the cache -> (pre-final-norm hidden [B,T,D], pools)."""
    pools = list(pools)
    h = model.embed(ids_BT)
    for i, layer in enumerate(model.layers):
        a, pools[i] = _cached_attention(layer.self_attn, pools[i], layer.input_layernorm(h), positions_BT,
                                        block_table_BP, lengths_B, mode)
        h = layer.ffn(h + a.astype(h.dtype))  # = DecoderLayer.attention, then its ffn
    return h, pools


def _mtp_block(model, pools, h_BTD, next_ids_BT, positions_BT, block_table_BP, lengths_B, mode: AttnMode):
    """MTP module 0 over its own cache (pool index = number of main layers) -> (block output o [B,T,D], pools)."""
    mod = model.mtp[0]
    li = len(model.layers)
    emb = model.embed(next_ids_BT)
    x = mod.eh_proj(jnp.concatenate([mod.enorm(emb), mod.hnorm(h_BTD).astype(emb.dtype)], axis=-1))
    blk = mod.block
    a, pools[li] = _cached_attention(blk.self_attn, pools[li], blk.input_layernorm(x), positions_BT,
                                     block_table_BP, lengths_B, mode)
    return blk.ffn(x + a.astype(x.dtype)), pools


def _mtp_source(model, h_pre, h_post):
    return h_post if model.mtp[0].hidden_source == "post_norm" else h_pre


def _sample(logits_BV, inp: StepInputs, counter_B, sampler: str, stream: int = 0):
    """Draw one token per row -> (int32 [B], the distribution f32 [B,V] or None when greedy)."""
    if sampler == "greedy":
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None
    probs = filtered_probs(logits_BV, inp.sampling, filtered=sampler == "filtered")
    return sample_from_probs(row_keys(inp.base_keys, counter_B, stream), probs), probs


def _draft_chain(model, pools, o_BD, pos_B, active_B, inp: StepInputs, k: int, mode: AttnMode, sampler: str):
    """k drafts from the MTP block output o at position pos (the pair (h_pos, t_{pos+1})).

    Draft 1 = head(o) predicts t_{pos+2}; draft j+1 reuses the module on (its own output, draft j)
    at position pos + j (DeepSeek-V3 §2.2 depth chaining with one module), writing that chain row
    into the MTP cache; the next verify step overwrites the rows it keeps with true pairs.
    -> (drafts int32 [B,k], their distributions f32 [B,k,V] or None when greedy, pools).
    The draft at chain index j for position p draws with stream 16 + j: a position is drafted at
    most once per chain index, so no draw ever reuses a key.
    """
    ds, qs = [], []
    for j in range(k):
        d, q = _sample(model.logits_from_hidden(model.mtp[0].head_hidden(o_BD)), inp, pos_B + 2 + j, sampler,
                       stream=16 + j)
        ds.append(d)
        qs.append(q)
        if j + 1 < k:
            p = pos_B + 1 + j
            o, pools = _mtp_block(model, pools, o_BD[:, None], d[:, None], jnp.where(active_B, p, -1)[:, None],
                                  inp.block_table, jnp.where(active_B, p + 1, 0), mode)
            o_BD = o[:, 0]
    return jnp.stack(ds, axis=1), (None if qs[0] is None else jnp.stack(qs, axis=1)), pools


def prefill_step(graphdef, state, pools, inp: StepInputs, mtp_next_ids, prompt_ends, drafts, draft_probs, *,
                 mode: AttnMode, use_mtp: bool, sampler: str):
    """One prefill chunk (or a plain decode step: T = 1) for every row; samples at `last_idx`.

    mtp_next_ids int32 [B,T]: t_{i+1} for each token i (ignored unless `use_mtp`); prompt_ends
    bool [B]: the chunk holds the row's last prompt token, whose MTP pair takes the token sampled
    here; drafts int32 [B,k] / draft_probs f32 [B,k,V]: the MTP draft state, replaced in the rows
    that end their prompt (draft_probs is passed through when `sampler` is "greedy", see
    `models.sampling.sampler_kind`). Returns (pools, tokens int32 [B], drafts, draft_probs).
    """
    model = nnx.merge(graphdef, state)
    B, T = inp.ids.shape
    rows = jnp.arange(B)
    h_pre, pools = _trunk(model, pools, inp.ids, inp.positions, inp.block_table, inp.lengths, mode)
    h_post = model.norm(h_pre)
    logits = model.logits_from_hidden(h_post[rows, inp.last_idx])
    last_pos = inp.positions[rows, inp.last_idx]
    tokens, _ = _sample(logits, inp, last_pos + 1, sampler)
    if use_mtp:
        at_end = prompt_ends[:, None] & (jnp.arange(T)[None, :] == inp.last_idx[:, None])
        nxt = jnp.where(at_end, tokens[:, None], mtp_next_ids)
        o, pools = _mtp_block(model, pools, _mtp_source(model, h_pre, h_post), nxt, inp.positions,
                              inp.block_table, inp.lengths, mode)
        d, q, pools = _draft_chain(model, pools, o[rows, inp.last_idx], last_pos, prompt_ends, inp, drafts.shape[1],
                                   mode, sampler)
        drafts = jnp.where(prompt_ends[:, None], d, drafts)
        if q is not None:
            draft_probs = jnp.where(prompt_ends[:, None, None], q, draft_probs)
    return tuple(pools), tokens, drafts, draft_probs


def decode_step(graphdef, state, pools, inp: StepInputs, *, mode: AttnMode, sampler: str):
    """One plain decode step (T = 1): -> (pools, the next token int32 [B])."""
    pools, tokens, _, _ = prefill_step(graphdef, state, pools, inp, None, None, None, None, mode=mode, use_mtp=False,
                                       sampler=sampler)
    return pools, tokens


def verify_step(graphdef, state, pools, inp: StepInputs, drafts, draft_probs, n_spec, *, mode: AttnMode,
                sampler: str):
    """MTP decode step: verify [t_n, d_1 .. d_k] (T = k + 1, causal) and draft again.

    inp.ids[:, 0] = t_n (the last sampled token, not yet cached) at inp.positions[:, 0] = n; drafts
    int32 [B,k] sit at n+1 .. n+k, of which the first n_spec [B] are verified (the positions of the
    others are padding, -1). Draft j is accepted by rejection sampling against the main model's
    distribution, in order, until the first rejection, which emits a replacement from the residual;
    when all n_spec are accepted a bonus token is drawn from the next distribution. Greedy: the
    accepted drafts are those equal to the argmax. Returns (pools, tokens int32 [B,k+1] of which
    the first accepted + 1 are new, accepted int32 [B], drafts [B,k], draft_probs).
    """
    model = nnx.merge(graphdef, state)
    B, k = drafts.shape
    n = inp.positions[:, 0]
    active = n >= 0
    rows = jnp.arange(B)
    ids = jnp.concatenate([inp.ids[:, :1], drafts], axis=1)
    h_pre, pools = _trunk(model, pools, ids, inp.positions, inp.block_table, inp.lengths, mode)
    h_post = model.norm(h_pre)
    logits = model.logits_from_hidden(h_post)  # [B,k+1,V]
    V = logits.shape[-1]
    j = jnp.arange(k + 1)[None, :]
    verifiable = (j[:, :k] < n_spec[:, None]) & active[:, None]  # [B,k]
    counters = (n[:, None] + 1 + j).reshape(-1)  # position of the token each logit row decides
    if sampler == "greedy":  # one-hot p and q: a draft is accepted iff it is the argmax
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B,k+1]
        ok = (best[:, :k] == drafts) & verifiable
        accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
        tokens = best  # tokens before `accepted` equal the drafts; the one at `accepted` is the argmax
    else:
        keys = jnp.repeat(inp.base_keys, k + 1, axis=0)
        flat = StepInputs(*inp[:5], base_keys=keys, sampling=SamplingArrays(*(jnp.repeat(a, k + 1) for a in
                                                                              inp.sampling)))
        bonus, p = _sample(logits.reshape(B * (k + 1), V), flat, counters, sampler, stream=2)
        p = p.reshape(B, k + 1, V)
        acc, repl = speculative_accept(row_keys(keys, counters).reshape(B, k + 1, 2)[:, :k].reshape(B * k, 2),
                                       p[:, :k].reshape(B * k, V), draft_probs.reshape(B * k, V),
                                       drafts.reshape(B * k))
        ok = acc.reshape(B, k) & verifiable
        accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
        repl = jnp.concatenate([repl.reshape(B, k), jnp.zeros((B, 1), jnp.int32)], axis=1)
        # At index `accepted`: the residual replacement after a rejection, else (all verified
        # drafts accepted) the bonus token drawn from p.
        last = jnp.where(accepted < n_spec, repl[rows, accepted], bonus.reshape(B, k + 1)[rows, accepted])
        tokens = jnp.where(j < accepted[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1), last[:, None])
    # MTP pairs (h_{n+i}, t_{n+i+1}) for the kept positions i = 0 .. accepted (rows of rejected drafts
    # and chain rows of the last step are overwritten or left past the length).
    kept = (j <= accepted[:, None]) & active[:, None]
    mtp_pos = jnp.where(kept, n[:, None] + j, -1)
    mtp_len = jnp.where(active, n + 1 + accepted, 0)
    o, pools = _mtp_block(model, pools, _mtp_source(model, h_pre, h_post), tokens, mtp_pos, inp.block_table,
                          mtp_len, mode)
    d, q, pools = _draft_chain(model, pools, o[rows, accepted], n + accepted, active, inp, k, mode, sampler)
    return tuple(pools), tokens, accepted, d, draft_probs if q is None else q


# Compiled once per process and shared by every Engine: the cache key is (graphdef, shapes, static
# choices), so engines over equal model structures and pool shapes reuse each other's compilations.
TRACE_COUNTS: collections.Counter = collections.Counter()


def _counted(kind, fn):
    @functools.wraps(fn)  # keeps the signature: jit resolves static / donated names through it
    def traced(*args, **kwargs):
        TRACE_COUNTS[kind] += 1  # runs once per trace, i.e. once per compilation
        return fn(*args, **kwargs)
    return traced


_prefill_jit = jax.jit(_counted("prefill", prefill_step), static_argnames=("graphdef", "mode", "use_mtp", "sampler"),
                       donate_argnames=("pools", "drafts", "draft_probs"))
_decode_jit = jax.jit(_counted("decode", decode_step), static_argnames=("graphdef", "mode", "sampler"),
                      donate_argnames=("pools",))
_verify_jit = jax.jit(_counted("verify", verify_step), static_argnames=("graphdef", "mode", "sampler"),
                      donate_argnames=("pools", "drafts", "draft_probs"))


def trace_counts() -> dict[str, int]:
    """How many times each step kind ("prefill", "decode", "verify") has been traced (= compiled)
    in this process."""
    return dict(TRACE_COUNTS)


# ------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class GenerationResult:
    """tokens: the new tokens of each prompt (stop token included when one ended it).
    stats: prefill_tok_s, decode_tok_s (over the steps that did not compile, unless all did),
    compile_s (wall time of the steps that compiled), prefill_tokens, decode_tokens (computed by
    decode steps, including tokens cut off by a stop), prefill_steps, decode_steps,
    mtp_drafted, mtp_accepted, mtp_acceptance (None without MTP), pages_used_peak, pages_total,
    traces (compilations so far, per step kind), failed.
    finish_reasons: per prompt "stop" | "length" (max_new_tokens) | "context" (max_context) | "error".
    errors: per prompt None, or the message of the error that ended it (e.g. a `CacheFullError`)."""

    tokens: list[list[int]]
    stats: dict
    finish_reasons: list[str]
    errors: list[str | None]


@dataclasses.dataclass
class _Seq:
    """Host state of one running request."""

    req: int
    prompt: list[int]
    params: SamplingParams
    key: np.ndarray  # uint32 [2]
    prefilled: int = 0  # prompt tokens in the cache
    cached: int = 0  # tokens in the cache
    pending: int = -1  # last sampled token, not yet in the cache
    out: list[int] = dataclasses.field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


class Engine:
    """Generation with a paged latent KV cache.

    Args:
      model: a `models.DeepSeekModel` (its weights are captured at construction).
      page_size: tokens a page (the decode kernel needs 64; tests use small pages on the jnp path).
      num_pages: pages in the pool; None = enough for max_batch sequences of max_context tokens.
      max_batch: slots decoded together (B of every step).
      prefill_chunk: prompt tokens a row prefills per step.
      naive_threshold: prefill chunks of at least this many tokens use the decompressed path.
      attention_impl: "auto" (the Pallas kernels on a Hopper GPU when the shape is supported, else
        jnp), "reference" (jnp), "kernel" or "interpret" (force the kernels; ValueError when the
        model / page shape is not one they support).
      max_context: tokens a sequence may hold (prompt + generated); None = min(the model's
        max_position_embeddings, num_pages * page_size) (2048 when num_pages is None too).
      kv_dtype: the page format's dtype (bf16 default; float32 for exact comparisons).
      cache_fill: value of never-written cache rows (tests poison them with NaN).
      min_chunk_bucket: the smallest prefill chunk shape (tokens); chunk shapes are powers of two.
      min_table_tokens: the smallest block-table width, in tokens (rounded up to whole pages);
        widths are powers of two of pages. Larger minimums mean fewer compilations and a little
        padded work on short sequences.
    """

    def __init__(self, model, page_size: int = 64, num_pages: int | None = None, max_batch: int = 8,
                 prefill_chunk: int = 512, naive_threshold: int = 256, attention_impl: str = "auto",
                 max_context: int | None = None, kv_dtype=jnp.bfloat16, cache_fill: float = 0.0,
                 min_chunk_bucket: int = 16, min_table_tokens: int = 256):
        cfg = model.cfg
        for name, v, lo in (("page_size", page_size, 1), ("max_batch", max_batch, 1),
                            ("prefill_chunk", prefill_chunk, 1), ("naive_threshold", naive_threshold, 1),
                            ("min_chunk_bucket", min_chunk_bucket, 1), ("min_table_tokens", min_table_tokens, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"Engine {name} must be an integer >= {lo}, got {v!r}")
        if num_pages is not None and (isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1):
            raise ValueError(f"Engine num_pages must be a positive integer or None, got {num_pages!r}")
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or not 1 <= max_context <= cfg.max_position_embeddings):
            raise ValueError(f"Engine max_context must be an integer in [1, max_position_embeddings="
                             f"{cfg.max_position_embeddings}], got {max_context!r}")
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"Engine attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
        if max_context is None:
            cap = 2048 if num_pages is None else num_pages * page_size
            max_context = min(cfg.max_position_embeddings, cap)
        # MTP drafts (and their chain rows) may sit up to MAX_DRAFT_TOKENS positions past the last kept
        # token; a model without an MTP head needs no such room. The default pool is what
        # `plan_kv_cache(cfg, context_len=max_context, num_sequences=max_batch, include_mtp=True,
        # draft_tokens=self.draft_room)` predicts (tests/test_kv_cache.py checks it).
        self.draft_room = MAX_DRAFT_TOKENS if len(model.mtp) > 0 else 0
        pages_per_seq = -(-(max_context + self.draft_room) // page_size)
        if num_pages is None:
            num_pages = max_batch * pages_per_seq
        self.cfg = cfg
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.naive_threshold = naive_threshold
        self.max_context = max_context
        self.min_chunk_bucket = min_chunk_bucket
        self.min_table_pages = -(-min_table_tokens // page_size)
        self.has_mtp = len(model.mtp) > 0
        self.graphdef, self.state = nnx.split(model)
        self.cache = PagedLatentCache(
            num_layers=cfg.num_hidden_layers + (1 if self.has_mtp else 0), num_pages=num_pages,
            page_size=page_size, latent_dim=cfg.latent_dim, max_seqs=max_batch,
            max_pages_per_seq=next_pow2(pages_per_seq), dtype=kv_dtype, fill_value=cache_fill)
        self.attention_impl = attention_impl
        self.kernel_impl = self._resolve_kernel(attention_impl)

    # --- configuration ----------------------------------------------------------------------
    def _resolve_kernel(self, impl: str) -> str | None:
        cfg = self.cfg
        problems = []
        if cfg.latent_dim != KERNEL_LATENT_DIM:
            problems.append(f"latent width kv_lora_rank + qk_rope_head_dim = {cfg.latent_dim} (kernels need "
                            f"{KERNEL_LATENT_DIM})")
        if self.page_size != KERNEL_PAGE_SIZE:
            problems.append(f"page_size = {self.page_size} (kernels need {KERNEL_PAGE_SIZE})")
        if cfg.num_attention_heads not in KERNEL_HEADS:
            problems.append(f"num_attention_heads = {cfg.num_attention_heads} (kernels need one of {KERNEL_HEADS})")
        if self.cache.kv_dtype != "bf16":
            problems.append(f"kv_dtype = {self.cache.kv_dtype} (kernels need bf16)")
        if impl == "reference":
            return None
        if impl == "auto":
            from pallas_kernels._platform import default_backend_is_hopper
            return "kernel" if default_backend_is_hopper() and not problems else None
        if problems:
            raise ValueError(f"attention_impl={impl!r} is not possible for this model/engine: " + "; ".join(problems))
        return impl

    def _mode(self, absorbed: bool, decode: bool) -> AttnMode:
        """Decode / verify steps (T <= 2) may call the decode kernel; prefill chunks gather the prefix
        (with the gather kernel when the kernels are on) and attend with jnp."""
        k = self.kernel_impl
        return AttnMode(absorbed=absorbed, kernel=k if decode else None, gather=k or "reference")

    # --- input checking ---------------------------------------------------------------------
    def _check_request(self, prompts, max_new_tokens, sampling, use_mtp, stop_tokens, stream, on_cache_full):
        V = self.cfg.vocab_size
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise ValueError(f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__} "
                             f"of length {len(prompts) if hasattr(prompts, '__len__') else '?'}")
        clean = []
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
                raise ValueError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
            if len(p) > self.max_context:
                raise ValueError(f"prompt {i} has {len(p)} tokens, beyond max_context={self.max_context}")
            ids = []
            for t in p:
                if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                    raise ValueError(f"prompt {i} holds a non-integer token {t!r}")
                if not 0 <= int(t) < V:
                    raise ValueError(f"prompt {i} holds token id {int(t)} outside the vocabulary [0, {V})")
                ids.append(int(t))
            clean.append(ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if isinstance(sampling, SamplingParams):
            params = [sampling] * len(clean)
            keys = [jax.random.fold_in(jax.random.PRNGKey(sampling.seed), i) for i in range(len(clean))]
        else:
            params = list(sampling) if isinstance(sampling, (list, tuple)) else None
            if params is None or len(params) != len(clean) or not all(isinstance(s, SamplingParams) for s in params):
                raise ValueError("sampling must be a SamplingParams or a list of one SamplingParams per prompt "
                                 f"({len(clean)}), got {sampling!r}")
            keys = [jax.random.PRNGKey(s.seed) for s in params]
        if use_mtp and not self.has_mtp:
            raise ValueError("use_mtp=True but the model has no MTP module (cfg.num_mtp_layers == 0)")
        stops = set()
        for t in stop_tokens:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"stop_tokens must be integers, got {t!r}")
            stops.add(int(t))
        if stream is not None and not callable(stream):
            raise ValueError(f"stream must be a callable stream(request_index, token_id), got {stream!r}")
        if on_cache_full not in ON_CACHE_FULL:
            raise ValueError(f"on_cache_full must be one of {ON_CACHE_FULL}, got {on_cache_full!r}")
        return clean, params, [np.asarray(k, np.uint32) for k in keys], stops

    # --- generation -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
                 sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(temperature=0.0),
                 use_mtp: bool = False, stop_tokens: Sequence[int] = (),
                 stream: Callable[[int, int], None] | None = None,
                 on_cache_full: str = "fail_request", mtp_draft_tokens: int = 1) -> GenerationResult:
        """Generate up to `max_new_tokens` new tokens for each prompt (ragged lengths).

        At most `max_batch` prompts run at once; a finished one's slot takes the next waiting
        prompt. A request ends at a stop token (included in its output), after `max_new_tokens`,
        or when it fills `max_context`. `stream(request_index, token_id)` is called for every new
        token, in order per request. With a single `SamplingParams`, request i draws with the key
        fold_in(PRNGKey(seed), i); with a list, request i uses PRNGKey(its own seed); every draw
        folds in the token's position, so the output does not depend on batching.

        `use_mtp`: speculative decoding with the model's MTP module drafting `mtp_draft_tokens`
        (k in [1, 3]) tokens a step (k > 1 chains the one module on its own output); the output is
        the same as without it (greedy: identical tokens; sampling: the same distribution).

        When the pool runs out of pages for a request, `on_cache_full="fail_request"` ends that
        request (finish reason "error", the message in `errors`) and the others go on untouched;
        "raise" raises the `CacheFullError` (with `.partial_result`). Bad arguments raise ValueError.
        """
        prompts, params, keys, stops = self._check_request(prompts, max_new_tokens, sampling, use_mtp,
                                                           stop_tokens, stream, on_cache_full)
        if isinstance(mtp_draft_tokens, bool) or not isinstance(mtp_draft_tokens, int) \
                or not 1 <= mtp_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"mtp_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}] (a verify step "
                             f"attends with s_q = k + 1 <= 4 queries), got {mtp_draft_tokens!r}")
        k = mtp_draft_tokens if use_mtp else 0
        n_req = len(prompts)
        B, V = self.max_batch, self.cfg.vocab_size
        cache = self.cache
        tokens: list[list[int]] = [[] for _ in range(n_req)]
        reasons = [""] * n_req
        errors: list[str | None] = [None] * n_req
        waiting = collections.deque(range(n_req))
        slots: list[_Seq | None] = [None] * B
        # Times of steps that compiled are kept apart (compile_s): tokens/s is measured on warm steps.
        st = dict(prefill_tokens=0, decode_tokens=0, prefill_steps=0, decode_steps=0, mtp_drafted=0,
                  mtp_accepted=0, compile_s=0.0, prefill_warm=[0, 0.0], decode_warm=[0, 0.0],
                  prefill_all=[0, 0.0], decode_all=[0, 0.0])

        def account(kind: str, n_tokens: int, t0: float, traces0: int) -> None:
            dt = time.perf_counter() - t0
            st[f"{kind}_tokens"] += n_tokens
            st[f"{kind}_steps"] += 1
            for key in (f"{kind}_all",) + (() if sum(TRACE_COUNTS.values()) != traces0 else (f"{kind}_warm",)):
                st[key][0] += n_tokens
                st[key][1] += dt
            if sum(TRACE_COUNTS.values()) != traces0:
                st["compile_s"] += dt
        cache.peak_pages_used = cache.pages_used
        kind = sampler_kind(params)
        drafts = jnp.zeros((B, k), jnp.int32) if use_mtp else None
        # Greedy drafts need no distribution: a [B,k,1] placeholder keeps the steps' signature.
        draft_probs = jnp.zeros((B, k, V if kind != "greedy" else 1), jnp.float32) if use_mtp else None

        def finish(b: int, reason: str) -> None:
            seq = slots[b]
            reasons[seq.req] = reason
            cache.release(b)
            slots[b] = None

        def fail(b: int, err: CacheFullError) -> None:
            errors[slots[b].req] = str(err)
            finish(b, "error")
            if on_cache_full == "raise":
                err.partial_result = GenerationResult(tokens, self._stats(st, use_mtp), reasons, errors)
                raise err

        def emit(b: int, tok: int, position: int) -> bool:
            """Record slot b's new token (at `position` of its sequence); True when the request is done
            (and its slot freed)."""
            seq = slots[b]
            seq.out.append(tok)
            tokens[seq.req].append(tok)
            if stream is not None:
                stream(seq.req, tok)
            if tok in stops:
                finish(b, "stop")
            elif len(seq.out) >= max_new_tokens:
                finish(b, "length")
            elif position >= self.max_context:  # the new token could not be fed back
                finish(b, "context")
            else:
                seq.pending = tok
                return False
            return True

        try:
            while True:
                # Admit waiting prompts into free slots while their whole prompt fits in the pool.
                for b in range(B):
                    if slots[b] is None and waiting:
                        r = waiting[0]
                        try:
                            # + k - 1: the rows the prefill's draft chain writes past the prompt.
                            cache.reserve(b, len(prompts[r]) + max(k - 1, 0))
                        except CacheFullError as e:
                            if any(s is not None for s in slots):
                                break  # wait for a running request to free pages
                            waiting.popleft()
                            slots[b] = _Seq(r, prompts[r], params[r], keys[r])
                            fail(b, e)
                            continue
                        waiting.popleft()
                        slots[b] = _Seq(r, prompts[r], params[r], keys[r])
                live = [b for b in range(B) if slots[b] is not None]
                if not live:
                    if waiting:
                        continue
                    break
                pre = [b for b in live if not slots[b].decoding]
                t0, traces0 = time.perf_counter(), sum(TRACE_COUNTS.values())
                if pre:
                    drafts, draft_probs, done_tokens = self._run_prefill(slots, pre, use_mtp, drafts, draft_probs, kind)
                    account("prefill", sum(n for _, _, n in done_tokens), t0, traces0)
                    for b, tok, _ in done_tokens:
                        if tok is not None:
                            emit(b, tok, slots[b].cached)
                    continue
                # Decode: reserve the rows' next positions; a row that cannot get a page fails alone.
                # A verify step writes t_n, n_spec drafts and, past the kept ones, k - 1 chain rows:
                # cached + n_spec + k rows at most (cached + 1 without MTP).
                spec = {}
                for b in live:
                    seq = slots[b]
                    n_spec = 0
                    if use_mtp:  # drafts only where their tokens could be kept (draft j is new token out + j)
                        n_spec = max(0, min(k, max_new_tokens - len(seq.out), self.max_context - seq.cached - 1))
                    try:
                        cache.reserve(b, seq.cached + max(1, n_spec + k))
                        spec[b] = n_spec
                    except CacheFullError as e:
                        # Without room for the drafts' rows, verify no draft if t_n (and the chain) fit.
                        short = cache.pages_for(seq.cached + max(1, k)) - len(cache.pages_of(b))
                        if n_spec and short <= cache.num_free_pages:
                            cache.reserve(b, seq.cached + max(1, k))
                            spec[b] = 0
                        else:
                            fail(b, e)
                live = [b for b in live if slots[b] is not None]
                if not live:
                    continue
                if use_mtp:
                    drafts, draft_probs, emitted = self._run_verify(slots, live, spec, drafts, draft_probs, kind)
                else:
                    emitted = self._run_decode(slots, live, kind)
                account("decode", sum(len(toks) for _, toks, _ in emitted), t0, traces0)
                for b, toks, accepted in emitted:
                    seq = slots[b]
                    if use_mtp:
                        st["mtp_drafted"] += spec[b]
                        st["mtp_accepted"] += accepted
                    first = seq.cached + 1  # position of the first new token
                    seq.cached += 1 + int(accepted)
                    cache.truncate(b, seq.cached)  # rewinds a rejected draft's row (and its page if emptied)
                    for i, tok in enumerate(toks):
                        if emit(b, tok, first + i):
                            break
        finally:
            # Whatever ended the loop (an error raised, a stream callback that threw), no slot keeps
            # its pages: the next call starts from a clean pool.
            for b in range(B):
                if slots[b] is not None:
                    cache.release(b)
                    slots[b] = None
        stats = self._stats(st, use_mtp)
        stats["failed"] = sum(e is not None for e in errors)
        return GenerationResult(tokens, stats, reasons, errors)

    def _stats(self, st: dict, use_mtp: bool) -> dict:
        def rate(kind: str) -> float:  # warm steps only, unless every step compiled
            n, t = st[f"{kind}_warm"] if st[f"{kind}_warm"][1] > 0 else st[f"{kind}_all"]
            return n / t if t > 0 else 0.0

        return dict(
            prefill_tok_s=rate("prefill"), decode_tok_s=rate("decode"), compile_s=st["compile_s"],
            prefill_tokens=st["prefill_tokens"], decode_tokens=st["decode_tokens"],
            prefill_steps=st["prefill_steps"], decode_steps=st["decode_steps"],
            mtp_drafted=st["mtp_drafted"], mtp_accepted=st["mtp_accepted"],
            mtp_acceptance=(st["mtp_accepted"] / st["mtp_drafted"] if st["mtp_drafted"] else 0.0) if use_mtp else None,
            pages_used_peak=self.cache.peak_pages_used, pages_total=self.num_pages,
            traces=trace_counts(),
        )

    # --- step drivers (host arrays in, host results out) ---------------------------------------
    def _inputs(self, slots, rows, T: int, pages_needed: int):
        B = self.max_batch
        P = min(next_pow2(max(self.min_table_pages, pages_needed)), self.cache.max_pages_per_seq)
        ids = np.zeros((B, T), np.int32)
        pos = np.full((B, T), -1, np.int32)
        lengths = np.zeros((B,), np.int32)
        last = np.zeros((B,), np.int32)
        keys = np.zeros((B, 2), np.uint32)
        sp = [SamplingParams(temperature=0.0)] * B
        for b in rows:
            keys[b] = slots[b].key
            sp[b] = slots[b].params
        return ids, pos, lengths, last, keys, sp, self.cache.block_tables[:, :P].copy()

    def _run_prefill(self, slots, rows, use_mtp, drafts, draft_probs, kind):
        chunk = {b: min(self.prefill_chunk, len(slots[b].prompt) - slots[b].prefilled) for b in rows}
        T = next_pow2(max(self.min_chunk_bucket, *chunk.values()))
        # The table covers every page a row holds: its whole prompt (and the draft chain's rows).
        need = max(len(self.cache.pages_of(b)) for b in rows)
        ids, pos, lengths, last, keys, sp, bt = self._inputs(slots, rows, T, need)
        nxt = np.zeros_like(ids)
        ends = np.zeros((self.max_batch,), bool)
        for b in rows:
            seq, c = slots[b], chunk[b]
            a = seq.prefilled
            ids[b, :c] = seq.prompt[a:a + c]
            pos[b, :c] = np.arange(a, a + c)
            follow = seq.prompt[a + 1:a + c + 1]
            nxt[b, :len(follow)] = follow
            lengths[b] = a + c
            last[b] = c - 1
            ends[b] = a + c == len(seq.prompt)
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        mode = self._mode(absorbed=max(chunk.values()) < self.naive_threshold, decode=False)
        if use_mtp:
            pools, toks, drafts, draft_probs = _prefill_jit(self.graphdef, self.state, self.cache.pages, inp, nxt,
                                                             ends, drafts, draft_probs, mode=mode, use_mtp=True,
                                                             sampler=kind)
        else:
            pools, toks, _, _ = _prefill_jit(self.graphdef, self.state, self.cache.pages, inp, None, None, None,
                                              None, mode=mode, use_mtp=False, sampler=kind)
        self.cache.pages = pools
        toks = np.asarray(toks)
        done = []
        for b in rows:
            seq = slots[b]
            seq.prefilled += chunk[b]
            seq.cached = seq.prefilled
            done.append((b, int(toks[b]) if ends[b] else None, chunk[b]))
        return drafts, draft_probs, done

    def _run_decode(self, slots, rows, kind):
        need = max(self.cache.pages_for(slots[b].cached + 1) for b in rows)
        ids, pos, lengths, last, keys, sp, bt = self._inputs(slots, rows, 1, need)
        for b in rows:
            seq = slots[b]
            ids[b, 0] = seq.pending
            pos[b, 0] = seq.cached
            lengths[b] = seq.cached + 1
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        pools, toks = _decode_jit(self.graphdef, self.state, self.cache.pages, inp, mode=self._mode(True, decode=True),
                                  sampler=kind)
        self.cache.pages = pools
        toks = np.asarray(toks)
        return [(b, [int(toks[b])], 0) for b in rows]

    def _run_verify(self, slots, rows, spec, drafts, draft_probs, kind):
        k = drafts.shape[1]
        # The kernel is given seq_len = cached + 1 + k (padding queries counted in, see
        # `_cached_attention`), so the table must cover that many tokens even where fewer drafts
        # are verified (entries past a row's own pages are page 0, masked out by position).
        need = max(max(len(self.cache.pages_of(b)), self.cache.pages_for(slots[b].cached + 1 + k)) for b in rows)
        ids, pos, lengths, last, keys, sp, bt = self._inputs(slots, rows, k + 1, need)
        n_spec = np.zeros((self.max_batch,), np.int32)
        for b in rows:
            seq = slots[b]
            ids[b, 0] = seq.pending
            pos[b, :1 + spec[b]] = np.arange(seq.cached, seq.cached + 1 + spec[b])
            lengths[b] = seq.cached + 1 + spec[b]
            n_spec[b] = spec[b]
        inp = StepInputs(ids, pos, bt, lengths, last, keys, SamplingArrays.from_params(sp))
        pools, toks, acc, drafts, draft_probs = _verify_jit(self.graphdef, self.state, self.cache.pages, inp, drafts,
                                                             draft_probs, n_spec, mode=self._mode(True, decode=True),
                                                             sampler=kind)
        self.cache.pages = pools
        toks, acc = np.asarray(toks), np.asarray(acc)
        return drafts, draft_probs, [(b, [int(t) for t in toks[b, :1 + int(acc[b])]], int(acc[b])) for b in rows]
