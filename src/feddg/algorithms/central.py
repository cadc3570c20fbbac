"""Central: one model trained on the pooled data of all source clients — the upper reference of hFedF's and
FedFA's tables, evaluated by the same server code as every federated method.

A method cannot pool data (a client sees only its own indices, by design), so the pooling is the
partition's: ``partition: {kind: iid, num_clients: 1}`` deals every source sample to one client, and
this method trains that client with plain local SGD (FedAvg of one model is that model). It refuses a
federation of more than one client, where it would be FedAvg under another name.
"""

from __future__ import annotations

from torch import nn

from feddg.algorithms.base import ServerContext, ServerState
from feddg.algorithms.fedavg import FedAvg

POOLED = "partition.kind=iid partition.num_clients=1"


class Central(FedAvg):
    """FedAvg on a single client that holds the union of the source domains."""

    name = "central"

    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        if ctx.num_clients != 1:
            raise ValueError(f"method central trains one client on the pooled source data; got {ctx.num_clients} "
                             f"clients. Pool them with {POOLED}")
        return super().server_init(model, ctx)
