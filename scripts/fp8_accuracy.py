"""FP8 and FP4 latent pages against bf16 ones on the built-in model (or an HF checkpoint): decode-step
logits and greedy tokens.

Two measurements, both through the model's cached forward (`model(ids, positions, cache=...)`,
the jnp path: attention_impl "reference", so it runs on a CPU) with each page format:

* teacher-forced decode logits: the prompt is prefilled, then the bf16 cache's greedy continuation
  is fed one token a step to both caches; at every decode step the logits of the two are compared
  (max and mean |fp8 - bf16| (and fp4) over the vocabulary and the steps, the logits' own spread for scale,
  and how often the two pick the same next token). The fp32-cache run is printed beside it: bf16
  pages already differ from exact latents, and this says by how much.
* free-running greedy: `Engine.generate` with kv_dtype "bf16", "fp8" and "fp4", N new tokens each;
  the tokens up to the first difference, and the share of positions that agree.

  PYTHONPATH=. python3 scripts/fp8_accuracy.py [--new-tokens 256] [--prompt TEXT] [--formats fp8 fp4]
  PYTHONPATH=. python3 scripts/fp8_accuracy.py --checkpoint tests/fixtures/hf_v3_tiny   # an HF fixture

`--checkpoint DIR`: another HF checkpoint (the committed HF fixtures are random tiny models without a
tokenizer: the prompt is then `--prompt-ids` token ids, and no text is printed). A format that cannot
store the model's latent (fp8 needs kv_lora_rank a multiple of 128; the fixtures' is 32) is left out
with its one-line reason.

docs/PERFORMANCE.md ("FP8 and FP4 page accuracy") quotes its output;
tests/test_builtin_model.py bounds a short fp8 run (fp4's error is measured here, not asserted).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.kv_cache import KVCache, PagedLatentCache
from models import Engine, SamplingParams, load_hf_checkpoint
from models.builtin import BUILTIN_DIR, BUILTIN_PROMPT
from models.tokenizer import BYTE_TOKENIZER_FILE, HF_TOKENIZER_FILE, load_tokenizer
from pallas_kernels import resolve_page_format

PAGE = 64


def decode_logits(model, ids: list[int], n_prompt: int, kv_dtype) -> np.ndarray:
    """Logits [len(ids) - n_prompt + 1, V] (float32) of the cached forward: one prefill of the first
    n_prompt tokens (its last position's logits), then one decode step for each later token."""
    cfg = model.cfg
    pages_needed = -(-len(ids) // PAGE)
    cache = PagedLatentCache(
        num_layers=cfg.num_hidden_layers + len(model.mtp),
        num_pages=pages_needed,
        page_size=PAGE,
        latent_dim=cfg.latent_dim,
        max_seqs=1,
        max_pages_per_seq=pages_needed,
        dtype=kv_dtype,
        rope_dim=cfg.qk_rope_head_dim,
    )
    cache.reserve(0, len(ids))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, kv, tok, pos):
        logits, kv = nnx.merge(graphdef, state)(tok, pos, cache=kv)
        return logits[:, -1].astype(jnp.float32), kv

    table = cache.block_tables[:, :pages_needed]
    pages, out = cache.pages, []
    spans = [(0, n_prompt)] + [(t, t + 1) for t in range(n_prompt, len(ids))]
    for a, b in spans:
        kv = KVCache.create(pages, table, np.array([b], np.int32), page_format=cache.page_format)
        logits, kv = step(state, kv, jnp.asarray([ids[a:b]], jnp.int32), jnp.arange(a, b, dtype=jnp.int32)[None])
        pages = kv.pages
        out.append(np.asarray(logits[0]))
    return np.stack(out[:-1])  # the last token's logits predict past the sequence


def greedy(model, prompt: list[int], n: int, kv_dtype) -> list[int]:
    e = Engine(
        model, page_size=PAGE, max_batch=1, max_context=len(prompt) + n, kv_dtype=kv_dtype, attention_impl="reference"
    )
    return e.generate([prompt], max_new_tokens=n, sampling=SamplingParams(temperature=0.0)).tokens[0]


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """|a - b| statistics of logits [steps, V] and the share of steps with the same argmax."""
    d = np.abs(a - b)
    return dict(
        max=float(d.max()),
        mean=float(d.mean()),
        step_max_mean=float(d.max(-1).mean()),
        top1=float((a.argmax(-1) == b.argmax(-1)).mean()),
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt", default=BUILTIN_PROMPT)
    p.add_argument(
        "--formats",
        nargs="+",
        choices=("fp8", "fp4"),
        default=["fp8", "fp4"],
        help="the quantized page formats compared with bf16 and fp32 (default: fp8 fp4)",
    )
    p.add_argument("--checkpoint", default=BUILTIN_DIR, help="an HF checkpoint directory (default: the built-in model)")
    p.add_argument(
        "--prompt-ids",
        default="1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16",
        help="comma-separated prompt token ids, for a checkpoint without a tokenizer",
    )
    args = p.parse_args(argv)
    model = load_hf_checkpoint(args.checkpoint)
    builtin = os.path.abspath(args.checkpoint) == os.path.abspath(BUILTIN_DIR)
    has_tokenizer = any(
        os.path.exists(os.path.join(args.checkpoint, f)) for f in (HF_TOKENIZER_FILE, BYTE_TOKENIZER_FILE)
    )
    tok = load_tokenizer(args.checkpoint) if has_tokenizer else None
    prompt = tok.encode(args.prompt) if tok else [int(t) for t in args.prompt_ids.split(",")]
    quant = []
    for q in args.formats:
        try:
            resolve_page_format(q, value_dim=model.cfg.latent_dim, rope_dim=model.cfg.qk_rope_head_dim)
            quant.append(q)
        except ValueError as e:
            print(f"# {q}: left out: {e}")
    kinds = ["fp32", "bf16"] + quant
    n = args.new_tokens
    name = "built-in model" if builtin else os.path.basename(os.path.normpath(args.checkpoint))
    print(
        f"# {' / '.join(quant)} vs bf16 latent pages, {name}, {datetime.date.today()}, {platform.machine()} CPU "
        f"({jax.default_backend()}), jax {jax.__version__}; prompt {len(prompt)} tokens, {n} new tokens"
    )

    runs = {kv: greedy(model, prompt, n, kv) for kv in kinds}
    bf16_tokens = runs["bf16"]
    pairs = [(q, "bf16") for q in quant] + [("bf16", "fp32")] + [(q, "fp32") for q in quant]
    for x, y in pairs:
        same = [a == b for a, b in zip(runs[x], runs[y])]
        first = same.index(False) if False in same else len(same)
        print(
            f"{x + ' vs ' + y:13s} greedy (free-running): the first {first} of {len(same)} tokens agree; "
            f"{100 * np.mean(same):.1f} % of positions agree"
        )

    ids = prompt + bf16_tokens  # teacher forcing: both caches read the bf16 run's tokens
    ref = {kv: decode_logits(model, ids, len(prompt), kv) for kv in kinds}
    spread = float(ref["bf16"].std(-1).mean())
    for x, y in pairs:
        name = f"{x} vs {y}"
        c = compare(ref[x], ref[y])
        print(
            f"{name:13s} decode logits over {len(ref[x])} steps (teacher-forced): max |d| {c['max']:.4f}, "
            f"mean |d| {c['mean']:.5f}, mean of per-step max {c['step_max_mean']:.4f}; same next token "
            f"{100 * c['top1']:.1f} %"
        )
    print(
        f"(logit scale: per-step standard deviation over the vocabulary {spread:.3f}, "
        f"bf16 cache; {ref['bf16'].shape[1]} logits a step)"
    )
    for kv in ["bf16"] + quant:
        print(f"{kv + ':':5s}", repr(tok.decode(runs[kv][:80])) if tok else runs[kv][:24])


if __name__ == "__main__":
    main()
