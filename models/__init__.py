"""Flax NNX models for long-range tasks.

`MODELS` maps the model family a task asks for (`task.MODEL`) to its module class; every class is
built as `cls(cfg, rngs=nnx.Rngs(seed))` from the `config.model` fields. `get(name)` looks one up
and lists the valid names when it is unknown.
"""

from models.dual_encoder import DualEncoder
from models.encoder import Classifier, Encoder
from models.language_model import LanguageModel

MODELS = {
    "classifier": Classifier,
    "dual_encoder": DualEncoder,
    "lm": LanguageModel,
}


def get(name: str):
  """Returns the model class registered under `name`."""
  try:
    return MODELS[name]
  except KeyError:
    raise ValueError(
        f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}.") from None


__all__ = ["MODELS", "Classifier", "DualEncoder", "Encoder", "LanguageModel", "get"]
