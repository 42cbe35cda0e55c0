"""Argument checking of the engine's calls (`models.serving.engine.Engine`; its constructor's options are
`models.serving.options`): a prompt, the options `generate`, `submit` and `warm_up` share, each of those calls'
arguments. Each bad value raises a one-line ValueError naming it."""

from __future__ import annotations

import collections.abc

import jax
import numpy as np

from models.serving.sampling import SamplingParams
from models.serving.steps import MAX_DRAFT_TOKENS

ON_CACHE_FULL = ("fail_request", "raise")


def check_prompt(engine, p, name: str) -> list[int]:
    """A prompt of `engine` (1 .. max_context token ids in its vocabulary; `name` names it in the message) -> its
    ids as Python ints."""
    V = engine.cfg.vocab_size
    if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
        raise ValueError(f"{name} must be a list of token ids, got {type(p).__name__}")
    if len(p) == 0:
        raise ValueError(f"{name} is empty; a prompt needs at least one token")
    if len(p) > engine.max_context:
        raise ValueError(f"{name} has {len(p)} tokens, beyond max_context={engine.max_context}")
    ids = []
    for t in p:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{name} holds a non-integer token {t!r}")
        if not 0 <= int(t) < V:
            raise ValueError(f"{name} holds token id {int(t)} outside the vocabulary [0, {V})")
        ids.append(int(t))
    return ids


def check_options(engine, max_new_tokens, use_mtp, mtp_draft_tokens, stop_tokens) -> tuple[int, frozenset]:
    """-> (k, the stop ids): the arguments generate() and submit() share."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if use_mtp and not engine.has_mtp:
        raise ValueError("use_mtp=True but the model has no MTP module (cfg.num_mtp_layers == 0)")
    if (
        isinstance(mtp_draft_tokens, bool)
        or not isinstance(mtp_draft_tokens, int)
        or not 1 <= mtp_draft_tokens <= MAX_DRAFT_TOKENS
    ):
        raise ValueError(
            f"mtp_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}] (a verify step "
            f"attends with s_q = k + 1 <= 4 queries), got {mtp_draft_tokens!r}"
        )
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, collections.abc.Iterable):
        raise ValueError(f"stop_tokens must be a sequence of token ids, got {stop_tokens!r}")
    stops = set()
    for t in stop_tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"stop_tokens must be integers, got {t!r}")
        stops.add(int(t))
    k = mtp_draft_tokens if use_mtp else 0
    sched = engine._sched
    if k != sched.k and sched.requests:
        raise ValueError(
            f"use_mtp={bool(k)}, mtp_draft_tokens={mtp_draft_tokens} while {len(sched.requests)} request(s) "
            f"run with {'MTP, ' + str(sched.k) + ' draft(s) a step' if sched.k else 'no MTP'}: one MTP setting "
            "for every running request"
        )
    return k, frozenset(stops)


def check_request(
    engine, prompts, max_new_tokens, sampling, use_mtp, stop_tokens, stream, on_cache_full, mtp_draft_tokens
):
    """The arguments of `engine.generate` -> (the prompts' ids, a `SamplingParams` and a uint32 [2] key per prompt,
    k, the stop ids)."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError(
            f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__} "
            f"of length {len(prompts) if hasattr(prompts, '__len__') else '?'}"
        )
    clean = [check_prompt(engine, p, f"prompt {i}") for i, p in enumerate(prompts)]
    if isinstance(sampling, SamplingParams):
        params = [sampling] * len(clean)
        keys = [jax.random.fold_in(jax.random.PRNGKey(sampling.seed), i) for i in range(len(clean))]
    else:
        params = list(sampling) if isinstance(sampling, (list, tuple)) else None
        if params is None or len(params) != len(clean) or not all(isinstance(s, SamplingParams) for s in params):
            raise ValueError(
                "sampling must be a SamplingParams or a list of one SamplingParams per prompt "
                f"({len(clean)}), got {sampling!r}"
            )
        keys = [jax.random.PRNGKey(s.seed) for s in params]
    k, stops = check_options(engine, max_new_tokens, use_mtp, mtp_draft_tokens, stop_tokens)
    if stream is not None and not callable(stream):
        raise ValueError(f"stream must be a callable stream(request_index, token_id), got {stream!r}")
    if on_cache_full not in ON_CACHE_FULL:
        raise ValueError(f"on_cache_full must be one of {ON_CACHE_FULL}, got {on_cache_full!r}")
    return clean, params, [np.asarray(key, np.uint32) for key in keys], k, stops


def check_submit(
    engine, prompt, max_new_tokens, sampling, stop_tokens, on_token, use_mtp, mtp_draft_tokens
) -> tuple[list[int], int, frozenset]:
    """The arguments of `engine.submit` -> (the prompt's ids, k, the stop ids)."""
    ids = check_prompt(engine, prompt, "prompt")
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {sampling!r}")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token must be a callable on_token(token_id), got {on_token!r}")
    k, stops = check_options(engine, max_new_tokens, use_mtp, mtp_draft_tokens, stop_tokens)
    return ids, k, stops


def check_warm_up(engine, max_tokens, use_mtp, mtp_draft_tokens) -> int:
    """The arguments of `engine.warm_up`, on an idle engine -> k."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive integer or None, got {max_tokens!r}")
    if engine._sched.requests:
        raise ValueError(f"warm_up needs an idle engine; {len(engine._sched.requests)} request(s) wait or run")
    k, _ = check_options(engine, 1, use_mtp, mtp_draft_tokens, ())
    return k
