"""Which augmentation and normalisation a dataset's batches get: presets, overrides, validation.

A :class:`TransformSpec` is plain data; :class:`feddg.data.augment.BatchAugment` applies it to
batches. Overrides come from YAML (``data.transforms``) or a folder's ``feddg.json`` as either a
preset name or a mapping of the keys below (optionally with ``preset:`` to start from):

=============  ==========================================================================
``crop_scale``  random-resized-crop area fraction ``[lo, hi]`` in (0, 1]; ``null`` = no crop
``crop_ratio``  its aspect-ratio range ``[lo, hi]`` (default ``[0.75, 1.333]``)
``flip``        horizontal-flip probability
``jitter``      colour-jitter strength: one number, or ``[brightness, contrast, saturation]``
``grayscale``   probability of replacing an image by its luma
``pad_crop``    zero-pad by this many pixels and crop back at a random offset (digits-style)
``mean, std``   per-channel normalisation statistics of ``[0, 1]`` pixels
=============  ==========================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from feddg.data.transforms import IMAGENET_MEAN, IMAGENET_STD


@dataclass(frozen=True)
class TransformSpec:
    """Training augmentation (all off by default) and normalisation (``None``: the dataset's own)."""

    crop_scale: tuple[float, float] | None = None
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.0
    jitter: tuple[float, float, float] = (0.0, 0.0, 0.0)
    grayscale: float = 0.0
    pad_crop: int = 0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @property
    def augments(self) -> bool:
        """Whether training batches are randomly transformed at all."""
        return bool(self.crop_scale or self.flip or any(self.jitter) or self.grayscale or self.pad_crop)

    def describe(self) -> str:
        """One line for ``feddg datasets``."""
        parts = []
        if self.crop_scale:
            parts.append(f"crop {self.crop_scale[0]:g}-{self.crop_scale[1]:g}")
        if self.pad_crop:
            parts.append(f"pad-crop {self.pad_crop}px")
        if self.flip:
            parts.append(f"flip {self.flip:g}")
        if any(self.jitter):
            parts.append("jitter " + "/".join(f"{s:g}" for s in self.jitter))
        if self.grayscale:
            parts.append(f"grayscale {self.grayscale:g}")
        stats = f"mean {_fmt(self.mean)} std {_fmt(self.std)}" if self.mean and self.std else "dataset stats"
        return f"{', '.join(parts) or 'no augmentation'}; {stats}"


def _fmt(values: tuple[float, ...] | None) -> str:
    return "(" + ", ".join(f"{v:.3g}" for v in values or ()) + ")"


PRESETS: dict[str, TransformSpec] = {
    "none": TransformSpec(),
    "digits": TransformSpec(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
    "domainbed": TransformSpec(
        crop_scale=(0.7, 1.0), flip=0.5, jitter=(0.3, 0.3, 0.3), grayscale=0.1, mean=IMAGENET_MEAN, std=IMAGENET_STD
    ),
}
KEYS = ("preset", *(f.name for f in fields(TransformSpec)))


class _KeyError(ValueError):
    """A bad value of one key."""

    def __init__(self, key: str, msg: str) -> None:
        super().__init__(msg)
        self.key = key


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _KeyError(key, f"must be a number, got {value!r}")
    return float(value)


def _probability(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise _KeyError(key, f"must be a probability in [0, 1], got {value!r}")
    return float(value)


def _numbers(key: str, value: Any, count: int | None = None) -> tuple[float, ...]:
    if not isinstance(value, list | tuple) or not value or (count is not None and len(value) != count):
        size = f"{count} numbers" if count else "a list of numbers"
        raise _KeyError(key, f"must be {size}, got {value!r}")
    return tuple(_number(key, v) for v in value)


def _range(key: str, value: Any, upper: float) -> tuple[float, float]:
    lo, hi = _numbers(key, value, 2)
    if not 0 < lo <= hi <= upper:
        raise _KeyError(key, f"must be [lo, hi] with 0 < lo <= hi <= {upper:g}, got {value!r}")
    return lo, hi


def _field(key: str, value: Any) -> Any:
    """``value`` of key ``key`` checked and converted to the :class:`TransformSpec` field's type."""
    if key == "crop_scale":
        return None if value is None or value is False else _range(key, value, 1.0)
    if key == "crop_ratio":
        return _range(key, value, math.inf)
    if key in ("flip", "grayscale"):
        return _probability(key, value)
    if key == "jitter":
        strengths = (_number(key, value),) * 3 if isinstance(value, int | float) else _numbers(key, value, 3)
        if min(strengths) < 0:
            raise _KeyError(key, f"strengths must be >= 0, got {value!r}")
        return strengths
    if key == "pad_crop":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _KeyError(key, f"must be an integer >= 0 (pixels), got {value!r}")
        return value
    stats = _numbers(key, value)  # mean, std
    if key == "std" and min(stats) <= 0:
        raise _KeyError(key, f"must be > 0, got {value!r}")
    return stats


def _preset(name: Any) -> TransformSpec:
    if isinstance(name, str) and name in SLICE_AUGMENTS:
        raise ValueError(f"{name!r} is a segmentation slices' augmentation (synthetic-mri, prostate); an image "
                         f"dataset takes a preset: {', '.join(PRESETS)}")
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"unknown transforms preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


#: the training augmentations of the 2.5-D slice datasets (their ``data.transforms``; image and mask move together)
SLICE_AUGMENTS = {
    "hflip": "a left-right flip with probability 1/2 (feddg's default)",
    "rot90_flip": "HarmoFL's and FedFA's code's: a random 90° rotation, then a flip of the rows, the columns or both "
                  "with probability 0.75",
}


def parse_slice_augment(value: Any, dataset: str) -> str:
    """The slice augmentation ``value`` names (``None``: ``hflip``); one line for anything else."""
    if value is None:
        return "hflip"
    if isinstance(value, str) and value in SLICE_AUGMENTS:
        return value
    options = "; ".join(f"{k} ({v})" for k, v in SLICE_AUGMENTS.items())
    raise ValueError(f"{dataset} takes data.transforms {' or '.join(SLICE_AUGMENTS)}, got {value!r}: its slices are "
                     f"scaled per volume to 0..255 and normalised with (0.5, 0.5); {options}")


def _on(base: TransformSpec, preset: TransformSpec) -> TransformSpec:
    """``preset``'s augmentation, and its statistics where it has them (else ``base``'s)."""
    return replace(preset, mean=preset.mean or base.mean, std=preset.std or base.std)


def _parse(value: Any, base: TransformSpec) -> TransformSpec:
    if value is None:
        return base
    if isinstance(value, str):
        return _on(base, _preset(value))
    if not isinstance(value, dict):
        raise TypeError(f"must be a preset name ({', '.join(PRESETS)}) or a mapping of {', '.join(KEYS)}")
    unknown = [k for k in value if k not in KEYS]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; expected some of {', '.join(KEYS)}")
    spec = _on(base, _preset(value["preset"])) if "preset" in value else base
    spec = replace(spec, **{k: _field(k, v) for k, v in value.items() if k != "preset"})
    if spec.mean is not None and spec.std is not None and len(spec.mean) != len(spec.std):
        raise ValueError(f"mean and std need as many values (one per channel), got {spec.mean} and {spec.std}")
    return spec


def parse_transforms(value: Any, base: TransformSpec = PRESETS["none"], where: str = "transforms") -> TransformSpec:
    """``base`` with the overrides in ``value`` (``None``, a preset name, or a mapping; see the module doc).

    Raises:
        ValueError: one line naming the key, e.g. ``transforms.flip must be a probability in [0, 1], got 2``.
    """
    try:
        return _parse(value, base)
    except _KeyError as err:
        raise ValueError(f"{where}.{err.key} {err}") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def check_channels(spec: TransformSpec, channels: int, where: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The spec's ``(mean, std)``, checked to have one value per image channel."""
    if spec.mean is None or spec.std is None:
        raise ValueError(f"{where}: no normalisation statistics (give transforms mean and std)")
    if len(spec.mean) != channels:
        raise ValueError(f"{where}: transforms mean/std need {channels} values (one per channel), got {len(spec.mean)}")
    return spec.mean, spec.std
