"""The built-in small model: a ~1.4M-parameter byte-level DeepSeek-V3-style model (`ModelConfig.tiny()`:
MLA, 8-expert MoE with the V3 router, one MTP layer) trained by `mla-train` on
`models/data/corpus.txt`.

`BUILTIN_DIR` is an HF-layout checkpoint directory (config.json, model.safetensors,
byte_tokenizer.json, training.json with the exact recipe and losses):

    from models import load_hf_checkpoint
    from models.builtin import BUILTIN_DIR
    from models.tokenizer import load_tokenizer
    model, tok = load_hf_checkpoint(BUILTIN_DIR), load_tokenizer(BUILTIN_DIR)
"""

import os

BUILTIN_DIR = os.path.dirname(os.path.abspath(__file__))
# A prompt in the corpus's style, for `mla-generate` with no arguments.
BUILTIN_PROMPT = "Once upon a time, there was a"
