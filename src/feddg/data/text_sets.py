"""The text datasets by layout: each loader returns every domain's samples (``data/registry.py`` selects domains and
subsamples), tokenised through the cache of :mod:`feddg.data.text`; :func:`check_text` lists every problem."""

from __future__ import annotations

import os
from pathlib import Path

from feddg.data import synthetic_text
from feddg.data.base import first_problem
from feddg.data.text import BowDataset, Corpus, TokenDataset, bag_of_words, files_key, tokenised
from feddg.data.text_formats import (
    ACL_LAYOUT,
    AMAZON_DOMAINS,
    RAW_LAYOUT,
    SENTIMENT,
    TABLE_LAYOUT,
    read_processed_acl,
    read_raw,
    read_table,
    review_files,
    table_files,
)

AMAZON = "amazon-reviews"
TABLE = "text-table"
AMAZON_BOW = "amazon-bow"
MAX_FEATURES = 5000  # MDAN's and KD3A's bag-of-words size for Amazon


def _raise(problems: list[str], name: str, root: str) -> None:
    if problems:
        raise ValueError(first_problem(problems, name, root))


def load_synthetic_sentiment(*, root: str | None, cache_dir: str | os.PathLike[str] | None, seed: int,
                             tokenizer: str | None, max_length: int, vocab_size: int) -> TokenDataset:
    """``synthetic-sentiment`` (:mod:`feddg.data.synthetic_text`) drawn from ``seed``, tokenised."""
    if root is not None:
        raise ValueError(f"{synthetic_text.NAME} is built in and takes no root (got {root!r})")

    def read() -> Corpus:
        return Corpus.from_domains(synthetic_text.CLASSES, synthetic_text.generate(seed))

    return tokenised(synthetic_text.NAME, f"seed{seed}-{synthetic_text.VERSION}", read, cache_dir=cache_dir,
                     tokenizer=tokenizer, max_length=max_length, vocab_size=vocab_size)


def load_amazon_reviews(*, root: str | None, cache_dir: str | os.PathLike[str] | None, seed: int,
                        tokenizer: str | None, max_length: int, vocab_size: int) -> TokenDataset:
    """Blitzer et al.'s raw release under ``root``, tokenised."""
    if root is None:
        raise ValueError(f"dataset {AMAZON} needs root=<folder> laid out as {text_layout(AMAZON)}")
    files, problems = review_files(root)
    _raise(problems, AMAZON, root)

    def read() -> Corpus:
        samples, bad = read_raw(root)
        _raise(bad, AMAZON, root)
        return Corpus.from_domains(SENTIMENT, samples)

    return tokenised(AMAZON, files_key(Path(root), [f for _, f, _ in files]), read, cache_dir=cache_dir,
                     tokenizer=tokenizer, max_length=max_length, vocab_size=vocab_size)


def load_text_table(*, root: str | None, cache_dir: str | os.PathLike[str] | None, seed: int,
                    tokenizer: str | None, max_length: int, vocab_size: int) -> TokenDataset:
    """A CSV / JSONL table (or a folder of them) at ``root``, tokenised; domains and classes sorted by name."""
    if root is None:
        raise ValueError(f"dataset {TABLE} needs root=<file or folder>: {text_layout(TABLE)}")
    files, problems = table_files(root)
    _raise(problems, TABLE, root)

    def read() -> Corpus:
        _, rows, bad = read_table(root)
        _raise(bad, TABLE, root)
        classes = sorted({label for samples in rows.values() for _, label in samples})
        return Corpus.from_domains(classes, {d: [(t, classes.index(c)) for t, c in s] for d, s in rows.items()})

    folder = Path(root).expanduser()
    return tokenised(TABLE, files_key(folder if folder.is_dir() else folder.parent, files), read,
                     cache_dir=cache_dir, tokenizer=tokenizer, max_length=max_length, vocab_size=vocab_size)


def load_amazon_bow(*, root: str | None, max_features: int = MAX_FEATURES) -> BowDataset:
    """Amazon ``processed_acl`` under ``root`` as count vectors over its ``max_features`` most frequent features."""
    if root is None:
        raise ValueError(f"dataset {AMAZON_BOW} needs root=<folder> laid out as {text_layout(AMAZON_BOW)}")
    samples, problems = read_processed_acl(root)
    _raise(problems, AMAZON_BOW, root)
    features, labels, domain_ids, vocabulary = bag_of_words(samples, list(SENTIMENT), max_features)
    return BowDataset(AMAZON_BOW, features, labels, domain_ids, list(AMAZON_DOMAINS), list(SENTIMENT), vocabulary)


def text_layout(name: str) -> str:
    """How dataset ``name``'s root is laid out."""
    return {AMAZON: RAW_LAYOUT, TABLE: TABLE_LAYOUT, AMAZON_BOW: ACL_LAYOUT}.get(name, "(built in)")


def check_text(name: str, root: str | None) -> list[str]:
    """Every malformed file and line of text dataset ``name`` at ``root`` (``[]`` for the built-in corpus)."""
    if name == synthetic_text.NAME:
        return []
    if root is None:
        raise ValueError(f"dataset {name} needs --root laid out as {text_layout(name)}")
    if name == AMAZON:
        return read_raw(root)[1]
    if name == AMAZON_BOW:
        return read_processed_acl(root)[1]
    return read_table(root)[2]
