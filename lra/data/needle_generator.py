"""The needle generator: one key-value pair hidden in filler at a chosen distance before a final
query of its key (long-range retrieval at a controlled distance, as in RULER's single needle).

An example has `seq_len` tokens over a vocabulary of `vocab_size` tokens 0 .. V - 1 split in
three disjoint ranges:
- keys [0, num_keys), values [num_keys, num_keys + num_values), filler [num_keys + num_values, V);
- the last position q = seq_len - 1 holds the query: a key drawn uniformly from the keys;
- the distance d is drawn uniformly from `distances` (one entry: a fixed d); the key sits at
  position q - d and its value at q - d + 1, so d is the query's position minus the key's
  position (d = 2: the pair is the two tokens just before the query; d = seq_len - 1: the key
  is the first token). 2 <= d <= seq_len - 1;
- the value is drawn uniformly from the values, independently of the key and of d;
- every other position holds a filler token drawn uniformly from the filler range, so the key
  appears exactly once before the query and no filler is a key or a value;
- with `num_distractors` N > 0, N other key-value pairs are drawn after the filler: N distinct
  keys other than the query's (uniformly, without replacement), each with a value drawn
  uniformly, each pair on two adjacent filler positions drawn uniformly among those still free
  (not the needle's, the query's or another pair's), one pair after the other. The query's key
  still appears exactly once before it, and the answer is the value after it, so the model must
  match the key, not merely find a value (with N = 0 the only value in the row is the answer).
  N = 0 draws nothing more: the examples are those drawn without the option;
- the target of the query position is the value (a causal model reads the query and predicts
  the next token; a classifier reads the query position); every other target is 0, "not
  scored". Values are >= num_keys >= 1, so a target is never 0.

Examples are drawn one after the other from `numpy.random.default_rng(seed)` (PCG64), so a seed
gives the same examples. The draws of one example, in order: d, key, value, the filler, then the
distractors (keys, values, positions).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def check(*, vocab_size: int, seq_len: int, num_keys: int, num_values: int,
          distances: Sequence[int], num_distractors: int) -> None:
  """Raises ValueError (one line) when no example can be drawn with these settings."""
  if seq_len < 3:
    raise ValueError(f"seq_len={seq_len}: a needle example needs at least 3 tokens (key, value, "
                     f"query).")
  if num_keys < 1 or num_values < 1:
    raise ValueError(f"num_keys={num_keys}, num_values={num_values}: need at least one of each.")
  if vocab_size <= num_keys + num_values:
    raise ValueError(f"vocab_size={vocab_size}: must exceed num_keys + num_values = "
                     f"{num_keys + num_values} (the rest is the filler vocabulary).")
  if vocab_size > np.iinfo(np.uint16).max + 1:
    raise ValueError(f"vocab_size={vocab_size}: tokens are stored as uint16, so at most "
                     f"{np.iinfo(np.uint16).max + 1}.")
  if len(distances) == 0:
    raise ValueError("distances is empty: give one distance or several to draw from.")
  bad = [d for d in distances if not 2 <= int(d) <= seq_len - 1]
  if bad:
    raise ValueError(f"distances {bad}: a distance d puts the key at seq_len - 1 - d and its "
                     f"value after it, so 2 <= d <= seq_len - 1 = {seq_len - 1}.")
  if num_distractors < 0 or num_distractors > num_keys - 1:
    raise ValueError(f"num_distractors={num_distractors}: the distractors' keys are distinct and "
                     f"not the query's, so 0 <= num_distractors <= num_keys - 1 = "
                     f"{num_keys - 1}.")
  if num_distractors and seq_len < 4 * (num_distractors + 1) + 1:
    raise ValueError(f"seq_len={seq_len}: {num_distractors} distractor pairs need "
                     f"seq_len >= 4 (num_distractors + 1) + 1 = {4 * (num_distractors + 1) + 1}.")


def example(rng: np.random.Generator, *, vocab_size: int, seq_len: int, num_keys: int,
            num_values: int, distances: Sequence[int], num_distractors: int
            ) -> tuple[np.ndarray, np.ndarray]:
  """One (inputs uint16 [seq_len], targets uint16 [seq_len]) pair drawn from `rng`; the target
  is the value at the query position (the last) and 0 elsewhere."""
  d = int(distances[rng.integers(len(distances))])
  key = rng.integers(num_keys)
  value = num_keys + rng.integers(num_values)
  inputs = rng.integers(num_keys + num_values, vocab_size, seq_len)
  query = seq_len - 1
  inputs[query - d], inputs[query - d + 1], inputs[query] = key, value, key
  if num_distractors:
    others = np.delete(np.arange(num_keys), key)
    keys = rng.choice(others, num_distractors, replace=False)
    values = num_keys + rng.integers(num_values, size=num_distractors)
    free = np.ones(seq_len, bool)
    free[[query - d, query - d + 1, query]] = False
    for k, v in zip(keys, values):
      starts = np.flatnonzero(free[:-1] & free[1:])     # both positions of the pair free
      p = int(starts[rng.integers(starts.size)])
      inputs[p], inputs[p + 1] = k, v
      free[p:p + 2] = False
  targets = np.zeros(seq_len, np.int64)
  targets[query] = value
  return inputs.astype(np.uint16), targets.astype(np.uint16)


def generate(num: int, *, vocab_size: int, seq_len: int, num_keys: int, num_values: int,
             distances: Sequence[int], seed: int, num_distractors: int
             ) -> list[tuple[np.ndarray, np.ndarray]]:
  """`num` examples drawn from `seed`: a list of (inputs, targets), uint16 [seq_len] each."""
  distances = tuple(int(d) for d in distances)
  check(vocab_size=vocab_size, seq_len=seq_len, num_keys=num_keys, num_values=num_values,
        distances=distances, num_distractors=num_distractors)
  rng = np.random.default_rng(seed)
  return [example(rng, vocab_size=vocab_size, seq_len=seq_len, num_keys=num_keys,
                  num_values=num_values, distances=distances, num_distractors=num_distractors)
          for _ in range(num)]


def distance_of(inputs: np.ndarray) -> int:
  """The distance of a generated example, read back from its tokens: the query (last) position
  minus the position of the query's key earlier in the row (which must appear exactly once)."""
  where = np.flatnonzero(inputs[:-1] == inputs[-1])
  if where.size != 1:
    raise ValueError(f"the query's key appears {where.size} times before the query.")
  return int(inputs.size - 1 - where[0])
