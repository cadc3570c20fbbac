"""The explicit method registry: one line per method, ``name -> "module:Class"``, imported on first use.

Lazy, so that naming or validating one method does not import every method's dependencies (FINCH's
scikit-learn, POT). A test or plug-in may also register a class directly (``METHODS[name] = cls``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from feddg.algorithms.base import Method

METHODS: dict[str, str | type[Method]] = {
    "fedavg": "feddg.algorithms.fedavg:FedAvg",
    "fedfa": "feddg.algorithms.fedfa:FedFA",
    "fedprox": "feddg.algorithms.fedprox:FedProx",
    "fediir": "feddg.algorithms.fediir:FedIIR",
    "fedsr": "feddg.algorithms.fedsr:FedSR",
    "pardon": "feddg.algorithms.pardon:Pardon",
    "ccst": "feddg.algorithms.ccst:CCST",
    "fpl": "feddg.algorithms.fpl:FPL",
    "hfedf": "feddg.algorithms.hfedf:HFedF",
    "local": "feddg.algorithms.local_only:LocalOnly",
    "pfedhn": "feddg.algorithms.pfedhn:PFedHN",
    "fedgma": "feddg.algorithms.fedgma:FedGMA",
    "feddg_ga": "feddg.algorithms.feddg_ga:FedDGGA",
    "fedbn": "feddg.algorithms.fedbn:FedBN",
    "scaffold": "feddg.algorithms.scaffold:Scaffold",
    "central": "feddg.algorithms.central:Central",
    "mtgc": "feddg.algorithms.mtgc:MTGC",
    "fedrc": "feddg.algorithms.fedrc:FedRC",
    "harmofl": "feddg.algorithms.harmofl:HarmoFL",
    "elcfs": "feddg.algorithms.elcfs:ELCFS",
    "fedavgm": "feddg.algorithms.fedavgm:FedAvgM",
    "fedsam": "feddg.algorithms.fedsam:FedSAM",
    "fedrobust": "feddg.algorithms.fedrobust:FedRobust",
    "fedmix": "feddg.algorithms.fedmix:FedMix",
}


def method_class(name: str) -> type[Method]:
    """The class registered as ``name``, imported on first use."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {sorted(METHODS)}")
    entry = METHODS[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = METHODS[name] = getattr(importlib.import_module(module), attr)
        if entry.name != name:
            raise ValueError(f"registry line {name!r} points at {module}:{attr}, whose name is {entry.name!r}")
    return entry


def create_method(name: str, params: Mapping[str, Any] | None = None) -> Method:
    """Instantiate a registered method with validated hyper-parameters."""
    cls = method_class(name)
    return cls(cls.Params(**dict(params or {})))


def method_label(name: str) -> str:
    """``name`` as listings, tables and reports show it: with " (reconstructed)" for a reconstructed method."""
    return f"{name} (reconstructed)" if method_class(name).reconstructed else name


def labelled(variant: str, method: str) -> str:
    """A sweep variant's row name: " (reconstructed)" added when its method is reconstructed (and not named)."""
    reconstructed = method_class(method).reconstructed and "(reconstructed)" not in variant
    return f"{variant} (reconstructed)" if reconstructed else variant


def list_methods() -> list[str]:
    return sorted(METHODS)
