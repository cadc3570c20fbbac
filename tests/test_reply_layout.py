"""What a method reads of a reply beside its ``w/`` arrays is declared (``Method.reply_layout``) and checked before
the reply is folded: a client that sends it in another shape, leaves it out, or echoes another value is dropped
with the reason, and the round goes on. Before, such a reply crashed the server's fold (FedBN, FedIIR, FedDG-GA)
or was broadcast into it (a ``[3]`` sign array over FedGMA's ``[4, 1, 3, 3]`` filters)."""

import json

import numpy as np
import pytest
import torch
from toy import ToyNet, toy_federation_of

from feddg.algorithms.base import ClientContext, ClientState, Method
from feddg.config import build_config
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server
from feddg.federation.validation import RunStopped, check_reply, check_setup_replies
from feddg.messages import Message, array_slot, like_slot, number_slot
from feddg.models.permutation import register_spec, sequential_spec

register_spec(ToyNet, sequential_spec)  # HFedATM's alignment of the toy model (as tests/test_hierarchy.py)

SENT = {"w/a": np.zeros(2, np.float32)}
REPLY = {"w/a": np.ones(2, np.float32), "num_examples": 3, "train_loss": 0.5}


@pytest.mark.parametrize(("extra", "why"), [
    ({"dc/a": np.zeros(3, np.float32)}, "dc/a has shape (3,), expected (2,)"),
    ({"dc/a": np.zeros(2, np.float64)}, "dc/a is float64, expected float32"),
    ({"dc/a": 1.0}, "dc/a is a float, not an array"),
    ({}, "missing dc/a"),
    ({"dc/a": np.zeros(2, np.float32), "dc/b": np.zeros(2, np.float32)}, "unexpected array dc/b"),
    ({"dc/a": np.zeros(2, np.float32), "n": 2.5}, "n is 2.5, not an int"),
    ({"dc/a": np.zeros(2, np.float32), "n": np.zeros(1)}, "n is array([0.]), not a number"),
    ({"dc/a": np.zeros(2, np.float32), "echo": 0.25}, "echo is 0.25, sent 0.5"),
    ({"dc/a": np.zeros(2, np.float32), "train_loss": "low"}, "train_loss is 'low', not a number"),
    ({"dc/a": np.zeros(2, np.float32), "stat/x": np.zeros(5, np.float16)}, "stat/x is float16, expected float32"),
    ({"dc/a": np.zeros((2, 1), np.float32)}, "dc/a has shape (2, 1), expected (2,)"),  # another rank
])
def test_check_reply_refuses_what_the_layout_does_not_declare(extra, why):
    beside = {"dc/a": like_slot(SENT["w/a"]), "n": number_slot(int, required=False),
              "echo": number_slot(required=False, value=0.5), "stat/": array_slot(None, np.float32)}
    fine = {**REPLY, "dc/a": np.zeros(2, np.float32), "n": 4, "echo": 0.5, "stat/x": np.zeros(5, np.float32),
            "stat/y": np.zeros((2, 2), np.float32), "note": "a client's own string", "metric": 1.5}
    assert check_reply(fine, SENT, {}, all_weights=True, beside=beside) is None
    assert check_reply({**REPLY, **extra}, SENT, {}, all_weights=True, beside=beside) == why


def test_an_array_beside_the_weights_is_refused_unless_declared():
    assert check_reply({**REPLY, "x": np.zeros(1)}, SENT, {}, all_weights=True) == "unexpected array x"
    assert check_reply({**REPLY, "x": 1.0}, SENT, {}, all_weights=True) is None  # a number: a metric at most


def tamper(reply: Message, key: str, how: str) -> None:
    """Client 3's round-2 reply: the first key under ``key`` in another shape, left out, or its value × 10⁶."""
    first = next(k for k in reply if k.startswith(key))
    if how == "shape":
        reply[first] = np.zeros(3, np.asarray(reply[first]).dtype)
    elif how == "drop":
        del reply[first]
    else:
        reply[first] = float(reply[first]) * 1e6


CASES = [  # method, extra overrides, key, how, the reason the server gives
    ("scaffold", ["optim.momentum=0"], "dc/", "shape", "dc/conv.weight has shape (3,), expected (4, 1, 3, 3)"),
    ("fedgma", [], "sign/", "shape", "sign/conv.weight has shape (3,), expected (4, 1, 3, 3)"),
    ("fedbn", [], "bn/", "shape", "bn/w/bn.weight has shape (3,), expected (4,)"),
    ("fediir", [], "grad/", "drop", "missing grad/weight"),
    ("fediir", [], "grad_batches", "drop", "missing grad_batches"),
    ("fpl", [], "proto/mean", "shape", "proto/mean has shape (3,), expected (4, 16)"),
    ("hfedf", [], "delta/", "shape", "delta/conv.weight has shape (3,), expected (4, 1, 3, 3)"),
    ("feddg_ga", [], "ga_weight", "value", "ga_weight is"),
    ("feddg_ga", [], "ga_gap", "drop", "missing ga_gap"),
    ("fedfa", ["method.params.stages=[conv, bn]"], "stat/", "shape", "stat/1/mu_bar has shape (3,), expected (4,)"),
    ("fedfa", ["method.params.stages=[conv, bn]"], "hist/", "shape", "hist/pi has shape (3,), expected (4, 8)"),
    ("fedavg", ["hierarchy.stations=2", "hierarchy.station_rounds=2", "hierarchy.merge=hfedatm"], "gram/", "shape",
     "gram/fc has shape (3,), expected (144, 144)"),
]


@pytest.mark.parametrize(("method", "over", "key", "how", "why"), CASES, ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in CASES])
def test_a_malformed_reply_beside_the_weights_drops_that_client_and_the_round_goes_on(
        tmp_path, method, over, key, how, why):
    cfg = build_config({"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"},
                        "federation": {"rounds": 2, "batch_size": 16, "workers": 1}, "optim": {"lr": 0.1},
                        "device": "cpu", "method": {"name": method}}, over)
    fed = toy_federation_of(cfg)
    honest = fed.topology.client_update

    def client_update(method: Method, model: torch.nn.Module, msg: Message, state: ClientState, ctx: ClientContext):
        reply, state = honest(method, model, msg, state, ctx)
        if ctx.round == 2 and ctx.client_id == 3:
            tamper(reply, key, how)
        return reply, state

    fed.topology.client_update = client_update  # type: ignore[method-assign]  # the sequential engine calls it
    server = Server(fed, tmp_path / "run")
    run_inprocess(server)
    rows = [json.loads(line) for line in (server.run_dir / "metrics.jsonl").read_text().splitlines()]
    reasons = {r["round"]: r.get("clients_failed_reasons", {}) for r in rows}
    assert reasons[1] == {}  # honest replies fit the layout
    assert list(reasons[2]) == ["3"] and reasons[2]["3"].startswith(why), reasons[2]
    assert max(reasons) == server.round  # and the run went on to its end


def test_setup_replies_are_checked_and_open_sizes_must_agree_past_the_first_dimension():
    layout = {"bank": array_slot((-1, -1, 3), np.float32), "n": number_slot(int), "latent": array_slot((4,), np.float32)}
    good = {"bank": np.zeros((5, 2, 3), np.float32), "n": 5, "latent": np.zeros(4, np.float32)}
    assert check_setup_replies({0: good, 1: {**good, "bank": np.zeros((9, 2, 3), np.float32)}}, layout) == {}
    replies = {0: good, 1: good, 2: {**good, "bank": np.zeros((5, 7, 3), np.float32)},  # another C than the others
               3: {**good, "latent": np.zeros(1, np.float32)},  # copy_ would have broadcast it over ν[3]
               4: {**good, "extra": np.zeros(1)}, 5: {**good, "n": 2.5},
               6: {**good, "bank": np.full((5, 2, 3), np.nan, np.float32)}}
    assert check_setup_replies(replies, layout) == {
        2: "bank has shape (5, 7, 3), the other clients' (5, 2, 3)", 3: "latent has shape (1,), expected (4,)",
        4: "unexpected array extra", 5: "n is 2.5, not an int", 6: "NaN in bank"}
    split = {0: good, 1: {**good, "bank": np.zeros((5, 7, 3), np.float32)}}  # one against one: no side is blamed
    assert check_setup_replies(split, layout) == {
        0: "bank has shape (5, 2, 3): the clients' shapes differ, none shared by most",
        1: "bank has shape (5, 7, 3): the clients' shapes differ, none shared by most"}
    # a reply already refused (NaN) has no say in which shape most clients share: one against one again
    nan = {**good, "bank": np.full((5, 2, 3), np.nan, np.float32)}
    assert check_setup_replies({**split, 2: nan}, layout) == {**check_setup_replies(split, layout), 2: "NaN in bank"}


def test_a_malformed_setup_reply_stops_the_run_in_one_line_before_the_method_stacks_it(tmp_path):
    cfg = build_config({"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"},
                        "federation": {"rounds": 1, "batch_size": 16, "workers": 1}, "device": "cpu",
                        "method": {"name": "fedmix"}})
    fed = toy_federation_of(cfg)
    honest = fed.method.client_setup

    def client_setup(model, msg, client_state, ctx):
        reply, state = honest(model, msg, client_state, ctx)
        return ({**reply, "mix/y": reply["mix/y"][:, :2]} if ctx.client_id == 1 else reply), state

    fed.method.client_setup = client_setup  # type: ignore[method-assign]
    with pytest.raises(RunStopped, match=r"^setup exchange: client 1: mix/y has shape \(\d+, 2\), the other clients' "
                                         r"\(\d+, 4\)$"):
        run_inprocess(Server(fed, tmp_path / "run"))
