"""A task as the readers of a run see it: results.json's ``task`` block (``Task.info()``), and how to read the
metric keys a run wrote (``ood_acc/uci`` -> role ``ood``, domain ``uci``) without guessing from their names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from feddg.tasks.base import metric_key

EXTRA = "extra/"


@dataclass(frozen=True)
class TaskInfo:
    name: str
    metric: str
    label: str
    unit: str
    bounds: tuple[float, float]
    higher_is_better: bool
    chance: float | None
    #: the task's other metrics (those it offers, those the run reported): keys of theirs are not this metric's
    others: tuple[str, ...] = ()

    @classmethod
    def of(cls, block: Mapping[str, Any]) -> TaskInfo:
        """From results.json's ``task`` block."""
        from feddg.tasks.registry import TASKS

        lo, hi = block["bounds"]
        offered = TASKS[block["name"]].offers if block["name"] in TASKS else ()
        others = tuple(dict.fromkeys([*block.get("extra_metrics", ()), *offered]))
        return cls(block["name"], block["metric"], block["label"], block.get("unit", ""), (float(lo), float(hi)),
                   bool(block["higher_is_better"]), None if block.get("chance") is None else float(block["chance"]),
                   others)

    @property
    def axis_label(self) -> str:
        """``accuracy (%)``."""
        return f"{self.label} ({self.unit})" if self.unit else self.label

    def key(self, role: str, domain: str | None = None) -> str:
        return metric_key(role, self.metric, domain)

    def parse(self, key: str) -> tuple[str, str | None] | None:
        """``(role, domain)`` of a key of this metric (``ood_acc/uci`` -> ``("ood", "uci")``, ``id_acc`` ->
        ``("id", None)``, ``extra/rot_acc/a`` -> ``("extra/rot", "a")``), ``None`` for any other key, among them
        another metric's whose name ends in this one's (``ood_slice_dice/a`` is ``slice_dice``'s, not ``dice``'s)."""
        head, prefix = (key[len(EXTRA):], EXTRA) if key.startswith(EXTRA) else (key, "")
        base, sep, domain = head.partition("/")
        suffix = f"_{self.metric}"
        if not base.endswith(suffix) or base == suffix:
            return None
        if any(other.endswith(suffix) and base.endswith(f"_{other}") for other in self.others):
            return None
        return prefix + base[: -len(suffix)], (domain if sep else None)

    def bounds_of(self, key: str) -> tuple[float, float] | None:
        """The bounds of the figures under ``key``: the metric's for its own keys, ``None`` (unbounded) for any other
        (``time_total_s``, another metric's)."""
        return self.bounds if self.parse(key) is not None else None


def info_for_dataset(name: str) -> TaskInfo | None:
    """The task of dataset ``name`` from the registry alone (no data loaded): what a run that has not written
    results.json yet measures; ``None`` for an unknown dataset. ``chance`` is ``None`` where the class count is
    discovered from folders."""
    from feddg.data import dataset_info
    from feddg.tasks.registry import task_class

    try:
        info = dataset_info(name)
    except ValueError:
        return None
    cls = task_class(info["task"])
    num_classes = info["num_classes"]
    if num_classes is None:
        return TaskInfo.of({**cls(2, info["inputs"]).info(), "chance": None})
    return TaskInfo.of(cls(num_classes, info["inputs"]).info())
