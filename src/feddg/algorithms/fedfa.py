"""FedFA^l and FedFA+ (Zhou & Konukoglu, "FedFA: Federated Feature Augmentation", ICLR 2023, and its
journal extension FedFA+): FFA layers after the conv stages (§3.2, Algorithms 1–2) and, with
``lambda_h > 0``, soft-histogram alignment at the last stage (§3.3, eqs. 11–14; loss eq. 15).

Messages (see docs/methods/fedfa.md for the privacy audit):

* client → server: ``w/…``, ``num_examples``, ``train_loss``; ``stat/<k>/mu_bar``, ``stat/<k>/sigma_bar``
  (eq. 5, per FFA stage k; variants full and direct); ``hist/pi`` (eq. 11, ``[C, L]``, when
  ``lambda_h > 0``); ``align_loss`` (mean eq. 14 over the local batches, when alignment ran).
* server → client: ``w/…``; ``ffa/<k>/gamma_mu``, ``ffa/<k>/gamma_sigma`` (eq. 7, variant full) or
  ``ffa/<k>/var_mu``, ``ffa/<k>/var_sigma`` (eq. 6, variant direct); ``hist/pi`` (the average π).
* client state: ``ffa/<k>/mu_bar``, ``ffa/<k>/sigma_bar``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from feddg.aggregation.accounting import statistic_privacy
from feddg.aggregation.dp import StatisticDP, privatize
from feddg.aggregation.fedfa_stats import add_noise, client_sharing_variance, t_modulation
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
from feddg.algorithms.components.ffa import FFAAttachment, FFALayer, Variant, attach_ffa
from feddg.algorithms.components.local import train_local
from feddg.algorithms.components.soft_histogram import CutPoints, KLReduction, soft_histogram, symmetric_kl
from feddg.devices import Inputs
from feddg.messages import (
    WEIGHT_PREFIX,
    Layout,
    Message,
    Shapes,
    Value,
    array_slot,
    entries,
    like_slot,
    load_weights,
    message_nbytes,
    number_slot,
    weights_of,
)
from feddg.tasks import CONV_STAGES

STAT, FFA, HIST = "stat/", "ffa/", "hist/"
BYTES = "nbytes/"  # server side only: a kept reply's payload sizes, by prefix
HIST_KEY = "hist/pi"


class FedFAParams(Params):
    variant: Variant = Field("full", description="full (eq. 8) | random (FedFA-R) | client (FedFA-C) | direct")
    lambda_h: float = Field(0.1, ge=0.0, description="eq. 15 weight of the alignment loss; 0 is FedFA^l")
    layers: list[int] | None = Field(None, description="1-based conv stages with an FFA layer (Table 12); default all")
    stages: list[str] | None = Field(None, description="module names ending the conv stages (default conv_stages)")
    last_stage: bool = Field(
        True, description="an FFA layer after the last conv stage too (Fig. 1, Table 12's {1..5}); before global "
        "average pooling it makes the pooled embedding μ + ε Σ̂_μ (docs/methods/fedfa.md)"
    )
    p: float = Field(0.5, ge=0.0, le=1.0, description="probability that an FFA layer is active in a training step")
    momentum: float = Field(0.99, ge=0.0, le=1.0, description="α of eq. 5")
    random_std: float = Field(0.5, ge=0.0, description="FedFA-R's fixed Σ̂ for every channel")
    reset_stats: bool = Field(False, description="re-initialise μ̄=0, σ̄=1 every round (Algorithm 1, line 3)")
    stat_noise: float = Field(0.0, ge=0.0, description="std of Gaussian noise on the uploaded μ̄, σ̄ (§6.2)")
    bins: int = Field(8, ge=3, description="L, bins per channel (eq. 12)")
    tau: float = Field(0.01, gt=0.0, description="soft-binning temperature τ (eq. 12)")
    cut_points: CutPoints = Field("paper", description="paper: ρ = [0..L−2]/(L−2); interior: ρ_l = l/L")
    kl_reduction: KLReduction = Field("mean", description="eq. 14 over channels: mean or sum")
    hist_samples: Literal["pooled", "spatial"] = Field(
        "pooled", description="a histogram sample is a spatially averaged feature (pooled) or one position (spatial)"
    )
    hist_weighting: Literal["uniform", "num_examples"] = Field("uniform", description="server average of π_m")
    dp: StatisticDP | None = Field(None, description="clip + Gaussian noise on uploaded stat/, hist/ (docs/privacy.md)")

    @model_validator(mode="after")
    def _dp_needs_a_statistic(self) -> FedFAParams:
        if self.dp is not None and self.variant not in ("full", "direct") and self.lambda_h == 0:
            raise ValueError(f"dp: variant {self.variant} with lambda_h=0 uploads no statistic to privatise")
        return self


def _tensor(value: Value) -> Tensor:
    return torch.from_numpy(np.asarray(value, dtype=np.float32))


def _nbytes(msg: Message, prefix: str) -> int:
    return message_nbytes(entries(msg, prefix))


class FedFA(Method):
    """FedFA^l (``lambda_h=0``) / FedFA+ (``lambda_h=0.1``) and the ablation variants; FedAvg weights."""

    name = "fedfa"
    Params = FedFAParams
    # λ: FedFA paper Fig. 7; p and momentum α: within Fig. 5's ranges (its text names p 0.1-0.5, α 0-0.99)
    search_space = {"lambda_h": [0.0, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5, 1.0, 10.0],
                    "p": [0.1, 0.3, 0.5, 0.7], "momentum": [0.0, 0.9, 0.99]}
    params: FedFAParams

    @classmethod
    def requirements(cls, params: Any) -> frozenset[str]:
        """FFA layers act on [B, C, H, W] feature maps: the model's conv stages, unless ``stages`` names modules."""
        assert isinstance(params, FedFAParams)
        return frozenset({CONV_STAGES}) if params.stages is None else frozenset()

    # --- model ---------------------------------------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        from feddg.models.stages import conv_stages  # models sit beside algorithms, imported on use

        hp = self.params
        names = list(hp.stages) if hp.stages is not None else conv_stages(model)
        chosen = sorted(set(hp.layers)) if hp.layers is not None else list(range(1, len(names) + 1))
        if not hp.last_stage:
            chosen = [k for k in chosen if k != len(names)]
        layers = {k: FFALayer(hp.variant, hp.p, hp.momentum, hp.random_std) for k in chosen}
        attach_ffa(model, names, layers, tap_stage=len(names))
        return model

    @staticmethod
    def attachment(model: nn.Module) -> FFAAttachment:
        att = getattr(model, "fedfa", None)
        if not isinstance(att, FFAAttachment):
            raise TypeError("the model has no FFA layers: build it with FedFA.prepare_model")
        return att

    @property
    def uploads_stats(self) -> bool:
        return self.params.variant in ("full", "direct")

    @property
    def aligns(self) -> bool:
        return self.params.lambda_h > 0

    # --- server --------------------------------------------------------------------------
    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        """The weights and empty tables; with the dataset's example input, the stages' channels that the first
        round's statistics must have (:meth:`reply_layout`)."""
        if ctx.example is not None:
            att = self.attachment(model)
            att.expected_channels = att.stage_channels(model, ctx.example)
        return {"weights": weights_of(model), "stats": ctx.per_client("stats"), "hists": {}, "broadcast": {}}

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        return {**state["weights"], **state["broadcast"]}

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """The FFA statistics ``stat/<k>/{mu,sigma}_bar`` and, when aligning, the histogram π_m and the alignment
        loss, each float32 and shaped as the modulation or average histogram sent; before any was sent (the first
        round), as the stages' channels measured in :meth:`server_init` (``[C_k]``, ``[C_tap, L]``): a reply of
        other shapes would crash eq. 6's stack or be broadcast into it. Unchecked only where the server had no
        example input to measure them (a hand-built ``ServerContext``)."""
        att = self.attachment(model)
        channels = att.expected_channels
        layout: Layout = {}
        if self.uploads_stats:
            sent_stats = {f"{STAT}{key[len(FFA):].rsplit('/', 1)[0]}/{'mu' if key.endswith('_mu') else 'sigma'}_bar":
                          like_slot(v) for key, v in sent.items() if key.startswith(FFA)}  # ffa/<k>/gamma_mu etc.
            if not sent_stats and channels is not None:
                sent_stats = {f"{STAT}{k}/{which}_bar": array_slot((channels[k],), np.float32)
                              for k, _ in att.items() for which in ("mu", "sigma")}
            layout.update(sent_stats or {STAT: array_slot(None, np.float32)})
        if self.aligns:
            if HIST_KEY in sent:
                hist = like_slot(sent[HIST_KEY])
            elif channels is not None:
                hist = array_slot((channels[att.tap_stage], self.params.bins), np.float32)
            else:
                hist = array_slot(None, np.float32)
            layout.update({HIST_KEY: hist, "align_loss": number_slot(required=False)})
        return layout

    def keep(self, reply: Reply) -> Message:
        """The small payloads (statistics, histogram, alignment loss) and the byte counts of each reply."""
        msg = reply.message
        kept: Message = {k: v for k, v in msg.items() if k.startswith((STAT, HIST)) or k == "align_loss"}
        kept.update({f"{BYTES}{p}": _nbytes(msg, p) for p in (WEIGHT_PREFIX, STAT, HIST)})
        return {**kept, "num_examples": reply.num_examples}

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        state, _ = super().finish(state, acc)  # FedAvg of the w/ arrays
        replies = acc.kept
        stats = state["stats"]  # latest statistics of every client seen so far (ServerContext.per_client: in place)
        if self.uploads_stats:
            stats.update({r.client_id: self._subset(r.message, STAT) for r in replies})
        hists = dict(state["hists"])
        for r in replies:
            if HIST_KEY in r.message:
                hists[r.client_id] = (np.asarray(r.message[HIST_KEY]), r.num_examples)
        broadcast = {**self._modulations(stats), **self._global_histogram(hists)}
        metrics = self._byte_metrics(state["broadcast"], replies)
        losses = [float(r.message["align_loss"]) for r in replies if "align_loss" in r.message]
        if losses:
            metrics["fedfa/align_loss"] = float(np.mean(losses))
        return {**state, "stats": stats, "hists": hists, "broadcast": broadcast}, metrics

    @staticmethod
    def _subset(msg: Message, prefix: str) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in entries(msg, prefix).items()}

    def _modulations(self, stats: Mapping[int, Message]) -> Message:
        """Eqs. 6–7 per FFA stage over the latest statistics of every client seen so far."""
        clients = list(stats.values())  # each client's statistics read once
        if not clients:
            return {}
        keys = sorted({k for s in clients for k in s})
        out: Message = {}
        for key in keys:
            _, layer, which = key.split("/")  # stat/<k>/mu_bar
            var = client_sharing_variance([np.asarray(s[key]) for s in clients if key in s])  # eq. 6
            name = "mu" if which == "mu_bar" else "sigma"
            if self.params.variant == "full":
                out[f"{FFA}{layer}/gamma_{name}"] = t_modulation(var).astype(np.float32)  # eq. 7
            else:  # direct fusion (Table 11): the raw client-sharing variance
                out[f"{FFA}{layer}/var_{name}"] = var.astype(np.float32)
        return out

    def _global_histogram(self, hists: dict[int, tuple[np.ndarray, int]]) -> Message:
        """§3.3.2: π = (1/M) Σ_m π_m (``hist_weighting=num_examples``: weighted by N_m)."""
        if not hists:
            return {}
        arrays = np.stack([h for h, _ in hists.values()]).astype(np.float64)
        w = np.array([n for _, n in hists.values()], dtype=np.float64)
        if self.params.hist_weighting == "uniform":
            w = np.ones_like(w)
        return {HIST_KEY: np.tensordot(w / w.sum(), arrays, axes=1).astype(np.float32)}

    @staticmethod
    def _byte_metrics(sent: Message, replies: list[Reply]) -> dict[str, float]:
        """Per-client bytes this round: FedFA's extra payloads next to the weights (§6.1)."""
        n = len(replies)
        up_w, up_s, up_h = (sum(int(r.message[f"{BYTES}{p}"]) for r in replies) / n for p in (WEIGHT_PREFIX, STAT, HIST))
        down_s, down_h = _nbytes(sent, FFA), _nbytes(sent, HIST)
        return {
            "fedfa/bytes_weights_up": up_w,
            "fedfa/bytes_stats_up": up_s,
            "fedfa/bytes_stats_down": float(down_s),
            "fedfa/bytes_hist_up": up_h,
            "fedfa/bytes_hist_down": float(down_h),
            "fedfa/bytes_extra": up_s + down_s + up_h + down_h,
        }

    # --- client --------------------------------------------------------------------------
    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        hp = self.params
        load_weights(model, msg)
        att = self.attachment(model)
        self._load_ffa(att, {} if hp.reset_stats else client_state, msg, ctx.device)
        pi = _tensor(msg[HIST_KEY]).to(ctx.device) if self.aligns and HIST_KEY in msg else None
        align_losses: list[float] = []

        def loss_fn(m: nn.Module, x: Inputs, y: Tensor) -> Tensor:
            loss = ctx.task.loss(m(x), y)
            if pi is None:
                return loss
            align = symmetric_kl(self._histogram(self._samples(att.tap.features)), pi, hp.kl_reduction)  # eq. 14
            align_losses.append(float(align.detach()))
            return loss + hp.lambda_h * align  # eq. 15

        att.tap.recording = pi is not None
        try:
            loss = train_local(model, ctx, lr=float(msg["lr"]), loss_fn=loss_fn)
        finally:
            att.tap.recording = False
        reply: Message = weights_reply(model, ctx.num_examples, loss)
        new_state = self._ffa_state(att)
        if self.uploads_stats:
            seed = int(torch.randint(2**62, (1,), generator=ctx.generator)) if hp.stat_noise > 0 else 0
            rng = np.random.default_rng(seed)
            reply.update({STAT + k[len(FFA) :]: add_noise(np.asarray(v), hp.stat_noise, rng) for k, v in new_state.items()})
        if self.aligns:
            reply[HIST_KEY] = self.local_histogram(model, ctx)
        if hp.dp is not None:  # after every statistic is computed: the noise stream's next draws
            for prefix in (STAT, HIST):  # the statistics and the histogram are arrays
                group = {k: np.asarray(v) for k, v in entries(reply, prefix).items()}
                reply.update(privatize(group, hp.dp.clip, hp.dp.sigma(), ctx.noise) if group else {})
        if align_losses:
            reply["align_loss"] = float(np.mean(align_losses))
        att.tap.features = None
        return reply, new_state

    def privacy(self, rounds_done: int) -> dict[str, Any] | None:
        """One release per round of each uploaded group (``stat/``, ``hist/``), each clipped as one vector."""
        if self.params.dp is None:
            return None
        return statistic_privacy(self.params.dp, rounds_done * (int(self.uploads_stats) + int(self.aligns)))

    def _load_ffa(self, att: FFAAttachment, client_state: ClientState, msg: Message, device: torch.device) -> None:
        """Client state μ̄, σ̄ and the server's modulation into the (shared) model's FFA layers."""
        for k, layer in att.items():
            layer.reset()
            if f"{FFA}{k}/mu_bar" in client_state:
                layer.mu_bar = _tensor(client_state[f"{FFA}{k}/mu_bar"])
                layer.sigma_bar = _tensor(client_state[f"{FFA}{k}/sigma_bar"])
            tag = "gamma" if self.params.variant == "full" else "var"
            if f"{FFA}{k}/{tag}_mu" in msg:
                layer.modulation_mu = _tensor(msg[f"{FFA}{k}/{tag}_mu"])
                layer.modulation_sigma = _tensor(msg[f"{FFA}{k}/{tag}_sigma"])
            layer.to(device)

    @staticmethod
    def _ffa_state(att: FFAAttachment) -> ClientState:
        state: ClientState = {}
        for k, layer in att.items():
            if layer.mu_bar is not None and layer.sigma_bar is not None:
                state[f"{FFA}{k}/mu_bar"] = layer.mu_bar.detach().cpu().numpy().astype(np.float32)
                state[f"{FFA}{k}/sigma_bar"] = layer.sigma_bar.detach().cpu().numpy().astype(np.float32)
        return state

    def _samples(self, features: Tensor | None) -> Tensor:
        """Stage output ``[B, C, H, W]`` → histogram samples ``[N, C]`` (pooled: N=B, spatial: N=B·H·W)."""
        if features is None:
            raise RuntimeError("no features were recorded at the alignment stage")
        if features.dim() == 2:
            return features
        if self.params.hist_samples == "pooled":
            return features.mean(dim=(2, 3))
        return features.transpose(0, 1).flatten(1).T

    def _histogram(self, samples: Tensor) -> Tensor:
        hp = self.params
        return soft_histogram(samples, hp.bins, hp.tau, hp.cut_points)

    @torch.no_grad()
    def local_histogram(self, model: nn.Module, ctx: ClientContext) -> np.ndarray:
        """Eq. 11: π_m over the client's whole training set with the trained model (eval mode, no FFA)."""
        att = self.attachment(model)
        model.eval()
        att.tap.recording = True
        try:
            samples = []
            for x, _ in ctx.batches(shuffle=False, train=False):
                model(x)
                samples.append(self._samples(att.tap.features))
        finally:
            att.tap.recording = False
            att.tap.features = None
        return self._histogram(torch.cat(samples)).cpu().numpy().astype(np.float32)
