"""``examples/<site>.png`` at the end of a run: the task's figures of a few evaluation samples per site with the
final model (:meth:`feddg.tasks.Task.examples`; segmentation: image, ground truth, prediction; classification:
none). Every engine's end calls :func:`write_examples` after results.json is written (``experiment.py`` for the
in-process and the Flower simulation engines, ``engines/flower/app.py`` for a Flower deployment)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from feddg.devices import autocast, to_device
from feddg.evaluation.overlays import example_path
from feddg.evaluation.plots import save
from feddg.federation.server import Server
from feddg.messages import load_weights
from feddg.tasks.base import Predictor

log = logging.getLogger(__name__)


def write_examples(server: Server) -> list[Path]:
    """The task's figures of the final model into ``examples/<site>.png`` (none for a task without them); returns
    the files written. It never raises (results.json is written already): a failure is one warning line."""
    try:
        figures = server.fed.task.examples(server.fed.dataset, evaluation_sites(server), final_predictor(server))
        paths = []
        for site, fig in figures.items():
            path = example_path(server.run_dir, site)
            path.parent.mkdir(exist_ok=True)
            paths.append(save(fig, path))
        return paths
    except Exception as err:  # a figure must not fail a finished run
        log.warning("examples/ not written: %s: %s", type(err).__name__, err)
        return []


def evaluation_sites(server: Server) -> dict[str, np.ndarray]:
    """Each domain's evaluation samples, in the dataset's domain order: a held-out (ood, val) domain's test samples,
    a source domain's samples in the clients' holdouts."""
    fed = server.fed
    pool = np.concatenate([fed.split.test_idx, fed.split.val_idx, server.evaluator.holdouts]).astype(np.int64)
    ids = fed.dataset.domain_ids[pool]
    return {name: pool[ids == d] for d, name in enumerate(fed.dataset.domains) if (ids == d).any()}


def final_predictor(server: Server) -> Predictor:
    """The final model's outputs on dataset indices, with the weights the final evaluation scored them with (the
    topology's ``eval_weights``, the method's ``predict``, ``optim.amp``): the global model, or for a personalised
    method each client's own model on its holdout's samples and the global model on the others (a held-out domain's
    ood figure averages the clients' models; its global_ood figure is the global model's)."""
    fed, cfg = server.fed, server.fed.cfg
    owner = np.full(len(fed.dataset), -1, dtype=np.int64)
    if fed.method.personalized:
        for cid, client in enumerate(fed.clients):
            owner[client.holdout_idx] = cid

    @torch.no_grad()
    def predict(indices: np.ndarray) -> torch.Tensor:
        out: torch.Tensor | None = None
        for who in np.unique(owner[indices]):
            at = np.flatnonzero(owner[indices] == who)
            load_weights(fed.model, fed.topology.eval_weights(fed.method, server.state, None if who < 0 else int(who)))
            fed.model.eval()
            x, _ = fed.dataset.get_batch(indices[at], train=False)
            with autocast(fed.device, cfg.optim.amp):
                part = fed.method.predict(fed.model, to_device(x, fed.device, cfg.model.channels_last)).float().cpu()
            out = part.new_empty((len(indices), *part.shape[1:])) if out is None else out
            out[torch.from_numpy(at)] = part
        if out is None:
            raise ValueError("no indices to predict")
        return out

    return predict
