"""Text classification datasets: token ids (for transformers) and bag-of-words vectors, and the tokenised cache.

A corpus is tokenised **once** into ``<cache>/text/<name>_<source>_<tokenizer>_<max_length>.npy`` (token ids, int32
``[N, max_length]``, padded with the tokenizer's padding id, memory-mapped back) and its ``.npz`` beside it
(``lengths``, labels, domain ids, domain and class names, ``vocab_size``, ``pad_token_id``): ``source`` hashes the
source files' paths, sizes and modification times (or a built-in corpus's seed and version), ``tokenizer`` names the
tokenizer directory's files (or ``bpe<vocab_size>``), so a second load reads no text and trains no tokenizer.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor

from feddg.data.base import DomainDataset
from feddg.data.cache import Arrays, load_arrays, replaced_atomically, resolve_cache_dir, save_arrays
from feddg.data.image_cache import progress_bar
from feddg.data.tokenizer import load_tokenizer, tokenizer_stamp, train_bpe

DEFAULT_MAX_LENGTH = 128  # tokens per review, <s> and </s> included (data.max_length)
DEFAULT_VOCAB_SIZE = 4000  # the BPE trained when no tokenizer is given (data.vocab_size)
ENCODE_CHUNK = 1024  # texts per tokenizer call
META_KEYS = ("lengths", "labels", "domain_ids", "domains", "classes", "vocab_size", "pad_token_id")


@dataclass(frozen=True)
class Corpus:
    """Texts with a class and a domain each (indices into ``classes`` and ``domains``)."""

    domains: list[str]
    classes: list[str]
    texts: list[str]
    labels: np.ndarray
    domain_ids: np.ndarray

    @classmethod
    def from_domains(cls, classes: Sequence[str], samples: dict[str, list[tuple[str, int]]]) -> Corpus:
        """The corpus of ``(text, class index)`` samples per domain (domains in the mapping's order)."""
        domains = list(samples)
        return cls(domains, list(classes), [t for d in domains for t, _ in samples[d]],
                   np.array([k for d in domains for _, k in samples[d]], dtype=np.int64),
                   np.repeat(np.arange(len(domains), dtype=np.int64), [len(samples[d]) for d in domains]))


class TokenDataset(DomainDataset):
    """Token ids per review; :meth:`get_batch` pads each batch on the right to its longest review."""

    task = "classification"
    inputs = "tokens"

    def __init__(self, name: str, ids: np.ndarray, lengths: np.ndarray, labels: np.ndarray, domain_ids: np.ndarray,
                 domains: list[str], classes: list[str], *, vocab_size: int, pad_token_id: int) -> None:
        self.name, self.ids, self.lengths = name, ids, lengths
        self.labels, self.domain_ids, self.domains, self.classes = labels, domain_ids, domains, classes
        self.vocab_size, self.pad_token_id, self.max_length = int(vocab_size), int(pad_token_id), int(ids.shape[1])
        self.image_shape = (1, 1, self.max_length)

    def get_batch(self, indices: np.ndarray, train: bool,
                  generator: torch.Generator | None = None) -> tuple[dict[str, Tensor], Tensor]:
        """``({"input_ids", "attention_mask"}, labels)``, int64 ``[B, L]`` with ``L`` the batch's longest review
        (no training augmentation: ``train`` and ``generator`` are unused)."""
        idx = np.asarray(indices, dtype=np.int64)
        lengths = torch.from_numpy(self.lengths[idx].astype(np.int64))
        longest = int(lengths.max()) if len(idx) else 1
        ids = torch.from_numpy(self.ids[idx, :longest].astype(np.int64))
        mask = (torch.arange(longest)[None, :] < lengths[:, None]).long()
        return {"input_ids": ids, "attention_mask": mask}, torch.from_numpy(self.labels[idx])

    def model_args(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "max_length": self.max_length, "pad_token_id": self.pad_token_id}

    def subset(self, keep: np.ndarray, domains: list[str]) -> TokenDataset:
        """The samples ``keep``, their domains renumbered into ``domains`` (a subset of this one's, in its order)."""
        remap = np.array([domains.index(d) if d in domains else -1 for d in self.domains], dtype=np.int64)
        return TokenDataset(self.name, self.ids[keep], self.lengths[keep], self.labels[keep],
                            remap[self.domain_ids[keep]], domains, self.classes, vocab_size=self.vocab_size,
                            pad_token_id=self.pad_token_id)


class BowDataset(DomainDataset):
    """Bag-of-words count vectors (sparse rows made dense per batch), e.g. Amazon ``processed_acl``."""

    task = "classification"
    inputs = "features"

    def __init__(self, name: str, features: sp.csr_matrix, labels: np.ndarray, domain_ids: np.ndarray,
                 domains: list[str], classes: list[str], vocabulary: list[str]) -> None:
        self.name, self.features, self.vocabulary = name, features, vocabulary
        self.labels, self.domain_ids, self.domains, self.classes = labels, domain_ids, domains, classes
        self.image_shape = (1, 1, len(vocabulary))

    def get_batch(self, indices: np.ndarray, train: bool,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """``(float32 [B, V] counts, labels)`` (no training augmentation)."""
        idx = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(self.features[idx].toarray()), torch.from_numpy(self.labels[idx])

    def model_args(self) -> dict[str, Any]:
        return {"in_features": len(self.vocabulary)}

    def subset(self, keep: np.ndarray, domains: list[str]) -> BowDataset:
        """As :meth:`TokenDataset.subset`."""
        remap = np.array([domains.index(d) if d in domains else -1 for d in self.domains], dtype=np.int64)
        return BowDataset(self.name, self.features[keep], self.labels[keep], remap[self.domain_ids[keep]], domains,
                          self.classes, self.vocabulary)


def bag_of_words(samples: dict[str, list[tuple[dict[str, int], int]]], classes: list[str],
                 max_features: int) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray, list[str]]:
    """Count vectors over the ``max_features`` most frequent features of the corpus (total count, ties by name:
    MDAN's and KD3A's 5,000 for Amazon), with labels, domain ids and the vocabulary."""
    if max_features < 1:
        raise ValueError(f"max_features must be >= 1, got {max_features}")
    total: dict[str, int] = {}
    for rows in samples.values():
        for counts, _ in rows:
            for f, n in counts.items():
                total[f] = total.get(f, 0) + n
    vocabulary = sorted(total, key=lambda f: (-total[f], f))[:max_features]
    column = {f: j for j, f in enumerate(vocabulary)}
    docs = [counts for rows in samples.values() for counts, _ in rows]
    cells = [(i, column[f], n) for i, counts in enumerate(docs) for f, n in counts.items() if f in column]
    rows_, cols, data = (np.array(x) for x in zip(*cells, strict=True)) if cells else (np.zeros(0),) * 3
    matrix = sp.csr_matrix((data.astype(np.float32), (rows_.astype(np.int64), cols.astype(np.int64))),
                           shape=(len(docs), len(vocabulary)), dtype=np.float32)
    labels = np.array([k for rows in samples.values() for _, k in rows], dtype=np.int64)
    domain_ids = np.repeat(np.arange(len(samples), dtype=np.int64), [len(r) for r in samples.values()])
    return matrix, labels, domain_ids, vocabulary


#: part of every text cache key: bumped when a reader parses the same files otherwise (2: processed_acl splits at
#: spaces only, mixed-encoding files decode line by line; files the readers now refuse must not come back from an
#: earlier cache)
READERS_VERSION = 2


def files_key(root: Path, files: Sequence[Path]) -> str:
    """A hash of ``root`` and its ``files``' relative paths, sizes and modification times (the source's cache key)."""
    root = root.expanduser().resolve()
    h = hashlib.sha256(f"readers {READERS_VERSION}\n{root}".encode("utf-8", "surrogateescape"))
    for f in files:
        st = os.stat(f)
        h.update(f"\n{os.path.relpath(f.resolve(), root)}\t{st.st_size}\t{st.st_mtime_ns}".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


def encode(tokenizer: Any, texts: Sequence[str], max_length: int, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids int32 ``[N, max_length]`` (truncated, padded with ``pad_token_id``) and lengths int32 ``[N]``,
    encoded in chunks with a progress bar."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # client workers fork later: keep tokenizers quiet
    ids = np.full((len(texts), max_length), pad_token_id, dtype=np.int32)
    lengths = np.zeros(len(texts), dtype=np.int32)
    with progress_bar() as bar:
        task = bar.add_task(f"tokenising {len(texts)} texts", total=len(texts))
        for start in range(0, len(texts), ENCODE_CHUNK):
            chunk = tokenizer(list(texts[start : start + ENCODE_CHUNK]), truncation=True, max_length=max_length)
            for i, row in enumerate(chunk["input_ids"], start):
                ids[i, : len(row)] = row
                lengths[i] = len(row)
            bar.advance(task, len(chunk["input_ids"]))
    return ids, lengths


def _load_cache(path: Path, max_length: int) -> tuple[np.ndarray, Arrays] | None:
    meta = load_arrays(path.with_suffix(".npz"), META_KEYS)
    if meta is None:
        return None
    try:
        ids = np.load(path, mmap_mode="c")
    except (OSError, ValueError):
        return None
    ok = ids.dtype == np.int32 and ids.shape == (len(meta["labels"]), max_length)
    return (ids, meta) if ok else None


def _save_cache(path: Path, ids: np.ndarray, meta: Arrays) -> None:
    """The ids (atomically, as ``.npy``) and the meta ``.npz`` beside them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_arrays(path.with_suffix(".npz"), meta)
    with replaced_atomically(path) as tmp, tmp.open("wb") as f:
        np.save(f, ids)


def tokenised(name: str, source: str, read: Callable[[], Corpus], *, cache_dir: str | os.PathLike[str] | None,
              tokenizer: str | None, max_length: int, vocab_size: int) -> TokenDataset:
    """The :class:`TokenDataset` of the corpus ``read()`` returns, from the cache keyed by ``source`` (see the module
    docstring) or tokenised into it first: with the tokenizer directory ``tokenizer`` if given, else a byte-level BPE
    of ``vocab_size`` trained on every domain's texts (:func:`feddg.data.tokenizer.train_bpe`)."""
    if max_length < 8:
        raise ValueError(f"max_length must be >= 8, got {max_length}")
    cache = resolve_cache_dir(cache_dir)
    kind = f"tok{tokenizer_stamp(tokenizer)}" if tokenizer is not None else f"bpe{vocab_size}"
    path = cache / "text" / f"{name}_{source}_{kind}_{max_length}.npy"
    cached = _load_cache(path, max_length)
    if cached is None:
        corpus = read()
        tok = load_tokenizer(tokenizer) if tokenizer is not None else train_bpe(corpus.texts, vocab_size, cache)
        ids, lengths = encode(tok, corpus.texts, max_length, int(tok.pad_token_id))
        _save_cache(path, ids, {"lengths": lengths, "labels": corpus.labels, "domain_ids": corpus.domain_ids,
                                "domains": np.array(corpus.domains), "classes": np.array(corpus.classes),
                                "vocab_size": np.array(len(tok)), "pad_token_id": np.array(tok.pad_token_id)})
        cached = _load_cache(path, max_length)
        if cached is None:
            raise OSError(f"token cache {path} could not be read back after writing it")
    ids, meta = cached
    return TokenDataset(name, ids, meta["lengths"], meta["labels"].astype(np.int64),
                        meta["domain_ids"].astype(np.int64), [str(d) for d in meta["domains"]],
                        [str(c) for c in meta["classes"]], vocab_size=int(meta["vocab_size"]),
                        pad_token_id=int(meta["pad_token_id"]))
