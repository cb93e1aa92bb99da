"""Retrieval (LRA): AAN citation matching of two byte-level documents, 2 classes, dual encoder.

The data (the AAN TSVs of the LRA release, the tfds dataset, the padded pair source) is
`lra.data.retrieval`; this file pairs it with the matching family (`MatchingTask`: the
shared-weight dual encoder, `models/dual_encoder.py`).
"""

from __future__ import annotations

from lra.data import retrieval as data
from lra.tasks.classification import MatchingTask

NAME = data.NAME

TASK = MatchingTask(name=NAME, vocab_size=data.VOCAB_SIZE, num_classes=data.NUM_CLASSES,
                    get_source=data.get_source, prepare=data.DATA.prepare, status=data.DATA.status)
