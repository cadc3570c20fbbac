"""FedIIR (Guo et al., ICML 2023): federated learning of *implicit invariant relationships*.

The server keeps ``ḡ``, an EMA-smoothed mean of the clients' gradients of the loss with respect to
the classifier's parameters; each client adds a penalty on the squared distance between its own
classifier gradient and that mean (the official code's ``update``):

    L_k = CE + γ · Σ_params ‖∇_w CE_k(batch) − ḡ‖²,     ḡ ← β ḡ + (1 − β) · mean over batches of ∇_w CE

with ``γ = penalty`` and ``β = ema``. The mean is over the batches of all participating clients at
the global model (their ``mean_grad``). With one message exchange per round, each client computes
its batch gradients at the model it receives, *before* training, and sends their sum; the server
folds them into ``ḡ`` at aggregation, so round ``t``'s penalty uses gradients up to round ``t − 1``
(the official code computes round ``t``'s gradients first, in a second pass over all clients).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, autograd, nn

from feddg.aggregation.mean import WeightedSum
from feddg.algorithms.base import (
    Accumulator,
    ClientContext,
    ClientState,
    Method,
    Metrics,
    Params,
    Reply,
    ServerContext,
    ServerState,
    weights_reply,
)
from feddg.algorithms.components.local import gradient_batches, train_local
from feddg.devices import Inputs
from feddg.messages import Layout, Message, Shapes, like_slot, load_weights, number_slot, weights_of
from feddg.models.base import head_linear
from feddg.tasks import CLASS_LABELS

MEAN_PREFIX = "iir/"  # server -> client: ḡ per classifier parameter
GRAD_PREFIX = "grad/"  # client -> server: Σ over its batches of the classifier gradient
BATCHES = "grad_batches"  # client -> server: number of those batches


class FedIIRParams(Params):
    penalty: float = Field(1e-3, ge=0, description="γ, weight of the gradient-alignment penalty")
    ema: float = Field(0.95, ge=0, lt=1, description="β, EMA factor of the server's mean classifier gradient")
    penalised: Literal["last_linear", "head"] = Field(
        "last_linear", description="the classifier whose gradients are aligned: the head's last linear layer "
        "(the official code's default linear classifier) or the zoo model's whole `classifier` block")


def classifier(model: nn.Module, penalised: str = "last_linear") -> nn.Module:
    """The layers FedIIR's classifier gradient is taken over. The official code's default classifier is one linear
    layer on the featurizer; on zoo models with an MLP head (AlexNet, VGG) the hidden layers, BatchNorm included,
    then belong to the featurizer, so ``last_linear`` (the default) takes the head's last ``nn.Linear`` and
    ``head`` the whole ``classifier`` block (the same layer on every other zoo model)."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Module):
        raise TypeError("FedIIR needs a model with a `classifier` head (a zoo model)")
    return head_linear(model, "for FedIIR's gradient penalty")[1] if penalised == "last_linear" else head


def gradient_penalty(grads: tuple[Tensor, ...], mean: list[Tensor]) -> Tensor | int:
    """``Σ_params ‖g − ḡ‖²`` (the int 0 without any parameter)."""
    return sum(((g - m) ** 2).sum() for g, m in zip(grads, mean, strict=True))


def ema_update(old: dict[str, np.ndarray], new: dict[str, np.ndarray], beta: float) -> dict[str, np.ndarray]:
    """``β · old + (1 − β) · new`` per parameter."""
    return {k: (beta * old[k] + (1.0 - beta) * new[k]).astype(old[k].dtype) for k in old}


def batch_gradient_sum(model: nn.Module, ctx: ClientContext, head: nn.Module) -> tuple[dict[str, np.ndarray], int]:
    """Σ over the client's batches of ``∇_classifier`` of the task's loss (cross-entropy) at the current weights,
    and the batch count.

    Runs in training mode like the official code (BatchNorm running statistics are restored after), over
    the client's data in order and without augmentation, so it draws nothing from the client's random stream;
    a single-sample batch is skipped under BatchNorm, as training skips it.
    """
    names, params = zip(*head.named_parameters(), strict=True)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    total = [torch.zeros_like(p) for p in params]
    batches = 0
    model.train()
    for x, y in gradient_batches(model, ctx):
        grads = autograd.grad(ctx.task.loss(model(x), y), params)
        total = [t + g for t, g in zip(total, grads, strict=True)]
        batches += 1
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(buffers[k])
    return {n: t.detach().cpu().numpy() for n, t in zip(names, total, strict=True)}, batches


class FedIIR(Method):
    name = "fediir"
    Params = FedIIRParams
    params: FedIIRParams
    requires = frozenset({CLASS_LABELS})  # gradients of its classifier head
    search_space = {"penalty": [1e-2, 5e-3, 1e-3, 5e-4, 1e-4], "ema": [0.90, 0.95, 0.99]}


    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        head = classifier(model, self.params.penalised)
        mean = {n: np.zeros_like(p.detach().cpu().numpy()) for n, p in head.named_parameters()}
        return {"weights": weights_of(model), "grad_mean": mean}

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        return {**state["weights"], **{MEAN_PREFIX + k: v for k, v in state["grad_mean"].items()}}

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        head = classifier(model, self.params.penalised)
        names = [n for n, _ in head.named_parameters()]
        mean = [torch.from_numpy(np.asarray(msg[MEAN_PREFIX + n])).to(ctx.device) for n in names]
        grad_sum, batches = batch_gradient_sum(model, ctx, head)
        params = list(head.parameters())
        gamma = self.params.penalty

        def loss_fn(m: nn.Module, x: Inputs, y: Tensor) -> Tensor:
            erm = ctx.task.loss(m(x), y)
            grads = autograd.grad(erm, params, create_graph=True)
            return erm + gamma * gradient_penalty(grads, mean)

        loss = train_local(model, ctx, lr=float(msg["lr"]), loss_fn=loss_fn)
        reply = weights_reply(model, ctx.num_examples, loss, **{GRAD_PREFIX + k: v for k, v in grad_sum.items()},
                              **{BATCHES: batches})
        return reply, client_state

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """The summed classifier gradient per parameter, as the mean ḡ sent, and the number of batches."""
        return {**{GRAD_PREFIX + k[len(MEAN_PREFIX) :]: like_slot(v) for k, v in sent.items() if k.startswith(MEAN_PREFIX)},
                BATCHES: number_slot(int)}

    def accumulate(self, acc: Accumulator, reply: Reply) -> Accumulator:
        """FedAvg's running sum, plus running ``Σ_k grad_sum_k`` and ``Σ_k batches_k``."""
        acc = super().accumulate(acc, reply)
        acc.sums.setdefault(GRAD_PREFIX, WeightedSum(GRAD_PREFIX)).add(reply.message, 1.0)
        return acc

    def keep(self, reply: Reply) -> Message:
        return {BATCHES: reply.message[BATCHES]}

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        """FedAvg of the weights; ``ḡ ← β ḡ + (1 − β) Σ_k grad_sum_k / Σ_k batches_k``."""
        state, metrics = super().finish(state, acc)
        batches = sum(int(r.message[BATCHES]) for r in acc.kept)
        if batches == 0:
            return state, metrics
        grads = {k[len(GRAD_PREFIX) :]: v for k, v in acc.sums[GRAD_PREFIX].sums.items()}
        new = {k: grads[k] / batches for k in state["grad_mean"]}
        return {**state, "grad_mean": ema_update(state["grad_mean"], new, self.params.ema)}, metrics
