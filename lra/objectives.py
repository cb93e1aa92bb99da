"""Losses and metric sums for each model family (`task.MODEL`): one literal table.

Each objective maps (model, batch, rng) to sums over the batch: `loss_sum` (cross-entropy),
`correct`, and `weight` (the number of examples, or of scored tokens for language models).
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
  """Next-token sums; `weight` counts the scored tokens.

  With explicit `targets` `[B, L]` (the character-LM windows), position i of the logits is
  scored against targets[:, i] where `mask` `[B, L]` is nonzero (every real target when there is
  no mask). Without them, inputs `[B, L]` predict themselves shifted by one and id 0 is padding.
  Eval batches' per-example `weights` multiply either mask.
  """
  inputs = batch["inputs"]
  logits = model(inputs, rng=rng)                                          # [B, L, V]
  if "targets" in batch:
    targets = batch["targets"]                                             # [B, L]
    mask = batch["mask"] if "mask" in batch else targets > 0
  else:
    logits = logits[:, :-1]                                                # [B, L-1, V]
    targets = inputs[:, 1:]                                                # [B, L-1]
    mask = targets > 0
  weights = mask.astype(jnp.float32)
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
