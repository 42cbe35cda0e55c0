"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, and the
speculative-decoding acceptance rule. Pure jnp functions over a batch of rows (jit-able).

Dimension letters: B rows (sequences), V vocabulary.

Every row carries its own parameters as arrays, so one compiled step serves a batch that mixes
greedy and sampled requests:
    temperature f32 [B]  0 = greedy (argmax); so is anything below MIN_TEMPERATURE
    top_k       i32 [B]  0 = off; else keep the k most likely tokens
    top_p       f32 [B]  1 = off; else keep the smallest prefix (by probability) whose mass >= top_p
    min_p       f32 [B]  0 = off; else keep tokens with p >= min_p * max(p)
The filters apply in that order (temperature, top-k, top-p, min-p), each on the distribution left
by the previous one, as in vLLM and HF. `filtered_probs` returns the resulting distribution; a
greedy row gets the one-hot distribution of its argmax, so the rejection-sampling rule below is
exact for greedy too (accept iff the draft is the argmax, else emit the argmax).

Numerics: a row is tempered as (logits - max) / temperature in fp32, so the most likely token
scores exactly 0 and every other one <= 0 at any temperature (no inf - inf, no overflow in exp);
a tiny temperature tends to greedy, and below `MIN_TEMPERATURE` (where a device may flush the
divisor to zero) the row is greedy. Logits that are NaN or +inf give no distribution at all:
`finite_rows` flags such rows inside the jitted step, and the host raises
`NonFiniteLogitsError` (`check_finite_rows`) instead of emitting whatever token a NaN draw gives.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_F32 = jnp.float32
# The smallest normal float32 (1.18e-38). Below it a temperature is subnormal, which the device may
# flush to zero (0 / 0 = NaN), so such rows are greedy; above it tempering is exact.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are drawn.

    temperature: >= 0; 0 means greedy (argmax, the other filters are then irrelevant), as does
        anything below `MIN_TEMPERATURE`.
    top_k: >= 0; 0 = no top-k filter.
    top_p: in (0, 1]; 1 = no nucleus filter.
    min_p: in [0, 1]; 0 = no min-p filter.
    seed: an integer in [0, 2**32); with the same seed, prompt and parameters a request draws the
        same tokens (see `models.serving.engine.Engine.generate` for how the key is derived).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        def real(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {v!r}")
            return float(v)

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"SamplingParams.{name} must be an integer, got {v!r}")
            return v

        if real("temperature") < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if integer("top_k") < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < real("top_p") <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not 0.0 <= real("min_p") <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not 0 <= integer("seed") < 2**32:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**32), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


class SamplingArrays(NamedTuple):
    """`SamplingParams` of B rows as device arrays (see the module docstring)."""

    temperature: jax.Array  # f32 [B]
    top_k: jax.Array  # i32 [B]
    top_p: jax.Array  # f32 [B]
    min_p: jax.Array  # f32 [B]

    @staticmethod
    def from_params(params: list[SamplingParams]) -> "SamplingArrays":
        # numpy, not jnp: built on the host before every step, where an eager jnp array costs a dispatch
        return SamplingArrays(
            temperature=np.asarray([p.temperature for p in params], np.float32),
            top_k=np.asarray([p.top_k for p in params], np.int32),
            top_p=np.asarray([p.top_p for p in params], np.float32),
            min_p=np.asarray([p.min_p for p in params], np.float32),
        )


# ------------------------------------------------------------------------------------------
def sampler_kind(params: list[SamplingParams]) -> str:
    """The cheapest sampler that serves every row: "greedy" (all rows greedy: argmax only),
    "random" (no top-k / top-p / min-p anywhere: no sort) or "filtered". A static choice, so
    that a greedy batch does not compile (or run) the vocabulary sort."""
    if all(p.greedy for p in params):
        return "greedy"
    if all(p.top_k == 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        return "random"
    return "filtered"


def filtered_probs(logits_BV: jax.Array, s: SamplingArrays, *, filtered: bool = True) -> jax.Array:
    """The distribution a row samples from, f32 [B, V] (rows sum to 1).

    Excluded tokens get exactly 0. Greedy rows (temperature 0) get one-hot(argmax). A token tied
    with the k-th largest logit is kept or dropped by its index (lowest index first), so top-k
    keeps exactly k tokens. `filtered=False` skips top-k / top-p / min-p (valid only when no row
    uses them; see `sampler_kind`).
    """
    logits = logits_BV.astype(_F32)
    B, V = logits.shape
    greedy = s.temperature < MIN_TEMPERATURE
    t = jnp.where(greedy, 1.0, s.temperature)[:, None]
    # Shift first: the max scores exactly 0 and the rest <= 0 whatever t is. logits / t at a tiny t
    # is ~1e11 in magnitude, and softmax's own max-subtraction then differed by rounding from the
    # values it exponentiated (exp(+1e4) = inf, inf / inf = NaN under jit).
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / t
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=_F32)
    if not filtered:
        return jnp.where(greedy[:, None], onehot, jax.nn.softmax(scaled, axis=-1))
    # Rank of every token in descending order (stable: ties by index).
    order_BV = jnp.argsort(-scaled, axis=-1, stable=True)  # sorted position -> token
    rank_BV = jnp.argsort(order_BV, axis=-1)  # token -> sorted position
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)[:, None]
    keep = rank_BV < k
    # top-p over what top-k left, in sorted order: keep a token when the mass strictly before it
    # is < top_p (the most likely token is always kept).
    p = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
    p_sorted = jnp.take_along_axis(p, order_BV, axis=-1)
    before_sorted = jnp.cumsum(p_sorted, axis=-1) - p_sorted
    keep_sorted = (before_sorted < s.top_p[:, None]) | (s.top_p[:, None] >= 1.0)
    keep = keep & jnp.take_along_axis(keep_sorted, rank_BV, axis=-1)
    # min-p on the distribution left by top-k and top-p.
    p = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
    keep = keep & (p >= s.min_p[:, None] * jnp.max(p, axis=-1, keepdims=True))
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
    return jnp.where(greedy[:, None], onehot, probs)


def finite_rows(logits_BV: jax.Array) -> jax.Array:
    """bool [...]: whether each row of logits [..., V] defines a distribution: no NaN, no +inf, and at
    least one finite logit (-inf entries are fine: masked tokens). Jit-able; compute it in the step
    beside the sampled tokens and pass it to `check_finite_rows` on the host. A False row came
    from non-finite weights or activations; its "sampled" token is meaningless."""
    # One reduction (a launch where two were): the row's max is NaN where a logit is (max propagates NaN), +inf
    # where one is, -inf where all are; else finite.
    return jnp.isfinite(jnp.max(logits_BV.astype(_F32), axis=-1))


class NonFiniteLogitsError(ValueError):
    """The model produced NaN / infinite logits (a `ValueError`: command-line tools print it as one line)."""


def check_finite_rows(finite_B, requests=None) -> None:
    """Raise `NonFiniteLogitsError` unless every entry of `finite_B` (from `finite_rows`) is True.

    requests: optional labels of the rows (e.g. request indices) for the message; default the row
    indices. Host-side (reads the flags).
    """
    ok = np.asarray(finite_B, bool).reshape(-1)
    if ok.all():
        return
    bad = np.flatnonzero(~ok)
    names = [requests[i] for i in bad] if requests is not None else bad.tolist()
    raise NonFiniteLogitsError(
        f"the model produced NaN or infinite logits for request(s) {names}: its weights or activations are not "
        "finite (a corrupt or mis-converted checkpoint, or a dtype that overflows)"
    )


def sample_from_probs(keys_B2: jax.Array, probs_BV: jax.Array) -> jax.Array:
    """Draw one token per row from `probs` (f32 [B,V]) with a raw uint32 key per row [B,2] -> int32 [B].

    Zero-probability tokens are never drawn; a one-hot row always returns its token.
    """
    logp = jnp.where(probs_BV > 0, jnp.log(jnp.where(probs_BV > 0, probs_BV, 1.0)), -jnp.inf)
    return jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(keys_B2, logp).astype(jnp.int32)


def sample(keys_B2: jax.Array, logits_BV: jax.Array, s: SamplingArrays) -> jax.Array:
    """Filter and draw: int32 [B]. Greedy rows return the argmax whatever the key."""
    return sample_from_probs(keys_B2, filtered_probs(logits_BV, s))


def speculative_accept(
    keys_B2: jax.Array, p_BV: jax.Array, q_BV: jax.Array, draft_B: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling of one drafted token (Leviathan et al. 2023; Chen et al. 2023).

    p_BV: the target distribution at the draft's position; q_BV: the distribution the draft was
    drawn from; draft_B int32 [B]. The draft d is accepted with probability min(1, p(d)/q(d));
    otherwise a replacement is drawn from normalise(max(p - q, 0)). The emitted token is then
    distributed exactly as p. Returns (accepted bool [B], token int32 [B]: the draft when
    accepted, else the replacement).
    """
    k_u, k_r = jax.vmap(lambda k: jax.random.split(k, 2))(keys_B2).transpose(1, 0, 2)
    p_d = jnp.take_along_axis(p_BV, draft_B[:, None], axis=-1)[:, 0]
    q_d = jnp.take_along_axis(q_BV, draft_B[:, None], axis=-1)[:, 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, (), _F32))(k_u)
    # u < p/q written without the division: q(d) > 0 always holds for a token drawn from q.
    accepted = u * q_d < p_d
    resid = jnp.maximum(p_BV - q_BV, 0.0)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    # total == 0 only when p == q, where rejection has probability 0; fall back to p for safety.
    resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p_BV)
    replacement = sample_from_probs(k_r, resid)
    return accepted, jnp.where(accepted, draft_B, replacement)


def row_keys(base_keys_B2: jax.Array, counters_B: jax.Array, stream: int = 0) -> jax.Array:
    """Per-row keys for one draw: fold (counter, stream) into each row's base key -> uint32 [B,2].

    `counter` is the position of the token being decided, so a request's draws do not depend on
    which slot or batch it runs in; `stream` separates independent draws at one position.
    """

    def one(k, c):
        return jax.random.fold_in(jax.random.fold_in(k, c), stream)

    return jax.vmap(one)(base_keys_B2, counters_B.astype(jnp.uint32))
