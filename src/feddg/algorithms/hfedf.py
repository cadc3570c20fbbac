"""hFedF: hypernetwork-driven model fusion (Bartholet et al., "Hypernetwork-Driven Model Fusion for
Federated Domain Generalization"), §4, Algorithms 1–4, Tables 6, 8, 10.

One round (Algorithm 1), as this file runs it:

* line 5   ``client_config``: the server generates ``φ_i = h(θ, ν[i])`` and sends it as ``w/...``.
* line 6–9 ``client_update``: E local epochs of cross-entropy (Algorithm 2, ``train_local``);
           the reply is ``delta/<name> = Δφ_i = φ̃_i^{t,E} − φ_i^{t,0}`` (line 9, literally).
* line 13  ``aggregate``: ``g_i = ∇h(θ, ν[i])ᵀ · (−Δφ_i)`` by one vector–Jacobian product. The
           sign: line 9 with line 17 (``θ − α g``) would *ascend* the clients' loss, so the
           server uses ``φ_init − φ_final = −Δφ`` (pFedHN's convention): a descent step.
* line 14–16 GradAlign (Algorithm 3), separately for θ and ν: ``γ_i = cos(g_avg, g_i)``,
           ``γ̃ = softmax(γ)`` (the box; §4.2 writes ``softmax(−γ)``, kept as an option),
           ``g = Σ_i γ̃_i g_i``. Without GradAlign ``g`` is the plain mean.
* line 17  the server optimiser (Adam, Table 10's server lr and weight decay) steps.
* line 18  EMA (Algorithm 4) with warm-up round ``w`` and smoothing ``α``.

See ``docs/methods/hfedf.md`` for every choice the paper leaves open.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

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
)
from feddg.algorithms.components.embedding_ae import EmbeddingAutoencoder, train_and_embed
from feddg.algorithms.components.hypernetwork import HyperNetwork, hypernetwork_vjp
from feddg.algorithms.components.local import train_local
from feddg.devices import images
from feddg.messages import WEIGHT_PREFIX, Layout, Message, Shapes, array_slot, load_weights
from feddg.numerics import adam, sqrt
from feddg.seeds import derived_seed
from feddg.tasks import IMAGES

DELTA_PREFIX = "delta/"
EMB_KEY = "emb/latent"


class HFedFParams(Params):
    server_lr: float = Field(1e-3, gt=0, description="α of Algorithm 1 (Table 10: 1e-3)")
    server_weight_decay: float = Field(1e-5, ge=0, description="Adam weight decay on θ, ν (Table 10, PACS: 1e-5)")
    server_optimizer: Literal["adam", "sgd"] = Field("adam", description="adam (§C.7) | sgd (Alg. 1 line 17 literal)")
    gradalign: bool = Field(True, description="Algorithm 3; False: plain mean of the client gradients")
    gradalign_sign: Literal["box", "main_text"] = Field(
        "box", description="box: softmax(+cos) (Alg. 3); main_text: softmax(−cos) (§4.2)"
    )
    ema: bool = Field(True, description="Algorithm 4")
    ema_alpha: float = Field(0.95, ge=0.0, le=1.0, description="α: weight of the new θ (Table 10, PACS: 0.95)")
    ema_warmup: int = Field(1, ge=1, description="w: EMA starts at round index t = w (t counts from 0)")
    ema_embeddings: bool = Field(True, description="smooth ν too (Alg. 1 line 18); False: θ only (Alg. 4)")
    ema_mode: Literal["box", "polyak"] = Field(
        "box", description="box: θ ← θ_EMA each round (Alg. 4); polyak: θ trains raw, θ_EMA only evaluates"
    )
    embeddings: Literal["learned", "random", "autoencoder"] = Field(
        "learned", description="learned (default) | random, re-drawn after every update (Table 7) | autoencoder (C.2)"
    )
    embed_dim: int | None = Field(None, ge=1, description="L; default ⌊1 + N/4⌋ (§5.1)")
    init: Literal["model", "default"] = Field("model", description="hypernetwork head init (see hypernetwork.py)")
    ae_images: int = Field(100, ge=1, description="images a client trains its auto-encoder on (C.2: 100)")
    ae_epochs: int = Field(20, ge=1)
    ae_lr: float = Field(1e-3, gt=0)


# ------------------------------------------------------------------- Algorithms 3 and 4

Grad = Sequence[Tensor]  # one gradient, as the list of its tensors (θ: one per hypernetwork tensor)


def _parts(g: Tensor | Grad) -> Grad:
    return [g] if isinstance(g, Tensor) else g


def gradalign(grads: Sequence[Tensor | Grad], sign: float = 1.0) -> tuple[Tensor, Tensor]:
    """GradAlign (Algorithm 3; §4.2): weights ``γ̃`` and cosines ``γ`` of the client gradients.

    ``g_avg = (1/|S|) Σ_i g_i``, ``γ_i = cos(g_avg, g_i)``, ``γ̃ = softmax(sign · γ)``; ``sign=+1``
    is the appendix box, ``sign=-1`` the main text's ``e^{−γ_i}``. A zero gradient has cosine 0.

    Computed from the Gram matrix ``G_ij = ⟨g_i, g_j⟩`` (no copy of the gradients):
    ``γ_i = Σ_j G_ij / (√G_ii · √Σ_jk G_jk)``, which is ``⟨g_avg, g_i⟩ / (‖g_avg‖ ‖g_i‖)``.
    """
    parts = [_parts(g) for g in grads]
    k = len(parts)
    gram = torch.zeros(k, k, dtype=torch.float64)
    for i in range(k):
        for j in range(i, k):
            gram[i, j] = gram[j, i] = sum(float(torch.dot(a.flatten(), b.flatten()))
                                          for a, b in zip(parts[i], parts[j], strict=True))
    norm_avg = float(sqrt(gram.sum().clamp_min(0.0)))
    cos = gram.sum(1) / (sqrt(gram.diagonal().clamp_min(0.0)) * norm_avg).clamp_min(1e-300)
    return torch.softmax(sign * cos, 0), cos


def combine(weights: Sequence[float], grads: list[list[Tensor]]) -> list[Tensor]:
    """``Σ_i w_i g_i`` (Algorithm 1, line 16), accumulated in place into the first gradient's tensors."""
    out = [t.mul_(weights[0]) for t in grads[0]]
    for w, g in zip(weights[1:], grads[1:], strict=True):
        for o, t in zip(out, g, strict=True):
            o.add_(t, alpha=w)
    return out


def ema_step(theta: Tensor, shadow: Tensor | None, t: int, warmup: int, alpha: float) -> tuple[Tensor, Tensor | None]:
    """EMA (Algorithm 4) at round index ``t``: returns the new ``(θ^t, θ_EMA)``.

    ``t == w``: ``θ_EMA ← θ``. ``t > w``: ``θ_EMA ← α θ + (1 − α) θ_EMA`` and ``θ ← θ_EMA``.
    Before the warm-up round nothing happens.
    """
    if t == warmup:
        shadow = theta.clone()
    if t > warmup:
        if shadow is None:
            raise ValueError("EMA past its warm-up round needs θ_EMA")
        shadow = alpha * theta + (1.0 - alpha) * shadow
        theta = shadow.clone()
    return theta, shadow


# ------------------------------------------------------------------------------ helpers


def buffer_names(model: nn.Module) -> list[str]:
    """state_dict keys that are not parameters (BatchNorm running stats): not generated by h."""
    params = {n for n, _ in model.named_parameters()}
    return [k for k in model.state_dict() if k not in params]


class HFedF(Method):
    """Server: hypernetwork + embeddings + optimiser; client: E local epochs, reply Δφ."""

    name = "hfedf"
    Params = HFedFParams
    params: HFedFParams

    @classmethod
    def requirements(cls, params: Any) -> frozenset[str]:
        """The auto-encoder embeddings (C.2) are learned from images."""
        assert isinstance(params, HFedFParams)
        return frozenset({IMAGES}) if params.embeddings == "autoencoder" else frozenset()
    personalized = True
    averages_weights = False
    search_space = {  # the hFedF paper's Table 10 (its client lr and weight decay are optim.*, not searched here)
        "server_lr": [1e-1, 1e-2, 1e-3],
        "server_weight_decay": [1e-3, 1e-4, 1e-5],
        "ema_alpha": [0.75, 0.85, 0.95],
    }

    # --- server half --------------------------------------------------------------------
    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        p = self.params
        shapes = [(n, q.shape) for n, q in model.named_parameters()]
        with torch.random.fork_rng():
            torch.manual_seed(derived_seed(ctx.seed, 31, bits=31))
            hnet = HyperNetwork(
                shapes, ctx.num_clients, p.embed_dim, init=p.init,
                init_params={n: q.detach().cpu() for n, q in model.named_parameters()},
            )
        learned = p.embeddings == "learned"
        hnet.embeddings.weight.requires_grad_(learned)
        params = hnet.theta() + ([hnet.embeddings.weight] if learned else [])
        if p.server_optimizer == "adam":
            opt: torch.optim.Optimizer = adam(params, lr=p.server_lr, weight_decay=p.server_weight_decay)
        else:
            opt = torch.optim.SGD(params, lr=p.server_lr, weight_decay=p.server_weight_decay)
        state = model.state_dict()
        init_buffers = {k: state[k].detach().cpu().numpy().copy() for k in buffer_names(model)}
        return {
            "hnet": hnet, "opt": opt, "t": 0, "seed": ctx.seed,
            "init_buffers": init_buffers, "buffers": ctx.per_client("buffers"), "num_examples": {},
            "ema_shadow": None,
        }

    def _weights(self, state: ServerState, client_id: int | None, buffers: dict[str, np.ndarray],
                 use_shadow: bool = False) -> Message:
        """``h(θ, ν[client_id])`` (``None``: the mean embedding) and ``buffers`` as a ``w/`` message;
        ``use_shadow``: with θ_EMA (and ν_EMA) of the polyak EMA once it exists."""
        hnet: HyperNetwork = state["hnet"]
        params: dict[str, Tensor] = dict(hnet.named_parameters())
        if use_shadow and state["ema_shadow"] is not None:
            params.update(state["ema_shadow"])
        nu = params["embeddings.weight"]
        with torch.no_grad():
            emb = nu.mean(0) if client_id is None else nu[client_id]
            phi = torch.func.functional_call(hnet, params, (emb,))
        return {**{WEIGHT_PREFIX + n: t.numpy().copy() for n, t in phi.items()},
                **{WEIGHT_PREFIX + k: v for k, v in buffers.items()}}

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        """Algorithm 1, line 5: ``φ_i^{t,0} = h(θ^t, ν^t[i])`` plus the client's own buffers."""
        return self._weights(state, client_id, state["buffers"].get(client_id, state["init_buffers"]))

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """Δφ_i per trainable parameter of the target network."""
        return {DELTA_PREFIX + n: array_slot(*weights[WEIGHT_PREFIX + n]) for n, _ in model.named_parameters()}

    def keep(self, reply: Reply) -> Message:
        """The hypernetwork step needs every client's Δφ at once (GradAlign compares them): keep it all."""
        return reply.message

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        """Algorithm 1, lines 12–18 (VJP, GradAlign, optimiser step, EMA); metrics: GradAlign weights and
        cosines per client (Fig. 5a) and the norm of the aggregated θ gradient."""
        replies = acc.kept
        p = self.params
        hnet: HyperNetwork = state["hnet"]
        opt: torch.optim.Optimizer = state["opt"]
        t = int(state["t"])
        learned = p.embeddings == "learned"
        theta, nu = hnet.theta(), hnet.embeddings.weight

        # line 13: g_i = ∇h(θ, ν[i])ᵀ · (φ_init − φ_final), one VJP per client
        g_theta: list[list[Tensor]] = []
        g_nu: list[list[Tensor]] = []
        for r in replies:
            v = {n: -torch.from_numpy(np.asarray(r.message[DELTA_PREFIX + n])) for n in hnet.names}
            gt, gn = hypernetwork_vjp(hnet, r.client_id, v, wrt_embeddings=learned)
            g_theta.append(gt)
            if gn is not None:  # the ν gradient, only when the embeddings learn
                g_nu.append([gn])

        # lines 14–16: GradAlign weights, separately for θ and ν (the plain mean without it)
        last: dict[str, float] = {}
        grads = combine(self._align(g_theta, replies, "theta", last), g_theta)
        last["hn_grad_norm"] = float(torch.stack([torch.linalg.vector_norm(g) for g in grads]).norm())
        params: list[Tensor] = list(theta)
        if learned:
            grads += combine(self._align(g_nu, replies, "nu", last), g_nu)
            params.append(nu)
        del g_theta, g_nu

        # line 17: the server optimiser steps (Adam by default)
        smoothed = params if p.ema_embeddings else theta  # Alg. 1 line 18 smooths {θ, ν}; Alg. 4 θ only
        keep = p.ema and p.ema_mode == "box" and t > p.ema_warmup
        before = [q.detach().clone() for q in smoothed] if keep else None  # = θ_EMA^t, see _ema
        for q, g in zip(params, grads, strict=True):
            q.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)

        # line 18: EMA (Algorithm 4)
        shadow = state["ema_shadow"]
        if p.ema:
            shadow = self._ema(hnet, smoothed, t, before, shadow)

        # the privacy variant of Table 7: fresh random embeddings after every server update
        if p.embeddings == "random":
            gen = torch.Generator().manual_seed(derived_seed(state["seed"], t, 37, bits=31))
            with torch.no_grad():
                nu.copy_(torch.randn(nu.shape, generator=gen))

        buffers = state["buffers"]  # a per-client table (ServerContext.per_client): updated in place
        num_examples = dict(state["num_examples"])
        for r in replies:
            num_examples[r.client_id] = r.num_examples
            if state["init_buffers"]:
                buffers[r.client_id] = {k: np.asarray(r.message[WEIGHT_PREFIX + k]) for k in state["init_buffers"]}
        return {**state, "t": t + 1, "num_examples": num_examples, "ema_shadow": shadow}, last

    def _align(self, grads: list[list[Tensor]], replies: list[Reply], tag: str, last: dict[str, float]) -> list[float]:
        if not self.params.gradalign:
            return [1.0 / len(grads)] * len(grads)
        sign = 1.0 if self.params.gradalign_sign == "box" else -1.0
        weights, cos = gradalign(grads, sign)
        for r, w, c in zip(replies, weights.tolist(), cos.tolist(), strict=True):
            last[f"gradalign_{tag}/{r.client_id}"] = w
            last[f"cos_{tag}/{r.client_id}"] = c
        return weights.tolist()

    def _ema(self, hnet: HyperNetwork, smoothed: Sequence[Tensor], t: int, before: list[Tensor] | None,
             shadow: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        """Algorithm 4, tensor by tensor, on θ (and ν when ``ema_embeddings``).

        box: Algorithm 4 ends with ``θ ← θ_EMA``, so after every call θ *is* θ_EMA and the next
        call's ``θ_EMA^t`` is the pre-step θ (``before``): no copy is kept between rounds.
        polyak: θ_EMA is kept in the server state (by parameter name) and θ trains on unsmoothed.
        """
        p = self.params
        names = {id(q): n for n, q in hnet.named_parameters()}
        if p.ema_mode == "box":
            if before is not None:  # t > w; up to the warm-up round Algorithm 4 leaves θ as it is
                with torch.no_grad():
                    for q, prev in zip(smoothed, before, strict=True):
                        q.copy_(ema_step(q.detach(), prev, t, p.ema_warmup, p.ema_alpha)[0])
            return None
        new: dict[str, Tensor] = {}
        for q in smoothed:
            kept = None if shadow is None else shadow[names[id(q)]]
            _, s = ema_step(q.detach(), kept, t, p.ema_warmup, p.ema_alpha)
            if s is None:
                return None  # before the warm-up round there is no θ_EMA yet
            new[names[id(q)]] = s
        return new

    def eval_weights(self, state: ServerState, client_id: int | None = None) -> Message:
        """Client ``i``: ``h(θ, ν[i])`` with its buffers; ``None``: ``h(θ, mean_i ν[i])`` (Fig. 2c's
        single global model) with the ``num_examples``-weighted mean of the clients' buffers."""
        polyak = self.params.ema and self.params.ema_mode == "polyak"
        if client_id is not None:
            buffers = state["buffers"].get(client_id, state["init_buffers"])
            return self._weights(state, client_id, buffers, use_shadow=polyak)
        return self._weights(state, None, _mean_buffers(state), use_shadow=polyak)

    # --- one-time setup: auto-encoder embeddings (Appendix C.2) ---------------------------
    def setup_request(self, state: ServerState) -> Message | None:
        """The AE variant asks every client once for its mean latent; the AE seed makes the
        clients' auto-encoders identical at start (a "shared autoencoder")."""
        if self.params.embeddings != "autoencoder":
            return None
        return {"ae_seed": derived_seed(state["seed"], 41, bits=31), "latent_dim": state["hnet"].embed_dim}

    def setup_layout(self, model: nn.Module, request: Message, weights: Shapes) -> Layout:
        return {EMB_KEY: array_slot((int(request["latent_dim"]),), np.float32)}  # the client's mean latent

    def client_setup(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        """Train the Table-6 auto-encoder on ``ae_images`` local images; upload only their mean latent."""
        p = self.params
        order = torch.randperm(ctx.num_examples, generator=ctx.generator)[: p.ae_images].numpy()
        x, _ = ctx.dataset.get_batch(ctx.train_idx[np.sort(order)], train=False)
        batch = images(x)
        c, h, _ = batch.shape[1:]
        with torch.random.fork_rng():
            torch.manual_seed(int(msg["ae_seed"]))
            ae = EmbeddingAutoencoder(c, h, int(msg["latent_dim"]))
        latent = train_and_embed(ae, batch.float().cpu(), epochs=p.ae_epochs, lr=p.ae_lr,
                                 batch_size=ctx.batch_size, generator=ctx.generator)
        return {EMB_KEY: latent}, client_state

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        """ν[i] ← client i's mean latent (fixed from now on)."""
        nu = state["hnet"].embeddings.weight
        with torch.no_grad():
            for r in replies:
                nu[r.client_id].copy_(torch.from_numpy(np.asarray(r.message[EMB_KEY], dtype=np.float32)))
        return state

    # --- client half ----------------------------------------------------------------------
    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        """Algorithm 1, lines 6–9 with Algorithm 2: train E epochs from φ_i^{t,0}, reply Δφ_i."""
        load_weights(model, msg)
        start = {n: q.detach().clone() for n, q in model.named_parameters()}
        loss = train_local(model, ctx, lr=float(msg["lr"]))
        reply: Message = {DELTA_PREFIX + n: (q.detach() - start[n]).cpu().numpy() for n, q in model.named_parameters()}
        state = model.state_dict()
        reply.update({WEIGHT_PREFIX + k: state[k].detach().cpu().numpy().copy() for k in buffer_names(model)})
        return {**reply, "num_examples": ctx.num_examples, "train_loss": loss}, client_state


def _mean_buffers(state: ServerState) -> dict[str, np.ndarray]:
    """``num_examples``-weighted mean of the clients' buffers (the initial ones before round 1)."""
    have = list(state["buffers"])
    if not state["init_buffers"] or not have:
        return dict(state["init_buffers"])
    mean = WeightedSum("", sum(state["num_examples"][c] for c in have))  # one client's buffers at a time
    for c in have:
        mean.add(state["buffers"][c], state["num_examples"][c])
    return mean.mean()
