"""Tests for lra/schema.py: bad config values end `lra run` at once in one line.

Every bad value goes through the real command (`launch.cli.main`), which must return 2 and print
exactly one `error: ` line naming the field and its value, before anything heavy is imported (a
few runs in a fresh interpreter check the wall time and that jax stays unloaded). Every shipped
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

# (arguments after `lra run`, text the one error line must contain)
BAD = [
    (["listops", "--config.log_every=0"], "config.log_every = 0"),
    (["listops", "--config.eval_every=0"], "config.eval_every = 0"),
    (["listops", "--config.checkpoint_every=0"], "config.checkpoint_every = 0"),
    (["listops", "--config.keep_checkpoints=0"], "config.keep_checkpoints = 0"),
    (["listops", "--config.model.num_heads=0"], "config.model.num_heads = 0"),
    (["listops", "--config.seed=-1"], "config.seed = -1"),
    (["listops", "--config.batch_size=0"], "config.batch_size = 0"),
    (["listops", "--config.eval_batch_size=0"], "config.eval_batch_size = 0"),
    (["listops", "--config.num_train_steps=-5"], "config.num_train_steps = -5"),
    (["listops", "--config.learning_rate=-0.1"], "config.learning_rate = -0.1"),
    (["listops", "--config.learning_rate=1e999"], "config.learning_rate = inf"),
    (["listops", "--config.warmup_steps=-1"], "config.warmup_steps = -1"),
    (["listops", "--config.weight_decay=-1"], "config.weight_decay = -1.0"),
    (["listops", "--config.grad_clip=-1"], "config.grad_clip = -1.0"),
    (["listops", "--config.adam_b1=1"], "config.adam_b1 = 1.0"),
    (["listops", "--config.adam_b2=-0.5"], "config.adam_b2 = -0.5"),
    (["listops", "--config.adam_eps=0"], "config.adam_eps = 0.0"),
    (["listops", "--config.schedule=linear"], "config.schedule = 'linear'"),
    (["listops", "--config.model.num_layers=0"], "config.model.num_layers = 0"),
    (["listops", "--config.model.emb_dim=0"], "config.model.emb_dim = 0"),
    (["listops", "--config.model.mlp_dim=-1"], "config.model.mlp_dim = -1"),
    (["listops", "--config.model.classifier_dim=0"], "config.model.classifier_dim = 0"),
    (["listops", "--config.model.num_heads=3", "--config.model.qkv_dim=64"],
     "config.model.qkv_dim = 64"),
    (["listops", "--config.model.dropout=1"], "config.model.dropout = 1.0"),
    (["listops", "--config.model.pos_emb=bogus"], "config.model.pos_emb = 'bogus': must be one "
     "of sinusoidal, learned, none, rotary, infused, relative"),
    (["listops", "--attention", "favor", "--config.model.pos_emb=relative"],
     "config.model.pos_emb = 'relative': attention 'favor' has no relative positions; valid "
     "kinds: band, dot_product"),
    (["listops", "--config.model.sublayers=sfx"], "config.model.sublayers = 'sfx': must be a "
     "string of 's' (self-attention) and 'f' (feed-forward) only"),
    (["listops", "--config.model.sandwich=9"], "config.model.sandwich = 9: must be an integer in"),
    (["listops", "--config.model.rotary_base=0"], "config.model.rotary_base = 0.0"),
    (["listops", "--config.model.pool=max"], "config.model.pool = 'max'"),
    (["listops", "--config.data.max_length=0"], "config.data.max_length = 0"),
    (["listops", "--config.mesh.fsdp=0"], "config.mesh.fsdp = 0"),
    (["listops", "--attention", "band", "--config.model.attention.window=-3"],
     "config.model.attention.window = -3"),
    (["listops", "--attention", "band", "--config.model.attention.windw=8"],
     "config.model.attention.windw = 8: band takes no argument 'windw'; valid: block_size, "
     "dilation, max_global, window."),
    (["listops", "--config.model.attention.window=8"],
     "config.model.attention.window = 8: dot_product takes no arguments"),
    (["listops", "--config.model.attention.kind=flashy"],
     "config.model.attention.kind = 'flashy'"),
    (["listops", "--config.model.layer_attention=({'window': 4},)"],
     "config.model.layer_attention has 1 entry"),
    (["listops", "--size", "small", "--attention", "band",
      "--config.model.layer_attention=({}, {'kind': 'lsh', 'window': 4})"],
     "config.model.layer_attention[1].window = 4: lsh takes no argument 'window'"),
    (["enwik8", "--size", "small", "--config.model.layer_attention="
      "({'window': 8}, {'window': -2}, {}, {})"],
     "config.model.layer_attention[1].window = -2"),
    (["listops", "--config.seed", "--size", "small"],
     "--config.seed needs a value: --config.seed=VALUE."),
    (["enwik8", "--size", "small", "--config.model.same_length=true"],
     "config.model.same_length = True: needs config.model.memory_length > 0"),
    (["listops", "--attention", "band", "--config.model.attention.implementation=cuda"],
     "config.model.attention.implementation = 'cuda': must be one of auto, xla, tokamax"),
    (["listops", "--attention", "linear", "--config.model.attention.implementation=splash"],
     "attention 'linear' has no splash implementation (it has xla)"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_value_is_one_line_and_exit_2(args, message, capsys, tmp_path):
  start = time.perf_counter()
  assert cli.main(["run", *args, "--workdir", str(tmp_path / "w")]) == 2
  assert time.perf_counter() - start < 1.0
  out, err = capsys.readouterr()
  assert out == ""
  assert err.startswith("error: ") and err.count("\n") == 1, err
  assert message in err
  assert not (tmp_path / "w").exists()


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
