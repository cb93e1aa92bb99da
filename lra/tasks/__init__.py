"""Long Range Arena and character-LM tasks by name.

Each task module exports NAME, NUM_CLASSES, VOCAB_SIZE, PAD_ID (0), MODEL (the model family the
trainer builds: "classifier", "dual_encoder" or "lm"), `data_config()` (an ml_collections
ConfigDict of data settings), `get_source(data_cfg, split)` (a random-access source of padded
examples for "train", "validation" and "test"), `prepare(data_cfg)` (builds the dataset if it is
missing; raises `lra.archives.DataMissingError` naming the file to get) and `status(data_cfg)`
(an `lra.datasets.Status` for `lra data status`).

Modules are imported when a task is first asked for, so one task's imports never slow another.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Task name -> the module implementing it.
TASKS = {
    "listops": "lra.tasks.listops",
    "text": "lra.tasks.text",
    "retrieval": "lra.tasks.retrieval",
    "image": "lra.tasks.image",
    "pathfinder": "lra.tasks.pathfinder",
    "pathx": "lra.tasks.pathx",
    "enwik8": "lra.tasks.enwik8",
    "text8": "lra.tasks.text8",
}


def get_task(name: str) -> ModuleType:
  """Returns the task module registered under `name`."""
  try:
    module = TASKS[name]
  except KeyError:
    raise ValueError(
        f"unknown task {name!r}; valid names: {', '.join(sorted(TASKS))}.") from None
  return importlib.import_module(module)


__all__ = ["TASKS", "get_task"]
