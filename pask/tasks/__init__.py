"""Evaluation tasks: the :class:`Task` interface and the registry (``bfcl``, ``sql``, ``ruler``, and any registered)."""

from pask.tasks.base import Output, Task, TaskRequest, measured_budgets
from pask.tasks.registry import TASKS, get_task, register_task, task_names

__all__ = ["TASKS", "Output", "Task", "TaskRequest", "get_task", "measured_budgets", "register_task", "task_names"]
