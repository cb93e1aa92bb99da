"""The Task object: everything that differs between tasks, asked for by the trainer.

A task is its data (a random-access source per split, `prepare` and `status` for `lra data`) plus
a family: the model it trains, its objective (summed loss and metrics of a batch), the metrics
derived from those sums, which validation result is better (best-checkpoint selection), the
fields it adds to `results.json` and the last line a run prints. The trainer never asks what kind
of task it runs; a new family is a subclass of `Task` in its own file (see `classification.py`
and `language_model.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx


def weighted_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array
                  ) -> dict[str, jax.Array]:
  """Cross-entropy and correct predictions summed with `weights` (0 for padding or filler)."""
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [...]
  correct = predicted(logits, targets).astype(jnp.float32)
  return {"loss_sum": jnp.sum(loss * weights), "correct": jnp.sum(correct * weights),
          "weight": jnp.sum(weights)}


def predicted(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """`jnp.argmax(logits, axis=-1) == targets` (bool `[...]`), without an arg-reduction.

  argmax is the first index of the largest logit, NaN counting as the largest. So the target t
  is the argmax exactly when no logit beats it: none is larger, none at a smaller index is
  equal, and no NaN stands anywhere (before t only, when t's own logit is NaN). A target
  outside `[0, V)` is never predicted. XLA:CPU runs argmax's (value, index) reduction one
  element at a time: over the 8,193 ids of an MQAR batch it took 19 ms of a 335 ms training
  step, these comparisons (one max-like pass) 2 ms.
  """
  v = logits.shape[-1]
  t = targets[..., None].astype(jnp.int32)                                # [..., 1]
  inside = (t >= 0) & (t < v)
  x_t = jnp.take_along_axis(logits, jnp.clip(t, 0, v - 1), axis=-1)     # [..., 1]
  ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  nan = jnp.isnan(logits)
  beaten = ((logits > x_t) | ((logits == x_t) & (ids < t))
            | (nan & ((ids < t) | ~jnp.isnan(x_t))))
  return (inside & ~jnp.any(beaten, axis=-1, keepdims=True))[..., 0]


def eval_weights(spec: dict[str, jax.ShapeDtypeStruct], batch_size: int, split: str
                 ) -> dict[str, jax.ShapeDtypeStruct]:
  """`spec` plus the evaluation batches' `weights` [B] float32 (0 for filler examples)."""
  if split != "train":
    spec["weights"] = jax.ShapeDtypeStruct((batch_size,), jnp.float32)
  return spec


def example_weights(batch: Mapping[str, jax.Array]) -> jax.Array:
  """Per-example weights: the eval batch's `weights` (0 for filler examples), else ones."""
  if "weights" in batch:
    return batch["weights"].astype(jnp.float32)
  return jnp.ones(batch["targets"].shape[:1], jnp.float32)


@dataclasses.dataclass(frozen=True)
class Task:
  """A task: its name, vocabulary and classes, its data functions and its family's behaviour.

  `get_source(data_cfg, split)` returns a random-access source of examples for "train",
  "validation" and "test"; `prepare(data_cfg)` builds the dataset if it is missing (raising
  `lra.data.archives.DataMissingError` naming the file to get) and returns its folder;
  `status(data_cfg)` says whether it is ready (`lra data status`).
  """

  name: str
  vocab_size: int
  num_classes: int
  get_source: Callable[[ml_collections.ConfigDict, str], Any]
  prepare: Callable[[ml_collections.ConfigDict], str]
  status: Callable[[ml_collections.ConfigDict], Any]
  pad_id: int = 0

  # ---- the family: subclasses override these.

  def build_model(self, model_cfg: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    """The NNX model for `model_cfg` (the `config.model` fields plus vocab, classes, length)."""
    raise NotImplementedError(f"{type(self).__name__} does not define its model.")

  def batch_spec(self, data_cfg: ml_collections.ConfigDict, batch_size: int,
                 split: str = "train") -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes and dtypes of a global batch of `split` as the data pipeline yields it
    (evaluation batches add `weights` [B] float32), without reading any data: what
    `lra.preflight` compiles the steps for."""
    raise NotImplementedError(f"{type(self).__name__} does not describe its batches.")

  def check_layers(self, kinds: Sequence[str]) -> None:
    """Raises ValueError when the task cannot train with these per-layer attention kinds."""
    del kinds

  def causal_attention(self, model_cfg: Mapping[str, Any]) -> bool | None:
    """True when every attention layer of the model is causal; None when it is not known
    without building the model (bidirectional layers, or causal ones beside them). The
    backend choice of the lines a run prints (`attention.backends.choose`) takes it: a band
    layer goes to cuDNN's one-sided window only when it is known to be causal."""
    del model_cfg
    return None

  def objective(self, model: nnx.Module, batch: Mapping[str, jax.Array], rng
                ) -> dict[str, jax.Array]:
    """Sums over a batch: `loss_sum`, `correct`, `weight`; `rng` is None in evaluation."""
    raise NotImplementedError(f"{type(self).__name__} does not define its objective.")

  def init_state(self, model_cfg: Mapping[str, Any], batch_size: int) -> Any:
    """State the task carries across training steps (a pytree, checkpointed with the train
    state), or None; with one the trainer calls `objective_with_state` instead of `objective`."""
    del model_cfg, batch_size
    return None

  def objective_with_state(self, model: nnx.Module, batch: Mapping[str, jax.Array], rng,
                           state: Any) -> tuple[dict[str, jax.Array], Any]:
    """(sums as `objective`, the next state) of one training step."""
    return self.objective(model, batch, rng), state

  def derived_metrics(self, metrics: Mapping[str, float]) -> dict[str, float]:
    """Metrics computed from the summarised loss and accuracy (for example bits per char)."""
    del metrics
    return {}

  def chance_reference(self) -> tuple[str, int] | None:
    """The run's chance reference, or None: (its `results.json` key, the number of distinct ids
    `chance_ids` returns). The trainer counts those ids over the test split and records the
    share of the most frequent one (the majority class of a classifier)."""
    return None

  def chance_ids(self, batch: Mapping[str, Any]) -> np.ndarray:
    """The ids of one evaluation batch (host arrays) that the chance reference counts."""
    del batch
    return np.zeros(0, np.int64)

  def better(self, metrics: Mapping[str, float], best: Mapping[str, Any]) -> bool:
    """Whether validation `metrics` beat the best so far (accuracy by default)."""
    return metrics["accuracy"] > best["accuracy"]

  def result_fields(self, *, test_best: Mapping[str, float], test_final: Mapping[str, float],
                    final_validation: Mapping[str, float], best: Mapping[str, Any]
                    ) -> dict[str, Any]:
    """Fields this family adds to `results.json`."""
    del test_best, test_final, final_validation, best
    return {}

  def result_line(self, results: Mapping[str, Any], where: str) -> str:
    """The last line of a finished run; `where` is the path of its results.json."""
    line = f"test accuracy {results['test_accuracy']:.4f}"
    rate = results.get("majority_class_rate")
    if isinstance(rate, (int, float)) and results["test_accuracy"] < rate:
      line += (f" (below the majority class {rate:.4f}: always answering the most frequent "
               f"label does better; train longer or at a larger --size)")
    elif rate is not None:
      line += f" (majority class {rate:.4f})"
    return line + (f", best validation accuracy {results['best_validation_accuracy']:.4f} at "
                   f"step {results['best_validation_step']}; results in {where}")
