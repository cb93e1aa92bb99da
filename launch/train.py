"""Runs one task by name: builds its config, applies overrides, calls `train_and_evaluate`.

  python -m launch.train listops --attention band --size small --workdir runs/x \
      --config.num_train_steps=300 --config.model.attention.window=8

`--config.a.b=V` overrides an existing field; V is parsed as a Python literal when it is one
(numbers, booleans, tuples, dicts) and checked against the field's current type. Unknown fields
raise with the valid names at that level. The `lra` console command (launch/cli.py) calls this.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Any, Sequence

import importlib

import ml_collections

# Task name -> its config module (get_config(arg), sweep(add)), imported when first used.
CONFIGS = {task: f"configs.{task}" for task in (
    "listops", "text", "retrieval", "image", "pathfinder", "pathx", "enwik8", "text8")}


def config_module(task: str):
  try:
    module = CONFIGS[task]
  except KeyError:
    raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(sorted(CONFIGS))}.") \
        from None
  return importlib.import_module(module)


def _parse_value(text: str, current: Any) -> Any:
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text
  if isinstance(current, bool):
    if isinstance(value, str) and value.lower() in ("true", "false"):
      value = value.lower() == "true"
    if not isinstance(value, bool):
      raise ValueError(f"expected true/false, got {text!r}.")
  elif isinstance(current, int) and not isinstance(value, bool) and isinstance(value, int):
    pass
  elif isinstance(current, float) and isinstance(value, (int, float)):
    value = float(value)
  elif isinstance(current, str):
    value = text
  elif isinstance(current, (tuple, list)) and isinstance(value, (tuple, list)):
    value = tuple(value)
  elif current is not None and not isinstance(value, type(current)):
    raise ValueError(f"expected a {type(current).__name__}, got {text!r}.")
  return value


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
        node[leaf] = _parse_value(text, None)
      return
    raise ValueError(f"unknown config field {dotted!r}; valid fields of {where}: "
                     f"{', '.join(sorted(node.keys()))}.")
  try:
    value = _parse_value(text, node[leaf])
  except ValueError as e:
    raise ValueError(f"--config.{dotted}: {e}") from None
  with node.ignore_type():
    node[leaf] = value


def build_config(task: str, *, attention: str | None = None, size: str | None = None,
                 arg: str = "", overrides: Sequence[tuple[str, str]] = ()
                 ) -> ml_collections.ConfigDict:
  """The task's config for `arg` (+ attention/size), with `--config.x=y` overrides applied."""
  parts = [p for p in (arg or "").split(",") if p]
  if attention:
    parts.append(f"attention={attention}")
  if size:
    parts.append(f"size={size}")
  config = config_module(task).get_config(",".join(parts))
  for dotted, text in overrides:
    apply_override(config, dotted, text)
  return config


def default_workdir(task: str, config: ml_collections.ConfigDict) -> str:
  arg = dict(p.split("=", 1) for p in config.config_arg.split(","))
  return os.path.join("workdirs", f"{task}-{arg['attention']}-{arg['size']}")


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
  """Separates `--config.a.b=v` (or `--config.a.b v`) from the other arguments."""
  rest, overrides, i = [], [], 0
  argv = list(argv)
  while i < len(argv):
    a = argv[i]
    if a.startswith("--config."):
      key, eq, value = a[len("--config."):].partition("=")
      if not eq:
        if i + 1 >= len(argv):
          raise ValueError(f"{a} needs a value: {a}=VALUE.")
        value, i = argv[i + 1], i + 1
      overrides.append((key, value))
    else:
      rest.append(a)
    i += 1
  return rest, overrides


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("task", help=f"one of: {', '.join(sorted(CONFIGS))}")
  parser.add_argument("--attention", default=None, help="an attention kind (see `lra list`)")
  parser.add_argument("--size", default=None, help="base (LRA settings) or small (CPU)")
  parser.add_argument("--arg", default="", help="more get_config arguments, e.g. window=8")
  parser.add_argument("--workdir", default=None,
                      help="run directory (default workdirs/TASK-ATTENTION-SIZE); rerunning in "
                           "it resumes")


def run(args: argparse.Namespace, overrides: Sequence[tuple[str, str]]) -> int:
  """Trains; returns the process exit status (130 when interrupted by Ctrl-C)."""
  try:
    config = build_config(args.task, attention=args.attention, size=args.size, arg=args.arg,
                          overrides=overrides)
  except ValueError as e:  # a bad name or override: say which, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2
  workdir = args.workdir or default_workdir(args.task, config)
  print(f"Training {args.task} ({config.config_arg}) in {workdir}", flush=True)
  from lra import train  # heavy imports only once the arguments are valid
  results = train.train_and_evaluate(config, workdir)
  if results["interrupted"]:
    return 130
  line = f"test accuracy {results['test_accuracy']:.4f}"
  if "majority_class_rate" in results:
    line += f" (majority class {results['majority_class_rate']:.4f})"
  line += (f", best validation accuracy {results['best_validation_accuracy']:.4f} at step "
           f"{results['best_validation_step']}; results in "
           f"{os.path.join(workdir, 'results.json')}")
  print(line, flush=True)
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  rest, overrides = split_overrides(argv)
  parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  add_run_arguments(parser)
  return run(parser.parse_args(rest), overrides)


if __name__ == "__main__":
  sys.exit(main())
