"""Self-pretraining (lra/tasks/pretraining.py, models/pretraining.py, attention/masks.py): MPNet's
two-stream masks against the paper's Figure 2, no target visible to its own prediction under
any objective, one-line refusals, and `protocol=spt` running pretraining then fine-tuning."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import configs
import task_helpers
from attention import masks
from lra import schema
from lra import phases, tasks, train
from lra.tasks.pretraining import bert_corruption, permutation

jax.config.update("jax_disable_most_optimizations", True)


def _grid(rows):
  return np.array([[c == "1" for c in row.replace(" ", "")] for row in rows])


# MPNet Figure 2: x1..x6 permuted to (x1, x3, x5, x4, x6, x2), the last three predicted. Content
# stream (x1, x3, x5, [M]p4, [M]p6, [M]p2, x4, x6, x2); 1 = the row attends the column.
FIGURE2_CONTENT = _grid([
    # x1x3x5 M4M6M2 x4x6x2
    "111 111 000",   # x1
    "111 111 000",   # x3
    "111 111 000",   # x5
    "111 111 000",   # [M] p4
    "111 111 000",   # [M] p6
    "111 111 000",   # [M] p2
    "111 011 100",   # x4: [M] p6, p2 and itself: all six positions, x4 known
    "111 001 110",   # x6: x4, x6 and [M] p2
    "111 000 111",   # x2: every real token
])
FIGURE2_QUERY = _grid([
    "111 111 000",   # predicts x4 at p4: the known tokens and every mask token
    "111 011 100",   # predicts x6 at p6: x4 now known, not its own content
    "111 001 110",   # predicts x2 at p2: x4, x6, [M] p2
])


def test_mpnet_masks_are_figure_2():
  content, query = masks.mpnet_masks(6, 3)
  np.testing.assert_array_equal(content, FIGURE2_CONTENT)
  np.testing.assert_array_equal(query, FIGURE2_QUERY)


def test_position_layout_is_the_permuted_one():
  # The same example laid out by position (what the model uses): tokens 0..5 are x1..x6,
  # slots 6..11 their mask tokens; gathering the permuted order gives Figure 2 again.
  ranks = np.array([[0, 5, 1, 3, 2, 4]])               # x1 x3 x5 x4 x6 x2 in that order
  predicted = ranks >= 3
  content, query = masks.mpnet_position_masks(ranks, predicted, np.ones_like(predicted))
  order = [0, 2, 4, 6 + 3, 6 + 5, 6 + 1, 3, 5, 1]
  np.testing.assert_array_equal(np.asarray(content)[0][np.ix_(order, order)], FIGURE2_CONTENT)
  np.testing.assert_array_equal(np.asarray(query)[0][np.ix_([3, 5, 1], order)], FIGURE2_QUERY)
  unused = [6 + 0, 6 + 2, 6 + 4]                      # mask slots of unpredicted positions
  assert not np.asarray(content)[0][unused].any() and not np.asarray(content)[0][:, unused].any()


def tiny_config(tmp_path, **overrides):
  c = configs.build_config("listops", size="small")
  c.data.data_dir = str(tmp_path / "data")
  c.data.num_train, c.data.num_val, c.data.num_test = 32, 16, 16
  c.data.max_length, c.data.gen_min_length, c.data.gen_max_length = 16, 4, 17
  c.model.emb_dim, c.model.qkv_dim, c.model.mlp_dim, c.model.classifier_dim = 16, 16, 16, 16
  c.model.num_heads, c.model.num_layers = 2, 2
  c.batch_size, c.eval_batch_size = 16, 16
  c.num_train_steps, c.warmup_steps = 4, 1
  c.log_every, c.eval_every, c.checkpoint_every = 1, 100, 100
  c.progress = False
  return task_helpers.override(c, overrides)


def _changed(a, b):
  return not np.allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("objective,attention,pool", [
    ("mlm", "dot_product", "mean"), ("clm", "dot_product", "cls"),
    ("mpnet", "dot_product", "cls"), ("mpnet", "band", "mean"), ("mpnet", "sparse", "mean")])
def test_no_target_is_visible_to_its_own_prediction(tmp_path, objective, attention, pool):
  c = tiny_config(tmp_path, **{"model.pool": pool, "model.mask_rate": 0.4})
  c.model.attention = {"kind": attention, "band": {"window": 3},
                       "sparse": {"pattern": "strided", "stride": 3}}.get(
                           attention, {"kind": attention}) | {"kind": attention}
  task = tasks.get_task(f"listops+{objective}")
  model = task.build_model(train.model_config(c, task), nnx.Rngs(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, task.vocab_size, (2, 16)).astype(np.int32)
  tokens[1, 11:] = 0                                   # padding
  key = jax.random.PRNGKey(3)
  run = jax.jit(lambda t: task.logits_and_targets(model, t, key, None))
  logits, _, scored = (np.asarray(x) for x in run(tokens))
  shift = 1 if objective == "clm" else 0               # clm's logit t predicts token t + 1
  kept = np.zeros_like(scored)
  if objective == "mlm":                               # BERT's 10% unchanged see themselves
    inputs, shown, chosen = (np.asarray(x) for x in bert_corruption(tokens, 0.4, task.vocab_size,
                                                                    key))
    kept = chosen & ~shown & (inputs == tokens)
  checked = 0
  for b, t in zip(*np.nonzero(scored)):
    perturbed = tokens.copy()
    perturbed[b, t + shift] = tokens[b, t + shift] % (task.vocab_size - 1) + 1
    after = np.asarray(run(perturbed)[0])
    if kept[b, t]:
      assert _changed(after[b, t], logits[b, t])      # shown unchanged: visible, as in BERT
      continue
    np.testing.assert_allclose(after[b, t], logits[b, t], atol=1e-5,
                               err_msg=f"target ({b}, {t + shift}) reaches its own logit")
    checked += 1
  assert checked >= 4
  # The test can fail: a token that is no target (the first, in clm) does reach the logits.
  other = 0 if objective == "clm" else int(np.nonzero(~scored[0])[0][0])
  perturbed = tokens.copy()
  perturbed[0, other] = tokens[0, other] % (task.vocab_size - 1) + 1
  assert _changed(np.asarray(run(perturbed)[0])[scored], logits[scored])


def test_mpnet_predicts_the_end_of_each_permutation():
  tokens = np.array([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 0, 0]] * 3, np.int32)
  ranks, predicted = (np.asarray(x) for x in permutation(tokens, 0.3, jax.random.PRNGKey(1)))
  for r, p in zip(ranks, predicted):
    assert sorted(r[:10]) == list(range(10)) and p.sum() == 3 and not p[10:].any()
    assert set(r[p]) == {7, 8, 9}
  assert len({tuple(r[:10]) for r in ranks}) == 3       # one permutation per example


@pytest.mark.parametrize("overrides,needle", [
    ([("protocol", "pretrain")], "config.protocol = 'pretrain': must be one of scratch, spt"),
    ([("protocol", "spt"), ("pretrain.objective", "mpnet")], None),
    ([("protocol", "spt"), ("pretrain.objective", "xlnet")], "config.pretrain.objective"),
])
def test_protocol_values(overrides, needle):
  if needle is None:
    c = configs.build_config("listops", size="small", overrides=overrides)
    assert [p["task"] for p in c.phases] == ["listops+mpnet", "listops"]
    assert sum(p["steps"] for p in c.phases) == c.num_train_steps
    return
  with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
    configs.build_config("listops", size="small", overrides=overrides)


def test_mpnet_refuses_linformer_and_a_bad_mask_rate():
  with pytest.raises(ValueError, match="'linformer'.*cannot be composed"):
    configs.build_config("listops", size="small", attention="linformer",
                         overrides=[("protocol", "spt"), ("pretrain.objective", "mpnet")])
  c = configs.build_config("listops", size="small", overrides=[("model.mask_rate", "1.2")])
  with pytest.raises(ValueError, match=r"config.model.mask_rate = 1.2: must be a number in"):
    schema.check(c)


def test_cli_refuses_in_one_line():
  out = subprocess.run([sys.executable, "-m", "launch.cli", "run", "listops", "--size", "small",
                        "--attention", "linformer", "--config.protocol=spt",
                        "--config.pretrain.objective=mpnet"],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 2, out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "linformer" in lines[0] and "permutation" in lines[0], out.stderr


def _most_frequent_share(values):
  counts = np.bincount(np.asarray(values, np.int64))
  return counts.max() / counts.sum()


@pytest.mark.slow
def test_spt_pretrains_then_fine_tunes_in_one_workdir(tmp_path, capsys):
  c = tiny_config(tmp_path, protocol="spt", learning_rate=0.0, weight_decay=0.0,
                  **{"pretrain.learning_rate": 0.01, "pretrain.objective": "mpnet"})
  c = configs.common.apply_protocol(c)
  workdir = str(tmp_path / "run")
  results = phases.run(c, workdir)
  assert len(results["phases"]) == 2 and np.isfinite(results["test_accuracy"])
  assert phases.results_path(workdir, results).endswith("phase2/results.json")
  # Each phase's chance reference, counted here from the test split itself: the most frequent
  # real token for pretraining (printed when the phase ends), the majority class after it.
  test = tasks.get_task("listops").get_source(c.data, "test")
  examples = [test[i] for i in range(len(test))]
  tokens = np.concatenate([np.asarray(e["inputs"]).reshape(-1) for e in examples])
  pretrained = results["phases"][0]
  assert pretrained["most_frequent_token_rate"] == pytest.approx(
      _most_frequent_share(tokens[tokens > 0]))
  assert "majority_class_rate" not in pretrained
  assert results["majority_class_rate"] == pytest.approx(
      _most_frequent_share([int(e["targets"]) for e in examples]))
  printed = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("Phase 1/2: mpnet pretraining")]
  assert len(printed) == 1 and "(most frequent token " in printed[0], printed
  assert f"{pretrained['most_frequent_token_rate']:.4f}" in printed[0]
  # Fine-tuning at learning rate 0 keeps what it loaded: the encoder pretraining trained, and
  # the head as a fresh model initialises it (pretraining never reaches the head).
  task = tasks.get_task("listops")
  fresh = nnx.state(task.build_model(train.model_config(c, task), nnx.Rngs(int(c.seed))),
                    nnx.Param)
  params = results["state"]["params"]
  for name in ("head", "hidden"):
    for a, b in zip(jax.tree.leaves(params[name]), jax.tree.leaves(fresh[name])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  moved = [_changed(a, b) for a, b in zip(jax.tree.leaves(params["encoder"]),
                                          jax.tree.leaves(fresh["encoder"]))]
  assert any(moved)
