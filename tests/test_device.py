"""A GPU-clean engine: every module gets its inputs on the model's device and in its dtype, for every registered
method; mixed precision (optim.amp), channels_last, per-worker devices, device strings. CPU only here: the
device checks compare ``.device`` (all CPU), the dtype checks catch a float64 (or float16) tensor made behind
the model's back; the CUDA paths themselves are not exercised."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from toy import toy_federation
from toy_pixels import needs_masks, pixel_config, pixel_federation, registered
from typer.testing import CliRunner

from feddg.algorithms.registry import list_methods
from feddg.cli import app
from feddg.config import build_config
from feddg.engines.inprocess import run_inprocess
from feddg.federation.client import client_context
from feddg.federation.server import Server
from feddg.federation.setup import build_federation, worker_device
from feddg.messages import WEIGHT_PREFIX, load_weights

#: what a method needs to run one round on the toy federation (ToyNet has no conv-stage map)
TOY_PARAMS = {
    "fedfa": ["method.params.stages=[conv, bn]"],
    "ccst": ["method.params.style_path=pixel"],
    "pardon": ["method.params.style_path=pixel"],
    "central": ["partition.kind=iid", "partition.num_clients=1"],
    "scaffold": ["optim.momentum=0"],
    "mtgc": ["optim.momentum=0", "hierarchy.stations=2"],
    "fedrc": ["hierarchy.stations=2"],
}


@contextmanager
def _federation(name: str, *overrides: str) -> Iterator[Any]:
    """The toy federation, or for a method that needs dense masks the pixel task's (registered meanwhile)."""
    if name != "hfedatm" and needs_masks(name):
        with registered():
            yield pixel_federation(pixel_config(*overrides))
    else:
        yield toy_federation(*overrides)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


@contextmanager
def inputs_checked(device: torch.device, dtype: torch.dtype = torch.float32) -> Iterator[list[str]]:
    """A forward pre-hook on every module of the process: each tensor input on ``device``, each floating one
    of ``dtype``; yields the names of the modules that ran."""
    ran: list[str] = []

    def check(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = type(module).__name__
        for t in _tensors((args, kwargs)):
            assert t.device == device, f"{name} got a tensor on {t.device}; the model is on {device}"
            assert not t.is_floating_point() or t.dtype == dtype, f"{name} got a {t.dtype} tensor; the model is {dtype}"
        ran.append(name)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: check(m, a, {}))
    try:
        yield ran
    finally:
        handle.remove()


def test_the_input_check_can_fail():
    net = torch.nn.Linear(3, 2)
    with inputs_checked(torch.device("cpu")) as ran:
        net(torch.zeros(1, 3))
        with pytest.raises(AssertionError, match="Linear got a torch.float64 tensor"):
            net.double()(torch.zeros(1, 3, dtype=torch.float64))
        with pytest.raises(AssertionError, match="Linear got a tensor on meta; the model is on cpu"):
            net(torch.zeros(1, 3, device="meta"))  # a stand-in for a CPU tensor reaching a GPU model
    assert ran == ["Linear"]


@pytest.mark.parametrize("name", [*list_methods(), "hfedatm"])
def test_every_method_feeds_its_modules_on_the_models_device_and_dtype(name, tmp_path):
    """hfedatm: FedAvg clients under HFedATM's RegMean merge without FOT (ToyNet has no permutation spec)."""
    hfedatm = ["hierarchy.stations=2", "hierarchy.station_rounds=1", "hierarchy.merge=hfedatm-no-fot"]
    over = hfedatm if name == "hfedatm" else [f"method.name={name}", *TOY_PARAMS.get(name, [])]
    with _federation(name, "federation.rounds=1", *over) as fed, inputs_checked(fed.device) as ran:
        server = Server(fed, tmp_path / name)
        results = run_inprocess(server)
    assert ran and math.isfinite(results["final"][f"ood_{fed.task.metric}"])
    assert all("clients_failed" not in m for m in server.metrics)  # a hook's failure inside a client drops it


@pytest.mark.parametrize("name", list_methods())
def test_bf16_autocast_trains_one_round_with_float32_weights(name, tmp_path):
    training_outputs: list[torch.dtype] = []
    handle = torch.nn.modules.module.register_module_forward_hook(  # the heads: a Linear, or the pixel task's conv
        lambda m, a, out: training_outputs.append(out.dtype) if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)
        and m.training else None)
    try:
        with _federation(name, f"method.name={name}", "federation.rounds=1", "optim.amp=bf16",
                         *TOY_PARAMS.get(name, [])) as fed:
            server = Server(fed, tmp_path / name)
            run_inprocess(server)
    finally:
        handle.remove()
    assert math.isfinite(server.metrics[0]["train_loss"])
    assert all(p.dtype == torch.float32 for p in fed.model.parameters())
    weights = fed.topology.eval_weights(fed.method, server.state, None)
    dtypes = {np.asarray(v).dtype for k, v in weights.items() if k.startswith(WEIGHT_PREFIX)}
    assert dtypes <= {np.dtype("float32"), np.dtype("int64")}  # BatchNorm's num_batches_tracked is int64
    assert torch.bfloat16 in training_outputs  # the local training ran under autocast


def test_fp16_and_bf16_autocast_in_the_local_loop_and_evaluation(tmp_path):
    """The shared loop (train_local) and evaluation both run under autocast: their Linear outputs are half."""
    for amp, half in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        fed = toy_federation("federation.rounds=1", f"optim.amp={amp}")
        seen: list[tuple[bool, torch.dtype]] = []
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, out: seen.append((m.training, out.dtype)) if isinstance(m, torch.nn.Linear) else None)
        try:
            server = Server(fed, tmp_path / amp)
            run_inprocess(server)
        finally:
            handle.remove()
        assert {dtype for training, dtype in seen if training} == {half}, amp
        assert {dtype for training, dtype in seen if not training} == {half}, amp
        assert math.isfinite(server.metrics[0]["train_loss"]) and server.metrics[0]["id_acc"] > 25


def test_amp_off_is_float32_throughout(tmp_path):
    fed = toy_federation("federation.rounds=1")
    with inputs_checked(fed.device):
        run_inprocess(Server(fed, tmp_path / "off"))


def test_channels_last_model_and_batches_give_the_same_training(tmp_path, cache_dir):
    over = ["data.dataset=digits-dg", f"data.cache_dir={cache_dir}", "data.max_per_domain=40", "model.name=lenet",
            "partition.num_clients=3", "federation.rounds=1", "device=cpu", "split.target=uci"]
    plain = build_federation(build_config({}, over))
    fed = build_federation(build_config({}, [*over, "model.channels_last=true"]))
    convs = [m.weight for m in fed.model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    x, _ = next(client_context(fed, 0, 1).batches())
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    a, b = Server(plain, tmp_path / "plain"), Server(fed, tmp_path / "cl")
    run_inprocess(a)
    run_inprocess(b)
    load_weights(fed.model, b.state["weights"])  # the format survives loading a message
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    for k, v in a.state["weights"].items():
        np.testing.assert_allclose(b.state["weights"][k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_workers_get_one_device_each_round_robin_over_the_gpus(monkeypatch):
    assert worker_device("cpu", 3) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_device("auto", 1) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [worker_device("cuda", i) for i in range(5)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert [worker_device("auto", i) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert {worker_device("cuda:1", i) for i in range(3)} == {"cuda:1"}  # pinned


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_asking_for_cuda_without_it_is_one_line(cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    res = CliRunner().invoke(app, ["run", "configs/demo.yaml", "-o", "device=cuda"])
    lines = res.stdout.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert lines[0] == "error: device: cuda requested but torch has no CUDA; use device=cpu (or auto)"


def test_placement_helpers_on_images_and_token_dicts():
    from feddg.devices import autocast, batch_size, to_device

    with pytest.raises(ValueError, match=r"^unknown amp 'fp8'; expected off, bf16 or fp16$"):
        autocast("cpu", "fp8")
    image, tokens = torch.zeros(2, 3, 4, 5), {"input_ids": torch.zeros(3, 7, dtype=torch.long),
                                              "attention_mask": torch.ones(3, 7, dtype=torch.long)}
    assert to_device(image, "cpu", channels_last=True).is_contiguous(memory_format=torch.channels_last)
    moved = to_device(tokens, "cpu", channels_last=True)  # not images: left as they are
    assert isinstance(moved, dict) and all(moved[k].is_contiguous() and torch.equal(moved[k], v)
                                           for k, v in tokens.items())
    assert batch_size(image) == 2 and batch_size(tokens) == 3
