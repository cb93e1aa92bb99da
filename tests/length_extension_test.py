"""Length extension (Longformer's recipe): a run at length L initialised from a run at L0 < L by
`config.init_from` + `config.init_length` tiles the learned position table and evaluates at L."""

import jax
import numpy as np
import pytest

import task_helpers
from configs import listops as listops_config
from lra import train
from models import embeddings

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

jax.config.update("jax_disable_most_optimizations", True)


def tiny(data_dir, length, **overrides):
  c = listops_config.get_config("size=small,attention=dot_product")
  c.data.data_dir = data_dir
  c.data.num_train, c.data.num_val, c.data.num_test = 32, 16, 16
  c.data.max_length, c.data.gen_min_length, c.data.gen_max_length = length, 4, length + 1
  c.model.emb_dim, c.model.qkv_dim, c.model.mlp_dim, c.model.classifier_dim = 16, 16, 16, 16
  c.model.num_heads, c.model.num_layers, c.model.pos_emb = 2, 1, "learned"
  c.batch_size, c.eval_batch_size = 16, 16
  c.num_train_steps, c.warmup_steps = 1, 1
  c.log_every, c.eval_every, c.checkpoint_every = 1, 100, 100
  c.progress = False
  return task_helpers.override(c, overrides)


def _tables(params):
  found = []
  embeddings.map_position_tables(params, lambda t: found.append(np.asarray(t)) or t)
  return found


def test_extend_table_tiles_rows():
  table = np.arange(6, dtype=np.float32).reshape(3, 2)
  np.testing.assert_array_equal(embeddings.extend_table(table, 7),
                                table[[0, 1, 2, 0, 1, 2, 0]])


def test_length_extended_model_loads_and_evaluates(tmp_path):
  short = train.train_and_evaluate(tiny(str(tmp_path / "d12"), 12), str(tmp_path / "short"))
  (table,) = _tables(short["state"]["params"])
  assert table.shape[0] == 12                      # mean pooling: no CLS position
  longer = tiny(str(tmp_path / "d24"), 24, init_from=str(tmp_path / "short"), init_length=12,
                learning_rate=0.0)                 # no update: the loaded table is kept as is
  results = train.train_and_evaluate(longer, str(tmp_path / "long"))
  (extended,) = _tables(results["state"]["params"])
  np.testing.assert_array_equal(extended, np.asarray(embeddings.extend_table(table, 24)))
  assert results["test_examples"] == 16 and np.isfinite(results["test_loss"])
