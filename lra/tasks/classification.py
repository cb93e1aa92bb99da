"""Classification families: one sequence to a label (`ClassificationTask`, the LRA encoder
classifier) and a pair of sequences to a label (`MatchingTask`, the retrieval dual encoder)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
from flax import nnx

import models
from lra.tasks.base import Task, example_weights, weighted_sums


@dataclasses.dataclass(frozen=True)
class ClassificationTask(Task):
  """inputs `[B, L]`, targets `[B]`; the encoder classifier; accuracy, best by accuracy."""

  count_labels: bool = dataclasses.field(default=True, init=False)

  def build_model(self, model_cfg: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    return models.Classifier(model_cfg, rngs=rngs)

  def objective(self, model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
    logits = model(batch["inputs"], rng=rng)                               # [B, C]
    return weighted_sums(logits, batch["targets"], example_weights(batch))


@dataclasses.dataclass(frozen=True)
class MatchingTask(ClassificationTask):
  """inputs1, inputs2 `[B, L]`, targets `[B]`: the shared-weight dual encoder [u, v, u*v, u-v]."""

  def build_model(self, model_cfg: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    return models.DualEncoder(model_cfg, rngs=rngs)

  def objective(self, model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
    logits = model(batch["inputs1"], batch["inputs2"], rng=rng)            # [B, C]
    return weighted_sums(logits, batch["targets"], example_weights(batch))
