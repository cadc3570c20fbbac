"""FedRobust (Reisizadeh, Farnia, Pedarsani, Jadbabaie, "Robust Federated Learning: The Case of Affine
Distribution Shifts", NeurIPS 2020, eq. 4 and Algorithm 1): each client ``i`` holds an affine perturbation
``x ↦ Λ_i x + δ_i`` of its inputs and plays the minimax

    min_w max_{‖Λ_i − I‖_F ≤ ε_Λ, ‖δ_i‖₂ ≤ ε_δ}  (1/n) Σ_i  E_{(x,y)~P_i} ℓ(f_w(Λ_i x + δ_i), y)

by gradient descent ascent: on every local batch the model steps down (the client's optimiser) and
``(Λ_i, δ_i)`` steps up, ``(Λ, δ) ← Π((Λ, δ) + η_a ∇_{Λ,δ} ℓ)``, Π the projection onto the two norm balls.
The server averages ``w`` (FedAvg); ``(Λ_i, δ_i)`` never leave their client (client state, from ``(I, 0)``).

What is perturbed: the image input. ``perturb: pixels`` (the paper's) is one ``d × d`` matrix on the flattened
image (``d = C·H·W``, at most ``max_dim``); ``perturb: channels`` one ``C × C`` matrix on every pixel's colour
vector and one ``δ ∈ R^C`` (cheap for large images).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

from feddg.algorithms.base import ClientContext, ClientState, Method, Params, weights_reply
from feddg.algorithms.components.local import LossFn, grad_scaler, local_batches, make_optimizer, scaled_step
from feddg.devices import images
from feddg.messages import Message, load_weights
from feddg.tasks import IMAGES

LAMBDA, DELTA = "robust/lambda", "robust/delta"  # client state: Λ_i, δ_i


class FedRobustParams(Params):
    eps_lambda: float = Field(0.5, ge=0.0, description="ε_Λ, the radius of ‖Λ − I‖_F")
    eps_delta: float = Field(0.5, ge=0.0, description="ε_δ, the radius of ‖δ‖₂")
    ascent_lr: float = Field(0.01, gt=0.0, description="η_a, the ascent step of (Λ, δ)")
    perturb: Literal["pixels", "channels"] = Field("pixels", description="Λ on the flattened image (d×d, the "
                                                   "paper's) or on each pixel's channels (C×C)")
    max_dim: int = Field(4096, ge=1, description="largest d = C·H·W that perturb=pixels accepts")


def perturb(x: Tensor, lam: Tensor, delta: Tensor, mode: str) -> Tensor:
    """``Λ x + δ`` on the flattened image (``pixels``) or on every pixel's channel vector (``channels``)."""
    if mode == "pixels":
        return (x.flatten(1) @ lam.T + delta).reshape(x.shape)
    return torch.einsum("ij,bj...->bi...", lam, x) + delta.reshape(1, -1, *([1] * (x.dim() - 2)))


def project(lam: Tensor, delta: Tensor, eps_lambda: float, eps_delta: float) -> None:
    """Π in place: ``Λ − I`` onto the Frobenius ball of radius ε_Λ, ``δ`` onto the L2 ball of radius ε_δ."""
    eye = torch.eye(lam.shape[0], dtype=lam.dtype, device=lam.device)
    dev = lam - eye
    lam.copy_(eye + dev * min(1.0, eps_lambda / max(float(dev.norm()), 1e-12)))
    delta.mul_(min(1.0, eps_delta / max(float(delta.norm()), 1e-12)))


def descent_ascent_step(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, lam: Tensor, delta: Tensor,
                        opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, p: FedRobustParams,
                        autocast: Any = torch.enable_grad, clip: float | None = None) -> Tensor:
    """One step of both players on ``ℓ(f_w(Λx + δ), y)``: the optimiser's descent on ``w`` and the projected
    ascent on ``(Λ, δ)`` with their gradients at the same point; returns the loss."""
    lam.requires_grad_(True)
    delta.requires_grad_(True)
    opt.zero_grad(set_to_none=True)
    lam.grad = delta.grad = None
    with autocast():
        loss = loss_fn(model, perturb(x, lam, delta, p.perturb), y)

    def ascend() -> None:
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        grads = [t.grad / scale for t in (lam, delta) if t.grad is not None]
        if len(grads) < 2 or not all(bool(torch.isfinite(g).all()) for g in grads):
            return  # fp16 overflow: the scaler skips this step, so does the ascent
        with torch.no_grad():
            lam.add_(p.ascent_lr * grads[0])
            delta.add_(p.ascent_lr * grads[1])
            project(lam, delta, p.eps_lambda, p.eps_delta)

    scaled_step(loss, opt, scaler, ascend, clip)
    lam.requires_grad_(False)
    delta.requires_grad_(False)
    return loss.detach()


class FedRobust(Method):
    """Client-specific affine input perturbations by projected ascent; the model descends; FedAvg."""

    name = "fedrobust"
    Params = FedRobustParams
    params: FedRobustParams
    requires = frozenset({IMAGES})  # an affine map of image tensors
    search_space: ClassVar[dict[str, list[Any]]] = {"eps_lambda": [0.1, 0.5, 1.0], "eps_delta": [0.1, 0.5, 1.0],
                                                    "ascent_lr": [0.001, 0.01, 0.1]}
    loss_fn: LossFn | None = None  # ℓ(f_w(x̃), y): the task's loss of the model's output

    def initial(self, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """``(I, 0)`` sized for the image batch ``x``; refuses ``pixels`` beyond ``max_dim``."""
        if self.params.perturb == "pixels":
            d = int(np.prod(x.shape[1:]))
            if d > self.params.max_dim:
                raise ValueError(f"fedrobust: perturb=pixels needs a {d}×{d} Λ (d = C·H·W > max_dim="
                                 f"{self.params.max_dim}); set method.params.perturb=channels or raise max_dim")
        else:
            d = int(x.shape[1])
        return np.eye(d, dtype=np.float32), np.zeros(d, np.float32)

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        objective = self.loss_fn or (lambda m, x, y: ctx.task.loss(m(x), y))
        model.train()
        opt = make_optimizer(model.parameters(), ctx.optim, float(msg["lr"]))
        scaler = grad_scaler(ctx)
        lam = delta = None
        total, steps = 0.0, 0
        for _, inputs, y in local_batches(model, ctx):
            x = images(inputs)
            if lam is None or delta is None:
                eye, zero = self.initial(x)
                lam = torch.tensor(np.asarray(client_state.get(LAMBDA, eye)), device=x.device)
                delta = torch.tensor(np.asarray(client_state.get(DELTA, zero)), device=x.device)
            total += float(descent_ascent_step(model, objective, x, y, lam, delta, opt, scaler, self.params,
                                               ctx.autocast, ctx.optim.grad_clip))
            steps += 1
        reply = weights_reply(model, ctx.num_examples, total / max(steps, 1))
        if lam is None or delta is None:  # no local step: the perturbation stays as it was
            return reply, client_state
        return reply, {**client_state, LAMBDA: lam.detach().cpu().numpy(), DELTA: delta.detach().cpu().numpy()}
