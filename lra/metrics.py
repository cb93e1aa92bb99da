"""Metrics: summed statistics from the jitted steps, and a JSON-lines log in the workdir.

Steps return sums (`loss_sum`, `correct`, `weight`, and for language models `tokens`), never
means, so batches with padding examples and multi-device splits add up exactly; `summarise`
turns sums into loss, accuracy and, for language models, bits per character.

TensorBoard: the pinned stack has no TensorFlow-free summary writer (`flax.metrics.tensorboard`
imports TensorFlow; tensorboardX and clu are not dependencies), so metrics go to
`<workdir>/metrics.jsonl`, one JSON object per line: `{"step": ..., "split": ..., ...}`.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping

import jax
import numpy as np


def summarise(sums: Mapping[str, Any], *, bits_per_char: bool = False) -> dict[str, float]:
  """Sums from steps -> {"loss", "accuracy"[, "bpc"]}, weighted by the number of examples."""
  sums = {k: float(np.asarray(v)) for k, v in sums.items()}
  weight = max(sums.get("weight", 0.0), 1e-9)
  out = {"loss": sums["loss_sum"] / weight, "accuracy": sums["correct"] / weight,
         "examples": sums.get("weight", 0.0)}
  if bits_per_char:
    out["bpc"] = out["loss"] / math.log(2.0)
  return out


def add_sums(total: dict[str, Any] | None, sums: Mapping[str, Any]) -> dict[str, Any]:
  """Accumulates device sums (kept on device until read)."""
  if total is None:
    return dict(sums)
  return {k: total[k] + sums[k] for k in total}


class MetricWriter:
  """Appends metric records to `<workdir>/metrics.jsonl` (process 0 only)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.enabled = jax.process_index() == 0

  def write(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
    for name, value in metrics.items():
      if isinstance(value, float) and not math.isfinite(value):
        raise FloatingPointError(
            f"{split} {name} is {value} at step {step}: training diverged (try a lower "
            f"learning rate or gradient clipping).")
    if not self.enabled:
      return
    record = {"step": int(step), "split": split, "time": round(time.time(), 3), **metrics}
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """All records of `<workdir>/metrics.jsonl` (empty if none)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
