"""ε of a whole run: the Gaussian releases of a statistic composed by Google's ``dp-accounting`` package.

Every release is the Gaussian mechanism with noise multiplier ``z = σ / Δ`` (``Δ`` the L2 sensitivity);
``k`` releases are composed adaptively by

* ``rdp``: Rényi DP (Mironov 2017), ``ε(α) = k α / (2 z²)`` at each order ``α``, converted to ``(ε, δ)``
  with Canonne et al. 2020 (Prop. 12) and minimised over the package's default orders;
* ``pld``: privacy loss distributions (Meiser & Mohammadi 2018; Koskela et al. 2020), tighter.

Clients are assumed to take part in every round (no privacy amplification by client sampling is claimed),
so the count is an upper bound on any client's releases. ``docs/privacy.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dp_accounting import DpEvent, GaussianDpEvent, PoissonSampledDpEvent
from dp_accounting.pld import PLDAccountant
from dp_accounting.privacy_accountant import PrivacyAccountant
from dp_accounting.rdp import RdpAccountant

from feddg.aggregation.dp import Accountant, StatisticDP


def _accountant(name: Accountant) -> PrivacyAccountant:
    if name == "rdp":
        return RdpAccountant()
    if name == "pld":
        return PLDAccountant()
    raise ValueError(f"unknown accountant {name!r}; expected 'rdp' or 'pld'")


def _not_converged(record: logging.LogRecord) -> bool:
    """False for dp-accounting's warning that an RDP order's series did not converge: the package leaves that order
    out of the minimum, so ε stays an upper bound; one warning per order and call was noise in a run's output."""
    return "failed to converge" not in record.getMessage()


@contextmanager
def _orders_left_out_quietly() -> Iterator[None]:
    absl = logging.getLogger("absl")
    absl.addFilter(_not_converged)
    try:
        yield
    finally:
        absl.removeFilter(_not_converged)


def _epsilon(event: DpEvent, noise_multiplier: float, releases: int, delta: float, accountant: Accountant) -> float:
    """ε at ``delta`` of ``event`` composed ``releases`` times (arguments checked first)."""
    if not (noise_multiplier > 0 and releases >= 0 and 0 < delta < 1):
        raise ValueError(f"need noise_multiplier > 0, releases >= 0, 0 < delta < 1; got {noise_multiplier}, "
                         f"{releases}, {delta}")
    if releases == 0:
        return 0.0
    acc = _accountant(accountant)
    with _orders_left_out_quietly():
        acc.compose(event, releases)
        return float(acc.get_epsilon(delta))


def gaussian_epsilon(noise_multiplier: float, releases: int, delta: float, accountant: Accountant = "rdp") -> float:
    """ε at ``delta`` of ``releases`` adaptive Gaussian releases with noise multiplier ``σ/Δ``."""
    return _epsilon(GaussianDpEvent(noise_multiplier), noise_multiplier, releases, delta, accountant)


def sampled_gaussian_epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float,
                             accountant: Accountant = "rdp") -> float:
    """ε at ``delta`` of ``steps`` Gaussian releases (multiplier ``σ/Δ``), each over a client sample of rate
    ``q``: ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` composed ``steps`` times (amplification by sampling,
    Mironov et al. 2019; at ``q = 1`` exactly :func:`gaussian_epsilon`). DP-FedAvg of the weight replies."""
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"need 0 < sampling_rate <= 1; got {sampling_rate}")
    event = PoissonSampledDpEvent(sampling_rate, GaussianDpEvent(noise_multiplier))
    return _epsilon(event, noise_multiplier, steps, delta, accountant)


def privacy_record(
    *, sigma: float, sensitivity: float, clip: float, releases: int, delta: float, accountant: Accountant, unit: str
) -> dict[str, Any]:
    """results.json's ``privacy``: the run's ε and what it was computed from (``unit``: whose data is
    protected, ``client`` or ``sample``)."""
    z = sigma / sensitivity
    return {
        "epsilon": gaussian_epsilon(z, releases, delta, accountant),
        "delta": delta,
        "sigma": sigma,
        "clip": clip,
        "sensitivity": sensitivity,
        "noise_multiplier": z,
        "releases": releases,
        "accountant": accountant,
        "unit": unit,
    }


def statistic_privacy(dp: StatisticDP, releases: int) -> dict[str, Any]:
    """:func:`privacy_record` of a client-level statistic release (``method.params.dp``)."""
    return privacy_record(sigma=dp.sigma(), sensitivity=dp.sensitivity, clip=dp.clip, releases=releases,
                          delta=dp.delta, accountant=dp.accountant, unit="client")
