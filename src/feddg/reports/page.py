"""Render a self-contained HTML page (Jinja2; images embedded as data URIs, no network needed)."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import jinja2

REPORT = "report.html"


def file_uri(path: Path) -> str:
    """A PNG file as a ``data:image/png;base64,...`` URI."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def render(template: str, out: Path, **context: Any) -> Path:
    """Render ``templates/<template>`` with ``context`` into ``out``."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("feddg.reports", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
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
