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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-bytes", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, default=1)
    args = p.parse_args(argv)
    model, tok = load_hf_checkpoint(BUILTIN_DIR), load_tokenizer(BUILTIN_DIR)
    _, held = split_corpus(open(DEFAULT_CORPUS, encoding="utf-8").read())
    prompts = [tok.encode(para[: args.prompt_bytes]) for para in held[: args.prompts]]
    engine = Engine(model, page_size=64, max_batch=len(prompts), max_context=512)
    greedy = SamplingParams(temperature=0.0)
    plain = engine.generate(prompts, max_new_tokens=args.max_new_tokens, sampling=greedy)
    spec = engine.generate(
        prompts, max_new_tokens=args.max_new_tokens, sampling=greedy, use_mtp=True, mtp_draft_tokens=args.draft_tokens
    )
    s = spec.stats
    print(f"prompts {len(prompts)} x {args.max_new_tokens} new tokens, {args.draft_tokens} draft(s) a step")
    print(
        f"MTP acceptance {100 * s['mtp_acceptance']:.1f}% ({s['mtp_accepted']}/{s['mtp_drafted']}); "
        f"decode steps {s['decode_steps']} with MTP vs {plain.stats['decode_steps']} without"
    )
    same = spec.tokens == plain.tokens
    print(f"greedy tokens with MTP equal those without: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
