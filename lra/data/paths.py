"""Where data lives: the data root (`$LRA_DATA`, default `~/lra_data`), its `manual/` folder for
the original archives and one folder per task for the prepared datasets.

Pure Python (imports only `os`), so the config files can fill in their default data folders
without loading tfds or jax.
"""

from __future__ import annotations

import os

DATA_ROOT_ENV = "LRA_DATA"


def data_root() -> str:
  """The data root: `$LRA_DATA`, or `~/lra_data`."""
  return os.path.expanduser(os.environ.get(DATA_ROOT_ENV) or "~/lra_data")


def default_data_dir(task: str) -> str:
  """Where the prepared dataset of `task` lives by default."""
  return os.path.join(data_root(), task)


def default_manual_dir() -> str:
  """Where the original archives are looked for (and downloaded to) by default."""
  return os.path.join(data_root(), "manual")
