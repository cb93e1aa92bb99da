"""Tests for lra/schema.py: bad config values end `lra run` at once in one line.

Every bad value goes through the real command (`launch.cli.main`), which must return 2 and print
exactly one `error: ` line naming the field and its value, before anything heavy is imported
(the table of bad values is tests/bad_values_test.py; a few runs in a fresh interpreter here
check the wall time and that jax stays unloaded). Every shipped
config (task x size x attention kind, and every phase of the staged ones) passes. Each kind's
`arguments` in attention/kinds.py is checked against its primitive's signature and its extras
class, and the schedule and mesh names against the trainer's (the model names and rules are
`models.settings`' own: tests/settings_test.py).
"""

import inspect
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flax import nnx

import attention
import configs
from attention import kinds, synthesizer
from launch import cli, train as launcher
from lra import mesh, schema, tasks
from lra import train as trainer
from models import attention_extras

REPO = Path(__file__).resolve().parents[1]

def test_messages_say_what_the_value_must_be():
  config = configs.build_config("listops", size="small")
  with config.unlocked():
    config.log_every = 0
  with pytest.raises(ValueError) as e:
    schema.check(config)
  assert str(e.value) == ("config.log_every = 0: must be a positive integer (steps between "
                          "train-metric records).")


@pytest.mark.parametrize("args", [
    ["run", "listops", "--config.log_every=0"],
    ["run", "listops", "--config.model.pool=max"],
    ["run", "listops", "--config.seed", "--size", "small"],
])
def test_fresh_process_fails_fast_without_jax(args):
  code = ("import sys; from launch import cli; rc = cli.main(sys.argv[1:]); "
          "assert 'jax' not in sys.modules, 'jax was imported'; sys.exit(rc)")
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True,
                        text=True, timeout=60)
  assert time.perf_counter() - start < 5.0
  assert proc.returncode == 2, proc.stderr
  assert proc.stdout == ""
  assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_python_m_launch_cli_is_one_line():
  proc = subprocess.run([sys.executable, "-m", "launch.cli", "run", "listops",
                         "--config.eval_every=0"], cwd=REPO, capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr == ("error: config.eval_every = 0: must be a positive integer (steps "
                         "between validation passes).\n")


def test_data_prepare_checks_the_data_fields(capsys):
  assert cli.main(["data", "prepare", "listops", "--size", "small",
                   "--config.data.max_length=0"]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.startswith("error: config.data.max_length = 0: ")
  assert err.count("\n") == 1


def test_each_phase_is_checked():
  config = configs.build_config("text8", size="small")
  schedule = [dict(p) for p in config.phases]
  schedule[1]["batch_size"] = 0
  with config.unlocked():
    config.phases = tuple(schedule)
  with pytest.raises(ValueError, match=r"^config\.phases\[1\] gives config\.batch_size = 0: "):
    launcher.check_config(config)
  schedule[1].update(batch_size=8, learning_rate=-1.0)
  with config.unlocked():
    config.phases = tuple(schedule)
  with pytest.raises(ValueError, match=r"^config\.phases\[1\] gives config\.learning_rate"):
    launcher.check_config(config)


SIZES = {"enwik8": ("base", "small", "large"), "text8": ("base", "small", "large")}
EVERY_CONFIG = [(task, size, kind) for task in sorted(tasks.TASKS)
                for size in SIZES.get(task, ("base", "small")) for kind in kinds.names()]


@pytest.mark.parametrize("task, size, kind", EVERY_CONFIG)
def test_every_shipped_config_passes(task, size, kind):
  config = configs.build_config(task, size=size, attention=kind)
  schema.check(config)
  launcher.check_config(config)  # and every phase of the staged ones


LAYER_ARGUMENTS = {"key_mask", "query_mask", "causal"}  # the layer passes these itself
ARRAY_ARGUMENTS = {"mask", "global_mask", "block_mask"}  # arrays for direct callers, no config


def supplied_by_extras(name: str) -> set[str]:
  """The primitive's keyword arguments that the kind's extras class hands it."""
  cls = attention_extras.extras_class(name)
  if cls is None:
    return set()
  args = kinds.defaults(name, window=4, max_length=16)
  if name == "synthesizer":  # every component, so every array it can supply
    args["components"] = "+".join(synthesizer.COMPONENTS)
  extras = cls(args, num_heads=2, head_dim=8, max_length=16, rngs=nnx.Rngs(0))
  return set(extras(length=16, rng=None))


@pytest.mark.parametrize("name", kinds.names())
def test_kind_arguments_match_the_primitive_and_its_extras(name):
  kind = kinds.get(name)
  params = inspect.signature(getattr(attention, kind.function)).parameters
  keywords = {p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
  consumed = set(attention_extras.consumed_args(name))
  expected = (keywords - LAYER_ARGUMENTS - ARRAY_ARGUMENTS - supplied_by_extras(name)) | consumed
  assert kind.arguments == tuple(sorted(expected))


def test_names_agree_with_the_trainer():
  assert schema.MESH_AXES == mesh.MESH_AXES
  config = configs.build_config("listops", size="small")
  for name in schema.SCHEDULES:
    with config.unlocked():
      config.schedule = name
    assert float(trainer.learning_rate_schedule(config)(10)) >= 0
  with config.unlocked():
    config.schedule = "linear"
  with pytest.raises(ValueError, match="unknown schedule"):
    trainer.learning_rate_schedule(config)


def test_the_data_choices_are_the_data_modules_own():
  from lra.data import pathfinder, text
  assert schema.PATHFINDER_DIFFICULTIES == tuple(pathfinder.DIFFICULTIES)
  assert schema.TEXT_VALIDATIONS == tuple(text.VALIDATION_CHOICES)
