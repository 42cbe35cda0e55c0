"""MTP speculative decoding on the built-in model: acceptance rate, and output equal to plain greedy.

    python scripts/measure_mtp_acceptance.py [--prompts 8] [--prompt-bytes 32] [--max-new-tokens 128]

Prompts are the first bytes of held-out corpus paragraphs (never trained on). Prints the MTP
acceptance (accepted / drafted), the decode steps with and without MTP, and whether the greedy
tokens with MTP equal those without it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import Engine, SamplingParams, load_hf_checkpoint  # noqa: E402
from models.builtin import BUILTIN_DIR  # noqa: E402
from models.tokenizer import load_tokenizer  # noqa: E402
from models.training.loop import DEFAULT_CORPUS, split_corpus  # noqa: E402


def measure(prompts: int = 8, prompt_bytes: int = 32, max_new_tokens: int = 128, draft_tokens: int = 1) -> dict:
    """Greedy generation of the first `prompts` held-out paragraphs' first `prompt_bytes` bytes, plain and with
    MTP -> {"accepted", "drafted", "mtp_steps", "plain_steps", "same"} (the README's and PERFORMANCE.md's
    figures; `tests/test_readme.py` checks them against this)."""
    model, tok = load_hf_checkpoint(BUILTIN_DIR), load_tokenizer(BUILTIN_DIR)
    _, held = split_corpus(open(DEFAULT_CORPUS, encoding="utf-8").read())
    ids = [tok.encode(para[:prompt_bytes]) for para in held[:prompts]]
    engine = Engine(model, page_size=64, max_batch=len(ids), max_context=512)
    greedy = SamplingParams(temperature=0.0)
    plain = engine.generate(ids, max_new_tokens=max_new_tokens, sampling=greedy)
    spec = engine.generate(
        ids, max_new_tokens=max_new_tokens, sampling=greedy, use_mtp=True, mtp_draft_tokens=draft_tokens
    )
    s = spec.stats
    return dict(
        accepted=s["mtp_accepted"],
        drafted=s["mtp_drafted"],
        mtp_steps=s["decode_steps"],
        plain_steps=plain.stats["decode_steps"],
        same=spec.tokens == plain.tokens,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-bytes", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, default=1)
    args = p.parse_args(argv)
    m = measure(args.prompts, args.prompt_bytes, args.max_new_tokens, args.draft_tokens)
    print(f"prompts {args.prompts} x {args.max_new_tokens} new tokens, {args.draft_tokens} draft(s) a step")
    print(
        f"MTP acceptance {100 * m['accepted'] / m['drafted']:.1f}% ({m['accepted']}/{m['drafted']}); "
        f"decode steps {m['mtp_steps']} with MTP vs {m['plain_steps']} without"
    )
    print(f"greedy tokens with MTP equal those without: {m['same']}")
    return 0 if m["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
