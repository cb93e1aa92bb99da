"""The sequence-to-sequence family: an encoder-decoder (LED) trained by teacher forcing and
evaluated by greedy decoding.

Batches are `inputs` `[B, L]` and `targets` `[B, T]` (the output tokens, EOS last, 0 = padding);
the decoder reads BOS then the targets shifted right. Every sum is per example, so a batch's
`weight` is its number of examples:
- `loss_sum`: each example's mean token cross-entropy (teacher forced), summed;
- `correct`: exact matches (every target token right, EOS included, nothing after it); in
  training these are the teacher-forced argmaxes, in evaluation the greedy decoding with the
  key-value cache, so `accuracy` is the exact match;
- `token_correct`, `tokens`: target tokens right (position by position) and target tokens.
The best checkpoint is the one with the highest validation exact match; results add the test
exact match and token accuracy; the run's last line ends with the test exact match.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from lra.tasks.base import Task, eval_weights, example_weights
from models import decoding
from models.seq2seq import LED


@dataclasses.dataclass(frozen=True)
class Seq2SeqTask(Task):
  """inputs `[B, L]` -> targets `[B, T]` with `models.seq2seq.LED`; `bos_id` starts decoding and
  `eos_id` ends a target."""

  bos_id: int = 1
  eos_id: int = 2
  target_length: Any = None    # data_cfg -> T, the target tokens per example (EOS included)

  def build_model(self, model_cfg: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    return LED(model_cfg, rngs=rngs)

  def batch_spec(self, data_cfg: ml_collections.ConfigDict, batch_size: int,
                 split: str = "train") -> dict[str, jax.ShapeDtypeStruct]:
    """inputs int32 [B, max_length], targets int32 [B, T] (0 = padding)."""
    return eval_weights({
        "inputs": jax.ShapeDtypeStruct((batch_size, int(data_cfg.max_length)), jnp.int32),
        "targets": jax.ShapeDtypeStruct((batch_size, int(self.target_length(data_cfg))),
                                        jnp.int32)}, batch_size, split)

  def check_layers(self, kinds: Sequence[str]) -> None:
    del kinds  # the encoder is bidirectional: every kind can run there

  def objective(self, model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
    targets = batch["targets"]                                             # [B, T]
    mask = targets > 0
    memory, memory_mask = model.encode(batch["inputs"], rng=None if rng is None
                                       else jax.random.fold_in(rng, 0))
    logits = model.decode(memory, memory_mask, decoding.shift_right(targets, self.bos_id),
                          rng=None if rng is None else jax.random.fold_in(rng, 1))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
    tokens = mask.sum(axis=1).astype(jnp.float32)                          # [B]
    per_example = jnp.sum(jnp.where(mask, loss, 0.0), axis=1) / jnp.maximum(tokens, 1.0)
    if rng is None:   # evaluation: what the model writes by itself
      predicted = decoding.greedy(model, memory, memory_mask, length=targets.shape[1],
                                  bos_id=self.bos_id, eos_id=self.eos_id)
    else:
      predicted = jnp.where(mask, jnp.argmax(logits, axis=-1), 0)
    same = predicted == targets                                            # [B, T]
    w = example_weights(batch)                                             # [B]
    return {"loss_sum": jnp.sum(per_example * w),
            "correct": jnp.sum(jnp.all(same, axis=1) * w),
            "weight": jnp.sum(w),
            "token_correct": jnp.sum(jnp.sum(same & mask, axis=1) * w),
            "tokens": jnp.sum(tokens * w)}

  def derived_metrics(self, metrics: Mapping[str, float]) -> dict[str, float]:
    out = {"exact_match": metrics["accuracy"]}
    if "tokens" in metrics:
      out["token_accuracy"] = metrics["token_correct"] / max(metrics["tokens"], 1e-9)
    return out

  def result_fields(self, *, test_best, test_final, final_validation, best) -> dict[str, Any]:
    return {"test_exact_match": test_best["exact_match"],
            "test_token_accuracy": test_best["token_accuracy"],
            "final_test_exact_match": test_final["exact_match"],
            "final_validation_exact_match": final_validation["exact_match"],
            "best_validation_exact_match": best["accuracy"]}

  def result_line(self, results: Mapping[str, Any], where: str) -> str:
    return (f"test token accuracy {results['test_token_accuracy']:.4f}, best validation exact "
            f"match {results['best_validation_exact_match']:.4f} at step "
            f"{results['best_validation_step']}; results in {where}; test exact match "
            f"{results['test_exact_match']:.4f}")
