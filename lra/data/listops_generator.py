"""The ListOps generator and the released TSV format, with the fixed ListOps vocabulary.

A ListOps example is a prefix expression over the digits 0-9 with the operators `[MIN`, `[MAX`,
`[MED` (median, truncated to an int) and `[SM` (sum mod 10), each closed by `]`, e.g.
`[MAX 2 9 [MIN 4 7 ] 0 ]` -> 9. The label is the value of the expression (10 classes).

Generator: the grammar of the LRA generator (`lra_benchmarks/data/listops.py`). A node at depth
< max_depth (the root is at depth 1) is an operator with probability 0.25, otherwise a uniform
digit; an operator draws its operator uniformly and 2..max_args (inclusive, uniform) children.
Trees are kept when `gen_min_length < tokens < gen_max_length` (strict, as in LRA) and are unique
across all three splits. LRA used max_depth 10, max_args 10 and lengths (500, 2000). Unlike LRA,
the generator is seeded, draws 2048 trees at a time breadth first with numpy, and stops growing a
tree once it reaches the upper bound (the kept trees have the same distribution; only rejected
work is skipped).

Released format: `lra_release/listops-1000/basic_{train,val,test}.tsv`, a header `Source\tTarget`,
then one row per example whose source is the tree written as left-nested pairs,
`( ( ( [MAX 2 ) 9 ) ] )` for `[MAX 2 9 ]`. Tokenisation drops `(` and `)` and splits on
whitespace. `to_released_string` and `write_tsv` write this format; `python -m
lra.data.listops_generator --output_dir=DIR` writes generated TSVs like the LRA script.

Vocabulary: fixed, not built from data (LRA built it from a Python `set`, so token ids depended on
PYTHONHASHSEED). Ids: 0 padding, 1-10 the digits 0-9, 11 `[MIN`, 12 `[MAX`, 13 `[MED`, 14 `[SM`,
15 `]`, 16 unknown token.
"""

from __future__ import annotations

import argparse
import csv
import os
from typing import Iterable, Iterator, NamedTuple, Sequence

import numpy as np

NUM_CLASSES = 10
# LRA's generator settings (the `base` ListOps data).
DEFAULTS = {"num_train": 96_000, "num_val": 2_000, "num_test": 2_000, "gen_min_length": 500,
            "gen_max_length": 2000, "max_depth": 10, "max_args": 10, "seed": 0}

VOCAB = ("<pad>", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
         "[MIN", "[MAX", "[MED", "[SM", "]", "<unk>")
PAD_ID = 0
UNK_ID = len(VOCAB) - 1
VOCAB_SIZE = len(VOCAB)
TOKEN_TO_ID = {tok: i for i, tok in enumerate(VOCAB) if i not in (PAD_ID, UNK_ID)}
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
_DIGIT0 = TOKEN_TO_ID["0"]        # id of digit d is _DIGIT0 + d
_OP0 = TOKEN_TO_ID["[MIN"]        # ids of OPERATORS are _OP0 + 0..3
END_ID = TOKEN_TO_ID["]"]
VALUE_P = 0.25                    # P(operator) at depth < max_depth; _draw_levels assumes 1/4
ROOTS_PER_ROUND = 2048            # trees drawn together by the vectorised generator
IDLE_ROUNDS = 200                 # rounds without a new kept tree before the generator gives up


# ----------------------------------------------------------------------------------------------
# Generator.


class _Levels(NamedTuple):
  """Trees stored level by level (roots first); the children of a node are contiguous."""
  parent: list   # per level, [n] int: index of the parent in the level above (empty for roots)
  op: list       # per level, [n] int: operator 0..3, or -1 for a digit
  arity: list    # per level, [n] int: number of children (0 for a digit)
  digit: list    # per level, [n] int: the digit (0 for an operator)


def _draw_levels(rng: np.random.Generator, num_roots: int, limit: int, max_depth: int,
                 max_args: int) -> tuple[list, np.ndarray]:
  """Draws `num_roots` trees breadth first; returns per level (tree, parent, draw), lengths [T].

  One integer draw r in [0, 4m) per node, m = lcm(4 (max_args - 1), 10): r < m (probability
  VALUE_P = 1/4) makes an operator whose kind r mod 4(max_args - 1) picks the operator and the
  arity, otherwise the node is the digit r mod 10; both are uniform. A tree stops growing once
  it has `limit` tokens (it can only be rejected): the work per tree is bounded, and its length
  is then a lower bound, still >= limit.
  """
  kinds = 4 * (max_args - 1)
  m = np.lcm(kinds, 10)
  levels = []
  tree = np.arange(num_roots, dtype=np.int32)
  parent = np.zeros(0, np.int32)
  length = np.zeros(num_roots, np.int32)  # [T] tokens so far
  for depth in range(1, max_depth + 1):
    if depth < max_depth:
      r = rng.integers(0, 4 * m, size=tree.size, dtype=np.int32)
    else:  # nodes at max_depth are digits
      r = rng.integers(m, 4 * m, size=tree.size, dtype=np.int32)
    levels.append((tree, parent, r))
    is_op = r < m
    length += np.bincount(tree, minlength=num_roots).astype(np.int32)
    length += np.bincount(tree[is_op], minlength=num_roots).astype(np.int32)
    grow = np.flatnonzero(is_op & (length[tree] < limit))
    parent = np.repeat(grow.astype(np.int32), 2 + (r[grow] % kinds >> 2))
    if not parent.size:
      break
    tree = tree[parent]
  return levels, length


def _select(levels: list, keep_tree: np.ndarray, max_args: int) -> _Levels:
  """The trees with keep_tree[t] (all of their nodes are present), renumbered and decoded."""
  kinds = 4 * (max_args - 1)
  m = np.lcm(kinds, 10)
  out = _Levels([], [], [], [])
  new_index = None
  for tree, parent, r in levels:
    keep = keep_tree[tree]
    if not keep.any():
      break
    parent = new_index[parent[keep]] if new_index is not None else parent
    new_index = np.cumsum(keep, dtype=np.int32) - 1
    r = r[keep].astype(np.int64)
    is_op = r < m
    out.parent.append(parent)
    out.op.append(np.where(is_op, r % kinds & 3, -1))
    out.arity.append(np.where(is_op, 2 + (r % kinds >> 2), 0))
    out.digit.append(np.where(is_op, 0, r % 10))
  return out


def _flatten(lv: _Levels) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Prefix token ids of all trees back to back; returns (tokens, tree starts, values)."""
  depth = len(lv.op)
  size = [None] * depth
  value = [None] * depth
  for d in reversed(range(depth)):  # bottom up: sizes and values
    is_op = lv.op[d] >= 0
    size[d] = np.where(is_op, 2, 1)
    value[d] = lv.digit[d].copy()
    if d + 1 < depth and lv.parent[d + 1].size:
      child_size, child_val, parent = size[d + 1], value[d + 1], lv.parent[d + 1]
      size[d] = size[d] + np.bincount(parent, weights=child_size, minlength=size[d].size
                                      ).astype(np.int64)
      arity = lv.arity[d][is_op]
      starts = np.cumsum(arity) - arity
      ranked = child_val[np.lexsort((child_val, parent))]  # sorted within each parent
      mid = starts + arity // 2
      med = np.where(arity % 2 == 1, ranked[mid], (ranked[mid - 1] + ranked[mid]) // 2)
      results = np.stack([np.minimum.reduceat(child_val, starts),
                          np.maximum.reduceat(child_val, starts), med,
                          np.add.reduceat(child_val, starts) % 10])  # [4, ops]
      value[d][is_op] = results[lv.op[d][is_op], np.arange(arity.size)]
  pos = [np.cumsum(size[0]) - size[0]]  # top down: position of each node's first token
  for d in range(1, depth):
    is_op = lv.op[d - 1] >= 0
    arity = lv.arity[d - 1][is_op]
    before = np.cumsum(size[d]) - size[d]
    starts = np.cumsum(arity) - arity
    pos.append(np.repeat(pos[d - 1][is_op] + 1 - before[starts], arity) + before)
  tokens = np.empty(int(size[0].sum()), np.uint8)
  for d in range(depth):
    is_op = lv.op[d] >= 0
    tokens[pos[d]] = np.where(is_op, _OP0 + lv.op[d], _DIGIT0 + lv.digit[d])
    tokens[(pos[d] + size[d] - 1)[is_op]] = END_ID
  return tokens, pos[0], value[0]


def _apply(op: int, vals: list) -> int:
  if op == 0:
    return min(vals)
  if op == 1:
    return max(vals)
  if op == 2:  # int(np.median(vals)) for non-negative ints
    vals = sorted(vals)
    m = len(vals) // 2
    return vals[m] if len(vals) % 2 else (vals[m - 1] + vals[m]) // 2
  return sum(vals) % 10


def generate(num: int, *, min_length: int, max_length: int, max_depth: int = 10,
             max_args: int = 10, seed: int = 0,
             exclude: set | None = None) -> list[tuple[np.ndarray, int]]:
  """Generates `num` unique trees with min_length < tokens < max_length.

  Returns a list of (token ids as uint8 [n], label). Trees whose token bytes are in `exclude`
  are skipped, and the kept ones are added to it (pass one set to keep splits disjoint).
  """
  if max_length - min_length < 2 or max_length <= 4:
    raise ValueError(
        f"no ListOps tree has min_length < length < max_length for ({min_length}, "
        f"{max_length}); an operator node has at least 4 tokens, so use e.g. (20, 200).")
  if max_depth < 1 or max_args < 2:
    raise ValueError(f"need max_depth >= 1 and max_args >= 2, got {max_depth}, {max_args}.")
  seen = set() if exclude is None else exclude
  rng = np.random.default_rng(seed)
  out = []
  idle_rounds = 0  # consecutive rounds that found nothing new
  while len(out) < num:
    if idle_rounds == IDLE_ROUNDS:
      raise RuntimeError(
          f"the generator found only {len(out)} of {num} unique trees with lengths in "
          f"({min_length}, {max_length}) for max_depth={max_depth}, max_args={max_args}; "
          f"widen the length bounds or ask for fewer examples.")
    idle_rounds += 1
    levels, length = _draw_levels(rng, ROOTS_PER_ROUND, max_length, max_depth, max_args)
    keep = (length > min_length) & (length < max_length)  # [T]: complete trees only
    if not keep.any():
      continue
    tokens, starts, values = _flatten(_select(levels, keep, max_args))
    ends = np.append(starts[1:], tokens.size)
    for start, end, value in zip(starts.tolist(), ends.tolist(), values.tolist()):
      key = tokens[start:end].tobytes()
      if key not in seen:
        seen.add(key)
        out.append((np.frombuffer(key, np.uint8), value))
        idle_rounds = 0
        if len(out) == num:
          break
  return out


def evaluate(ids: Sequence[int]) -> int:
  """The value of a token-id sequence (a tree in prefix form); raises on malformed input."""
  stack = [[None, []]]
  for t in ids:
    t = int(t)
    if _DIGIT0 <= t < _DIGIT0 + 10:
      stack[-1][1].append(t - _DIGIT0)
    elif _OP0 <= t < _OP0 + 4:
      stack.append([t - _OP0, []])
    elif t == END_ID and len(stack) > 1:
      op, vals = stack.pop()
      if not vals:
        raise ValueError("an operator has no arguments.")
      stack[-1][1].append(_apply(op, vals))
    else:
      raise ValueError(f"token id {t} does not fit here in a ListOps expression.")
  if len(stack) != 1 or len(stack[0][1]) != 1:
    raise ValueError("not one complete ListOps expression.")
  return stack[0][1][0]


# ----------------------------------------------------------------------------------------------
# Released TSV format.


def tokenize(source: str) -> list[str]:
  """Whitespace tokens of a released `Source` string without the pair parentheses."""
  return [t for t in source.split() if t not in ("(", ")")]


def encode(source: str) -> np.ndarray:
  """Token ids (uint8) of a released `Source` string; unknown tokens map to UNK_ID."""
  return np.array([TOKEN_TO_ID.get(t, UNK_ID) for t in tokenize(source)], np.uint8)


def to_released_string(ids: Sequence[int]) -> str:
  """Writes a tree as the LRA generator does: operator and arguments as left-nested pairs.

  `[MAX 2 9 ]` becomes `( ( ( [MAX 2 ) 9 ) ] )`: the pair (((op, 2), 9), END).
  """
  frames = [[None, []]]  # [operator token, argument strings]
  for t in ids:
    t = int(t)
    if _OP0 <= t < _OP0 + 4:
      frames.append([VOCAB[t], []])
    elif t == END_ID and len(frames) > 1:
      op, args = frames.pop()
      frames[-1][1].append(
          "( " * (len(args) + 1) + op + "".join(f" {a} )" for a in args) + " ] )")
    elif 0 < t < UNK_ID and t != END_ID:
      frames[-1][1].append(VOCAB[t])
    else:
      raise ValueError(f"token id {t} does not fit here in a ListOps expression.")
  if len(frames) != 1 or len(frames[0][1]) != 1:
    raise ValueError("not one complete ListOps expression.")
  return frames[0][1][0]


def write_tsv(path: str, rows: Iterable[tuple[Sequence[int], int]]) -> None:
  """Writes (token ids, label) rows as a released-format TSV with the `Source\\tTarget` header."""
  with open(path, "w", newline="") as f:
    writer = csv.writer(f, delimiter="\t")
    writer.writerow(["Source", "Target"])
    for ids, label in rows:
      writer.writerow([to_released_string(ids), int(label)])


def read_tsv(path: str) -> Iterator[tuple[np.ndarray, int]]:
  """Yields (token ids uint8, label) from a released-format TSV."""
  with open(path, newline="") as f:
    reader = csv.reader(f, delimiter="\t")
    header = next(reader, None)
    if header != ["Source", "Target"]:
      raise ValueError(f"{path}: expected the header 'Source<TAB>Target', got {header!r}.")
    for line, row in enumerate(reader, start=2):
      if len(row) != 2:
        raise ValueError(f"{path}:{line}: expected 2 tab-separated fields, got {len(row)}.")
      label = int(row[1])
      if not 0 <= label < NUM_CLASSES:
        raise ValueError(f"{path}:{line}: label {label} is not in 0..{NUM_CLASSES - 1}.")
      yield encode(row[0]), label


def main(argv: Sequence[str] | None = None) -> None:
  """Writes generated `{task}_{train,val,test}.tsv` in the released format, like the LRA script."""
  d = DEFAULTS
  p = argparse.ArgumentParser(description=main.__doc__)
  p.add_argument("--output_dir", required=True)
  p.add_argument("--task", default="basic")
  for key in ("num_train", "num_val", "num_test", "gen_min_length", "gen_max_length",
              "max_depth", "max_args", "seed"):
    p.add_argument(f"--{key}", type=int, default=d[key])
  a = p.parse_args(argv)
  os.makedirs(a.output_dir, exist_ok=True)
  seen = set()
  kw = dict(min_length=a.gen_min_length, max_length=a.gen_max_length, max_depth=a.max_depth,
            max_args=a.max_args, exclude=seen)
  for suffix, num, offset in (("test", a.num_test, 2), ("val", a.num_val, 1),
                              ("train", a.num_train, 0)):
    path = os.path.join(a.output_dir, f"{a.task}_{suffix}.tsv")
    write_tsv(path, generate(num, seed=a.seed * 3 + offset, **kw))
    print(f"wrote {num} examples to {path}")


if __name__ == "__main__":
  main()
