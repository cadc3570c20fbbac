"""The explicit model registry, and loading of local ``.pth`` state_dicts."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from feddg.models.alexnet import AlexNet
from feddg.models.base import FedModel
from feddg.models.cnn import cnn, cnn_gn
from feddg.models.cnn4 import CNN4
from feddg.models.efficientnet import efficientnet_lite0
from feddg.models.hfedf_cnn import HFedFCNN
from feddg.models.lenet import LeNet
from feddg.models.mlp import BagOfWordsMLP
from feddg.models.resnet import resnet18, resnet50
from feddg.models.swin import OPTIONS as SWIN_OPTIONS
from feddg.models.swin import swin_t, swin_tiny_test
from feddg.models.transformer import deberta_options, pretrained_transformer, roberta_options, tiny_deberta, tiny_roberta
from feddg.models.unet import UNet
from feddg.models.vgg import vgg11, vgg11_bn

logger = logging.getLogger(__name__)

# Every image factory takes (num_classes, in_channels, image_size, **model options); a token model
# (num_classes, vocab_size, max_length, pad_token_id, **options), a feature model (num_classes, in_features, ...).
MODELS: dict[str, Callable[..., FedModel]] = {
    "alexnet": AlexNet,
    "cnn": cnn,
    "cnn4": CNN4,  # 32-64-64-64, ~94k parameters (the W1 benchmark)
    "cnn_gn": cnn_gn,  # cnn with GroupNorm: no running statistics (for dp_weights)
    "efficientnet_lite0": efficientnet_lite0,  # model.params.pretrained: true for the ImageNet weights
    "hfedf-cnn": HFedFCNN,
    "lenet": LeNet,
    "mlp": BagOfWordsMLP,  # bag-of-words [B, V] inputs; model.params.hidden (256)
    "resnet18": resnet18,
    "resnet50": resnet50,
    "swin_t": swin_t,  # Swin-T via transformers (random init; model.path: a local HF Swin); models/swin.py: sizes
    "swin_tiny_test": swin_tiny_test,  # a small random Swin (channels 16-128) for tests
    "tiny-deberta": tiny_deberta,  # random DeBERTa-v2 (hidden 64, 2 layers, 4 heads), disentangled attention
    "tiny-roberta": tiny_roberta,  # random RoBERTa (hidden 64, 2 layers, 4 heads)
    "transformer": pretrained_transformer,  # a local Hugging Face model directory (model.path): RoBERTa, DeBERTa
    "unet": UNet,  # dense [B, classes, H, W] outputs (segmentation); width 32, depth 4 is FedHarmo/FedFA's
    "vgg11": vgg11,
    "vgg11_bn": vgg11_bn,
}


_STAGES = frozenset({"conv_stages"})
_BN_STAGES = frozenset({"batchnorm", "conv_stages"})
_TOKENS = frozenset({"tokens"})  # takes {"input_ids", "attention_mask"} batches (feddg.tasks.TOKENS)
_FEATURES = frozenset({"features"})  # takes dense [B, V] vectors (feddg.tasks.FEATURES)
_DENSE = frozenset({"dense_masks"})  # predicts per-pixel class scores [B, classes, H, W] (feddg.tasks.DENSE_MASKS)
#: what each model offers methods (``feddg.tasks`` capabilities): BatchNorm layers, a conv-stage map
#: (models/stages.py), the non-image inputs it takes (tokens, features), and dense masks where it predicts per pixel
#: (every other model predicts one class per sample); checked against the built models by tests/test_models.py
CAPABILITIES: dict[str, frozenset[str]] = {
    "alexnet": _BN_STAGES,
    "cnn": _BN_STAGES,
    "cnn4": _BN_STAGES,
    "cnn_gn": _STAGES,
    "efficientnet_lite0": _BN_STAGES,
    "hfedf-cnn": _STAGES,
    "lenet": _STAGES,
    "mlp": _FEATURES,
    "resnet18": _BN_STAGES,
    "resnet50": _BN_STAGES,
    "swin_t": _STAGES,  # LayerNorm only; stage ends are token grids [B, C, H, W]
    "swin_tiny_test": _STAGES,
    "tiny-deberta": _TOKENS,
    "tiny-roberta": _TOKENS,
    "transformer": _TOKENS,
    "unet": _BN_STAGES | _DENSE,
    "vgg11": _STAGES,
    "vgg11_bn": _BN_STAGES,
}


#: what each kind of dataset gives a model (``DomainDataset.model_args()``)
DATA_OF: dict[str, frozenset[str]] = {
    "images": frozenset({"in_channels", "image_size"}),
    "tokens": frozenset({"vocab_size", "max_length", "pad_token_id"}),
    "features": frozenset({"in_features"}),
}
#: what the data and the run give a model (the above, the task's head, ``model.path``), never ``model.params``
DATA_ARGS = frozenset().union(*DATA_OF.values()) | {"num_classes", "path"}
#: the ``model.params`` of the models whose factories pass options on to a Hugging Face config (``**options``):
#: that config's fields, read when asked (transformers is slow to import); ``transformer``'s go to
#: ``from_pretrained`` and depend on the checkpoint, so they are not listed (its loader judges them)
HF_OPTIONS: dict[str, Callable[[], frozenset[str]]] = {
    "swin_t": lambda: SWIN_OPTIONS,
    "swin_tiny_test": lambda: SWIN_OPTIONS,
    "tiny-deberta": deberta_options,
    "tiny-roberta": roberta_options,
}
#: the options of those models too many or too open to list, in words
OPTIONS_IN_WORDS = {
    "tiny-deberta": "DebertaV2Config's fields",
    "tiny-roberta": "RobertaConfig's fields",
    "transformer": "from_pretrained's keywords",
}


def model_targets(name: str) -> str:
    """What model ``name``'s outputs predict: ``dense_masks`` or ``class_labels`` (a task's targets)."""
    return next(iter(model_capabilities(name) & _DENSE), "class_labels")


def model_inputs(name: str) -> str:
    """What model ``name`` takes: ``tokens``, ``features`` or ``images`` (a dataset's ``inputs``)."""
    return next(iter(model_capabilities(name) & (_TOKENS | _FEATURES)), "images")


def model_options(name: str) -> frozenset[str] | None:
    """The keys ``model.params`` may set for model ``name`` (its factory's keyword options beyond
    :data:`DATA_ARGS`, or its Hugging Face config's fields); ``None`` where the model's loader judges them."""
    if name in HF_OPTIONS:
        return HF_OPTIONS[name]()
    parameters = inspect.signature(MODELS[name]).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters) - DATA_ARGS


def options_text(name: str) -> str:
    """Model ``name``'s ``model.params`` keys in one line (``feddg models``, errors), without importing transformers."""
    if name in OPTIONS_IN_WORDS:
        return OPTIONS_IN_WORDS[name]
    options = model_options(name)
    return "any (its factory judges them)" if options is None else ", ".join(sorted(options)) or "none"


def check_model_params(name: str, params: Iterable[str]) -> None:
    """Refuse, in one line naming it, a ``model.params`` key that model ``name`` does not take: a value the data
    gives, or an option the model does not have (a typo would otherwise be a TypeError, or silently ignored by a
    Hugging Face config)."""
    if given := sorted(set(params) & DATA_ARGS):
        raise ValueError(f"model.params.{given[0]}: given by the data or the run (data.*, model.path), not "
                         "model.params")
    options = model_options(name)
    if options is not None and (unknown := sorted(set(params) - options)):
        raise ValueError(f"model.params.{unknown[0]}: model {name} has no such option; it takes {options_text(name)}")


def model_capabilities(name: str) -> frozenset[str]:
    """What model ``name`` offers methods, without building it."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    return CAPABILITIES[name]


def list_models() -> list[str]:
    """Names accepted by :func:`create_model`."""
    return sorted(MODELS)


#: models that load a local directory (``model.path``)
TAKES_PATH = frozenset({"transformer", "swin_t", "swin_tiny_test"})


def create_model(
    name: str,
    num_classes: int,
    in_channels: int | None = None,
    image_size: int | None = None,
    weights: str | Path | None = None,
    path: str | Path | None = None,
    **kwargs: object,
) -> FedModel:
    """Build a zoo model: an image model for ``in_channels``×``image_size``² inputs (default 3 × 28²), a token model
    from ``vocab_size``, ``max_length``, ``pad_token_id``, a feature model from ``in_features`` (in ``kwargs``, from
    ``DomainDataset.model_args()``); other ``kwargs`` are model options (e.g. ``small_input``, ``hidden_dim``).
    ``weights`` is a local ``.pth`` state_dict loaded with :func:`load_weights`; ``path`` a local model directory,
    for the models in :data:`TAKES_PATH`."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    images = {k: v for k, v in (("in_channels", in_channels), ("image_size", image_size)) if v is not None}
    data = images | {k: kwargs.pop(k) for k in DATA_OF["tokens"] | DATA_OF["features"] if k in kwargs}
    check_model_params(name, kwargs)
    inputs = model_inputs(name)
    if foreign := sorted(set(data) - DATA_OF[inputs]):
        kind = next(k for k, args in DATA_OF.items() if foreign[0] in args)
        raise ValueError(f"model {name} takes {inputs}, not {kind} ({', '.join(foreign)})")
    if inputs == "images":
        data = {"in_channels": 3, "image_size": 28} | data
    if path is not None:
        if name not in TAKES_PATH:
            raise ValueError(f"model.path is for {', '.join(sorted(TAKES_PATH))}; model {name} takes none")
        kwargs["path"] = path
    model = MODELS[name](num_classes=num_classes, **data, **kwargs)
    if weights is not None:
        load_weights(model, weights)
    return model


def _head_prefix(model: FedModel) -> str:
    name = next(name for name, module in model.named_modules() if module is model.classifier)
    return f"{name}."


def _first(keys: Iterable[str], n: int = 3) -> str:
    names = sorted(keys)
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _shape_diff(keys: list[str], state: Mapping[str, Tensor], own: Mapping[str, Tensor], n: int = 3) -> str:
    diff = "; ".join(f"{k} {list(state[k].shape)} vs {list(own[k].shape)}" for k in keys[:n])
    return diff + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def load_weights(model: FedModel, path: str | Path) -> None:
    """Load a state_dict saved with ``torch.save(model.state_dict(), path)`` into ``model``.

    Head tensors (those of ``model.classifier``) whose shapes differ, e.g. a checkpoint for another
    number of classes, are skipped and keep their fresh initialisation; this is logged. Any other
    difference (missing, unexpected or mis-shaped keys) raises a one-line ``ValueError`` naming the
    file and the first few keys; a missing file raises ``FileNotFoundError``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model weights not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load fails with many types: UnpicklingError, RuntimeError, struct.error, ...
        raise ValueError(
            f"{path}: cannot be read by torch.load(weights_only=True) ({type(err).__name__}); "
            "save a state_dict with torch.save(model.state_dict(), path)"
        ) from err
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path}: not a state_dict (a dict of tensors), got {type(state).__name__}")

    own = model.state_dict()
    # BatchNorm fills in ``num_batches_tracked`` for checkpoints that predate it (torchvision's); a variant's own
    # additions (``model.added_keys``: DAC-SC's CCNorm / SCNorm parameters) keep their initialisation.
    optional = {k for k in own if k.endswith(".num_batches_tracked")} | set(getattr(model, "added_keys", ()))
    missing = set(own) - set(state) - optional
    unexpected = set(state) - set(own)
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing keys: {_first(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {_first(unexpected)}")
        raise ValueError(f"{path}: does not fit {type(model).__name__}; {'; '.join(problems)}")
    mismatched = sorted(k for k, v in state.items() if own[k].shape != v.shape)
    head = _head_prefix(model)
    skipped = [k for k in mismatched if k.startswith(head)]
    trunk = [k for k in mismatched if not k.startswith(head)]
    if trunk:
        diff = _shape_diff(trunk, state, own)
        raise ValueError(f"{path}: shape mismatch for {type(model).__name__} (checkpoint vs model): {diff}")
    model.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=False)
    if skipped:
        logger.warning(
            "%s: head shape differs (checkpoint vs model: %s); loaded everything else, "
            "the head keeps its fresh initialisation",
            path,
            _shape_diff(skipped, state, own),
        )
