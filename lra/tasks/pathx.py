"""Path-X (LRA): Pathfinder at 128x128, sequences of 16,384 pixels, 2 classes.

The task of `lra.tasks.pathfinder` with `data.resolution=128` (the release folder
`pathfinder128/curv_contour_length_14`, LRA's choice), its own data folder (`~/lra_data/pathx`)
and its name in messages. Everything else (layout, tokenisation, splits, generation) is
Pathfinder's; `data.resolution` may be changed like there.
"""

from __future__ import annotations

import ml_collections

from lra import datasets
from lra.tasks import pathfinder

NAME = "pathx"
NUM_CLASSES = pathfinder.NUM_CLASSES
MODEL = pathfinder.MODEL
VOCAB_SIZE = pathfinder.VOCAB_SIZE
PAD_ID = pathfinder.PAD_ID
RESOLUTION = 128


def data_config() -> ml_collections.ConfigDict:
  """Pathfinder's data settings at 128x128 (max_length 16,384) in the pathx data folder."""
  return pathfinder.data_config(task=NAME, resolution=RESOLUTION)


def prepare(data_cfg: ml_collections.ConfigDict) -> str:
  """Builds the dataset for data_cfg if needed; returns its folder."""
  return pathfinder.prepare(data_cfg, task=NAME)


def status(data_cfg: ml_collections.ConfigDict) -> datasets.Status:
  """Whether the dataset is prepared; if not, where its images will come from."""
  return pathfinder.status(data_cfg, task=NAME)


def get_source(data_cfg: ml_collections.ConfigDict, split: str) -> datasets.PaddedSource:
  """A random-access source for `split` (int32 [res * res] ids, int32 label)."""
  return pathfinder.get_source(data_cfg, split, task=NAME)
