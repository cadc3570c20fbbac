"""Reading a rich table back as text, cell by cell."""

import io

from rich.console import Console
from rich.table import Table


def table_cells(table: Table) -> list[list[str]]:
    """The rendered rows of ``table``, one list of cell texts each."""
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(table)
    return [[c.strip() for c in line.split("│")[1:-1]] for line in out.getvalue().splitlines() if line.startswith("│")]
