"""PARDON (Nguyen et al., "PARDON: Privacy-Aware and Robust Federated Domain Generalization", §III-B).

Once, before training, with *every* client (the framework's setup exchange):

1. local style calculation — each client encodes its data with ``E``, clusters its samples with
   FINCH (eq. 1: cosine, coarsest partition), takes each cluster's style (eq. 2) and uploads the
   mean of its cluster styles: one ``(μ, σ)`` per client, nothing else;
2. interpolation style extraction — the server clusters the client styles with FINCH (eq. 3,
   finest partition), averages within clusters (eq. 4) and takes the element-wise median of the
   cluster styles (eq. 5) as the global interpolation style ``S_g``, broadcast in every round.

Each round (sampled clients, FedAvg by ``n_k``): ``x̃ = D(α·AdaIN(E(x), S_g) + (1 − α)·E(x))``
without gradient, ``f = g(x)``, ``f̃ = g(x̃)`` and (eq. 9)::

    L = CE(h(f), y) + λ_t · Triplet(f_i, f̃_i, f̃_j | y_j ≠ y_i; margin m) + λ_r · mean(f² + f̃²)

(eq. 7 the triplet loss on L2-normalised features, eq. 8 the representation regulariser).
Table V ablations: ``local_style=average`` (v1), ``global_style=average`` (v2),
``objective=stylised-ce`` (v3), ``objective=augment-triplet`` (v4); defaults are v5.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from feddg.aggregation.accounting import statistic_privacy
from feddg.aggregation.dp import StatisticDP, privatize
from feddg.algorithms.base import (
    Accumulator,
    ClientContext,
    ClientState,
    Method,
    Metrics,
    Reply,
    ServerState,
    weights_reply,
)
from feddg.algorithms.components.local import train_local
from feddg.algorithms.components.style import (
    ENCODER_PREFIX,
    FinchLevel,
    StyleCodec,
    StyleParams,
    finch_labels,
    local_moments,
    make_codec,
    pooled_style,
    std_from_moments,
    style_setup_request,
    style_vectors,
)
from feddg.data.transforms import BatchRandomCrop
from feddg.devices import Inputs, images
from feddg.messages import Layout, Message, Shapes, array_slot, load_weights, subset
from feddg.tasks import CLASS_LABELS, CONV_STAGES, IMAGES

if TYPE_CHECKING:
    from feddg.models.base import FedModel

STYLE_MEAN, STYLE_STD = "style/mean", "style/std"
#: ``(model, x) -> g(x̃)``
Stylise = Callable[["FedModel", Tensor], Tensor]


class PardonParams(StyleParams):
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="content/style blend of the transfer (authors: 0.5)")
    triplet_weight: float = Field(0.75, ge=0.0, description="λ_t of eq. 9")
    margin: float = Field(0.3, ge=0.0, description="triplet margin m of eq. 7")
    reg_weight: float = Field(0.2, ge=0.0, description="λ_r of eq. 9 (0.2 PACS, 0.1 Office-Home)")
    local_style: Literal["finch", "average"] = Field("finch", description="eq. 1-2 clusters, or v1: one pooled style")
    cluster_on: Literal["style", "features"] = Field("style", description="FINCH on per-sample [μ‖σ] or flat E(x)")
    client_average: Literal["styles", "moments"] = Field(
        "styles", description="client style = mean of cluster (μ, σ), or of cluster moments (authors' code)"
    )
    global_style: Literal["finch-median", "average"] = Field(
        "finch-median", description="eq. 3-5, or v2: plain mean of client styles"
    )
    global_partition: FinchLevel = Field("finest", description="FINCH partition of eq. 3 (authors' code: finest)")
    objective: Literal["triplet", "stylised-ce", "augment-triplet"] = Field(
        "triplet", description="v5 triplet on stylised data | v3 CE on stylised data | v4 triplet on augmentations"
    )
    dp: StatisticDP | None = Field(None, description="clip + Gaussian noise on the uploaded style (docs/privacy.md)")

    @model_validator(mode="after")
    def _dp_needs_a_style(self) -> PardonParams:
        if self.dp is not None and self.objective == "augment-triplet":
            raise ValueError("dp: objective augment-triplet uploads no style to privatise")
        return self


# --------------------------------------------------------------------------- style math


def cluster_styles(mean: Tensor, second: Tensor, labels: np.ndarray) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. 2 per cluster: ``(μ_c, σ_c, E_c[F²])`` rows ``[K, C]`` for the clusters of ``labels``."""
    out = [pooled_style(mean[idx], second[idx]) + (second[idx].mean(0),) for idx in _groups(labels)]
    mu, sigma, sq = zip(*out, strict=True)
    return torch.stack(mu), torch.stack(sigma), torch.stack(sq)


def _groups(labels: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(np.flatnonzero(labels == c)) for c in np.unique(labels)]


def local_labels(params: PardonParams, mean: Tensor, second: Tensor, features: Callable[[], Tensor]) -> np.ndarray:
    """Eq. 1: FINCH's clusters of a client's samples, on their styles ``[μ ‖ σ]`` or on their flat encoder maps
    ``features()`` (``params.cluster_on``); v1 (``params.local_style: average``): every sample in one cluster."""
    if params.local_style == "average":
        return np.zeros(len(mean), dtype=np.int64)
    if params.cluster_on == "style":
        return finch_labels(style_vectors(mean.numpy(), std_from_moments(mean, second).numpy()), "coarsest")
    return finch_labels(features().numpy(), "coarsest")


def client_style(
    mean: Tensor, second: Tensor, labels: np.ndarray, average: Literal["styles", "moments"] = "styles"
) -> tuple[Tensor, Tensor]:
    """A client's style: the mean over its clusters' styles (§III-B, "local style calculation").

    ``styles``: mean of the cluster ``(μ_c, σ_c)`` (the paper). ``moments``: mean of the cluster
    means and second moments, then ``σ = sqrt(E[F²] − μ² + ε)`` (the authors' code).
    """
    mu, sigma, sq = cluster_styles(mean, second, labels)
    if average == "styles":
        return mu.mean(0), sigma.mean(0)
    m = mu.mean(0)
    return m, std_from_moments(m, sq.mean(0))


def interpolation_style(
    means: np.ndarray,
    stds: np.ndarray,
    mode: Literal["finch-median", "average"] = "finch-median",
    level: FinchLevel = "finest",
) -> tuple[np.ndarray, np.ndarray, int]:
    """The global interpolation style ``S_g`` from client styles ``[K, C]``; also the cluster count.

    ``finch-median``: FINCH on ``[μ ‖ σ]`` (eq. 3, partition ``level``), cluster mean (eq. 4),
    element-wise median over the cluster styles (eq. 5). ``average``: mean of client styles (v2).
    """
    means, stds = np.asarray(means, np.float64), np.asarray(stds, np.float64)
    if mode == "average":
        return means.mean(0), stds.mean(0), 1
    labels = finch_labels(style_vectors(means, stds), level)
    clusters = np.unique(labels)
    cm = np.stack([means[labels == c].mean(0) for c in clusters])
    cs = np.stack([stds[labels == c].mean(0) for c in clusters])
    return np.median(cm, axis=0), np.median(cs, axis=0), len(clusters)


# --------------------------------------------------------------------------- losses


def sample_negatives(labels: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """For every anchor ``i`` with a sample of another class in the batch, one uniformly drawn
    index ``j`` with ``y_j ≠ y_i``; returns ``(anchor indices, negative indices)``."""
    other = labels[:, None] != labels[None, :]
    anchors = torch.nonzero(other.any(dim=1)).flatten()
    if len(anchors) == 0:
        return anchors, anchors
    # drawn on the CPU, where the client's generator lives (the batch may be on a GPU)
    neg = torch.multinomial(other[anchors].float().cpu(), 1, generator=generator).flatten()
    return anchors, neg.to(labels.device)


def triplet_loss(
    f: Tensor, f_pos: Tensor, labels: Tensor, margin: float, generator: torch.Generator | None = None
) -> Tensor:
    """Eq. 7: ``mean_i max(‖a_i − p_i‖ − ‖a_i − n_i‖ + m, 0)`` on L2-normalised features, with
    anchor ``a_i = f_i``, positive ``p_i = f̃_i`` and negative ``n_i = f̃_j``, ``y_j ≠ y_i``.
    Anchors without a different-class sample in the batch are skipped (zero if none has one)."""
    anchors, neg = sample_negatives(labels, generator)
    if len(anchors) == 0:
        return f.sum() * 0.0
    a, p, n = (F.normalize(t, p=2, dim=1) for t in (f[anchors], f_pos[anchors], f_pos[neg]))
    return F.triplet_margin_loss(a, p, n, margin=margin, p=2, eps=1e-7)


def representation_reg(f: Tensor, f_tilde: Tensor) -> Tensor:
    """Eq. 8 as the authors' code: ``mean(f² + f̃²)`` over batch and dimensions."""
    return (f.pow(2) + f_tilde.pow(2)).mean()


def augment_view(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """v4's positive view: a random shift (zero-padded crop, pad = H/8) and a per-sample contrast
    ``a ∈ [0.7, 1.3]`` and brightness ``b ∈ [−0.3, 0.3]`` change in the normalised space."""
    b = x.shape[0]
    shifted = BatchRandomCrop(max(1, x.shape[-1] // 8))(x, generator)
    scale = 0.7 + 0.6 * torch.rand(b, 1, 1, 1, generator=generator)
    shift = -0.3 + 0.6 * torch.rand(b, 1, 1, 1, generator=generator)
    return shifted * scale.to(x) + shift.to(x)


# --------------------------------------------------------------------------- the method


class Pardon(Method):
    """PARDON: FINCH-clustered client styles, a median interpolation style, triplet + CE + L2."""

    name = "pardon"
    Params = PardonParams
    # the PARDON paper gives no grid: a neighbourhood of the defaults
    search_space = {"triplet_weight": [0.25, 0.5, 0.75, 1.0], "reg_weight": [0.05, 0.1, 0.2], "alpha": [0.25, 0.5, 1.0]}
    params: PardonParams
    requires = frozenset({IMAGES, CLASS_LABELS})  # image styles (AdaIN) and class triplets
    takes_soft_targets = False

    @classmethod
    def requirements(cls, params: Any) -> frozenset[str]:
        """Its feature-space style path also needs the model's conv stages."""
        assert isinstance(params, PardonParams)
        return cls.requires | ({CONV_STAGES} if params.style_path == "feature" else set())

    @property
    def uses_style(self) -> bool:
        return self.params.objective != "augment-triplet"

    # --- setup exchange ------------------------------------------------------------------
    def setup_request(self, state: ServerState) -> Message | None:
        """v1-v3, v5: every client computes its style; the feature path needs the initial weights."""
        if not self.uses_style:
            return None
        state["setup_started"] = time.perf_counter()
        return style_setup_request(self.params, state["weights"])

    def setup_layout(self, model: nn.Module, request: Message, weights: Shapes) -> Layout:
        return {STYLE_MEAN: array_slot((-1,), np.float32), STYLE_STD: array_slot((-1,), np.float32)}  # one (μ, σ)

    def client_setup(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        """Local style calculation: the reply is one ``(μ, σ)`` pair and nothing else."""
        codec, enc, mean, second = local_moments(self.params, model, msg, ctx, self.name)
        labels = self._local_labels(codec, ctx, mean, second)
        mu, sigma = client_style(mean, second, labels, self.params.client_average)
        style: dict[str, np.ndarray] = {STYLE_MEAN: mu.numpy().astype(np.float32),
                                         STYLE_STD: sigma.numpy().astype(np.float32)}
        if (dp := self.params.dp) is not None:  # one release: [μ ‖ σ] clipped as one vector, noised; σ ≥ 0 after
            style = privatize(style, dp.clip, dp.sigma(), ctx.noise)
            style[STYLE_STD] = np.maximum(style[STYLE_STD], 0.0)
        reply: Message = {**style}
        return reply, {**client_state, **enc}

    def privacy(self, rounds_done: int) -> dict[str, Any] | None:
        """The style is released once, in the setup exchange."""
        return statistic_privacy(self.params.dp, 1) if self.params.dp is not None and self.uses_style else None

    def _local_labels(self, codec: StyleCodec, ctx: ClientContext, mean: Tensor, second: Tensor) -> np.ndarray:
        return local_labels(self.params, mean, second, lambda: torch.cat(
            [codec.encode(images(x)).flatten(1).cpu() for x, _ in ctx.batches(shuffle=False, train=False)]))

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        """Interpolation style extraction (eqs. 3-5) from every client's style."""
        means = np.stack([np.asarray(r.message[STYLE_MEAN]) for r in replies])
        stds = np.stack([np.asarray(r.message[STYLE_STD]) for r in replies])
        mean, std, clusters = interpolation_style(means, stds, self.params.global_style, self.params.global_partition)
        started = state.pop("setup_started", None)
        return {
            **state,
            "style": (mean.astype(np.float32), std.astype(np.float32)),
            "style_clusters": clusters,
            "time_style_setup_s": time.perf_counter() - started if started is not None else float("nan"),
        }

    # --- rounds --------------------------------------------------------------------------
    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        msg = dict(state["weights"])
        if self.uses_style:
            msg[STYLE_MEAN], msg[STYLE_STD] = state["style"]
        return msg

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        """FedAvg; the metrics repeat the one-time style setup (cost, clusters, style vector length)."""
        state, _ = super().finish(state, acc)
        if "style" not in state:
            return state, {}
        return state, {
            "time_style_setup_s": float(state["time_style_setup_s"]),
            "style_clusters": float(state["style_clusters"]),
            "style_dim": float(len(state["style"][0])),
        }

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        p = self.params
        stylise = self._stylise(model, msg, client_state, ctx)

        def loss_fn(m: nn.Module, inputs: Inputs, y: Tensor) -> Tensor:
            net = cast("FedModel", m)  # the network is a zoo model: classifier(features(x))
            x = images(inputs)
            f = net.features(x)
            loss = ctx.task.loss(net.classifier(f), y)
            f_tilde = stylise(net, x)
            if p.objective == "stylised-ce":
                loss = loss + ctx.task.loss(net.classifier(f_tilde), y)
            elif p.triplet_weight > 0:
                loss = loss + p.triplet_weight * triplet_loss(f, f_tilde, y, p.margin, ctx.generator)
            return loss + p.reg_weight * representation_reg(f, f_tilde)

        loss = train_local(model, ctx, lr=float(msg["lr"]), loss_fn=loss_fn)
        return weights_reply(model, ctx.num_examples, loss), client_state

    def _stylise(self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext) -> Stylise:
        """``(m, x) -> f̃``: features of the stylised (or, for v4, augmented) batch."""
        if not self.uses_style:
            return lambda m, x: m.features(augment_view(x, ctx.generator))
        if self.params.style_path == "feature" and not subset(client_state, ENCODER_PREFIX):
            raise KeyError(f"client {ctx.client_id} has no frozen style encoder: did the setup exchange run?")
        codec = make_codec(self.params, model, client_state)
        mean = torch.as_tensor(np.asarray(msg[STYLE_MEAN]))
        std = torch.as_tensor(np.asarray(msg[STYLE_STD]))
        alpha = self.params.alpha
        return lambda m, x: codec.features(m, x, codec.transfer(x, mean, std, alpha))
