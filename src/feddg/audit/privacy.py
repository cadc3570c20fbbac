"""``feddg audit privacy RUN_DIR``: rebuild a run's federation (config.yaml + checkpoint), recompute what its
clients share, run every attack that applies (and, on request, all of them), each at a sweep of DP noise
multipliers, and write ``RUN_DIR/audit/privacy.json`` with true-vs-reconstructed grids.

An offline analysis with the experimenter's copy of the data, like ``reports/style_grid.py``: the victims
are ``per_client`` random training images of every client; the attackers are (i) ``third-party``: held-out
public data (the run's target-domain images) and (ii) ``inter-client``: client 0 with its own training
images, attacking the others. The audit's seed is ``audit.seed``, else the run's. docs/privacy.md, "Auditing
what leaves a client".
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast, get_args

import numpy as np
import torch

from feddg.aggregation.accounting import gaussian_epsilon
from feddg.aggregation.dp import clip_rows, symmetric_noise
from feddg.algorithms.components.style import StyleParams, make_codec
from feddg.algorithms.hfedatm import gram_layers
from feddg.algorithms.pardon import PardonParams
from feddg.algorithms.registry import create_method
from feddg.audit.gradient import TinyNet, dlg, dp_update, one_step_update, update_norm
from feddg.audit.gram import gram_audit
from feddg.audit.grids import draw_grid
from feddg.audit.inversion import Victims, reference, scores, vector_inversion
from feddg.audit.metrics import FID_NAME, denormalise, to_unit
from feddg.audit.shares import Share, moments_share, prototype_share, stage_encoder, style_share
from feddg.config import (
    METHOD_ATTACKS,
    AuditConfig,
    ExperimentConfig,
    PrivacyAttack,
    audit_attacks,
    audit_problem,
    build_config,
    read_yaml,
)
from feddg.devices import images
from feddg.experiment import AUDIT_DIR
from feddg.federation.client_store import open_checkpoint
from feddg.federation.setup import Federation, build_federation
from feddg.messages import load_weights
from feddg.models.base import FedModel

PRIVACY_JSON = "privacy.json"
VECTOR_ATTACKS = ("sample-style", "client-style", "fedfa-moments", "fpl-prototypes")
ATTACKS: tuple[str, ...] = get_args(PrivacyAttack)
ATTACKERS = ("third-party", "inter-client")
#: the shares whose σ half the methods send clamped at 0 after the noise (CCST, PARDON); FedFA sends its noised σ̄ as is
CLAMPED_STD = ("sample-style", "client-style")
Progress = Callable[[str], None]


@dataclass
class Replay:
    """The rebuilt run: the federation, its trained model, the victims' images (normalised) and labels."""

    cfg: ExperimentConfig
    fed: Federation
    model: FedModel
    weights: str
    x: list[torch.Tensor]
    y: list[np.ndarray]
    attacker_x: torch.Tensor
    lo: float
    hi: float

    def unit(self, x: torch.Tensor | np.ndarray) -> np.ndarray:
        """Images as the scores read them, in ``[0, 1]``: the dataset's per-channel normalisation undone, else (no
        statistics known) the victims' and attacker's value range mapped onto it."""
        ds = self.fed.dataset
        if ds.mean is not None and ds.std is not None:
            return denormalise(np.asarray(x), ds.mean, ds.std)
        return to_unit(np.asarray(x), self.lo, self.hi)

    def victims(self, vectors: list[np.ndarray], ids: list[int], attacker: int | None = None, *, paired: bool = False,
                present: list[np.ndarray] | None = None) -> Victims:
        """The victims' rows (``paired``: row ``j`` of client ``c`` is the share of its image ``j``; ``present``: per
        client, the rows sent without DP); the pool is every client's images but the attacking client's (it knows
        its own)."""
        keep = [c for c in range(len(self.x)) if c != attacker]
        pool = self.unit(torch.cat([self.x[c] for c in keep]))
        owners = np.concatenate([np.full(len(self.x[c]), c) for c in keep])
        row_owner = np.concatenate([np.full(len(v), c) for v, c in zip(vectors, ids, strict=True)])
        start = {c: int(np.sum([len(self.x[k]) for k in keep if k < c])) for c in ids}  # client c's first in pool
        source = np.concatenate([start[c] + np.arange(len(v)) for v, c in zip(vectors, ids, strict=True)]) if paired else None
        return Victims(np.concatenate(vectors).astype(np.float32), row_owner, pool, owners, source,
                       None if present is None else np.concatenate(present))


def replay(run_dir: Path, settings: AuditConfig, seed: int) -> Replay:
    """The run's federation from config.yaml, the final global weights from its checkpoint (else the initial
    ones), ``per_client`` training images of every client and the third-party attacker's public images (drawn
    with ``seed``)."""
    cfg = build_config(read_yaml(run_dir / "config.yaml"))
    fed = build_federation(cfg.model_copy(update={"device": "cpu"}))
    model = cast(FedModel, copy.deepcopy(fed.model).eval())
    ckpt = open_checkpoint(run_dir)
    weights = ckpt["server_state"].get("weights") if ckpt is not None else None
    if weights is not None:
        load_weights(model, weights)
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for client in fed.clients:
        idx = np.sort(rng.choice(client.train_idx, size=min(settings.per_client, len(client.train_idx)), replace=False))
        inputs, y = fed.dataset.get_batch(idx, train=False)
        xs.append(images(inputs).float())
        ys.append(np.asarray(y))
    public = fed.split.test_idx if len(fed.split.test_idx) else fed.split.val_idx
    if len(public) == 0:
        raise ValueError("the third-party attacker needs held-out public data: the run has no target domain")
    pick = np.sort(rng.choice(public, size=min(settings.attacker_size, len(public)), replace=False))
    attacker_x = images(fed.dataset.get_batch(pick, train=False)[0]).float()
    both = torch.cat([*xs, attacker_x])
    return Replay(cfg, fed, model, "checkpoint" if weights is not None else "initial (no checkpoint)", xs, ys,
                  attacker_x, float(both.min()), float(both.max()))


def _share(rp: Replay, attack: str, s: AuditConfig) -> Share:
    own = dict(rp.cfg.method.params) if rp.cfg.method.name in ("pardon", "ccst") else {}
    style = StyleParams(**{k: v for k, v in own.items() if k in StyleParams.model_fields})
    if s.style_path is not None:
        style = StyleParams.model_validate({**style.model_dump(), "style_path": s.style_path})
    if attack in ("sample-style", "client-style"):
        codec = make_codec(style, rp.fed.model)  # the initial model: the feature path's frozen encoder
        pardon = PardonParams(**own) if rp.cfg.method.name == "pardon" else None  # eqs. 1–2 as the run set them
        return style_share(codec, "sample" if attack == "sample-style" else "client", pardon)
    if attack == "fedfa-moments":
        return moments_share(stage_encoder(rp.model))
    return prototype_share(rp.model, rp.fed.dataset.num_classes)


def _releases(rp: Replay, attack: str) -> int:
    """Releases of the statistic over the run as its method's own accounting counts them (results.json's
    ``privacy.releases``, with the run's params if the run is that method's, else its defaults): styles once, at
    setup; FedFA's ``stat/`` and ``hist/`` and FPL's prototypes every engine round."""
    if attack in ("sample-style", "client-style"):
        return 1
    name = next(m for m, a in METHOD_ATTACKS.items() if a == attack)
    params = dict(rp.cfg.method.params) if rp.cfg.method.name == name else {}
    method = create_method(name, {**params, "dp": {"noise_multiplier": 1.0, "clip": 1.0}})  # only to count
    record = method.privacy(rp.fed.topology.engine_rounds(rp.cfg.federation.rounds))
    assert record is not None
    return int(record["releases"])


def vector_attack(rp: Replay, attack: str, attacker: str, s: AuditConfig, seed: int, out: Path) -> list[dict[str, Any]]:
    """One vector inversion (``attack`` by ``attacker``) over the noise sweep; its grid under ``out``."""
    per_sample, release = _share(rp, attack, s)
    own_x = rp.attacker_x if attacker == "third-party" else rp.x[0]
    ids = list(range(len(rp.x))) if attacker == "third-party" else list(range(1, len(rp.x)))
    shared = [release(rp.x[c], rp.y[c]) for c in ids]
    held = ([np.isin(np.arange(len(v)), rp.y[c]) for v, c in zip(shared, ids, strict=True)]  # the classes held
            if attack == "fpl-prototypes" else None)
    victims = rp.victims(shared, ids, None if attacker == "third-party" else 0, paired=attack == "sample-style",
                         present=held)
    rows, recons = vector_inversion(rp.unit(own_x), per_sample(own_x), victims, noise_multipliers=tuple(s.noise_multipliers),
                                    delta=s.delta, releases=_releases(rp, attack), steps=s.generator_steps, seed=seed,
                                    fid=s.fid, sigma_from=shared[0].shape[1] // 2 if attack in CLAMPED_STD else None)
    shown = {z: r[victims.released(0.0)[victims.released(z)]] for z, r in recons.items()}  # the rows z = 0 sends
    top = shown[min(shown)]
    grid = [(f"true ({'own' if victims.source is not None else 'nearest'})",
             reference(top, victims.rows(victims.released(0.0)))), *[(f"z = {z:g}", shown[z]) for z in sorted(shown)]]
    path = draw_grid(grid, f"{attack}, {attacker} attacker", out / f"{attack}-{attacker}.png")
    return [{"attack": attack, "attacker": attacker, "grid": path.name, **r} for r in rows]


def update_attack(rp: Replay, s: AuditConfig, seed: int, out: Path) -> list[dict[str, Any]]:
    """DLG/iDLG on one-step batch-1 updates of a tiny model, one image (the first) of each of ``dlg_victims`` clients,
    each client noising its own update (local DP); the chance level scores one random image of another client each."""
    ids = list(range(min(s.dlg_victims, len(rp.x))))
    shape = tuple(rp.x[0].shape[1:])
    torch.manual_seed(seed)
    net = TinyNet(shape[0], shape[1], shape[2], rp.fed.dataset.num_classes)
    lr = rp.cfg.optim.lr
    updates = [one_step_update(net, rp.x[c][:1], torch.as_tensor(rp.y[c][:1]), lr) for c in ids]
    clip = float(np.median([update_norm(up) for up in updates]))
    victims = rp.victims([np.zeros((1, 1)) for _ in ids], ids, paired=True)  # each scored against its x[c][:1]
    rng = np.random.default_rng(seed)
    decoys = np.stack([victims.pool[rng.choice(np.flatnonzero(victims.pool_owner != c))] for c in ids])
    # Local DP (the client noises its reply; dp_weights is central: its server sees the z = 0 row): Δ clipped to C
    # plus N(0, (zC)²) is the Gaussian mechanism of sensitivity 2C (replace-one), multiplier z/2, released in each
    # engine round with no amplification by sampling (the server knows who it sampled).
    rounds = rp.fed.topology.engine_rounds(rp.cfg.federation.rounds)
    rows, grid = [], [("true", rp.unit(torch.cat([rp.x[c][:1] for c in ids])))]
    for z in s.noise_multipliers:
        found = [dlg(net, dp_update(up, z, clip, seed + c), lr, shape, iterations=s.dlg_iterations, seed=seed)
                 for c, up in zip(ids, updates, strict=True)]
        recon = rp.unit(torch.cat([x for x, _ in found]))
        labels = np.mean([lab == int(rp.y[c][0]) for (_, lab), c in zip(found, ids, strict=True)])
        eps = gaussian_epsilon(z / 2, rounds, s.delta) if z > 0 else None
        rows.append({"attack": "update-dlg", "attacker": "server", "dp": "local", "noise_multiplier": z, "epsilon": eps,
                     "delta": s.delta, "clip": clip, "label_acc": float(labels),
                     **scores(recon, victims, decoys, fid=s.fid)})
        grid.append((f"z = {z:g}", recon))
    path = draw_grid(grid, "update-dlg (tiny sigmoid CNN, one SGD step, batch 1, local DP)", out / "update-dlg.png")
    return [{**r, "grid": path.name} for r in rows]


def gram_releases(rp: Replay) -> int:
    """HFedATM's Gram releases over the run as training counts them (``station_summary``: results.json's
    ``hierarchy.privacy.releases``): one per Gram layer (``hfedatm.gram_layers`` of the model) per server round."""
    return rp.cfg.federation.rounds * len(gram_layers(rp.model))


def gram_attack(rp: Replay, s: AuditConfig, seed: int) -> list[dict[str, Any]]:
    """Gram inversion of every client's ``G = AᵀA`` of the classifier's inputs (per-sample DP: rows clipped to
    ``C``, symmetric ``N(0, (z·C²)²)``: multiplier ``z`` at sensitivity ``C²``), averaged over clients; ε over
    :func:`gram_releases`."""
    feats = []
    with torch.no_grad():
        for x in rp.x:
            feats.append(rp.model.features(x).double())
    clip = float(np.median(torch.cat(feats).norm(dim=1).numpy()))  # torch's median is the lower middle of an even count
    releases = gram_releases(rp)
    rows = []
    for z in s.noise_multipliers:
        per_client = []
        for c, a in enumerate(feats):
            if z == 0:
                per_client.append(gram_audit(a.numpy(), seed=seed + c))
                continue
            ac = clip_rows(a, clip)
            g = ac.T @ ac + symmetric_noise(ac.shape[1], z * clip * clip, torch.Generator().manual_seed(seed + c))
            per_client.append(gram_audit(ac.numpy(), g.numpy(), seed=seed + c))
        mean = {k: float(np.mean([r[k] for r in per_client])) for k in per_client[0]}
        eps = gaussian_epsilon(z, releases, s.delta) if z > 0 else None
        rows.append({"attack": "gram", "attacker": "station", "noise_multiplier": z, "epsilon": eps, "delta": s.delta,
                     "clip": clip, **mean})
    return rows


def check_attacks(attacks: tuple[str, ...]) -> None:
    """A one-line error naming any attack that does not exist."""
    if unknown := sorted(set(attacks) - set(ATTACKS)):
        raise ValueError(f"unknown attack(s) {unknown}; expected some of {list(ATTACKS)}")


def run_settings(run_dir: Path) -> AuditConfig:
    """The run's ``audit:`` section, or the defaults."""
    return build_config(read_yaml(run_dir / "config.yaml")).audit or AuditConfig()


def audit_privacy(run_dir: str | Path, settings: AuditConfig | None = None, progress: Progress | None = None) -> Path:
    """Run the audit and write ``RUN_DIR/audit/privacy.json`` (and the grids); ``settings`` defaults to the run's
    ``audit:`` section, its attacks to :func:`~feddg.config.audit_attacks` of the run (refused in one line where
    they do not fit its task); ``progress`` is called with each step's name before it runs. ``settings.seed``
    ``None`` is the run's seed (privacy.json's ``seed``: the one used)."""
    run_dir = Path(run_dir)
    s = settings or run_settings(run_dir)
    step = progress or (lambda _: None)
    cfg = build_config(read_yaml(run_dir / "config.yaml"))
    if (why := audit_problem(cfg, s.attacks)) is not None:
        raise ValueError(why)
    seed = cfg.seed if s.seed is None else s.seed
    step("rebuilding the run")
    rp = replay(run_dir, s, seed)
    chosen = tuple(s.attacks) if s.attacks else audit_attacks(rp.cfg)
    out = run_dir / f"{AUDIT_DIR}.partial"  # a crash leaves the earlier audit whole
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    rows: list[dict[str, Any]] = []
    for attack in chosen:
        if attack in VECTOR_ATTACKS:
            for attacker in ATTACKERS:
                step(f"{attack} ({attacker})")
                rows += vector_attack(rp, attack, attacker, s, seed, out)
        elif attack == "update-dlg":
            step("update-dlg")
            rows += update_attack(rp, s, seed, out)
        else:
            step("gram")
            rows += gram_attack(rp, s, seed)
    record = {"run": run_dir.name, "method": rp.cfg.method.name, "weights": rp.weights, "fid_name": FID_NAME,
              "clients": len(rp.x), "settings": s.model_dump(mode="json"), "seed": seed, "attacks": list(chosen),
              "rows": rows}
    (out / PRIVACY_JSON).write_text(json.dumps(record, indent=1))
    return _publish(out, run_dir / AUDIT_DIR) / PRIVACY_JSON


def _publish(staged: Path, final: Path) -> Path:
    """Move the finished audit ``staged`` to ``final``; an earlier audit there is kept as ``audit-1``,
    ``audit-2``, ... (the latest is always ``final``)."""
    if final.exists():
        n = 1 + max((int(p.name.rsplit("-", 1)[1]) for p in final.parent.glob(f"{final.name}-*")
                     if p.name.rsplit("-", 1)[1].isdigit()), default=0)
        final.rename(final.with_name(f"{final.name}-{n}"))
    staged.rename(final)
    return final
