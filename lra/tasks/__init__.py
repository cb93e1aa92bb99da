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
    "mqar": "lra.tasks.mqar:TASK",
    "needle": "lra.tasks.needle:TASK",
}


# "<task>+<objective>": self-pretraining on the task's inputs (lra/tasks/pretraining.py).
OBJECTIVES = ("mlm", "clm", "mpnet")


def check_name(name: str) -> str:
  """Returns `name` when it is a task; raises ValueError listing the valid names otherwise."""
  base, plus, objective = name.partition("+")
  if base not in TASKS:
    raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}.")
  if plus and objective not in OBJECTIVES:
    raise ValueError(f"unknown pretraining objective {objective!r} in task {name!r}; valid: "
                     f"{', '.join(OBJECTIVES)}.")
  return name


def get_task(name: str):
  """The Task object registered under `name` (a `lra.tasks.base.Task`)."""
  base, plus, objective = check_name(name).partition("+")
  if plus:
    pretraining = importlib.import_module("lra.tasks.pretraining")
    return pretraining.pretraining_task(get_task(base), objective)
  module, attribute = TASKS[name].split(":")
  return getattr(importlib.import_module(module), attribute)


__all__ = ["TASKS", "check_name", "get_task"]
