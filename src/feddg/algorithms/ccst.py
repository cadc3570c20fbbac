"""CCST (Chen et al., "Federated Domain Generalization for Image Recognition via Cross-Client
Style Transfer", WACV 2023).

Once, before training (setup exchange with every client): each client uploads its style —
the *overall domain style* (eq. 2 style of all its ``E(x)``, one ``(μ, σ)``) or *single image
styles* (the per-image ``(μ, σ)`` of ``images_per_client`` random images). The server keeps
them as the style bank and sends every client the bank without its own entries.

Each round: for every batch the client draws ``K`` styles of ``K`` distinct other clients (one random image
style of each under ``single``, as the authors' code stylises with a random image style of every other domain), builds
``x̃_k = D(α·AdaIN(E(x), S_k) + (1 − α)·E(x))`` without gradient and minimises
``CE(h(g(x)), y) + CE(h(g([x̃_1; …; x̃_K])), [y; …; y])``. FedAvg aggregation by ``n_k``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

from feddg.aggregation.accounting import statistic_privacy
from feddg.aggregation.dp import StatisticDP, privatize
from feddg.algorithms.base import ClientContext, ClientState, Method, Reply, ServerState, weights_reply
from feddg.algorithms.components.local import train_local
from feddg.algorithms.components.style import (
    ENCODER_PREFIX,
    StyleParams,
    local_moments,
    make_codec,
    pooled_style,
    std_from_moments,
    style_setup_request,
)
from feddg.devices import Inputs, images
from feddg.messages import Layout, Message, Shapes, array_slot, load_weights, subset
from feddg.tasks import CLASS_LABELS, CONV_STAGES, IMAGES

if TYPE_CHECKING:
    from feddg.models.base import FedModel

STYLE_MEAN, STYLE_STD = "style/mean", "style/std"
BANK_MEAN, BANK_STD, BANK_OWNER = "bank/mean", "bank/std", "bank/owner"


class CCSTParams(StyleParams):
    style_type: Literal["overall", "single"] = Field(
        "overall", description="overall domain style or single image styles"
    )
    images_per_client: int = Field(1, ge=1, description="single: image styles each client shares")
    k: int = Field(3, ge=1, description="augmentation level K: styles per batch (3 for PACS)")
    alpha: float = Field(1.0, ge=0.0, le=1.0, description="AdaIN content/style blend (CCST: 1.0; PARDON's re-run: 0.5)")
    dp: StatisticDP | None = Field(None, description="clip + Gaussian noise on the uploaded styles (docs/privacy.md)")


def draw_styles(owners: np.ndarray, k: int, generator: torch.Generator | None = None) -> Tensor:
    """Bank rows of ``min(k, clients)`` distinct owners drawn uniformly, one row of each, drawn uniformly among its
    rows (with one row per client: ``k`` distinct rows)."""
    clients = list(dict.fromkeys(owners.tolist()))  # in bank order
    rows = []
    for c in torch.randperm(len(clients), generator=generator)[:k].tolist():
        mine = np.flatnonzero(owners == clients[c])
        pick = 0 if len(mine) == 1 else int(torch.randint(len(mine), (1,), generator=generator))
        rows.append(int(mine[pick]))
    return torch.tensor(rows, dtype=torch.long)


class CCST(Method):
    """Cross-client style transfer: a shared style bank, K stylised copies of every batch."""

    name = "ccst"
    Params = CCSTParams
    search_space = {"k": [1, 2, 3], "alpha": [0.5, 1.0]}
    params: CCSTParams
    requires = frozenset({IMAGES, CLASS_LABELS})  # image styles (AdaIN), labels repeated per stylised copy
    takes_soft_targets = False

    @classmethod
    def requirements(cls, params: Any) -> frozenset[str]:
        """Its feature-space style path also needs the model's conv stages."""
        assert isinstance(params, CCSTParams)
        return cls.requires | ({CONV_STAGES} if params.style_path == "feature" else set())

    # --- setup exchange ------------------------------------------------------------------
    def setup_request(self, state: ServerState) -> Message | None:
        return style_setup_request(self.params, state["weights"])

    def setup_layout(self, model: nn.Module, request: Message, weights: Shapes) -> Layout:
        return {STYLE_MEAN: array_slot((-1, -1), np.float32), STYLE_STD: array_slot((-1, -1), np.float32)}  # [J, C]

    def client_setup(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        """The client's style(s), rows ``[J, C]`` (J = 1 for the overall domain style)."""
        codec, enc, mean, second = local_moments(self.params, model, msg, ctx, self.name)
        if self.params.style_type == "overall":
            mu, sigma = (t[None] for t in pooled_style(mean, second))
        else:
            pick = torch.randperm(len(mean), generator=ctx.generator)[: self.params.images_per_client]
            mu, sigma = mean[pick], std_from_moments(mean[pick], second[pick])
        style: dict[str, np.ndarray] = {STYLE_MEAN: mu.numpy().astype(np.float32),
                                         STYLE_STD: sigma.numpy().astype(np.float32)}
        if (dp := self.params.dp) is not None:  # one release: all rows of μ and σ clipped as one vector; σ ≥ 0 after
            style = privatize(style, dp.clip, dp.sigma(), ctx.noise)
            style[STYLE_STD] = np.maximum(style[STYLE_STD], 0.0)
        reply: Message = {**style}
        return reply, {**client_state, **enc}

    def privacy(self, rounds_done: int) -> dict[str, Any] | None:
        """The styles are released once, in the setup exchange."""
        return statistic_privacy(self.params.dp, 1) if self.params.dp is not None else None

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        """The style bank: every client's rows, tagged with their owner."""
        means = [np.asarray(r.message[STYLE_MEAN]) for r in replies]
        stds = [np.asarray(r.message[STYLE_STD]) for r in replies]
        owners = np.concatenate([np.full(len(m), r.client_id) for m, r in zip(means, replies, strict=True)])
        return {**state, "bank": (np.concatenate(means), np.concatenate(stds), owners)}

    # --- rounds --------------------------------------------------------------------------
    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        """The global weights and the style bank without the client's own styles, each row with its owner."""
        mean, std, owners = state["bank"]
        others = owners != client_id
        return {**state["weights"], BANK_MEAN: mean[others], BANK_STD: std[others], BANK_OWNER: owners[others]}

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        if self.params.style_path == "feature" and not subset(client_state, ENCODER_PREFIX):
            raise KeyError(f"client {ctx.client_id} has no frozen style encoder: did the setup exchange run?")
        codec = make_codec(self.params, model, client_state)
        bank_mean = torch.as_tensor(np.asarray(msg[BANK_MEAN]))
        bank_std = torch.as_tensor(np.asarray(msg[BANK_STD]))
        bank_owner = np.asarray(msg[BANK_OWNER])
        k, alpha = self.params.k, self.params.alpha

        def loss_fn(m: nn.Module, inputs: Inputs, y: Tensor) -> Tensor:
            net = cast("FedModel", m)  # the network is a zoo model: classifier(features(x))
            x = images(inputs)
            rows = draw_styles(bank_owner, k, ctx.generator)
            if len(rows) == 0:  # a federation of one client has no other styles
                return ctx.task.loss(net(x), y)
            x_tilde = torch.cat([codec.transfer(x, bank_mean[r], bank_std[r], alpha) for r in rows.tolist()])
            x_rep = x.repeat(len(rows), *([1] * (x.dim() - 1)))
            f_tilde = codec.features(net, x_rep, x_tilde)
            return ctx.task.loss(net(x), y) + ctx.task.loss(net.classifier(f_tilde), y.repeat(len(rows)))

        loss = train_local(model, ctx, lr=float(msg["lr"]), loss_fn=loss_fn)
        return weights_reply(model, ctx.num_examples, loss), client_state

