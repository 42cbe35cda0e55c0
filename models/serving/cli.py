"""`mla-generate`: stream text from a DeepSeek-style model through the paged-cache engine.

    mla-generate                                   # the built-in small model on a built-in prompt
    mla-generate --prompt "Once upon" --max-new-tokens 64 --temperature 0.8 --top-p 0.9 --mtp
    mla-generate --mtp --mtp-draft-tokens 2      # two drafts a step (the MTP module chained)
    mla-generate --checkpoint DIR                  # an HF-layout checkpoint + its tokenizer.json

The text is printed as it is generated, then one stats line (prefill and decode tokens/s, MTP
acceptance, cache pages used). A silent run of the same request first compiles the programs the
timed run takes (each decode-loop length it reaches), so the tokens/s figures are the steps' own;
steps that compile (the warm-up's, or any with `--no-warmup`) are left out of them and reported as
compile time. Compiled steps are kept in jax's persistent compilation cache
(`--compile-cache`, see `models.compile_cache`), so a second run starts warm. `--mesh` places the
weights on a device mesh; `--coordinator/--num-processes/--process-id` join several processes first
(`models.distributed`). Errors in arguments or inputs: one line on stderr, exit status 2. Ctrl-C: the
text stops where it got to and ends its line, then `mla-generate: interrupted` on stderr, exit status 130.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import ModelConfig
from mla_jax.cache_paths import resolve_cache_impl
from mla_jax.kv_cache import CacheFullError
from mla_jax.memory import DEFAULT_MEMORY_FRACTION, check_fraction
from mla_jax.sharding import make_mesh, parse_mesh, shard_model
from models import compile_cache, distributed
from models.builtin import BUILTIN_DIR, BUILTIN_PROMPT
from models.checkpoint import load_hf_checkpoint
from models.deepseek import DeepSeekModel
from models.serving.engine import ATTENTION_IMPLS, Engine
from models.serving.sampling import SamplingParams
from models.tokenizer import ByteTokenizer, load_tokenizer
from pallas_kernels.page_format import NAMES as PAGE_FORMAT_NAMES
from pallas_kernels.page_format import resolve_page_format

DTYPES = ("auto", "float32", "bfloat16")
KV_DTYPES = ("auto", *PAGE_FORMAT_NAMES)  # "auto": `cache_dtype`
FALLBACK_PROMPT = "Once upon a time, there was a"


class _UsageError(Exception):
    """A bad argument or input: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of argparse's usage block
        raise _UsageError(message)


def _build_parser() -> _Parser:
    p = _Parser(
        prog="mla-generate",
        description="Generate text with a DeepSeek-style model (MLA paged cache, "
        "optional MTP speculative decoding), streaming it to stdout.",
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="HF-layout checkpoint directory (config.json, safetensors, tokenizer.json); "
        "default: the built-in small model",
    )
    p.add_argument("--prompt", help="prompt text (default: a built-in prompt)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate (default: 96)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, 1 = off (default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = off (default: 0)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter, 0 = off (default: 0)")
    p.add_argument("--mtp", action="store_true", help="speculative decoding with the model's MTP head")
    p.add_argument(
        "--mtp-draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="tokens the MTP head drafts a step with --mtp, 1..3 (default: 1)",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=8,
        metavar="N",
        help="model steps (plain decode, or MTP verify) one device call runs; each call is enqueued before the "
        "previous one is read, so 1 streams every token as its step ends, while more steps a call hide the "
        "host's share of a step where a small model's step is shorter than it (default: 8)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="compute dtype; auto = bfloat16 on a GPU, float32 elsewhere (default: auto)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="latent cache format; auto = bf16 on a GPU (the decode kernel's fastest), fp32 "
        "elsewhere, where the jnp path keeps the latents exact; fp8 = 656-byte tokens (e4m3 "
        "latent + fp32 scale per 128 + bf16 rope), 1.76x the tokens of bf16; fp4 = 416-byte "
        "tokens (e2m1 pairs + e4m3 scale per 16 + bf16 rope), 2.77x. The built-in model's greedy text depends "
        "on it: bf16 pages change it within a few words, fp16 and fp32 pages agree (default: auto)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the silent warm-up run that compiles the steps before the timed one",
    )
    p.add_argument(
        "--attention-impl",
        choices=ATTENTION_IMPLS,
        default="auto",
        help="attention over the cache: the Pallas kernels on a Hopper GPU where they serve the model (auto), "
        "the kernels (kernel; interpret: in the Pallas interpreter) or the jnp reference",
    )
    p.add_argument(
        "--mesh",
        metavar="SPEC",
        help="a device mesh, e.g. data=2,tensor=2 (axes data, expert, tensor; left out = 1): weights "
        "placed by mla_jax.sharding's table (heads and MLP width over tensor, routed experts "
        "over expert), the cache replicated on every device (default: one device)",
    )
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=DEFAULT_MEMORY_FRACTION,
        metavar="F",
        help="share of the GPU's memory (what JAX's allocator may use) the engine plans for: weights, the largest "
        f"step's temporaries and the page pool (default: {DEFAULT_MEMORY_FRACTION})",
    )

    compile_cache.add_argument(p)
    distributed.add_arguments(p)
    return p


def cache_dtype(name: str) -> str:
    """The Engine's page format for `--kv-dtype`: the name, or for "auto" bf16 on a GPU (where the kernels
    read it) and fp32 elsewhere (the small built-in model's greedy text drifts with bf16 latents on the jnp
    path)."""
    if name == "auto":
        return "bf16" if jax.default_backend() == "gpu" else "fp32"
    return name


def compute_dtype(name: str):
    """The jnp dtype of `--dtype` ("auto": bf16 on a GPU, where fp32 would double the weight bytes
    a decode step reads, fp32 on a CPU)."""

    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return jnp.float32 if name == "float32" else jnp.bfloat16


def _builtin_available() -> bool:

    return os.path.isfile(os.path.join(BUILTIN_DIR, "config.json"))


def _load(args):
    """-> (model, tokenizer, default prompt, a warning or None)."""

    dtype = compute_dtype(args.dtype)
    if args.checkpoint is not None:
        d = args.checkpoint
        if not os.path.isdir(d):
            raise _UsageError(f"--checkpoint {d}: no such directory")
        if not os.path.isfile(os.path.join(d, "config.json")):
            raise _UsageError(f"--checkpoint {d}: no config.json (expected a Hugging Face layout checkpoint)")
        try:
            tok = load_tokenizer(d)
        except (OSError, ValueError) as e:
            raise _UsageError(f"--checkpoint {d}: {e}") from None
        try:
            model = load_hf_checkpoint(d, dtype=dtype)
        except (OSError, ValueError, KeyError) as e:
            raise _UsageError(f"--checkpoint {d}: {e}") from None
        return model, tok, FALLBACK_PROMPT, None

    if _builtin_available():
        return load_hf_checkpoint(BUILTIN_DIR, dtype=dtype), load_tokenizer(BUILTIN_DIR), BUILTIN_PROMPT, None
    # The built-in weights are not there (not trained yet): a random model of the same shape, so
    # the command still exercises the whole path; its text is noise.

    model = DeepSeekModel(ModelConfig.tiny(), rngs=nnx.Rngs(0), dtype=dtype)
    warning = (
        "warning: the built-in checkpoint (models/builtin/config.json) is missing; using a randomly "
        "initialised ModelConfig.tiny() model, so the text is noise"
    )
    return model, ByteTokenizer(), BUILTIN_PROMPT, warning


class _TextStream:
    """Prints decoded text as tokens arrive. A byte-level token may end inside a UTF-8 character:
    text ending in U+FFFD is held back until the next token completes it (or the stream ends)."""

    def __init__(self, tok, out):
        self.tok, self.out = tok, out
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, request: int, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self._emit(text)

    def _emit(self, text: str) -> None:
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)

    def close(self) -> None:
        self._emit(self.tok.decode(self.ids))


def format_stats(stats: dict) -> str:
    """The one-line summary printed after the text."""
    acc = stats.get("mtp_acceptance")
    mtp = "off" if acc is None else f"{100 * acc:.1f}% ({stats['mtp_accepted']}/{stats['mtp_drafted']})"
    return (
        f"[stats] prefill {stats['prefill_tok_s']:.1f} tok/s ({stats['prefill_tokens']} tokens) | "
        f"decode {stats['decode_tok_s']:.1f} tok/s ({stats['decode_tokens']} tokens, "
        f"{stats['decode_steps']} steps) | MTP acceptance {mtp} | "
        f"pages used {stats['pages_used_peak']}/{stats['pages_total']} | compile {stats['compile_s']:.1f} s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The `mla-generate` console script: returns 0, or exits with status 2 and a one-line error (130 when
    interrupted)."""
    out, err = sys.stdout, sys.stderr
    mid_line = False  # text printed since the last newline: an interruption ends its line
    try:
        args = _build_parser().parse_args(argv)
        try:
            distributed.initialize(args)  # before anything else touches jax
        except (ValueError, RuntimeError) as e:
            raise _UsageError(str(e)) from None
        if args.max_new_tokens < 1:
            raise _UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        if args.mtp_draft_tokens is not None and not 1 <= args.mtp_draft_tokens <= 3:
            raise _UsageError(f"--mtp-draft-tokens must be in [1, 3], got {args.mtp_draft_tokens}")
        if args.mtp_draft_tokens is not None and not args.mtp:
            raise _UsageError(f"--mtp-draft-tokens {args.mtp_draft_tokens} drafts with the MTP head: add --mtp")
        args.mtp_draft_tokens = args.mtp_draft_tokens or 1
        if args.decode_steps < 1:
            raise _UsageError(f"--decode-steps must be >= 1, got {args.decode_steps}")
        try:
            check_fraction(args.memory_fraction, "--memory-fraction")
        except ValueError as e:
            raise _UsageError(str(e)) from None

        compile_cache.enable(args.compile_cache)
        try:
            sampling = SamplingParams(
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed
            )
        except ValueError as e:  # name the flag the user typed
            msg = str(e).replace("SamplingParams.", "--").replace("top_", "top-").replace("min_p", "min-p")
            raise _UsageError(msg) from None
        mesh = None
        if args.mesh is not None:
            try:
                sizes = parse_mesh(args.mesh)
            except ValueError as e:  # the message quotes the spec
                raise _UsageError(f"--mesh: {e}") from None
            try:
                mesh = make_mesh(**sizes)
            except ValueError as e:
                raise _UsageError(f"--mesh {args.mesh}: {e}") from None
        model, tok, default_prompt, warning = _load(args)
        if mesh is not None:
            try:
                model = shard_model(model, mesh)
            except ValueError as e:  # a head count or width the mesh does not divide
                raise _UsageError(f"--mesh {args.mesh}: {e}") from None
        if warning:
            print(warning, file=err)
        if args.mtp and len(model.mtp) == 0:
            raise _UsageError("--mtp: this model has no MTP module (num_nextn_predict_layers = 0)")
        prompt_text = default_prompt if args.prompt is None else args.prompt
        try:
            ids = tok.encode(prompt_text)
        except ValueError as e:  # e.g. argv bytes that are not UTF-8 (they arrive as surrogate escapes)
            raise _UsageError(f"--prompt: {e}") from None
        if not ids:
            raise _UsageError("--prompt is empty and the tokenizer adds no BOS token")
        cfg = model.cfg
        if len(ids) >= cfg.max_position_embeddings:
            raise _UsageError(f"the prompt has {len(ids)} tokens; the model's context is {cfg.max_position_embeddings}")
        max_context = min(cfg.max_position_embeddings, len(ids) + args.max_new_tokens)
        # The engine sizes its own pool for one sequence of max_context tokens (and the MTP draft room);
        # with data ranks a slot a rank (a pool per data rank: the slots must split evenly), the prompt in one.
        slots = dict(zip(mesh.axis_names, mesh.axis_sizes)).get("data", 1) if mesh is not None else 1
        page_format = cache_dtype(args.kv_dtype)
        try:  # the format first (its message names --kv-dtype), then whether the kernels serve this model
            page_format = resolve_page_format(page_format, value_dim=cfg.latent_dim, rope_dim=cfg.qk_rope_head_dim)
        except ValueError as e:
            raise _UsageError(f"--kv-dtype {args.kv_dtype}: {e}") from None
        try:
            resolve_cache_impl(args.attention_impl, cfg, 64, page_format, name="--attention-impl")
        except ValueError as e:
            raise _UsageError(str(e)) from None
        try:
            engine = Engine(
                model,
                page_size=64,
                max_batch=slots,
                max_context=max_context,
                attention_impl=args.attention_impl,
                kv_dtype=page_format,
                mesh=mesh,
                decode_steps=args.decode_steps,
                memory_fraction=args.memory_fraction,
            )
        except ValueError as e:
            raise _UsageError(str(e)) from None
        stops = () if tok.eos_id is None else (tok.eos_id,)
        compile_s = 0.0
        try:
            if not args.no_warmup:
                # The same request first, silently: it compiles (or loads from the cache) exactly the programs
                # the timed run takes (its prompt's chunk, each decode-loop length it reaches, its sampler; the
                # tokens are the same), so that the stats line measures warm steps rather than XLA compilation.
                warm = engine.generate(
                    [ids],
                    max_new_tokens=args.max_new_tokens,
                    sampling=sampling,
                    use_mtp=args.mtp,
                    stop_tokens=stops,
                    on_cache_full="raise",
                    mtp_draft_tokens=args.mtp_draft_tokens,
                )
                compile_s = warm.stats["compile_s"]
                if warm.errors[0] is not None:  # e.g. NaN logits: say so before printing anything
                    raise _UsageError(warm.errors[0])
            out.write(prompt_text)
            out.flush()
            mid_line = True
            stream = _TextStream(tok, out)
            res = engine.generate(
                [ids],
                max_new_tokens=args.max_new_tokens,
                sampling=sampling,
                use_mtp=args.mtp,
                stop_tokens=stops,
                stream=stream,
                on_cache_full="raise",
                mtp_draft_tokens=args.mtp_draft_tokens,
            )
        except CacheFullError as e:
            raise _UsageError(str(e)) from None
        stream.close()
        out.write("\n")
        mid_line = False
        if res.errors[0] is not None:
            raise _UsageError(res.errors[0])
        print(format_stats(dict(res.stats, compile_s=res.stats["compile_s"] + compile_s)), file=out)
        out.flush()
        if res.finish_reasons[0] == "stop":
            print(
                f"mla-generate: note: stopped after {len(res.tokens[0])} of {args.max_new_tokens} new tokens at the "
                f"end-of-text token ({tok.eos_id})",
                file=err,
            )
        if res.finish_reasons[0] == "context":
            print(
                f"mla-generate: note: stopped after {len(res.tokens[0])} of {args.max_new_tokens} new tokens at "
                f"the model's context limit ({cfg.max_position_embeddings} tokens; the prompt has {len(ids)})",
                file=err,
            )
        return 0
    except _UsageError as e:
        print(f"mla-generate: error: {e}", file=err)
        raise SystemExit(2) from None
    except (ValueError, OSError) as e:  # anything else the inputs can cause, still one line
        print(f"mla-generate: error: {e}", file=err)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C: the text so far, its line ended, then one line
        if mid_line:
            out.write("\n")
            out.flush()
        print("mla-generate: interrupted", file=err)
        raise SystemExit(130) from None


if __name__ == "__main__":
    sys.exit(main())
