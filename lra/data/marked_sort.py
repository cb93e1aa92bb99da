"""The sort-marked generator: a long input of filler tokens with a few marked tokens scattered far
apart; the target is the marked tokens in increasing order, then end-of-sequence.

An example has `length` tokens (uniform in [min_length, max_length]). `k` marks (uniform in
[min_marks, max_marks]) carry distinct values drawn without replacement from `num_values`
values; the input is cut into `k` equal segments and each segment gets one mark at a uniform
position, so the marks spread over the whole input (about length / k apart). Every other token
is a filler drawn uniformly from `num_fillers` filler tokens. The target is the `k` values sorted
increasingly followed by EOS, so writing its first token needs every mark, wherever it is.

Vocabulary (fixed by the two counts): 0 padding, 1 BOS (the decoder's start token), 2 EOS,
`3 .. 3 + num_values - 1` the mark values in their order, then the fillers. Ids are stored as
uint8, so the vocabulary has at most 256 ids. Generation is deterministic from `seed` (numpy's
PCG64), one example after the other.
"""

from __future__ import annotations

import numpy as np

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VALUE0 = 3                  # id of mark value v is VALUE0 + v
MAX_VOCAB = 256             # ids are stored as uint8


def vocab_size(num_values: int, num_fillers: int) -> int:
  """Padding, BOS, EOS, the mark values and the fillers."""
  return VALUE0 + num_values + num_fillers


def check(*, min_length: int, max_length: int, num_values: int, num_fillers: int,
          min_marks: int, max_marks: int) -> None:
  """Raises ValueError (one line) when no example can be drawn with these settings."""
  if not 1 <= min_marks <= max_marks:
    raise ValueError(f"marks: need 1 <= min_marks <= max_marks, got min_marks={min_marks}, "
                     f"max_marks={max_marks}.")
  if max_marks > num_values:
    raise ValueError(f"max_marks={max_marks} distinct marks need at least as many values, got "
                     f"num_values={num_values}.")
  if not max_marks <= min_length <= max_length:
    raise ValueError(f"lengths: need max_marks <= min_length <= max_length (one segment per "
                     f"mark), got max_marks={max_marks}, min_length={min_length}, "
                     f"max_length={max_length}.")
  if num_fillers < 1:
    raise ValueError(f"num_fillers={num_fillers}: need at least one filler token.")
  if vocab_size(num_values, num_fillers) > MAX_VOCAB:
    raise ValueError(f"num_values + num_fillers = {num_values + num_fillers}: the vocabulary "
                     f"(3 + values + fillers) must have at most {MAX_VOCAB} ids.")


def example(rng: np.random.Generator, *, min_length: int, max_length: int, num_values: int,
            num_fillers: int, min_marks: int, max_marks: int
            ) -> tuple[np.ndarray, np.ndarray]:
  """One (inputs uint8 [length], targets uint8 [k + 1]) pair drawn from `rng`."""
  length = int(rng.integers(min_length, max_length + 1))
  k = int(rng.integers(min_marks, max_marks + 1))
  inputs = rng.integers(0, num_fillers, length) + VALUE0 + num_values          # fillers
  values = rng.choice(num_values, size=k, replace=False)
  edges = np.linspace(0, length, k + 1).astype(np.int64)                      # k segments
  positions = edges[:-1] + (rng.random(k) * (edges[1:] - edges[:-1])).astype(np.int64)
  inputs[positions] = VALUE0 + values
  targets = np.append(np.sort(values) + VALUE0, EOS_ID)
  return inputs.astype(np.uint8), targets.astype(np.uint8)


def generate(num: int, *, min_length: int, max_length: int, num_values: int, num_fillers: int,
             min_marks: int, max_marks: int, seed: int = 0
             ) -> list[tuple[np.ndarray, np.ndarray]]:
  """`num` examples drawn from `seed`: a list of (inputs uint8 [n], targets uint8 [k + 1])."""
  kw = dict(min_length=min_length, max_length=max_length, num_values=num_values,
            num_fillers=num_fillers, min_marks=min_marks, max_marks=max_marks)
  check(**kw)
  rng = np.random.default_rng(seed)
  return [example(rng, **kw) for _ in range(num)]

