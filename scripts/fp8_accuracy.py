"""FP8 and FP4 latent pages against bf16 ones on the built-in model (or an HF checkpoint): decode-step
logits and greedy tokens; and, on the built-in model, the FP8 decode math over held-out text.

Three measurements, all through the model's cached forward (`model(ids, positions, cache=...)`,
the jnp path: attention_impl "reference", so it runs on a CPU) with each page format:

* teacher-forced decode logits: the prompt is prefilled, then the bf16 cache's greedy continuation
  is fed one token a step to both caches; at every decode step the logits of the two are compared
  (max and mean |fp8 - bf16| (and fp4) over the vocabulary and the steps, the logits' own spread for scale,
  and how often the two pick the same next token). The fp32-cache run is printed beside it: bf16
  pages already differ from exact latents, and this says by how much.
* free-running greedy: `Engine.generate` with kv_dtype "bf16", "fp8" and "fp4", N new tokens each;
  the tokens up to the first difference, and the share of positions that agree.
* held-out (the built-in model only): the first `--heldout-windows` windows mla-train evaluated the model on
  (its held-out split, `models.training.data.load_corpus` with the recipe of models/builtin/training.json),
  each a `--heldout-prompt`-token prompt prefilled, then `--heldout-positions` decode steps fed the TRUE
  text. For each run of `HELDOUT_RUNS` (pages x decode math): the share of steps whose greedy next token is
  bf16 pages', and the mean CE against the true next token (and its ratio to bf16 pages'); then the FP8
  math's row against the bounds of the decision "FP8 pages compute in FP8" (DESIGN.md): >= 98 % of the
  tokens and the CE within 1 %.

The decode math of a held-out run (`decode_math`). No kernel body computes the FP8 math yet (so no
`MlaDecodeConfig` option names it: the kernel could only refuse it), and on a CPU the cached forward attends
over the gathered, dequantised pages in jnp (`mla_jax.cache_paths.cached_path`: "absorbed"), never through
`mla_decode`. So, while a run with a decode math is traced, this script substitutes two names of
`mla_jax.attention` (scoped: restored on exit): `cached_path`, so that the calls the decode kernel serves on a
GPU (at most `MAX_QUERY_LEN` tokens a row; its heads, pages and format) take the "decode_kernel" path, and
`mla_decode`, so that path runs a jnp reference: "bf16" = `mla_decode_reference` (the kernel's math today:
bf16 query, pages dequantised to bf16, f32 products), "fp8" = `mla_decode_fp8_math_reference` (e4m3 query and
P, the block scales per 128 columns). Everything else is the model's own path: the prompt's prefill (one chunk
of `--heldout-prompt` tokens a row: the "absorbed" path below 256 tokens, the "decompressed" one from there;
the pages gathered and dequantised, f32 math) is the same in every run of a page format, and so are the runs
without a decode math.

  PYTHONPATH=. python3 scripts/fp8_accuracy.py [--new-tokens 256] [--prompt TEXT] [--formats fp8 fp4]
      [--heldout-windows 8] [--heldout-prompt 64] [--heldout-positions 256]
  PYTHONPATH=. python3 scripts/fp8_accuracy.py --checkpoint tests/fixtures/hf_v3_tiny   # an HF fixture

`--checkpoint DIR`: another HF checkpoint (the committed HF fixtures are random tiny models without a
tokenizer: the prompt is then `--prompt-ids` token ids, and no text is printed). A format that cannot
store the model's latent (fp8 needs kv_lora_rank a multiple of 128; the fixtures' is 32) is left out
with its one-line reason.

docs/PERFORMANCE.md ("FP8 and FP4 page accuracy") quotes its output;
tests/test_builtin_model.py bounds a short fp8 run (fp4's error is measured here, not asserted) and a short
held-out run (`heldout`) with both decode maths.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax import attention, cache_paths
from mla_jax.kv_cache import KVCache, PagedLatentCache
from models import Engine, SamplingParams, load_hf_checkpoint
from models.builtin import BUILTIN_DIR, BUILTIN_PROMPT
from models.data import CORPUS_PATH
from models.tokenizer import BYTE_TOKENIZER_FILE, HF_TOKENIZER_FILE, load_tokenizer
from models.training.data import load_corpus
from pallas_kernels import resolve_page_format
from pallas_kernels.mla_decode import mla_decode_fp8_math_reference, mla_decode_problems, mla_decode_reference

PAGE = 64


def cached_logits(model, ids, n_prompt: int, kv_dtype) -> np.ndarray:
    """Logits float32 [W, n - n_prompt + 1, V] of the cached forward over W rows of n tokens (ids int [W, n]),
    the rows in one batch: one prefill of each row's first n_prompt tokens (its last position's logits), then
    one decode step for each later token (the last step's logits predict past the rows)."""
    ids = np.asarray(ids, np.int32)
    W, n = ids.shape
    cfg = model.cfg
    pages_needed = -(-n // PAGE)
    cache = PagedLatentCache(
        num_layers=cfg.num_hidden_layers + len(model.mtp),
        num_pages=W * pages_needed,
        page_size=PAGE,
        latent_dim=cfg.latent_dim,
        max_seqs=W,
        max_pages_per_seq=pages_needed,
        dtype=kv_dtype,
        rope_dim=cfg.qk_rope_head_dim,
    )
    for row in range(W):
        cache.reserve(row, n)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, kv, tok, pos):
        logits, kv = nnx.merge(graphdef, state)(tok, pos, cache=kv)
        return logits[:, -1].astype(jnp.float32), kv

    table = cache.block_tables[:, :pages_needed]
    pages, out = cache.pages, []
    spans = [(0, n_prompt)] + [(t, t + 1) for t in range(n_prompt, n)]
    for a, b in spans:
        kv = KVCache.create(pages, table, np.full(W, b, np.int32), page_format=cache.page_format)
        pos = np.broadcast_to(np.arange(a, b, dtype=np.int32), (W, b - a))
        logits, kv = step(state, kv, jnp.asarray(ids[:, a:b]), jnp.asarray(pos))
        pages = kv.pages
        out.append(np.asarray(logits))
    return np.stack(out, axis=1)


def decode_logits(model, ids: list[int], n_prompt: int, kv_dtype) -> np.ndarray:
    """Logits [len(ids) - n_prompt, V] (float32) of the cached forward over one row: the prefill's last
    position's, then one decode step's for each later token but the last."""
    return cached_logits(model, [ids], n_prompt, kv_dtype)[0, :-1]


# The decode math of a held-out run (`decode_math`): the jnp reference the decode steps attend with.
DECODE_MATHS = {"bf16": mla_decode_reference, "fp8": mla_decode_fp8_math_reference}


@contextlib.contextmanager
def decode_math(math: str | None):
    """While open, the cached forward's decode steps attend with `math` (None: the model's own path, unchanged;
    a key of `DECODE_MATHS`): the scoped substitution of the module docstring. Yields a list that gets one
    entry each time a substituted decode is traced, so a caller can check that the steps took it."""
    traced: list[str] = []
    if math is None:
        yield traced
        return
    reference = DECODE_MATHS[math]

    def path(cfg, T, cache):  # the GPU's choice: the decode kernel wherever it serves the call
        chosen = cache_paths.cached_path(cfg, T, cache)
        problems = mla_decode_problems(cfg.num_attention_heads, cache.page_size, cache.page_format, T)
        return "decode_kernel" if chosen == "absorbed" and not problems else chosen

    def decode(q, kv_pages, block_table, seq_lens, *, impl, config, schedule, split_partials=False, **kwargs):
        del impl, config, schedule, split_partials  # the kernel's; a reference has no use for them (and merges)
        traced.append(math)
        return reference(q, kv_pages, block_table, seq_lens, **kwargs)

    saved = attention.cached_path, attention.mla_decode
    attention.cached_path, attention.mla_decode = path, decode
    try:
        yield traced
    finally:
        attention.cached_path, attention.mla_decode = saved


def teacher_forced(model, windows, n_prompt: int, kv_dtype, math: str | None = None) -> np.ndarray:
    """Decode-step logits float32 [W, n - n_prompt - 1, V] over rows of true text (windows int [W, n]): each
    row's first n_prompt tokens prefilled, then its tokens fed one a decode step under `decode_math(math)`;
    step t's logits predict windows[:, n_prompt + 1 + t]. Raises RuntimeError when a decode math was asked
    for and no step took it."""
    windows = np.asarray(windows, np.int32)
    if not 1 <= n_prompt <= windows.shape[1] - 2:
        raise ValueError(
            f"n_prompt must be in [1, {windows.shape[1] - 2}] for windows of {windows.shape[1]}, got {n_prompt}"
        )
    with decode_math(math) as traced:
        logits = cached_logits(model, windows[:, :-1], n_prompt, kv_dtype)[:, 1:]
    if math is not None and not traced:
        raise RuntimeError(f"decode math {math!r}: no decode step of the model went through mla_decode")
    return logits


def heldout_windows(count: int, n_tokens: int) -> np.ndarray:
    """int32 [count, n_tokens]: the first n_tokens of each of the first `count` windows mla-train evaluated the
    built-in model on (its held-out split, windows of the recipe's seq_len, models/builtin/training.json); a
    ValueError when the corpus is not the one the model was trained on or the split has too few windows."""
    with open(os.path.join(BUILTIN_DIR, "training.json")) as f:
        recipe = json.load(f)
    args = recipe["args"]
    data = load_corpus(CORPUS_PATH, args["seq_len"], args["eval_windows"])
    if data.fingerprint != recipe["corpus_sha256"]:
        raise ValueError(
            f"the corpus {CORPUS_PATH} has fingerprint {data.fingerprint}; the built-in model was trained on "
            f"{recipe['corpus_sha256']}"
        )
    W, T = data.windows.shape
    if not 1 <= count <= W or not 1 <= n_tokens <= T:
        raise ValueError(f"held-out windows: {count} of {n_tokens} tokens asked for, the split has {W} of {T}")
    return data.windows[:count, :n_tokens]


def mean_ce(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean cross-entropy (nats) of logits [..., V] against targets int [...]."""
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None], axis=-1).mean())


# (label, pages, decode math) of the held-out runs; "bf16 pages" is the baseline, "fp8 pages, FP8 math" the
# decision's check.
HELDOUT_BASELINE, HELDOUT_CHECKED = "bf16 pages", "fp8 pages, FP8 math"
HELDOUT_RUNS = (
    ("fp32 pages", "fp32", None),
    (HELDOUT_BASELINE, "bf16", None),
    ("bf16 pages, bf16 math (mla_decode_reference)", "bf16", "bf16"),
    ("fp8 pages, dequantised (jnp path)", "fp8", None),
    ("fp8 pages, bf16 math (mla_decode_reference)", "fp8", "bf16"),
    (HELDOUT_CHECKED, "fp8", "fp8"),
)
MIN_SAME_TOKEN, MAX_CE_CHANGE = 0.98, 0.01  # the decision's bounds (DESIGN.md, "FP8 pages compute in FP8")


def heldout(model, windows, n_prompt: int, runs=HELDOUT_RUNS) -> dict[str, dict]:
    """Each run of `runs` over the held-out rows (`teacher_forced`) -> {label: {"same": share of steps whose
    argmax is the baseline's, "ce": mean CE against the true next token, "ce_ratio": ce / the baseline's,
    "logits": the steps' logits}}; the baseline (`HELDOUT_BASELINE`) must be among the runs."""
    targets = np.asarray(windows)[:, n_prompt + 1 :]
    logits = {label: teacher_forced(model, windows, n_prompt, kv, math) for label, kv, math in runs}
    base = logits[HELDOUT_BASELINE]
    base_ce = mean_ce(base, targets)
    out = {}
    for label, x in logits.items():
        ce = mean_ce(x, targets)
        same = float((x.argmax(-1) == base.argmax(-1)).mean())
        out[label] = dict(same=same, ce=ce, ce_ratio=ce / base_ce, logits=x)
    return out


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
    p.add_argument(
        "--heldout-windows", type=int, default=8, help="held-out windows (built-in model; 0 leaves the measurement out)"
    )
    p.add_argument("--heldout-prompt", type=int, default=64, help="tokens a held-out window prefills (default 64)")
    p.add_argument("--heldout-positions", type=int, default=256, help="teacher-forced decode steps a window")
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
    if args.heldout_windows > 0:
        if builtin:
            print_heldout(model, args.heldout_windows, args.heldout_prompt, args.heldout_positions)
        else:
            print("# held-out: left out: the held-out split is the built-in model's")


def print_heldout(model, count: int, n_prompt: int, positions: int) -> None:
    windows = heldout_windows(count, n_prompt + positions + 1)
    print(
        f"# held-out: the first {count} of mla-train's evaluation windows (the last 5 % of the corpus's paragraphs), "
        f"each {n_prompt} tokens prefilled, then {positions} decode steps fed the true text "
        f"({count * positions} predictions a run)"
    )
    res = heldout(model, windows, n_prompt)
    print(f"{'run':45s} {'same next token as bf16 pages':>30s} {'CE (nats/token)':>16s} {'CE / bf16 pages':>16s}")
    for label, r in res.items():
        print(f"{label:45s} {100 * r['same']:29.2f} % {r['ce']:16.5f} {r['ce_ratio']:16.5f}")
    r = res[HELDOUT_CHECKED]
    ok_same, ok_ce = r["same"] >= MIN_SAME_TOKEN, abs(r["ce_ratio"] - 1) <= MAX_CE_CHANGE
    print(
        f"check ({HELDOUT_CHECKED} against {HELDOUT_BASELINE}): same next token {100 * r['same']:.2f} % >= "
        f"{100 * MIN_SAME_TOKEN:.0f} %: {'PASS' if ok_same else 'FAIL'}; CE {100 * (r['ce_ratio'] - 1):+.3f} % "
        f"within {100 * MAX_CE_CHANGE:.0f} %: {'PASS' if ok_ce else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
