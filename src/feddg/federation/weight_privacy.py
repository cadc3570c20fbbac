"""DP-FedAvg on the weight replies as the server runs it (``dp_weights:``; docs/privacy.md, "DP on the weights"):
every accepted reply's update is clipped before the method folds it in, Gaussian noise goes into the round's running
weighted sum before the method finishes the round, and with adaptive clipping the clip norm moves after each round.
Both engines share :class:`~feddg.federation.server.Server`, so both get it; the formulas are
``feddg.aggregation.dp_weights``'s, the run's ε ``feddg.aggregation.accounting``'s."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from feddg.aggregation.accounting import dp_fedavg_epsilon
from feddg.aggregation.dp_weights import adaptive_noise, clip_update, gaussian_noise, next_clip, noise_std
from feddg.aggregation.mean import WeightedSum
from feddg.algorithms.base import Accumulator, Reply
from feddg.config import WeightDPConfig
from feddg.federation.rounds import sample_size
from feddg.messages import WEIGHT_PREFIX, Message
from feddg.seeds import derived_seed

log = logging.getLogger(__name__)

#: the purpose key of a round's noise stream: ``derived_seed(seed, round, NOISE_STREAM)``
NOISE_STREAM = 1_000_033
#: reply keys not listed as uncovered: ``num_examples`` (the server knows each partition's size) and ``train_loss``,
#: one unnoised number per client and round that every method sends (docs/privacy.md says so; not_covered lists
#: the payloads beyond these)
PLAIN_KEYS = frozenset({"num_examples", "train_loss"})


class WeightPrivacy:
    """The run's DP-FedAvg: the current clip norm (checkpointed), the round's unclipped count, and the reply
    payloads the guarantee does not cover (anything but ``w/``, ``num_examples``, ``train_loss``; the setup
    exchange's too, unless the method noises them under its own ``dp:``)."""

    def __init__(self, cfg: WeightDPConfig, num_clients: int, fraction: float, seed: int,  # seeds.noise_seed
                 clip: float | None = None, uncovered: list[str] | None = None) -> None:
        self.cfg = cfg
        self.num_clients = num_clients
        self.sampled = sample_size(num_clients, fraction)  # m, as sample_members draws them
        self.seed = seed
        self.clip = cfg.clip if clip is None else clip
        count_std = None if cfg.adaptive is None else cfg.adaptive.count_std
        self.count_std, self.z_weights = (adaptive_noise(cfg.noise_multiplier, self.sampled, count_std)
                                          if cfg.adaptive is not None else (0.0, cfg.noise_multiplier))
        self.unclipped = 0
        self.next = self.clip
        self.uncovered: set[str] = set(uncovered or ())  # checkpointed: a resumed run reports the whole run's

    def begin(self) -> None:
        self.unclipped = 0

    def clip_reply(self, reply: Reply, sent: Message) -> Reply:
        """``reply`` with its update clipped to the current norm (counted when it was within it)."""
        msg, norm = clip_update(reply.message, sent, self.clip)
        self.unclipped += int(norm <= self.clip)
        self.note_clear(msg, "replies")
        return Reply(reply.client_id, msg)

    def note_clear(self, msg: Message, what: str) -> None:
        """Record the key prefixes of ``msg`` the guarantee does not cover (warned once per new prefix): round
        replies' payloads beside ``w/``, and the setup replies' (``what`` names which, for the warning)."""
        if extra := {k.split("/")[0] for k in msg if not k.startswith(WEIGHT_PREFIX) and k not in PLAIN_KEYS}:
            if extra - self.uncovered:
                log.warning("dp_weights covers the w/ arrays only: %s also carry %s in the clear", what,
                            ", ".join(sorted(extra)))
            self.uncovered |= extra

    def add_noise(self, acc: Any, round: int, examples: list[int], sampled: int) -> dict[str, float]:
        """Gaussian noise of std ``z_Δ · C · max_k p_k`` into the round's weighted sum (so that its mean gets exactly
        the noise), then the adaptive clip's next value; returns the round's ``dp_weights/`` metrics."""
        if not (isinstance(acc, Accumulator) and isinstance(acc.weights, WeightedSum)):
            raise ValueError("dp_weights: the method's round has no running weighted sum of the weights to noise")
        sums = acc.weights
        std = noise_std(self.z_weights, self.clip, examples)
        rng = np.random.default_rng(derived_seed(self.seed, round, NOISE_STREAM))
        if std > 0:
            floats = {k: s for k, s in sums.sums.items() if np.issubdtype(sums.dtypes[k], np.floating)}
            factor = sums.total / sums.scale  # mean() multiplies by scale / total
            for k, noise in gaussian_noise(floats, std, rng).items():
                sums.sums[k] += noise if factor == 1.0 else noise * factor
        metrics = {"dp_weights/clip": self.clip, "dp_weights/noise_std": std}
        if (adaptive := self.cfg.adaptive) is not None:
            count = self.unclipped + (rng.normal(0.0, self.count_std) if self.count_std > 0 else 0.0)
            self.next = next_clip(self.clip, count, sampled, adaptive.target_quantile, adaptive.clip_lr)
            metrics["dp_weights/unclipped_noised"] = count / sampled
        return metrics

    def commit(self) -> None:
        """The round was kept (not rolled back): the adaptive clip moves to its next value."""
        self.clip = self.next

    def record(self, rounds_done: int) -> dict[str, Any]:
        """results.json's ``weights_privacy``: ε at δ over ``rounds_done`` rounds of ``m`` of ``K`` clients sampled
        without replacement (:func:`~feddg.aggregation.accounting.dp_fedavg_epsilon`; ``null`` with no noise), and
        what it was computed from. Each round's noise std is metrics.jsonl's ``dp_weights/noise_std``."""
        cfg, z = self.cfg, self.cfg.noise_multiplier
        return {
            "epsilon": (dp_fedavg_epsilon(z, self.num_clients, self.sampled, rounds_done, cfg.delta, cfg.accountant)
                        if z > 0 else None),
            "delta": cfg.delta,
            "noise_multiplier": z,
            "noise_multiplier_weights": self.z_weights,
            "noise_multiplier_accounted": z / 2,  # replacing one client moves the mean by up to 2·C·max p_k
            "neighboring": "replace-one",
            "clip": cfg.clip,
            "clip_final": self.clip,
            "adaptive": cfg.adaptive is not None,
            "clients": self.num_clients,
            "sampled": self.sampled,
            "sampling_rate": self.sampled / self.num_clients,
            "releases": rounds_done,
            "accountant": cfg.accountant,
            "unit": "client",
            "not_covered": sorted(self.uncovered),
        }
