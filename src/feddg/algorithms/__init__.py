"""Federated methods: one file per method, each with a server half and a client half."""

from feddg.algorithms.base import ClientContext, Method, OptimSettings, Params, Reply, ServerContext
from feddg.algorithms.registry import METHODS, create_method, list_methods, method_class

__all__ = [
    "METHODS",
    "ClientContext",
    "Method",
    "OptimSettings",
    "Params",
    "Reply",
    "ServerContext",
    "create_method",
    "list_methods",
    "method_class",
]
