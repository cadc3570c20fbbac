"""`feddg report`: the figures' content, report.html of a run and of a sweep, and both pages in a real browser."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from feddg.cli import app
from feddg.config import build_config
from feddg.evaluation.plots import chance_line, draw_domains, draw_metric
from feddg.experiment import run_experiment
from feddg.reports import figures
from feddg.reports.run import failure_notes, report
from feddg.sweep import run_sweep
from feddg.tasks import TaskInfo
from feddg.tasks.classification import Classification

ACC = TaskInfo.of(Classification(10).info())

TINY = {"data": {"dataset": "digits-dg", "max_per_domain": 40}, "partition": {"kind": "by_domain", "num_clients": 3},
        "model": {"name": "lenet"}, "federation": {"rounds": 3, "batch_size": 32}, "split": {"target": "uci"},
        "device": "cpu"}
IMG = re.compile(r'<img src="data:image/png;base64,([^"]+)"')


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, cache_dir) -> Path:
    out = tmp_path_factory.mktemp("run") / "r"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDDG_CACHE", str(cache_dir))
        run_experiment(build_config(TINY), out, progress=False)
    return out


@pytest.fixture(scope="module")
def run_pages(run_dir) -> list[Path]:
    return report(run_dir)


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory, cache_dir) -> Path:
    base = tmp_path_factory.mktemp("sweep")
    spec = {**TINY, "name": "tiny", "federation": {"rounds": 2, "batch_size": 32},
            "sweep": {"targets": ["uci", "mnist"], "seeds": [0, 1],
                      "variants": {"FedProx": {"method.name": "fedprox", "method.params.mu": 0.1}}}}
    (base / "sweep.yaml").write_text(yaml.safe_dump(spec))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDDG_CACHE", str(cache_dir))
        run_sweep(base / "sweep.yaml", out_dir=base / "out", progress=False)
    return base / "out"


@pytest.fixture(scope="module")
def sweep_page(sweep_dir) -> Path:
    return report(sweep_dir)[0]


def _images(html: str) -> list[Image.Image]:
    imgs = [Image.open(io.BytesIO(base64.b64decode(b))) for b in IMG.findall(html)]
    for img in imgs:
        img.load()  # decodes the whole PNG: a truncated or corrupt one raises
    return imgs


@pytest.mark.parametrize("rounds", [(1, 2, 3, 4), (2,), (4, 5)])  # one evaluation (2,): its axis is 1.5-2.5
def test_accuracy_axes_have_integer_rounds_and_the_chance_line(rounds):
    fig, ax = plt.subplots()
    draw_metric(ax, [{"round": r, "ood_acc": 10.0 * r} for r in rounds], ACC)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert set(rounds) <= set(ticks)  # every evaluated round is ticked
    chance = [ln for ln in ax.get_lines() if ln.get_label().startswith("chance")]
    assert len(chance) == 1 and chance[0].get_ydata()[0] == pytest.approx(10.0)
    plt.close(fig)


@pytest.mark.parametrize(("metric", "drawn"), [("ood_acc", True), ("ood_acc/mnist", True), ("acc", True),
                                              ("ood_macro_f1", False), ("id_loss", False)])
def test_the_chance_line_is_the_task_metrics_only(metric, drawn):
    """Chance is accuracy's 100/C; a sweep's macro-F1 plot drew it too (a random predictor's F1 lies below it)."""
    fig, ax = plt.subplots()
    chance_line(ax, ACC, metric)
    assert any(ln.get_label().startswith("chance") for ln in ax.get_lines()) == drawn
    plt.close(fig)


def test_domain_bars_show_seed_spread_and_sample_counts():
    fig, ax = plt.subplots()
    draw_domains(ax, {"id_acc/a": [50.0, 60.0, 70.0], "ood_acc/b": [30.0]}, ACC, {"id_acc/a": 120, "ood_acc/b": 400})
    bars = [c for c in ax.containers if hasattr(c, "patches")]
    assert [round(b.patches[0].get_height(), 6) for b in bars] == [60.0, 30.0]
    assert bars[0].errorbar is not None and bars[1].errorbar is None  # several seeds -> sample std, one -> none
    err_segment = bars[0].errorbar.lines[2][0].get_segments()[0]
    assert err_segment[1][1] - err_segment[0][1] == pytest.approx(2 * np.std([50, 60, 70], ddof=1))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a\nn=120", "b\nn=400"]
    plt.close(fig)


def test_a_runs_title_over_few_domains_stays_inside_its_figure():
    """domains.png is 1.2 in a bar wide (4.8 in for four); the text demo's title was cut at "... kitchen · seec"."""
    title = "fedavg · synthetic-sentiment · held out kitchen · seed 0"
    final = {"id_acc/books": 48.0, "id_acc/dvd": 50.5, "id_acc/electronics": 53.5, "ood_acc/kitchen": 49.8}
    fig, ax = plt.subplots(figsize=(4.8, 3.8))
    draw_domains(ax, final, ACC, title=title)
    fig.tight_layout()
    fig.canvas.draw()
    box, frame = ax.title.get_window_extent(), fig.bbox
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and box.y1 <= frame.y1, (box, frame)
    assert ax.title.get_text() == title  # all of it, wrapped at a space
    plt.close(fig)


def test_the_domain_legend_sits_above_bars_at_the_top_of_the_scale_and_ticks_stay_within_it():
    """Bars at 98-100 %: the legend's default place (upper right, inside 0-108) lay over the last bars' values."""
    fig, ax = plt.subplots(figsize=(4.8, 3.8))
    draw_domains(ax, {"id_acc/a": 100.0, "id_acc/b": 99.0, "val_acc/c": 98.0, "ood_acc/d": 100.0}, ACC)
    fig.tight_layout()
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    drawn = [p.get_window_extent() for c in ax.containers for p in c.patches] + [t.get_window_extent() for t in ax.texts]
    assert len(drawn) == 8 and not any(legend.overlaps(b) for b in drawn)
    assert max(ax.get_yticks()) == 100.0 and ax.get_ylim()[1] > 100.0  # a band above 100 %, not ticked
    plt.close(fig)


def test_the_sweep_bars_legend_sits_above_bars_near_the_top_of_the_scale():
    """Five variants at 95-99 % on two targets: the legend (five variants and chance, two rows) clears every bar."""
    from feddg.reports.sweep import bars

    rows = [{"variant": f"V{v}", "target": t, "seed": s, "ood_acc": 95.0 + v - 0.5 * s}
            for v in range(5) for t in ("a", "b") for s in (0, 1)]
    fig = bars(rows, "ood_acc", ACC)
    (ax,) = fig.axes
    fig.tight_layout()
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    drawn = [p.get_window_extent() for c in ax.containers if hasattr(c, "patches") for p in c.patches]
    assert len(drawn) == 15 and not any(legend.overlaps(b) for b in drawn)  # 5 variants × (a, b, avg)
    assert len(ax.get_legend().get_texts()) == 6 and max(ax.get_yticks()) == 100.0
    plt.close(fig)


def test_the_sweep_bars_error_bars_stop_at_the_metrics_bounds():
    """Seeds at 90 and 100 %: mean 95 ± 7.1; the error bar ends at 100, not 102.1 (into the legend's band)."""
    from feddg.reports.sweep import bars

    rows = [{"variant": "V", "target": "a", "seed": s, "ood_acc": v} for s, v in ((0, 90.0), (1, 100.0))]
    fig = bars(rows, "ood_acc", ACC)
    (ax,) = fig.axes
    [span] = [c.errorbar.lines[2][0].get_segments()[0][:, 1] for c in ax.containers if hasattr(c, "errorbar")]
    assert list(span) == pytest.approx([95.0 - np.sqrt(50.0), 100.0])
    plt.close(fig)


def test_thousands_of_domains_are_drawn_as_a_histogram_of_their_figures():
    """Natural clients (writers) have thousands of domains: one bar and tick label each took a minute to draw;
    past MAX_DOMAIN_BARS the figure is a histogram per role whose bars count the domains."""
    from feddg.evaluation.plots import MAX_DOMAIN_BARS

    ood = {f"ood_acc/w{i:04d}": [float(i % 10) * 10.0] for i in range(300)}  # 30 domains at each of 0, 10, ..., 90
    ids = {f"id_acc/v{i:04d}": [95.0] for i in range(MAX_DOMAIN_BARS + 1)}
    fig, ax = plt.subplots()
    draw_domains(ax, {**ood, **ids}, ACC)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    counts = dict(zip(labels, (sum(p.get_height() for p in c.patches) for c in ax.containers), strict=True))
    assert counts == {"ood: 300 domains": 300, f"id: {MAX_DOMAIN_BARS + 1} domains": MAX_DOMAIN_BARS + 1}
    means = sorted(round(float(line.get_xdata()[0]), 6) for line in ax.get_lines())
    assert means == [45.0, 95.0]
    plt.close(fig)


def test_method_diagnostics_are_grouped_by_key_prefix_layer_and_client():
    rows = [{"round": r, "lr": 0.1, "train_loss": 1.0, "ood_acc": 50.0, "ood_acc/b": 50.0, "fot/passes": 2,
             "fot/conv1/moved": 0.1 * r, "fot/fc/moved": 0.2 * r, "gradalign_theta/0": 0.4, "gradalign_theta/1": 0.6,
             "hn_grad_norm": 1.5} for r in (1, 2)]
    panels = figures.diagnostic_panels(rows, ACC)
    assert panels == {
        "fot": {"fot/passes": {"fot/passes": [(1, 2.0), (2, 2.0)]},
                "fot/…/moved": {"conv1": [(1, 0.1), (2, 0.2)], "fc": [(1, 0.2), (2, 0.4)]}},
        "per client": {"gradalign_theta": {"client 0": [(1, 0.4), (2, 0.4)], "client 1": [(1, 0.6), (2, 0.6)]}},
        "other": {"hn_grad_norm": {"hn_grad_norm": [(1, 1.5), (2, 1.5)]}},
    }  # accuracies, lr, loss, bytes and times are drawn elsewhere
    fig = figures.diagnostics(panels["fot"])
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["fot/passes", "fot/…/moved"]
    plt.close(fig)


def test_run_report_has_per_domain_counts_bytes_time_and_config(run_dir, run_pages):
    paths = run_pages
    assert paths[0] == run_dir / "report.html" and {p.name for p in paths[1:]} == {"curves.png", "domains.png"}
    html = paths[0].read_text()
    results = json.loads((run_dir / "results.json").read_text())
    counts = results["counts"]
    assert results["task"]["name"] == "classification" and results["task"]["chance"] == 10.0
    assert counts["ood_acc/uci"] == 40 and counts["ood_acc"] == 40
    for key, acc in results["final"].items():
        if "/" in key:
            role, dom = key.split("/")
            row = f"<tr><td>{dom}</td><td class=\"text\">{role.removesuffix('_acc')}</td><td>{acc:.2f}</td>"
            assert row in html and f"<td>{counts[key]}</td>" in html[html.index(row):html.index(row) + 200], key
    for text in ("bytes per round", "time per round", "chance (%)", "config.yaml", "name: fedavg", "bytes_down"):
        assert text in html, text
    imgs = _images(html)
    assert len(imgs) == len(re.findall(r"<img ", html)) >= 5  # curves, domains, bytes, time, schedule
    assert all(img.width > 300 and img.height > 200 for img in imgs)
    assert "http://" not in html and "https://" not in html  # nothing to fetch


def test_a_run_in_progress_reports_its_last_evaluation_its_summed_time_and_bytes_in_kib(run_dir, tmp_path):
    # no results.json "final" yet: the per-domain table is the last evaluated round's; hand-set time and bytes
    out = shutil.copytree(run_dir, tmp_path / "r", ignore=shutil.ignore_patterns("report.html"))
    results = json.loads((out / "results.json").read_text())
    (out / "results.json").write_text(json.dumps({k: v for k, v in results.items() if k != "final"}))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3] and all("ood_acc/uci" in r for r in rows)
    rows = [{**{k: 0 for k in r if "bytes" in k}, **r, "ood_acc/uci": 10.0 * r["round"] + 0.25,
             "time_round_s": t, "bytes_down": 1536, "bytes_up": 512} for r, t in zip(rows, (1.2, 2.5, 4.1))]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report(out)
    html = " ".join(report(out)[0].read_text().split())  # the second report finds the first's report.html
    assert "per domain (last evaluation, round 3)" in html
    assert '<tr><td>uci</td><td class="text">ood</td><td>30.25</td> <td>40</td></tr>' in html
    assert "<b>7.8</b><span>time (s)</span>" in html  # 1.2 + 2.5 + 4.1
    assert "<b>4.5 KiB / 1.5 KiB</b><span>sent down / up</span>" in html  # 3 × 1536 B, 3 × 512 B
    assert "<tr><td>bytes_down</td><td>1.50</td></tr>" in html and "<tr><td>bytes_up</td><td>0.50</td></tr>" in html
    assert 'href="metrics.jsonl"' in html and 'href="report.html"' not in html  # the page does not list itself


def test_an_unfinished_run_says_how_many_of_its_rounds_are_in_and_how_it_continues(run_dir, tmp_path):
    """A run stopped after round 1 of 3 (no results.json "final"): its page read like a finished 1-round run."""
    from feddg.reports.run import _planned_rounds

    out = shutil.copytree(run_dir, tmp_path / "r", ignore=shutil.ignore_patterns("report.html"))
    results = json.loads((out / "results.json").read_text())
    (out / "results.json").write_text(json.dumps({k: v for k, v in results.items() if k != "final"}))
    first = (out / "metrics.jsonl").read_text().splitlines()[0]
    (out / "metrics.jsonl").write_text(first + "\n")
    html = " ".join(report(out)[0].read_text().split())
    assert (f"unfinished: round 1 of 3 is the last in metrics.jsonl (the run is still going, or it stopped: feddg run "
            f"--resume {out} continues it); the figures are those of round 1") in html
    assert "<b>1 of 3</b><span>rounds</span>" in html
    # a Flower deployment's run directory has the ServerApp's mark: its state, and the deployment's way to resume
    (out / "status.json").write_text(json.dumps({"status": "stopped", "error": "stopped from outside"}))
    html = " ".join(report(out)[0].read_text().split())
    assert ("unfinished: round 1 of 3 is the last in metrics.jsonl (status.json: stopped: stopped from outside; "
            f"feddg flower run --resume {out} --connection NAME continues it)") in html
    whole = shutil.copytree(run_dir, tmp_path / "whole", ignore=shutil.ignore_patterns("report.html"))
    assert "unfinished: round" not in report(whole)[0].read_text()  # the whole run: no note
    # engine rounds: federation.rounds × a hierarchy's station rounds
    assert _planned_rounds({"federation": {"rounds": 3}, "hierarchy": {"station_rounds": 2}}) == 6
    assert _planned_rounds({"federation": {"rounds": 3}, "hierarchy": None}) == 3
    assert _planned_rounds({"federation": {}}) is None


def test_the_failure_note_names_the_rounds_the_client_rounds_lost_and_the_first_reason():
    failures = {"client_rounds_lost": 3, "rounds": [2, 5],
                "clients": {"4": [{"round": 2, "reason": "NaN in w"}, {"round": 5, "reason": "no reply"}],
                            "1": [{"round": 5, "reason": "RuntimeError"}]}}
    assert failure_notes(failures) == ["clients were dropped in rounds 2, 5: 3 client-round(s) lost (e.g. client 4 in "
                                       "round 2: NaN in w); the figures are those of the degraded run"]


def test_sweep_report_has_both_tables_its_figures_and_every_run(sweep_dir, sweep_page):
    html = sweep_page.read_text()
    rows = [json.loads(line) for line in (sweep_dir / "runs.jsonl").read_text().splitlines()]
    main, rest = html.split('<section id="selection">')
    selection = rest.split("</section>")[0]
    assert main.count("<th>avg</th>") == 2  # ood_acc and id_acc tables, with the mean over targets
    # each model-selection rule's Markdown table as an HTML table (it was the Markdown text in a <pre>), no <pre> left
    rules = sorted(p.stem for p in sweep_dir.glob("table_*_*.md"))
    assert rules and selection.count("<table>") == sum("|---" in (sweep_dir / f"{r}.md").read_text() for r in rules)
    assert "<pre>" not in selection and "|---" not in selection
    # per metric: bars + curves; per variant: per-domain bars
    assert len(_images(html)) == 2 * 2 + 1
    for r in rows:
        assert Path(r["run_dir"]).relative_to(sweep_dir).as_posix() in html


def test_markdown_tables_become_html_under_the_pages_headings_and_raw_html_is_escaped():
    from feddg.reports.page import markdown_html

    html = str(markdown_html("# sweep: privacy audit\n\n### rows\n\n| variant | z |\n|---|---:|\n| <b>A</b> | 1 |\n"))
    assert html.startswith("<h4>sweep: privacy audit</h4>\n<h6>rows</h6>")  # h1 -> h4, h3 -> h6 (4 + 3 - 1)
    assert "<td>&lt;b&gt;A&lt;/b&gt;</td>" in html  # a variant named in HTML is shown, not run
    assert '<th style="text-align:right">z</th>' in html and "<table>" in html
    assert str(markdown_html("no heading")) == "<p>no heading</p>\n"


def test_sweep_report_cells_are_the_mean_the_sample_std_and_a_student_t_ci(sweep_dir, tmp_path):
    # the runs' own ood_acc is chance for every seed (std 0): hand-set figures over three seeds instead, seed 2 a copy
    # of seed 1's folder; per seed (uci, mnist) and their average over targets
    out = shutil.copytree(sweep_dir, tmp_path / "out")
    for target in ("uci", "mnist"):
        shutil.copytree(out / "FedProx" / target / "seed1", out / "FedProx" / target / "seed2")
    acc = {0: (20.0, 44.0), 1: (30.0, 50.0), 2: (40.0, 56.0)}  # avg over targets 32, 40, 48
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    rows += [{**r, "seed": 2, "run_dir": str(Path(r["run_dir"]).with_name("seed2"))} for r in rows if r["seed"] == 1]
    rows = [{**r, "ood_acc": acc[r["seed"]][r["target"] == "mnist"]} for r in rows]
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = " ".join(report(out)[0].read_text().split())
    start = html.index('<section id="ood_acc">')
    ood = html[start:html.index("</table>", start)]
    # mean ± std (ddof 1) with half-width t(0.975, 2) · std / √3 = 4.303 · std / 1.732 = 2.484 · std:
    # uci 30 ± 10, half 24.84; mnist 50 ± 6, half 14.91; avg 40 ± 8, half 19.87
    assert ('<td class="best">30.0 ± 10.0 <span class="ci">[5.2, 54.8] n=3</span></td> '
            '<td class="best">50.0 ± 6.0 <span class="ci">[35.1, 64.9] n=3</span></td> '
            '<td class="best">40.0 ± 8.0 <span class="ci">[20.1, 59.9] n=3</span></td>') in ood


def test_paired_figure_plots_each_variants_mean_difference_its_ci_and_its_seeds():
    from feddg.reports.sweep import paired

    # per-seed averages over targets x, y: base 10, 30; "up" = base + 1, + 3; "solo" shares no seed with base
    rows = [{"variant": "base", "target": t, "seed": s, "ood_acc": v + (t == "y")}
            for s, v in ((0, 9.5), (1, 29.5)) for t in "xy"]
    rows += [{**r, "variant": "up", "ood_acc": r["ood_acc"] + 1 + 2 * r["seed"]} for r in rows]
    rows += [{"variant": "solo", "target": t, "seed": 7, "ood_acc": 50.0} for t in "xy"]
    fig = paired(rows, "ood_acc", "base")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["up"]  # neither the baseline nor a row without pairs
    square = next(line for line in ax.lines if line.get_marker() == "s")
    assert square.get_xdata()[0] == pytest.approx(2.0)
    seeds = next(line for line in ax.lines if line.get_marker() == "o")
    assert sorted(seeds.get_xdata()) == pytest.approx([1.0, 3.0])
    bar = ax.collections[0].get_segments()[0]  # the CI: 2 ± t(0.975, 1) · √2 / √2 = 2 ± 12.706
    assert [p[0] for p in bar] == pytest.approx([2 - 12.706, 2 + 12.706], abs=1e-3)
    plt.close(fig)
    assert paired(rows, "ood_acc", "solo") is None


def test_a_sweep_with_a_baseline_reports_the_paired_differences(sweep_dir, tmp_path):
    out = shutil.copytree(sweep_dir, tmp_path / "out")
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    more = [{**r, "variant": "Shifted", "ood_acc": r["ood_acc"] + 1} for r in rows]
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + more))
    spec = json.loads((out / "sweep.json").read_text())
    assert spec["baseline"] is None and spec["seeds"] == [0, 1]  # written by the sweep
    (out / "sweep.json").write_text(json.dumps({**spec, "baseline": "FedProx"}))
    html = report(out)[0].read_text()
    assert 'alt="ood_acc: paired difference from FedProx"' in html
    assert "paired difference from" not in report(sweep_dir)[0].read_text()


def test_the_sweep_page_sums_the_runs_time_and_counts_every_target(sweep_dir, tmp_path):
    out = shutil.copytree(sweep_dir, tmp_path / "out")
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    rows = [{**r, "time_total_s": t} for r, t in zip(rows, (20.1, 30.2, 10.1, 40.0), strict=True)]
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = " ".join(report(out)[0].read_text().split())
    assert "<b>100</b><span>time (s)</span>" in html  # 20.1 + 30.2 + 10.1 + 40.0
    assert "1 variant × 2 targets × 2 seeds" in html  # each target's sample counts read


def test_a_sweep_still_running_reads_each_runs_dropped_clients_from_its_results(sweep_dir, tmp_path):
    from feddg.reports.sweep import sweep_rows

    out = shutil.copytree(sweep_dir, tmp_path / "out")
    (out / "runs.jsonl").unlink()  # rows from the runs' own results.json
    path = out / "FedProx" / "mnist" / "seed1" / "results.json"
    results = json.loads(path.read_text())
    path.write_text(json.dumps({**results, "failures": {**results["failures"], "client_rounds_lost": 2}}))
    assert {(r["target"], r["seed"]): r["dropped"] for r in sweep_rows(out)} == {
        ("mnist", 0): 0, ("mnist", 1): 2, ("uci", 0): 0, ("uci", 1): 0}


def test_the_best_cell_follows_the_tasks_direction():
    from feddg.reports.sweep import table

    rows = [{"variant": v, "target": "x", "seed": s, "ood_err": e}
            for v, s, e in (("a", 0, 5.0), ("a", 1, 7.0), ("b", 0, 9.0), ("b", 1, 11.0))]
    error = TaskInfo("toy", "err", "error", "%", (0.0, 100.0), False, None)
    for task, best in ((error, "a"), (dataclasses.replace(error, higher_is_better=True), "b")):
        assert {v: cells[0][1] for v, cells in table(rows, "ood_err", task)["rows"]} == {"a": best == "a",
                                                                                          "b": best == "b"}


def test_the_curves_band_is_the_sample_std_over_seeds(tmp_path):
    from feddg.reports.sweep import curves

    rows = []
    for seed, accs in enumerate(((10.0, 20.0), (14.0, 26.0))):  # per round: mean 12, 23; sample std 2√2, 3√2
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"round": r, "ood_acc": a}) + "\n"
                                                   for r, a in enumerate(accs, 1)))
        rows.append({"variant": "v", "target": "t", "seed": seed, "run_dir": str(run), "ood_acc": accs[-1]})
    fig = curves(rows, "ood_acc", ACC)
    band = fig.axes[0].collections[0].get_paths()[0].vertices
    ys = {round(float(y), 6) for y in band[:, 1]}
    assert {round(12 - 2 * 2**0.5, 6), round(12 + 2 * 2**0.5, 6), round(23 - 3 * 2**0.5, 6),
            round(23 + 3 * 2**0.5, 6)} <= ys
    plt.close(fig)


def test_report_of_a_folder_that_is_neither_run_nor_sweep_is_one_line(tmp_path):
    res = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2 and "neither a run directory" in res.output and "Traceback" not in res.output


@pytest.mark.slow
def test_report_of_a_flower_simulation_run(tmp_path, cache_dir, monkeypatch):
    pytest.importorskip("flwr")
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    cfg = build_config({**TINY, "federation": {"rounds": 2, "batch_size": 32, "engine": "flower"},
                        "flower": {"ray_num_cpus": 1}})
    run_experiment(cfg, tmp_path / "flower", progress=False)
    html = report(tmp_path / "flower")[0].read_text()
    assert "<b>flower</b><span>engine</span>" in html and "<td>uci</td>" in html
    assert len(_images(html)) >= 5


def _chromium() -> str | None:
    return next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.parametrize("which", ["run", "sweep"])
def test_report_renders_in_headless_chromium(which, request, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium binary on PATH (`make setup` installs Debian's chromium where apt exists)")
    page = request.getfixturevalue("run_pages")[0] if which == "run" else request.getfixturevalue("sweep_page")
    shot = tmp_path / "shot.png"
    res = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000",
         "--window-size=1280,2000", f"--screenshot={shot}", "--dump-dom", page.as_uri()],
        check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    console = [line for line in res.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console  # no JavaScript error (or any console message)
    body = re.search(r"<body([^>]*)>", res.stdout).group(1)  # set by the page's own image check on load
    n_img = len(re.findall(r"<img ", page.read_text()))
    assert f'data-images="{n_img}"' in body and 'data-broken-images="0"' in body, body
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.std() > 20 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 100  # a page, not a blank


def test_a_flower_runs_page_tables_who_took_part_in_each_session(run_dir, tmp_path):
    out = shutil.copytree(run_dir, tmp_path / "r", ignore=shutil.ignore_patterns("report.html"))
    assert "who took part" not in " ".join(report(out)[0].read_text().split())  # an in-process run: no table
    record = json.loads((out / "provenance.json").read_text())
    node = {"by": "roster key", "name": "St Mary's", "key": "SHA256:abc", "state_dir": True}
    record["flower_nodes"] = [
        {"at": "t0", "after_round": 0, "clients": {"0": {"node": 12, **node}}, "refused": ["node 10: key SHA256:x is "
                                                                                             "not in the roster"]},
        {"at": "t1", "after_round": 2, "clients": {"0": {"node": 31, "by": "declared partition", "state_dir": False}},
         "refused": []}]
    (out / "provenance.json").write_text(json.dumps(record))
    (out / "status.json").write_text(json.dumps({"status": "completed"}))  # the deployed ServerApp's mark
    html = " ".join(report(out)[0].read_text().split())
    assert "<b>flower deployment</b><span>engine</span>" in html  # its config.yaml says engine: inprocess
    cells = lambda *v: "<tr>" + "".join(f'<td class="text">{x}</td>' for x in v) + "</tr>"  # noqa: E731
    assert "who took part (Flower nodes, session 1)</h3>" in html and "who took part (Flower nodes, session 2)" in html
    assert cells(1, 0, "St Mary&#39;s", "roster key", "SHA256:abc", 12, "yes") in html  # Jinja escapes the quote
    assert cells(3, 0, "–", "declared partition", "–", 31, "no") in html  # resumed after round 2: from round 3
    assert "<p>refused: node 10: key SHA256:x is not in the roster</p>" in html
    record["flower_nodes"] = [{"after_round": "x", "clients": {"0": {"node": 5}, "1": "junk"}}, "junk"]  # hand-edited
    (out / "provenance.json").write_text(json.dumps(record))
    html = " ".join(report(out)[0].read_text().split())
    assert cells("?", 0, "–", "?", "–", 5, "?") in html and html.count("who took part") == 1
    crowd = {str(c): {"node": 1000 + c, "by": "declared partition", "state_dir": True} for c in range(3060)}
    record["flower_nodes"] = [{"at": "t", "after_round": 0, "clients": crowd, "refused": []}]  # writers, simulated
    (out / "provenance.json").write_text(json.dumps(record))
    html = " ".join(report(out)[0].read_text().split())
    assert html.count("declared partition") == 100 and "<p>and 2960 more clients (provenance.json, flower_nodes)</p>" in html
