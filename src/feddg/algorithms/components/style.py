"""Style machinery shared by PARDON and CCST: AdaIN, style statistics, FINCH, style encoders.

Equations (PARDON, §III-B):

* eq. 2 — the style of a set of feature maps ``{F_i}`` (each ``[C, H, W]``) is the channel-wise
  mean and standard deviation over every sample and pixel of the set;
* eq. 6 — AdaIN (Huang & Belongie, 2017): ``AdaIN(F, S) = σ_S · (F − μ(F)) / σ(F) + μ_S`` with
  ``μ(F), σ(F)`` the per-sample channel statistics of ``F``; the stylised sample is
  ``x̃ = D(α·AdaIN(E(x), S) + (1 − α)·E(x))`` (α = 0.5 in the authors' code).

A :class:`StyleCodec` is the encoder/decoder pair ``(E, D)``. Three implementations:

* ``adain-vgg`` — the AdaIN paper's normalised VGG-19 up to relu4_1 and its mirrored decoder,
  from local files (``vgg_normalised.pth``, ``decoder.pth``). Statistics are taken and injected
  at the *same* layer, relu4_1 (the PARDON code takes them before that ReLU but injects after it).
* ``feature`` — weight-free: a frozen copy of the *initial* global model up to the end of a conv
  stage is ``E``; the transferred feature map replaces that stage's output in the trained network,
  so ``D`` is the identity and the rest of the network continues from it.
* ``pixel`` — weight-free: AdaIN on the (normalised) image channels; ``E = D = identity``.
"""

from __future__ import annotations

import copy
import functools
import logging
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from feddg.algorithms.base import ClientContext, Params
from feddg.devices import images
from feddg.messages import WEIGHT_PREFIX, Message, load_weights, subset
from feddg.numerics import sqrt

if TYPE_CHECKING:
    from feddg.models.base import FedModel

logger = logging.getLogger(__name__)
EPS = 1e-5
ENCODER_PREFIX = "enc/"
StylePath = Literal["feature", "pixel", "adain-vgg"]
#: the weight-free path measured best on Digits-DG (docs/methods/pardon.md, "Style path")
DEFAULT_STYLE_PATH: StylePath = "pixel"


class StyleParams(Params):
    """Which style encoder/decoder a method uses (shared by PARDON and CCST)."""

    style_path: StylePath = Field(DEFAULT_STYLE_PATH, description="feature | pixel | adain-vgg")
    style_stage: int = Field(1, ge=1, description="feature path: E = the model up to the end of this conv stage")
    style_layer: str | None = Field(None, description="feature path: module name overriding style_stage")
    vgg_weights: str | None = Field(None, description="adain-vgg: local vgg_normalised.pth")
    decoder_weights: str | None = Field(None, description="adain-vgg: local decoder.pth")
    image_mean: tuple[float, ...] = Field((0.5, 0.5, 0.5), description="adain-vgg: the dataset's normalisation")
    image_std: tuple[float, ...] = Field((0.5, 0.5, 0.5), description="adain-vgg: the dataset's normalisation")


# --------------------------------------------------------------------------- statistics


def channel_moments(feat: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample channel mean ``E[F]`` and second moment ``E[F²]`` over pixels: two ``[B, C]``."""
    flat = feat.flatten(2)
    return flat.mean(dim=2), flat.pow(2).mean(dim=2)


def std_from_moments(mean: Tensor, second: Tensor, eps: float = EPS) -> Tensor:
    """``σ = sqrt(E[F²] − E[F]² + ε)`` (population variance, as eq. 2)."""
    return sqrt((second - mean.pow(2)).clamp_min(0.0).add(eps))


def channel_stats(feat: Tensor, eps: float = EPS) -> tuple[Tensor, Tensor]:
    """Per-sample channel mean and std of ``[B, C, H, W]`` feature maps: two ``[B, C]``."""
    mean, second = channel_moments(feat)
    return mean, std_from_moments(mean, second, eps)


def pooled_style(mean: Tensor, second: Tensor, eps: float = EPS) -> tuple[Tensor, Tensor]:
    """Eq. 2: style (channel mean, std over all samples and pixels) of a set of feature maps.

    Takes the per-sample moments ``[N, C]`` of :func:`channel_moments`; with equal ``H×W`` per
    sample the pooled mean and second moment are the means of the per-sample ones.
    """
    m, s = mean.mean(dim=0), second.mean(dim=0)
    return m, std_from_moments(m, s, eps)


def adain(feat: Tensor, mean: Tensor, std: Tensor, eps: float = EPS) -> Tensor:
    """Eq. 6: re-normalise each sample's channels of ``feat`` to the target ``mean``/``std``.

    ``mean`` and ``std`` are ``[C]`` (one style for the batch) or ``[B, C]`` (one per sample).
    """
    mu, sigma = channel_stats(feat, eps)
    target_mu = mean.expand_as(mu)[..., None, None]
    target_sigma = std.expand_as(sigma)[..., None, None]
    return (feat - mu[..., None, None]) / sigma[..., None, None] * target_sigma + target_mu


def blend(feat: Tensor, mean: Tensor, std: Tensor, alpha: float) -> Tensor:
    """``α·AdaIN(F, S) + (1 − α)·F`` — the content/style trade-off of AdaIN (α = 1: full transfer)."""
    return alpha * adain(feat, mean, std) + (1.0 - alpha) * feat


def style_vectors(mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Rows ``[μ ‖ σ]``: the vectors FINCH clusters (cosine distance)."""
    return np.concatenate([np.asarray(mean, np.float32), np.asarray(std, np.float32)], axis=-1)


# --------------------------------------------------------------------------- clustering

FinchLevel = Literal["coarsest", "finest"]


def __getattr__(name: str) -> Any:
    """``FINCH`` is imported on first use: it imports scikit-learn (seconds), which only clustering methods need."""
    if name != "FINCH":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with warnings.catch_warnings():  # finch-clust warns at import that the optional pynndescent is absent
        warnings.simplefilter("ignore")
        from finch import FINCH
    globals()["FINCH"] = FINCH
    return FINCH


def finch_labels(data: np.ndarray, level: FinchLevel) -> np.ndarray:
    """Cluster labels of the rows of ``data`` by FINCH (``finch-clust``, cosine distance).

    ``coarsest`` is FINCH's last partition (fewest clusters; PARDON eq. 1, FPL), ``finest`` its
    first (PARDON eq. 3, as the authors' server code). ``ensure_early_exit=False`` as both
    authors' code; exact nearest neighbours always (no ANN). Fewer than two rows: one cluster.
    """
    data = np.asarray(data, dtype=np.float32)
    if len(data) < 2:
        return np.zeros(len(data), dtype=np.int64)
    finch = globals().get("FINCH") or __getattr__("FINCH")
    c, _, _ = finch(data, distance="cosine", ensure_early_exit=False, ann_threshold=max(20_000, len(data) + 1))
    return np.asarray(c[:, -1] if level == "coarsest" else c[:, 0], dtype=np.int64)


# --------------------------------------------------------------------------- codecs


class StyleCodec(ABC):
    """A style encoder ``E`` and decoder ``D``; ``g(x̃)`` is :meth:`features`."""

    name: ClassVar[str]

    @abstractmethod
    def encode(self, x: Tensor) -> Tensor:
        """``E(x)``: the ``[B, C, H, W]`` maps whose channel statistics are the style."""

    @abstractmethod
    def decode(self, t: Tensor, like: Tensor) -> Tensor:
        """``D(t)``: what the model consumes in place of ``like`` (an image, or a feature map)."""

    def features(self, model: FedModel, x: Tensor, x_tilde: Tensor) -> Tensor:
        """``g(x̃)``: the model's representation of the stylised batch (``x`` is the original)."""
        return model.features(x_tilde)

    def describe(self) -> str:
        return self.name

    @torch.no_grad()
    def moments(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample channel moments of ``E(x)`` (for eq. 2)."""
        return channel_moments(self.encode(x))

    @torch.no_grad()
    def transfer(self, x: Tensor, mean: Tensor, std: Tensor, alpha: float) -> Tensor:
        """``x̃ = D(α·AdaIN(E(x), S) + (1 − α)·E(x))`` (eq. 6 with the authors' blend), no gradient."""
        e = self.encode(x)
        return self.decode(blend(e, mean.to(e), std.to(e), alpha), x)


class PixelStyle(StyleCodec):
    """AdaIN on the image channels themselves."""

    name = "pixel"

    def encode(self, x: Tensor) -> Tensor:
        return x

    def decode(self, t: Tensor, like: Tensor) -> Tensor:
        return t


class _Stop(Exception):
    def __init__(self, output: Tensor) -> None:
        self.output = output


def _stop_hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
    raise _Stop(output)


def run_until(model: nn.Module, layer: str, x: Tensor) -> Tensor:
    """The output of module ``layer`` when ``model(x)`` runs (the rest is not computed)."""
    handle = model.get_submodule(layer).register_forward_hook(_stop_hook)
    try:
        model(x)
    except _Stop as stop:
        return stop.output
    finally:
        handle.remove()
    raise RuntimeError(f"module {layer!r} was not called by the model's forward pass")


def encoder_state(model: nn.Module, layer: str, x: Tensor) -> Message:
    """``enc/<key>`` arrays of every parameter and buffer used before ``layer`` returns on ``x``."""
    ran: set[str] = set()
    handles = [
        m.register_forward_pre_hook(lambda mod, inp, name=name: ran.add(name)) for name, m in model.named_modules()
    ]
    was_training = model.training
    try:
        with torch.no_grad():
            run_until(model.eval(), layer, x)  # eval: leave BatchNorm's running statistics alone
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return {
        ENCODER_PREFIX + k: v.detach().cpu().numpy().copy()
        for k, v in model.state_dict().items()
        if (k.rpartition(".")[0] in ran)
    }


def resolve_layer(model: nn.Module, params: StyleParams) -> str:
    """The module whose output is the feature-path style space: ``style_layer``, else the end of
    conv stage ``style_stage`` (:func:`feddg.models.stages.conv_stages`)."""
    if params.style_layer is not None:
        model.get_submodule(params.style_layer)  # raises AttributeError naming it if absent
        return params.style_layer
    from feddg.models.stages import conv_stages

    stages = conv_stages(model)
    if params.style_stage > len(stages):
        raise ValueError(f"style_stage={params.style_stage} but {type(model).__name__} has {len(stages)} conv stages")
    return stages[params.style_stage - 1]


class FeatureStyle(StyleCodec):
    """``E`` = a frozen copy of the model up to ``layer``; the stylised map replaces that layer's
    output in the trained model (no decoder)."""

    name = "feature"

    def __init__(self, model: nn.Module, layer: str, state: Message | None = None) -> None:
        """Copy ``model``; ``state`` (``enc/`` arrays of :func:`encoder_state`) overrides its encoder weights."""
        self.layer = layer
        self.encoder = copy.deepcopy(model).eval().requires_grad_(False)
        if state:
            own = self.encoder.state_dict()
            with torch.no_grad():
                for k, v in subset(state, ENCODER_PREFIX).items():
                    own[k].copy_(torch.from_numpy(np.asarray(v)))

    def describe(self) -> str:
        return f"feature (AdaIN on the output of '{self.layer}' of the frozen initial model)"

    def encode(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return run_until(self.encoder, self.layer, x)

    def decode(self, t: Tensor, like: Tensor) -> Tensor:
        return t

    def features(self, model: FedModel, x: Tensor, x_tilde: Tensor) -> Tensor:
        handle = model.get_submodule(self.layer).register_forward_hook(lambda mod, inp, out: x_tilde)
        try:
            return model.features(x)
        finally:
            handle.remove()


# --- AdaIN-VGG (Huang & Belongie, 2017): architecture of the published weights ---------------

_VGG_RELU4_1 = 31  # modules [0, 31) of the published vgg_normalised end at relu4_1


def adain_vgg_encoder() -> nn.Sequential:
    """The full normalised VGG-19 of the AdaIN release (its state_dict keys are ``0.weight`` ...)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 3, 1)]
    cfg: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512]
    channels = 3
    for item in cfg:
        if item == "M":
            layers.append(nn.MaxPool2d(2, 2, 0, ceil_mode=True))
            continue
        layers += [nn.ReflectionPad2d(1), nn.Conv2d(channels, int(item), 3), nn.ReLU()]
        channels = int(item)
    return nn.Sequential(*layers)


def adain_vgg_decoder() -> nn.Sequential:
    """The AdaIN decoder: relu4_1 (512 channels) back to RGB, mirrored VGG with nearest upsampling."""
    cfg: list[int | str] = [256, "U", 256, 256, 256, 128, "U", 128, 64, "U", 64]
    layers: list[nn.Module] = []
    channels = 512
    for item in cfg:
        if item == "U":
            layers.append(nn.Upsample(scale_factor=2, mode="nearest"))
            continue
        layers += [nn.ReflectionPad2d(1), nn.Conv2d(channels, int(item), 3), nn.ReLU()]
        channels = int(item)
    layers += [nn.ReflectionPad2d(1), nn.Conv2d(channels, 3, 3)]
    return nn.Sequential(*layers)


def _missing_weights_error(vgg: str | None, dec: str | None) -> FileNotFoundError:
    return FileNotFoundError(
        "style_path=adain-vgg needs the AdaIN authors' published weights as local files: "
        f"method.params.vgg_weights (vgg_normalised.pth, got {vgg!r}) and "
        f"method.params.decoder_weights (decoder.pth, got {dec!r}); nothing is downloaded at run time. "
        "Use method.params.style_path=feature or pixel for a weight-free style transfer."
    )


@functools.lru_cache(maxsize=2)
def load_adain_vgg(vgg_path: str, decoder_path: str) -> tuple[nn.Sequential, nn.Sequential]:
    """Encoder (up to relu4_1) and decoder from the published files, frozen, cached per path pair."""
    for p in (vgg_path, decoder_path):
        if not Path(p).is_file():
            raise _missing_weights_error(vgg_path, decoder_path)
    vgg, dec = adain_vgg_encoder(), adain_vgg_decoder()
    vgg.load_state_dict(torch.load(vgg_path, map_location="cpu", weights_only=True))
    dec.load_state_dict(torch.load(decoder_path, map_location="cpu", weights_only=True))
    encoder = nn.Sequential(*list(vgg.children())[:_VGG_RELU4_1])
    return encoder.eval().requires_grad_(False), dec.eval().requires_grad_(False)


class AdainVGGStyle(StyleCodec):
    """``E`` = normalised VGG-19 up to relu4_1 on ``[0, 1]`` RGB, ``D`` = the AdaIN decoder."""

    name = "adain-vgg"

    def __init__(self, vgg_path: str | None, decoder_path: str | None,
                 image_mean: tuple[float, ...], image_std: tuple[float, ...]) -> None:
        if not vgg_path or not decoder_path:
            raise _missing_weights_error(vgg_path, decoder_path)
        self.encoder, self.decoder = load_adain_vgg(str(vgg_path), str(decoder_path))
        self.mean = torch.tensor(image_mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(image_std, dtype=torch.float32).view(1, -1, 1, 1)

    def encode(self, x: Tensor) -> Tensor:
        rgb = x * self.std.to(x) + self.mean.to(x)
        if rgb.shape[1] == 1:
            rgb = rgb.expand(-1, 3, -1, -1)
        with torch.no_grad():
            return self.encoder.to(x.device)(rgb)

    def decode(self, t: Tensor, like: Tensor) -> Tensor:
        with torch.no_grad():
            rgb = self.decoder.to(t.device)(t)
        rgb = F.interpolate(rgb, size=like.shape[-2:], mode="bilinear", align_corners=False).clamp(0.0, 1.0)
        if like.shape[1] == 1:
            rgb = rgb.mean(dim=1, keepdim=True)
        return (rgb - self.mean.to(rgb)) / self.std.to(rgb)


def make_codec(params: StyleParams, model: nn.Module, state: Message | None = None) -> StyleCodec:
    """The codec ``params.style_path`` names; ``state`` carries the feature path's frozen encoder."""
    if params.style_path == "pixel":
        return PixelStyle()
    if params.style_path == "adain-vgg":
        return AdainVGGStyle(params.vgg_weights, params.decoder_weights, params.image_mean, params.image_std)
    return FeatureStyle(model, resolve_layer(model, params), state)


def setup_codec(params: StyleParams, model: nn.Module, example: Tensor) -> tuple[StyleCodec, Message]:
    """A client's codec at setup (``model`` holds the initial global weights) and the client-state
    arrays that rebuild the same codec in every later round (the feature path's frozen encoder)."""
    if params.style_path != "feature":
        return make_codec(params, model), {}
    layer = resolve_layer(model, params)
    state = encoder_state(model, layer, example)
    return FeatureStyle(model, layer), state


def client_moments(codec: StyleCodec, batches: Iterable[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Per-sample moments ``[N, C]`` of ``E(x)`` over an iterable of ``(x, y)`` batches."""
    means, seconds = [], []
    for x, _ in batches:
        m, s = codec.moments(x)
        means.append(m.cpu())
        seconds.append(s.cpu())
    return torch.cat(means), torch.cat(seconds)


def local_moments(
    params: StyleParams, model: nn.Module, msg: Message, ctx: ClientContext, method: str
) -> tuple[StyleCodec, Message, Tensor, Tensor]:
    """A client's setup step shared by PARDON and CCST: load the initial global weights if the
    setup request carries them, build the codec, log its path (once, from client 0) and return it
    with its client-state arrays and the per-sample moments of all local training data."""
    if subset(msg, WEIGHT_PREFIX):
        load_weights(model, msg)
    first, _ = next(ctx.batches(shuffle=False, train=False))
    codec, enc = setup_codec(params, model, images(first))
    if ctx.client_id == 0:
        logger.warning("%s: style path = %s", method, codec.describe())
    mean, second = client_moments(codec, ((images(x), y) for x, y in ctx.batches(shuffle=False, train=False)))
    return codec, enc, mean, second


def style_setup_request(params: StyleParams, weights: Message) -> Message:
    """The setup request of a style method: the initial weights on the feature path (its frozen
    encoder), else just the path's name."""
    return dict(weights) if params.style_path == "feature" else {"style/path": params.style_path}
