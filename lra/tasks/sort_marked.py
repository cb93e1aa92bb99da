"""Sort-marked: a synthetic long-input sequence-to-sequence task for the LED encoder-decoder.

The data (the generator's tfds dataset and the padded source) is `lra.data.sort_marked`, the
generator and its vocabulary `lra.data.marked_sort`; this file pairs them with the seq2seq
family.
"""

from __future__ import annotations

from lra.data import marked_sort, sort_marked as data
from lra.tasks.seq2seq import Seq2SeqTask

NAME = data.NAME

# The vocabulary is the largest the generator allows (ids are uint8): the embedding has rows for
# every setting of num_values and num_fillers, so the task's vocabulary does not depend on them.
TASK = Seq2SeqTask(name=NAME, vocab_size=marked_sort.MAX_VOCAB,
                   num_classes=marked_sort.MAX_VOCAB, get_source=data.get_source,
                   prepare=data.DATA.prepare, status=data.DATA.status,
                   bos_id=marked_sort.BOS_ID, eos_id=marked_sort.EOS_ID,
                   target_length=data.target_length)
