"""Tasks: a dataset's loss, additive per-domain tallies and metric (tasks/base.py)."""

from feddg.tasks.base import (
    BATCHNORM,
    CAPABILITIES,
    CLASS_LABELS,
    CONV_STAGES,
    DENSE_MASKS,
    IMAGES,
    TOKENS,
    Task,
    metric_key,
)
from feddg.tasks.info import TaskInfo, info_for_dataset
from feddg.tasks.registry import TASKS, make_task, task_class

__all__ = ["BATCHNORM", "CAPABILITIES", "CLASS_LABELS", "CONV_STAGES", "DENSE_MASKS", "IMAGES", "TASKS", "TOKENS",
           "Task", "TaskInfo", "info_for_dataset", "make_task", "metric_key", "task_class"]
