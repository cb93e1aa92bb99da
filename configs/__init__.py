"""One config file per task (`configs/<task>.py`: `get_config(arg)` and `sweep(add)`), and
`build_config`, which resolves a task's config by name with command-line overrides.

Config files import only ml_collections and pure-Python names (no jax, no tensorflow_datasets),
so resolving or printing a config is instant.
"""

from __future__ import annotations

import importlib
from typing import Sequence

import ml_collections

from configs import common
from lra import tasks as tasks_lib


def config_module(task: str):
  """The config module of `task` (`configs/<task>.py`: get_config(arg), sweep(add))."""
  return importlib.import_module(f"configs.{tasks_lib.check_name(task)}")


def sizes(task: str) -> tuple[str, ...]:
  """The sizes task `task`'s config takes (`--size`), the default first."""
  return tuple(getattr(config_module(task), "SIZES", common.DEFAULT_SIZES))


def apply_override(config: ml_collections.ConfigDict, dotted: str, text: str) -> None:
  """Sets `config.<dotted>` from the command-line string `text`."""
  *parents, leaf = dotted.split(".")
  node = config
  for i, name in enumerate(parents):
    if not isinstance(node, ml_collections.ConfigDict) or name not in node:
      raise ValueError(f"unknown config field {'.'.join(parents[:i + 1])!r}; valid fields: "
                       f"{', '.join(sorted(node.keys()))}.")
    node = node[name]
  if leaf not in node:
    where = ".".join(parents) or "config"
    # attention arguments are free-form: a kind's arguments differ from kind to kind
    if parents[-1:] == ["attention"]:
      with node.unlocked():
        node[leaf] = common.convert(text, None)
      return
    raise ValueError(f"unknown config field {dotted!r}; valid fields of {where}: "
                     f"{', '.join(sorted(node.keys()))}.")
  try:
    value = common.convert(text, node[leaf])
  except ValueError as e:
    raise ValueError(f"--config.{dotted}: {e}") from None
  with node.ignore_type():
    node[leaf] = value


def build_config(task: str, *, attention: str | None = None, size: str | None = None,
                 arg: str = "", overrides: Sequence[tuple[str, str]] = ()
                 ) -> ml_collections.ConfigDict:
  """The task's config for `arg` (+ attention/size), with `--config.x=y` overrides applied."""
  parts = [p for p in (arg or "").split(",") if p]
  # `--config.model.attention.kind=K` chooses the kind as `--attention K` does: the task's
  # arguments for K (a band's window, LSH's buckets, ...), then every override on top. Setting
  # the field alone would keep the old kind's arguments and lack the new kind's.
  kind = [text for dotted, text in overrides if dotted == "model.attention.kind"]
  if kind:
    attention = str(common.convert(kind[-1], ""))
    if attention not in common.kinds.KINDS and attention not in common.kinds.aliases():
      raise ValueError(f"config.model.attention.kind = {attention!r}: unknown attention kind; "
                       f"valid: {', '.join(common.kinds.names())}.")
  # `--config.size=S` likewise chooses the size as `--size S` does (every field of that size).
  sized = [text for dotted, text in overrides if dotted == "size"]
  if sized:
    size = str(common.convert(sized[-1], ""))
  if attention:
    parts.append(f"attention={attention}")
  if size:
    parts.append(f"size={size}")
  module = config_module(task)
  config = module.get_config(",".join(parts))
  chosen = {"model.attention.kind"} if kind else set()
  chosen |= {"size"} if sized else set()
  for dotted, text in overrides:
    if dotted not in chosen:   # set above (a paper's name resolved, a size's fields)
      apply_override(config, dotted, text)
  if hasattr(module, "check"):   # a task's own relations between fields (one-line ValueError)
    module.check(config)
  return common.apply_protocol(config)   # protocol=spt: pretraining and fine-tuning phases
