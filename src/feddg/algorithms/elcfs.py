"""FedDG-ELCFS (Liu, Chen, Qin, Dou, Heng, "FedDG: Federated Domain Generalization on Medical Image Segmentation via
Episodic Learning in Continuous Frequency Space", CVPR 2021; authors' code ``liuquande/FedDG-ELCFS``:
``train_ELCFS.py``, ``dataloaders/prepare_dataset.py``, ``freq_space_interpolation_demo.py``).

**Distribution bank** (§3.2; setup exchange, once). Client ``k`` uploads the amplitude spectra ``A(x) = |F(x)|`` of
``M_k = max(1, ⌊n_k · bank_fraction⌋)`` of its training images, drawn at random (the code samples ``⌊n/8⌋`` of
each client's spectra) — only their low-frequency window, the one part that enters the interpolation. The server
keeps the bank and sends every client the rows of the *other* clients in each round.

**Continuous frequency space interpolation** (§3.2). For a local image ``x`` (amplitude ``A``, phase ``P``), an
amplitude ``A_n`` of another client (a client drawn uniformly, then one of its spectra) and ``λ ~ U(λ_min, λ_max)``::

    A^{k→n} = [(1 − λ) A + λ A_n] ∘ M + A ∘ (1 − M)          x^{k→n} = Re F⁻¹(A^{k→n} ∘ e^{iP})

``M`` the ``(2b+1)²`` window around the zero frequency, ``b = ⌊min(H, W)·window⌋`` (``harmofl.mix_low_frequency``).

**Episodic learning** (§3.3), per batch, first order as the code (``autograd.grad`` without ``create_graph``)::

    L_inn(θ) = L_seg(x; θ)             θ' = θ − β · clip(∇_θ L_inn, ±c)
    L_out(θ') = L_seg(x^{k→n}; θ') + γ L_bd          minimise L_inn(θ) + L_out(θ')

``L_seg`` is the task's loss (``ctx.task.loss``; the code uses Dice). ``β = 1e−3``, ``c = 100``, ``γ = 0.1``.

**Boundary-oriented contrastive loss** (§3.4). Per foreground class, the boundary region of a mask ``m`` is
``m − erode(m)`` and its background region ``dilate(m) − m`` (4-connected, 1 and 5 iterations, outside the image
counts as background: the code's ``scipy.ndimage`` calls). On the last feature map before the head, ``f`` (``[B, C,
h, w]``), each region gives one embedding ``h = Σ_u r(u) f(u) / Σ_u r(u)`` per image; the raw images' (with ``θ``)
and the transformed images' (with ``θ'``) boundary embeddings are one class, their background embeddings the other.
With cosine similarities ``s`` and temperature ``τ = 0.05`` (``pytorch_metric_learning``'s ``NTXentLoss``)::

    L_bd = mean over ordered pairs (a, p) of the same class, a ≠ p, of
           −log( e^{s_ap/τ} / (e^{s_ap/τ} + Σ_{n of the other class} e^{s_an/τ}) )

summed over the foreground classes. ``denominator: all`` puts every other embedding in the denominator (SimCLR's
form). ``docs/methods/elcfs.md``.
"""

from __future__ import annotations

import time
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn
from torch.func import functional_call

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
from feddg.algorithms.harmofl import amplitude_window, low_freq_radius, mix_low_frequency
from feddg.devices import images
from feddg.messages import Layout, Message, Shapes, array_slot, load_weights
from feddg.models.base import FedModel
from feddg.tasks import DENSE_MASKS, IMAGES

AMP_BANK = "amp/bank"  # setup reply: [M, C, 2b+1, 2b+1]
BANK_AMP, BANK_OWNER = "bank/amp", "bank/owner"  # round message: the other clients' rows and who sent them


class ELCFSParams(Params):
    window: float = Field(0.003, ge=0.0, lt=0.5, description="low-frequency window ratio L: b = ⌊min(H, W)·L⌋ "
                                                              "(demo 0.003; train_ELCFS.py 0: DC only)")
    lam_min: float = Field(0.0, ge=0.0, le=1.0, description="λ ~ U(lam_min, lam_max) (paper: [0, 1])")
    lam_max: float = Field(1.0, ge=0.0, le=1.0, description="train_ELCFS.py: lam_min = lam_max = 1 (replacement)")
    bank_fraction: float = Field(0.125, gt=0.0, le=1.0, description="share of a client's images whose spectra it "
                                                                    "uploads (code: ⌊n/8⌋)")
    meta_lr: float = Field(1e-3, ge=0.0, description="β: inner step size (code meta_step_size)")
    inner_clip: float = Field(100.0, gt=0.0, description="c: the inner gradient is clamped to ±c (code clip_value)")
    boundary_weight: float = Field(0.1, ge=0.0, description="γ of the boundary loss (code: 0.1)")
    temperature: float = Field(0.05, gt=0.0, description="τ of the contrastive loss (code: 0.05)")
    boundary_width: int = Field(1, ge=1, description="erosion iterations of the boundary region (code: 1)")
    background_width: int = Field(5, ge=1, description="dilation iterations of the background region (code: 5)")
    denominator: Literal["negatives", "all"] = Field(
        "negatives", description="contrastive denominator: the positive + the anchor's negatives (code, NTXentLoss) "
                                 "or every other embedding (SimCLR)")
    second_order: bool = Field(False, description="differentiate through the inner step (code: first order)")
    dp: StatisticDP | None = Field(None, description="clip + Gaussian noise on the uploaded spectra (docs/privacy.md)")

    @model_validator(mode="after")
    def _lam_range(self) -> ELCFSParams:
        if self.lam_min > self.lam_max:
            raise ValueError(f"lam_min {self.lam_min} > lam_max {self.lam_max}")
        return self


# --------------------------------------------------------------------------- interpolation draws


def draw_rows(owners: np.ndarray, count: int, generator: torch.Generator | None = None) -> Tensor:
    """For each of ``count`` images, one bank row: a client drawn uniformly among ``owners``, then one of its rows
    uniformly (the code: ``np.random.choice`` of a site, then of one of its spectra)."""
    owners = np.asarray(owners)
    clients = np.unique(owners)
    pick = torch.randint(len(clients), (count,), generator=generator).numpy()
    rows = []
    for c in clients[pick]:
        mine = np.flatnonzero(owners == c)
        rows.append(int(mine[int(torch.randint(len(mine), (), generator=generator))]))
    return torch.as_tensor(rows, dtype=torch.long)


def interpolation_ratios(count: int, lo: float, hi: float, generator: torch.Generator | None = None) -> Tensor:
    """``λ ~ U(lo, hi)``, one per image."""
    return lo + (hi - lo) * torch.rand(count, generator=generator)


# --------------------------------------------------------------------------- boundary regions and loss

_CROSS = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])


def _cross_count(m: Tensor) -> Tensor:
    """How many of each pixel's 4-neighbourhood and itself are set (outside the image: unset)."""
    kernel = _CROSS.to(m.device)[None, None]
    return F.conv2d(F.pad(m[:, None].float(), (1, 1, 1, 1)), kernel)[:, 0]


def erode(mask: Tensor, iterations: int = 1) -> Tensor:
    """Binary erosion with the 4-connected cross, outside the image unset (``scipy.ndimage.binary_erosion``)."""
    m = mask.bool()
    for _ in range(iterations):
        m = _cross_count(m) > 4.5
    return m


def dilate(mask: Tensor, iterations: int = 1) -> Tensor:
    """Binary dilation with the 4-connected cross (``scipy.ndimage.binary_dilation``)."""
    m = mask.bool()
    for _ in range(iterations):
        m = _cross_count(m) > 0.5
    return m


def boundary_regions(mask: Tensor, boundary_width: int = 1, background_width: int = 5) -> tuple[Tensor, Tensor]:
    """``(m − erode(m), dilate(m) − m)`` of binary masks ``[B, H, W]`` (the code's ``_get_coutour_sample``)."""
    m = mask.bool()
    return m & ~erode(m, boundary_width), dilate(m, background_width) & ~m


def region_embeddings(features: Tensor, region: Tensor) -> tuple[Tensor, Tensor]:
    """``h = Σ_u r(u) f(u) / Σ_u r(u)`` per image (``[B', C]``) for the images whose region is not empty, and that
    selection (``[B]``). A region at another resolution than ``f`` is resized (nearest) first."""
    r = region[:, None].to(features.dtype)
    if r.shape[-2:] != features.shape[-2:]:
        r = F.interpolate(r, size=features.shape[-2:], mode="nearest")
    area = r.sum(dim=(-2, -1))[:, 0]
    keep = area > 0
    emb = (r * features).sum(dim=(-2, -1))[keep] / area[keep, None]
    return emb, keep


def contrastive_loss(h: Tensor, labels: Tensor, temperature: float,
                     denominator: Literal["negatives", "all"] = "negatives") -> Tensor:
    """The NT-Xent loss over the ordered positive pairs ``(a, p)`` (same label, ``a ≠ p``), cosine similarities:
    ``−log(e^{s_ap/τ} / (e^{s_ap/τ} + Σ_{n: other label} e^{s_an/τ}))`` (``negatives``, pytorch_metric_learning's
    ``NTXentLoss``) or ``−log(e^{s_ap/τ} / Σ_{q ≠ a} e^{s_aq/τ})`` (``all``); their mean, 0 without a positive pair."""
    z = F.normalize(h.float(), dim=1)
    s = z @ z.T / temperature
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool, device=h.device)
    pos = same & ~eye
    if not bool(pos.any()):
        return h.sum() * 0.0
    others = ~same if denominator == "negatives" else ~eye
    # an excluded entry counts as e^{-huge} = 0 (finite, so an anchor without negatives has no NaN gradient)
    lse = torch.logsumexp(s.masked_fill(~others, torch.finfo(s.dtype).min), dim=1, keepdim=True)
    if denominator == "negatives":
        lse = torch.logaddexp(s, lse.expand_as(s))  # the positive itself joins its anchor's negatives
    return (lse - s)[pos].mean()


def boundary_loss(f_raw: Tensor, f_trans: Tensor, target: Tensor, num_classes: int, params: ELCFSParams) -> Tensor:
    """``L_bd`` summed over the foreground classes: boundary vs background embeddings of the raw (``f_raw``) and the
    transformed (``f_trans``) images."""
    total = f_raw.sum() * 0.0
    for c in range(1, num_classes):
        bd, bg = boundary_regions(target == c, params.boundary_width, params.background_width)
        parts = [region_embeddings(f, r)[0] for r in (bd, bg) for f in (f_raw, f_trans)]
        h = torch.cat(parts)
        labels = torch.cat([torch.full((len(p),), int(i < 2), device=h.device) for i, p in enumerate(parts)])
        total = total + contrastive_loss(h, labels, params.temperature, params.denominator)
    return total


class _FeaturesAndOutput(nn.Module):
    """``x -> (features(x), classifier(features(x)))`` of a zoo model, for a forward pass with other weights."""

    def __init__(self, net: FedModel) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        f = self.net.features(x)
        return f, self.net.classifier(f)


# --------------------------------------------------------------------------- the method


class ELCFS(Method):
    """Episodic learning in continuous frequency space: a shared amplitude bank, a meta step on interpolated images,
    a boundary-oriented contrastive loss; FedAvg."""

    name = "elcfs"
    Params = ELCFSParams
    params: ELCFSParams
    search_space = {"boundary_weight": [0.0, 0.1, 0.5], "window": [0.0, 0.003, 0.01], "meta_lr": [1e-4, 1e-3, 1e-2]}
    requires = frozenset({IMAGES, DENSE_MASKS})  # Fourier amplitudes of images; boundaries of masks
    takes_soft_targets = False  # the boundary regions come from hard masks

    # --- setup exchange ------------------------------------------------------------------
    def setup_request(self, state: ServerState) -> Message | None:
        state["setup_started"] = time.perf_counter()
        return {"amp/window": self.params.window}

    def setup_layout(self, model: nn.Module, request: Message, weights: Shapes) -> Layout:
        return {AMP_BANK: array_slot((-1, -1, -1, -1), np.float32)}  # [M, C, 2b+1, 2b+1]

    def client_setup(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        """The client's share of the bank: the amplitude windows ``[M, C, 2b+1, 2b+1]`` of ``M`` random images."""
        n = ctx.num_examples
        m = max(1, int(n * self.params.bank_fraction))
        pick = ctx.train_idx[torch.randperm(n, generator=ctx.generator)[:m].numpy()]
        rows = []
        for start in range(0, m, ctx.batch_size):
            x, _ = ctx.dataset.get_batch(pick[start : start + ctx.batch_size], train=False)
            x = images(x)
            b = low_freq_radius(x.shape[-2], x.shape[-1], float(msg["amp/window"]))
            rows.append(amplitude_window(x, b))
        bank = {AMP_BANK: torch.cat(rows).numpy().astype(np.float32)}
        if (dp := self.params.dp) is not None:  # one release: the whole bank clipped as one vector, noised; A ≥ 0 after
            bank = privatize(bank, dp.clip, dp.sigma(), ctx.noise)  # (but the signed Σx at the centre)
            centre = bank[AMP_BANK][..., b, b].copy()
            bank[AMP_BANK] = np.maximum(bank[AMP_BANK], 0.0)
            bank[AMP_BANK][..., b, b] = centre
        reply: Message = {**bank}
        return reply, client_state

    def privacy(self, rounds_done: int) -> dict[str, Any] | None:
        """The spectra are released once, in the setup exchange."""
        return statistic_privacy(self.params.dp, 1) if self.params.dp is not None else None

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        """The distribution bank: every client's rows, tagged with their owner."""
        amps = [np.asarray(r.message[AMP_BANK]) for r in replies]
        owners = np.concatenate([np.full(len(a), r.client_id, dtype=np.int64) for a, r in zip(amps, replies,
                                                                                                strict=True)])
        started = state.pop("setup_started", None)
        return {**state, "bank": (np.concatenate(amps), owners),
                "time_bank_setup_s": time.perf_counter() - started if started is not None else float("nan")}

    # --- rounds --------------------------------------------------------------------------
    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        """The global weights and the bank without the client's own spectra."""
        amps, owners = state["bank"]
        others = owners != client_id
        return {**state["weights"], BANK_AMP: amps[others], BANK_OWNER: owners[others]}

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        """FedAvg; the metrics repeat the one-time bank setup (its cost and size)."""
        state, _ = super().finish(state, acc)
        if "bank" not in state:
            return state, {}
        return state, {"time_bank_setup_s": float(state["time_bank_setup_s"]),
                       "bank_spectra": float(len(state["bank"][1]))}

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        p = self.params
        bank = torch.as_tensor(np.asarray(msg[BANK_AMP]))
        owners = np.asarray(msg[BANK_OWNER])
        split = _FeaturesAndOutput(cast(FedModel, model))  # a zoo model: classifier(features(x))
        model.train()
        opt = make_optimizer(model.parameters(), ctx.optim, float(msg["lr"]))
        scaler = grad_scaler(ctx)
        named = [(n, w) for n, w in model.named_parameters() if w.requires_grad]
        total, steps = 0.0, 0
        for _, inputs, y in local_batches(model, ctx):
            x = images(inputs)
            x_trans = self.transform(x, bank, owners, ctx.generator)
            opt.zero_grad(set_to_none=True)
            with ctx.autocast():
                f_raw, out_raw = split(x)
                loss_inner = ctx.task.loss(out_raw, y)
            # the inner gradient is unscaled (under fp16 only the outer step goes through the loss scaler)
            grads = torch.autograd.grad(loss_inner, [w for _, w in named], retain_graph=True,
                                        create_graph=p.second_order, allow_unused=True)
            fast = {f"net.{n}": w if g is None else w - p.meta_lr * g.clamp(-p.inner_clip, p.inner_clip)
                    for (n, w), g in zip(named, grads, strict=True)}
            with ctx.autocast():
                f_trans, out_trans = functional_call(split, fast, (x_trans,))
                loss_outer = ctx.task.loss(out_trans, y)
                if p.boundary_weight > 0:
                    loss_outer = loss_outer + p.boundary_weight * boundary_loss(
                        f_raw, f_trans, y, ctx.task.num_classes, p)
                loss = loss_inner + loss_outer
            scaled_step(loss, opt, scaler, clip=ctx.optim.grad_clip)
            total += float(loss.detach())
            steps += 1
        return weights_reply(model, ctx.num_examples, total / max(steps, 1)), client_state

    def transform(self, x: Tensor, bank: Tensor, owners: np.ndarray, generator: torch.Generator | None) -> Tensor:
        """``x^{k→n}``: each image's low-frequency amplitude interpolated with a drawn bank row by a drawn ``λ``
        (without gradient); the images as they are when the bank holds no other client's spectra."""
        if len(bank) == 0:
            return x
        b = low_freq_radius(x.shape[-2], x.shape[-1], self.params.window)
        if bank.shape[-1] != 2 * b + 1:
            raise ValueError(f"elcfs: the bank's windows are {bank.shape[-1]} wide, these images need {2 * b + 1}")
        rows = draw_rows(owners, len(x), generator)
        lam = interpolation_ratios(len(x), self.params.lam_min, self.params.lam_max, generator)
        with torch.no_grad():
            return mix_low_frequency(x, bank[rows].to(x.device), lam.to(x.device), b)
