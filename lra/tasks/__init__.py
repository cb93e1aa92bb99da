"""Long Range Arena tasks by name.

Each task module exports NAME, NUM_CLASSES, VOCAB_SIZE, PAD_ID, MODEL (the model family the
trainer builds: "classifier", "dual_encoder" or "lm"), `data_config()` (an ml_collections
ConfigDict of data settings) and `get_source(data_cfg, split)` (a random-access source of padded
examples for "train", "validation" and "test").
"""

from types import ModuleType

from lra.tasks import listops

TASKS = {
    "listops": listops,
}


def get_task(name: str) -> ModuleType:
  """Returns the task module registered under `name`."""
  try:
    return TASKS[name]
  except KeyError:
    raise ValueError(
        f"unknown task {name!r}; valid names: {', '.join(sorted(TASKS))}.") from None


__all__ = ["TASKS", "get_task", "listops"]
