"""Flax NNX models for long-range tasks.

Every model is built as `cls(cfg, rngs=nnx.Rngs(seed))` from the `config.model` fields plus what
the task fixes (vocabulary, classes, length); which class a task trains is the task's choice
(`lra.tasks`): the encoder `Classifier`, the retrieval `DualEncoder` or the causal
`LanguageModel`. The attention kind of each layer comes from `attention.kinds`.
"""

from models.dual_encoder import DualEncoder
from models.encoder import Classifier, Encoder
from models.language_model import LanguageModel

__all__ = ["Classifier", "DualEncoder", "Encoder", "LanguageModel"]
