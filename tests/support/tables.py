"""Reading rich tables back as text, cell by cell."""

import io

from rich.console import Console
from rich.table import Table


def rendered(table: Table) -> str:
    """``table`` as a wide terminal would print it, without colour."""
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(table)
    return out.getvalue()


def text_rows(text: str) -> list[list[str]]:
    """The cells of each row, header rows included, of every rich table printed in ``text``."""
    return [_cells(line) for line in text.replace("┃", "│").splitlines() if line.count("│") >= 2]


def table_cells(table: Table) -> list[list[str]]:
    """The rendered body rows of ``table``, one list of cell texts each."""
    return [_cells(line) for line in rendered(table).splitlines() if line.startswith("│")]


def _cells(line: str) -> list[str]:
    """The cell texts of one printed row (between its outer borders)."""
    return [c.strip() for c in line.split("│")[1:-1]]
