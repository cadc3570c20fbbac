"""The run's evaluation and its results.json, driven by the dataset's task.

Each evaluation computes the task's per-domain tallies (``feddg.evaluation.tally``) of the global model — or, for
a personalised method, of every client's model (and the global one's, ``global_<role>``) — on the clients'
holdouts (``id``), the held-out domains (``ood``, ``val``) and the extra targets (``eval.extra``), and turns them
into the task's metric under its keys (``<role>_<metric>[/<domain>]``, :func:`feddg.tasks.metric_key`):
``ood_acc/uci`` for classification, ``ood_dice/BIDMC`` for segmentation (and ``eval.metrics``' further ones:
``ood_macro_f1``). Which keys a run
writes, and how many samples stand behind each, follow from its split and clients alone (:meth:`Evaluator.keys`,
:meth:`Evaluator.counts`), so results.json records both with the task's block (name, metric, bounds, chance) and
every consumer reads that instead of sniffing key names.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from feddg.evaluation.tally import batch_outputs, domain_metrics, tally_by_domain
from feddg.federation.setup import Federation
from feddg.messages import load_weights
from feddg.tasks import metric_key


class Evaluator:
    """Evaluation of one federation's models (see the module docstring)."""

    def __init__(self, fed: Federation) -> None:
        self.fed, self.task = fed, fed.task
        self.holdouts = np.concatenate([c.holdout_idx for c in fed.clients])
        #: the last evaluation's per-class view of each role (the global model's), for results.json and the report
        self.class_views: dict[str, dict[str, list[float | None]]] = {}

    @property
    def headline(self) -> str:
        """The key that marks an evaluation row: the mean over the held-out domains (``ood_acc``), or over the
        clients' holdouts where no domain is held out (``split.protocol: federated``)."""
        return metric_key("ood" if len(self.fed.split.test_idx) else "id", self.task.metric)

    def tally(self, indices: np.ndarray, dataset: Any = None) -> np.ndarray:
        """The task's tally of the model as loaded, on ``indices`` of ``dataset`` (default: the run's), with the
        method's ``predict``, the evaluation batch size, the device, ``optim.amp`` and ``model.channels_last``."""
        fed, cfg = self.fed, self.fed.cfg
        return tally_by_domain(fed.model, dataset if dataset is not None else fed.dataset, indices, self.task,
                               batch_size=cfg.eval.batch_size, device=fed.device, predict=fed.method.predict,
                               amp=cfg.optim.amp, channels_last=cfg.model.channels_last)

    @torch.no_grad()
    def holdout_loss(self, state: Any) -> float:
        """The task's loss (``Task.loss``) of the global model of ``state`` on the clients' holdouts, each batch's
        weighted by its samples, in eval mode: what ``federation.rollback_loss_factor`` compares, round against
        round at the same ``eval.batch_size`` (a loss that pools over its batch, segmentation's soft Dice, is not a
        per-sample mean, so its value moves with the batch size)."""
        fed, cfg = self.fed, self.fed.cfg
        self._load(state, None)
        total, count = 0.0, 0
        for output, y, chunk in batch_outputs(fed.model, fed.dataset, self.holdouts, batch_size=cfg.eval.batch_size,
                                              device=fed.device, predict=fed.method.predict, amp=cfg.optim.amp,
                                              channels_last=cfg.model.channels_last):
            total += float(self.task.loss(output.float(), y.to(output.device))) * len(chunk)
            count += len(chunk)
        return total / count

    def _load(self, state: Any, client_id: int | None) -> None:
        load_weights(self.fed.model, self.fed.topology.eval_weights(self.fed.method, state, client_id))

    def _figures(self, tally: np.ndarray, role: str) -> dict[str, float]:
        """The role's figures of a tally, keeping the task's per-class view of it where the role has samples (an
        empty role, e.g. ood under ``split.protocol: federated``, has no figures and so no view)."""
        total = tally.sum(0)
        if self.task.count(total) > 0 and (view := self.task.class_view(total)) is not None:
            self.class_views[role] = view
        return self._metrics(tally, self.fed.dataset.domains, role)

    def _metrics(self, tally: np.ndarray, domains: list[str], role: str) -> dict[str, float]:
        """The task's metric of each domain with samples and their mean, and so for each of ``eval.metrics``."""
        return domain_metrics(self.task, tally, domains, role) | self.task.extra_figures(tally, domains, role)

    def _roles(self) -> dict[str, np.ndarray]:
        split = self.fed.split
        roles = {"id": self.holdouts, "ood": split.test_idx}
        return roles | ({"val": split.val_idx} if len(split.val_idx) else {})

    def evaluate(self, state: Any) -> dict[str, float]:
        """Every figure of one evaluation of ``state``: id, ood (val) and extra, per domain and averaged."""
        fed, method, ds = self.fed, self.fed.method, self.fed.dataset
        out: dict[str, float] = {}
        if not method.personalized:
            self._load(state, None)
            for role, idx in self._roles().items():
                out.update(self._figures(self.tally(idx), role))
        else:  # each client's own model on its holdout (tallies summed) and on the held-out domains (figures averaged)
            unseen = {role: idx for role, idx in self._roles().items() if role != "id"}  # ood, and val under ltdo
            id_tally: np.ndarray | None = None
            per_client: dict[str, list[dict[str, float]]] = {role: [] for role in unseen}
            for cid, client in enumerate(fed.clients):
                self._load(state, cid)
                t = self.tally(client.holdout_idx)
                id_tally = t if id_tally is None else id_tally + t
                for role, idx in unseen.items():
                    per_client[role].append(self._metrics(self.tally(idx), ds.domains, role))
            assert id_tally is not None
            out.update(self._metrics(id_tally, ds.domains, "id"))
            for figures in per_client.values():
                out.update({k: float(np.mean([f[k] for f in figures])) for k in figures[0]})
            self._load(state, None)
            for role, idx in unseen.items():
                out.update(self._figures(self.tally(idx), f"global_{role}"))
            out.update(self._figures(self.tally(self.holdouts), "global_id"))  # on every holdout
        for target in fed.extra:
            out.update(self.extra(state, target))
        return out

    def extra(self, state: Any, target: Any) -> dict[str, float]:
        """``extra/<name>_<metric>[/<domain>]`` on every sample of an extra target: the global model's, or for a
        personalised method the mean over clients of each client's model plus ``extra/<name>_global_<metric>``."""
        ds, role = target.dataset, f"extra/{target.name}"
        every = np.arange(len(ds), dtype=np.int64)

        def figures(client_id: int | None, key: str) -> dict[str, float]:
            self._load(state, client_id)
            return self._metrics(self.tally(every, ds), ds.domains, key)

        if not self.fed.method.personalized:
            return figures(None, role)
        per_client = [figures(cid, role) for cid in range(len(self.fed.clients))]
        out = {k: float(np.mean([f[k] for f in per_client])) for k in per_client[0]}
        out.update(figures(None, f"{role}_global"))
        return out

    def counts(self) -> dict[str, int]:
        """The samples behind every key of an evaluation (a mean's: all of its domains'), from the split alone."""
        fed = self.fed
        out: dict[str, int] = {}

        def add(role: str, domain_ids: np.ndarray, domains: list[str]) -> None:
            per = np.bincount(domain_ids, minlength=len(domains))
            for metric in (self.task.metric, *self.task.extra_metrics):
                out.update({metric_key(role, metric, domains[d]): int(n) for d, n in enumerate(per) if n})
                if per.sum():
                    out[metric_key(role, metric)] = int(per.sum())

        roles = self._roles()
        if fed.method.personalized:
            roles |= {f"global_{role}": idx for role, idx in roles.items()}
        for role, idx in roles.items():
            add(role, fed.dataset.domain_ids[idx], fed.dataset.domains)
        for t in fed.extra:
            roles_extra = [f"extra/{t.name}", *([f"extra/{t.name}_global"] if fed.method.personalized else [])]
            for role in roles_extra:
                add(role, t.dataset.domain_ids, t.dataset.domains)
        return out

    def keys(self) -> set[str]:
        """Every key an evaluation writes."""
        return set(self.counts())

    def aggregate_keys(self) -> set[str]:
        """The keys of the means over domains (what ``eval.per_domain: false`` keeps in metrics.jsonl)."""
        return {k for k in self.keys() if "/" not in k.removeprefix("extra/")}

    def results(self, final: dict[str, float]) -> dict[str, Any]:
        """results.json's evaluation blocks: the task, the final figures and the samples behind each."""
        counts = self.counts()
        out = {"task": self.task.info(), "final": {k: v for k, v in final.items() if k in counts},
               "counts": {k: n for k, n in counts.items() if k in final}}
        return out | ({"per_class": {"classes": self.fed.dataset.classes, **self.class_views}} if self.class_views
                      else {})
