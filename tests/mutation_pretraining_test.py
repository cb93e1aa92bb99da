"""Tests written to kill the surviving mutants of lra/tasks/pretraining.py (benchmarks/mutation.py,
docs/testing.md): which objective checks which kinds, the default mask rate, example weights in
the objective (a filler example contributes nothing: the sums equal those of the real examples
alone), the tokens the chance reference counts, and the best-checkpoint rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from lra import tasks, train
from lra.tasks.pretraining import BERT_SPLIT, bert_corruption, permutation

jax.config.update("jax_disable_most_optimizations", True)


def _model(objective, **model):
  c = configs.build_config("listops", size="small")
  c.model.emb_dim, c.model.qkv_dim, c.model.mlp_dim, c.model.classifier_dim = 16, 16, 16, 16
  c.model.num_heads, c.model.num_layers = 2, 1
  c.data.max_length = 12
  for key, value in model.items():
    c.model[key] = value
  task = tasks.get_task(f"listops+{objective}")
  return task, task.build_model(train.model_config(c, task), nnx.Rngs(0))


def test_only_mpnet_checks_the_permutation_and_only_clm_causality():
  mlm, mpnet, clm = (tasks.get_task(f"listops+{o}") for o in ("mlm", "mpnet", "clm"))
  mlm.check_layers(["linformer", "dot_product"])           # masked LM: any kind
  with pytest.raises(ValueError, match="'linformer'.*permutation"):
    mpnet.check_layers(["dot_product", "linformer"])
  mpnet.check_layers(["dot_product", "band"])
  with pytest.raises(ValueError, match="linformer"):
    clm.check_layers(["linformer"])
  clm.check_layers(["dot_product"])


def test_mask_rate_defaults_to_bert_s_fifteen_percent():
  c = configs.build_config("listops", size="small")
  task = tasks.get_task("listops+mlm")
  cfg = dict(train.model_config(c, task))
  cfg.pop("mask_rate", None)
  model = task.build_model(cfg, nnx.Rngs(0))
  assert model.pretraining[1] == 0.15


@pytest.mark.slow   # runs in the mutation runs (benchmarks/mutation.py) and CI
@pytest.mark.parametrize("objective", ["mlm"])   # the weighting is shared by every objective
def test_filler_examples_contribute_nothing(objective):
  """The sums over a batch whose second example has weight 0 equal the sums over the first
  example alone (the same draw of masks: the first row's key is the same)."""
  task, model = _model(objective, mask_rate=0.3)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, task.vocab_size, (2, 12)).astype(np.int32)
  tokens[0, 10:] = 0
  both = task.objective(model, {"inputs": tokens, "weights": np.array([1.0, 0.0], np.float32)},
                        None)
  alone = task.objective(model, {"inputs": tokens[:1], "weights": np.ones(1, np.float32)}, None)
  for name in ("loss_sum", "correct", "weight"):
    np.testing.assert_allclose(np.asarray(both[name]), np.asarray(alone[name]), rtol=1e-5,
                               atol=1e-5, err_msg=name)
  assert float(both["weight"]) > 0
  half = task.objective(model, {"inputs": tokens[:1], "weights": np.full(1, 0.5, np.float32)},
                        None)
  np.testing.assert_allclose(np.asarray(half["weight"]), 0.5 * np.asarray(alone["weight"]))


def test_chance_ids_are_the_real_tokens_of_the_real_examples():
  task = tasks.get_task("listops+mlm")
  batch = {"inputs": np.array([[1, 4, 0], [5, 6, 7], [8, 0, 0]]),
           "weights": np.array([1.0, 0.0, 1.0])}
  assert sorted(task.chance_ids(batch).tolist()) == [1, 4, 8]


def test_lower_loss_is_better_and_a_tie_is_not():
  task = tasks.get_task("listops+mlm")
  assert task.better({"loss": 1.0}, {})
  assert task.better({"loss": 1.0}, {"loss": 2.0})
  assert not task.better({"loss": 2.0}, {"loss": 1.0})
  assert not task.better({"loss": 1.0}, {"loss": 1.0})


def test_bert_split_is_eighty_ten_ten_and_tokens_are_never_padding():
  assert BERT_SPLIT == (0.8, 0.1)
  vocab = 3                                            # random tokens can only be 1 or 2
  tokens = jnp.full((64, 64), 2, jnp.int32)            # so a 1 can only be a random token
  inputs, shown, chosen = bert_corruption(tokens, 1.0, vocab, jax.random.key(0))
  inputs, shown, chosen = (np.asarray(a) for a in (inputs, shown, chosen))
  assert chosen.all()
  changed = inputs[~shown]
  assert set(np.unique(changed)) == {1, 2}             # 1 drawn, never 0 or vocab
  assert (inputs[shown] == 2).all()                    # [MASK] positions keep their token
  zero_rate = bert_corruption(tokens, 0.0, vocab, jax.random.key(0))[2]
  assert not np.asarray(zero_rate).any()


def test_token_id_one_is_chosen_like_any_real_token():
  """Only padding (id 0) is never chosen: a sequence of token 1 is chosen at the rate."""
  tokens = jnp.ones((8, 64), jnp.int32)
  chosen = np.asarray(bert_corruption(tokens, 1.0, 5, jax.random.key(3))[2])
  assert chosen.all()
  padded = tokens.at[:, 32:].set(0)
  chosen = np.asarray(bert_corruption(padded, 1.0, 5, jax.random.key(3))[2])
  assert chosen[:, :32].all() and not chosen[:, 32:].any()


def test_permutation_of_one_token_and_of_padding_only():
  tokens = jnp.array([[7, 0, 0], [0, 0, 0]], jnp.int32)
  ranks, predicted = (np.asarray(a) for a in permutation(tokens, 0.15, jax.random.key(2)))
  assert ranks[0, 0] == 0 and predicted[0].tolist() == [True, False, False]
  assert not predicted[1].any()
  assert sorted(ranks[1].tolist()) == [0, 1, 2]


@pytest.mark.slow   # runs in the mutation runs (benchmarks/mutation.py) and CI
def test_two_fields_add_up():
  """A two-input task (retrieval) scores both fields: the weight is the number of chosen tokens
  of the first field plus that of the second, each drawn from the evaluation key folded with
  the field's index."""
  from lra.tasks.pretraining import EVAL_KEY
  c = configs.build_config("retrieval", size="small")
  c.model.emb_dim, c.model.qkv_dim, c.model.mlp_dim, c.model.classifier_dim = 16, 16, 16, 16
  c.model.num_heads, c.model.num_layers, c.data.max_length = 2, 1, 12
  c.model.mask_rate = 0.4
  task = tasks.get_task("retrieval+mlm")
  assert task.inputs == ("inputs1", "inputs2")
  model = task.build_model(train.model_config(c, task), nnx.Rngs(0))
  rng = np.random.default_rng(1)
  batch = {f: rng.integers(1, task.vocab_size, (2, 12)).astype(np.int32) for f in task.inputs}
  total = task.objective(model, batch, None)
  key = jax.random.PRNGKey(EVAL_KEY)
  want = sum(int(np.asarray(bert_corruption(batch[f], 0.4, task.vocab_size,
                                            jax.random.fold_in(key, i))[2]).sum())
             for i, f in enumerate(task.inputs))
  assert float(total["weight"]) == want


@pytest.mark.slow   # runs in the mutation runs (benchmarks/mutation.py) and CI
def test_one_attention_spec_per_attention_sublayer_of_a_reordered_stack():
  """MPNet's masks are built per attention sublayer: with sublayers "ssssff" (4 attention
  sublayers in 3 layers' worth) the model carries 4 specs, the fourth with its own window."""
  c = configs.build_config("listops", size="small")
  c.model.emb_dim, c.model.qkv_dim, c.model.mlp_dim, c.model.classifier_dim = 16, 16, 16, 16
  c.model.num_heads, c.model.num_layers, c.model.sublayers = 2, 3, "ssssff"
  c.model.attention = {"kind": "band", "window": 2}
  c.model.layer_attention = ({}, {}, {}, {"window": 5})
  task = tasks.get_task("listops+mpnet")
  model = task.build_model(train.model_config(c, task), nnx.Rngs(0))
  specs = [dict(s) for s in model.pretraining[2]]
  assert [s["window"] for s in specs] == [2, 2, 2, 5]


def test_result_line_names_the_chance_reference_only_when_known():
  task = tasks.get_task("listops+mlm")
  line = task.result_line({"test_accuracy": 0.5, "test_loss": 1.25}, "w")
  assert line == ("mlm pretraining: test accuracy on the predicted tokens 0.5000, loss 1.2500; "
                  "results in w")
  line = task.result_line({"test_accuracy": 0.5, "test_loss": 1.25,
                           "most_frequent_token_rate": 0.125}, "w")
  assert "0.5000 (most frequent token 0.1250), loss 1.2500" in line


def test_clm_predicts_the_next_token():
  task, model = _model("clm")
  tokens = np.array([[3, 1, 5, 6, 0, 0], [7, 8, 9, 10, 1, 12]], np.int32)
  logits, targets, scored = task.logits_and_targets(model, tokens, jax.random.key(0), None)
  assert logits.shape[:2] == (2, 5)
  np.testing.assert_array_equal(np.asarray(targets), tokens[:, 1:])
  np.testing.assert_array_equal(np.asarray(scored), tokens[:, 1:] > 0)
