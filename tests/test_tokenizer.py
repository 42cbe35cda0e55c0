"""Tokenizers: the byte tokenizer round-trips any text, the HF wrapper has the same interface, and
`load_tokenizer` picks the right one or says why it cannot."""

import json

import pytest

from mla_jax import ModelConfig
from models.tokenizer import (
    BYTE_TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    save_byte_tokenizer,
)

TEXTS = [
    "",
    "a",
    "Once upon a time, there was a quiet fox.\n\nThe end.",
    "naïve café, Straße, ŝi",  # 2-byte characters
    "中文字符 and 日本語",  # 3-byte characters
    "emoji 🙂🦊 and a flag 🇳🇴",  # 4-byte characters and a multi-codepoint sequence
    "\x00 control \t chars \x7f",
]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert ids[1:] == list(text.encode("utf-8"))  # ids are exactly the UTF-8 bytes
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_byte_vocab_matches_tiny_config():
    tok, cfg = ByteTokenizer(), ModelConfig.tiny()
    assert tok.vocab_size == cfg.vocab_size
    assert (tok.bos_id, tok.eos_id) == (cfg.bos_token_id, cfg.eos_token_id)
    assert tok.pad_id == 258


def test_byte_decode_skips_specials_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    hi = list("hi".encode())
    assert tok.decode([tok.bos_id, *hi, tok.eos_id, tok.pad_id, 263]) == "hi"
    # 0xff never occurs in UTF-8; a 3-byte character cut after 2 bytes is incomplete: both become U+FFFD
    assert tok.decode([*hi, 0xFF]) == "hi\ufffd"
    cut = list("中".encode())[:2]
    assert tok.decode([*hi, *cut]) == "hi\ufffd"


def test_byte_rejects_bad_input():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([1, 264])
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="expects str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="bos_id"):
        ByteTokenizer(bos_id=65)  # a byte id cannot be a special
    with pytest.raises(ValueError, match="must differ"):
        ByteTokenizer(bos_id=256, eos_id=256)


def _make_hf_tokenizer_json(path):
    """A small byte-level BPE trained here (no download), with <s>/</s> specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the cat sat on the mat", "once upon a time there was a fox"], trainer)
    tok.save(str(path))
    return tok


def test_hf_tokenizer_round_trip_and_specials(tmp_path):
    raw = _make_hf_tokenizer_json(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id) == (raw.token_to_id("<s>"), raw.token_to_id("</s>"))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id
        assert tok.decode(ids) == text  # the bos is a special token: skipped
        assert tok.encode(text, add_bos=False) == ids[1:]
    # merges were learned: a training word is fewer tokens than bytes
    assert len(tok.encode("the cat", add_bos=False)) < len("the cat")


def test_hf_tokenizer_ids_from_config_json(tmp_path):
    _make_hf_tokenizer_json(tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [0]}))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (1, 0)


def test_hf_tokenizer_bad_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read tokenizer"):
        HFTokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError):
        HFTokenizer(tmp_path / "missing.json")


def test_load_tokenizer_byte_marker(tmp_path):
    save_byte_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 264}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert tok.decode(tok.encode("ok ✓")) == "ok ✓"


def test_load_tokenizer_prefers_tokenizer_json(tmp_path):
    save_byte_tokenizer(tmp_path)
    _make_hf_tokenizer_json(tmp_path / "tokenizer.json")
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"tokenizer.json.*{BYTE_TOKENIZER_FILE}"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    save_byte_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    with pytest.raises(ValueError, match="vocab_size"):
        load_tokenizer(tmp_path)
