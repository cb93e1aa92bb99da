"""Pathfinder and Path-X (LRA): are the two dots joined by one path? Binary labels on flattened
PNG images, classified by the LRA encoder.

The data (the release layout or generated images, the split, the tfds dataset, the source) is
`lra.data.pathfinder`; this file pairs it with the classification family. Path-X (`PATHX`) is
the same data functions at 128x128 (`data.resolution=128`, LRA's choice) with its own data
folder.
"""

from __future__ import annotations

import functools

from lra.data import pathfinder as data
from lra.tasks.classification import ClassificationTask

NAME = data.NAME


def _task(name: str) -> ClassificationTask:
  return ClassificationTask(
      name=name, vocab_size=data.VOCAB_SIZE, num_classes=data.NUM_CLASSES,
      get_source=functools.partial(data.get_source, task=name), prepare=data.DATA[name].prepare,
      status=data.DATA[name].status)


TASK = _task(NAME)
PATHX = _task("pathx")
