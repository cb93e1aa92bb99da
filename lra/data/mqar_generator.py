"""The multi-query associative recall (MQAR) generator of Zoology (Arora et al. 2023, "Zoology:
Measuring and Improving Recall in Efficient Language Models", arXiv 2312.04927, section 3 and
appendix; Zoology's `multiquery_ar`), written from that definition.

An example has `seq_len` tokens (even) over a vocabulary of `vocab_size` tokens 0 .. V - 1:
- keys come from [1, V // 2) and values from [V // 2, V), two disjoint halves of the vocabulary;
  `num_pairs` distinct keys and `num_pairs` distinct values are drawn without replacement;
- the first 2 * num_pairs tokens are the pairs, key_1 value_1 key_2 value_2 ...;
- the rest holds one query of every key: the query of key i sits at position
  2 * num_pairs + 2 * gap_i, the gaps drawn without replacement from 0 .. S - 1 with
  S = (seq_len - 2 * num_pairs) // 2 and P(gap = g) proportional to (g + 1) ** (power_a - 1)
  (Zoology's power law, `power_a` = 0.01: close gaps are much more likely). The draws are
  successive weighted sampling (each draw from the law restricted to the gaps not yet taken,
  key 1 first), made with exponential keys (Efraimidis and Spirakis 2006), so the gap of the
  first key follows the law exactly;
- the target of a query's position is its key's value (a causal model reads the query and
  predicts the next token); every other position has target 0, which means "not scored";
- with `noise` (Zoology's `random_non_queries`) every position that is neither a pair nor a
  query holds a token drawn uniformly from the whole vocabulary 0 .. V - 1, else 0.

Unlike Zoology, which seeds numpy's global generator once per split, examples are drawn one after
the other from `numpy.random.default_rng(seed)` (PCG64): deterministic for a seed, with the same
distribution, not the same numbers. Unique examples are not enforced (nor are they in Zoology).
"""

from __future__ import annotations

import numpy as np

POWER_A = 0.01          # Zoology's train_power_a and test_power_a


def check(*, vocab_size: int, seq_len: int, num_pairs: int, power_a: float = POWER_A) -> None:
  """Raises ValueError (one line) when no example can be drawn with these settings (Zoology's
  asserts: an even length, a vocabulary larger than the length, 4 * pairs <= length)."""
  if seq_len < 4 or seq_len % 2:
    raise ValueError(f"seq_len={seq_len}: MQAR needs an even length of at least 4.")
  if num_pairs < 1 or 4 * num_pairs > seq_len:
    raise ValueError(f"num_pairs={num_pairs}: need 1 <= num_pairs and 4 * num_pairs <= seq_len "
                     f"= {seq_len} (the pairs, then a query slot per gap).")
  # With 4 * num_pairs <= seq_len < vocab_size, the halves hold at least num_pairs keys in
  # [1, vocab_size // 2) and num_pairs values: 2 * num_pairs - 1 and 2 * num_pairs at least.
  if vocab_size <= seq_len:
    raise ValueError(f"vocab_size={vocab_size}: must exceed seq_len = {seq_len}.")
  if vocab_size > np.iinfo(np.uint16).max + 1:
    raise ValueError(f"vocab_size={vocab_size}: tokens are stored as uint16, so at most "
                     f"{np.iinfo(np.uint16).max + 1}.")
  if not power_a > 0:
    raise ValueError(f"power_a={power_a}: the power law needs power_a > 0 (1 is uniform).")


def gap_law(seq_len: int, num_pairs: int, power_a: float = POWER_A) -> np.ndarray:
  """P(gap = g) for g = 0 .. S - 1: proportional to (g + 1) ** (power_a - 1)."""
  space = (seq_len - 2 * num_pairs) // 2
  p = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1.0)
  return p / p.sum()


def example(rng: np.random.Generator, *, vocab_size: int, seq_len: int, num_pairs: int,
            law: np.ndarray, noise: bool) -> tuple[np.ndarray, np.ndarray]:
  """One (inputs uint16 [seq_len], targets uint16 [seq_len]) pair drawn from `rng`, the gaps
  from `law` (`gap_law`); targets are the values at the query positions and 0 elsewhere."""
  half = vocab_size // 2
  keys = rng.choice(half - 1, size=num_pairs, replace=False) + 1             # [1, V/2)
  values = rng.choice(vocab_size - half, size=num_pairs, replace=False) + half  # [V/2, V)
  # Successive weighted sampling without replacement: the num_pairs largest log(u) / law, in
  # decreasing order, are the gaps drawn first, second, ...
  scores = np.log(rng.random(law.size)) / law
  gaps = np.argsort(-scores, kind="stable")[:num_pairs]
  context = 2 * num_pairs
  if noise:
    inputs = rng.integers(0, vocab_size, seq_len)
  else:
    inputs = np.zeros(seq_len, np.int64)
  targets = np.zeros(seq_len, np.int64)
  inputs[0:context:2], inputs[1:context:2] = keys, values
  queries = context + 2 * gaps
  inputs[queries] = keys
  targets[queries] = values
  return inputs.astype(np.uint16), targets.astype(np.uint16)


def generate(num: int, *, vocab_size: int, seq_len: int, num_pairs: int, seed: int,
             power_a: float = POWER_A, noise: bool = True
             ) -> list[tuple[np.ndarray, np.ndarray]]:
  """`num` examples drawn from `seed`: a list of (inputs, targets), uint16 [seq_len] each."""
  check(vocab_size=vocab_size, seq_len=seq_len, num_pairs=num_pairs, power_a=power_a)
  rng = np.random.default_rng(seed)
  law = gap_law(seq_len, num_pairs, power_a)
  return [example(rng, vocab_size=vocab_size, seq_len=seq_len, num_pairs=num_pairs, law=law,
                  noise=noise) for _ in range(num)]
