"""The tasks by name: `TASKS` is the one list of task names, `get_task(name)` the Task object.

Each entry names the module and attribute of a `lra.tasks.base.Task` (data plus family: model,
objective, metrics, best-checkpoint rule, result line). Modules are imported when a task is
first asked for, so listing names imports nothing heavy and one task's imports never slow
another. The config of task `name` is `configs/<name>.py`.
"""

from __future__ import annotations

import importlib

# Task name -> "module:attribute" of its Task object.
TASKS = {
    "listops": "lra.tasks.listops:TASK",
    "text": "lra.tasks.text:TASK",
    "retrieval": "lra.tasks.retrieval:TASK",
    "image": "lra.tasks.image:TASK",
    "pathfinder": "lra.tasks.pathfinder:TASK",
    "pathx": "lra.tasks.pathfinder:PATHX",
    "enwik8": "lra.tasks.charlm:ENWIK8",
    "text8": "lra.tasks.charlm:TEXT8",
    "sort_marked": "lra.tasks.sort_marked:TASK",
}


def check_name(name: str) -> str:
  """Returns `name` when it is a task; raises ValueError listing the valid names otherwise."""
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}.")
  return name


def get_task(name: str):
  """The Task object registered under `name` (a `lra.tasks.base.Task`)."""
  module, attribute = TASKS[check_name(name)].split(":")
  return getattr(importlib.import_module(module), attribute)


__all__ = ["TASKS", "check_name", "get_task"]
