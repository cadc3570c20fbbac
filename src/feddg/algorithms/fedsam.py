"""FedSAM (Qu, Li, Duan, Liu, Tang, Lu, "Generalized Federated Learning via Sharpness Aware Minimization", ICML
2022, Algorithm 1): FedAvg whose clients take SAM steps (Foret et al., ICLR 2021, eq. 2):

    ε = ρ g / ‖g‖₂                  g = ∇L(w) on the batch, ‖·‖ over all trainable parameters
    w ← w − η ∇L(w + ε)             the optimiser's step from w with the gradient at the perturbed point

Two forward-backward passes per batch. The second pass leaves BatchNorm's running statistics as the first
left them (the usual SAM practice), and the reported loss is ``L(w)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor, nn

from feddg.algorithms.base import ClientContext, ClientState, Method, Params, weights_reply
from feddg.algorithms.components.local import LossFn, grad_scaler, local_batches, make_optimizer, scaled_step
from feddg.devices import Inputs
from feddg.messages import Message, load_weights
from feddg.numerics import sqrt


class FedSAMParams(Params):
    rho: float = Field(0.05, gt=0.0, description="ρ, the radius of SAM's ascent step (SAM's default)")


def ascent(params: Sequence[Tensor], grads: Sequence[Tensor], rho: float) -> list[Tensor]:
    """``ε = ρ g / ‖g‖₂`` (zero when ``g`` is zero or not finite: an fp16 overflow)."""
    norm = sqrt(sum((g.float() ** 2).sum() for g in grads))  # type: ignore[arg-type]  # a 0-d tensor
    if not bool(torch.isfinite(norm)) or float(norm) == 0.0:
        return [torch.zeros_like(p) for p in params]
    return [(rho * g / norm).to(p.dtype) for p, g in zip(params, grads, strict=True)]


def sam_step(model: nn.Module, loss_fn: LossFn, x: Inputs, y: Tensor, opt: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler, rho: float, autocast: Callable[[], Any] = torch.enable_grad,
             clip: float | None = None) -> Tensor:
    """One SAM step: gradient at ``w``, ascend to ``w + ε``, gradient there, step from ``w``; returns ``L(w)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    with autocast():
        loss = loss_fn(model, x, y)
    grads = torch.autograd.grad(scaler.scale(loss), params, allow_unused=True)  # the scale cancels in ε
    eps = ascent(params, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)], rho)
    buffers = [b.clone() for b in model.buffers()]
    with torch.no_grad():
        for p, e in zip(params, eps, strict=True):
            p.add_(e)
    opt.zero_grad(set_to_none=True)
    with autocast():
        perturbed = loss_fn(model, x, y)

    def back_to_w() -> None:
        with torch.no_grad():
            for p, e in zip(params, eps, strict=True):
                p.sub_(e)
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)

    scaled_step(perturbed, opt, scaler, back_to_w, clip)
    return loss.detach()


class FedSAM(Method):
    """Local sharpness-aware minimisation; FedAvg aggregation."""

    name = "fedsam"
    Params = FedSAMParams
    params: FedSAMParams
    search_space: ClassVar[dict[str, list[Any]]] = {"rho": [0.01, 0.02, 0.05, 0.1, 0.5]}
    loss_fn: LossFn | None = None  # the local objective: the task's loss (tests swap in a quadratic)

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        objective = self.loss_fn or (lambda m, x, y: ctx.task.loss(m(x), y))
        model.train()
        opt = make_optimizer(model.parameters(), ctx.optim, float(msg["lr"]))
        scaler = grad_scaler(ctx)
        total, steps = 0.0, 0
        for _, x, y in local_batches(model, ctx):
            total += float(sam_step(model, objective, x, y, opt, scaler, self.params.rho, ctx.autocast,
                                    ctx.optim.grad_clip))
            steps += 1
        return weights_reply(model, ctx.num_examples, total / max(steps, 1)), client_state
