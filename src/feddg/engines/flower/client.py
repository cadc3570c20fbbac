"""The Flower ClientApp: a SuperNode rebuilds the experiment's Federation and runs the client half.

The SuperNode with ``partition-id`` k (of ``num-partitions`` K, the number of clients) is
client k. It rebuilds the same
:class:`~feddg.federation.setup.Federation` as the server from the experiment config — data,
split and partition are deterministic given the seed — once per process (a warm process, see
:mod:`feddg.engines.flower.executor`, reuses it for every message), and keeps each client's state
(a Message) in its ``Context.state`` under ``client-<k>/``, so it never leaves the node. A train
update's new state waits under ``client-<k>/pending/`` until the server's next message says the
reply was folded in (``commit-round``): a client whose reply the server dropped keeps its old state. A node started
with ``--node-config state-dir=DIR`` (the simulation: the run directory's ``node-state/``) keeps the state on disk
instead, so a resumed run continues with it (:mod:`feddg.engines.flower.node_state`).

Message types (the ServerApp sends them, see :mod:`feddg.engines.flower.server`):

``query.identify``  reply ``route`` = {partition-id, num-partitions, fingerprint}; in a secure deployment
                    (``flower.roster``) the server's ``challenge`` comes back signed with the node's key
                    (``--node-config "auth-key='KEY'"``), and the roster, not partition-id, says which client it is
``query.setup``     the method's one-time setup exchange (``client_setup``)
``train``           one round of ``client_update``; under ``flower.secure_aggregation: secaggplus`` the SecAgg+
                    workflow's train messages go through ``secaggplus_mod`` and its stage-2 ``FitIns`` is
                    answered as a ``FitRes`` (:mod:`feddg.engines.flower.secagg`)

Setup and training run under the experiment's ``federation.threads`` (:func:`node_threads`; ``auto``: one torch and
one BLAS thread), or the node's ``--node-config threads=N``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

import yaml
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.supercore.logger import update_console_handler

from feddg.config import ExperimentConfig, build_config, dump_config
from feddg.engines.flower.node_state import DURABLE, RUN_KEY, STATE_DIR, NodeStateDir
from feddg.engines.flower.records import get_message, put_message, record_int
from feddg.engines.flower.secagg import fitres_content, from_fitins, is_fitins, secure_mod
from feddg.engines.flower.security import identity_statement, load_private_key, public_key_text, sign
from feddg.engines.workers import federation_threads
from feddg.federation.client import describe, run_client, run_client_setup
from feddg.federation.setup import Federation, build_federation
from feddg.messages import Message as FeddgMessage

IDENTIFY, SETUP, TRAIN = "query.identify", "query.setup", "train"
#: ConfigRecord naming the client a message is for (and, in identify replies, the node's facts)
ROUTE = "route"
#: route key of train messages: the last round whose reply the server folded in from this client
COMMIT = "commit-round"
#: identify reply key: True when the node keeps its clients' state on disk (``state-dir``), so a resume keeps it
KEEPS_STATE = "keeps-state"
#: node config key: the node's private key file (its ``--auth-supernode-private-key``), for the roster's proof
AUTH_KEY = "auth-key"
#: node config key: torch and BLAS threads of the node's clients (default: the experiment's ``federation.threads``)
THREADS = "threads"

FederationFactory = Callable[[ExperimentConfig], Federation]

#: the Federations this process built, by (factory, sha256 of the config text), least recently used first:
#: a warm process (``feddg.engines.flower.executor``) serves every message of its node, run after run
_FEDERATIONS: OrderedDict[tuple[str, str], Federation] = OrderedDict()
MAX_FEDERATIONS = 2


def config_from_text(text: str) -> ExperimentConfig:
    """The experiment config from its YAML text (as it travels in the Flower run config)."""
    return build_config(yaml.safe_load(text) or {})


def required_config(text: str) -> str:
    """``text``, the experiment YAML of the run config (key ``config``); ``ValueError`` in one line when empty."""
    if not text.strip():
        raise ValueError("no experiment config: pass the YAML text as run config 'config' (see docs/flower.md)")
    return text


def fingerprint(fed: Federation) -> str:
    """Hash of the config, the dataset's size and every client's index arrays, each array's dtype and length before
    its bytes (a sample moved from one array to the next changes it): equal iff two processes built the same
    federation."""
    h = hashlib.sha256(dump_config(fed.cfg).encode())
    h.update(str(len(fed.dataset)).encode())
    for c in fed.clients:
        for idx in (c.train_idx, c.holdout_idx):
            h.update(f"{idx.dtype.str}{len(idx)}:".encode())
            h.update(idx.tobytes())
    return h.hexdigest()


def client_federation(cfg: ExperimentConfig) -> Federation:
    """The Federation as a client needs it: :func:`build_federation` without the datasets only the server
    evaluates on (``eval.extra``); ``cfg`` stays whole, so the fingerprint equals the server's."""
    if not cfg.eval.extra:
        return build_federation(cfg)
    fed = build_federation(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"extra": []})}))
    fed.cfg = cfg
    return fed


def node_federation(text: str, factory: FederationFactory) -> Federation:
    """The Federation of config ``text``, built once per process (the last ``MAX_FEDERATIONS`` configs kept)."""
    name = getattr(factory, "__qualname__", type(factory).__qualname__)  # a function, or a callable object
    key = (f"{factory.__module__}.{name}", hashlib.sha256(text.encode()).hexdigest())
    fed = _FEDERATIONS.get(key)
    if fed is None:
        if os.environ.get("FEDDG_PLAIN_LOGS") == "1":  # the driver's stderr is not a terminal: no colour codes
            update_console_handler(colored=False)
        t0 = time.perf_counter()
        fed = factory(config_from_text(text))
        log(INFO, "feddg: built the federation of config %s in %.2f s (process %d)", key[1][:12],
            time.perf_counter() - t0, os.getpid())
        while len(_FEDERATIONS) >= MAX_FEDERATIONS:
            _FEDERATIONS.popitem(last=False)
        _FEDERATIONS[key] = fed
    _FEDERATIONS.move_to_end(key)
    return fed


def node_partition(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of this SuperNode."""
    nc = context.node_config
    if "partition-id" not in nc or "num-partitions" not in nc:
        raise ValueError("start the SuperNode with --node-config 'partition-id=<p> num-partitions=<P>'")
    return int(nc["partition-id"]), int(nc["num-partitions"])


def node_threads(context: Context, fed: Federation) -> AbstractContextManager[None]:
    """The block at this node's thread count: ``--node-config threads=N`` where its operator set one (a machine of
    its own), else the experiment's ``federation.threads`` (``auto``: one torch and one BLAS thread, as in-process,
    so SuperNodes that share a machine never spin at one another's OpenMP barriers)."""
    if THREADS not in context.node_config:
        return federation_threads(fed.cfg.federation.threads, fed.device)
    value = context.node_config[THREADS]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--node-config threads={value!r}: expected a whole number of threads, at least 1")
    return federation_threads(value, fed.device)


def state_prefix(client_id: int) -> str:
    return f"client-{client_id}/"


def pending_prefix(client_id: int) -> str:
    return f"client-{client_id}/pending/"


def committed_state(state: RecordDict, client_id: int, commit: int) -> FeddgMessage:
    """The client's state as the server saw it: the state of the client's last update becomes its state
    once the server has folded that update's reply in (round ``commit``); if the server dropped the reply
    (late, failed a check) that state is discarded and the one before stays."""
    marker = state.metric_records.get(pending_prefix(client_id) + "round")
    if marker is not None and record_int(marker["round"]) == commit:
        put_message(state, get_message(state, pending_prefix(client_id)), state_prefix(client_id))
    return get_message(state, state_prefix(client_id))


def state_root(context: Context, state_dir: Path | None) -> Path | None:
    """This node's folder of client state: ``state_dir`` (the simulation's), else its ``--node-config state-dir=DIR``;
    ``None``: in ``Context.state`` only (lost when the run is resumed)."""
    root = state_dir if state_dir is not None else context.node_config.get(STATE_DIR)
    return None if root is None else Path(str(root))


def node_state_dir(context: Context, route: Mapping[str, Any], cid: int, state_dir: Path | None) -> NodeStateDir | None:
    """Where client ``cid`` keeps its state on this node's disk, under :func:`state_root` and the run's key."""
    root = state_root(context, state_dir)
    return None if root is None else NodeStateDir(root, str(route[RUN_KEY]), cid)


class _RoutineActorExit(logging.Filter):
    """Flower's Ray actors announce their normal end at WARNING (``Manually terminating ClientAppActor``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Manually terminating")


def quiet_actor_logs() -> None:
    """Flower's INFO lines and its actors' routine end off in this process (a simulation's Ray actor)."""
    flwr_log = logging.getLogger("flwr")
    flwr_log.setLevel(logging.WARNING)
    if not any(isinstance(f, _RoutineActorExit) for f in flwr_log.filters):
        flwr_log.addFilter(_RoutineActorExit())


def make_client_app(config_text: str | None = None, factory: FederationFactory = client_federation,
                    state_dir: Path | None = None, quiet: bool = False) -> ClientApp:
    """A ClientApp for the experiment ``config_text`` (YAML); ``None`` reads the run config key ``config``.
    ``state_dir``: where every node keeps its clients' state (default: the node config's ``state-dir``, if any).
    ``quiet``: Flower's INFO lines and its actors' routine end notice off in the processes that run it (the
    simulation's Ray actors, whose lines Ray prints under the driver's progress bar)."""
    app = ClientApp(mods=[secure_mod])

    def federation(context: Context) -> Federation:
        if quiet:
            quiet_actor_logs()
        text = config_text if config_text is not None else str(context.run_config.get("config", ""))
        return node_federation(required_config(text), factory)

    def client_id(msg: Message, context: Context, cid: int | None = None) -> int:
        """The client a message is for (its route's, or ``cid``), checked against this node's partition."""
        cid = record_int(msg.content.config_records[ROUTE]["client-id"]) if cid is None else cid
        if AUTH_KEY in context.node_config:  # the server bound this node to its client by the node's key (roster)
            return cid
        partition = node_partition(context)[0]
        if cid != partition:
            raise ValueError(f"a message for client {cid} reached the SuperNode of partition {partition}")
        return cid

    def reply(msg: Message, payload: FeddgMessage, cid: int) -> Message:
        return Message(put_message(RecordDict({ROUTE: ConfigRecord({"client-id": cid})}), payload), reply_to=msg)

    @app.query("identify")
    def identify(msg: Message, context: Context) -> Message:
        fed, asked = federation(context), msg.content.config_records[ROUTE]
        node_threads(context, fed)  # a node with a bad thread count fails here, before any work
        fp = fingerprint(fed)
        if AUTH_KEY in context.node_config:  # secure: the roster says who this node is
            if "challenge" not in asked:  # a ServerApp without a roster would trust any node's declared partition
                raise ValueError("this SuperNode proves its roster key (auth-key) and answers only a roster's challenge: "
                                 "the run has no flower.roster")
            key = load_private_key(Path(str(context.node_config[AUTH_KEY])))
            statement = identity_statement(str(asked["challenge"]), context.node_id, fp)
            info = ConfigRecord({"fingerprint": fp, "public-key": public_key_text(key.public_key()),
                                 "signature": sign(key, statement)})
        else:
            p, n = node_partition(context)
            info = ConfigRecord({"partition-id": p, "num-partitions": n, "fingerprint": fp})
        info[KEEPS_STATE] = state_root(context, state_dir) is not None
        return Message(RecordDict({ROUTE: info}), reply_to=msg)

    @app.query("setup")
    def setup(msg: Message, context: Context) -> Message:
        fed, cid = federation(context), client_id(msg, context)
        state = get_message(context.state, state_prefix(cid))
        with node_threads(context, fed):
            answer, state = run_client_setup(fed, cid, get_message(msg.content), state)
        if (store := node_state_dir(context, msg.content.config_records[ROUTE], cid, state_dir)) is not None:
            store.save(0, state)
        else:
            put_message(context.state, state, state_prefix(cid))
        return reply(msg, answer, cid)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        secure = is_fitins(msg.content)  # SecAgg+'s stage 2: the route travels in the FitIns config
        route: Mapping[str, Any]
        if secure:
            payload, route = from_fitins(msg.content)
            cid = client_id(msg, context, int(route["client-id"]))
        else:
            payload, route = get_message(msg.content), msg.content.config_records[ROUTE]
            cid = client_id(msg, context)
        fed = federation(context)
        round, commit = int(payload["round"]), record_int(route[COMMIT])
        try:
            if (store := node_state_dir(context, route, cid, state_dir)) is not None:
                state = store.load(commit)  # a file this node lost fails the client in one line (describe)
                store.keep_only({commit, record_int(route[DURABLE])})  # what a resume from the checkpoint may ask for
            else:
                state = committed_state(context.state, cid, commit)
            with node_threads(context, fed):
                answer, state = run_client(fed, cid, round, payload, state)
            if secure:
                content = fitres_content(payload, answer)
        except Exception as err:
            log(ERROR, "feddg client %d, round %d failed:\n%s", cid, round, traceback.format_exc())
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, describe(err)), reply_to=msg)
        if store is not None:
            store.save(round, state)  # read back once the server names this round as the commit round
        else:
            put_message(context.state, state, pending_prefix(cid))  # kept once the server accepts the reply
            context.state[pending_prefix(cid) + "round"] = MetricRecord({"round": round})
        return Message(content, reply_to=msg) if secure else reply(msg, answer, cid)

    return app
