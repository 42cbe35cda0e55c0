"""What a `mla-bench e2e` run covers and where its rows go: the reference cells and the tiny ones, the
``--cells`` / ``--batch`` x ``--prompt`` grid, the random prompts of a cell (fixed or ragged lengths), the meshes
of ``--mesh``, the columns of e2e.csv and its writers (e2e.csv, e2e.jsonl, e2e_meta.json)."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np

import benchmarks as bm
from benchmarks.e2e_models import MODELS, model_config
from mla_jax.sharding import parse_mesh

CSV_NAME, JSONL_NAME, META_NAME = "e2e.csv", "e2e.jsonl", "e2e_meta.json"

# The reference run (about 8 minutes on an H200): V2-Lite at 1K context over the batches, the V3 cut, then
# V2-Lite at 8K. In this order so that a cut-short run still has a bit of each.
DEFAULT_BATCHES, DEFAULT_PROMPTS = "1,8,32,128", "1024,8192"  # the full grid (--batch / --prompt)
QUICK_CELLS = [
    ("v2-lite", 1, 1024),
    ("v2-lite", 8, 1024),
    ("v2-lite", 32, 1024),
    ("v2-lite", 128, 1024),
    ("v3-cut", 1, 1024),
    ("v3-cut", 8, 1024),
    ("v2-lite", 1, 8192),
    ("v2-lite", 8, 8192),
]

# --config tiny's cells (`tiny_cells`): (model, B, prompt as a fraction of the model's context). Three cells, each
# compiling its own prefill and decode steps (~5 s each on a busy 2-core CPU), so that the run stays under a minute.
TINY_CELLS = [
    ("v2-lite", 1, 1 / 8),
    ("v2-lite", 4, 1 / 2),
    ("v3-cut", 1, 1 / 8),
]
TINY_CELLS_TEXT = "v2-lite B=1 at 1/8 of the context, v2-lite B=4 at 1/2, v3-cut B=1 at 1/8 (256, 1024, 256 tokens)"

# Columns of e2e.csv, in order (a row may leave any of them empty).
COLUMNS = [
    "model",
    "impl",
    "B",
    "prompt",
    "lengths",
    "prompt_mean",
    "new_tokens",
    "mtp",
    "layers",
    "kv_dtype",
    "weights",
    "cold_wall_s",
    "warm_wall_s",
    "cold_compile_s",
    "compile_s",
    "compiles",
    "compile_buckets",
    "ttft_s",
    "ttft_stats_s",
    "prefill_s",
    "prefill_tok_s",
    "prefill_gflop",
    "prefill_tflops",
    "prefill_mfu",
    "prefill_chunk",
    "decode_steps",
    "decode_ms_step",
    "decode_tok_s",
    "mtp_acceptance",
    "decode_calls",
    "steps_per_call",
    "kernels_step",
    "device_ms_step",
    "host_gap_ms_step",
    "top_kernels",
    "floor_gb",
    "floor_ms",
    "x_floor",
    "experts_touched",
    "pages_used_peak",
    "peak_mem_gb",
    "build_s",
    "weights_gb",
    "same_tokens",
    "mesh",
    "devices",
    "pool_devices",
    "agree_one_device",
    "note",
    "error",
]


# ------------------------------------------------------------------------------------------
# Cells
# ------------------------------------------------------------------------------------------
def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_cells(spec: str) -> list[tuple[str, int, int]]:
    """ "v2-lite:1x1024,8x1024;v3-cut:1x1024" -> [(model, B, T), ...] in the order given."""
    cells = []
    for group in spec.split(";"):
        if not group.strip():
            continue
        name, _, items = group.partition(":")
        if name.strip() not in MODELS or not items:
            raise ValueError(f"--cells group {group!r}: expected MODEL:BxT[,BxT...] with MODEL in {MODELS}")
        for item in items.split(","):
            b, _, t = item.strip().partition("x")
            cells.append((name.strip(), int(b), int(t)))
    return cells


def format_cells(cells) -> str:
    return ";".join(
        f"{m}:" + ",".join(f"{b}x{t}" for _, b, t in grp) for m, grp in itertools.groupby(cells, key=lambda c: c[0])
    )


def tiny_cells(models, *, layers=None, kv_dtype: str = "bf16", new_tokens: int = 128) -> list[tuple[str, int, int]]:
    """--config tiny's cells of `models`: TINY_CELLS with each prompt a fraction of that tiny model's context C
    (`max_position_embeddings`, 2048), at most C - new_tokens - 3 (the engine's draft room), so that every
    cell's prompt and new tokens fit the model (the full grid's 8192-token prompts do not)."""
    cells = []
    for name, b, frac in TINY_CELLS:
        if name in models:
            C = model_config(name, config="tiny", layers=layers, kv_dtype=kv_dtype).max_position_embeddings
            cells.append((name, b, max(1, min(int(C * frac), C - new_tokens - 3))))
    return cells


def grid(args) -> list[tuple[str, int, int]]:
    """The cells of this run: --cells, else (--config tiny without --batch / --prompt) `tiny_cells`, else
    --quick, else models x --batch x --prompt."""
    if args.cells:
        return parse_cells(args.cells)
    models = args.model.split(",")
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"e2e: error: unknown model {m!r}; known: {', '.join(MODELS)}")
    if args.config == "tiny" and args.batch is None and args.prompt is None:
        return tiny_cells(models, layers=args.layers, kv_dtype=args.kv_dtype, new_tokens=args.new_tokens)
    if args.quick:
        return [c for c in QUICK_CELLS if c[0] in models]
    prompts, batches = parse_ints(args.prompt or DEFAULT_PROMPTS), parse_ints(args.batch or DEFAULT_BATCHES)
    return [(m, b, t) for m in models for t in prompts for b in batches]


def segments(cells):
    """Runs of consecutive cells of one model: each runs in one worker process."""
    return [list(g) for _, g in itertools.groupby(cells, key=lambda c: c[0])]


# ------------------------------------------------------------------------------------------
# Prompts and meshes
# ------------------------------------------------------------------------------------------
RAGGED_SHORTEST = 16  # --ragged: prompt lengths uniform in [T // 16, T]


def prompt_lengths(batch: int, prompt: int, *, ragged: bool = False, seed: int = 0) -> list[int]:
    """The B prompts' lengths: T each, or with ``ragged`` drawn uniformly from [max(1, T // RAGGED_SHORTEST), T]
    (the same draw for a cell wherever it runs: seeded by the seed and the cell)."""
    if not ragged:
        return [prompt] * batch
    rng = np.random.default_rng((seed, batch, prompt, RAGGED_SHORTEST))
    return rng.integers(max(1, prompt // RAGGED_SHORTEST), prompt + 1, batch).tolist()


def lengths_label(prompt: int, ragged: bool) -> str:
    return f"uniform {max(1, prompt // RAGGED_SHORTEST)}-{prompt}" if ragged else "fixed"


def make_prompts(vocab: int, batch: int, prompt: int, seed: int = 0, *, ragged: bool = False) -> list[list[int]]:
    """B random prompts of T token ids (with ``ragged``, row b cut to `prompt_lengths`' b-th length), the same
    for ours and the HF peer."""
    rng = np.random.default_rng((seed, batch, prompt))
    ids = rng.integers(0, vocab, (batch, prompt)).tolist()
    return [row[:n] for row, n in zip(ids, prompt_lengths(batch, prompt, ragged=ragged, seed=seed))]


def parse_meshes(specs) -> list:
    """`--mesh` values -> [None (one device) | {axis: size}], in order; "1" is one device. ValueError (one
    line, `mla_jax.sharding.parse_mesh`'s) for a bad spec or a spec given twice."""
    out, seen = [], set()
    for spec in specs or ["1"]:
        sizes = None if spec.strip() == "1" else parse_mesh(spec)
        key = mesh_label(sizes)
        if key in seen:
            raise ValueError(f"mesh {spec!r} is given twice")
        seen.add(key)
        out.append(sizes)
    return out


def mesh_label(sizes) -> str:
    """The `impl` column of our rows: "ours" on one device, e.g. "ours@data=2,tensor=2" on a mesh."""
    return "ours@" + ",".join(f"{a}={n}" for a, n in sizes.items()) if sizes else "ours"


# ------------------------------------------------------------------------------------------
# Rows and the run's metadata
# ------------------------------------------------------------------------------------------
def append_row(out_dir: str, row: dict) -> None:
    """Adds `row` to e2e.csv (`benchmarks.append_row`: rewritten whole through a temporary file, so a kill never
    leaves half a file) and to e2e.jsonl (every field, lists included)."""
    bm.append_row(os.path.join(out_dir, CSV_NAME), row, columns=COLUMNS, jsonl=os.path.join(out_dir, JSONL_NAME))


def read_meta(out_dir: str) -> dict:
    path = os.path.join(out_dir, META_NAME)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_meta(out_dir: str, meta: dict) -> None:
    bm.write_json(os.path.join(out_dir, META_NAME), meta)


def stat(stats, key):
    """stats["key"] of a dict or of a dataclass that supports [] (or has the attribute); None when absent."""
    try:
        return stats[key]
    except (KeyError, TypeError, IndexError, AttributeError):
        return getattr(stats, key, None)


# ------------------------------------------------------------------------------------------
# Greedy tokens against a reference run
# ------------------------------------------------------------------------------------------
def common_prefix(tokens, reference) -> int:
    """How many leading positions `tokens` and `reference` share (the index of their first difference, or the
    shorter length when none)."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n


def token_agreement(tokens, reference) -> float:
    """The fraction of generated positions where `tokens` equal `reference` (per request, up to the first
    difference: after it the two continue from different contexts, so later positions do not count as
    agreeing)."""
    same = total = 0
    for a, b in zip(tokens, reference):
        same, total = same + common_prefix(a, b), total + max(len(a), len(b))
    return same / total if total else 1.0
