"""FPL (Huang et al., "Rethinking Federated Learning with Domain Shift: A Prototype View", CVPR 2023).

Each round the sampled clients upload, with their weights, one prototype per class they hold:
the mean representation ``g(x)`` of that class over their last local epoch. For every class the
server clusters the uploaded prototypes with FINCH (cosine, coarsest partition) and keeps the
cluster means — the *cluster prototypes* — and their mean, the *unbiased prototype*. Clients of
the next round add to CE, for every sample ``z`` of class ``y`` with prototypes:

* cluster prototypes contrastive learning (CPCL):
  ``−log( Σ_{c ∈ P_y} exp(cos(z, c)/τ) / Σ_{c ∈ P} exp(cos(z, c)/τ) )``, ``P_y`` the class-``y``
  cluster prototypes, ``P`` all of them;
* unbiased prototypes consistent regularisation (UPCR): ``‖z − u_y‖²`` (``mse``: averaged over
  dimensions, as the authors' code; ``sum``: the squared norm of the paper).

FedAvg aggregation of the weights by ``n_k``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from feddg.aggregation.accounting import statistic_privacy
from feddg.aggregation.dp import StatisticDP, privatize
from feddg.algorithms.base import (
    Accumulator,
    ClientContext,
    ClientState,
    Method,
    Metrics,
    Params,
    Reply,
    ServerState,
    weights_reply,
)
from feddg.algorithms.components.local import grad_scaler, local_batches, make_optimizer, scaled_step
from feddg.algorithms.components.style import finch_labels
from feddg.messages import Layout, Message, Shapes, array_slot, load_weights
from feddg.models.base import head_linear
from feddg.tasks import CLASS_LABELS

if TYPE_CHECKING:
    from feddg.models.base import FedModel

PROTO_MEAN, PROTO_PRESENT = "proto/mean", "proto/present"
CLUSTER, CLUSTER_CLASS, UNBIASED, HAS_UNBIASED = "proto/cluster", "proto/cluster_class", "proto/unbiased", "proto/has"


class FPLParams(Params):
    temperature: float = Field(0.02, gt=0, description="τ of CPCL (authors' code: 0.02)")
    cpcl_weight: float = Field(1.0, ge=0.0, description="weight of the cluster-prototype contrastive term")
    upcr_weight: float = Field(1.0, ge=0.0, description="weight of the unbiased-prototype consistency term")
    upcr_reduction: Literal["mse", "sum"] = Field("mse", description="UPCR: mean over dimensions (code) or sum (paper)")
    dp: StatisticDP | None = Field(None, description="clip + Gaussian noise on the uploaded prototypes (docs/privacy)")


def cluster_prototypes(
    protos: np.ndarray, present: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """From client prototypes ``[N, K, D]`` and presence ``[N, K]``: cluster prototypes ``[M, D]``,
    their classes ``[M]``, unbiased prototypes ``[K, D]`` and which classes have them ``[K]``."""
    n, num_classes, dim = protos.shape
    clusters, classes = [], []
    unbiased = np.zeros((num_classes, dim), dtype=np.float32)
    has = np.zeros(num_classes, dtype=np.int64)
    for k in range(num_classes):
        rows = protos[present[:, k].astype(bool), k]
        if len(rows) == 0:
            continue
        labels = finch_labels(rows, "coarsest")
        means = np.stack([rows[labels == c].mean(0) for c in np.unique(labels)])
        clusters.append(means)
        classes += [k] * len(means)
        unbiased[k], has[k] = means.mean(0), 1
    if not clusters:
        return np.zeros((0, dim), np.float32), np.zeros(0, np.int64), unbiased, has
    return np.concatenate(clusters).astype(np.float32), np.asarray(classes, np.int64), unbiased, has


def cpcl_loss(z: Tensor, y: Tensor, clusters: Tensor, cluster_class: Tensor, temperature: float) -> Tensor:
    """Per-sample CPCL ``[B]``: ``logsumexp_P(s) − logsumexp_{P_y}(s)``, ``s = cos(z, c)/τ``."""
    sims = F.cosine_similarity(z[:, None, :], clusters[None, :, :], dim=2) / temperature
    positive = cluster_class[None, :] == y[:, None]
    return torch.logsumexp(sims, dim=1) - torch.logsumexp(sims.masked_fill(~positive, float("-inf")), dim=1)


def upcr_loss(z: Tensor, target: Tensor, reduction: Literal["mse", "sum"]) -> Tensor:
    """Per-sample UPCR ``[B]``: squared distance to the class's unbiased prototype."""
    sq = (z - target).pow(2)
    return sq.mean(dim=1) if reduction == "mse" else sq.sum(dim=1)


class FPL(Method):
    """Federated prototype learning: FINCH cluster prototypes + unbiased prototypes."""

    name = "fpl"
    Params = FPLParams
    search_space = {"temperature": [0.02, 0.07, 0.2], "upcr_weight": [0.1, 1.0, 10.0]}
    params: FPLParams
    requires = frozenset({CLASS_LABELS})  # prototypes per class
    takes_soft_targets = False

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        msg = dict(state["weights"])
        if "protos" in state:
            msg[CLUSTER], msg[CLUSTER_CLASS], msg[UNBIASED], msg[HAS_UNBIASED] = state["protos"]
        return msg

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """The client's class prototypes ``[K, D]`` and which classes it saw ``[K]``."""
        classes, dim = _proto_shape(model)
        return {PROTO_MEAN: array_slot((classes, dim), np.float32), PROTO_PRESENT: array_slot((classes,), np.int8)}

    def keep(self, reply: Reply) -> Message:
        return {k: reply.message[k] for k in (PROTO_MEAN, PROTO_PRESENT)}

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        """FedAvg of the weights; cluster and unbiased prototypes of this round's uploads."""
        state, _ = super().finish(state, acc)
        protos = np.stack([np.asarray(r.message[PROTO_MEAN]) for r in acc.kept])
        present = np.stack([np.asarray(r.message[PROTO_PRESENT]) for r in acc.kept])
        new = {**state, "protos": cluster_prototypes(protos, present)}
        return new, {"proto_clusters": float(len(new["protos"][0]))}

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        protos = {k: torch.as_tensor(np.asarray(msg[k])) for k in (CLUSTER, CLUSTER_CLASS, UNBIASED, HAS_UNBIASED)
                  if k in msg}
        model.train()  # train_local's loop + last-epoch prototypes (authors' code; stylised under mixstyle)
        opt = make_optimizer(model.parameters(), ctx.optim, float(msg["lr"]))
        scaler = grad_scaler(ctx)
        total, steps = 0.0, 0
        sums: Tensor | None = None
        counts: Tensor | None = None
        net = cast("FedModel", model)  # the network is a zoo model: classifier(features(x))
        for epoch, x, y in local_batches(model, ctx):
            opt.zero_grad(set_to_none=True)
            with ctx.autocast():
                z = net.features(x)  # type: ignore[arg-type]  # token inputs (a dict) go to a plugin model as they are
                logits = net.classifier(z)
                loss = ctx.task.loss(logits, y) + self._proto_terms(z, y, protos)
            scaled_step(loss, opt, scaler, clip=ctx.optim.grad_clip)
            total += float(loss.detach())
            steps += 1
            if epoch == ctx.local_epochs - 1:
                if sums is None or counts is None:  # both None until the last epoch's first batch
                    sums = torch.zeros(logits.shape[1], z.shape[1])
                    counts = torch.zeros(logits.shape[1])
                sums.index_add_(0, y.cpu(), z.detach().float().cpu())
                counts.index_add_(0, y.cpu(), torch.ones(len(y)))
        assert sums is not None and counts is not None  # local_batches refuses a client left with no batch
        present = counts > 0
        mean = torch.where(present[:, None], sums / counts.clamp_min(1)[:, None], torch.zeros_like(sums))
        local: dict[str, np.ndarray] = {PROTO_MEAN: mean.numpy().astype(np.float32)}
        if (dp := self.params.dp) is not None:  # the [K, D] matrix clipped as one vector, noised; the label set
            local = privatize(local, dp.clip, dp.sigma(), ctx.noise)  # is private too: all classes "present"
            present = torch.ones_like(present)
        reply = weights_reply(model, ctx.num_examples, total / max(steps, 1), **{
            **local, PROTO_PRESENT: present.numpy().astype(np.int8)})
        return reply, client_state

    def privacy(self, rounds_done: int) -> dict[str, Any] | None:
        """One release of the prototype matrix per round."""
        return statistic_privacy(self.params.dp, rounds_done) if self.params.dp is not None else None

    def _proto_terms(self, z: Tensor, y: Tensor, protos: dict[str, Tensor]) -> Tensor:
        """``Σ_i [w_c·CPCL_i + w_u·UPCR_i] / B``: summed over the samples whose class has global prototypes, divided
        by the whole batch ``B`` (the authors' ``loss_InfoNCE / i``, ``i`` counting every label)."""
        if not protos:
            return z.sum() * 0.0
        has = protos[HAS_UNBIASED].to(z.device)[y].bool()
        if not has.any():
            return z.sum() * 0.0
        zs, ys = z[has], y[has]
        clusters = protos[CLUSTER].to(z)
        cpcl = cpcl_loss(zs, ys, clusters, protos[CLUSTER_CLASS].to(z.device), self.params.temperature)
        upcr = upcr_loss(zs, protos[UNBIASED].to(z)[ys], self.params.upcr_reduction)
        return (self.params.cpcl_weight * cpcl + self.params.upcr_weight * upcr).sum() / len(y)


def _proto_shape(model: nn.Module) -> tuple[int, int]:
    """``(K, D)`` of a model's prototypes: its head's classes and its feature size."""
    return head_linear(model, "for FPL's class prototypes")[1].out_features, int(cast(int, model.feature_dim))
