"""A SuperNode's client state on its own disk (``--node-config state-dir=DIR``), so that a resumed run continues
with it: Flower keeps a node's ``Context.state`` per Flower run, and ``flwr run`` after a crash is a new run.

The node writes the state after each update as ``DIR/<run-key>/client-<k>/round-<r>.pb`` (the setup exchange's as
round 0), through the records of :mod:`feddg.engines.flower.records` and Flower's protobuf, written to a temporary
file and renamed. Every train message names the round whose reply the server last folded in (``commit-round``) and
that round as of the server's last checkpoint (``durable-round``): the node reads the state of the first and keeps
the files of those two rounds only, so a reply the server dropped or rolled back leaves no trace, and a server that
resumes from its checkpoint finds the node's state of the same round. ``run-key`` is the feddg run's (kept in its
checkpoint), so two runs of one config never share a file.
"""

from __future__ import annotations

import re
from pathlib import Path

from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from feddg.data.cache import replaced_atomically
from feddg.engines.flower.records import get_message, put_message
from feddg.messages import Message

#: node config key: the folder of this node's client state (a resumed run continues with it)
STATE_DIR = "state-dir"
#: route keys of setup and train messages: the run's key, and the commit round as of the server's last checkpoint
RUN_KEY, DURABLE = "run-key", "durable-round"
#: a run key as ``federation.server.Server`` makes it (``secrets.token_hex(8)``)
RUN_KEY_FORM = re.compile(r"[0-9a-f]{16}")


class NodeStateDir:
    """One client's states by round, in ``root/<run_key>/client-<client_id>/``."""

    def __init__(self, root: Path, run_key: str, client_id: int) -> None:
        if not RUN_KEY_FORM.fullmatch(run_key):  # it names a folder: the server's word must not reach beyond root
            raise ValueError(f"run-key {run_key[:40]!r} is not a run key (16 hex digits)")
        self.folder = root / run_key / f"client-{client_id}"

    def path(self, round: int) -> Path:
        return self.folder / f"round-{round}.pb"

    def save(self, round: int, state: Message) -> None:
        """The client state after its update of ``round`` (0: after the setup exchange)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        data = recorddict_to_proto(put_message(RecordDict(), state)).SerializeToString()
        with replaced_atomically(self.path(round)) as tmp:
            tmp.write_bytes(data)

    def load(self, round: int) -> Message:
        """The state the client had after ``round``; before any (round 0 without a setup file) it has none."""
        path = self.path(round)
        if not path.is_file():
            if round == 0:
                return {}
            raise FileNotFoundError(f"the client state of round {round} is not in {self.folder} (the server folded "
                                    f"that round's reply in): this node's state-dir lost it")
        return get_message(recorddict_from_proto(ProtoRecordDict.FromString(path.read_bytes())))

    def keep_only(self, rounds: set[int]) -> None:
        """Remove every state file but those of ``rounds``."""
        for path in self.folder.glob("round-*.pb"):
            number = path.stem.removeprefix("round-")
            if number.isdigit() and int(number) not in rounds:  # another name there is not this module's
                path.unlink(missing_ok=True)
