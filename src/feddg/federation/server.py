"""The server half as any engine runs it: round bookkeeping, evaluation, metrics, checkpoints.

An engine only moves messages: it asks :meth:`Server.configure` what to send, delivers the
messages to clients however it likes (a Python call, worker processes, Flower), hands each reply
to :meth:`Server.receive` as it arrives, and closes the round with :meth:`Server.finish_round`.
Everything else — sampling, learning-rate schedule, the fold of the replies, evaluation, the run
directory — lives here, and everything that depends on the federation's shape is asked of its
topology (``federation/topology.py``), so every engine produces the same run directory.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from feddg.algorithms.base import Reply, ServerContext
from feddg.config import ExperimentConfig, dump_config
from feddg.devices import to_device
from feddg.evaluation.communication import bytes_per_round
from feddg.federation.checkpoint import load_checkpoint, save_checkpoint
from feddg.federation.client_store import STORE_DIR, ClientStore, ClientStores, restore
from feddg.federation.evaluator import Evaluator
from feddg.federation.integrity import (
    LossGuard,
    NormBound,
    cap_examples,
    non_finite,
    robust_problem,
    robust_replies,
)
from feddg.federation.provenance import write_provenance
from feddg.federation.rounds import learning_rate
from feddg.federation.setup import Federation
from feddg.federation.validation import (
    RunStopped,
    check_reply,
    check_setup_replies,
    outliers,
    shapes_of,
    update_norm,
)
from feddg.federation.weight_privacy import WeightPrivacy
from feddg.messages import Message, message_nbytes, weights_of
from feddg.reproducibility import check_pinned

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
#: the client id under which a securely aggregated round's one reply (the clients' weighted mean) is checked
AGGREGATE = -1
RESULTS = "results.json"
CONFIG = "config.yaml"
#: the Flower simulation's folder of its virtual SuperNodes' client states (what a deployed node keeps in its
#: ``state-dir``: engines/flower/node_state.py), so a resumed simulation continues with them
NODE_STATE = "node-state"


def default_run_dir(cfg: ExperimentConfig) -> Path:
    """``output_dir/<name>-<method>-<target>-s<seed>-<time>``."""
    s = cfg.split
    target = (f"{s.target_fraction:g}-of-domains" if s.target_fraction is not None
              else "+".join(s.target) if isinstance(s.target, list) else s.target or "first")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cfg.output_dir) / f"{cfg.name}-{cfg.method.name}-{target}-s{cfg.seed}-{stamp}"


def _clear_text_problem(examples: dict[int, Any], losses: dict[int, Any], expected: dict[int, int]) -> str | None:
    """Why a secure aggregate's clear-text counts and losses refuse it (:meth:`Server.receive_aggregate`), or None."""
    for cid, n in examples.items():
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n <= 0:
            return f"client {cid} claimed num_examples={n!r}, not a positive int"
        if n > expected[cid]:
            return (f"client {cid} claimed num_examples={n} > its {expected[cid]} training examples: a secure "
                    "aggregate cannot be re-weighted")
        loss = losses.get(cid)
        if isinstance(loss, bool) or not isinstance(loss, int | float | np.number) or not math.isfinite(loss):
            return f"client {cid} sent train_loss={loss!r}, not a finite number"
    return None


def used_run_dir(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a file or a folder with anything in it: a new run writes neither over another run's
    files nor over its mark."""
    return run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir()))


@dataclass
class RoundFold:
    """A round in progress: the topology's accumulator and per-reply scalars. Replies are held only
    with ``federation.reject_outliers`` or a robust ``federation.aggregation`` (``held``: the decision needs
    the whole round)."""

    sent: dict[int, Message]
    expected: dict[int, int]
    bytes_down: int
    acc: Any = None
    held: list[Reply] | None = None
    norms: dict[int, float] = field(default_factory=dict)
    states: dict[int, Message] = field(default_factory=dict)  # new client states, kept for accepted clients only
    accepted: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    capped: dict[int, int] = field(default_factory=dict)  # client -> the num_examples it claimed beyond its data
    examples: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    bytes_up: int = 0
    seconds: float = 0.0


class Server:
    """Server-side state of one run, resumable from its run directory."""

    def __init__(self, fed: Federation, run_dir: str | Path, *, resume: bool = False) -> None:
        check_pinned(fed.cfg.reproducibility)
        self.fed = fed
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = load_checkpoint(self.run_dir) if resume else None
        budget = fed.cfg.federation.client_state_budget_mb
        budget_bytes = None if budget is None else int(budget * 2**20)
        self.client_states: ClientStore
        if ckpt is None:
            cfg = fed.cfg
            self.stores = ClientStores(self.run_dir / STORE_DIR, budget_bytes)
            example = to_device(fed.dataset.get_batch(np.arange(1), train=False)[0], fed.device)
            ctx = ServerContext(len(fed.clients), self.rounds, cfg.seed, self.stores.open, example)
            self.state = fed.topology.init(fed.method, fed.model, ctx)
            self.client_states = self.stores.open("client_states")
            self.metrics: list[dict[str, Any]] = []
            self.round = 0
            self.setup_done = False
            self.commits: dict[int, int] = {}
            self.run_key = secrets.token_hex(8)
            (self.run_dir / CONFIG).write_text(dump_config(cfg))
            write_provenance(self.run_dir, cfg)
        else:
            self.stores, self.state, self.client_states = restore(ckpt, self.run_dir, budget_bytes)
            self.metrics = ckpt["metrics"]
            self.round = ckpt["round"]
            self.setup_done = ckpt["setup_done"]
            self.commits = dict(ckpt.get("commits", {}))  # older checkpoints: none kept
            self.run_key = ckpt.get("run_key") or secrets.token_hex(8)
        #: client -> the last round whose reply was folded into a kept (not rolled-back) round; as of the last
        #: checkpoint in ``saved_commits``. A Flower node keeps the client state of that round (engines/flower).
        self.saved_commits = dict(self.commits)
        self.saved_round: int | None = ckpt["round"] if ckpt is not None else None
        self.setup_sent: Message | None = None  # the setup request, once made (its replies are checked against it)
        fc = fed.cfg.federation
        reference = ckpt.get("norm_reference") if ckpt is not None else None  # older checkpoints: none yet
        self.norm_bound = (NormBound(fc.update_norm_factor, reference)
                           if fc.update_norm_factor is not None and fed.method.averages_weights else None)
        self.loss_guard = (None if fc.rollback_loss_factor is None
                           else LossGuard(fc.rollback_loss_factor, ckpt.get("loss_reference") if ckpt else None))
        self.warned_caps: set[int] = set()
        self.declared = shapes_of(weights_of(fed.model))  # what a reply's w/ arrays may be
        self.evaluator = Evaluator(fed)
        dp = fed.cfg.dp_weights  # DP-FedAvg on the weight replies (docs/privacy.md, "DP on the weights")
        self.dp = None if dp is None else WeightPrivacy(dp, len(fed.clients), fc.client_fraction,
                                                        fed.noise_key,
                                                        ckpt.get("dp_weights_clip") if ckpt is not None else None,
                                                        ckpt.get("dp_weights_uncovered") if ckpt is not None else None)
        if self.dp is not None and any(k.endswith("running_var") for k in self.declared):
            log.warning("dp_weights: the model's BatchNorm running statistics are part of each clipped update and take "
                        "the noise (a noised variance can go negative); model cnn_gn or lenet has none "
                        "(docs/privacy.md, 'DP on the weights')")
        self._rewrite_metrics()

    # --- setup exchange ----------------------------------------------------------------
    def setup_request(self) -> Message | None:
        """The one-time setup message for every client, if the method has one and it is pending."""
        self.setup_sent = None if self.setup_done else self.fed.topology.setup_request(self.fed.method, self.state)
        return self.setup_sent

    def finish_setup(self, replies: list[Reply]) -> None:
        """Check every setup reply against the method's layout (the exchange needs every client: one that fails
        stops the run in one line, before the method stacks them), then hand them to the method. Under
        ``dp_weights`` their payloads are outside the guarantee (``not_covered``) unless the method's own ``dp:``
        noises them."""
        layout = self.fed.method.setup_layout(self.fed.model, self.setup_sent or {}, self.declared)
        if problems := check_setup_replies({r.client_id: r.message for r in replies}, layout):
            raise RunStopped("setup exchange: " + "; ".join(f"client {c}: {why}" for c, why in sorted(problems.items())))
        if self.dp is not None and getattr(self.fed.method.params, "dp", None) is None:  # else the method's own DP
            for r in replies:
                self.dp.note_clear(r.message, "setup replies")
        self.state = self.fed.topology.server_setup(self.fed.method, self.state, replies)
        self.setup_done = True
        self.checkpoint()

    def mark_setup_done(self) -> None:
        self.setup_done = True

    # --- rounds ------------------------------------------------------------------------
    @property
    def rounds(self) -> int:
        """Engine rounds: the topology's rounds per server round × ``federation.rounds``."""
        return self.fed.topology.engine_rounds(self.fed.cfg.federation.rounds)

    def eval_due(self, round: int) -> bool:
        return self.fed.topology.eval_due(round, self.fed.cfg.eval.every, self.rounds)

    def lr(self, round: int) -> float:
        o = self.fed.cfg.optim
        return learning_rate(o.lr, o.schedule, round, self.rounds, o.step_size, o.gamma, o.warmup_rounds)

    def configure(self, round: int) -> dict[int, Message]:
        """The message for each client sampled in ``round``."""
        fed = self.fed
        sampled = fed.topology.sample(round, fed.cfg.federation.client_fraction, fed.cfg.seed)
        lr = self.lr(round)
        return {
            cid: {**fed.topology.client_config(fed.method, self.state, cid, round), "lr": lr, "round": round}
            for cid in sampled
        }

    def start_round(self, sent: dict[int, Message]) -> RoundFold:
        """The fold of a round whose messages ``sent`` are on their way."""
        fc = self.fed.cfg.federation
        if len(sent) < fc.min_clients:
            raise RunStopped(f"a round samples {len(sent)} clients, fewer than federation.min_clients="
                             f"{fc.min_clients}: lower it or raise federation.client_fraction")
        if (why := robust_problem(fc, len(sent))) is not None:
            raise RunStopped(why)
        expected = {cid: len(self.fed.clients[cid].train_idx) for cid in sent}  # = each client's num_examples
        if self.dp is not None:
            self.dp.begin()
        fold = RoundFold(sent, expected, bytes_down=int(sum(message_nbytes(m) for m in sent.values())))
        if fc.reject_outliers is None and fc.aggregation == "mean":
            fold.acc = self.fed.topology.start(self.fed.method, expected)
        else:
            fold.held = []
        return fold

    def receive(self, fold: RoundFold, reply: Reply, client_state: Message | None = None) -> None:
        """Check one reply and fold it in as it arrives (or drop it, with the reason); ``client_state`` is the
        client's new state, kept only if the reply is accepted. The server keeps no reply beyond what the
        method keeps, except with ``reject_outliers``."""
        t0 = time.perf_counter()
        cid, sent = reply.client_id, fold.sent[reply.client_id]
        fold.bytes_up += message_nbytes(reply.message)
        beside = self.fed.topology.reply_layout(self.fed.method, self.fed.model, sent, self.declared)
        problem = check_reply(reply.message, sent, self.declared, all_weights=self.fed.method.averages_weights,
                              beside=beside)
        norm = None
        if problem is None and (self.norm_bound is not None or fold.held is not None):
            norm = update_norm(reply.message, sent)
            problem = self.norm_bound.check(norm, sent) if self.norm_bound is not None else None
        if problem is not None:
            self.fail(fold, cid, problem)
        else:
            reply, claimed = cap_examples(reply, fold.expected[cid])
            if claimed is not None:
                fold.capped[cid] = claimed
            if client_state is not None:
                fold.states[cid] = client_state
            if self.dp is not None:
                reply = self.dp.clip_reply(reply, sent)
            if fold.held is None:
                self._fold(fold, reply)
            else:
                fold.held.append(reply)
            if norm is not None:
                fold.norms[cid] = norm
        fold.seconds += time.perf_counter() - t0

    def receive_aggregate(self, fold: RoundFold, weights: Message, examples: dict[int, Any],
                          losses: dict[int, Any]) -> None:
        """A securely aggregated round (Flower's SecAgg+, docs/flower.md "Secure aggregation"): only the
        ``num_examples``-weighted mean ``weights`` of the clients in ``examples`` arrives, with each client's
        claimed count and train loss in the clear. The mean is checked and folded as one reply (client
        :data:`AGGREGATE`) weighing their total, so every integrity check sees the aggregate only; a claim above a
        client's data refuses the aggregate (the weight inside a secure sum cannot be corrected), and so does a
        count that is not a positive int or a train loss that is not a finite number."""
        if (why := _clear_text_problem(examples, losses, fold.expected)) is not None:
            self.fail(fold, AGGREGATE, why)
            return
        first = next(iter(examples))
        fold.sent[AGGREGATE], fold.expected[AGGREGATE] = fold.sent[first], sum(examples.values())
        try:
            fold.acc = self.fed.topology.start(self.fed.method, {AGGREGATE: fold.expected[AGGREGATE]})
            loss = float(np.average([losses[c] for c in examples], weights=list(examples.values())))
            self.receive(fold, Reply(AGGREGATE, {**weights, "num_examples": fold.expected[AGGREGATE],
                                                 "train_loss": loss}))
        finally:
            del fold.sent[AGGREGATE], fold.expected[AGGREGATE]
        if fold.accepted == [AGGREGATE]:  # the round's figures count the clients behind the aggregate
            fold.accepted, fold.examples = list(examples), list(examples.values())
            fold.losses = [losses[c] for c in examples]
            if AGGREGATE in fold.norms:
                fold.norms = dict.fromkeys(examples, fold.norms[AGGREGATE])

    def fail(self, fold: RoundFold, client_id: int, reason: str) -> None:
        """Client ``client_id`` gave no usable reply this round (raised, timed out, died, failed a check)."""
        fold.failed[client_id] = reason

    def _fold(self, fold: RoundFold, reply: Reply) -> None:
        fold.acc = self.fed.topology.accumulate(self.fed.method, fold.acc, reply)
        fold.accepted.append(reply.client_id)
        fold.examples.append(reply.num_examples)
        fold.losses.append(float(reply.message.get("train_loss", np.nan)))

    def _fold_held(self, fold: RoundFold) -> dict[int, str]:
        """Drop the held replies whose update norm is an outlier, then fold the others in the order sent,
        normalised by their own example total (the same bits as a round without the dropped clients); a robust
        ``federation.aggregation`` decides what is folded. Returns the replies it left out, with why."""
        fc = self.fed.cfg.federation
        assert fold.held is not None
        rejected = {} if fc.reject_outliers is None else outliers(fold.norms, fc.reject_outliers)
        fold.failed.update(rejected)
        position = {cid: i for i, cid in enumerate(fold.sent)}
        kept = sorted((r for r in fold.held if r.client_id not in rejected), key=lambda r: position[r.client_id])
        fold.held = None
        left_out: dict[int, str] = {}
        if kept and fc.aggregation != "mean":
            kept, left_out = robust_replies(kept, fc)
        if kept:
            fold.acc = self.fed.topology.start(self.fed.method, {r.client_id: fold.expected[r.client_id] for r in kept})
        for reply in kept:
            self._fold(fold, reply)
        return left_out

    def finish_round(self, round: int, fold: RoundFold, timings: dict[str, float]) -> dict[str, Any]:
        """Finish the fold, evaluate when due, record metrics and checkpoint; returns this round's metrics.

        Raises :class:`RunStopped` (nothing of the round recorded) when fewer than ``federation.min_clients``
        replies are left."""
        t0 = time.perf_counter()
        fc = self.fed.cfg.federation
        left_out = self._fold_held(fold) if fold.held is not None else {}
        failed = {cid: fold.failed[cid] for cid in sorted(fold.failed)}
        for cid, reason in failed.items():
            log.warning("round %d: client %d dropped: %s", round, cid, reason)
        if len(fold.accepted) < fc.min_clients:
            raise RunStopped(self._stop_reason(round, fold, failed))
        dp_metrics = {} if self.dp is None else self.dp.add_noise(fold.acc, round, fold.examples, len(fold.sent))
        state, method_metrics = self.fed.topology.finish(self.fed.method, self.state, fold.acc, round)
        rollback = None if (where := non_finite(state)) is None else f"NaN or Inf in {where}"
        loss = None
        if rollback is None and self.loss_guard is not None:
            loss = self.evaluator.holdout_loss(state)
            rollback = self.loss_guard.check(loss)
        if rollback is None:  # a rolled-back round keeps the previous model, client states and norm reference
            self.state = state
            for cid in fold.accepted:
                if cid in fold.states:
                    self.client_states[cid] = fold.states[cid]
                self.commits[cid] = round
            if self.norm_bound is not None:
                self.norm_bound.update([fold.norms[cid] for cid in fold.accepted if cid in fold.norms])
            if self.dp is not None:
                self.dp.commit()
            if self.loss_guard is not None and loss is not None:
                self.loss_guard.update(loss)
        else:
            log.warning("round %d rolled back to the previous global model: %s", round, rollback)
        row: dict[str, Any] = {
            "round": round,
            "lr": self.lr(round),
            "clients": len(fold.examples),
            "train_loss": float(np.average(fold.losses, weights=np.array(fold.examples, dtype=np.float64))),
            "bytes_down": fold.bytes_down,
            "bytes_up": fold.bytes_up,
            **timings,
            "time_aggregate_s": fold.seconds + time.perf_counter() - t0,
            **method_metrics,
            **dp_metrics,
        }
        if failed:  # absent: every sampled client's reply was folded in
            row["clients_failed"] = len(failed)
            row["clients_failed_reasons"] = {str(cid): reason for cid, reason in failed.items()}
        if left_out:
            row["clients_left_out"] = {str(cid): reason for cid, reason in sorted(left_out.items())}
        if fold.capped:
            row["num_examples_capped"] = {str(cid): claim for cid, claim in sorted(fold.capped.items())}
            for cid in sorted(set(fold.capped) - self.warned_caps):
                log.warning("client %d claimed num_examples=%d but holds %d training examples: capped (logged once "
                            "per client; metrics.jsonl num_examples_capped)", cid, fold.capped[cid], fold.expected[cid])
            self.warned_caps.update(fold.capped)
        if rollback is not None:
            row["rolled_back"] = True
            row["rollback_reason"] = rollback
        if loss is not None:
            row["holdout_loss"] = loss
        if self.eval_due(round):
            t1 = time.perf_counter()
            figures = self.evaluator.evaluate(self.state)
            kept = None if self.fed.cfg.eval.per_domain else self.evaluator.aggregate_keys()
            row.update(figures if kept is None else {k: v for k, v in figures.items() if k in kept})
            row["time_eval_s"] = time.perf_counter() - t1
        engine_times = (*timings, "time_aggregate_s", "time_eval_s")  # a method's own time_* metrics are not summed
        row["time_round_s"] = sum(row[k] for k in engine_times if k in row)
        self.metrics.append(row)
        self.round = round
        with open(self.run_dir / METRICS, "a") as f:
            f.write(json.dumps(row) + "\n")
        if round % fc.checkpoint_every == 0 or round == self.rounds:
            self.checkpoint()
        return row

    def _stop_reason(self, round: int, fold: RoundFold, failed: dict[int, str]) -> str:
        reasons = "; ".join(f"client {cid}: {reason}" for cid, reason in list(failed.items())[:3])
        reasons += f"; {len(failed) - 3} more in the log" if len(failed) > 3 else ""
        kept = ("nothing was checkpointed yet" if self.saved_round is None
                else f"the last checkpoint (round {self.saved_round}) is intact")
        return (f"round {round}: {len(fold.accepted)} of {len(fold.sent)} clients replied usably, fewer than "
                f"federation.min_clients={self.fed.cfg.federation.min_clients} ({reasons}); stopped, {kept}: "
                f"feddg run --resume {self.run_dir} continues from it")

    # --- persistence -------------------------------------------------------------------
    def checkpoint(self) -> None:
        """checkpoint.pt; per-client stores go in as their index (spilled entries by file: client_store.py)."""
        index = self.stores.index()
        save_checkpoint(
            self.run_dir,
            {
                "round": self.round,
                "setup_done": self.setup_done,
                "commits": self.commits,
                "run_key": self.run_key,
                "server_state": self.stores.detach(self.state),
                "client_states": self.stores.detach(self.client_states),
                "client_store": index,
                "metrics": self.metrics,
                "norm_reference": None if self.norm_bound is None else self.norm_bound.reference,
                **({} if self.loss_guard is None else {"loss_reference": self.loss_guard.best}),
                **({} if self.dp is None else {"dp_weights_clip": self.dp.clip,
                                               "dp_weights_uncovered": sorted(self.dp.uncovered)}),
            },
        )
        self.stores.saved(index)
        self.saved_round = self.round
        self.saved_commits = dict(self.commits)

    def _rewrite_metrics(self) -> None:
        """metrics.jsonl = exactly the checkpointed rounds (drops rows of a round that crashed)."""
        lines = "".join(json.dumps(m) + "\n" for m in self.metrics)
        (self.run_dir / METRICS).write_text(lines)

    def write_results(self) -> dict[str, Any]:
        """results.json: the task and the last evaluation (every domain's figures, the samples behind them),
        totals, and what the run was."""
        fed = self.fed
        last: dict[str, Any] = next((m for m in reversed(self.metrics) if self.evaluator.headline in m), {})
        if last and not fed.cfg.eval.per_domain:  # metrics.jsonl kept the means only: the final figures again
            last = self.evaluator.evaluate(self.state)
        results = {
            "method": fed.method.name,
            **({"method_label": f"{fed.method.name} (reconstructed)"} if fed.method.reconstructed else {}),
            "method_params": fed.method.params.model_dump(mode="json"),
            "dataset": fed.dataset.name,
            "target": [fed.dataset.domains[d] for d in fed.split.test_domains],
            "val_domain": [fed.dataset.domains[d] for d in fed.split.val_domains],
            "source": [fed.dataset.domains[d] for d in fed.split.source_domains],
            "seed": fed.cfg.seed,
            "rounds": self.round,
            "num_clients": len(fed.clients),
            **self.evaluator.results(last),
            "failures": failure_record(self.metrics),
            "bytes_up_total": int(sum(m["bytes_up"] for m in self.metrics)),
            "bytes_down_total": int(sum(m["bytes_down"] for m in self.metrics)),
            "time_total_s": float(sum(m.get("time_round_s", 0.0) for m in self.metrics)),
            "bytes_per_round": bytes_per_round(self.metrics),
        }
        results.update(fed.topology.results(fed.method, self.metrics))
        if fed.extra:  # what the extra/<name>_<metric> keys of "final" were measured on
            results["extra"] = {t.name: {"dataset": t.dataset.name, "domains": t.dataset.domains} for t in fed.extra}
        results.update({"privacy": p} if (p := fed.method.privacy(self.round)) is not None else {})
        results.update({} if self.dp is None else {"weights_privacy": self.dp.record(self.round)})
        (self.run_dir / RESULTS).write_text(json.dumps(results, indent=2))
        return results


def failure_record(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """results.json's ``failures``: the rounds that dropped clients, each dropped client's rounds and reasons, and
    how many client-rounds were lost (0: every sampled client's reply was folded in, every round)."""
    dropped: dict[str, list[dict[str, Any]]] = {}
    rounds = []
    for row in rows:
        if reasons := row.get("clients_failed_reasons"):
            rounds.append(row["round"])
            for cid, why in reasons.items():
                dropped.setdefault(str(cid), []).append({"round": row["round"], "reason": why})
    return {"rounds": rounds, "clients": dropped, "client_rounds_lost": sum(len(v) for v in dropped.values())}


