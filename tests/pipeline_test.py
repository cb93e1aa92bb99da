"""Tests for lra.data.pipeline: epochs, sharding, exact resumption, weighted eval batches."""

import json

import numpy as np
import pytest

from lra.data import pipeline
from configs import listops as listops_config
from lra.data import listops, listops_generator as gen


class _Source:
  """Example i has targets i and inputs [i, i + 1, 0]."""

  def __init__(self, n: int):
    self.n = n

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    if not 0 <= i < self.n:
      raise IndexError(i)
    return {"inputs": np.array([i, i + 1, 0], np.int32), "targets": np.int32(i)}


def _take(it, k):
  return [next(it) for _ in range(k)]


def test_train_batches_cover_each_epoch_once_and_reshuffle():
  n, batch = 24, 6
  it = pipeline.train_iterator(_Source(n), batch_size=batch, seed=3)
  batches = _take(it, 3 * n // batch)
  for b in batches:
    assert b["inputs"].shape == (batch, 3) and b["inputs"].dtype == np.int32
    assert b["targets"].shape == (batch,)
    np.testing.assert_array_equal(b["inputs"][:, 0], b["targets"])
  epochs = np.concatenate([b["targets"] for b in batches]).reshape(3, n)
  for e in epochs:
    assert sorted(e.tolist()) == list(range(n))
  assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
  assert not np.array_equal(epochs[0], np.arange(n))
  other = pipeline.train_iterator(_Source(n), batch_size=batch, seed=4)
  assert not np.array_equal(next(other)["targets"], batches[0]["targets"])


def test_shards_put_together_are_the_global_batch():
  n, batch = 30, 8  # 30 is not a multiple of 8: batches straddle epochs
  whole = _take(pipeline.train_iterator(_Source(n), batch_size=batch, seed=0), 10)
  for count in (2, 4):
    shards = [pipeline.train_iterator(_Source(n), batch_size=batch, seed=0,
                                            shard_index=i, shard_count=count)
              for i in range(count)]
    for step in range(10):
      parts = [next(s) for s in shards]
      assert all(p["targets"].shape == (batch // count,) for p in parts)
      np.testing.assert_array_equal(np.concatenate([p["targets"] for p in parts]),
                                    whole[step]["targets"])


@pytest.mark.parametrize("stop", [1, 4, 7])
def test_resumed_iterator_continues_exactly(stop):
  n, batch = 20, 6  # an epoch is 3.33 batches: stops before, at and after epoch boundaries
  reference = _take(pipeline.train_iterator(_Source(n), batch_size=batch, seed=7,
                                                  shard_index=1, shard_count=2), 12)
  it = pipeline.train_iterator(_Source(n), batch_size=batch, seed=7, shard_index=1,
                                     shard_count=2)
  _take(it, stop)
  state = json.loads(json.dumps(it.get_state()))  # must survive a JSON round trip
  del it
  resumed = pipeline.train_iterator(_Source(n), batch_size=batch, seed=7, shard_index=1,
                                          shard_count=2)
  resumed.set_state(state)
  for want, got in zip(reference[stop:], _take(resumed, 12 - stop)):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
    np.testing.assert_array_equal(got["targets"], want["targets"])


@pytest.mark.parametrize("n, batch, count", [(10, 4, 1), (10, 4, 2), (3, 8, 4), (16, 8, 2)])
def test_eval_batches_count_every_example_once(n, batch, count):
  seen = []
  num_batches = None
  for shard in range(count):
    batches = pipeline.eval_batches(_Source(n), batch_size=batch, shard_index=shard,
                                          shard_count=count)
    listed = list(batches)
    assert len(listed) == len(batches) == -(-n // batch)
    num_batches = num_batches or len(listed)
    assert len(listed) == num_batches  # every shard runs the same number of steps
    for b in listed:
      assert b["inputs"].shape == (batch // count, 3) and b["weights"].dtype == np.float32
      assert set(np.unique(b["weights"]).tolist()) <= {0.0, 1.0}
      seen += b["targets"][b["weights"] == 1].tolist()
  assert sorted(seen) == list(range(n))
  assert list(pipeline.eval_batches(_Source(n), batch_size=batch))[0]["targets"][0] == 0


def test_bad_arguments_are_explained():
  with pytest.raises(ValueError, match="multiple of shard_count=3"):
    pipeline.train_iterator(_Source(10), batch_size=8, seed=0, shard_count=3)
  with pytest.raises(ValueError, match="shard_index < shard_count"):
    pipeline.eval_batches(_Source(10), batch_size=8, shard_index=2, shard_count=2)
  with pytest.raises(ValueError, match="empty"):
    pipeline.train_iterator(_Source(0), batch_size=8, seed=0)
  with pytest.raises(ValueError, match="seed"):
    pipeline.train_iterator(_Source(10), batch_size=8, seed=-1)


def test_listops_source_through_the_pipeline(tmp_path):
  cfg = listops_config.data_config()
  cfg.update(dict(data_dir=str(tmp_path), num_train=40, num_val=10, num_test=10,
                  gen_min_length=10, gen_max_length=40, max_length=48))
  train = listops.get_source(cfg, "train")
  it = pipeline.train_iterator(train, batch_size=8, seed=0, shard_index=1, shard_count=2)
  batch = next(it)
  assert batch["inputs"].shape == (4, 48) and batch["inputs"].dtype == np.int32
  assert batch["targets"].dtype == np.int32 and batch["targets"].max() < gen.NUM_CLASSES
  for row, label in zip(batch["inputs"], batch["targets"]):
    assert gen.evaluate(row[row > 0]) == label
  evals = list(pipeline.eval_batches(listops.get_source(cfg, "test"), batch_size=8))
  assert len(evals) == 2 and evals[1]["weights"].sum() == 2
