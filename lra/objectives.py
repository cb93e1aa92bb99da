"""Losses and metric sums for each model family (`task.MODEL`): one literal table.

Each objective maps (model, batch, rng) to sums over the batch: `loss_sum` (cross-entropy),
`correct`, and `weight` (the number of examples, or of predicted tokens for language models).
Eval batches carry a float `weights` field (0 for filler examples); train batches count every
example. The trainer divides sums only when it reports, so padding and device splits add up
exactly.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax


def _sums(logits, targets, weights) -> dict[str, jax.Array]:
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [...]
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return {"loss_sum": jnp.sum(loss * weights), "correct": jnp.sum(correct * weights),
          "weight": jnp.sum(weights)}


def _example_weights(batch: Mapping[str, jax.Array]) -> jax.Array:
  targets = batch["targets"]
  if "weights" in batch:
    return batch["weights"].astype(jnp.float32)
  return jnp.ones(targets.shape, jnp.float32)


def classification(model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
  """inputs `[B, L]`, targets `[B]` -> sums."""
  logits = model(batch["inputs"], rng=rng)                                 # [B, C]
  return _sums(logits, batch["targets"], _example_weights(batch))


def matching(model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
  """inputs1, inputs2 `[B, L]`, targets `[B]` -> sums (retrieval)."""
  logits = model(batch["inputs1"], batch["inputs2"], rng=rng)              # [B, C]
  return _sums(logits, batch["targets"], _example_weights(batch))


def language_modelling(model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
  """inputs `[B, L]` -> next-token sums over real target tokens (id 0 = padding)."""
  inputs = batch["inputs"]
  logits = model(inputs, rng=rng)[:, :-1]                                  # [B, L-1, V]
  targets = inputs[:, 1:]                                                  # [B, L-1]
  weights = (targets > 0).astype(jnp.float32)
  if "weights" in batch:
    weights = weights * batch["weights"].astype(jnp.float32)[:, None]
  return _sums(logits, targets, weights)


OBJECTIVES: dict[str, Callable[[Any, Mapping[str, jax.Array], Any], dict[str, jax.Array]]] = {
    "classifier": classification,
    "dual_encoder": matching,
    "lm": language_modelling,
}


def get(model_family: str):
  """The objective for a model family; lists the valid ones when unknown."""
  try:
    return OBJECTIVES[model_family]
  except KeyError:
    raise ValueError(f"no objective for model family {model_family!r}; valid: "
                     f"{', '.join(sorted(OBJECTIVES))}.") from None
