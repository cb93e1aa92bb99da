"""Classification families: one sequence to a label (`ClassificationTask`, the LRA encoder
classifier) and a pair of sequences to a label (`MatchingTask`, the retrieval dual encoder)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

import models
from lra.tasks.base import Task, eval_weights, example_weights, weighted_sums


@dataclasses.dataclass(frozen=True)
class ClassificationTask(Task):
  """inputs `[B, L]`, targets `[B]`; the encoder classifier; accuracy, best by accuracy."""

  inputs: tuple[str, ...] = dataclasses.field(default=("inputs",), init=False)  # token fields

  def build_model(self, model_cfg: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    return models.Classifier(model_cfg, rngs=rngs)

  def batch_spec(self, data_cfg: ml_collections.ConfigDict, batch_size: int,
                 split: str = "train") -> dict[str, jax.ShapeDtypeStruct]:
    """Each of `inputs` int32 [B, max_length] (0 = padding), targets int32 [B]."""
    tokens = jax.ShapeDtypeStruct((batch_size, int(data_cfg.max_length)), jnp.int32)
    spec = {name: tokens for name in self.inputs}
    spec["targets"] = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    return eval_weights(spec, batch_size, split)

  def chance_reference(self) -> tuple[str, int] | None:
    return ("majority_class_rate", self.num_classes)

  def chance_ids(self, batch: Mapping[str, Any]) -> np.ndarray:
    """The labels of the batch's real examples."""
    return np.asarray(batch["targets"])[np.asarray(batch["weights"]) > 0].reshape(-1)

  def objective(self, model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
    logits = model(batch["inputs"], rng=rng)                               # [B, C]
    return weighted_sums(logits, batch["targets"], example_weights(batch))


@dataclasses.dataclass(frozen=True)
class MatchingTask(ClassificationTask):
  """inputs1, inputs2 `[B, L]`, targets `[B]`: the shared-weight dual encoder [u, v, u*v, u-v]."""

  inputs: tuple[str, ...] = dataclasses.field(default=("inputs1", "inputs2"), init=False)

  def build_model(self, model_cfg: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    return models.DualEncoder(model_cfg, rngs=rngs)

  def objective(self, model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
    logits = model(batch["inputs1"], batch["inputs2"], rng=rng)            # [B, C]
    return weighted_sums(logits, batch["targets"], example_weights(batch))
