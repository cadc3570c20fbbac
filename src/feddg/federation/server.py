"""The server half as any engine runs it: round bookkeeping, evaluation, metrics, checkpoints.

An engine only moves messages: it asks :meth:`Server.configure` what to send, delivers the
messages to clients however it likes (a Python call, Flower), and hands the replies to
:meth:`Server.finish_round`. Everything else — sampling, learning-rate schedule, aggregation,
evaluation, the run directory — lives here, so both engines produce the same run directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from feddg.algorithms import Reply, ServerContext
from feddg.config import dump_config
from feddg.evaluation.accuracy import accuracy_metrics, correct_by_domain, merge_counts
from feddg.federation.checkpoint import load_checkpoint, save_checkpoint
from feddg.federation.rounds import learning_rate, sample_clients
from feddg.federation.setup import Federation
from feddg.messages import Message, load_weights, message_nbytes

METRICS = "metrics.jsonl"
RESULTS = "results.json"
CONFIG = "config.yaml"


class Server:
    """Server-side state of one run, resumable from its run directory."""

    def __init__(self, fed: Federation, run_dir: str | Path, *, resume: bool = False) -> None:
        self.fed = fed
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = load_checkpoint(self.run_dir) if resume else None
        if ckpt is None:
            cfg = fed.cfg
            ctx = ServerContext(len(fed.clients), self.rounds, fed.dataset.num_classes, cfg.seed)
            self.state = fed.method.server_init(fed.model, ctx)
            self.client_states: dict[int, Message] = {}
            self.metrics: list[dict[str, Any]] = []
            self.round = 0
            self.setup_done = False
            (self.run_dir / CONFIG).write_text(dump_config(cfg))
        else:
            self.state = ckpt["server_state"]
            self.client_states = ckpt["client_states"]
            self.metrics = ckpt["metrics"]
            self.round = ckpt["round"]
            self.setup_done = ckpt["setup_done"]
        self._rewrite_metrics()

    # --- setup exchange ----------------------------------------------------------------
    def setup_request(self) -> Message | None:
        """The one-time setup message for every client, if the method has one and it is pending."""
        return None if self.setup_done else self.fed.method.setup_request(self.state)

    def finish_setup(self, replies: list[Reply]) -> None:
        self.state = self.fed.method.server_setup(self.state, replies)
        self.setup_done = True
        self.checkpoint()

    def mark_setup_done(self) -> None:
        self.setup_done = True

    # --- rounds ------------------------------------------------------------------------
    @property
    def rounds(self) -> int:
        """Engine rounds; under a hierarchy one engine round is a station round (R server rounds × N)."""
        h = self.fed.cfg.hierarchy
        return self.fed.cfg.federation.rounds * (h.station_rounds if h is not None else 1)

    def eval_due(self, round: int) -> bool:
        """Every ``eval.every`` (server) rounds and after the last; a hierarchy evaluates only at server rounds' ends."""
        h = self.fed.cfg.hierarchy
        n = h.station_rounds if h is not None else 1
        return round == self.rounds or (round % n == 0 and (round // n) % self.fed.cfg.eval.every == 0)

    def lr(self, round: int) -> float:
        o = self.fed.cfg.optim
        return learning_rate(o.lr, o.schedule, round, self.rounds, o.step_size, o.gamma)

    def configure(self, round: int) -> dict[int, Message]:
        """The message for each client sampled in ``round``."""
        cfg = self.fed.cfg
        if cfg.hierarchy is not None:  # per station (algorithms/hierarchy.py)
            sampled = self.fed.method.sample_clients(round, cfg.federation.client_fraction, cfg.seed)  # type: ignore[attr-defined]
        else:
            sampled = sample_clients(len(self.fed.clients), cfg.federation.client_fraction, cfg.seed, round)
        lr = self.lr(round)
        return {
            cid: {**self.fed.method.client_config(self.state, cid, round), "lr": lr, "round": round}
            for cid in sampled
        }

    def finish_round(
        self, round: int, sent: dict[int, Message], replies: list[Reply], timings: dict[str, float]
    ) -> dict[str, Any]:
        """Aggregate, evaluate when due, record metrics and checkpoint; returns this round's metrics."""
        t0 = time.perf_counter()
        self.state = self.fed.method.aggregate(self.state, replies)
        n = np.array([r.num_examples for r in replies], dtype=np.float64)
        losses = [float(r.message.get("train_loss", np.nan)) for r in replies]
        row: dict[str, Any] = {
            "round": round,
            "lr": self.lr(round),
            "clients": len(replies),
            "train_loss": float(np.average(losses, weights=n)),
            "bytes_down": int(sum(message_nbytes(m) for m in sent.values())),
            "bytes_up": int(sum(message_nbytes(r.message) for r in replies)),
            **timings,
            "time_aggregate_s": time.perf_counter() - t0,
            **self.fed.method.round_metrics(self.state),
        }
        if self.eval_due(round):
            t1 = time.perf_counter()
            row.update(self.evaluate())
            row["time_eval_s"] = time.perf_counter() - t1
        engine_times = (*timings, "time_aggregate_s", "time_eval_s")  # a method's own time_* metrics are not summed
        row["time_round_s"] = sum(row[k] for k in engine_times if k in row)
        self.metrics.append(row)
        self.round = round
        with open(self.run_dir / METRICS, "a") as f:
            f.write(json.dumps(row) + "\n")
        if round % self.fed.cfg.federation.checkpoint_every == 0 or round == self.rounds:
            self.checkpoint()
        return row

    # --- evaluation --------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """id accuracy on the clients' holdouts, ood accuracy on the held-out domain(s), per domain."""
        fed, method, model = self.fed, self.fed.method, self.fed.model
        ds, split = fed.dataset, fed.split
        bs, dev = fed.cfg.eval.batch_size, fed.device

        def counts(idx: np.ndarray) -> dict[int, tuple[int, int]]:
            return correct_by_domain(model, ds, idx, batch_size=bs, device=dev, predict=method.predict)

        out: dict[str, float] = {}
        if not method.personalized:
            load_weights(model, method.eval_weights(self.state))
            out.update(accuracy_metrics(counts(np.concatenate([c.holdout_idx for c in fed.clients])), ds.domains, "id_acc"))
            out.update(accuracy_metrics(counts(split.test_idx), ds.domains, "ood_acc"))
            if len(split.val_idx):
                out.update(accuracy_metrics(counts(split.val_idx), ds.domains, "val_acc"))
            return out
        # personalised: each client's own model on its holdout and on the unseen domain(s)
        id_counts, ood_accs = [], []
        for cid, client in enumerate(fed.clients):
            load_weights(model, method.eval_weights(self.state, cid))
            id_counts.append(counts(client.holdout_idx))
            ood_accs.append(accuracy_metrics(counts(split.test_idx), ds.domains, "ood_acc"))
        out.update(accuracy_metrics(merge_counts(*id_counts), ds.domains, "id_acc"))
        out.update({k: float(np.mean([a[k] for a in ood_accs])) for k in ood_accs[0]})
        load_weights(model, method.eval_weights(self.state, None))
        out.update(accuracy_metrics(counts(split.test_idx), ds.domains, "global_ood_acc"))
        holdouts = np.concatenate([c.holdout_idx for c in fed.clients])  # the global model on every holdout
        out.update(accuracy_metrics(counts(holdouts), ds.domains, "global_id_acc"))
        return out

    # --- persistence -------------------------------------------------------------------
    def checkpoint(self) -> None:
        save_checkpoint(
            self.run_dir,
            {
                "round": self.round,
                "setup_done": self.setup_done,
                "server_state": self.state,
                "client_states": self.client_states,
                "metrics": self.metrics,
            },
        )

    def _rewrite_metrics(self) -> None:
        """metrics.jsonl = exactly the checkpointed rounds (drops rows of a round that crashed)."""
        lines = "".join(json.dumps(m) + "\n" for m in self.metrics)
        (self.run_dir / METRICS).write_text(lines)

    def write_results(self) -> dict[str, Any]:
        """results.json: the last evaluation, totals, and what the run was."""
        last = next((m for m in reversed(self.metrics) if "ood_acc" in m), {})
        fed = self.fed
        results = {
            "method": fed.method.name,
            "method_params": getattr(fed.method, "inner", fed.method).params.model_dump(mode="json"),
            "dataset": fed.dataset.name,
            "target": [fed.dataset.domains[d] for d in fed.split.test_domains],
            "val_domain": [fed.dataset.domains[d] for d in fed.split.val_domains],
            "source": [fed.dataset.domains[d] for d in fed.split.source_domains],
            "seed": fed.cfg.seed,
            "rounds": self.round,
            "num_clients": len(fed.clients),
            "final": {k: v for k, v in last.items() if "acc" in k},
            "bytes_up_total": int(sum(m["bytes_up"] for m in self.metrics)),
            "bytes_down_total": int(sum(m["bytes_down"] for m in self.metrics)),
            "time_total_s": float(sum(m.get("time_round_s", 0.0) for m in self.metrics)),
            "bytes_per_round": _mean_bytes(self.metrics),
        }
        if fed.cfg.hierarchy is not None:  # topology, cost per server round, DP ε (algorithms/hierarchy.py)
            results["hierarchy"] = fed.method.summary(self.metrics)  # type: ignore[attr-defined]
        (self.run_dir / RESULTS).write_text(json.dumps(results, indent=2))
        return results


def _mean_bytes(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean over rounds of every byte count in the metrics (engine totals and methods' own, e.g.
    ``fedfa/bytes_stats_up`` per client), for the run's communication summary."""
    keys = sorted({k for r in rows for k in r if "bytes" in k})
    return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}
