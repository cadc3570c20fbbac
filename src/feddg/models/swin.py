"""Swin-T (Liu et al., "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows", ICCV 2021): the
transformer backbone of FedFA+'s Swin-T results (FedFA Tables 3–7), built on ``transformers``' ``SwinModel``.

``features(x)`` is ``SwinModel``'s pooled output (the final LayerNorm of the stage-4 tokens, averaged over tokens);
``classifier`` a linear head. The model runs SwinModel's own modules stage by stage so that each stage's output can be
seen as a feature map: after the Swin blocks of stage k (before the patch merging that opens stage k + 1, as in the
Swin paper's Fig. 3) the tokens ``[B, H·W, C]`` are viewed as a grid ``[B, C, H, W]`` and passed through the
identity module ``stage_ends.<k-1>``. Those four modules are the stage map (``models/stages.py``), so FedFA's FFA
layers sit after each stage (FedFA Fig. 1) and their channel statistics over H×W (eq. 2) are those over the stage's
tokens. Without hooks the grid is a view: the forward computes exactly what ``SwinModel`` computes.

Input sizes. A window never crosses a stage's border and the last stage is whole windows, as Swin-T at 224 px (4-px
patches, windows of 7: 56, 28, 14, 7 tokens a side, i.e. 8, 4, 2, 1 windows): ``image_size`` must be a multiple of
``patch_size · 2³ · window_size`` (three patch mergings). By default the window is 7 for multiples of 56 px (224: patch
4) and 4 otherwise, and the patch ``image_size / (8 · window)``: 32 px (CIFAR-10) → patch 1, window 4; 64 px
(Tiny-ImageNet) → patch 2, window 4; both keep Swin-T's 8, 4, 2, 1 windows a side. ``patch_size`` / ``window_size``
(model options) override this.

``swin_t`` has Swin-T's sizes (embed 96, depths 2-2-6-2, heads 3-6-12-24; 28 M parameters), ``swin_tiny_test``
small ones for tests; both are randomly initialised offline, and model options are ``SwinConfig`` fields
(:data:`OPTIONS`). ``model.path`` loads a local Hugging Face Swin directory (``config.json`` + weights; its config
fixes the architecture; the head stays fresh); a whole-model ``.pth`` state_dict is ``model.weights``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from torch import Tensor, nn

from feddg.models.base import FedModel

#: Swin-T (Liu et al., Table 1): C = 96, layer numbers {2, 2, 6, 2}, heads {3, 6, 12, 24}
SWIN_T: dict[str, Any] = {"embed_dim": 96, "depths": [2, 2, 6, 2], "num_heads": [3, 6, 12, 24]}
#: a small stand-in for tests: channels 16, 32, 64, 128, two blocks a stage (regular and shifted windows)
SWIN_TINY_TEST: dict[str, Any] = {"embed_dim": 16, "depths": [2, 2, 2, 2], "num_heads": [1, 2, 4, 8]}
#: the ``SwinConfig`` fields ``model.params`` may set (checked by models/registry.py: ``check_model_params``)
OPTIONS = frozenset({"embed_dim", "depths", "num_heads", "patch_size", "window_size", "mlp_ratio", "drop_path_rate",
                     "hidden_dropout_prob", "attention_probs_dropout_prob", "qkv_bias", "hidden_act", "layer_norm_eps",
                     "use_absolute_embeddings", "initializer_range"})
MERGES = 3  # patch mergings between Swin's four stages


def default_patch_window(image_size: int) -> tuple[int, int]:
    """``(patch_size, window_size)`` giving Swin-T's 8, 4, 2, 1 windows a side: window 7 for multiples of 56 px
    (224 → patch 4), else window 4 (32 → patch 1, 64 → patch 2)."""
    window = 7 if image_size % 56 == 0 else 4
    return max(image_size // (2**MERGES * window), 1), window


def check_input_size(image_size: int, patch_size: int, window_size: int) -> None:
    """Refuse sizes whose stage grids are not whole windows (``transformers`` would pad or fail on them)."""
    step = patch_size * 2**MERGES * window_size
    if image_size % step:
        raise ValueError(f"swin: image_size {image_size} does not fit patch {patch_size} and window {window_size}: it "
                         f"must be a multiple of {step} (patch × 2^{MERGES} merges × window); set model.params "
                         "patch_size / window_size to fit it")


class StageEnd(nn.Module):
    """Identity on a stage's token grid ``[B, C, H, W]``: the module the stage map names (hooks see the grid)."""

    def forward(self, grid: Tensor) -> Tensor:
        return grid


class SwinClassifier(FedModel):
    """A ``transformers`` ``SwinModel`` (no pooling layer) run stage by stage, and a linear head."""

    def __init__(self, swin: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.swin = swin
        self.stage_ends = nn.ModuleList(StageEnd() for _ in self._stages())
        self.feature_dim = int(self.swin.get_submodule("layernorm").normalized_shape[0])  # type: ignore[index]
        self.classifier = nn.Linear(self.feature_dim, num_classes)

    def _stages(self) -> list[Any]:
        """SwinModel's four ``SwinStage`` modules (blocks, then a patch merging but in the last)."""
        return list(cast(nn.ModuleList, self.swin.get_submodule("encoder.layers")))

    def features(self, x: Tensor) -> Tensor:
        hidden, (h, w) = self.swin.get_submodule("embeddings")(x)
        for stage, end in zip(self._stages(), self.stage_ends, strict=True):  # SwinStage.forward, a grid at its end
            for block in stage.blocks:
                hidden = block(hidden, (h, w))[0]
            grid = end(hidden.transpose(1, 2).unflatten(2, (h, w)))  # a view: [B, C, H, W]
            hidden = grid.flatten(2).transpose(1, 2).contiguous()  # unchanged grid: the same memory, no copy
            if stage.downsample is not None:
                hidden = stage.downsample(hidden, (h, w))
                h, w = h // 2, w // 2
        return self.swin.get_submodule("layernorm")(hidden).mean(dim=1)  # SwinModel's pooler_output


def _swin(num_classes: int, in_channels: int, image_size: int, sizes: dict[str, Any], path: str | Path | None,
          options: dict[str, Any]) -> SwinClassifier:
    from transformers import SwinConfig, SwinModel  # imported when a Swin is built

    if path is not None:
        if options:
            raise ValueError(f"swin: model.path {path} fixes the architecture; drop model.params {sorted(options)}")
        if not Path(path).is_dir():
            raise ValueError(f"model.path {path}: no such directory: put a Hugging Face Swin model there "
                             "(config.json, model.safetensors)")
        swin = SwinModel.from_pretrained(str(path), local_files_only=True, add_pooling_layer=False,
                                         attn_implementation="sdpa")
        loaded: Any = swin.config
        if loaded.num_channels != in_channels:
            raise ValueError(f"model.path {path}: a Swin for {loaded.num_channels}-channel images; the data has "
                             f"{in_channels}")
        check_input_size(image_size, loaded.patch_size, loaded.window_size)
    else:
        patch, window = default_patch_window(image_size)
        fields = {"patch_size": patch, "window_size": window, **sizes, **options}
        check_input_size(image_size, fields["patch_size"], fields["window_size"])
        config = SwinConfig(image_size=image_size, num_channels=in_channels, **fields)
        config._attn_implementation = "sdpa"
        swin = SwinModel(config, add_pooling_layer=False)
    return SwinClassifier(swin, num_classes)


def swin_t(num_classes: int, in_channels: int = 3, image_size: int = 224, path: str | Path | None = None,
           **options: Any) -> SwinClassifier:
    """Swin-T (:data:`SWIN_T`), random weights, or the local Hugging Face directory ``path``."""
    return _swin(num_classes, in_channels, image_size, SWIN_T, path, options)


def swin_tiny_test(num_classes: int, in_channels: int = 3, image_size: int = 32, path: str | Path | None = None,
                   **options: Any) -> SwinClassifier:
    """A small random Swin (:data:`SWIN_TINY_TEST`) for tests and smoke runs."""
    return _swin(num_classes, in_channels, image_size, SWIN_TINY_TEST, path, options)
