"""Byzantine-robust combinations of a round's weight messages (one attacker cannot move the result far).

The rules Flower ships in ``flwr.server.strategy.aggregate`` (``aggregate_median``, ``aggregate_trimmed_avg``,
``aggregate_krum``), on feddg's messages and without the optional ``flwr`` dependency: the same numpy / scipy
operations (tests/test_integrity.py checks them against Flower's where it is installed). Krum returns *which*
replies it selects, so that the method's own fold averages them.

* coordinate-wise median and trimmed mean: Yin et al., "Byzantine-robust distributed learning", ICML 2018;
* Krum and Multi-Krum: Blanchard et al., "Machine learning with adversaries", NeurIPS 2017, §4.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
from scipy.stats import trim_mean

from feddg.messages import Value

Messages = Sequence[Mapping[str, Value]]


def _coordinate_wise(messages: Messages, prefix: str, rule: Callable[[np.ndarray], np.ndarray]) -> dict[str, np.ndarray]:
    """``rule`` over axis 0 of each ``prefix`` key's stacked arrays (float64), cast back (integers rounded)."""
    if not messages:
        raise ValueError("need at least one message")
    out = {}
    for key in (k for k in messages[0] if k.startswith(prefix)):
        first = np.asarray(messages[0][key])
        value = rule(np.stack([np.asarray(m[key], dtype=np.float64) for m in messages]))
        out[key] = np.rint(value).astype(first.dtype) if first.dtype.kind in "iub" else value.astype(first.dtype)
    return out


def coordinate_median(messages: Messages, prefix: str) -> dict[str, np.ndarray]:
    """Per coordinate, the median over the messages (the mean of the two middle values for an even count)."""
    return _coordinate_wise(messages, prefix, lambda a: np.median(a, axis=0))


def trimmed_mean(messages: Messages, prefix: str, fraction: float) -> dict[str, np.ndarray]:
    """Per coordinate, the mean after cutting ``int(fraction · n)`` values at each end (scipy's ``trim_mean``)."""
    if not 0 <= fraction < 0.5:
        raise ValueError(f"trim fraction must be in [0, 0.5), got {fraction}")
    return _coordinate_wise(messages, prefix, lambda a: np.asarray(trim_mean(a, fraction, axis=0)))


def krum_scores(messages: Messages, prefix: str, malicious: int) -> np.ndarray:
    """Krum's score of each message: the sum of its squared distances to its ``max(1, n − f − 2)`` nearest
    others, over the float ``prefix`` arrays (Blanchard et al. 2017, §4; Flower's ``num_closest``)."""
    keys = [k for k in messages[0] if k.startswith(prefix) and np.asarray(messages[0][k]).dtype.kind == "f"]
    flat = np.stack([np.concatenate([np.asarray(m[k], dtype=np.float64).ravel() for k in keys]) for m in messages])
    dist = np.full((len(flat), len(flat)), np.inf)
    for i in range(len(flat)):
        for j in range(i + 1, len(flat)):  # the differences themselves: no cancellation between close replies
            diff = flat[i] - flat[j]
            dist[i, j] = dist[j, i] = float(diff @ diff)
    closest = max(1, len(messages) - malicious - 2)
    return np.sort(dist, axis=1)[:, :closest].sum(axis=1)


def krum_select(messages: Messages, prefix: str, malicious: int, keep: int = 1) -> list[int]:
    """The indices of the ``keep`` messages of lowest Krum score, ascending (``keep=1``: Krum; more: Multi-Krum)."""
    if not 1 <= keep <= len(messages):
        raise ValueError(f"krum keeps between 1 and {len(messages)} replies, got {keep}")
    if len(messages) == 1:
        return [0]
    order = np.argsort(krum_scores(messages, prefix, malicious), kind="stable")
    return sorted(int(i) for i in order[:keep])
