"""`mla-bench serve`'s greedy check: requests served beside others against their runs alone, and the judge of a
difference in a bf16 run (`NearTieJudge`: bf16 rounding, or a real difference).

The judge's exact pass computes in float32 from the model's own weights: a model of the same config built with
float32 compute over those (bf16) parameters, so each weight is upcast where a layer reads it, inside the
scanned layer, one layer at a time. No float32 copy of the model exists on the device (V2-Lite's would be 63 GB
beside its 31 GB of bf16 weights and the engine's pages).
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.e2e_cells import common_prefix
from models import DeepSeekModel


def agreement(tokens: list[int], ref: list[int]) -> float:
    """Fraction of `ref` equal in `tokens` up to the first difference."""
    return common_prefix(tokens, ref) / len(ref) if ref else 1.0


def first_difference(tokens: list[int], ref: list[int]) -> int | None:
    """The first index where `tokens` and `ref` differ over their common length (None when none does)."""
    n = common_prefix(tokens, ref)
    return n if n < min(len(tokens), len(ref)) else None


def float32_compute(model: DeepSeekModel) -> nnx.GraphDef:
    """The graph of `model`'s config and weight format computing in float32 over parameters of `model`'s own
    dtype: merged with `nnx.state(model)` it is the same weights (no copy), each upcast where it is read."""
    param_dtype = model.embed_tokens.embedding[...].dtype
    make = lambda: DeepSeekModel(  # noqa: E731
        model.cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=param_dtype, weights=model.weights
    )
    return nnx.split(nnx.eval_shape(make))[0]


@functools.partial(jax.jit, static_argnums=0)
def _logits_at(graphdef, state, ids_BT, pos):
    # The LM head at one position, attention in blocks of 512 queries: a long teacher-forced sequence fits beside
    # the engine's pages. Only the logits come back (a program that returned the model's state would copy it).
    model = nnx.merge(graphdef, state)
    T = ids_BT.shape[1]
    out = model.forward(ids_BT, with_mtp=False, head=False, q_block=512 if T > 512 else None)
    return model.logits_from_hidden(out.hidden[:, pos])[0].astype(jnp.float32)


class NearTieJudge:
    """Tells a greedy difference that bf16 rounding explains from one it does not (bf16 runs).

    At the first position j where a request served in a batch (`got`) differs from its run alone (`ref`),
    one teacher-forced pass over prompt + ref[:j] in float32 (the model's weights, float32 compute:
    `float32_compute`) gives the two tokens' logit gap, and the same pass in the model's own dtype gives that
    dtype's largest logit error at j. The difference is a near tie when |gap| <= 2 x error: the rounding each
    of the two runs makes can order the two tokens either way. Anything else is a real difference (a slot's
    stale state, a page shared or freed early), which the benchmark reports as `alone_unexplained`.
    Sequences are padded to a power of two of at least `bucket` tokens (causal: the padding does not reach
    position j), so a few shapes compile."""

    def __init__(self, model: DeepSeekModel, bucket: int = 256):
        self.bucket = bucket
        self.own, self.state = nnx.split(model)
        self.exact = float32_compute(model)

    def _padded(self, ids: list[int]) -> jax.Array:
        n = max(self.bucket, 1 << (len(ids) - 1).bit_length())
        return jnp.asarray([ids + [0] * (n - len(ids))], jnp.int32)

    def logits(self, ids: list[int], pos: int, *, exact: bool) -> np.ndarray:
        """Logits [V] (float64) at position `pos` of the teacher-forced pass over `ids`: in float32 (`exact`)
        or in the model's own dtype."""
        graphdef = self.exact if exact else self.own
        return np.asarray(_logits_at(graphdef, self.state, self._padded(ids), jnp.int32(pos)), np.float64)

    def lower(self, num_tokens: int, *, exact: bool = True) -> jax.stages.Lowered:
        """The pass's program for a sequence padded as `num_tokens` tokens are (its device memory:
        ``.compile().memory_analysis()``)."""
        graphdef = self.exact if exact else self.own
        return _logits_at.lower(graphdef, self.state, self._padded([0] * num_tokens), jnp.int32(0))

    def __call__(self, prompt: list[int], ref: list[int], got: list[int]) -> dict | None:
        j = first_difference(got, ref)
        if j is None:
            return None
        ids = list(prompt) + list(ref[:j])
        exact = self.logits(ids, len(ids) - 1, exact=True)
        own = self.logits(ids, len(ids) - 1, exact=False)
        gap = float(exact[ref[j]] - exact[got[j]])
        err = float(np.max(np.abs(own - exact)))
        return dict(position=j, logit_gap=gap, logit_error=err, tie=abs(gap) <= 2 * err)


def check_alone(pairs, judge: NearTieJudge | None) -> dict:
    """Requests served beside others against their runs alone. pairs: [(prompt, got, ref)] (`ref` cut to
    `got`'s length for a cancelled request) -> {"alone_match": "equal/checked", "alone_agree": mean fraction
    equal up to the first difference, "alone_ties": differences that are near ties (`NearTieJudge`),
    "alone_unexplained": the others, "differences": each difference's judgement}. Without a judge (float32
    runs) every difference is unexplained."""
    equal, agree, diffs = 0, [], []
    for prompt, got, ref in pairs:
        equal += got == ref
        agree.append(agreement(got, ref))
        if got != ref:
            verdict = judge(prompt, ref, got) if judge is not None else None
            if verdict is None:  # float32, or one a prefix of the other (a length difference)
                verdict = dict(position=first_difference(got, ref), tie=False)
            diffs.append(verdict)
    ties = sum(d["tie"] for d in diffs)
    return dict(
        alone_match=f"{equal}/{len(pairs)}",
        alone_agree=statistics.mean(agree) if agree else None,
        alone_ties=ties,
        alone_unexplained=len(diffs) - ties,
        differences=diffs,
    )
