"""The task registry: every task ``pask eval``, sweeps and calibration know, by name.

Built-in tasks are imported on first use (``bfcl``: BFCL function calling, ``sql``: Spider
text-to-SQL, ``ruler``: RULER-style long-context tasks), so importing the registry stays light. A new task plugs in with
:func:`register_task` (or ``TASKS[name] = task``); nothing else needs to change.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping

from pask.errors import PaskError
from pask.tasks.base import Task

_BUILTIN = {"bfcl": "pask.tasks.bfcl:BfclTask", "sql": "pask.tasks.sql:SqlTask", "ruler": "pask.tasks.ruler:RulerTask"}


class TaskRegistry(MutableMapping[str, Task]):
    """Name -> :class:`~pask.tasks.base.Task`; built-in tasks are instantiated when first looked up."""

    def __init__(self, builtin: dict[str, str]) -> None:
        self._entries: dict[str, Task | str] = dict(builtin)

    def __getitem__(self, name: str) -> Task:
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = self._entries[name] = getattr(importlib.import_module(module), attr)()
        return entry

    def __setitem__(self, name: str, task: Task) -> None:
        if not isinstance(task, Task):
            raise TypeError(f"task '{name}' must be a pask.tasks.Task, got {type(task).__name__}")
        if missing := [a for a in ("name", "default_max_new_tokens") if not hasattr(task, a)]:
            raise TypeError(f"task '{name}' lacks the class attribute(s) {', '.join(missing)}")
        if task.name != name:
            raise ValueError(f"task '{task.name}' registered under another name '{name}'")
        self._entries[name] = task

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:  # without importing the task
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


TASKS = TaskRegistry(_BUILTIN)


def register_task(task: Task) -> Task:
    """Add (or replace) ``task`` under its name; returns it."""
    TASKS[task.name] = task
    return task


def task_names() -> list[str]:
    """The registered task names, sorted."""
    return sorted(TASKS)


def get_task(name: str) -> Task:
    """The task called ``name``; PaskError naming the known tasks otherwise."""
    if name not in TASKS:
        raise PaskError(f"unknown task '{name}'; known tasks: {', '.join(task_names())}")
    return TASKS[name]


__all__ = ["TASKS", "TaskRegistry", "get_task", "register_task", "task_names"]
