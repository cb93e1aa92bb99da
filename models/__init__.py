"""Flax NNX models for long-range tasks.

Every model is built as `cls(cfg, rngs=nnx.Rngs(seed))` from a `ModelSettings`
(`models.settings`) or the mapping it is made from once: the `config.model` fields plus what
the task fixes (vocabulary, classes, length). Which class a task trains is the task's choice
(`lra.tasks`): the encoder `Classifier`, the retrieval `DualEncoder` or the causal
`LanguageModel`. The attention kind of each layer comes from `attention.kinds`.

Imports are lazy (PEP 562): `from models import settings` loads no jax, so the config schema
can read the model names and rules; the first use of a model class or submodule imports it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# Public name -> the submodule defining it.
_EXPORTS = {"Classifier": "encoder", "DualEncoder": "dual_encoder", "Encoder": "encoder",
            "LanguageModel": "language_model", "ModelSettings": "settings"}


def __getattr__(name: str) -> Any:
  """Imports an exported class or a submodule on first use."""
  if name in _EXPORTS:
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")  # binds the submodule as an attribute
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


__all__ = ["Classifier", "DualEncoder", "Encoder", "LanguageModel", "ModelSettings"]
