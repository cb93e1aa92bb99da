"""Tests for lra/train.py on tiny generated ListOps: every attention kind trains two steps with
one trace of the step; a Ctrl-C'd and resumed run ends with exactly the parameters of an
uninterrupted one; a (4, 2) data x tensor mesh gives the losses of one device; results.json
counts the parameters, and a plan passed to the run (or a phase) is the one it uses."""

import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

import attention
import task_helpers
from configs import common, listops as listops_config
from lra import loop, metrics, phases, tasks, train

jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("listops_data"))


ONE_DEVICE = {"data": 1, "fsdp": 1, "tensor": 1}
ALL_DEVICES = {"data": -1, "fsdp": 1, "tensor": 1}   # the default: data parallel over all 8


def tiny_config(data_dir, kind="dot_product", **overrides):
  """A two-step run on one device (tiny programs to compile and save); the resumed run and the
  mesh test train on several."""
  c = listops_config.get_config(f"size=small,attention={kind}")
  c.data.data_dir = data_dir
  c.data.num_train, c.data.num_val, c.data.num_test = 64, 16, 16
  c.data.max_length, c.data.gen_min_length, c.data.gen_max_length = 24, 4, 25
  c.model.emb_dim, c.model.qkv_dim, c.model.mlp_dim, c.model.classifier_dim = 16, 16, 32, 16
  c.model.num_heads, c.model.num_layers = 2, 1
  c.model.attention = dict(kind=kind, **common.attention_defaults(kind, window=4, max_length=25))
  if kind == "favor":
    c.model.attention["num_features"] = 8
  if kind == "linformer":
    c.model.attention["k"] = 8
  c.batch_size, c.eval_batch_size = 16, 16
  c.num_train_steps, c.warmup_steps = 2, 1
  c.log_every, c.eval_every, c.checkpoint_every = 1, 100, 100  # final eval and save only
  c.progress = False
  c.mesh = ONE_DEVICE
  return task_helpers.override(c, overrides)


def train_losses(workdir):
  return [(r["step"], r["loss"]) for r in metrics.read_metrics(workdir) if r["split"] == "train"]


@pytest.fixture(scope="module")
def finished_run(data_dir, tmp_path_factory):
  """One finished run of `tiny_config(data_dir)` (dot_product, two steps): its workdir and
  results. Tests that go on from a finished run train in a copy of its workdir."""
  workdir = str(tmp_path_factory.mktemp("finished") / "run")
  return workdir, train.train_and_evaluate(tiny_config(data_dir), workdir)


def copy_of(finished_run, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(finished_run[0], workdir)
  return workdir


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(attention.REGISTRY))
def test_two_steps_with_every_attention_kind(kind, data_dir, tmp_path, request):
  if kind == "dot_product":   # the same config as the shared run's
    workdir, results = request.getfixturevalue("finished_run")
  else:
    workdir = str(tmp_path / kind)
    results = train.train_and_evaluate(tiny_config(data_dir, kind), workdir)
  assert results["train_step_traces"] == 1
  assert results["test_examples"] == 16
  assert 0.0 <= results["test_accuracy"] <= 1.0 and np.isfinite(results["test_loss"])
  losses = train_losses(workdir)
  assert [s for s, _ in losses] == [1, 2] and all(np.isfinite(l) for _, l in losses)
  for name in ("config.json", "results.json", "metrics.jsonl"):
    assert os.path.exists(os.path.join(workdir, name)), name
  params = jax.tree.leaves(results["state"]["params"])
  assert int(results["state"]["step"]) == 2 and all(np.isfinite(p).all() for p in params)


@pytest.mark.slow
def test_interrupted_and_resumed_run_equals_an_uninterrupted_run(data_dir, tmp_path):
  config = tiny_config(data_dir, num_train_steps=6, checkpoint_every=2, eval_every=100,
                       mesh=ALL_DEVICES, **{"model.dropout": 0.1})
  straight = train.train_and_evaluate(config, str(tmp_path / "straight"))

  resumed_dir = str(tmp_path / "resumed")

  def ctrl_c_at_step_3(step):
    if step == 3:
      os.kill(os.getpid(), signal.SIGINT)

  first = train.train_and_evaluate(config, resumed_dir, hooks=[ctrl_c_at_step_3])
  assert first["interrupted"] and first["step"] == 3
  assert os.path.isdir(os.path.join(resumed_dir, "checkpoints", "3"))
  assert not os.path.exists(os.path.join(resumed_dir, "results.json"))
  second = train.train_and_evaluate(config, resumed_dir)
  assert not second["interrupted"] and second["train_step_traces"] == 1

  for a, b in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(second["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert train_losses(resumed_dir) == train_losses(str(tmp_path / "straight"))
  assert second["test_accuracy"] == straight["test_accuracy"]


@pytest.mark.slow
def test_data_by_tensor_mesh_matches_one_device(data_dir, finished_run, tmp_path):
  """The shared run (one device) against the same config on a (4, 2) data x tensor mesh."""
  assert tiny_config(data_dir).mesh.data == 1
  config = tiny_config(data_dir, mesh={"data": 4, "fsdp": 1, "tensor": 2})
  r_sharded = train.train_and_evaluate(config, str(tmp_path / "mesh"))
  one, r_one = train_losses(finished_run[0]), finished_run[1]
  sharded = train_losses(str(tmp_path / "mesh"))
  assert [s for s, _ in one] == [s for s, _ in sharded] == [1, 2]
  np.testing.assert_allclose([l for _, l in one], [l for _, l in sharded], rtol=1e-5)
  np.testing.assert_allclose(r_one["test_loss"], r_sharded["test_loss"], rtol=1e-5)
  query = [x for x in jax.tree.leaves(r_sharded["state"]["params"]) if x.ndim == 3][0]
  assert "tensor" in str(query.sharding.spec)


@pytest.mark.slow
def test_rerun_of_a_finished_run_does_not_train_again(data_dir, finished_run, tmp_path):
  config = tiny_config(data_dir)
  first = finished_run[1]
  workdir = copy_of(finished_run, tmp_path)
  stored = (workdir / "results.json").read_bytes()
  steps = []
  again = train.train_and_evaluate(config, str(workdir), hooks=[steps.append])
  assert steps == []   # no training step ran
  assert [step for step, _ in train_losses(str(workdir))] == [1, 2]
  assert (workdir / "results.json").read_bytes() == stored
  assert not again["interrupted"]
  assert {k: v for k, v in again.items() if k not in ("state", "interrupted")} == \
      {k: v for k, v in first.items() if k not in ("state", "interrupted")}


@pytest.mark.slow
def test_a_refused_rerun_with_fewer_steps_leaves_config_json_as_it_was(data_dir, finished_run,
                                                                       tmp_path):
  """The trainer's own F0 refusal (checkpoints past num_train_steps) comes before config.json
  is written: the finished run's config stays, and no config.previous.json appears."""
  assert tiny_config(data_dir).num_train_steps == 2    # the finished run's
  workdir = copy_of(finished_run, tmp_path)
  saved = (workdir / "config.json").read_bytes()
  fewer = tiny_config(data_dir, num_train_steps=1)
  with pytest.raises(ValueError, match="past num_train_steps 1"):
    train.train_and_evaluate(fewer, str(workdir))
  assert (workdir / "config.json").read_bytes() == saved
  assert not (workdir / "config.previous.json").exists()


@pytest.mark.slow
def test_each_phase_counts_its_parameters_and_takes_its_plan(data_dir, tmp_path):
  config = tiny_config(data_dir)
  phase = dict(steps=1, max_length=24, window_scale=1.0, learning_rate=1e-3, batch_size=16,
               warmup_steps=1)
  with config.unlocked():
    config.phases = (phase, {**phase, "steps": 2})
  plan = train.Trainer.abstract(phases.phase_config(config, 0))   # phase 1's only
  results = phases.run(config, str(tmp_path), plans=[plan])
  count = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(results["state"]["params"]))
  assert count > 0 and results["param_count"] == count
  for k in (1, 2):
    with open(tmp_path / f"phase{k}" / "results.json") as f:
      assert json.load(f)["param_count"] == count
  assert plan.traces == 1                    # phase 1 traced the plan's step, once
  assert not hasattr(plan, "state")          # ... on a trainer of its own: the plan stays abstract
  assert results["train_step_traces"] == 1   # phase 2 planned (and traced) its own


def test_a_plan_for_other_steps_is_refused(data_dir):
  plan = train.Trainer.abstract(tiny_config(data_dir))
  with pytest.raises(ValueError, match="other steps"):
    train.Trainer(tiny_config(data_dir, batch_size=32), plan)


def test_periodic_actions_follow_their_period_and_the_last_step_rule():
  due = lambda periodic: [s for s in range(1, 11) if periodic.due(s, 10)]   # noqa: E731
  act = lambda step: None   # noqa: E731
  assert due(loop.Periodic(4, act)) == [4, 8]
  assert due(loop.Periodic(4, act, last=True)) == [4, 8, 10]
  assert due(loop.Periodic(5, act, last=False)) == [5]
  assert due(loop.Periodic(0, act)) == []


def test_language_model_config_refuses_non_causal_kinds():
  lm_task = tasks.get_task("enwik8")
  config = listops_config.get_config("size=small,attention=dot_product")
  config.model.attention = {"kind": "linformer", "k": 8}
  if "linformer" not in attention.REGISTRY:
    pytest.skip("linformer not registered")
  with pytest.raises(ValueError, match="cannot be causal"):
    train.check_layers(config, lm_task)


def test_schedules():
  c = listops_config.get_config("size=base")
  lr = train.learning_rate_schedule(c)
  np.testing.assert_allclose(float(lr(1000)), 0.05 / np.sqrt(1000), rtol=1e-6)
  np.testing.assert_allclose(float(lr(4000)), 0.05 / np.sqrt(4000), rtol=1e-6)
  np.testing.assert_allclose(float(lr(500)), 0.05 * 0.5 / np.sqrt(1000), rtol=1e-6)
  c.schedule, c.learning_rate, c.warmup_steps, c.num_train_steps = "cosine", 1e-3, 10, 110
  lr = train.learning_rate_schedule(c)
  np.testing.assert_allclose([float(lr(10)), float(lr(60)), float(lr(110))],
                             [1e-3, 5e-4, 0.0], atol=1e-9)
  c.schedule = "linear_cycle"
  with pytest.raises(ValueError, match="rsqrt, cosine, constant"):
    train.learning_rate_schedule(c)
