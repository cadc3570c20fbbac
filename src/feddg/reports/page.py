"""Render a self-contained HTML page (Jinja2; images embedded as data URIs, no network needed)."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import jinja2
from markdown_it import MarkdownIt
from markupsafe import Markup

REPORT = "report.html"
#: the sweep's Markdown tables (model selection, privacy audit) as HTML: raw HTML in them is escaped, not passed on
_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table")


def file_uri(path: Path) -> str:
    """A PNG file as a ``data:image/png;base64,...`` URI."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def markdown_html(text: str, top: int = 4) -> Markup:
    """Markdown ``text`` as HTML (tables included), its largest heading at ``<h{top}>`` and the others below it, so
    a file's ``# title`` sits under the page's own section headings."""
    tokens = _MARKDOWN.parse(text)
    levels = [int(t.tag[1]) for t in tokens if t.type == "heading_open"]
    shift = top - min(levels) if levels else 0
    for t in tokens:
        if t.type in ("heading_open", "heading_close"):
            t.tag = f"h{min(6, int(t.tag[1]) + shift)}"
    return Markup(_MARKDOWN.renderer.render(tokens, _MARKDOWN.options, {}))


def render(template: str, out: Path, **context: Any) -> Path:
    """Render ``templates/<template>`` with ``context`` into ``out`` (filter ``markdown``: :func:`markdown_html`)."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("feddg.reports", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["markdown"] = markdown_html
    out.write_text(env.get_template(template).render(**context))
    return out


def page_context(title: str, source: str, notes: list[str]) -> dict[str, Any]:
    """What every page shows: title, notes, and a footer naming the feddg version, time and source."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("feddg")
    except PackageNotFoundError:
        ver = "(not installed)"
    return {"title": title, "notes": notes, "version": ver, "source": source,
            "generated": time.strftime("%Y-%m-%d %H:%M")}
