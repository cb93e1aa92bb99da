"""Image (LRA): CIFAR-10 as sequences of 1,024 grayscale pixels, 10 classes, classified by the
LRA encoder.

The data (the CIFAR-10 python archive, LRA's grayscale, the tfds dataset, the source) is
`lra.data.image`; this file pairs it with the classification family.
"""

from __future__ import annotations

from lra.data import image as data
from lra.tasks.classification import ClassificationTask

NAME = data.NAME

TASK = ClassificationTask(name=NAME, vocab_size=data.VOCAB_SIZE, num_classes=data.NUM_CLASSES,
                          get_source=data.get_source, prepare=data.DATA.prepare,
                          status=data.DATA.status)
