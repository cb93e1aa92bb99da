"""Metrics: summed statistics from the jitted steps, and a JSON-lines log in the workdir.

Steps return sums (`loss_sum`, `correct`, `weight`, and for language models `tokens`), never
means, so batches with padding examples and multi-device splits add up exactly; `summarise`
turns sums into loss, accuracy and, for language models, bits per character.

`MetricWriter` appends every record to `<workdir>/metrics.jsonl`, one JSON object per line:
`{"step": ..., "split": ..., ...}`, and writes the same numbers as TensorBoard scalars
`<split>/<name>` (`train/loss`, `validation/accuracy`, ...) to an event file in
`<workdir>/tensorboard/` with `tensorboardX`, which needs no TensorFlow. Both may be in a
bucket (`gs://...`, through `lra.storage`).
"""

from __future__ import annotations

import atexit
import itertools
import json
import math
import os
import time
import weakref
from typing import Any, Mapping

import jax
import numpy as np
import tensorboardX

from lra import storage
from lra.rundir import RunDir

FLUSH_SECONDS = 2   # tensorboardX's writer thread flushes the event file this often
_WRITERS = itertools.count()   # tells apart the event files of writers started in one second


def summarise(sums: Mapping[str, Any], *, bits_per_char: bool = False) -> dict[str, float]:
  """Sums from steps -> {"loss", "accuracy"[, "bpc"]}, weighted by the number of examples; any
  other sum (a family's own, such as the seq2seq `tokens`) is passed on as it is."""
  sums = {k: float(np.asarray(v)) for k, v in sums.items()}
  weight = max(sums.get("weight", 0.0), 1e-9)
  out = {"loss": sums["loss_sum"] / weight, "accuracy": sums["correct"] / weight,
         "examples": sums.get("weight", 0.0)}
  if bits_per_char:
    out["bpc"] = out["loss"] / math.log(2.0)
  for key, value in sums.items():   # a family's own sums, for its derived metrics
    if key not in ("loss_sum", "correct", "weight"):
      out[key] = value
  return out


def add_sums(total: dict[str, Any] | None, sums: Mapping[str, Any]) -> dict[str, Any]:
  """Accumulates device sums (kept on device until read)."""
  if total is None:
    return dict(sums)
  return {k: total[k] + sums[k] for k in total}


class MetricWriter:
  """Appends metric records to `<workdir>/metrics.jsonl` and TensorBoard scalars to
  `<workdir>/tensorboard/events.out.tfevents.<time>.<hostname>.<pid>.<n>` (process 0 only).

  metrics.jsonl is on disk after every `write`. The scalars go through tensorboardX's writer
  thread: in the event file within FLUSH_SECONDS, and all of them once `close()` returns (also
  done when the writer is garbage collected or the interpreter exits). Every writer starts its
  own event file, created on the first write; TensorBoard reads a directory's files in name
  (time) order, so a resumed run continues its curves."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = RunDir(workdir).metrics
    self.tensorboard_dir = RunDir(workdir).tensorboard
    self._lines = storage.LineFile(self.path)
    self.enabled = jax.process_index() == 0
    self._summaries: tensorboardX.SummaryWriter | None = None  # created on the first write
    self._closer: weakref.finalize | None = None   # closes the event file once

  def write(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
    for name, value in metrics.items():
      if isinstance(value, float) and not math.isfinite(value):
        raise FloatingPointError(
            f"{split} {name} is {value} at step {step}: training diverged (try a lower "
            f"learning rate or gradient clipping).")
    if not self.enabled:
      return
    record = {"step": int(step), "split": split, "time": round(time.time(), 3), **metrics}
    self._lines.append(json.dumps(record))
    if self._summaries is None:
      if storage.is_remote(self.tensorboard_dir):
        storage.register_tensorboard_writers()
      self._summaries = tensorboardX.SummaryWriter(
          self.tensorboard_dir, flush_secs=FLUSH_SECONDS,
          filename_suffix=f".{os.getpid()}.{next(_WRITERS)}")
      self._closer = weakref.finalize(self, self._summaries.close)
      # At exit, close before multiprocessing's exit handler (registered when tensorboardX was
      # imported, so it runs after this one) shuts down the queue of tensorboardX's thread.
      self._closer.atexit = False
      atexit.register(self._closer)
    for name, value in metrics.items():
      if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        self._summaries.add_scalar(f"{split}/{name}", float(value), int(step))

  def keep_only(self, keep) -> int:
    """Rewrites metrics.jsonl with the records for which `keep(record)` is true (atomically:
    a new file renamed over the old one); returns how many were dropped. A resumed run drops
    the records written after its checkpoint, which it writes again."""
    if not self.enabled or not storage.exists(self.path):
      return 0
    records = read_metrics(self.workdir)
    kept = [r for r in records if keep(r)]
    if len(kept) == len(records):
      return 0
    self._lines.rewrite([json.dumps(r) for r in kept])
    return len(records) - len(kept)

  def close(self) -> None:
    """Writes every pending scalar to the event file and closes it."""
    if self._closer is not None:
      atexit.unregister(self._closer)
      self._closer()
      self._summaries = self._closer = None


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """All records of `<workdir>/metrics.jsonl` (empty if none). A last line cut short (a run
  killed while writing it) is left out; a damaged line elsewhere raises."""
  path = RunDir(workdir).metrics
  text = storage.read_text(path)
  if text is None:
    return []
  lines = [line for line in text.splitlines(keepends=True) if line.strip()]
  records = []
  for i, line in enumerate(lines):
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      if i < len(lines) - 1 or line.endswith("\n"):
        raise ValueError(f"{path}: line {i + 1} is not a JSON record; repair or remove it.")
  return records
