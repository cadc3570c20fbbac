"""The hFedF / pFedHN hypernetwork h(θ, ν[i]) (hFedF Table 8) and its vector–Jacobian product.

Table 8 of Bartholet et al. (hFedF), read layer by layer::

    Embedding ν ∈ R^{N×e}        the client-embedding table (ν); row i is client i's embedding
    Linear e→50,  LeakyReLU     ┐
    Linear 50→50, LeakyReLU     │ the trunk (part of θ)
    Linear 50→50, LeakyReLU     │
    Linear 50→50  (no activation)┘
    Multi-head Linear 50→numel(φ_k), one head per parameter tensor φ_k of the client model (θ)

The default embedding size is ``e = L = ⌊1 + N/4⌋`` (hFedF §5.1, after Shamsian et al.).
Only *parameters* are generated; buffers (BatchNorm running statistics) are handled by the
method (see :mod:`feddg.algorithms.hfedf`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import cast

import torch
from torch import Tensor, nn

HIDDEN = 50


def default_embedding_dim(num_clients: int) -> int:
    """``L = ⌊1 + N/4⌋`` (hFedF §5.1)."""
    return int(math.floor(1 + num_clients / 4))


class HyperNetwork(nn.Module):
    """``h(θ, ν[i])``: client embedding -> every parameter tensor of the client model (Table 8).

    Args:
        shapes: ``(name, shape)`` of every client-model parameter to generate, in order.
        num_clients: rows ``N`` of the embedding table ν.
        embed_dim: ``e`` (default ``⌊1 + N/4⌋``).
        init: ``"model"``: each head's bias starts at the client model's own initial tensor
            and its weight is scaled to that tensor's standard deviation, so ``h`` starts at
            a sensibly scaled network; ``"default"``: PyTorch's default Linear init (pFedHN's).
        init_params: the client model's initial tensors (needed for ``init="model"``).
    """

    def __init__(
        self,
        shapes: Sequence[tuple[str, torch.Size]],
        num_clients: int,
        embed_dim: int | None = None,
        *,
        init: str = "model",
        init_params: Mapping[str, Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.names = [n for n, _ in shapes]
        self.shapes = {n: torch.Size(s) for n, s in shapes}
        e = embed_dim if embed_dim is not None else default_embedding_dim(num_clients)
        self.embeddings = nn.Embedding(num_clients, e)  # ν: N(0, 1) init, as pFedHN's nn.Embedding
        act = nn.LeakyReLU
        self.trunk = nn.Sequential(
            nn.Linear(e, HIDDEN), act(), nn.Linear(HIDDEN, HIDDEN), act(), nn.Linear(HIDDEN, HIDDEN), act(),
            nn.Linear(HIDDEN, HIDDEN),
        )
        # heads are allocated uninitialised, then initialised once (they hold ~50× the client model)
        heads = nn.ModuleList(nn.Linear(HIDDEN, self.shapes[n].numel(), device="meta") for n in self.names)
        self.heads = heads.to_empty(device="cpu")
        if init == "model":
            if init_params is None:
                raise ValueError("init='model' needs the client model's initial parameters")
            self._init_from_model(init_params)
        elif init == "default":
            for head in self.heads:
                cast(nn.Linear, head).reset_parameters()  # every head is an nn.Linear
        else:
            raise ValueError(f"unknown hypernetwork init {init!r}; expected 'model' or 'default'")

    @torch.no_grad()
    def _init_from_model(self, params: Mapping[str, Tensor]) -> None:
        """bias_k = φ_k^init; weight_k ~ U(±√3 σ_k/√50) with σ_k the std of φ_k^init, so that
        ``W_k z`` has standard deviation ``σ_k · rms(z)``: a fan-in-aware scale for every layer."""
        for name, module in zip(self.names, self.heads, strict=True):
            head = cast(nn.Linear, module)  # every head is an nn.Linear
            p = params[name].detach().float().flatten()
            sigma = float(p.std(unbiased=False))
            head.bias.copy_(p)
            head.weight.uniform_(-1.0, 1.0).mul_(math.sqrt(3.0) * sigma / math.sqrt(HIDDEN))

    @property
    def embed_dim(self) -> int:
        return self.embeddings.embedding_dim

    def theta(self) -> list[nn.Parameter]:
        """θ: trunk and heads (everything but the embedding table ν)."""
        return [*self.trunk.parameters(), *self.heads.parameters()]

    def theta_names(self) -> list[str]:
        """Names (in ``named_parameters``) of θ, in the order of :meth:`theta`."""
        return [n for n, _ in self.named_parameters() if not n.startswith("embeddings.")]

    def forward(self, embedding: Tensor) -> dict[str, Tensor]:
        """φ = h(θ, embedding) for one ``[e]`` embedding: name -> tensor of the client's shape."""
        z = self.trunk(embedding.unsqueeze(0)).squeeze(0)
        return {n: head(z).view(self.shapes[n]) for n, head in zip(self.names, self.heads, strict=True)}

    def for_client(self, client_id: int) -> dict[str, Tensor]:
        """φ_i = h(θ, ν[i]) (Algorithm 1, line 5)."""
        return self(self.embeddings.weight[client_id])


def hypernetwork_vjp(
    hnet: HyperNetwork, client_id: int, v: Mapping[str, Tensor], *, wrt_embeddings: bool = True
) -> tuple[list[Tensor], Tensor | None]:
    """``(∇_θ h(θ,ν[i])ᵀ·v, ∇_ν h(θ,ν[i])ᵀ·v)`` (Algorithm 1, line 13).

    One backward pass through the generator with ``v`` as the output cotangent: the Jacobian is
    never materialised. It equals the gradient of ``Σ_k ⟨h_k(θ, ν[i]), v_k⟩`` with ``v`` held
    constant. The θ gradient is a list in the order of ``hnet.theta()``; the ν gradient is over
    the whole table ``ν ∈ R^{N×e}`` (only row ``i`` is nonzero), or ``None`` when
    ``wrt_embeddings`` is false (fixed or random embeddings).
    """
    phi = hnet.for_client(client_id)
    theta = hnet.theta()
    inputs: list[Tensor] = theta + ([hnet.embeddings.weight] if wrt_embeddings else [])
    outputs = [phi[n] for n in hnet.names]
    cotangents = [v[n].to(phi[n].dtype) for n in hnet.names]
    grads = list(torch.autograd.grad(outputs, inputs, grad_outputs=cotangents))
    return grads[: len(theta)], (grads[len(theta)] if wrt_embeddings else None)
