"""pFedHN (Shamsian et al., 2021) as the hFedF paper benchmarks it: the same hypernetwork
(hFedF Table 8) without GradAlign and EMA, with pFedHN's Table-10 server settings.

The round is hFedF's (:mod:`feddg.algorithms.hfedf`): generate ``φ_i = h(θ, ν[i])``, train E local
epochs, ``Δθ = ∇h(θ, ν[i])ᵀ (φ_init − φ_final)`` by one vector–Jacobian product (pFedHN's
Algorithm 1), the plain mean over the round's clients, one Adam step on θ and ν.
Differences from the original pFedHN (one client per server step, SGD) are in docs/methods/pfedhn.md.
"""

from __future__ import annotations

from pydantic import Field

from feddg.algorithms.hfedf import HFedF, HFedFParams


class PFedHNParams(HFedFParams):
    server_lr: float = Field(1e-2, gt=0, description="hFedF Table 10, pFedHN (PACS): 1e-2")
    server_weight_decay: float = Field(1e-3, ge=0, description="hFedF Table 10, pFedHN (PACS): 1e-3")
    gradalign: bool = False
    ema: bool = False


class PFedHN(HFedF):
    """hFedF with ``gradalign=False, ema=False`` and pFedHN's server learning rate and weight decay."""

    name = "pfedhn"
    Params = PFedHNParams
    search_space = {"server_lr": [1e-1, 1e-2, 1e-3], "server_weight_decay": [1e-3, 1e-4, 1e-5]}  # hFedF paper, Table 10
