"""A run's data: the corpus split into training and held-out paragraphs, tokenized into two streams; the
training batches (a pure function of the seed and the step) and the fixed held-out windows.

Each paragraph (blank-line separated) becomes [bos] + UTF-8 bytes + [eos] (`ByteTokenizer`); the last
`HELDOUT_FRACTION` of them are held out. A training batch is B windows of T tokens at offsets drawn from
`numpy.random.default_rng([seed, step])`: the step number *is* the data-order RNG state, so resuming at step s
draws exactly the batches an uninterrupted run would have drawn. Evaluation reads consecutive non-overlapping
T-token windows of the held-out stream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np

from models.tokenizer import ByteTokenizer
from models.training.settings import SettingError, TrainerError

HELDOUT_FRACTION = 0.05


def split_corpus(text: str, heldout_fraction: float = HELDOUT_FRACTION) -> tuple[list[str], list[str]]:
    """(train paragraphs, held-out paragraphs): the last `heldout_fraction` of the blank-line separated
    paragraphs (at least one) are held out. Deterministic; raises TrainerError on fewer than 2 paragraphs."""
    paras = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
    paras = [p for p in paras if p]
    if len(paras) < 2:
        raise TrainerError(f"the corpus needs at least 2 paragraphs (blank-line separated), found {len(paras)}")
    n_held = max(1, int(round(len(paras) * heldout_fraction)))
    return paras[:-n_held], paras[-n_held:]


def token_stream(paragraphs: list[str], tok) -> np.ndarray:
    """int32 [N]: [bos] + bytes + [eos] per paragraph, concatenated."""
    ids: list[int] = []
    for p in paragraphs:
        ids += tok.encode(p, add_bos=True)
        ids.append(tok.eos_id)
    return np.asarray(ids, np.int32)


def train_batch(stream: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int) -> np.ndarray:
    """int32 [B, T]: random windows; the offsets depend only on (seed, step) (see the module docstring)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len + 1, size=batch_size)
    return np.stack([stream[s : s + seq_len] for s in starts])


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """int32 [W, T]: the first `max_windows` consecutive non-overlapping windows of the held-out stream."""
    n = min(len(stream) // seq_len, max_windows)
    return stream[: n * seq_len].reshape(n, seq_len)


def corpus_fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class CorpusData:
    """A corpus made ready for a run: the token streams of both splits and the fixed evaluation windows."""

    train_ids: np.ndarray  # int32 [N_train]
    heldout_ids: np.ndarray  # int32 [N_held]
    windows: np.ndarray  # int32 [W, T]
    fingerprint: str  # corpus_fingerprint of the text


def load_corpus(path: str, seq_len: int, max_windows: int) -> CorpusData:
    """Read, split and tokenize a corpus (TrainerError when it is missing, not UTF-8 or too short)."""

    if os.path.isdir(path):
        raise SettingError("{0} {p!r} is a directory, not a text file", "corpus", p=path)
    if not os.path.isfile(path):
        raise SettingError("{0} {p!r}: no such file", "corpus", p=path)
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            text = f.read()
        except UnicodeDecodeError as e:
            raise SettingError("{0} {p!r} is not UTF-8 text: {e}", "corpus", p=path, e=e) from e
    tok = ByteTokenizer()
    train_paras, held_paras = split_corpus(text)
    train_ids, held_ids = token_stream(train_paras, tok), token_stream(held_paras, tok)
    if len(train_ids) < seq_len + 1:
        raise SettingError(
            "the training split has {n} tokens, fewer than {0} {t} + 1", "seq_len", n=len(train_ids), t=seq_len
        )
    windows = eval_windows(held_ids, seq_len, max_windows)
    if len(windows) == 0:
        raise SettingError(
            "the held-out split has {n} tokens, fewer than one {0} window ({t})", "seq_len", n=len(held_ids), t=seq_len
        )
    return CorpusData(train_ids, held_ids, windows, corpus_fingerprint(text))
