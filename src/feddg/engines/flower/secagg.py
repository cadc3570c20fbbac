"""Secure aggregation on Flower: SecAgg+ (Bell et al. 2020) through Flower 1.41's own implementation.

Flower 1.41 offers SecAgg+ only as a *legacy* workflow: ``SecAggPlusWorkflow`` (server) drives four rounds of
``train`` messages over a Grid with a ``LegacyContext`` and a legacy ``Strategy`` (``configure_fit`` /
``aggregate_fit`` on ``FitIns`` / ``FitRes``), and ``secaggplus_mod`` (client) turns the ClientApp's ``FitRes``
into a masked, quantised vector. The workflow is a plain callable on a Grid, so feddg joins it to its own
Message-API ServerApp (:mod:`feddg.engines.flower.secagg_server`). This module is the client side and the message
codec: the ClientApp answers the workflow's stage-2
message (``fitins.*`` records) with :func:`fitres_content`; :func:`secure_mod` runs ``secaggplus_mod`` on the
workflow's messages only (feddg's other train messages pass by).

What the server sees (docs/flower.md, "Secure aggregation"): never a client's weights; each client's
``num_examples`` and ``train_loss`` (a scalar each), and the mean. Only float ``w/`` arrays are summed;
integer buffers (BatchNorm's ``num_batches_tracked``) keep the value the server sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitIns, FitRes, Scalar, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from feddg.messages import WEIGHT_PREFIX
from feddg.messages import Message as FeddgMessage

#: FitIns config key: the message's array keys, in the order of ``FitIns.parameters``
ARRAY_KEYS = "feddg-array-keys"
#: prefix of the route's FitIns config keys (the client, the commit rounds, the run's key: ``server.train_route``)
ROUTE_PREFIX = "feddg-route/"
FITINS = "fitins.parameters"


def summed_keys(msg: FeddgMessage) -> list[str]:
    """The arrays SecAgg+ sums: the float ``w/`` arrays of the message sent, in its order."""
    return [k for k, v in msg.items()
            if k.startswith(WEIGHT_PREFIX) and isinstance(v, np.ndarray) and v.dtype.kind == "f"]


def to_fitins(msg: FeddgMessage, route: Mapping[str, int | str]) -> FitIns:
    """A feddg message as legacy ``FitIns``: its arrays as the parameters, numbers and strings as the config."""
    arrays = {k: v for k, v in msg.items() if isinstance(v, np.ndarray)}
    config: dict[str, Scalar] = {k: v.item() if isinstance(v, np.generic) else v  # numpy scalars as Python's
                                 for k, v in msg.items() if not isinstance(v, np.ndarray)}
    route_config = {ROUTE_PREFIX + k: v for k, v in route.items()}
    return FitIns(ndarrays_to_parameters(list(arrays.values())),
                  {**config, **route_config, ARRAY_KEYS: "\n".join(arrays)})


def is_fitins(content: RecordDict) -> bool:
    """Whether a train message is the SecAgg+ workflow's stage-2 ``FitIns`` (not a feddg message)."""
    return FITINS in content.array_records


def from_fitins(content: RecordDict) -> tuple[FeddgMessage, dict[str, int | str]]:
    """The feddg message and the route of a stage-2 ``FitIns`` (inverse of :func:`to_fitins`)."""
    ins = compat.recorddict_to_fitins(content, keep_input=True)
    config = dict(ins.config)
    keys = str(config.pop(ARRAY_KEYS)).split("\n")
    route = {k.removeprefix(ROUTE_PREFIX): cast(int | str, config.pop(k))
             for k in [k for k in config if k.startswith(ROUTE_PREFIX)]}
    arrays = parameters_to_ndarrays(ins.parameters)
    return {**dict(zip(keys, arrays, strict=True)), **config}, route  # type: ignore[dict-item]


def fitres_content(sent: FeddgMessage, answer: FeddgMessage) -> RecordDict:
    """A client's reply as the ``FitRes`` that ``secaggplus_mod`` masks: the summed arrays, ``num_examples``, and
    ``train_loss`` in the metrics. Anything else in the reply cannot be summed: refused (a ``ValueError``)."""
    keys = summed_keys(sent)
    extra = sorted(set(answer) - set(keys) - {"num_examples", "train_loss"}
                   - {k for k in sent if k.startswith(WEIGHT_PREFIX)})
    if extra:
        raise ValueError(f"flower.secure_aggregation: the reply holds {extra[0]!r} beyond weights + num_examples")
    params = ndarrays_to_parameters([np.asarray(answer[k]) for k in keys])
    metrics: dict[str, Scalar] = {"train_loss": float(answer.get("train_loss", np.nan))}
    return compat.fitres_to_recorddict(FitRes(Status(Code.OK, ""), params, int(answer["num_examples"]), metrics),
                                       keep_input=True)


def secure_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """``secaggplus_mod`` for the SecAgg+ workflow's messages (they carry its config record) only."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)
