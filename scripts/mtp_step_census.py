"""CUPTI census of the built-in model's decode steps on a GPU: the plain step and the MTP verify step (one and two
drafts), each warm, with its kernels a step, device time a step and host gap, and the decode rate over repeats.

    PYTHONPATH=. python3 scripts/mtp_step_census.py --out OUT [--label new] [--decode-steps 8] [--repeats 5]

The engine is `mla-generate`'s (page size 64, one sequence, `--decode-steps` steps a call) on the README prompt,
96 new tokens, greedy. Each mode is compiled and warmed first; `--repeats` generations give the decode rates
(their median and spread: at 8 steps a call this model's wall rate is host-bound and scatters ~15 %); then
`benchmarks.e2e_kernels.kernel_profile` takes the census (the difference of two generations). Writes
``OUT/census_<label>.json`` (a row a mode, the tokens included: MTP must equal plain greedy) and the per-kernel
tables ``OUT/kernels_<label>_<mode>.json``; prints a line a mode. Issue 56's "a verify step's device time <= 1.3x
a plain step's" reads ``device_ms_step`` of the ``mtp1`` row against the ``plain`` row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.e2e_cells import stat  # noqa: E402
from benchmarks.e2e_kernels import kernel_profile  # noqa: E402
from models import Engine, load_hf_checkpoint  # noqa: E402
from models.builtin import BUILTIN_DIR, BUILTIN_PROMPT  # noqa: E402
from models.tokenizer import load_tokenizer  # noqa: E402

MODES = (("plain", False, 1), ("mtp1", True, 1), ("mtp2", True, 2))
NEW_TOKENS = 96


def census(out: str, label: str, decode_steps: int = 8, repeats: int = 5) -> list[dict]:
    model, tok = load_hf_checkpoint(BUILTIN_DIR), load_tokenizer(BUILTIN_DIR)
    ids = tok.encode(BUILTIN_PROMPT)
    engine = Engine(model, page_size=64, max_batch=1, max_context=len(ids) + 2 * NEW_TOKENS, decode_steps=decode_steps)
    rows = []
    for mode, use_mtp, drafts in MODES:
        kw = dict(use_mtp=use_mtp, mtp_draft_tokens=drafts)
        for n in (NEW_TOKENS, 17, 81):  # compile every program the timed runs and the census's two lengths use
            engine.generate([ids], max_new_tokens=n, **kw)
        rates = []
        for _ in range(repeats):
            r = engine.generate([ids], max_new_tokens=NEW_TOKENS, **kw)
            rates.append(stat(r.stats, "decode_tok_s"))
        prof = kernel_profile(engine, [ids], kw, out, f"{label}_{mode}")
        row = dict(label=label, mode=mode, decode_steps_a_call=decode_steps, steps=stat(r.stats, "decode_steps"))
        row |= dict(tok_s=rates, tok_s_median=statistics.median(rates), **prof, tokens=[int(t) for t in r.tokens[0]])
        print(json.dumps({k: v for k, v in row.items() if k not in ("tokens", "top_kernels")}), flush=True)
        rows.append(row)
    if any(row["tokens"] != rows[0]["tokens"] for row in rows):
        print(f"# ERROR: MTP's tokens differ from plain greedy's ({label})", file=sys.stderr)
    with open(os.path.join(out, f"census_{label}.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for census_<label>.json and the kernel tables")
    p.add_argument("--label", default="run", help="names this run's files (e.g. base / new for a before-after)")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps a call (mla-generate's default 8)")
    p.add_argument("--repeats", type=int, default=5, help="timed generations a mode")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    census(args.out, args.label, args.decode_steps, args.repeats)


if __name__ == "__main__":
    main()
