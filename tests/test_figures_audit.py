"""Mutation audit of the figures and their data: plots.py's axes, bars and run figures, the segmentation overlays,
the style grid's layout, model selection and the paper tables, each against hand values on small inputs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from toy import toy_federation, toy_federation_of

from feddg.config import dump_config
from feddg.evaluation import plots
from feddg.evaluation.overlays import OUTLINE, example_path, overlay_figure
from feddg.evaluation.plots import (
    EVERY_DOMAIN_TRAINS,
    MAX_DOMAIN_BARS,
    domain_bars,
    draw_domains,
    draw_metric,
    from_zero,
    integer_rounds,
    plot_run,
    read_json,
    read_metrics,
    run_method,
    run_task,
    run_title,
)
from feddg.evaluation.selection import select
from feddg.evaluation.tables import DEGRADED_NOTE, csv_table, markdown_table, paired_deltas
from feddg.reports import style_grid as sg
from feddg.tasks import TaskInfo

ACC = TaskInfo("classification", "acc", "accuracy", "%", (0.0, 100.0), True, 10.0)


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Figure]]:
    """The figures plots.save would write, by file name, the latest of each (nothing is drawn to disk)."""
    figs: dict[str, Figure] = {}

    def keep(fig: Figure, path: Path) -> Path:
        if Path(path).name in figs:
            plt.close(figs[Path(path).name])
        figs[Path(path).name] = fig
        return Path(path)

    monkeypatch.setattr(plots, "save", keep)
    yield figs
    for fig in figs.values():
        plt.close(fig)


def _lines(ax: plt.Axes) -> dict[str, tuple[list[float], list[float]]]:
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}


# plots.py: axes -------------------------------------------------------------------------------------------------

def test_two_rounds_get_half_a_round_of_room_and_three_apart_are_left_to_autoscale() -> None:
    """integer_rounds: rounds 3 and 4 (one apart) get 2.5-4.5; rounds 3 and 5 are not pinned."""
    fig, (near, far) = plt.subplots(1, 2)
    integer_rounds(near, [3, 4])
    integer_rounds(far, [3, 5])
    assert near.get_xlim() == (2.5, 4.5) and not near.get_autoscalex_on()
    assert far.get_autoscalex_on() and far.get_xlabel() == "round"
    plt.close(fig)


def test_from_zero_starts_at_zero_with_room_above_a_line_at_zero_and_leaves_negative_values_alone() -> None:
    """from_zero: values 0 and 2 give 0-2.3 (1.15 × the largest); all zero or a negative value: no fixed axis."""
    fig, axes = plt.subplots(1, 3)
    from_zero(axes[0], [0.0, 2.0])
    from_zero(axes[1], [0.0, 0.0])
    from_zero(axes[2], [-1.0, 2.0])
    assert axes[0].get_ylim() == pytest.approx((0.0, 2.3))
    assert axes[1].get_autoscaley_on() and axes[2].get_autoscaley_on()
    plt.close(fig)


def test_metric_markers_are_hollow_for_id_and_val_and_filled_for_ood() -> None:
    """draw_metric's ROLE_STYLES: larger hollow id (8) and val (6) markers behind the filled ood (4) one."""
    fig, ax = plt.subplots()
    draw_metric(ax, [{"round": 1, "id_acc": 50.0, "val_acc": 50.0, "ood_acc": 50.0, "global_ood_acc": 40.0}], ACC)
    got = {ln.get_label(): (ln.get_markersize(), ln.get_markerfacecolor()) for ln in ax.get_lines()
           if not ln.get_label().startswith("chance")}
    assert got["id"] == (8, "none") and got["val"] == (6, "none")
    assert got["ood"][0] == 4 and got["ood"][1] != "none"
    assert got["global_ood"][1] != "none" and _lines(ax)["global_ood"] == ([1], [40.0])
    plt.close(fig)


def test_the_metric_panel_has_the_chance_line_the_bounds_and_room_around_its_rounds() -> None:
    """Rounds 4 and 5 only: x 3.5-5.5; y the task's bounds; the dotted chance line at 10 labelled with its unit."""
    fig, ax = plt.subplots()
    draw_metric(ax, [{"round": 4, "ood_acc": 20.0}, {"round": 5, "ood_acc": 30.0}], ACC)
    assert ax.get_xlim() == (3.5, 5.5) and ax.get_ylim() == (0.0, 100.0)
    (chance,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("chance")]
    assert chance.get_label() == "chance (10 %)" and list(chance.get_ydata()) == [10.0, 10.0]
    assert (ax.get_ylabel(), ax.get_title()) == ("accuracy (%)", "accuracy")
    plt.close(fig)


def test_the_curves_figure_plots_the_training_loss_of_every_round(tmp_path: Path, saved: dict[str, Figure]) -> None:
    """plot_curves' loss panel: every row's train_loss against its round, one or two rounds with room."""
    rows = [{"round": 1, "train_loss": 2.0}, {"round": 2, "train_loss": 1.5, "ood_acc": 40.0}]
    plots.plot_curves(rows, tmp_path / "curves.png", ACC, "t")
    ax_acc, ax_loss = saved["curves.png"].axes
    assert list(ax_loss.get_lines()[0].get_ydata()) == [2.0, 1.5]
    assert ax_loss.get_xlim() == (0.5, 2.5) and ax_loss.get_ylabel() == "loss"
    assert _lines(ax_acc)["ood"] == ([2], [40.0])
    assert ax_acc.get_xlim() == ax_loss.get_xlim()  # one evaluation (round 2) on the loss's rounds 1-2, not 1.5-2.5
    rows = [{"round": r, "train_loss": 1.0 / r} for r in range(1, 7)] + [{"round": 7, "train_loss": 0.1, "ood_acc": 50}]
    plots.plot_curves(rows, tmp_path / "curves.png", ACC, "t")
    ax_acc, ax_loss = saved["curves.png"].axes
    low, high = ax_acc.get_xlim()
    assert (low, high) == ax_loss.get_xlim() and low < 1 and high > 7


# plots.py: per-domain bars --------------------------------------------------------------------------------------

def test_domain_bars_are_the_per_domain_keys_of_the_metric_of_the_three_roles() -> None:
    """Means (no domain), another metric's keys, extra/ and global_ roles are no bars; a number is a list of one."""
    values = {"ood_acc": 50.0, "ood_acc/z": 20, "id_loss/a": 1.0, "extra/rot_acc/a": 5.0, "global_ood_acc/z": 9.0,
              "val_acc/m": [40.0, 60.0], "id_acc/a": 80.0}
    assert domain_bars(values, ACC) == [("z", "ood", [20.0]), ("m", "val", [40.0, 60.0]), ("a", "id", [80.0])]


def test_exactly_max_domain_bars_domains_still_get_a_bar_each() -> None:
    """Forty domains: forty bars (the histogram starts past MAX_DOMAIN_BARS)."""
    fig, ax = plt.subplots()
    draw_domains(ax, {f"ood_acc/d{i:02d}": 50.0 for i in range(MAX_DOMAIN_BARS)}, ACC)
    assert MAX_DOMAIN_BARS == 40
    assert len([c for c in ax.containers if hasattr(c, "patches")]) == 40 and len(ax.get_xticklabels()) == 40
    plt.close(fig)


def test_two_seeds_get_a_dot_each_in_their_order_and_the_mean_above_the_error_bar() -> None:
    """Values 70, 50 for one domain: bar 60, dots at 0 ∓ 0.15 in the given order, std 14.14 (ddof=1), text above
    at 60 + 14.14 + 1.5; a single value 100 puts its text at the cap 1.01 × 100."""
    fig, ax = plt.subplots()
    draw_domains(ax, {"id_acc/a": [70.0, 50.0], "ood_acc/b": [100.0]}, ACC)
    (dots,) = [ln for ln in ax.get_lines() if ln.get_marker() == "o"]  # not the error bar's caps
    assert list(dots.get_xdata()) == pytest.approx([-0.15, 0.15]) and list(dots.get_ydata()) == [70.0, 50.0]
    std = np.sqrt(200.0)
    a, b = ax.texts
    assert a.get_text() == "60.0" and a.get_position()[1] == pytest.approx(60.0 + std + 1.5)
    assert b.get_text() == "100.0" and b.get_position()[1] == pytest.approx(101.0)
    assert ax.get_ylim() == pytest.approx((0.0, 122.0)) and ax.get_title() == "accuracy per domain"  # 22 % for the legend
    plt.close(fig)


def test_a_domain_bar_is_the_mean_of_its_values_not_their_median() -> None:
    """Values 0, 10, 50: the bar and its text are the mean 20 (the median is 10)."""
    fig, ax = plt.subplots()
    draw_domains(ax, {"ood_acc/b": [0.0, 10.0, 50.0]}, ACC)
    (bar,) = [c for c in ax.containers if hasattr(c, "patches")]
    assert bar.patches[0].get_height() == pytest.approx(20.0) and ax.texts[0].get_text() == "20.0"
    plt.close(fig)


def test_domain_bars_start_at_the_tasks_lower_bound_and_keep_a_given_title() -> None:
    """A metric on 10-50: y from 10 to 50 + 0.22 × 40 (the legend's band); counts under the name of the key's own
    domain."""
    task = TaskInfo("toy", "err", "error", "", (10.0, 50.0), False, None)
    fig, ax = plt.subplots()
    draw_domains(ax, {"ood_err/b": 30.0, "ood_err": 30.0}, task, {"ood_err/b": 7, "ood_err": 99}, title="mine")
    assert ax.get_ylim() == pytest.approx((10.0, 58.8)) and ax.get_title() == "mine"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["b\nn=7"]
    plt.close(fig)


def test_the_domain_histogram_spans_the_bounds_and_counts_domain_means_not_values() -> None:
    """41 domains with values 10 and 30 each: 41 domains at 20 (their means), x over the bounds, title counts."""
    fig, ax = plt.subplots()
    draw_domains(ax, {f"ood_acc/w{i:02d}": [10.0, 30.0] for i in range(41)}, ACC)
    (bars,) = ax.containers
    assert {round(p.get_x()): p.get_height() for p in bars.patches if p.get_height()} == {20: 41}
    assert ax.get_xlim() == (0.0, 100.0) and ax.get_title() == "accuracy per domain (41 domains; dashed: mean)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ood: 41 domains"]
    plt.close(fig)


def test_the_legend_names_each_role_once_and_a_histogram_keeps_a_given_title() -> None:
    fig, (bars, spread) = plt.subplots(1, 2)
    draw_domains(bars, {"ood_acc/z": 20.0, "id_acc/a": 80.0, "id_acc/b": 70.0}, ACC)
    assert [t.get_text() for t in bars.get_legend().get_texts()] == ["ood", "id"]
    draw_domains(spread, {f"ood_acc/w{i:02d}": 50.0 for i in range(41)}, ACC, title="writers")
    assert spread.get_title() == "writers"
    plt.close(fig)


def test_only_a_task_with_a_chance_level_has_one() -> None:
    """has_chance: a task without chance (classes discovered from folders) has none, even for its own metric."""
    none = TaskInfo("classification", "acc", "accuracy", "%", (0.0, 100.0), True, None)
    assert not plots.has_chance(none, "ood_acc") and not plots.has_chance(none)
    assert plots.has_chance(ACC, "ood_acc") and plots.has_chance(ACC)


@pytest.mark.parametrize(("n", "width"), [(2, 4.0), (5, 6.0), (40, 48.0), (41, 7.0)])
def test_the_domain_figure_is_1_2_inches_a_bar_and_7_for_a_histogram(n: int, width: float, tmp_path: Path,
                                                                       saved: dict[str, Figure]) -> None:
    plots.plot_domains({f"ood_acc/d{i:02d}": 50.0 for i in range(n)}, tmp_path / "domains.png", ACC)
    assert tuple(saved["domains.png"].get_size_inches()) == pytest.approx((width, 3.8))


# plots.py: a run's files ----------------------------------------------------------------------------------------

def _write_run(d: Path, rows: list[dict], results: dict | None = None, config: str | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if results is not None:
        (d / "results.json").write_text(json.dumps(results))
    if config is not None:
        (d / "config.yaml").write_text(config)
    return d


def test_read_metrics_skips_blank_lines_and_names_a_damaged_line_by_its_number(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n\n   \n{"round": 2}\n')
    assert read_metrics(tmp_path) == [{"round": 1}, {"round": 2}]
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n{"rou\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: not JSON"):
        read_metrics(tmp_path)
    assert read_json(tmp_path / "absent.json") is None


def test_run_title_names_a_run_that_holds_no_domain_out_and_its_validation_domains(tmp_path: Path) -> None:
    base = {"method": "FedAvg", "dataset": "pacs", "seed": 3}
    (tmp_path / "results.json").write_text(json.dumps({**base, "target": [], "val_domain": []}))
    assert run_title(tmp_path) == f"FedAvg · pacs · held out {EVERY_DOMAIN_TRAINS} · seed 3"
    (tmp_path / "results.json").write_text(json.dumps({**base, "target": ["sketch"], "val_domain": ["photo", "art"]}))
    assert run_title(tmp_path) == "FedAvg · pacs · held out sketch (val photo, art) · seed 3"


def test_a_hierarchical_run_is_titled_by_its_client_method_and_its_station_merge(tmp_path: Path) -> None:
    """The text demo (FedAvg clients, HFedATM stations) was titled "fedavg", as a flat FedAvg run is."""
    base = {"method": "fedavg", "dataset": "synthetic-sentiment", "seed": 0, "target": ["kitchen"]}
    (tmp_path / "results.json").write_text(json.dumps({**base, "hierarchy": {"client_method": "fedavg",
                                                                              "merge": "hfedatm", "stations": 3}}))
    assert run_title(tmp_path) == "fedavg+hfedatm · synthetic-sentiment · held out kitchen · seed 0"
    assert run_method({"method": "fedrc", "method_label": "fedrc (reconstructed)"}) == "fedrc (reconstructed)"
    assert run_method({"method": "fedrc", "method_label": "fedrc (reconstructed)", "hierarchy": {"merge": "avg"}}
                      ) == "fedrc+avg (reconstructed)"  # the merge beside the method, the label's note after both


def test_a_folder_without_results_is_titled_by_its_name(tmp_path: Path) -> None:
    assert run_title(tmp_path / "runs" / "my-run") == "my-run"


def test_run_task_prefers_the_results_task_block_then_the_config_then_the_results_dataset(tmp_path: Path) -> None:
    block = {"name": "toy", "metric": "err", "label": "error", "unit": "", "bounds": [0, 1],
             "higher_is_better": False, "chance": None}
    d = _write_run(tmp_path / "a", [], {"dataset": "digits-dg", "task": block}, "data: {dataset: pacs}\n")
    assert run_task(d).metric == "err"
    d = _write_run(tmp_path / "b", [], {"dataset": "digits-dg"})  # a run from before the block: no config either
    assert run_task(d) is not None and run_task(d).metric == "acc" and run_task(d).chance == 10.0
    assert run_task(_write_run(tmp_path / "n", [], None, "data: {dataset: [pacs]}\n")) is None  # not a name
    d = _write_run(tmp_path / "c", [], None, "data: [unclosed\n")
    with pytest.raises(ValueError, match=r"config.yaml: not YAML"):
        run_task(d)


def test_a_run_plots_its_final_figures_else_its_last_evaluated_round_with_the_results_counts(
        tmp_path: Path, saved: dict[str, Figure]) -> None:
    """No results.json final: the domains figure is the last metrics row with an ood figure (round 3, not 2),
    its keys of the task's metric only, with results.json's counts."""
    rows = [{"round": 1, "train_loss": 1.0}, {"round": 2, "train_loss": 1.0, "ood_acc": 1.0, "ood_acc/b": 1.0},
            {"round": 3, "train_loss": 1.0, "ood_acc": 30.0, "ood_acc/b": 30.0, "id_acc/a": 70.0, "lr": 0.1},
            {"round": 4, "train_loss": 1.0}]
    d = _write_run(tmp_path / "run", rows, {"method": "M", "dataset": "x", "seed": 0, "target": ["b"],
                                            "counts": {"ood_acc/b": 12, "id_acc/a": 34}})
    assert [p.name for p in plot_run(d, ACC)] == ["curves.png", "domains.png"]
    (ax,) = saved["domains.png"].axes
    heights = [c.patches[0].get_height() for c in ax.containers if hasattr(c, "patches")]
    assert heights == [30.0, 70.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["b\nn=12", "a\nn=34"]
    with_final = _write_run(tmp_path / "done", rows, {"method": "M", "dataset": "x", "seed": 0, "target": ["b"],
                                                      "final": {"ood_acc/b": 55.0, "ood_acc": 55.0}})
    plot_run(with_final, ACC)  # a finished run: results.json's final figures, not a metrics row's
    heights = [c.patches[0].get_height() for c in saved["domains.png"].axes[0].containers if hasattr(c, "patches")]
    assert heights == [55.0]
    with pytest.raises(ValueError, match="has no rounds yet"):
        plot_run(_write_run(tmp_path / "empty", []), ACC)


# overlays.py -----------------------------------------------------------------------------------------------------

def _overlay(truth: np.ndarray, pred: np.ndarray, **kw: object) -> Figure:
    n = len(truth)
    args = {"dice": [10.0 * (k + 1) for k in range(n)], "names": [f"slice {k}" for k in range(n)],
            "num_classes": 3, **kw}
    return overlay_figure("site", np.full(truth.shape, 0.25), truth, pred, **args)  # type: ignore[arg-type]


def test_each_overlay_row_has_its_own_name_and_dice_and_the_grey_image_on_0_to_1() -> None:
    masks = np.zeros((2, 4, 4), dtype=np.int64)
    fig = _overlay(masks, masks, unit="")
    assert [ax.get_title() for ax in fig.axes] == ["slice 0", "ground truth", "prediction · Dice 10.0",
                                                   "slice 1", "ground truth", "prediction · Dice 20.0"]
    assert all(ax.images[0].get_clim() == (0.0, 1.0) for ax in fig.axes)  # a dim slice stays dim
    plt.close(fig)


def test_the_overlay_figure_is_titled_by_its_site_and_grows_with_its_rows() -> None:
    masks = np.zeros((3, 4, 4), dtype=np.int64)
    fig = _overlay(masks, masks)
    assert fig.get_suptitle().startswith("site: image, ground truth (green), prediction (red")
    assert tuple(fig.get_size_inches()) == pytest.approx((7.2, 2.5 * 3 + 0.4))
    plt.close(fig)


def test_the_fills_are_translucent_and_the_outline_is_lime() -> None:
    truth = np.zeros((1, 6, 6), dtype=np.int64)
    truth[0, 1:3, 1:3] = 1
    fig = _overlay(truth, truth)
    _, ax_true, ax_pred = fig.axes
    assert all(0.0 < ax.images[1].get_alpha() < 1.0 for ax in (ax_true, ax_pred))  # the slice shows through
    assert all(to_rgba(ax.collections[0].get_edgecolor()[0]) == to_rgba(OUTLINE) for ax in (ax_true, ax_pred))
    assert to_rgba(OUTLINE) == to_rgba("lime")
    plt.close(fig)


def test_a_class_2_truth_is_outlined_halfway_between_its_pixels_and_the_background() -> None:
    """The outline is of the foreground (mask > 0): a 2×2 square of class 2 at (1-2, 1-2) has its edge at 0.5 and
    2.5, not where a contour of the raw labels at 0.5 would run (a quarter of the way to the 2s)."""
    truth = np.zeros((1, 6, 6), dtype=np.int64)
    truth[0, 1:3, 1:3] = 2
    fig = _overlay(truth, np.zeros_like(truth))
    xy = np.concatenate([p.vertices for p in fig.axes[1].collections[0].get_paths()])
    assert xy.min(0) == pytest.approx([0.5, 0.5]) and xy.max(0) == pytest.approx([2.5, 2.5])
    plt.close(fig)


def test_an_all_foreground_or_empty_truth_has_no_outline() -> None:
    truth = np.stack([np.ones((4, 4), dtype=np.int64), np.zeros((4, 4), dtype=np.int64)])
    fig = _overlay(truth, truth)
    assert [len(ax.collections) for ax in fig.axes] == [0] * 6
    plt.close(fig)


def test_an_example_path_replaces_each_run_of_unsafe_characters_by_one_underscore_and_strips_dots(
        tmp_path: Path) -> None:
    assert example_path(tmp_path, "Site A/  B") == tmp_path / "examples" / "Site_A_B.png"
    assert example_path(tmp_path, ".hidden.") == tmp_path / "examples" / "hidden.png"


# style_grid.py ---------------------------------------------------------------------------------------------------

def test_a_domain_every_client_holds_takes_any_client_cyclically() -> None:
    """_foreign_client: no client lacks domain 0, so its samples cycle over all clients 0, 1, 2."""
    fed = SimpleNamespace(clients=[SimpleNamespace(domains=[0]), SimpleNamespace(domains=[0, 1]),
                                   SimpleNamespace(domains=[0])])
    assert [sg._foreign_client(fed, 0, j) for j in range(4)] == [0, 1, 2, 0]  # type: ignore[arg-type]
    assert [sg._foreign_client(fed, 1, j) for j in range(3)] == [0, 2, 0]  # type: ignore[arg-type]


@pytest.fixture
def grid(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, drawn: list[Figure]) -> Callable[..., np.ndarray]:
    """Draws styles.png of a toy run with the given overrides; returns its mosaic (closed figures kept)."""
    monkeypatch.setattr(sg, "build_federation", toy_federation_of)  # the toy data in place of the config's dataset

    def draw(*overrides: str) -> np.ndarray:
        fed = toy_federation("method.params.style_path=pixel", *overrides)
        (tmp_path / "config.yaml").write_text(dump_config(fed.cfg))
        assert sg.style_grid(tmp_path) == tmp_path / sg.GRID
        ax = drawn[-1].axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["original", "PARDON: interpolation style",
                                                                "CCST: style of client"]
        return np.asarray(ax.images[0].get_array())

    return draw


def test_a_ccst_runs_own_alpha_blends_its_row(grid: Callable[..., np.ndarray]) -> None:
    """A CCST run with α = 0: its row keeps every sample (AdaIN blended to nothing), as the original row."""
    mosaic = grid("method.name=ccst", "method.params.alpha=0")
    np.testing.assert_allclose(mosaic[16:22], mosaic[0:6], atol=1e-6)  # rows of 6 px and 2 px gaps


# selection.py ----------------------------------------------------------------------------------------------------

def _sel_run(root: Path, name: str, evals: dict[int, dict[str, float | None]]) -> str:
    d = root / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps({"round": r, **f}) + "\n" for r, f in evals.items()))
    return str(d)


def _sel_row(variant: str, target: str, run_dir: str) -> dict:
    return {"variant": variant, "target": target, "seed": 0, "run_dir": run_dir, "dropped": 0, "id_acc": 0.0, "ood_acc": 0.0}


def test_the_oracle_skips_a_draw_that_never_evaluated_the_unseen_domain(tmp_path: Path) -> None:
    """Draw 0's run has id figures only: no candidate (not an error); draw 1 round 4 is the pick."""
    rows = [_sel_row("X #0", "t", _sel_run(tmp_path, "a", {2: {"id_acc": 90.0}})),
            _sel_row("X #1", "t", _sel_run(tmp_path, "b", {2: {"ood_acc": 70.0}, 4: {"ood_acc": 60.0}}))]
    [chosen] = select(rows, "oracle", ACC)
    assert (chosen["draw"], chosen["round"], chosen["candidates"], chosen["ood_acc"]) == (1, 4, 1, 60.0)


def test_a_round_whose_score_is_null_is_no_candidate(tmp_path: Path) -> None:
    """A JSON null under the rule's key (no figure) is skipped like a missing one."""
    rows = [_sel_row("X", "t", _sel_run(tmp_path, "a", {2: {"id_acc": None, "ood_acc": 1.0},
                                                          4: {"id_acc": 50.0, "ood_acc": 40.0}}))]
    [chosen] = select(rows, "train_domain", ACC)
    assert (chosen["round"], chosen["candidates"], chosen["ood_acc"]) == (4, 1, 40.0)


def test_lodo_counts_each_variants_own_validation_domains(tmp_path: Path) -> None:
    """P pairs a→c and b→c, Q only a→c: Q's one run is complete for Q (not missing P's b)."""
    rows = [_sel_row("P", "a→c", _sel_run(tmp_path, "pa", {2: {"val_acc": 60.0, "ood_acc": 30.0}})),
            _sel_row("P", "b→c", _sel_run(tmp_path, "pb", {2: {"val_acc": 80.0, "ood_acc": 50.0}})),
            _sel_row("Q", "a→c", _sel_run(tmp_path, "qa", {2: {"val_acc": 70.0, "ood_acc": 20.0}}))]
    assert {r["variant"]: (r["score"], r["ood_acc"]) for r in select(rows, "lodo", ACC)} == {
        "P": (70.0, 40.0), "Q": (70.0, 20.0)}


# tables.py -------------------------------------------------------------------------------------------------------

def _rows(cells: dict[tuple[str, str], list[float]], **extra: object) -> list[dict]:
    return [{"variant": v, "target": t, "seed": s, "ood_acc": x, **extra}
            for (v, t), vals in cells.items() for s, x in enumerate(vals)]


def test_table_cells_and_averages_are_means_not_medians() -> None:
    """Seeds 10, 20, 60: mean 30 (median 20), sample std sqrt(700) = 26.5, in the markdown and the CSV."""
    rows = _rows({("A", "x"): [10.0, 20.0, 60.0]})
    assert markdown_table(rows).splitlines()[2].startswith("| A | 30.0 ± 26.5 | 30.0 ± 26.5 |")
    assert csv_table(rows).splitlines()[1].startswith("A,x,30.000,26.458,")


def test_a_table_without_dropped_clients_has_no_footnote() -> None:
    rows = _rows({("A", "x"): [50.0]}, dropped=0)
    assert DEGRADED_NOTE not in markdown_table(rows) and DEGRADED_NOTE in markdown_table(_rows({("A", "x"): [5.0]},
                                                                                              dropped=1))


def test_the_baseline_has_no_paired_line_of_its_own_and_the_average_no_selection() -> None:
    """csv_table: ``avg - base`` only for the other variants; ``selected`` is empty where picks has no cell."""
    rows = _rows({("base", "x"): [1.0, 2.0], ("new", "x"): [3.0, 5.0]})
    lines = csv_table(rows, baseline="base", picks={("new", "x"): "#0 r2 of 2"}).splitlines()
    assert [line.split(",")[:2] + line.split(",")[-1:] for line in lines[1:]] == [
        ["base", "x", ""], ["base", "avg", ""], ["new", "x", "#0 r2 of 2"], ["new", "avg", ""],
        ["new", "avg - base", ""]]
    assert lines[-1].startswith("new,avg - base,2.500,0.707,")  # per seed 3 - 1, 5 - 2


def test_a_paired_difference_needs_both_rows_complete_on_every_target_of_the_table() -> None:
    """new has targets x, y and base x, z: neither is complete on x, y, z, so there is no pair (not an average of
    new over x, y against base over x, z)."""
    rows = _rows({("base", "x"): [10.0], ("base", "z"): [30.0], ("new", "x"): [50.0], ("new", "y"): [70.0]})
    assert paired_deltas(rows, "new", "base") == []
    assert markdown_table(rows, baseline="base").splitlines()[3].endswith("| – | – |")


def test_a_variant_missing_a_target_has_no_csv_line_for_it() -> None:
    """B ran x only: its lines are x and avg (n=1), none for y (not a line of nan); one seed's delta has no CI."""
    rows = _rows({("A", "x"): [40.0], ("A", "y"): [60.0], ("B", "x"): [42.0]})
    lines = csv_table(rows, baseline="A").splitlines()
    assert [line.split(",")[:2] for line in lines[1:]] == [["A", "x"], ["A", "y"], ["A", "avg"], ["B", "x"]]
    full = rows + _rows({("B", "y"): [64.0]})
    assert markdown_table(full, baseline="A").splitlines()[3].endswith("| – | +3.0 |")  # (42 + 64 - 40 - 60) / 2


def test_paired_deltas_come_in_seed_order() -> None:
    """Seeds 8 and 1 (a set iterates them 8, 1): the deltas are seed 1's, then seed 8's."""
    rows = [{"variant": v, "target": "x", "seed": s, "ood_acc": x} for v, s, x in
            (("base", 8, 10.0), ("base", 1, 10.0), ("new", 8, 18.0), ("new", 1, 11.0))]
    assert paired_deltas(rows, "new", "base") == [1.0, 8.0]
