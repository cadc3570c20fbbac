"""The explicit method registry: one line per method."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from feddg.algorithms.base import Method
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.fedfa import FedFA
from feddg.algorithms.fedprox import FedProx
from feddg.algorithms.fediir import FedIIR
from feddg.algorithms.fedsr import FedSR
from feddg.algorithms.pardon import Pardon
from feddg.algorithms.ccst import CCST
from feddg.algorithms.fpl import FPL
from feddg.algorithms.hfedf import HFedF
from feddg.algorithms.local_only import LocalOnly
from feddg.algorithms.pfedhn import PFedHN

METHODS: dict[str, type[Method]] = {
    FedAvg.name: FedAvg,
    FedFA.name: FedFA,
    FedProx.name: FedProx,
    FedIIR.name: FedIIR,
    FedSR.name: FedSR,
    Pardon.name: Pardon,
    CCST.name: CCST,
    FPL.name: FPL,
    HFedF.name: HFedF,
    LocalOnly.name: LocalOnly,
    PFedHN.name: PFedHN,
}


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {sorted(METHODS)}")
    return METHODS[name]


def create_method(name: str, params: Mapping[str, Any] | None = None) -> Method:
    """Instantiate a registered method with validated hyper-parameters."""
    cls = method_class(name)
    return cls(cls.Params(**dict(params or {})))


def list_methods() -> list[str]:
    return sorted(METHODS)
