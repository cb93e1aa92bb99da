"""Text (LRA): IMDb sentiment from raw bytes, 2 classes, classified by the LRA encoder.

The data (the aclImdb archive, the tfds dataset, the held-out validation option, the padded
source) is `lra.data.text`; this file pairs it with the classification family.
"""

from __future__ import annotations

from lra.data import text as data
from lra.tasks.classification import ClassificationTask

NAME = data.NAME

TASK = ClassificationTask(name=NAME, vocab_size=data.VOCAB_SIZE, num_classes=data.NUM_CLASSES,
                          get_source=data.get_source, prepare=data.DATA.prepare,
                          status=data.DATA.status)
