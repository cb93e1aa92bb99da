"""Config values on the command line: dotted field names and values as `--config.x=TEXT` text.

`value_text` writes what `configs.common.convert` (the converter of `--config.x=y` overrides and
of `get_config` arguments) reads back to the same value, so a sweep point's overrides, `lra
results`' overrides column and the config's own text agree. Pure Python: no jax.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def flag_spelling(argv: Sequence[str]) -> list[str]:
  """The command line with every flag spelled with underscores (`--no-download` is
  `--no_download`, `--dry-run` is `--dry_run`), the one spelling the parsers define, so either
  spelling works. `--config.a.b=v` overrides and a value after `=` are left as they are, and so is
  everything after a bare `--` (the command `lra launch` runs, which its own parser reads)."""
  out = []
  for i, arg in enumerate(argv):
    if arg == "--":
      return out + list(argv[i:])
    if arg.startswith("--") and not arg.startswith("--config."):
      name, eq, value = arg.partition("=")
      arg = "--" + name[2:].replace("-", "_") + eq + value
    out.append(arg)
  return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """`{"a": {"b": 1}}` -> `{"a.b": 1}`, in order; an empty mapping is a value of its own."""
  out: dict[str, Any] = {}
  for key, value in tree.items():
    if isinstance(value, Mapping) and value:
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _literal(value: Any) -> str:
  """A Python literal of `value` without spaces (tuples and lists as tuples)."""
  if isinstance(value, (list, tuple)):
    return "(" + ",".join(_literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  if isinstance(value, Mapping):
    return "{" + ",".join(f"{_literal(k)}:{_literal(v)}" for k, v in value.items()) + "}"
  return repr(value)


def value_text(value: Any) -> str:
  """The command-line text of a config value, which `configs.common.convert` reads back:
  booleans as true/false, strings as they are, tuples and lists as a Python tuple without
  spaces (`(1,2)`, `('a',)`), anything else as its Python literal."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, str):
    return value
  return _literal(value)
