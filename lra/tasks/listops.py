"""ListOps (LRA): nested list operations, 10 classes, classified by the LRA encoder.

The data (the released TSVs or the generator, the tfds dataset, the padded source) is
`lra.data.listops`, the vocabulary and the generator `lra.data.listops_generator`; this file
pairs them with the classification family.
"""

from __future__ import annotations

from lra.data import listops as data
from lra.data.listops_generator import NUM_CLASSES, VOCAB_SIZE
from lra.tasks.classification import ClassificationTask

NAME = data.NAME

TASK = ClassificationTask(name=NAME, vocab_size=VOCAB_SIZE, num_classes=NUM_CLASSES,
                          get_source=data.get_source, prepare=data.DATA.prepare,
                          status=data.DATA.status)
