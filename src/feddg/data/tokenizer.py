"""Tokenizers of the text datasets: a local Hugging Face tokenizer directory, or a byte-level BPE trained on the
corpus and cached.

The trained BPE has RoBERTa's special tokens in RoBERTa's order (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3,
``<mask>`` 4) and wraps every text as ``<s> ... </s>``, so ids and padding follow RoBERTa's convention whichever
tokenizer a run uses.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # RoBERTa's ids 0..4
BPE_VERSION = "v1"
#: the files one of which a Hugging Face tokenizer directory holds (besides a SentencePiece ``*.model``)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer saved in the local directory ``path`` (a model's or :func:`train_bpe`'s); never downloads."""
    from transformers import AutoTokenizer

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"tokenizer {folder}: no such directory (a local Hugging Face tokenizer or model directory)")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES) and not any(folder.glob("*.model")):
        raise ValueError(f"tokenizer {folder}: no tokenizer files ({', '.join(TOKENIZER_FILES)} or a *.model); "
                         "transformers would build an empty one from config.json alone")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"tokenizer {folder}: cannot load it ({str(err).splitlines()[0]})") from None
    if tokenizer.pad_token_id is None:
        raise ValueError(f"tokenizer {folder} has no padding token; text batches are padded with it")
    return tokenizer


def corpus_digest(texts: Sequence[str], vocab_size: int) -> str:
    """A hash of the corpus and the vocabulary size: the trained tokenizer's cache key."""
    h = hashlib.sha256(f"{BPE_VERSION}\t{vocab_size}\n".encode())
    for text in texts:
        h.update(text.encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()[:16]


def train_bpe(texts: Sequence[str], vocab_size: int, cache_dir: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """A byte-level BPE of ``vocab_size`` tokens (specials included) trained on ``texts`` (Sennrich et al., 2016;
    GPT-2/RoBERTa's byte-level variant), saved once under ``cache_dir/tokenizers/`` keyed by
    :func:`corpus_digest` and loaded from there afterwards."""
    from tokenizers import ByteLevelBPETokenizer, processors
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS) + 256} (the specials and the 256 bytes), "
                         f"got {vocab_size}")
    folder = Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{corpus_digest(texts, vocab_size)}"
    if not (folder / "tokenizer.json").is_file():
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                special_tokens=list(SPECIAL_TOKENS))
        bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                                       unk_token="<unk>", mask_token="<mask>")
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name, dir=folder.parent))
        try:
            fast.save_pretrained(str(tmp))
            os.replace(tmp, folder)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (folder / "tokenizer.json").is_file():  # not another process's finished copy: a real failure
                raise
    return load_tokenizer(folder)


def tokenizer_stamp(path: str | os.PathLike[str]) -> str:
    """A hash of a tokenizer directory's resolved path and its files' names, sizes and modification times (part of
    the token cache's key: another tokenizer, or an edited one, selects another cache)."""
    folder = Path(path).expanduser().resolve()
    lines = [str(folder)] + [f"{p.name}\t{p.stat().st_size}\t{p.stat().st_mtime_ns}"
                             for p in sorted(folder.iterdir()) if p.is_file()] if folder.is_dir() else [str(folder)]
    return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogateescape")).hexdigest()[:16]
