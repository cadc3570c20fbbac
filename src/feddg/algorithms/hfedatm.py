"""HFedATM (hierarchical federated alignment and merging): the client's Gram
recorder (eq. 8, optionally clipped and noised for DP, §3.4) and the station's Gram statistics
(eqs. 9–10).

HFedATM is not a client method: any client method (FedAvg, FedProx, FedSR, FedIIR, FedFA, ...) trains
inside the stations of a station topology (``feddg.federation.topology``), and HFedATM is the station
→ server merge (FOT alignment, eqs. 2–6, then RegMean, eqs. 11–12; ``feddg.aggregation.merges``).
This file holds what that merge needs from the clients and the stations.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from feddg.aggregation.dp import clip_samples, privatize_gram
from feddg.aggregation.merges import GRAM_FLAG, GRAM_PREFIX, HFedATMParams
from feddg.aggregation.regmean import psd_project, shrink, station_gram
from feddg.algorithms.base import ClientContext, ClientState, Method
from feddg.devices import Inputs
from feddg.messages import Message

# ------------------------------------------------------------------------------- client: eq. 8


#: a 1×1 conv's Gram is summed over chunks of images of at most this many pixels (bounds the float64 copy)
PIXEL_CHUNK = 1 << 16


def is_pointwise(m: nn.Module) -> bool:
    """A 1×1 ``nn.Conv2d`` with stride 1, no padding and no groups: an ``nn.Linear`` applied to every pixel."""
    return (isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) and m.stride == (1, 1) and m.padding == (0, 0)
            and m.groups == 1)


def gram_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers whose input Grams HFedATM records: every ``nn.Linear``, and every pointwise (:func:`is_pointwise`)
    conv of a model's ``classifier`` head (a segmentation network's 1×1 output conv). Pointwise convs inside a trunk
    (EfficientNet's, ResNet-50's, hFedF-CNN's) are left to the weighted mean, as before."""
    heads = {id(m) for owner in model.modules() if isinstance(head := getattr(owner, "classifier", None), nn.Module)
             for m in head.modules()}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) or (id(m) in heads and is_pointwise(m))}


class GramRecorder:
    """Eq. 8 on the client: ``G = X^T X`` of the input of every linear layer (:func:`gram_layers`), summed over one
    pass over the client's data (the last pass that ran in training mode), each batch counted once. A 1×1 conv is a
    linear layer over pixels: its input ``[B, C, H, W]`` gives ``B·H·W`` rows of ``C`` features.

    Forward pre-hooks see each layer's input; a pass starts with every ``ctx.batches()`` call of a context from
    :meth:`track`. Token batches: a linear layer's ``[B, L, F]`` input gives one row per *non-padding* token (the
    batch's ``attention_mask`` is 1; RegMean's rule for transformers, Jin et al. 2023), so padding never enters
    ``G``; inputs of other shapes (a head's ``[B, H]``) are used whole. With ``clip`` (DP), each sample's rows
    together (its one row, its pixels, its tokens) are scaled to Frobenius norm at most ``clip``, so one sample
    changes ``G`` by at most ``clip²`` (:func:`~feddg.aggregation.dp.clip_samples`).
    """

    def __init__(self, model: nn.Module, clip: float | None = None) -> None:
        self.layers = gram_layers(model)
        self.clip = clip
        self.current: dict[str, Tensor] = {}
        self.last: dict[str, Tensor] = {}
        self.seen: set[str] = set()
        self.eval_mode = False
        self.handles: list[Any] = []
        self.mask: Tensor | None = None  # the current token batch's attention mask [B, L]

    def __enter__(self) -> GramRecorder:
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in self.layers.items()]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _gram(self, x: Tensor, keep: Tensor | None = None) -> Tensor:
        """``Σ_i X_iᵀ X_i`` of ``x`` ``[B, rows, F]`` (each sample's rows clipped together under DP), over the rows
        where ``keep`` ``[B, rows]`` is true (the non-padding tokens), else all."""
        x = x.double()
        if self.clip is not None:
            x = clip_samples(x * keep.unsqueeze(-1) if keep is not None else x, self.clip)  # padding: no norm
        rows = x[keep] if keep is not None else x.reshape(-1, x.shape[-1])
        return rows.T @ rows

    def _hook(self, name: str) -> Any:
        def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            if name in self.seen or not (module.training or self.eval_mode):
                return
            self.seen.add(name)  # a second forward of the same batch is not counted again
            x = args[0].detach()
            if isinstance(module, nn.Linear):
                tokens = self.mask is not None and x.shape[:-1] == self.mask.shape
                keep = self.mask.to(x.device, torch.bool) if tokens and self.mask is not None else None
                g = self._gram(x.reshape(len(x), -1, module.in_features), keep)
            else:  # a 1×1 conv: each image's pixels as its rows, a chunk of images at a time
                assert isinstance(module, nn.Conv2d)
                per = max(1, PIXEL_CHUNK // max(1, x.shape[2] * x.shape[3]))
                chunks = [self._gram(c.movedim(1, -1).reshape(len(c), -1, module.in_channels)) for c in x.split(per)]
                g = torch.stack(chunks).sum(0) if len(chunks) > 1 else chunks[0]
            self.current[name] = self.current[name] + g if name in self.current else g

        return record

    def new_pass(self) -> None:
        if self.current:
            self.last, self.current = self.current, {}

    def new_batch(self, x: Inputs | None = None) -> None:
        self.seen = set()
        self.mask = x.get("attention_mask") if isinstance(x, Mapping) else None

    def track(self, ctx: ClientContext) -> ClientContext:
        """``ctx`` whose ``batches()`` marks passes and batches for this recorder."""
        return _TrackedContext(**{f.name: getattr(ctx, f.name) for f in fields(ctx)}, recorder=self)

    def extra_pass(self, model: nn.Module, ctx: ClientContext) -> None:
        """Grams from one no-grad pass in eval mode after training (``gram_pass: after``)."""
        model.eval()
        self.eval_mode = True
        with self, torch.no_grad():
            for x, _ in self.track(ctx).batches(shuffle=False, train=False):
                model(x)
        self.eval_mode = False

    def grams(self) -> dict[str, Tensor]:
        self.new_pass()
        return self.last


@dataclass
class _TrackedContext(ClientContext):
    recorder: GramRecorder | None = None

    def batches(self, *, shuffle: bool = True, train: bool = True) -> Iterator[tuple[Inputs, Tensor]]:
        assert self.recorder is not None
        self.recorder.new_pass()
        for batch in super().batches(shuffle=shuffle, train=train):
            self.recorder.new_batch(batch[0])
            yield batch


def update_with_grams(
    method: Method, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext, params: HFedATMParams
) -> tuple[Message, ClientState]:
    """The client method's update, plus ``gram/<layer>`` (eq. 8) when the station asks for Grams
    (``collect_gram`` in ``msg``; the last station round), clipped and noised under DP."""
    if not msg.get(GRAM_FLAG):
        return method.client_update(model, msg, client_state, ctx)
    msg = {k: v for k, v in msg.items() if k != GRAM_FLAG}
    sigma = params.dp_sigma()
    recorder = GramRecorder(model, params.dp_clip if sigma is not None else None)
    if params.gram_pass == "last_epoch":
        with recorder:
            reply, client_state = method.client_update(model, msg, client_state, recorder.track(ctx))
    else:
        reply, client_state = method.client_update(model, msg, client_state, ctx)
        recorder.extra_pass(model, ctx)
    grams = {k: g.cpu() for k, g in recorder.grams().items()}  # the noise and the reply live on the CPU
    if sigma is not None:
        grams = {k: privatize_gram(g, sigma, ctx.noise) for k, g in grams.items()}
    return {**reply, **{GRAM_PREFIX + k: g.float().numpy() for k, g in grams.items()}}, client_state


# ------------------------------------------------------------------------------- station: eqs. 9–10


def station_grams(client_grams: Sequence[dict[str, np.ndarray]], params: HFedATMParams) -> dict[str, np.ndarray]:
    """Eq. 9 (mean over the station's active clients) of every layer all of them sent, PSD projection
    under DP (noise can make a Gram indefinite), then eq. 10 (shrinkage with α); none where no client sent one."""
    keys = set.intersection(*(set(g) for g in client_grams)) if client_grams else set()
    out = {}
    for key in sorted(keys):
        g = station_gram([g[key] for g in client_grams])
        if params.dp_epsilon is not None:
            g = psd_project(g)
        out[key] = shrink(g, params.alpha)
    return out


