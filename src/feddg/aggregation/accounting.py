"""ε of a whole run: the Gaussian releases of a statistic composed by Google's ``dp-accounting`` package.

Every release is the Gaussian mechanism with noise multiplier ``z = σ / Δ`` (``Δ`` the L2 sensitivity);
``k`` releases are composed adaptively by

* ``rdp``: Rényi DP (Mironov 2017), ``ε(α) = k α / (2 z²)`` at each order ``α``, converted to ``(ε, δ)``
  with Canonne et al. 2020 (Prop. 12) and minimised over the package's default orders;
* ``pld``: privacy loss distributions (Meiser & Mohammadi 2018; Koskela et al. 2020), tighter.

Clients are assumed to take part in every round (no privacy amplification by client sampling is claimed),
so the count is an upper bound on any client's releases — except for DP-FedAvg on the weights
(:func:`dp_fedavg_epsilon`), whose clients are sampled. ``docs/privacy.md``.
"""

from __future__ import annotations

from typing import Any

from dp_accounting import DpEvent, GaussianDpEvent, NeighboringRelation, SampledWithoutReplacementDpEvent
from dp_accounting.pld import PLDAccountant
from dp_accounting.privacy_accountant import PrivacyAccountant
from dp_accounting.rdp import RdpAccountant

from feddg.aggregation.dp import Accountant, StatisticDP


def _accountant(name: Accountant, relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE
                ) -> PrivacyAccountant:
    if name == "rdp":
        return RdpAccountant(neighboring_relation=relation)
    if name == "pld":
        return PLDAccountant(neighboring_relation=relation)
    raise ValueError(f"unknown accountant {name!r}; expected 'rdp' or 'pld'")


def _epsilon(event: DpEvent, noise_multiplier: float, releases: int, delta: float, accountant: Accountant,
             relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE) -> float:
    """ε at ``delta`` of ``event`` composed ``releases`` times (arguments checked first)."""
    if not (noise_multiplier > 0 and releases >= 0 and 0 < delta < 1):
        raise ValueError(f"need noise_multiplier > 0, releases >= 0, 0 < delta < 1; got {noise_multiplier}, "
                         f"{releases}, {delta}")
    if releases == 0:
        return 0.0
    acc = _accountant(accountant, relation)
    if not acc.supports(event):
        raise ValueError(f"the {accountant} accountant of dp-accounting cannot compose {type(event).__name__}")
    acc.compose(event, releases)
    return float(acc.get_epsilon(delta))


def gaussian_epsilon(noise_multiplier: float, releases: int, delta: float, accountant: Accountant = "rdp") -> float:
    """ε at ``delta`` of ``releases`` adaptive Gaussian releases with noise multiplier ``σ/Δ``."""
    return _epsilon(GaussianDpEvent(noise_multiplier), noise_multiplier, releases, delta, accountant)


def dp_fedavg_epsilon(noise_multiplier: float, clients: int, sampled: int, rounds: int, delta: float,
                      accountant: Accountant = "rdp") -> float:
    """ε at ``delta`` of DP-FedAvg as feddg runs it (:mod:`feddg.federation.weight_privacy`): each round ``sampled``
    of ``clients`` drawn uniformly without replacement, their clipped updates' weighted mean ``Σ_k p_k Δ_k`` noised
    with std ``z · C · max_k p_k``.

    Adjacency is replace-one (which fixed-size sampling needs; the clients' example counts, and so the weights, are
    the partition's, known to the server): replacing one client's update moves the mean by up to ``2 C p_k``, so the
    mechanism's noise multiplier is ``z / 2`` — with adaptive clipping too, whose split of ``z`` between the count
    (sensitivity 1 here) and the weights (Andrew et al. 2021, Thm. 1) keeps the two releases one Gaussian mechanism
    of multiplier ``z / 2``. Composed over ``rounds`` as ``SampledWithoutReplacementDpEvent`` (Wang, Balle and
    Kasiviswanathan 2019, Thm. 27; RDP only) or, with every client every round, the plain Gaussian."""
    if not 0 < sampled <= clients:
        raise ValueError(f"need 0 < sampled <= clients; got {sampled} of {clients}")
    # RDP's Gaussian ignores the relation: it gets the mechanism's z/2. PLD's REPLACE_ONE already moves the mean by
    # twice the event's sensitivity (its PLD of a Gaussian shifts both ways), so it gets z: z/2 would count the 2 twice
    base = GaussianDpEvent(noise_multiplier / 2 if accountant == "rdp" else noise_multiplier)
    event = base if sampled == clients else SampledWithoutReplacementDpEvent(clients, sampled, base)
    return _epsilon(event, noise_multiplier, rounds, delta, accountant, NeighboringRelation.REPLACE_ONE)


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
