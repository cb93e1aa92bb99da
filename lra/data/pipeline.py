"""Batches for training and evaluation from random-access sources, through grain.

Training: `train_iterator` shuffles the whole split (a fresh permutation every epoch, from
`seed`), repeats forever and cuts it into global batches of `batch_size`. Process `shard_index`
of `shard_count` gets rows [shard_index * b, (shard_index + 1) * b) of each global batch, b =
batch_size // shard_count, so the shards put together in order are exactly the global batch,
whatever the number of shards. The iterator's `get_state()` is a small JSON-serialisable dict;
`set_state(state)` on a fresh iterator over the same source and settings continues with exactly
the batches that would have come next.

Evaluation: `eval_batches` visits every example of the split exactly once, in order, in global
batches of `batch_size` split across shards the same way. The last global batch is filled up
with copies of examples from the start of the split whose `weights` are 0, so every shard sees
the same number of full-size batches (as jit and multi-host lockstep need), and a weighted sum
counts each example once.

A source is anything with `__len__` and `__getitem__(i) -> {"inputs": [L], "targets": []}` (such
as `lra.data.listops.get_source`); `__getitems__(indices)` is used when present.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import grain
import numpy as np


def _check_sharding(batch_size: int, shard_index: int, shard_count: int) -> int:
  """Checks the sharding arguments; returns the per-shard batch size."""
  if shard_count < 1 or not 0 <= shard_index < shard_count:
    raise ValueError(f"need 0 <= shard_index < shard_count, got shard_index={shard_index}, "
                     f"shard_count={shard_count}.")
  if batch_size < 1 or batch_size % shard_count:
    raise ValueError(
        f"batch_size={batch_size} must be a positive multiple of shard_count={shard_count} "
        f"(each shard gets batch_size // shard_count rows); round it to "
        f"{max(1, round(batch_size / shard_count)) * shard_count}.")
  return batch_size // shard_count


def _check_source(source) -> int:
  n = len(source)
  if n == 0:
    raise ValueError("the data source is empty; check the data_dir and the split.")
  return n


def _read(source, indices: Sequence[int]) -> list:
  if hasattr(source, "__getitems__"):
    return list(source.__getitems__(list(indices)))
  return [source[i] for i in indices]


class _ShardRows(grain.MapDataset):
  """Element i of shard s: row i mod b of global batch i // b, i.e. parent[(i//b) B + s b + i%b]."""

  def __init__(self, parent: grain.MapDataset, batch_size: int, shard_index: int,
               shard_batch: int):
    super().__init__(parent)
    self._batch = batch_size
    self._offset = shard_index * shard_batch
    self._b = shard_batch
    self._len = len(parent) // batch_size * shard_batch

  def _parent_index(self, index: int) -> int:
    step, row = divmod(index, self._b)
    return step * self._batch + self._offset + row

  def __len__(self) -> int:
    return self._len

  def __str__(self) -> str:
    return f"ShardRows(batch_size={self._batch}, offset={self._offset}, rows={self._b})"

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    return self._parent[self._parent_index(index)]

  def _getitems(self, indices: Sequence[int]) -> list:
    return self._parent._getitems([self._parent_index(i) for i in indices])  # pylint: disable=protected-access


def train_iterator(source, *, batch_size: int, seed: int, shard_index: int = 0,
                   shard_count: int = 1, num_threads: int = 2,
                   prefetch_batches: int = 4) -> grain.DatasetIterator:
  """An endless iterator of {"inputs": [b, L], "targets": [b]} numpy batches, b = B // shards.

  Has get_state() -> JSON-serialisable dict and set_state(dict) for exact resumption.
  """
  b = _check_sharding(batch_size, shard_index, shard_count)
  _check_source(source)
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed must be in [0, 2**32), got {seed}.")
  ds = grain.MapDataset.source(source)
  if getattr(source, "shuffle", True):   # a source of contiguous streams sets shuffle = False
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat()                       # reshuffled every epoch
  ds = _ShardRows(ds, batch_size, shard_index, b).batch(b, drop_remainder=True)
  read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_batches)
  return iter(ds.to_iter_dataset(read))


class EvalBatches:
  """One pass over a split in batches padded with weight-0 fillers; iterable more than once."""

  def __init__(self, source, *, batch_size: int, shard_index: int = 0, shard_count: int = 1):
    self._b = _check_sharding(batch_size, shard_index, shard_count)
    self._n = _check_source(source)
    self._source = source
    self._batch = batch_size
    self._offset = shard_index * self._b
    self.num_examples = self._n

  def __len__(self) -> int:
    """The number of batches (the same on every shard)."""
    return math.ceil(self._n / self._batch)

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    for step in range(len(self)):
      pos = step * self._batch + self._offset + np.arange(self._b)  # [b] global positions
      rows = _read(self._source, (pos % self._n).tolist())
      batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
      batch["weights"] = (pos < self._n).astype(np.float32)  # [b]
      yield batch


def eval_batches(source, *, batch_size: int, shard_index: int = 0,
                 shard_count: int = 1) -> EvalBatches:
  """Every example of `source` once, in batches of b = batch_size // shard_count with "weights"."""
  return EvalBatches(source, batch_size=batch_size, shard_index=shard_index,
                     shard_count=shard_count)

