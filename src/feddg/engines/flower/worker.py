"""A warm ClientApp worker: one process that runs every ClientApp task of one SuperNode, one after another.

Flower 1.41 starts a fresh ``flwr-clientapp`` process for each message a SuperNode receives, in both
isolation modes: with ``--isolation subprocess`` the SuperNode's own ``flower-superexec`` starts it, with
``--isolation process`` a ``flower-superexec`` started by the operator does (its executors start a local
process or a Kubernetes pod per task). Each such process imports torch and feddg and rebuilds the
Federation for one message. This worker takes the SuperExec's place in ``process`` mode: it claims the
node's ClientApp tasks over the SuperNode's Runtime API (``AcquireTask``) and runs each one in this
process exactly as ``flwr-clientapp`` would (pull the message and the node's Context, install the FAB,
load the ClientApp, call it, push the reply and the Context), so torch, feddg and the Federation cached
by :func:`feddg.engines.flower.client.node_federation` stay loaded between messages.

Run it through :mod:`feddg.engines.flower.executor`, which restarts it if it dies. It uses Flower's own
task functions (``flwr.supernode.runtime.run_clientapp``), internal to flwr 1.41 (the pinned version).
The Runtime API is reached over TLS with ``--root-certificates CA.pem`` (the SuperNode started with
``--ssl-certfile/--ssl-keyfile/--ssl-ca-certfile``), or in plain HTTP with ``--insecure`` (loopback only).
"""

from __future__ import annotations

import argparse
import time
from logging import ERROR, INFO
from pathlib import Path

import torch
from flwr.app import Context, Error, Message
from flwr.cli.install import install_from_fab
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.logger import log
from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
    AcquireTaskRequest,
    PullAppMessagesRequest,
    PullTaskInputRequest,
)
from flwr.supercore.app_utils import start_parent_process_monitor
from flwr.supercore.constant import TaskType
from flwr.supercore.fab import Fab
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.protobuf.client import ProtobufClientInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.run import Run
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

import feddg.engines.flower.app  # noqa: F401  # torch, feddg and the ClientApp load before the first message


def runtime_client(address: str, root_certificates: bytes | None, *interceptors: ProtobufClientInterceptor
                   ) -> RuntimeHttpClient:
    """A client of the SuperNode's Runtime API at ``address`` (host:port): TLS trusting ``root_certificates``
    (PEM), plain HTTP where it is ``None``."""
    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=root_certificates is None, root_certificates=root_certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), *interceptors],
        retry_invoker=make_simple_http_retry_invoker(),
    )


def pull_task_input(client: RuntimeHttpClient) -> tuple[Message, Context, Run, Fab]:
    """``flwr.supernode.runtime.run_clientapp.pull_task_input``, retrying every 0.05-0.5 s (not 1, 2, 4 ... s)
    while the SuperNode is still fetching the message's objects: this worker claims a task as soon as the
    SuperNode creates it, which is before its objects have arrived."""
    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = res.task_id, res.run.run_id, res.context.node_id
    context = context_from_proto(res.context)
    msgs = client.PullMessages(PullAppMessagesRequest())
    if not msgs.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node, tree = Node(node_id=context.node_id), msgs.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=0.05, backoff_cap=0.5, max_tries_per_object=None,  # Flower's max_time stays
    )
    message.metadata.__dict__["_message_id"] = tree.object_id  # as Flower's: the deflated message lacks its id
    return message, context, run_from_proto(res.run), fab_from_proto(res.fab)


def run_task(address: str, root_certificates: bytes | None, token: str, apps: dict[str, ClientApp]) -> None:
    """Run the claimed ClientApp task of ``token`` as ``flwr-clientapp`` would; ``apps`` caches the loaded
    ClientApp per FAB hash."""
    client = runtime_client(address, root_certificates, RuntimeTokenHttpInterceptor(token))
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = reply = context = None
    status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    try:
        message, context, run, fab = pull_task_input(client)
        app = apps.get(fab.hash_str)
        if app is None:
            install_from_fab(fab.content, skip_prompt=True)
            app = get_load_client_app_fn("", None, multi_app=True)(run.fab_id, run.fab_version, fab.hash_str)
            apps[fab.hash_str] = app
        reply = app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as err:  # the same Error reply as flwr-clientapp's
        log(ERROR, "ClientApp raised an exception", exc_info=err)
        code, details = ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(err)}:<'{err}'>"
        if isinstance(err, LoadClientAppError):
            code, details = ErrorCode.LOAD_CLIENT_APP_EXCEPTION, "An exception was raised when attempting to load `ClientApp`"
        if message is not None:
            reply = Message(Error(code=code, reason=details), reply_to=message)
    if reply is not None and context is not None:
        try:
            push_message(client, reply, context)
        except Exception as err:
            log(ERROR, "Failed to push reply message", exc_info=err)
    if heartbeat.is_running:
        heartbeat.stop()  # before the task ends: a beat for a finished task would SIGINT this process
    push_task_output(client=client, context=context, sub_status=status, details=details)
    client.close()


def warm_up() -> None:
    """Pay before the first message what a process pays at its first training step: torch imports its compiler
    stack (``torch._dynamo``, 2-4 s of CPU here) when the first optimizer is built."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def serve(address: str, root_certificates: bytes | None, poll_s: float) -> None:
    """Claim and run the ClientApp tasks of the SuperNode at ``address``, forever."""
    acquirer = runtime_client(address, root_certificates)
    apps: dict[str, ClientApp] = {}
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
    log(INFO, "feddg warm ClientApp worker: serving the SuperNode at %s", address)
    while True:
        res = acquirer.AcquireTask(request)
        if res.HasField("task") and res.token:
            run_task(address, root_certificates, res.token, apps)
        else:
            time.sleep(poll_s)


def main() -> None:
    ap = argparse.ArgumentParser(description="run a SuperNode's ClientApp tasks in this process (see executor.py)")
    ap.add_argument("--runtime-api-address", required=True, help="the SuperNode's --host:--port")
    ap.add_argument("--poll-interval", type=float, default=0.1, help="seconds between task polls when idle")
    ap.add_argument("--parent-pid", type=int, help="exit when this process ends")
    tls = ap.add_mutually_exclusive_group(required=True)
    tls.add_argument("--root-certificates", type=Path, help="CA certificate (PEM) of the Runtime API's TLS")
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API (loopback only)")
    args = ap.parse_args()
    if args.parent_pid is not None:
        start_parent_process_monitor(args.parent_pid)
    warm_up()
    serve(args.runtime_api_address, None if args.insecure else args.root_certificates.read_bytes(), args.poll_interval)


if __name__ == "__main__":
    main()
