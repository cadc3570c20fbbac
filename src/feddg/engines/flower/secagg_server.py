"""The server side of SecAgg+ on Flower (:mod:`feddg.engines.flower.secagg` has the client side and the codec).

Flower 1.41's ``SecAggPlusWorkflow`` is a callable on a Grid and a ``LegacyContext``, so feddg's own Message-API
ServerApp calls it: :func:`run_secure_rounds` runs it once per round with a :class:`SecureRound` strategy whose
``configure_fit`` is ``Server.configure`` and whose ``aggregate_fit`` receives what the workflow exposes — the
weighted mean of the clients' weights (the same arrays in every result) and each client's ``num_examples`` and
metrics in the clear — which goes to ``Server.receive_aggregate``. No feddg code sees a client's weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common import FitIns, FitRes, Parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from feddg.config import SecAggPlusConfig
from feddg.engines.flower.routes import Route, train_route
from feddg.engines.flower.secagg import summed_keys, to_fitins
from feddg.federation.server import Server
from feddg.federation.validation import RunStopped
from feddg.messages import WEIGHT_PREFIX
from feddg.messages import Message as FeddgMessage


class SecureRound(Strategy):
    """The legacy strategy the workflow calls: the clients of ``sent`` and what the workflow exposes of their
    replies (``results``: the aggregate in every ``FitRes.parameters``, each client's count and metrics)."""

    def __init__(self, grid: Grid, nodes: dict[int, int], route: Route) -> None:
        self.grid, self.nodes, self.route = grid, nodes, route
        self.by_node = {node: cid for cid, node in nodes.items()}
        self.sent: dict[int, FeddgMessage] = {}
        self.results: list[tuple[ClientProxy, FitRes]] | None = None
        self.failures: list[Any] = []

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                      ) -> list[tuple[ClientProxy, FitIns]]:
        return [(GridClientProxy(self.nodes[cid], self.grid, 0),  # the proxy is a node id here: it sends nothing
                 to_fitins(msg, self.route(cid)))
                for cid, msg in self.sent.items()]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list[Any]
                      ) -> tuple[Parameters | None, dict[str, Any]]:
        self.results, self.failures = results, failures
        return None, {}

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                           ) -> list[Any]:
        return []

    def aggregate_evaluate(self, server_round: int, results: list[Any], failures: list[Any]
                           ) -> tuple[float | None, dict[str, Any]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Any]] | None:
        return None


def workflow(cfg: SecAggPlusConfig, max_weight: float, timeout: float) -> SecAggPlusWorkflow:
    """Flower's SecAgg+ workflow under ``flower.secaggplus`` (``max_weight``: the largest client's examples)."""
    return SecAggPlusWorkflow(cfg.num_shares, cfg.reconstruction_threshold, max_weight=cfg.max_weight or max_weight,
                              clipping_range=cfg.clipping_range, quantization_range=cfg.quantization_range,
                              modulus_range=cfg.modulus_range, timeout=timeout)


def aggregate_message(sent: FeddgMessage, parameters: Parameters) -> FeddgMessage:
    """The weighted mean the workflow computed, as ``w/`` arrays of the sent dtypes; integer arrays as sent."""
    keys = summed_keys(sent)
    mean = dict(zip(keys, parameters_to_ndarrays(parameters), strict=True))
    return {k: (mean[k].astype(np.asarray(v).dtype) if k in mean else v) for k, v in sent.items()
            if k.startswith(WEIGHT_PREFIX)}


def run_secure_rounds(server: Server, grid: Grid, nodes: dict[int, int],
                      on_round: Callable[[dict[str, Any]], None] | None = None) -> None:
    """The remaining rounds of ``server``, each one SecAgg+ exchange (four message rounds) over ``grid``."""
    fed = server.fed
    timeout = fed.cfg.flower.round_timeout_s
    strategy = SecureRound(grid, nodes, train_route(server))
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(),
                                    run_config={}), strategy=strategy)
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    secagg = workflow(fed.cfg.flower.secaggplus, float(max(len(c.train_idx) for c in fed.clients)), timeout)
    for round in range(server.round + 1, server.rounds + 1):
        t0 = time.perf_counter()
        strategy.sent, strategy.results = server.configure(round), None
        fold = server.start_round(strategy.sent)
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: round})
        secagg(grid, context)
        if not strategy.results:
            raise RunStopped(f"round {round}: secure aggregation halted (fewer than 2 clients, or fewer key shares "
                             f"than flower.secaggplus.reconstruction_threshold, within {timeout:g} s); stopped")
        clients = [strategy.by_node[cast(GridClientProxy, proxy).node_id] for proxy, _ in strategy.results]
        for cid in strategy.sent:
            if cid not in clients:
                server.fail(fold, cid, "no masked reply (secure aggregation)")
        mean = aggregate_message(strategy.sent[clients[0]], strategy.results[0][1].parameters)
        server.receive_aggregate(fold, mean, {c: r.num_examples for c, (_, r) in zip(clients, strategy.results)},
                                 {c: r.metrics.get("train_loss") for c, (_, r) in zip(clients, strategy.results)})
        row = server.finish_round(round, fold, {"time_train_s": time.perf_counter() - t0})  # commits (not rolled back)
        if on_round is not None:
            on_round(row)

