"""Mutation audit of the round loop (federation/server.py, client.py, validation.py, client_store.py): each test
pins one behaviour that a mutation of those files changed while the rest of the suite still passed."""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from toy import toy_federation

from feddg.algorithms.base import Reply
from feddg.evaluation.plots import read_metrics
from feddg.federation.client import client_context, describe, run_client, run_client_setup, try_client
from feddg.federation.client_store import ClientStores
from feddg.federation.server import AGGREGATE, Server, used_run_dir
from feddg.federation.spill import MAP_FROM_BYTES
from feddg.federation.validation import RunStopped, check_reply, outliers, update_norm
from feddg.messages import WEIGHT_PREFIX, array_slot, entries, number_slot

SECURE = ("federation.engine=flower", "flower.secure_aggregation=secaggplus")


# --- server.py ---------------------------------------------------------------------------------------------
def test_a_secure_aggregates_boolean_train_loss_refuses_it(tmp_path: Path) -> None:
    server = Server(toy_federation(*SECURE), tmp_path / "run")
    sent = server.configure(1)
    fold = server.start_round(sent)
    server.receive_aggregate(fold, entries(sent[0], WEIGHT_PREFIX), {0: 54, 1: 54}, {0: 1.0, 1: True})
    assert fold.accepted == [] and fold.failed == {AGGREGATE: "client 1 sent train_loss=True, not a finite number"}


def test_a_file_in_the_run_dirs_place_counts_as_used(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "empty").mkdir()
    assert used_run_dir(tmp_path / "file") and used_run_dir(tmp_path / "full")
    assert not used_run_dir(tmp_path / "empty") and not used_run_dir(tmp_path / "absent")


def echo_round(server: Server, round: int, order: list[int] | None = None, loss: bool = True,
               fail: tuple[int, ...] = ()) -> dict:
    """Round ``round`` where each sampled client echoes the weights sent with 10 examples and train loss = its id
    (none with ``loss=False``); the replies arrive in ``order`` (default: as sent); ``fail`` clients give none."""
    sent = server.configure(round)
    fold = server.start_round(sent)
    for cid in order if order is not None else list(sent):
        if cid in fail:
            server.fail(fold, cid, f"why {cid}")
            continue
        reply = {**entries(sent[cid], WEIGHT_PREFIX), "num_examples": 10, **({"train_loss": float(cid)} if loss else {})}
        server.receive(fold, Reply(cid, reply), {"round": np.array(round)})
    return server.finish_round(round, fold, {})


def test_a_round_whose_replies_carry_no_train_loss_records_nan_not_zero(tmp_path: Path) -> None:
    server = Server(toy_federation("federation.rounds=1"), tmp_path / "run")
    row = echo_round(server, 1, loss=False)
    assert row["clients"] == 4 and np.isnan(row["train_loss"])


def test_held_replies_are_folded_in_the_order_sent_whatever_order_they_arrive_in(tmp_path: Path) -> None:
    server = Server(toy_federation("federation.rounds=1", "federation.reject_outliers=1000"), tmp_path / "run")
    sent = server.configure(1)
    fold = server.start_round(sent)
    assert fold.held == []
    for cid in reversed(list(sent)):
        server.receive(fold, Reply(cid, {**entries(sent[cid], WEIGHT_PREFIX), "num_examples": 10, "train_loss": 1.0}))
    server.finish_round(1, fold, {})
    assert fold.accepted == list(sent) == [0, 1, 2, 3]


def test_the_last_round_is_checkpointed_when_checkpoint_every_does_not_divide_the_rounds(tmp_path: Path) -> None:
    server = Server(toy_federation("federation.rounds=3", "federation.checkpoint_every=2"), tmp_path / "run")
    saved = []
    for r in (1, 2, 3):
        echo_round(server, r)
        saved.append(server.saved_round)
    assert saved == [None, 2, 3]


def test_a_stop_with_exactly_three_failures_names_them_without_a_count_of_more(tmp_path: Path) -> None:
    server = Server(toy_federation("federation.min_clients=2"), tmp_path / "run")
    with pytest.raises(RunStopped) as err:
        echo_round(server, 1, fail=(0, 1, 2))
    assert str(err.value) == (f"round 1: 1 of 4 clients replied usably, fewer than federation.min_clients=2 (client 0: "
                              f"why 0; client 1: why 1; client 2: why 2); stopped, nothing was checkpointed yet: "
                              f"feddg run --resume {server.run_dir} continues from it")


def test_results_of_a_run_that_kept_only_means_in_its_metrics_still_name_every_domain(tmp_path: Path) -> None:
    server = Server(toy_federation("federation.rounds=1", "eval.per_domain=false"), tmp_path / "run")
    row = echo_round(server, 1)
    assert "ood_acc" in row and "ood_acc/c" not in row  # metrics.jsonl: the means only
    final = server.write_results()["final"]
    assert set(final) == {"id_acc/a", "id_acc/b", "id_acc", "ood_acc/c", "ood_acc"}
    assert final["ood_acc"] == row["ood_acc"]


def test_a_resumed_run_drops_the_metrics_rows_of_rounds_after_its_checkpoint(tmp_path: Path) -> None:
    server = Server(toy_federation("federation.rounds=4", "federation.checkpoint_every=2"), tmp_path / "run")
    for r in (1, 2, 3):
        echo_round(server, r)
    assert [row["round"] for row in read_metrics(server.run_dir)] == [1, 2, 3]
    resumed = Server(toy_federation("federation.rounds=4", "federation.checkpoint_every=2"), server.run_dir,
                     resume=True)
    assert resumed.round == 2 and [row["round"] for row in read_metrics(resumed.run_dir)] == [1, 2]


def test_a_setup_exchange_stop_names_the_bad_clients_in_id_order_whatever_order_they_replied_in(tmp_path) -> None:
    server = Server(toy_federation("method.name=fedmix", "federation.rounds=1"), tmp_path / "run")
    server.setup_request()
    good = {"mix/x": np.zeros((10, 1, 6, 6), np.float32), "mix/y": np.zeros((10, 4), np.float32)}
    bad = {**good, "mix/y": np.full((10, 4), np.nan, np.float32)}
    replies = [Reply(cid, bad if cid in (1, 3) else good) for cid in (3, 2, 1, 0)]
    with pytest.raises(RunStopped, match=r"^setup exchange: client 1: NaN in mix/y; client 3: NaN in mix/y$"):
        server.finish_setup(replies)
    assert not server.setup_done


# --- validation.py -----------------------------------------------------------------------------------------
SENT = {"w/a": np.zeros((2, 3), np.float32), "lr": 0.1}
DECLARED = {"w/a": ((2, 3), np.dtype(np.float32)), "w/b": ((4,), np.dtype(np.float32)),
            "w/c": ((1,), np.dtype(np.float32))}
GOOD = {"w/a": np.ones((2, 3), np.float32), "num_examples": 10, "train_loss": 0.5}


def test_a_float_array_with_nan_and_inf_is_named_by_its_nan() -> None:
    bad = {**GOOD, "w/a": np.array([[np.inf, np.nan, 0], [0, 0, 0]], np.float32)}
    assert check_reply(bad, SENT, DECLARED, all_weights=True) == "NaN in w/a"
    bad["w/a"] = np.array([[np.inf, 0, 0], [0, 0, 0]], np.float32)
    assert check_reply(bad, SENT, DECLARED, all_weights=True) == "Inf in w/a"


def test_a_weight_that_was_sent_is_checked_against_what_was_sent_not_what_is_declared() -> None:
    # a method may send a weight in another layout than the model's (the reply must come back as sent)
    sent = {"w/a": np.zeros(5, np.float16)}
    assert check_reply({"w/a": np.ones(5, np.float16), "num_examples": 1}, sent, DECLARED, all_weights=True) is None
    assert check_reply({"w/a": np.ones((2, 3), np.float32), "num_examples": 1}, sent, DECLARED,
                       all_weights=True) == "w/a has shape (2, 3), expected (5,)"


def test_without_weights_sent_every_declared_weight_must_come_back_and_the_rest_are_counted() -> None:
    reply = {"w/a": np.ones((2, 3), np.float32), "num_examples": 1}
    assert check_reply(reply, {"lr": 0.1}, DECLARED, all_weights=True) == "missing w/b and 1 more weights"
    assert check_reply({**reply, "w/b": np.ones(4, np.float32)}, {"lr": 0.1}, DECLARED,
                       all_weights=True) == "missing w/c"
    assert check_reply(reply, {"lr": 0.1}, DECLARED, all_weights=False) is None  # a method that averages no weights


def test_a_declared_weight_that_was_not_sent_is_refused_from_a_method_that_averages_the_weights() -> None:
    reply = {**GOOD, "w/b": np.ones(4, np.float32)}
    assert check_reply(reply, SENT, DECLARED, all_weights=True) == "unexpected weight w/b"
    assert check_reply(reply, SENT, DECLARED, all_weights=False) is None


def test_an_optional_slot_may_be_left_out_a_required_one_not() -> None:
    beside = {"n": number_slot(int, required=False), "m": number_slot(float)}
    assert check_reply({**GOOD, "m": 1.0}, SENT, DECLARED, all_weights=True, beside=beside) is None
    assert check_reply(GOOD, SENT, DECLARED, all_weights=True, beside=beside) == "missing m"


def test_a_number_slot_refuses_a_bool_and_an_unsigned_int_slot_a_float() -> None:
    assert check_reply({**GOOD, "n": True}, SENT, DECLARED, all_weights=True,
                       beside={"n": number_slot(float)}) == "n is True, not a number"
    beside = {"u": number_slot(np.uint32)}
    assert check_reply({**GOOD, "u": 2.5}, SENT, DECLARED, all_weights=True, beside=beside) == "u is 2.5, not an int"
    assert check_reply({**GOOD, "u": 2}, SENT, DECLARED, all_weights=True, beside=beside) is None


def test_an_open_dimension_takes_any_size_and_a_fixed_one_only_its_own() -> None:
    beside = {"bank": array_slot((-1, 3), np.float32)}
    assert check_reply({**GOOD, "bank": np.zeros((7, 3), np.float32)}, SENT, DECLARED, all_weights=True,
                       beside=beside) is None
    assert check_reply({**GOOD, "bank": np.zeros((7, 2), np.float32)}, SENT, DECLARED, all_weights=True,
                       beside=beside) == "bank has shape (7, 2), expected (any, 3)"


def test_an_update_norm_exactly_factor_times_the_median_is_no_outlier() -> None:
    assert outliers({0: 1.0, 1: 2.0, 2: 6.0}, 3.0) == {}
    assert outliers({0: 1.0, 1: 2.0, 2: 6.5}, 3.0) == {2: "update norm 6.5 > 3 x median 2"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no median of nothing (numpy's "Mean of empty slice")
        assert outliers({}, 3.0) == {}


def test_update_norm_skips_integer_weights_and_weights_not_sent() -> None:
    sent = {"w/a": np.zeros(2, np.float32), "w/n": np.array(0, np.int64)}
    reply = {"w/a": np.array([3.0, 4.0], np.float32), "w/n": np.array(100, np.int64), "w/x": np.ones(9, np.float32)}
    assert update_norm(reply, sent) == 5.0


# --- client.py ---------------------------------------------------------------------------------------------
def reference_seed(*keys: int) -> int:
    """derived_seed's documented derivation: the first 64-bit word of ``SeedSequence(keys)``, shifted to 63 bits."""
    return int(np.random.SeedSequence(list(keys)).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def test_a_clients_torch_stream_is_keyed_by_seed_round_and_id_in_that_order() -> None:
    fed = toy_federation("seed=7")
    client_context(fed, 2, 5)
    got = torch.rand(4)
    want = torch.rand(4, generator=torch.Generator().manual_seed(reference_seed(7, 5, 2, 1)))
    assert torch.equal(got, want)


def test_seeded_dp_noise_leaves_the_client_no_secret_generator() -> None:
    assert client_context(toy_federation("dp_noise=seeded"), 0, 1).dp_generator is None
    assert isinstance(client_context(toy_federation("dp_noise=secret"), 0, 1).dp_generator, torch.Generator)


def test_a_reply_without_num_examples_or_with_a_bad_state_is_refused_by_the_client_half() -> None:
    fed = toy_federation()
    replies = {0: ({"w/a": np.zeros(1)}, {}), 1: ({"num_examples": 1}, {"s": [1, 2]})}
    fed.topology.client_update = lambda method, model, msg, state, ctx: replies[ctx.client_id]
    with pytest.raises(KeyError, match="a client reply must contain 'num_examples'"):
        run_client(fed, 0, 1, {}, {})
    with pytest.raises(TypeError, match="state of client 1"):
        run_client(fed, 1, 1, {}, {})
    assert try_client(fed, 0, 1, {}, {}).error == "KeyError: \"fedavg: a client reply must contain 'num_examples'\""


def test_the_setup_exchange_runs_as_round_0_and_its_state_is_checked() -> None:
    fed = toy_federation()
    seen = []

    def client_setup(model, msg, state, ctx):
        seen.append(ctx.round)
        return {"x": 1.0}, {"s": [1]}

    fed.method.client_setup = client_setup
    with pytest.raises(TypeError, match="state of client 3"):
        run_client_setup(fed, 3, {}, {})
    assert seen == [0]


def test_describe_is_one_line_of_at_most_limit_characters() -> None:
    assert describe(ValueError("a\n  b\tc")) == "ValueError: a b c"
    exact = ValueError("x" * (300 - len("ValueError: ")))
    assert describe(exact) == f"ValueError: {'x' * 288}"
    long = describe(ValueError("y" * 400))
    assert len(long) == 300 and long == "ValueError: " + "y" * 285 + "..."


# --- client_store.py ---------------------------------------------------------------------------------------
BIG = MAP_FROM_BYTES // 4  # float32 entries at least this long are read back memory-mapped


def mapped(a: np.ndarray) -> bool:
    while a is not None and not isinstance(a, np.memmap):
        a = getattr(a, "base", None)
    return a is not None


def test_writing_a_view_of_a_spilled_entry_copies_it_into_ram(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=None)
    disk = ClientStores(tmp_path / "disk", budget_bytes=0).open("d")
    disk[0] = {"w": np.arange(BIG, dtype=np.float32)}
    view = disk[0]["w"]
    assert mapped(view)
    store = stores.open("s")
    store[0] = {"w": view, "part": view[2:5][::2]}  # the file's array and a view of a view of it
    for key, want in (("w", np.arange(BIG)), ("part", [2.0, 4.0])):
        got = store[0][key]
        assert not mapped(got)
        np.testing.assert_array_equal(got, want, err_msg=key)


def test_a_zero_budget_is_allowed_and_spills_everything(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=0)
    stores.open("s")[0] = {"w": np.ones(2)}
    assert stores.ram_bytes == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["s-0-v0.npy"]


def test_a_taken_store_name_gets_the_next_free_suffix(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=None)
    assert [stores.open("x").name for _ in range(3)] == ["x", "x.1", "x.2"]


def test_a_restored_index_charges_its_in_ram_entries_to_the_budget(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=None)
    store = stores.open("s")
    for cid in range(3):
        store[cid] = {"w": np.full(100, cid, np.float32)}  # 1 + 400 bytes each
    restored = ClientStores(tmp_path, budget_bytes=2 * 401, index=stores.index())
    assert restored.ram_bytes == 2 * 401 and list(restored.lru) == [("s", 1), ("s", 2)]  # the oldest spilled
    assert restored.stores["s"][0]["w"][0] == 0


def test_the_client_state_budget_is_in_mebibytes(tmp_path: Path) -> None:
    server = Server(toy_federation("federation.client_state_budget_mb=0.5"), tmp_path / "run")
    assert server.stores.budget == 2**19


def test_the_update_norm_bound_is_off_for_a_method_that_averages_no_weights(tmp_path: Path) -> None:
    # Local-only's replies are the clients' own models: no norm against the sent weights bounds them
    assert Server(toy_federation("method.name=local"), tmp_path / "local").norm_bound is None
    assert Server(toy_federation(), tmp_path / "fedavg").norm_bound is not None  # update_norm_factor's default 10


DP_CLIP_ONLY = "dp_weights={noise_multiplier: 0, clip: 1.0}"


@pytest.mark.parametrize(("method_dp", "uncovered"), [([], {"style"}),
                                                      (["method.params.dp={clip: 1.0, noise_multiplier: 1.0}"], set())])
def test_setup_replies_are_outside_dp_weights_unless_the_method_noises_them(tmp_path, method_dp, uncovered) -> None:
    server = Server(toy_federation("method.name=ccst", DP_CLIP_ONLY, "federation.rounds=1", *method_dp),
                    tmp_path / "run")
    msg = server.setup_request()
    server.finish_setup([Reply(c, run_client_setup(server.fed, c, msg, {})[0]) for c in range(4)])
    assert server.dp is not None and server.dp.uncovered == uncovered


def test_the_adaptive_clips_unclipped_share_is_over_the_clients_sampled_not_those_that_replied(tmp_path) -> None:
    server = Server(toy_federation("dp_weights={noise_multiplier: 0, clip: 1.0, adaptive: {}}", "federation.rounds=1"),
                    tmp_path / "run")
    row = echo_round(server, 1, fail=(3,))  # three echoes (update norm 0 <= the clip), one failure; no count noise
    assert row["clients"] == 3 and row["dp_weights/unclipped_noised"] == 0.75


def test_no_setup_request_once_the_setup_exchange_is_done(tmp_path: Path) -> None:
    server = Server(toy_federation("method.name=fedmix", "federation.rounds=1"), tmp_path / "run")
    assert server.setup_request() is not None  # FedMix exchanges its clients' batch means once
    server.mark_setup_done()
    assert server.setup_request() is None and server.setup_sent is None


def test_results_total_each_direction_of_the_traffic_over_the_rounds(tmp_path: Path) -> None:
    server = Server(toy_federation("federation.rounds=2"), tmp_path / "run")
    got = [echo_round(server, r) for r in (1, 2)]
    up, down = (sum(row[k] for row in got) for k in ("bytes_up", "bytes_down"))
    assert up != down  # a reply carries num_examples and train_loss, a message lr and round
    results = server.write_results()
    assert (results["bytes_up_total"], results["bytes_down_total"]) == (up, down)


def test_asking_whether_a_client_is_stored_does_not_make_it_recently_used(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=2 * 401)  # room for two entries of 1 + 400 bytes
    store = stores.open("s")
    store[0], store[1] = {"w": np.zeros(100, np.float32)}, {"w": np.ones(100, np.float32)}
    assert 0 in store and 7 not in store
    store[2] = {"w": np.full(100, 2, np.float32)}
    assert list(stores.lru) == [("s", 1), ("s", 2)]  # client 0, the least recently used, spilled


def test_rewriting_an_entry_in_ram_charges_its_new_bytes_once_and_makes_it_the_newest(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=None)
    store = stores.open("s")
    store[0], store[1] = {"w": np.zeros(100, np.float32)}, {"w": np.ones(100, np.float32)}
    store[0] = {"w": np.zeros(10, np.float32)}  # 1 + 40 bytes now
    assert stores.ram_bytes == 401 + 41 and list(stores.lru.items()) == [(("s", 1), 401), (("s", 0), 41)]
