"""Runs one task by name: builds its config, applies overrides, calls `train_and_evaluate`.

  python -m launch.train listops --attention band --size small --workdir runs/x \
      --config.num_train_steps=300 --config.model.attention.window=8

`--config.a.b=V` overrides an existing field; V is parsed as a Python literal when it is one
(numbers, booleans, tuples, dicts) and checked against the field's current type. Unknown fields
raise with the valid names at that level. The `lra` console command (launch/cli.py) calls this.

Staged training: a config with a non-empty `phases` (the character-LM configs) runs phase k as
its own `train_and_evaluate` in `<workdir>/phase<k>`, with the phase's steps, sequence length,
window multiplier, learning rate, batch size and warmup (`phase_config`), starting from phase
k-1's final parameters (`config.init_from`). A phase whose `results.json` exists is skipped and
an interrupted one resumes, so rerunning the command continues the schedule.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import sys
from typing import Any, Callable, Sequence

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


# The fields a phase sets (`config.phases` is a tuple of dicts with exactly these keys).
PHASE_KEYS = ("steps", "max_length", "window_scale", "learning_rate", "batch_size",
              "warmup_steps")


def _scale_window(spec: Any, scale: float) -> Any:
  """An attention spec dict with its `window` (when it has one) multiplied by `scale`."""
  spec = dict(spec)
  if "window" in spec:
    spec["window"] = int(round(spec["window"] * scale))
  return spec


def phase_config(config: ml_collections.ConfigDict, index: int) -> ml_collections.ConfigDict:
  """The config of phase `index` (0-based): `config` with the phase's fields set and no phases.

  Attention windows (the default spec and every per-layer one) are multiplied by the phase's
  `window_scale`; the model's parameters must not depend on the length (pos_emb "sinusoidal"
  or "none"), since every phase continues the previous one's parameters.
  """
  phases = [dict(p) for p in config.phases]
  for k, phase in enumerate(phases):
    if set(phase) != set(PHASE_KEYS):
      raise ValueError(f"config.phases[{k}] has keys {sorted(phase)}; a phase needs exactly "
                       f"{', '.join(PHASE_KEYS)}.")
  if config.model.pos_emb == "learned" and len({p["max_length"] for p in phases}) > 1:
    raise ValueError("the phases change the sequence length, so the model's parameters must "
                     "not depend on it: use --config.model.pos_emb=sinusoidal (or none).")
  phase = phases[index]
  c = ml_collections.ConfigDict(config.to_dict())
  with c.unlocked(), c.ignore_type():
    c.phases = ()
    c.num_train_steps = int(phase["steps"])
    c.data.max_length = int(phase["max_length"])
    c.learning_rate = float(phase["learning_rate"])
    c.batch_size = int(phase["batch_size"])
    c.warmup_steps = int(phase["warmup_steps"])
    scale = float(phase["window_scale"])
    c.model.attention = ml_collections.ConfigDict(
        _scale_window(config.model.attention.to_dict(), scale), type_safe=False)
    c.model.layer_attention = tuple(_scale_window(x, scale)
                                    for x in (config.model.layer_attention or ()))
    if "init_from" not in c:
      c.init_from = ""
  return c


def finished_results(run_dir: str) -> dict[str, Any] | None:
  """The results.json of a finished run in `run_dir` (with "interrupted": False), or None."""
  done = os.path.join(run_dir, "results.json")
  if not os.path.exists(done):
    return None
  with open(done) as f:
    return {**json.load(f), "interrupted": False}


def run_phases(config: ml_collections.ConfigDict, workdir: str, *,
               hooks: Sequence[Callable[[int], None]] = ()) -> dict[str, Any]:
  """Runs every phase of `config.phases` in `<workdir>/phase<k>` (k from 1), each starting
  from the previous phase's final parameters; skips finished phases. Returns the results of
  the last phase run (or read), plus "phases" (each phase's results.json) and "interrupted".
  """
  from lra import train  # heavy imports only when training
  count = len(config.phases)
  summary = []
  results: dict[str, Any] = {}
  for k in range(count):
    phase_dir = os.path.join(workdir, f"phase{k + 1}")
    c = phase_config(config, k)
    if k > 0:
      with c.unlocked():
        c.init_from = os.path.join(workdir, f"phase{k}", "checkpoints")
    earlier = finished_results(phase_dir)
    if earlier is not None:
      results = earlier
      print(f"Phase {k + 1}/{count}: finished earlier ({phase_dir}); skipped.", flush=True)
    else:
      print(f"Phase {k + 1}/{count}: {c.num_train_steps} steps of batch {c.batch_size}, length "
            f"{c.data.max_length}, windows x{config.phases[k]['window_scale']}, learning rate "
            f"{c.learning_rate:g}, in {phase_dir}", flush=True)
      results = train.train_and_evaluate(c, phase_dir, hooks=hooks)
      if results["interrupted"]:
        return {**results, "phases": summary}
    summary.append({key: v for key, v in results.items() if key not in ("state", "interrupted")})
  return {**results, "phases": summary}


def result_line(results: dict[str, Any], workdir: str) -> str:
  """The final line of a run: test accuracy, or test bits per character for language models."""
  where = os.path.join(workdir, "results.json")
  if "test_bpc" in results:
    if results.get("phases"):
      where = os.path.join(workdir, f"phase{len(results['phases'])}", "results.json")
    return (f"test bits per character {results['test_bpc']:.4f} (uniform over bytes: 8), best "
            f"validation {results['best_validation_bpc']:.4f} at step "
            f"{results['best_validation_step']}; results in {where}")
  line = f"test accuracy {results['test_accuracy']:.4f}"
  if "majority_class_rate" in results:
    line += f" (majority class {results['majority_class_rate']:.4f})"
  return line + (f", best validation accuracy {results['best_validation_accuracy']:.4f} at step "
                 f"{results['best_validation_step']}; results in {where}")


def run(args: argparse.Namespace, overrides: Sequence[tuple[str, str]]) -> int:
  """Trains; returns the process exit status (130 when interrupted by Ctrl-C)."""
  try:
    config = build_config(args.task, attention=args.attention, size=args.size, arg=args.arg,
                          overrides=overrides)
  except ValueError as e:  # a bad name or override: say which, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2
  workdir = args.workdir or default_workdir(args.task, config)
  from lra import archives, tasks, train  # heavy imports only once the arguments are valid
  try:  # the data first: a missing or corrupt file is reported before anything is compiled
    tasks.get_task(config.task).prepare(config.data)
  except (archives.DataMissingError, archives.CorruptArchiveError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"Training {args.task} ({config.config_arg}) in {workdir}", flush=True)
  if config.get("phases"):
    try:
      phase_config(config, 0)  # checks the phase fields before anything is built
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    results = run_phases(config, workdir)
  else:
    results = train.train_and_evaluate(config, workdir)
  if results["interrupted"]:
    return 130
  print(result_line(results, workdir), flush=True)
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
