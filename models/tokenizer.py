"""Tokenizers behind one small interface: bytes for the built-in model, `tokenizer.json` for HF checkpoints.

Interface (both classes):
  encode(text, add_bos=True) -> list[int]     decode(ids) -> str (special ids skipped)
  vocab_size, bos_id, eos_id, pad_id          (an id may be None for an HF tokenizer without it)

`ByteTokenizer`: ids 0..255 are the UTF-8 bytes of the text, then bos 256, eos 257, pad 258, and
259..263 reserved, so `vocab_size` = 264 = `ModelConfig.tiny().vocab_size`. A checkpoint directory
says it uses it with the marker file `byte_tokenizer.json` (written by `save_byte_tokenizer`).

`load_tokenizer(dir)` picks `tokenizer.json` (HF) when present, else the byte marker, else raises.
A malformed file raises `ValueError` naming it; text that is not valid Unicode (a lone surrogate,
which is how Python hands over the undecodable bytes of a non-UTF-8 command-line argument) raises
`ValueError` from `encode` naming the offending byte.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from tokenizers import Tokenizer

from mla_jax.hf_config import read_json_object

BYTE_TOKENIZER_FILE = "byte_tokenizer.json"  # the marker a byte-level checkpoint carries
HF_TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus specials (bos 256, eos 257, pad 258; 259..263 reserved)."""

    num_bytes = 256

    def __init__(self, bos_id: int = 256, eos_id: int = 257, pad_id: int = 258, vocab_size: int = 264):
        if not (isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size > self.num_bytes + 2):
            raise ValueError(
                f"ByteTokenizer vocab_size={vocab_size!r}: must be an int > {self.num_bytes + 2} "
                "(256 bytes and 3 special ids)"
            )
        specials = {"bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id}
        for name, v in specials.items():
            if not (isinstance(v, int) and self.num_bytes <= v < vocab_size):
                raise ValueError(f"ByteTokenizer {name}={v!r}: must be an int in [{self.num_bytes}, {vocab_size})")
            if isinstance(v, bool):
                raise ValueError(f"ByteTokenizer {name}={v!r}: must be an int, not a boolean")
        if len(set(specials.values())) != 3:
            raise ValueError(f"ByteTokenizer special ids must differ, got {specials}")
        self.bos_id, self.eos_id, self.pad_id, self.vocab_size = bos_id, eos_id, pad_id, vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(_utf8(text))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special ids are dropped and invalid UTF-8 becomes U+FFFD (a model may
        emit any byte sequence, and a cut-off multi-byte character must not crash a stream)."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the byte vocabulary [0, {self.vocab_size})")
            if i < self.num_bytes:
                out.append(i)
        return out.decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {
            "type": "byte",
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
        }

    def __repr__(self) -> str:
        return (
            f"ByteTokenizer(bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id}, "
            f"vocab_size={self.vocab_size})"
        )


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library, with the `ByteTokenizer` interface.

    BOS is added by us (not by the file's post-processor) so `add_bos` means the same for both
    classes. bos/eos/pad ids come from the arguments; `load_tokenizer` reads them from the
    checkpoint's `tokenizer_config.json` / `config.json`.
    """

    def __init__(
        self, path: str | os.PathLike, bos_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None
    ):
        path = os.fspath(path)
        self._tok = _read_hf_tokenizer(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        for name, v in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"HFTokenizer {name}={v!r}: must be an integer token id or None")
            if v is not None and not 0 <= v < self.vocab_size:
                raise ValueError(f"HFTokenizer {name}={v} is outside the vocabulary [0, {self.vocab_size})")
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        _utf8(text)  # the library raises TypeError("TextInputSequence must be str") on a lone surrogate
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else list(ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"


def _utf8(text: str) -> bytes:
    """`text` as UTF-8; TypeError for a non-str, ValueError naming the first character UTF-8 cannot hold."""
    if not isinstance(text, str):
        raise TypeError(f"encode expects str, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = (
            f"the byte 0x{c - 0xDC00:02x}, which is not UTF-8"
            if 0xDC80 <= c <= 0xDCFF  # surrogateescape
            else f"a lone surrogate U+{c:04X}"
        )
        raise ValueError(f"the text is not valid Unicode: character {e.start} is {what}; pass UTF-8 text") from None


def _read_hf_tokenizer(path: str):
    """`tokenizers.Tokenizer` of a tokenizer.json; FileNotFoundError / ValueError naming the file. The JSON is
    checked first: the library reports a JSON object that is no tokenizer (`{"a": 1}`) as if it were a syntax
    error ("expected `,` or `}` at line 1 column 5"), and a syntax error as a type error."""

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer file at {path!r}")
    try:
        spec = read_json_object(path)
    except ValueError as e:  # "<path>: not valid JSON: ..." / "<path>: expected a JSON object ..."
        raise ValueError(f"cannot read tokenizer {e}") from None
    not_hf = f"cannot read tokenizer {path}: valid JSON, but not a Hugging Face tokenizer.json"
    if "model" not in spec:
        keys = ", ".join(map(repr, list(spec)[:6])) + (", ..." if len(spec) > 6 else "")
        raise ValueError(f'{not_hf}: it has no "model" entry (its keys: {keys or "none"})')
    if not isinstance(spec["model"], dict):
        raise ValueError(f'{not_hf}: its "model" must be an object (BPE, WordLevel, ...), got {spec["model"]!r:.40}')
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception on a malformed file
        reason = " ".join(str(e).split())
        raise ValueError(f"{not_hf}: {reason}") from None


def save_byte_tokenizer(directory: str | os.PathLike, tok: ByteTokenizer | None = None) -> str:
    """Write the byte-tokenizer marker into a checkpoint directory; returns its path."""
    tok = tok or ByteTokenizer()
    path = os.path.join(os.fspath(directory), BYTE_TOKENIZER_FILE)
    with open(path, "w") as f:
        json.dump(tok.to_dict(), f, indent=2)
        f.write("\n")
    return path


def _read_json(path: str) -> dict:
    """The JSON object of a file, {} when there is no file; ValueError naming a malformed one."""
    if not os.path.isfile(path):
        return {}
    return read_json_object(path)


def _special_id(tok, tok_cfg: dict, key: str, model_cfg: dict, model_cfg_path: str):
    """An id from tokenizer_config.json's `bos_token`-style entry (str or {"content": str}), else
    config.json's `<key>_id` (an int, a list of ints whose first counts, or null)."""
    entry = tok_cfg.get(key)
    if isinstance(entry, dict):
        entry = entry.get("content")
    if isinstance(entry, str):
        i = tok.token_to_id(entry)
        if i is not None:
            return i
    fallback = model_cfg.get(key + "_id")
    if isinstance(fallback, list):  # config.json may list several eos ids
        fallback = fallback[0] if fallback else None
    if fallback is not None and (not isinstance(fallback, int) or isinstance(fallback, bool)):
        raise ValueError(
            f"{model_cfg_path}: {key}_id={model_cfg[key + '_id']!r}: must be an integer token id, "
            "a list of them, or null"
        )
    return fallback


def load_tokenizer(checkpoint_dir: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a checkpoint directory: `tokenizer.json` -> HFTokenizer, `byte_tokenizer.json` -> ByteTokenizer.

    Raises FileNotFoundError naming both files when the directory has neither, and ValueError
    when the byte marker disagrees with the model's vocabulary.
    """
    d = os.fspath(checkpoint_dir)
    if not os.path.isdir(d):
        raise FileNotFoundError(f"checkpoint directory {d!r} does not exist")
    hf_path = os.path.join(d, HF_TOKENIZER_FILE)
    byte_path = os.path.join(d, BYTE_TOKENIZER_FILE)
    cfg_path = os.path.join(d, "config.json")
    model_cfg = _read_json(cfg_path)
    if os.path.isfile(hf_path):
        tok_cfg = _read_json(os.path.join(d, "tokenizer_config.json"))
        raw = _read_hf_tokenizer(hf_path)
        ids = {name: _special_id(raw, tok_cfg, f"{name}_token", model_cfg, cfg_path) for name in ("bos", "eos", "pad")}
        try:
            return HFTokenizer(hf_path, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"])
        except ValueError as e:  # a special id outside the vocabulary: say which files disagree
            raise ValueError(f"{hf_path} with {cfg_path}: {e}") from None
    if os.path.isfile(byte_path):
        spec = _read_json(byte_path)
        if spec.get("type") != "byte":
            raise ValueError(f'{byte_path}: expected "type": "byte", got {spec.get("type")!r}')
        try:
            tok = ByteTokenizer(
                bos_id=spec.get("bos_id", 256),
                eos_id=spec.get("eos_id", 257),
                pad_id=spec.get("pad_id", 258),
                vocab_size=spec.get("vocab_size", 264),
            )
        except ValueError as e:
            raise ValueError(f"{byte_path}: {e}") from None
        vocab = model_cfg.get("vocab_size")
        if vocab is not None and vocab != tok.vocab_size:
            raise ValueError(
                f"{byte_path}: byte tokenizer vocab_size={tok.vocab_size} but config.json has vocab_size={vocab}"
            )
        return tok
    raise FileNotFoundError(
        f"no tokenizer in {d!r}: expected {HF_TOKENIZER_FILE} (Hugging Face) or "
        f"{BYTE_TOKENIZER_FILE} (byte-level, written by mla-train)"
    )
