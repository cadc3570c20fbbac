"""What the figures show, read back from their artists against hand values: metric curves, per-domain bars and
histograms, bytes and time, diagnostics, per-class recall, segmentation overlays and the privacy audit's table."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import to_rgba

from feddg.audit.metrics import FID_NAME
from feddg.evaluation.overlays import overlay_figure
from feddg.evaluation.plots import ROLE_COLOURS, draw_domains, draw_metric
from feddg.reports import figures
from feddg.reports.audit import audit_section, sweep_audit_section
from feddg.tasks import TaskInfo
from feddg.tasks.classification import Classification

ACC = TaskInfo.of(Classification(10).info())


def test_metric_curves_are_drawn_against_the_round_per_role():
    fig, ax = plt.subplots()
    rows = [{"round": 2, "id_acc": 70.0, "ood_acc": 40.0}, {"round": 5, "id_acc": 80.0},
            {"round": 9, "id_acc": 90.0, "val_acc": 60.0, "ood_acc": 50.0}]
    draw_metric(ax, rows, ACC)
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
    assert lines["id"] == ([2, 5, 9], [70.0, 80.0, 90.0])
    assert lines["val"] == ([9], [60.0])
    assert lines["ood"] == ([2, 9], [40.0, 50.0])
    assert ax.get_ylim() == (0.0, 100.0)  # the task's bounds
    plt.close(fig)


def test_domain_bars_are_coloured_by_role_and_labelled_in_their_order():
    fig, ax = plt.subplots()
    draw_domains(ax, {"ood_acc/z": 20.0, "id_acc/a": 80.0, "val_acc/m": 50.0, "id_loss/a": 1.0}, ACC)
    patches = [c.patches[0] for c in ax.containers if hasattr(c, "patches")]
    assert [p.get_height() for p in patches] == [20.0, 80.0, 50.0]
    assert [p.get_x() + p.get_width() / 2 for p in patches] == pytest.approx([0, 1, 2])
    assert [p.get_facecolor()[:3] for p in patches] == [to_rgba(ROLE_COLOURS[r])[:3] for r in ("ood", "id", "val")]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["z", "a", "m"]
    assert [t.get_text() for t in ax.texts] == ["20.0", "80.0", "50.0"]  # each bar's mean above it
    plt.close(fig)


def test_the_domain_histogram_bins_the_domain_means_over_the_tasks_bounds_in_4_point_steps():
    fig, ax = plt.subplots()
    ood = {f"ood_acc/w{i:03d}": [1.0, 3.0] if i < 40 else [81.0, 83.0] for i in range(60)}
    draw_domains(ax, ood, ACC)  # domain means: 2 for 40 domains, 82 for 20
    (bars,) = ax.containers
    assert len(bars.patches) == 25 and all(p.get_width() == pytest.approx(4.0) for p in bars.patches)
    assert bars.patches[0].get_x() == pytest.approx(0.0)
    heights = {round(p.get_x()): p.get_height() for p in bars.patches if p.get_height()}
    assert heights == {0: 40, 80: 20}
    assert ax.get_lines()[0].get_xdata()[0] == pytest.approx((40 * 2 + 20 * 82) / 60)  # the mean over domains
    plt.close(fig)


def test_communication_plots_each_direction_per_round_in_the_largest_fitting_unit():
    rows = [{"round": 1, "bytes_down": 3 * 2**20, "bytes_up": 2**20}, {"round": 2, "bytes_down": 2**20, "bytes_up": 0}]
    fig = figures.communication(rows)
    (ax,) = fig.axes
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
    assert lines == {"down": ([1, 2], [3.0, 1.0]), "up": ([1, 2], [1.0, 0.0])}
    assert ax.get_ylabel() == "MiB" and ax.get_ylim() == pytest.approx((0.0, 3.45))
    plt.close(fig)


def test_timing_stacks_train_aggregate_and_evaluate_per_round():
    rows = [{"round": 1, "time_train_s": 2.0, "time_aggregate_s": 0.5, "time_eval_s": 1.0},
            {"round": 2, "time_train_s": 3.0, "time_eval_s": 0.25}]
    fig = figures.timing(rows)
    (ax,) = fig.axes
    got = {c.get_label(): [(p.get_x() + p.get_width() / 2, p.get_y(), p.get_height()) for p in c.patches]
           for c in ax.containers}
    assert got == {"train (clients)": [(1, 0, 2.0), (2, 0, 3.0)], "aggregate": [(1, 2.0, 0.5), (2, 3.0, 0.0)],
                   "evaluate": [(1, 2.5, 1.0), (2, 3.0, 0.25)]}
    plt.close(fig)


def test_diagnostic_panels_are_sorted_by_name_with_a_line_each():
    panels = {"b/x": {"b/x": [(1, 2.0), (3, 4.0)]}, "a/…/y": {"conv": [(1, 1.0)], "fc": [(1, 5.0)]}}
    fig = figures.diagnostics(panels)
    first, second = fig.axes[:2]
    assert (first.get_title(), second.get_title()) == ("a/…/y", "b/x")
    assert [(ln.get_label(), list(ln.get_ydata())) for ln in first.get_lines()] == [("conv", [1.0]), ("fc", [5.0])]
    assert list(second.get_lines()[0].get_xdata()) == [1, 3] and second.get_ylim() == pytest.approx((0.0, 4.6))
    plt.close(fig)


def test_a_key_ending_in_a_client_id_goes_to_the_per_client_figure_only():
    rows = [{"round": 1, "w/0": 0.25, "w/1": 0.75, "a/b": 1.0, "flag": True}]
    assert figures.diagnostic_panels(rows, ACC) == {
        "per client": {"w": {"client 0": [(1, 0.25)], "client 1": [(1, 0.75)]}}, "a": {"a/b": {"a/b": [(1, 1.0)]}}}


def test_per_class_draws_each_roles_recall_bars_and_prediction_share_dots():
    view = {"classes": ["cat", "dog"], "id": {"recall": [90.0, None], "predicted": [60.0, 40.0]},
            "ood": {"recall": [10.0, 70.0], "predicted": [5.0, 95.0]}}
    fig = figures.per_class(view)
    (ax,) = fig.axes
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    assert bars["id: recall"][0] == 90.0 and np.isnan(bars["id: recall"][1])  # None: the class has no sample
    assert bars["ood: recall"] == [10.0, 70.0]
    dots = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
    assert dots["id: share of predictions"][0] == pytest.approx([-0.2, 0.8])  # left of each class's tick
    assert dots["id: share of predictions"][1] == [60.0, 40.0]
    assert dots["ood: share of predictions"][0] == pytest.approx([0.2, 1.2])
    assert dots["ood: share of predictions"][1] == [5.0, 95.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["cat", "dog"]
    plt.close(fig)


def test_the_per_class_legend_covers_no_bar_when_every_recall_is_high():
    """Ten classes at 92-99 % recall: matplotlib's "best" place inside the axes lay over the last classes' bars."""
    view = {"classes": [str(c) for c in range(10)],
            "id": {"recall": [92.0 + c * 0.7 for c in range(10)], "predicted": [10.0] * 10},
            "ood": {"recall": [99.0 - c * 0.5 for c in range(10)], "predicted": [10.0] * 10}}
    fig = figures.per_class(view)
    (ax,) = fig.axes
    fig.canvas.draw()
    legend, frame = ax.get_legend().get_window_extent(), ax.get_window_extent()
    bars = [p.get_window_extent() for c in ax.containers for p in c.patches]
    assert not any(legend.overlaps(b) for b in bars) and legend.x0 >= frame.x1  # beside the axes
    plt.close(fig)


def test_collapse_is_reported_from_the_share_threshold_on_the_given_role():
    view = {"classes": ["a", "b", "c"], "ood": {"predicted": [5.0, 90.0, 5.0]}, "id": {"predicted": [40.0, 30.0, 30.0]}}
    assert "90 % of its ood predictions to class 'b'" in figures.collapsed(view)  # exactly the threshold counts
    assert figures.collapsed(view, role="id") is None
    assert figures.collapsed(view, share=90.5) is None
    assert "of its id predictions to class 'a'" in figures.collapsed({"classes": ["a", "b"], "id": {"predicted": [95.0, 5.0]}},
                                                                      role="id")


def test_the_overlay_fills_truth_and_prediction_in_their_own_panels_and_outlines_the_truth_on_both():
    truth = np.zeros((1, 6, 6), dtype=np.int64)
    truth[0, 1:3, 1:3] = 1
    pred = np.zeros((1, 6, 6), dtype=np.int64)
    pred[0, 3:5, 2:6] = 2
    fig = overlay_figure("site", np.full((1, 6, 6), 0.5), truth, pred, [12.5], ["slice 0"], num_classes=3)
    ax_image, ax_true, ax_pred = fig.axes
    assert len(ax_image.images) == 1 and not ax_image.collections  # the image alone
    for ax, mask in ((ax_true, truth[0]), (ax_pred, pred[0])):
        fill = ax.images[1].get_array()
        assert np.array_equal(np.ma.getmaskarray(fill), mask == 0) and np.array_equal(fill.compressed(), mask[mask > 0])
        (outline,) = ax.collections  # the ground truth's contour: its 2×2 square, around (1.5, 1.5)
        xy = np.concatenate([p.vertices for p in outline.get_paths()])
        assert xy.min(0) == pytest.approx([0.5, 0.5]) and xy.max(0) == pytest.approx([2.5, 2.5])
    cmap_true, cmap_pred = ax_true.images[1].get_cmap(), ax_pred.images[1].get_cmap()
    assert cmap_true(0.0)[:3] == to_rgba("tab:green")[:3] and cmap_pred(0.0)[:3] == to_rgba("tab:red")[:3]
    assert cmap_pred(1.0)[:3] == to_rgba("C3")[:3]  # class 2: the next colour
    assert ax_pred.get_title() == "prediction · Dice 12.5 %"
    plt.close(fig)


def test_the_audit_section_has_a_row_per_attack_with_its_chance_levels_and_the_grids(tmp_path: Path):
    (tmp_path / "audit").mkdir()
    (tmp_path / "audit" / "g1.png").write_bytes(b"\x89PNG one")
    rows = [{"attack": "dlg", "attacker": "server", "noise_multiplier": 0.0, "epsilon": None, "psnr": 21.34,
             "psnr_chance": 9.87, "ssim": 0.456, FID_NAME: 123.45, "reid": 0.75, "reid_chance": 0.125, "grid": "g1.png"},
            {"attack": "gram", "attacker": "client", "noise_multiplier": 1.5, "epsilon": 3.21, "procrustes_rel_err": 0.0123,
             "row_cosine": 0.876, "row_cosine_top": 0.5, "row_cosine_random": 0.111}]
    (tmp_path / "audit" / "privacy.json").write_text(json.dumps({"rows": rows, "weights": "final"}))
    section = audit_section(tmp_path)
    assert section["rows"] == [
        ("dlg", "server", "0", "—", "21.3 (9.9)", "0.46", "123.5", "0.75 (0.12)"),
        ("gram", "client", "1.5", "3.21", "Procrustes err 0.0123", "—", "—",
         "row |cos| 0.88 (top eigenvector 0.50, random 0.11)")]
    assert section["weights"] == "final"
    assert [(g["title"], g["uri"]) for g in section["grids"]] == [("g1.png", "data:image/png;base64,iVBORyBvbmU=")]
    assert audit_section(tmp_path / "none") is None


def test_the_sweep_audit_plots_mean_psnr_against_z_sorted_with_the_std_as_error_bar(tmp_path: Path):
    fields = ["variant", "attack", "attacker", "z", "psnr_mean", "psnr_std"]
    with (tmp_path / "audit.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerows([fields, ["v", "dlg", "server", "1.0", "12", "2"], ["v", "dlg", "server", "0", "20", "1"],
                     ["v", "gram", "server", "0", "", ""]])
    (tmp_path / "audit.md").write_text("| table |")
    captured: list[plt.Figure] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("feddg.reports.audit.png_uri", lambda fig: captured.append(fig) or "uri")
        section = sweep_audit_section(tmp_path)
    assert section["text"] == "| table |" and section["figure"]["uri"] == "uri"
    (ax,) = captured[0].axes
    (errorbar,) = ax.containers  # the Gram row (no PSNR) is left out
    line, _, (bars,) = errorbar.lines
    assert errorbar.get_label() == "v: dlg (server)"
    assert list(line.get_xdata()) == [0.0, 1.0] and list(line.get_ydata()) == [20.0, 12.0]
    assert [seg[:, 1].tolist() for seg in bars.get_segments()] == [[19.0, 21.0], [10.0, 14.0]]
    plt.close(captured[0])


def test_an_error_bar_stops_at_the_metrics_bounds_and_the_value_label_sits_above_it():
    fig, ax = plt.subplots()
    draw_domains(ax, {"ood_acc/z": [0.0, 10.0], "id_acc/a": [90.0, 100.0]}, ACC)  # 5 ± 7.1 and 95 ± 7.1
    spans = [c.errorbar.lines[2][0].get_segments()[0][:, 1] for c in ax.containers if hasattr(c, "errorbar")]
    std = float(np.std([0.0, 10.0], ddof=1))
    assert [list(s) for s in spans] == [pytest.approx([0.0, 5.0 + std]), pytest.approx([95.0 - std, 100.0])]
    labels = {t.get_text(): t.get_position()[1] for t in ax.texts}
    assert labels == pytest.approx({"5.0": 5.0 + std + 1.5, "95.0": 101.0})  # above the bar's top, never on it
    plt.close(fig)
