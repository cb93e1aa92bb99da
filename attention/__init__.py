"""Attention primitives: pure functions over `[batch, length, heads, head_dim]` arrays.

Every kind is one record in `attention.kinds` (its function, mask builders, causal support,
shared q/k, per-layer extras, config defaults); `kinds.get(name)` is the one check of a kind
name. This package exports each kind's function under its own name (`attention.band_attention`),
`REGISTRY` (kind name -> function, derived from the records on each use) and `get(name)` (the function of a
kind; an unknown name raises and lists the valid ones). Dense reference masks for every pattern
are in `attention.masks`.

Imports are lazy (PEP 562): `from attention import kinds` loads no jax, so config files can read
the kind names and defaults; the first use of a function or submodule imports it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable

from attention import kinds

# Public names that are not a kind's function -> the submodule defining them.
_OTHER_EXPORTS = {"favor_features": "favor"}


def _exports() -> dict[str, str]:
  """Exported function name -> submodule of this package, from the records of the package's
  own kinds (a kind registered from elsewhere names a full module path) and the extras."""
  out = {k.function: k.module for k in kinds.KINDS.values() if "." not in k.module}
  out.update(_OTHER_EXPORTS)
  return out


def _registry() -> dict[str, Callable]:
  """`REGISTRY`, kept mutable (a benchmark may wrap a kind's function in it) and completed from
  the records on each use, so kinds registered later (`kinds.register`) are in it too."""
  registry = globals().setdefault("_REGISTRY", {})
  for name in kinds.names():
    if name not in registry:
      kind = kinds.KINDS[name]
      registry[name] = getattr(importlib.import_module(kind.module_path), kind.function)
  for name in set(registry) - set(kinds.KINDS):   # unregistered since
    del registry[name]
  return registry


def get(name: str) -> Callable:
  """Returns the attention function of kind `name` (validated by `kinds.get`: an unknown name
  raises and lists the valid ones)."""
  kinds.get(name)
  return _registry()[name]


def __getattr__(name: str) -> Any:
  """Imports an exported function, `REGISTRY` or a submodule on first use."""
  if name == "REGISTRY":   # derived from the records, registered kinds included
    return _registry()
  exports = _exports()
  if name in exports:
    value = getattr(importlib.import_module(f"{__name__}.{exports[name]}"), name)
    globals()[name] = value
    return value
  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")  # binds the submodule as an attribute
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


__all__ = ["REGISTRY", "get", "kinds", "masks", *sorted(_exports())]
