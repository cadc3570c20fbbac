"""FedSR (Nguyen, Torr & Lim, NeurIPS 2022): a simple, probabilistic representation for FedDG.

The featurizer outputs the mean and (pre-softplus) scale of a Gaussian representation,
``z = μ(x) + softplus(s(x)) · ε`` with ``ε ~ N(0, I)`` (their §3.1), and the local objective is

    CE(classifier(z), y) + λ_L2R · E‖z‖₂ + λ_CMI · KL(p(z|x) ‖ r(z|y))                (their eqs. 5–8)

where the conditional mutual-information bound uses a learned class-conditional Gaussian reference
``r(z|y) = N(r_μ[y], softplus(r_σ[y])²)``, compared with ``p(z|x)`` scaled by a learned scalar ``c``
(their code: ``z_mu * C``, ``z_sigma * C``). The reference ``(r_μ, r_σ, c)`` is client state: it is
trained with the model but never leaves the client. Server: FedAvg. Test time: the softmax averaged
over ``num_samples`` draws of ``z``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from feddg.algorithms.base import ClientContext, ClientState, Method, Params, weights_reply
from feddg.algorithms.components.local import grad_scaler, local_batches, make_optimizer, scaled_step
from feddg.devices import Inputs
from feddg.messages import Message, load_weights
from feddg.models.base import FedModel, head_linear
from feddg.tasks import CLASS_LABELS

REF_KEYS = ("ref/mu", "ref/sigma", "ref/scale")


class FedSRParams(Params):
    l2r: float = Field(1e-2, ge=0, description="λ_L2R, weight of E‖z‖₂")
    cmi: float = Field(5e-4, ge=0, description="λ_CMI, weight of KL(p(z|x) ‖ r(z|y))")
    z_dim: int | None = Field(None, ge=1, description="size of z (default: the input size of the head's last "
                              "linear layer, the layer widened to 2·z_dim)")
    num_samples: int = Field(20, ge=1, description="Monte-Carlo draws of z at test time")


class FedSRNet(FedModel):
    """A zoo model whose last linear layer outputs ``2·z_dim`` Gaussian parameters, then a linear classifier.

    ``features(x)`` draws ``z`` in training mode and returns the mean ``μ`` in eval mode (FedSR's
    :meth:`FedSR.predict` averages over draws instead).
    """

    stages_in = "net"  # where models/stages.py finds the conv stages (augmentations hook them)
    classifier: nn.Linear

    def __init__(self, net: FedModel, z_dim: int | None = None) -> None:
        super().__init__()
        head_name, head = head_linear(net, "for FedSR to widen")
        self.z_dim = z_dim or head.in_features  # = feature_dim for a one-layer head; an MLP head's hidden size
        self.feature_dim = self.z_dim
        _set_module(net, head_name, nn.Linear(head.in_features, 2 * self.z_dim))
        self.net = net
        self.classifier = nn.Linear(self.z_dim, head.out_features)

    def distribution(self, x: Inputs) -> tuple[Tensor, Tensor]:
        """``(μ, σ)`` of ``p(z|x)``, ``σ = softplus(s)``."""
        params = self.net(x)
        return params[:, : self.z_dim], F.softplus(params[:, self.z_dim :])

    def features(self, x: Tensor) -> Tensor:
        mu, sigma = self.distribution(x)
        return mu + sigma * torch.randn_like(mu) if self.training else mu


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


def cmi_term(mu: Tensor, sigma: Tensor, scale: Tensor, r_mu: Tensor, r_sigma: Tensor) -> Tensor:
    """``KL(N(c μ, (c σ)²) ‖ N(r_μ, r_σ²))`` summed over dimensions, per sample (FedSR eq. 8 bound)."""
    s = sigma * scale
    return (torch.log(r_sigma) - torch.log(s) + (s**2 + (mu * scale - r_mu) ** 2) / (2 * r_sigma**2) - 0.5).sum(1)


def l2r_term(z: Tensor) -> Tensor:
    """``‖z‖₂`` per sample (FedSR's L2 regulariser on the representation)."""
    return z.norm(dim=1)


class FedSR(Method):
    name = "fedsr"
    Params = FedSRParams
    params: FedSRParams
    requires = frozenset({CLASS_LABELS})  # a reference distribution r(z|y) per class
    takes_soft_targets = False
    search_space = {"l2r": [1e-1, 1e-2, 1e-3], "cmi": [1e-4, 5e-4, 1e-3, 5e-3]}  # l2r: hFedF Table 10; cmi: not in it


    def prepare_model(self, model: nn.Module) -> nn.Module:
        if not isinstance(model, FedModel):
            raise TypeError("FedSR needs a zoo model (classifier(features(x)))")
        return FedSRNet(model, self.params.z_dim)

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        assert isinstance(model, FedSRNet)
        load_weights(model, msg)
        p = self.params
        num_classes, z_dim = model.classifier.out_features, model.z_dim
        ref = client_state or {
            "ref/mu": torch.zeros(num_classes, z_dim).numpy(),
            "ref/sigma": torch.ones(num_classes, z_dim).numpy(),
            "ref/scale": torch.ones(()).numpy(),
        }
        r_mu, r_sigma, scale = (torch.tensor(ref[k], device=ctx.device, requires_grad=True) for k in REF_KEYS)
        opt = make_optimizer([*model.parameters(), r_mu, r_sigma, scale], ctx.optim, float(msg["lr"]))
        scaler = grad_scaler(ctx)
        model.train()
        sums, steps = {"loss": 0.0, "l2r": 0.0, "cmi": 0.0}, 0
        for _, x, y in local_batches(model, ctx):
            with ctx.autocast():
                mu, sigma = model.distribution(x)
                z = mu + sigma * torch.randn_like(mu)
                l2r = l2r_term(z).mean()
                cmi = cmi_term(mu, sigma, scale, r_mu[y], F.softplus(r_sigma)[y]).mean()
                loss = ctx.task.loss(model.classifier(z), y) + p.l2r * l2r + p.cmi * cmi
            opt.zero_grad(set_to_none=True)
            scaled_step(loss, opt, scaler, clip=ctx.optim.grad_clip)
            for k, v in (("loss", loss), ("l2r", l2r), ("cmi", cmi)):
                sums[k] += float(v.detach())
            steps += 1
        n = max(steps, 1)
        reply = weights_reply(model, ctx.num_examples, sums["loss"] / n, l2r=sums["l2r"] / n, cmi=sums["cmi"] / n)
        state: ClientState = {k: t.detach().cpu().numpy().copy()
                              for k, t in zip(REF_KEYS, (r_mu, r_sigma, scale), strict=True)}
        return reply, state

    def predict(self, model: nn.Module, x: Inputs) -> Tensor:
        """``log`` of the softmax averaged over ``num_samples`` draws of ``z``. The draws ``ε`` come from a fixed
        seed and are the same for every sample, so a sample's prediction depends on neither what ran before nor
        the batch it is evaluated in (draws per batch position made figures move with ``eval.batch_size``)."""
        assert isinstance(model, FedSRNet)
        mu, sigma = model.distribution(x)
        s = self.params.num_samples
        eps = torch.randn((s, 1, mu.shape[1]), generator=torch.Generator().manual_seed(0)).to(mu.device, mu.dtype)
        probs = F.softmax(model.classifier((mu + sigma * eps).reshape(-1, mu.shape[1])), dim=1)
        return probs.reshape(s, mu.shape[0], -1).mean(0).clamp_min(1e-12).log()
