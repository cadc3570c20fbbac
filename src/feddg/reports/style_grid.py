"""PARDON's Fig. 8 for a PARDON or CCST run: original vs PARDON-stylised vs CCST-stylised samples.

An offline analysis with the experimenter's copy of the data (nothing here crosses between
clients and server): the run's federation is rebuilt from its config.yaml — the same initial
model, partition and seeds — and both setup exchanges are replayed, so the PARDON row uses the
run's global interpolation style and the CCST row the overall style of another client. Images
are shown on the value range of the originals; on the ``feature`` path, whose stylised samples
are feature maps, the channel mean of ``E(x)`` and of ``x̃`` is shown instead (min-max per tile).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from feddg.algorithms import Method, Reply, ServerContext, create_method
from feddg.algorithms.base import ServerState
from feddg.algorithms.ccst import CCSTParams
from feddg.algorithms.components.style import StyleCodec, StyleParams, make_codec
from feddg.algorithms.pardon import PardonParams
from feddg.config import build_config, read_yaml
from feddg.devices import images
from feddg.federation.client import client_context
from feddg.federation.client_store import open_checkpoint
from feddg.federation.setup import Federation, build_federation
from feddg.messages import Message

STYLE_METHODS = ("pardon", "ccst")
GRID = "styles.png"


def replay_setup(
    fed: Federation, method: Method, clients: list[int] | None = None
) -> tuple[ServerState, list[Reply], list[Message]]:
    """``method``'s setup exchange with ``clients`` (default: all, then ``server_setup`` runs too).

    Returns the server state (after ``server_setup`` only when every client took part), the
    replies and the client states, in the order of ``clients``.
    """
    cfg = fed.cfg
    state = method.server_init(fed.model, ServerContext(len(fed.clients), cfg.federation.rounds, cfg.seed))
    request = method.setup_request(state)
    assert request is not None, f"{method.name} has no setup exchange"
    ids = list(range(len(fed.clients))) if clients is None else clients
    replies, states = [], []
    logging.disable(logging.WARNING)  # the run's log already names the style path
    try:
        for cid in ids:
            reply, cstate = method.client_setup(fed.model, request, {}, client_context(fed, cid, 0))
            replies.append(Reply(cid, reply))
            states.append(cstate)
    finally:
        logging.disable(logging.NOTSET)
    if clients is None:
        state = method.server_setup(state, replies)
    return state, replies, states


def _tiles(t: Tensor, like: Tensor) -> np.ndarray:
    """``[B, H, W, 3]`` in [0, 1]: images on the value range of the originals ``like`` (clipped),
    feature maps as their channel mean, min-max per tile and resized to the image size."""
    if t.shape[1:] == like.shape[1:]:
        img = ((t - like.min()) / (like.max() - like.min()).clamp_min(1e-8)).clamp(0, 1)
    else:
        img = F.interpolate(t.mean(dim=1, keepdim=True), size=like.shape[-2:], mode="nearest")
        flat = img.flatten(1)
        lo, hi = flat.min(1).values.view(-1, 1, 1, 1), flat.max(1).values.view(-1, 1, 1, 1)
        img = (img - lo) / (hi - lo).clamp_min(1e-8)
    if img.shape[1] == 1:
        img = img.expand(-1, 3, -1, -1)
    return img.permute(0, 2, 3, 1).numpy()


def _samples(fed: Federation, per_domain: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(fed.cfg.seed)
    idx, doms = [], []
    for d in range(len(fed.dataset.domains)):
        pick = rng.choice(np.flatnonzero(fed.dataset.domain_ids == d), size=per_domain, replace=False)
        idx += pick.tolist()
        doms += [d] * per_domain
    return np.asarray(idx), doms


def _foreign_client(fed: Federation, domain: int, j: int) -> int:
    """A client whose assigned domains exclude ``domain`` (the ``j``-th such, cyclically)."""
    others = [c for c, cd in enumerate(fed.clients) if domain not in cd.domains] or list(range(len(fed.clients)))
    return others[j % len(others)]


def _pardon_style(fed: Federation, pardon: Method, ckpt: dict[str, Any] | None) -> tuple[Tensor, Tensor, Message]:
    """The run's global interpolation style and a client's codec state (checkpoint, else replayed)."""
    if ckpt is not None and fed.cfg.method.name == "pardon" and "style" in ckpt["server_state"]:
        state, client = ckpt["server_state"], ckpt["client_states"].get(0, {})
    else:
        state, _, (client, *_) = replay_setup(fed, pardon)
    mean, std = state["style"]
    return torch.as_tensor(mean), torch.as_tensor(std), client


def _ccst_styles(fed: Federation, ccst: Method, ckpt: dict[str, Any] | None, doms: list[int]
                 ) -> tuple[list[tuple[Tensor, Tensor]], list[int], Message]:
    """Per displayed sample, the overall style of a client of another domain; the owners; a codec state."""
    owners = [_foreign_client(fed, d, j) for j, d in enumerate(doms)]
    if ckpt is not None and fed.cfg.method.name == "ccst":
        mean, std, bank_owner = ckpt["server_state"]["bank"]
        first = {int(o): r for r, o in reversed(list(enumerate(bank_owner)))}
        styles = [(torch.as_tensor(mean[first[o]]), torch.as_tensor(std[first[o]])) for o in owners]
        return styles, owners, ckpt["client_states"].get(0, {})
    needed = sorted(set(owners))
    _, replies, states = replay_setup(fed, ccst, needed)
    by_client = {r.client_id: r.message for r in replies}
    arrays = {o: (np.asarray(by_client[o]["style/mean"]), np.asarray(by_client[o]["style/std"])) for o in needed}
    styles = [(torch.as_tensor(arrays[o][0][0]), torch.as_tensor(arrays[o][1][0])) for o in owners]
    return styles, owners, states[0]


def style_grid(run_dir: str | Path, per_domain: int = 2) -> Path | None:
    """Write ``styles.png`` for a PARDON or CCST run (``None`` for other methods)."""
    run_dir = Path(run_dir)
    raw = read_yaml(run_dir / "config.yaml")
    if (raw.get("method") or {}).get("name", "fedavg") not in STYLE_METHODS:
        return None
    cfg = build_config(raw)
    fed = build_federation(cfg.model_copy(update={"device": "cpu"}))
    ckpt = open_checkpoint(run_dir)
    own = dict(cfg.method.params)
    shared = {k: v for k, v in own.items() if k in StyleParams.model_fields}
    pardon = create_method("pardon", {**(own if cfg.method.name == "pardon" else shared), "objective": "triplet"})
    ccst = create_method("ccst", {**(own if cfg.method.name == "ccst" else shared), "style_type": "overall"})
    idx, doms = _samples(fed, per_domain)
    inputs, _ = fed.dataset.get_batch(idx, train=False)
    x = images(inputs)
    g_mean, g_std, p_client = _pardon_style(fed, pardon, ckpt)
    styles, owners, c_client = _ccst_styles(fed, ccst, ckpt, doms)
    p_params, c_params = cast(PardonParams, pardon.params), cast(CCSTParams, ccst.params)
    p_codec: StyleCodec = make_codec(p_params, fed.model, p_client)
    c_codec: StyleCodec = make_codec(c_params, fed.model, c_client)
    with torch.no_grad():
        rows = [("original", _tiles(x, x))]
        if p_codec.name == "feature":
            rows.append(("E(x), channel mean", _tiles(p_codec.encode(x), x)))
        rows.append(("PARDON: interpolation style", _tiles(p_codec.transfer(x, g_mean, g_std, p_params.alpha), x)))
        ccst_x = torch.cat([c_codec.transfer(x[j : j + 1], m, s, c_params.alpha) for j, (m, s) in enumerate(styles)])
        rows.append(("CCST: style of client", _tiles(ccst_x, x)))
    names = [fed.dataset.domains[d] for d in doms]
    path = run_dir / GRID
    _draw(rows, names, owners, f"{run_dir.name}\nstyle path: {p_codec.describe()}", path)
    return path


def _draw(rows: list[tuple[str, np.ndarray]], names: list[str], owners: list[int], title: str, path: Path) -> None:
    """One mosaic image (rows of tiles, 2 px white gaps) in a single axes: fast to draw."""
    n, h, w, _ = rows[0][1].shape
    gap = 2
    mosaic = np.ones((len(rows) * (h + gap), n * (w + gap), 3))
    for r, (_, tiles) in enumerate(rows):
        for c in range(n):
            mosaic[r * (h + gap) : r * (h + gap) + h, c * (w + gap) : c * (w + gap) + w] = tiles[c]
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * n, 0.6 + 0.95 * len(rows)))
    ax.imshow(mosaic, interpolation="nearest")
    ax.set_xticks([c * (w + gap) + w / 2 for c in range(n)], names, fontsize=7)
    ax.xaxis.tick_top()
    ax.set_yticks([r * (h + gap) + h / 2 for r in range(len(rows))], [label for label, _ in rows], fontsize=7)
    for c, o in enumerate(owners):
        ax.text(c * (w + gap) + w / 2, len(rows) * (h + gap) + 2, f"client {o}", ha="center", va="top", fontsize=6)
    ax.set_title(title, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
