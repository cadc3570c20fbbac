"""The tasks by name: a dataset names its task (``DomainDataset.task``), so a config is checked before any data
loads. A new task is one file and one line here (docs/writing-a-method.md, "Adding a task")."""

from __future__ import annotations

from collections.abc import Sequence

from feddg.tasks.base import IMAGES, Task
from feddg.tasks.classification import Classification
from feddg.tasks.segmentation import Segmentation

TASKS: dict[str, type[Task]] = {
    "classification": Classification,
    "segmentation": Segmentation,
}


def task_class(name: str) -> type[Task]:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {sorted(TASKS)}")
    return TASKS[name]


def make_task(name: str, num_classes: int, inputs: str = IMAGES, metrics: Sequence[str] = ()) -> Task:
    """The task ``name`` for a dataset with ``num_classes`` target classes and inputs of kind ``inputs``, also
    reporting the further ``metrics`` (``eval.metrics``)."""
    return task_class(name)(num_classes, inputs).with_metrics(metrics)
