"""Audit pins for the small models (alexnet, vgg, lenet, mlp, cnn) and the run report's helpers: parameter counts
computed by hand, reference forwards written with torch.nn.functional, defaults, and the report's text."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import matplotlib.pyplot as plt
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from feddg.evaluation.plots import EVERY_DOMAIN_TRAINS
from feddg.models import create_model
from feddg.models.alexnet import AlexNet
from feddg.models.base import head_linear
from feddg.models.cnn import SmallCNN
from feddg.models.lenet import LeNet
from feddg.models.mlp import BagOfWordsMLP
from feddg.models.registry import check_model_params
from feddg.reports import figures
from feddg.reports.counts import run_counts
from feddg.reports.overhead import overhead_table, sweep_results
from feddg.reports.page import page_context, render
from feddg.reports.run import _flat, _held_out, _size, domain_rows, failure_notes, run_report
from feddg.tasks import TaskInfo
from feddg.tasks.classification import Classification


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _on_meta(name: str, **kwargs):
    with torch.device("meta"):
        return create_model(name, **kwargs)


# ---------------------------------------------------------------------------------------------- models: counts


def test_alexnet_default_head_is_1024_wide_and_counts_12_974_154_parameters():
    # convs: 3·64·121+64, 64·192·25+192, 192·384·9+384, 384·256·9+256, 256·256·9+256 = 2_469_696
    # BN2d: 2·(64+192+384+256+256) = 2_304; fc: 9216·1024+1024, 1024·1024+1024, 1024·10+10 = 10_498_058
    # BN1d: 2·2·1024 = 4_096 (FedFA's "49.5 MB": 12.97 M float32)
    model = _on_meta("alexnet", num_classes=10)
    assert model.classifier.fc1.out_features == 1024
    assert _count(model) == 2_469_696 + 2_304 + 10_498_058 + 4_096


def test_alexnet_head_has_batchnorm_after_both_hidden_layers():
    model = _on_meta("alexnet", num_classes=10, hidden_dim=16)
    kinds = [type(m) for m in model.classifier]
    assert kinds == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]


def test_lenet_counts_62_006_parameters_at_32_px_and_44_726_at_28_px():
    # conv 3·6·25+6 = 456, conv 6·16·25+16 = 2_416, fc 400·120+120 = 48_120, 120·84+84 = 10_164, 84·10+10 = 850
    assert _count(LeNet(10, 3, 32)) == 456 + 2_416 + 48_120 + 10_164 + 850
    # 28 px: 28-4=24 → 12 → 8 → 4: flatten 16·4·4 = 256: fc 256·120+120 = 30_840
    assert _count(LeNet(10, 3, 28)) == 456 + 2_416 + 30_840 + 10_164 + 850


def test_cnn_counts_391_466_parameters_with_bias_free_convolutions():
    # convs 9·(3·32 + 32·64 + 64·128 + 128·256) = 387_936, BN 2·(32+64+128+256) = 960, fc 256·10+10 = 2_570
    model = create_model("cnn", num_classes=10)
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Conv2d))
    assert _count(model) == 387_936 + 960 + 2_570


def test_cnn_gn_uses_8_groups_and_the_same_parameter_count():
    model = create_model("cnn_gn", num_classes=10)
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert [(m.num_groups, m.num_channels) for m in norms] == [(8, 32), (8, 64), (8, 128), (8, 256)]
    assert _count(model) == 387_936 + 960 + 2_570


def test_mlp_default_hidden_is_256_with_a_relu():
    model = create_model("mlp", num_classes=3, in_features=5)
    assert model.feature_dim == 256 and _count(model) == 5 * 256 + 256 + 256 * 3 + 3
    x = torch.randn(4, 5)
    assert torch.equal(model.features(x), torch.relu(model.hidden[0](x)))


@pytest.mark.parametrize(("in_features", "hidden"), [(0, 4), (4, 0)])
def test_mlp_refuses_an_empty_layer(in_features, hidden):
    with pytest.raises(ValueError, match=r"^mlp needs in_features and hidden >= 1, got "):
        BagOfWordsMLP(2, in_features, hidden)


def test_cnn_refuses_an_unknown_norm():
    with pytest.raises(ValueError, match=r"^cnn norm must be 'batch' or 'group', got 'layer'$"):
        SmallCNN(3, norm="layer")


# ---------------------------------------------------------------------------------------------- models: forwards


def test_alexnet_forward_at_64_px_is_the_functional_reference():
    torch.manual_seed(0)
    model = AlexNet(4, in_channels=3, image_size=64, hidden_dim=8).eval()
    assert model.layer1.conv1.stride == (1, 1) and model.layer1.conv1.padding == (5, 5)  # 64 px is "small"
    x = torch.randn(2, 3, 64, 64)

    def stage(h, layer, i):
        conv, bn = getattr(layer, f"conv{i}"), getattr(layer, f"bn{i}")
        h = F.conv2d(h, conv.weight, conv.bias, conv.stride, conv.padding)
        return F.relu(F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps))

    h = F.max_pool2d(stage(x, model.layer1, 1), 3, 2)  # 64 → 31
    h = F.max_pool2d(stage(h, model.layer2, 2), 3, 2)  # 31 → 15
    h = stage(stage(stage(h, model.layer3, 3), model.layer4, 4), model.layer5, 5)
    h = F.max_pool2d(h, 3, 2)  # 15 → 7
    assert h.shape[-2:] == (7, 7)
    h = F.adaptive_avg_pool2d(h, 6).flatten(1)
    with torch.no_grad():
        assert torch.allclose(model.features(x), h, atol=1e-6)


def test_alexnet_above_64_px_uses_the_stride_4_first_convolution():
    model = _on_meta("alexnet", num_classes=3, image_size=65)
    assert model.layer1.conv1.stride == (4, 4) and model.layer1.conv1.padding == (2, 2)


def test_lenet_forward_is_the_functional_reference():
    torch.manual_seed(0)
    model = LeNet(5, in_channels=1, image_size=28).eval()
    convs = [m for m in model.conv if isinstance(m, nn.Conv2d)]
    fcs = [m for m in model.fc if isinstance(m, nn.Linear)]
    assert [c.padding for c in convs] == [(0, 0), (0, 0)]
    x = torch.randn(3, 1, 28, 28)
    h = F.max_pool2d(F.relu(F.conv2d(x, convs[0].weight, convs[0].bias)), 2)
    h = F.max_pool2d(F.relu(F.conv2d(h, convs[1].weight, convs[1].bias)), 2).flatten(1)
    h = F.relu(F.linear(F.relu(F.linear(h, fcs[0].weight, fcs[0].bias)), fcs[1].weight, fcs[1].bias))
    with torch.no_grad():
        assert torch.allclose(model.features(x), h, atol=1e-6)


def test_cnn_pools_after_the_first_three_blocks_and_averages_globally():
    torch.manual_seed(0)
    model = SmallCNN(3, in_channels=1, block_widths=(4, 4, 8)).eval()
    x = torch.randn(2, 1, 16, 16)
    h = x
    for i, block in enumerate(model.blocks):
        conv, bn = block[0], block[1]
        h = F.relu(F.batch_norm(F.conv2d(h, conv.weight, None, 1, 1), bn.running_mean, bn.running_var,
                                bn.weight, bn.bias, False, 0.0, bn.eps))
        if i < 2:
            h = F.max_pool2d(h, 2)
    assert h.shape[-2:] == (4, 4)
    with torch.no_grad():
        assert torch.allclose(model.features(x), h.mean(dim=(2, 3)), atol=1e-6)


# ---------------------------------------------------------------------------------------------- models: vgg


def test_vgg_head_has_two_dropouts_of_one_half_by_default():
    model = _on_meta("vgg11", num_classes=10, reduced_head=True)
    assert [m.p for m in model.classifier if isinstance(m, nn.Dropout)] == [0.5, 0.5]


def test_vgg_reduced_head_pools_to_one_cell_and_counts_its_512_wide_layers():
    model = _on_meta("vgg11", num_classes=10, reduced_head=True)
    assert model.feature_dim == 512 and model.avgpool.output_size == (1, 1)
    # 512·512+512, 512·512+512, 512·10+10
    assert sum(p.numel() for p in model.classifier.parameters()) == 2 * 262_656 + 5_130


def test_vgg_rounds_its_pools_up_at_64_px_and_below_only():
    assert all(m.ceil_mode for m in _on_meta("vgg11", num_classes=2, image_size=64, reduced_head=True).trunk
               if isinstance(m, nn.MaxPool2d))
    assert not any(m.ceil_mode for m in _on_meta("vgg11", num_classes=2, image_size=96, reduced_head=True).trunk
                   if isinstance(m, nn.MaxPool2d))


def test_vgg_initialisation_is_torchvisions():
    torch.manual_seed(0)
    model = create_model("vgg11_bn", num_classes=10, in_channels=3, reduced_head=True)
    first = model.trunk[0]
    # kaiming_normal_(fan_out, relu): std = sqrt(2 / (64·3·3)) = 0.0589 (fan_in would be sqrt(2/27) = 0.272)
    assert first.weight.std().item() == pytest.approx((2 / 576) ** 0.5, rel=0.1)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(torch.count_nonzero(c.bias) == 0 for c in convs)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears[0].weight.std().item() == pytest.approx(0.01, rel=0.1)
    assert all(torch.count_nonzero(m.bias) == 0 for m in linears)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(torch.all(b.weight == 1) and torch.all(b.bias == 0) for b in bns)


def test_vgg_at_28_px_keeps_a_one_cell_map_through_ceil_mode_pools():
    torch.manual_seed(0)
    model = create_model("vgg11", num_classes=3, in_channels=1, image_size=28, reduced_head=True).eval()
    x = torch.randn(1, 1, 28, 28)
    with torch.no_grad():
        trunk = model.trunk(x)
        assert trunk.shape == (1, 512, 1, 1)  # 28 → 14 → 7 → 4 → 2 → 1
        assert torch.equal(model.features(x), trunk.flatten(1))


# ---------------------------------------------------------------------------------------------- models: registry


def test_image_models_default_to_3_channels_at_28_px():
    model = _on_meta("lenet", num_classes=2)
    assert model.conv[0].in_channels == 3 and model.fc[0].in_features == 256  # 28 px: 16·4·4


def test_model_params_may_not_set_what_the_data_gives():
    with pytest.raises(ValueError, match=r"^model\.params\.image_size: given by the data or the run"):
        check_model_params("cnn", ["block_widths", "image_size"])


def test_an_unknown_model_option_is_refused_naming_the_options():
    with pytest.raises(ValueError, match=r"^model\.params\.widht: model alexnet has no such option; it takes "
                                         r"hidden_dim, small_input$"):
        create_model("alexnet", 2, widht=3)


def test_model_path_is_refused_for_models_that_take_none():
    with pytest.raises(ValueError, match=r"^model\.path is for swin_t, swin_tiny_test, transformer; model lenet"):
        create_model("lenet", 2, path="/nowhere")


def test_head_linear_is_the_last_linear_of_the_classifier():
    model = _on_meta("alexnet", num_classes=3, hidden_dim=4)
    assert head_linear(model, "x") == ("classifier.fc3", model.classifier.fc3)


# ---------------------------------------------------------------------------------------------- reports: helpers

ACC = TaskInfo.of(Classification(10).info())


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1,023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                         (5 * 2**20, "5.0 MiB"), (3 * 2**30, "3.0 GiB"), (2**40, "1,024.0 GiB")])
def test_sizes_are_in_the_largest_binary_unit_below_1024(n, text):
    assert _size(n) == text


def test_the_held_out_domains_come_from_results_then_the_split():
    assert _held_out({"target": ["a", "b"]}, {"target": ["x"]}) == "a, b"
    assert _held_out({"target": []}, {}) == EVERY_DOMAIN_TRAINS
    assert _held_out({}, {"protocol": "federated", "target": ["x"]}) == EVERY_DOMAIN_TRAINS
    assert _held_out({}, {"target": ["x", "y"]}) == "x, y"
    assert _held_out({}, {"target": "x"}) == "x"
    assert _held_out({}, {}) == "?"


def test_nested_params_are_flattened_to_dotted_keys():
    assert _flat({"a": 1, "b": {"c": 2, "d": {"e": 3}}}) == [("a", 1), ("b.c", 2), ("b.d.e", 3)]


def test_domain_rows_follow_the_role_order_and_skip_the_domain_means():
    final = {"ood_acc/uci": 30.0, "ood_acc": 30.0, "val_acc/svhn": 50.0, "id_acc/mnist": 90.0, "id_acc/syn": 80.0}
    rows = domain_rows(final, {"ood_acc/uci": 40, "id_acc/mnist": 7}, ACC)
    assert [(r["role"], r["domain"], r["value"], r["n"]) for r in rows] == [
        ("id", "mnist", 90.0, 7), ("id", "syn", 80.0, None), ("val", "svhn", 50.0, None), ("ood", "uci", 30.0, 40)]


def test_no_failure_note_without_lost_client_rounds():
    assert failure_notes(None) == [] and failure_notes({}) == []
    assert failure_notes({"client_rounds_lost": 0, "rounds": [], "clients": {}}) == []


def test_run_counts_notes_what_is_missing(tmp_path):
    counts, task, notes = run_counts(tmp_path)
    assert counts == {} and task is None and len(notes) == 2
    assert notes[0].startswith("sample counts unavailable") and notes[1].startswith("the task is unknown")
    (tmp_path / "results.json").write_text(json.dumps({"task": Classification(10).info(), "counts": {}}))
    counts, task, notes = run_counts(tmp_path)
    assert counts == {} and task is not None and [n[:25] for n in notes] == ["sample counts unavailable"]
    (tmp_path / "results.json").write_text(json.dumps({"task": Classification(10).info(), "counts": {"ood_acc": 4}}))
    assert run_counts(tmp_path)[0] == {"ood_acc": 4} and run_counts(tmp_path)[2] == []


def _hier(method, merge, time_s):
    return {"hierarchy": {"client_method": method, "merge": merge, "per_server_round": {"time_s": time_s}}}


def test_overhead_table_means_the_rounds_per_merge_and_gives_the_increase_over_avg():
    table = overhead_table([_hier("fedavg", "avg", 1.0), _hier("fedavg", "avg", 3.0), _hier("fedavg", "hfedatm", 3.0),
                            _hier("fedavg", "regmean", 100.0), {"hierarchy": None}, {},
                            _hier("fedprox", "hfedatm", 1.0), _hier("fedprox", "avg", 4.0),
                            _hier("scaffold", "regmean", 5.0)])  # a method with other merges only: no row
    assert table.splitlines()[2:] == ["| fedavg | 2.000 | 3.000 | 50.0 |",  # (3 - 2) / 2
                                      "| fedprox | 4.000 | 1.000 | -75.0 |"]  # (1 - 4) / 4


def test_overhead_table_keeps_first_seen_methods_means_three_rounds_and_skips_runs_without_a_time():
    untimed = {"hierarchy": {"client_method": "fedavg", "merge": "avg", "per_server_round": {}}}
    table = overhead_table([_hier("scaffold", "avg", 2.0), _hier("scaffold", "hfedatm", 3.0), untimed,
                            _hier("fedavg", "avg", 1.0), _hier("fedavg", "avg", 2.0), _hier("fedavg", "avg", 6.0),
                            _hier("fedavg", "hfedatm", 4.5)])
    assert table.splitlines()[2:] == ["| scaffold | 2.000 | 3.000 | 50.0 |",  # the sweep's order, not sorted
                                      "| fedavg | 3.000 | 4.500 | 50.0 |"]  # mean of 1, 2, 6 (median 2)


def test_sweep_results_reads_each_listed_run_and_skips_blank_lines(tmp_path):
    runs = []
    for name, merge in (("a", "avg"), ("b", "hfedatm")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(_hier("fedavg", merge, 1.0)))
        runs.append(json.dumps({"run_dir": str(tmp_path / name)}))
    (tmp_path / "runs.jsonl").write_text(runs[0] + "\n\n" + runs[1] + "\n")
    assert [r["hierarchy"]["merge"] for r in sweep_results(tmp_path)] == ["avg", "hfedatm"]


# ---------------------------------------------------------------------------------------------- reports: figures


def test_collapse_prefers_the_global_model_on_the_held_out_domain_over_the_holdouts():
    view = {"classes": ["a", "b"], "id": {"predicted": [95.0, 5.0]}, "global_ood": {"predicted": [50.0, 50.0]}}
    assert figures.collapsed(view) is None
    assert "of its id predictions" in figures.collapsed({"classes": ["a", "b"], "id": {"predicted": [95.0, 5.0]},
                                                        "global_id": {"predicted": [50.0, 50.0]}})


def test_a_single_class_is_never_a_collapse():
    assert figures.collapsed({"classes": ["a"], "ood": {"predicted": [100.0]}}) is None


def test_communication_switches_unit_at_exactly_one_mib():
    fig = figures.communication([{"round": 1, "bytes_down": 2**20, "bytes_up": 2**19}])
    (ax,) = fig.axes
    assert ax.get_ylabel() == "MiB" and [list(ln.get_ydata()) for ln in ax.get_lines()] == [[1.0], [0.5]]
    plt.close(fig)


def test_layer_keys_share_a_panel_and_two_part_keys_keep_their_own():
    rows = [{"round": 1, "fot/conv/moved": 1.0, "fot/fc/moved": 2.0, "fot/passes": 3.0, "loose": 4.0}]
    assert figures.diagnostic_panels(rows, ACC) == {
        "fot": {"fot/…/moved": {"conv": [(1, 1.0)], "fc": [(1, 2.0)]}, "fot/passes": {"fot/passes": [(1, 3.0)]}},
        "other": {"loose": {"loose": [(1, 4.0)]}}}


@pytest.mark.parametrize(("lines", "legend"), [(10, True), (11, False)])
def test_a_panel_has_a_legend_up_to_ten_lines(lines, legend):
    fig = figures.diagnostics({"p": {f"l{i}": [(1, float(i))] for i in range(lines)}})
    assert (fig.axes[0].get_legend() is not None) is legend
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- reports: the page


def _run_dir(tmp_path: Path, rows, results) -> Path:
    run = tmp_path / "r"
    run.mkdir()
    base = {"bytes_down": 2048, "bytes_up": 1024, "time_round_s": 0.5, "clients": 2, "lr": 0.1, "train_loss": 1.0}
    (run / "metrics.jsonl").write_text("".join(json.dumps({**base, **r}) + "\n" for r in rows))
    (run / "results.json").write_text(json.dumps({"task": Classification(10).info(), "counts": {}, **results}))
    (run / "config.yaml").write_text("method:\n  name: fedavg\ndata:\n  dataset: digits-dg\n")
    return run


def test_the_page_reports_the_last_evaluated_round_and_the_global_model_figure(tmp_path):
    rows = [{"round": 1, "ood_acc": 11.0, "ood_acc/uci": 11.0, "global_ood_acc": 12.0},
            {"round": 2, "ood_acc": 22.0, "ood_acc/uci": 22.0, "global_ood_acc": 23.5}, {"round": 3}]
    run = _run_dir(tmp_path, rows, {"method": "fedavg", "dataset": "digits-dg", "target": ["uci"], "seed": 0})
    html = " ".join(run_report(run)[0].read_text().split())
    assert "per domain (last evaluation, round 2)" in html
    assert "<b>22.00</b><span>ood_acc (%)</span>" in html and "<b>23.50</b><span>global_ood_acc (%)</span>" in html
    assert "<b>1.5</b><span>time (s)</span>" in html and "<b>6.0 KiB / 3.0 KiB</b><span>sent down / up</span>" in html


# ---------------------------------------------------------------------------------------------- reports: the page


def test_a_page_escapes_notes_and_refuses_a_missing_variable(tmp_path):
    context = page_context("<run>", "runs/x", ["client 3: <lambda> & co"])
    html = render("base.html.j2", tmp_path / "p.html", subtitle="s", **context).read_text()
    assert "client 3: &lt;lambda&gt; &amp; co" in html and "<lambda>" not in html
    assert "<title>&lt;run&gt;</title>" in html
    with pytest.raises(jinja2.UndefinedError, match="subtitle"):
        render("base.html.j2", tmp_path / "q.html", **context)  # a page never shows a silently empty field


def test_the_footer_names_the_version_or_says_it_is_not_installed_and_the_minute(monkeypatch):
    import importlib.metadata as metadata

    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", page_context("t", "s", [])["generated"])

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert page_context("t", "s", [])["version"] == "(not installed)"
