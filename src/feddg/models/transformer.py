"""Text classifiers for token inputs (HFedATM Tables 1–2: RoBERTa-base and DeBERTa-base on Amazon Reviews).

A Hugging Face sequence classifier wrapped in the zoo's contract (``classifier(features(x))``) on
``{"input_ids", "attention_mask"}`` batches:

- RoBERTa-style (``classifier`` a head with ``dense`` and ``out_proj``): ``features`` is the ``<s>`` token's hidden
  state through the head's dropout → dense → tanh → dropout, ``classifier`` the head's ``out_proj``;
- DeBERTa-style (a ``pooler`` then a linear ``classifier``): ``features`` is the ContextPooler's output (dropout),
  ``classifier`` the model's ``classifier``.

So ``model(x)`` computes the Hugging Face model's logits, and FedSR/FedIIR act on the pooled representation and the
last linear layer. ``tiny-roberta``/``tiny-deberta`` are small randomly initialised ones (tests, smoke runs);
``transformer`` loads a local pre-trained directory (``model.path``). transformers is imported when one is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from feddg.models.base import FedModel

#: the tiny models' size (a random-weight stand-in for the base models' 768 hidden, 12 layers, 12 heads, 3072)
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


class TextTransformer(FedModel):
    """A Hugging Face ``*ForSequenceClassification`` model as a zoo model (see the module docstring)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        head = getattr(hf, "classifier", None)
        self.pooled = hasattr(hf, "pooler") and isinstance(head, nn.Linear)  # DeBERTa-style
        if not self.pooled and not (isinstance(getattr(head, "out_proj", None), nn.Linear) and hasattr(head, "dense")):
            raise ValueError(f"{type(hf).__name__}: unsupported head; expected RoBERTa's (dense, out_proj) or "
                             "DeBERTa's (pooler, linear classifier)")
        self.hf = hf
        self.feature_dim = int(self.config.hidden_size)

    @property
    def classifier(self) -> nn.Module:  # type: ignore[override]
        """The final linear layer to the classes (HF's ``out_proj`` or ``classifier``), a submodule of ``hf``."""
        head = self.hf.get_submodule("classifier")
        return head if self.pooled else head.get_submodule("out_proj")

    def __setattr__(self, name: str, value: Any) -> None:
        # as in EfficientNetLite: assigning ``classifier`` would register a second, unused head
        if name == "classifier":
            raise AttributeError("TextTransformer.classifier is a read-only alias of a module inside hf")
        super().__setattr__(name, value)

    @property
    def config(self) -> Any:
        """The Hugging Face model's config (``PretrainedConfig``)."""
        return self.hf.config

    def features(self, x: Mapping[str, Tensor]) -> Tensor:  # type: ignore[override]
        hidden = self.hf.base_model(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).last_hidden_state  # type: ignore[operator]
        if self.pooled:
            return self.hf.dropout(self.hf.pooler(hidden))  # type: ignore[operator]
        head = self.hf.get_submodule("classifier")
        h = head.dropout(hidden[:, 0])  # type: ignore[operator]
        return head.dropout(torch.tanh(head.dense(h)))  # type: ignore[operator]

    def forward(self, x: Mapping[str, Tensor]) -> Tensor:  # type: ignore[override]
        return self.classifier(self.features(x))


def _positions(max_length: int, pad_token_id: int) -> int:
    """RoBERTa numbers positions from ``pad_token_id + 1``: ``max_length`` tokens need ``max_length + pad + 1``."""
    return max_length + pad_token_id + 1


#: DeBERTa-v3's disentangled attention (relative positions, ``p2c`` + ``c2p``, ``share_att_key``) for ``tiny-deberta``
DISENTANGLED = {"relative_attention": True, "pos_att_type": ["p2c", "c2p"], "share_att_key": True,
                "position_biased_input": False, "norm_rel_ebd": "layer_norm", "max_relative_positions": -1}
#: the config fields the tiny models take from the data, never from ``model.params``
FROM_DATA = frozenset({"vocab_size", "pad_token_id", "max_position_embeddings"})


def roberta_options() -> frozenset[str]:
    """The keys ``model.params`` may set for ``tiny-roberta``: ``RobertaConfig``'s fields but :data:`FROM_DATA`."""
    from transformers import RobertaConfig

    return frozenset(RobertaConfig().to_dict()) - FROM_DATA


def deberta_options() -> frozenset[str]:
    """The keys ``model.params`` may set for ``tiny-deberta``: ``DebertaV2Config``'s fields and those of
    :data:`DISENTANGLED` (read by the model, not declared by the config), but :data:`FROM_DATA`."""
    from transformers import DebertaV2Config

    return (frozenset(DebertaV2Config().to_dict()) | set(DISENTANGLED)) - FROM_DATA


def tiny_roberta(num_classes: int, vocab_size: int, max_length: int, pad_token_id: int = 1,
                 **params: Any) -> TextTransformer:
    """A small random RoBERTa (:data:`TINY`, eager attention); ``params`` override its ``RobertaConfig``."""
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(vocab_size=vocab_size, pad_token_id=pad_token_id,
                           max_position_embeddings=_positions(max_length, pad_token_id), **{**TINY, **params})
    config.num_labels = num_classes
    config._attn_implementation = "eager"
    return TextTransformer(RobertaForSequenceClassification(config))


def tiny_deberta(num_classes: int, vocab_size: int, max_length: int, pad_token_id: int = 1,
                 **params: Any) -> TextTransformer:
    """A small random DeBERTa-v2 (:data:`TINY`) with DeBERTa-v3's disentangled attention (:data:`DISENTANGLED`);
    ``params`` override its ``DebertaV2Config``."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    config = DebertaV2Config(vocab_size=vocab_size, pad_token_id=pad_token_id,
                             max_position_embeddings=_positions(max_length, pad_token_id),
                             **{**TINY, **DISENTANGLED, **params})
    config.num_labels = num_classes
    config._attn_implementation = "eager"
    return TextTransformer(DebertaV2ForSequenceClassification(config))


def pretrained_transformer(num_classes: int, path: str | Path | None = None, **params: Any) -> TextTransformer:
    """``AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_classes, local_files_only=True)``
    (RoBERTa- or DeBERTa-style heads); the data's ``vocab_size`` and ``max_length`` must fit the model's embeddings
    (one line otherwise: they failed as an index error in the first forward). ``params`` go to ``from_pretrained``."""
    data = {key: params.pop(key, None) for key in ("vocab_size", "max_length", "pad_token_id")}
    if path is None:
        raise ValueError("model transformer needs model.path: a local Hugging Face model directory")
    if not Path(path).is_dir():
        raise ValueError(f"model.path {path}: no such directory: put a Hugging Face model there (config.json, "
                         "model.safetensors, tokenizer files)")
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(
        str(path), num_labels=num_classes, local_files_only=True, attn_implementation="eager", **params)
    _fits_embeddings(hf.config, path, data["vocab_size"], data["max_length"], data["pad_token_id"])
    return TextTransformer(hf)


def _fits_embeddings(config: Any, path: str | Path, vocab_size: int | None, max_length: int | None,
                     pad_token_id: int | None) -> None:
    """The tokenizer's ids within the model's vocabulary, ``max_length`` within its positions (RoBERTa's start
    after the padding id)."""
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise ValueError(f"model.path {path}: the tokenizer has {vocab_size} tokens, the model's embeddings "
                         f"{config.vocab_size}: use the model's own tokenizer")
    positions = getattr(config, "max_position_embeddings", None)
    offset = (pad_token_id or 0) + 1 if getattr(config, "model_type", "") == "roberta" else 0
    if max_length is not None and positions is not None and max_length + offset > positions:
        raise ValueError(f"data.max_length {max_length}: the model at {path} has {positions} positions"
                         f"{f' (its first {offset} reserved)' if offset else ''}: at most {positions - offset}")
