"""The trainer's handling of adaptive span: the band window follows the learned spans, the
lowered window computes what the full one does, fixed spans stay fixed.

The model's layer is built with the window S + R, exact at every span. Before each step the
trainer reads the spans and hands the steps each layer's `span_window` (ceil(max z) + R rounded
up to a block) as a static argument, so the attention's cost follows the spans and a step is
compiled once per set of windows.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

import configs
from lra import mesh as mesh_lib, preflight, train
from models import attention_extras

def tiny(**changes):
  """enwik8 small with adaptive span at a size the tests train in seconds: length 64, S 64,
  R 8, blocks of 8 (so the windows move on a grid of 8), 2 layers of width 32."""
  o = {"phases": "()", "num_train_steps": "4", "data.max_length": "64",
       "data.eval_length": "64", "data.eval_context": "32", "batch_size": "8",
       "eval_batch_size": "8", "model.num_layers": "2", "model.emb_dim": "32",
       "model.qkv_dim": "32", "model.num_heads": "2", "model.mlp_dim": "64",
       "model.dropout": "0.0", "model.attention.max_span": "64", "model.attention.ramp": "8",
       "model.attention.block_size": "8", "model.attention.span_init": "10.0",
       "log_every": "1", "eval_every": "4", "checkpoint_every": "4", "progress": "false",
       "learning_rate": "0.05", "warmup_steps": "1", "schedule": "constant"}
  o.update({k: str(v) for k, v in changes.items()})
  return configs.build_config("enwik8", attention="adaptive_span", size="small",
                              overrides=list(o.items()))


def a_batch(trainer, config, seed=0):
  abstract = preflight.abstract_batch(trainer.task, config.data, int(config.batch_size),
                                      trainer.mesh, "train")
  rng = np.random.default_rng(seed)
  batch = {k: rng.integers(1, trainer.task.vocab_size, v.shape).astype(v.dtype)
           for k, v in abstract.items()}
  return mesh_lib.global_batch(batch, trainer.mesh)


def spans_of(trainer, params):
  return [np.asarray(x) for x in attention_extras.span_parameters(params,
                                                                  trainer.span_layers)]


def test_the_steps_get_each_layers_window_for_its_spans():
  config = tiny()
  trainer = train.Trainer(config)
  assert len(trainer.span_layers) == 2
  windows = trainer.step_options(trainer.state["params"])["windows"]
  # z = 10 in every head: ceil(10) + 8 = 18, rounded up to blocks of 8: 24 (S + R is 72).
  assert [w for _, w in windows] == [24, 24]
  assert [path for path, _ in windows] == list(trainer.span_layers)
  # Spans set by hand: each layer's own largest span decides its window.
  params = jax.tree.map(lambda x: x, trainer.state["params"])
  paths = list(trainer.span_layers)
  for path, p in zip(paths, ([0.0, 0.5], [0.05, 0.1])):     # z = 64 p
    node = params
    for key in path:
      node = node[key]
    node["span"].set_value(np.asarray(p, np.float32))
  windows = trainer.step_options(params)["windows"]
  assert [w for _, w in windows] == [-(-(32 + 8) // 8) * 8, -(-(7 + 8) // 8) * 8]   # 40, 16


def test_a_lowered_window_computes_the_full_windows_loss_and_a_too_small_one_does_not():
  config = tiny()
  trainer = train.Trainer(config)
  params, batch = trainer.state["params"], a_batch(trainer, config)
  paths = list(trainer.span_layers)
  follow = trainer.step_options(params)["windows"]
  full = tuple((p, 72) for p in paths)
  small = tuple((p, 8) for p in paths)                    # drops keys inside the ramp
  loss = {name: float(trainer.eval_step(params, batch, trainer.rest, windows=w)["loss_sum"])
          for name, w in (("follow", follow), ("full", full), ("small", small))}
  assert loss["follow"] == pytest.approx(loss["full"], rel=1e-5)
  assert abs(loss["small"] - loss["full"]) > 1e-3 * abs(loss["full"])


def test_training_follows_the_spans_and_reports_them(tmp_path):
  # A large L1 weight shrinks the spans from 10 towards 0 in a few steps: the windows go from
  # 24 to 16 or 8, each new set compiled once.
  config = tiny(**{"model.attention.penalty": "5.0", "num_train_steps": "6"})
  results = train.train_and_evaluate(config, str(tmp_path))
  assert results["span_window_sets"] >= 2
  params = results["state"]["params"]
  trainer = train.Trainer.abstract(config)
  for i, (path, m) in enumerate(trainer.span_layers.items()):
    z = 64 * np.clip(spans_of(trainer, params)[i], 0, 1)
    assert results[f"span_max_{i}"] == pytest.approx(float(z.max()), abs=1e-4)
    assert results[f"span_mean_{i}"] == pytest.approx(float(z.mean()), abs=1e-4)
    assert results[f"span_window_{i}"] == m.window_for(spans_of(trainer, params)[i])
    assert results[f"span_max_{i}"] < 10.0 - 1.0          # the spans did shrink
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  train_records = [r for r in records if r["split"] == "train"]
  assert len(train_records) == 6 and all("span_window_1" in r for r in train_records)
  assert train_records[0]["span_window_0"] == 24 > train_records[-1]["span_window_0"]
  # One trace of the train step per set of windows it ran with.
  assert results["train_step_traces"] <= results["span_window_sets"]


def test_fixed_spans_take_no_gradient_no_penalty_and_no_weight_decay():
  config = tiny(**{"model.attention.train_span": "false", "model.attention.span_init": "64.0",
                   "model.attention.penalty": "5.0", "weight_decay": "0.5"})
  trainer = train.Trainer(config)
  before = spans_of(trainer, trainer.state["params"])
  flags = [bool(x) for x in jax.tree.leaves(attention_extras.decayed(trainer.state["params"]))]
  assert flags.count(False) == 2 and flags.count(True) == len(flags) - 2   # the two layers
  other = flags.index(True)
  other_before = np.asarray(jax.tree.leaves(trainer.state["params"])[other]).copy()
  state = trainer.state
  for seed in range(2):
    options = trainer.step_options(state["params"])
    state, _ = trainer.train_step(state, a_batch(trainer, config, seed), trainer.rest,
                                  **options)
  after = spans_of(trainer, state["params"])
  for b, a in zip(before, after):
    np.testing.assert_array_equal(a, b)                    # still exactly 1 (z = S)
    np.testing.assert_array_equal(a, np.ones_like(a))
  assert not np.array_equal(np.asarray(jax.tree.leaves(state["params"])[other]), other_before)

