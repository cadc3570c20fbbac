"""What keeps one client from taking over the global model (docs/reliability.md, "A client cannot take over the
model"): its example count is capped at what the server knows it holds, its update norm is bounded by the honest
clients' recent norms, a robust rule may replace the mean, and a non-finite aggregate (or, with
``federation.rollback_loss_factor``, one whose evaluated loss explodes) is rolled back."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from feddg.aggregation.robust import coordinate_median, krum_select, trimmed_mean
from feddg.algorithms.base import Reply
from feddg.config import FederationConfig
from feddg.messages import WEIGHT_PREFIX, Message


def weights_norm(msg: Message) -> float:
    """``‖w‖`` over the float ``w/`` arrays of ``msg``, in float64."""
    total = 0.0
    for key, value in msg.items():
        if key.startswith(WEIGHT_PREFIX) and np.asarray(value).dtype.kind == "f":
            flat = np.asarray(value, dtype=np.float64).ravel()
            total += float(flat @ flat)
    return math.sqrt(total)


@dataclass
class NormBound:
    """``‖w_k − w_sent‖ ≤ factor × reference``: the reference is the median of the previous completed round's
    accepted update norms (one client cannot move a median far), or ``‖w_sent‖`` before any (round 1, or a
    median of 0). Streams: it needs nothing of the current round but the reply at hand."""

    factor: float
    reference: float | None = None

    def limit(self, sent: Message) -> float:
        return self.factor * (self.reference if self.reference else weights_norm(sent))

    def check(self, norm: float, sent: Message) -> str | None:
        """Why an update of norm ``norm`` from weights ``sent`` is refused, or ``None``."""
        limit = self.limit(sent)
        if norm <= limit:
            return None
        of = f"median {self.reference:.4g} of the last round" if self.reference else "|w_sent|"
        return f"update norm {norm:.4g} > {self.factor:g} x {of} (federation.update_norm_factor)"

    def update(self, accepted_norms: list[float]) -> None:
        """After a completed round (not rolled back): the median of its accepted replies' norms."""
        if accepted_norms:
            self.reference = float(np.median(accepted_norms))


@dataclass
class LossGuard:
    """``loss > factor × best``: the round's evaluated loss against the lowest evaluated loss of an applied round
    (``None`` before the first: round 1 is never refused by it). The best, not the previous, so that a slow
    climb of small steps is still measured from the model before it."""

    factor: float
    best: float | None = None

    def check(self, loss: float) -> str | None:
        """Why a round whose new model has evaluated loss ``loss`` is rolled back, or ``None``."""
        if not math.isfinite(loss):
            return f"evaluated loss {loss}"
        if self.best is None or loss <= self.factor * self.best:
            return None
        return (f"evaluated loss {loss:.4g} > {self.factor:g} x best {self.best:.4g} "
                "(federation.rollback_loss_factor)")

    def update(self, loss: float) -> None:
        """After an applied round."""
        self.best = loss if self.best is None else min(self.best, loss)


def cap_examples(reply: Reply, known: int) -> tuple[Reply, int | None]:
    """``reply`` with ``num_examples`` at most ``known`` (the client's training examples, from the partition),
    and the claim when it was larger (else ``None``)."""
    claimed = reply.num_examples
    if claimed <= known:
        return reply, None
    return Reply(reply.client_id, {**reply.message, "num_examples": known}), claimed


def robust_problem(fc: FederationConfig, sampled: int) -> str | None:
    """Why ``fc.aggregation`` would be no defence with ``sampled`` replies a round, in one line: Krum's f attackers
    without an honest majority (its guarantee needs n > 2f + 2; between the two it runs, as Flower's does),
    ``multi_krum`` keeping every reply, or ``trimmed_mean`` cutting none (both the plain mean); ``None``
    otherwise."""
    if fc.aggregation == "trimmed_mean" and int(fc.trim_fraction * sampled) == 0:
        return (f"federation.trim_fraction={fc.trim_fraction:g} cuts nothing among the {sampled} replies a round "
                f"samples (int({fc.trim_fraction:g} x {sampled}) = 0): the plain mean, no defence; set it to at "
                f"least 1/{sampled}")
    if fc.aggregation not in ("krum", "multi_krum"):
        return None
    if 2 * fc.krum_malicious >= sampled:
        return (f"federation.krum_malicious={fc.krum_malicious} attackers among the {sampled} replies a round samples "
                "leave no honest majority for federation.aggregation=" + fc.aggregation)
    if fc.aggregation == "multi_krum" and _krum_keep(fc, sampled) >= sampled:
        return (f"federation.krum_keep={fc.krum_keep} with krum_malicious={fc.krum_malicious} keeps all {sampled} "
                "replies a round samples: the plain mean, no defence; keep fewer (0: replies - krum_malicious)")
    return None


def _krum_keep(fc: FederationConfig, n: int) -> int:
    """How many replies ``multi_krum`` keeps of ``n`` (``krum`` one): ``krum_keep``, or ``n − f`` where it is 0."""
    keep = 1 if fc.aggregation == "krum" else (fc.krum_keep or n - fc.krum_malicious)
    return min(max(keep, 1), n)


def robust_replies(replies: list[Reply], fc: FederationConfig) -> tuple[list[Reply], dict[int, str]]:
    """What the method folds under ``fc.aggregation`` (not ``mean``), and the replies left out with why.

    median / trimmed_mean: every reply, each carrying the round's robust ``w/`` arrays (the weighted mean of
    equal arrays is that array); krum / multi_krum: the selected replies, unchanged."""
    messages = [r.message for r in replies]
    if fc.aggregation in ("median", "trimmed_mean"):
        robust = (coordinate_median(messages, WEIGHT_PREFIX) if fc.aggregation == "median"
                  else trimmed_mean(messages, WEIGHT_PREFIX, fc.trim_fraction))
        return [Reply(r.client_id, {**r.message, **robust}) for r in replies], {}
    chosen = set(krum_select(messages, WEIGHT_PREFIX, fc.krum_malicious, _krum_keep(fc, len(replies))))
    left_out = {r.client_id: f"not selected by {fc.aggregation} (federation.aggregation)"
                for i, r in enumerate(replies) if i not in chosen}
    return [r for i, r in enumerate(replies) if i in chosen], left_out


def non_finite(tree: Any, path: str = "state") -> str | None:
    """The path of the first float array holding NaN or Inf in a server state (dicts, lists, tuples), or ``None``."""
    if isinstance(tree, np.ndarray):
        return None if tree.dtype.kind not in "fc" or np.isfinite(tree).all() else path
    if type(tree) in (dict, list, tuple):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        for key, value in items:
            if (found := non_finite(value, f"{path}/{key}" if path else str(key))) is not None:
                return found
    return None
