"""The language-model family: a causal decoder scored on next tokens, in bits per character.

Batches are character-LM windows `{"inputs", "targets", "mask"}` (position i of the logits is
scored against targets[:, i] where the mask is nonzero), or plain `inputs` that predict
themselves shifted by one (id 0 is padding). The best checkpoint is the one with the lowest
validation loss; results add bits per character (loss / ln 2) for test and validation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

import models
from attention import kinds as attention_kinds
from lra.tasks.base import Task, eval_weights, weighted_sums
from models import memory as memory_lib


@dataclasses.dataclass(frozen=True)
class LanguageModelTask(Task):
  """Next-token prediction with the causal `models.LanguageModel`."""

  def build_model(self, model_cfg: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    return models.LanguageModel(model_cfg, rngs=rngs)

  def batch_spec(self, data_cfg: ml_collections.ConfigDict, batch_size: int,
                 split: str = "train") -> dict[str, jax.ShapeDtypeStruct]:
    """Character windows: inputs, targets, mask int32 [B, L]; L is max_length in training and
    eval_length (when set) in evaluation."""
    length = int(data_cfg.max_length)
    if split != "train":
      length = int(data_cfg.get("eval_length", 0) or length)
    window = jax.ShapeDtypeStruct((batch_size, length), jnp.int32)
    return eval_weights({"inputs": window, "targets": window, "mask": window}, batch_size, split)

  def check_layers(self, kinds: Sequence[str]) -> None:
    for kind in kinds:
      reason = attention_kinds.get(kind).causal
      if reason is not True:
        raise ValueError(f"task {self.name!r} trains a causal language model but attention "
                         f"{kind!r} cannot be causal: {reason}")

  def init_state(self, model_cfg: Mapping[str, Any], batch_size: int):
    """With `model.memory_length` > 0: the Transformer-XL (and compressed) memory of every
    batch row, carried from step to step (each row a contiguous stream; models/memory.py)."""
    m_len = int(model_cfg.get("memory_length", 0) or 0)
    if not m_len:
      return None
    return memory_lib.init_state(
        int(model_cfg["num_layers"]), batch_size, int(model_cfg["emb_dim"]), m_len,
        int(model_cfg.get("compressed_length", 0) or 0))

  def objective_with_state(self, model, batch: Mapping[str, jax.Array], rng, state):
    """`objective` over the memory `state`; the attention-reconstruction loss adds only its
    gradient (value zero), so the reported loss stays the next-token loss."""
    logits, state, recon = model(batch["inputs"], rng=rng, memory=state)
    sums = self._sums(logits, batch)
    sums["loss_sum"] = sums["loss_sum"] + sums["weight"] * (recon - jax.lax.stop_gradient(recon))
    return sums, state

  def objective(self, model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
    """Next-token sums; `weight` counts the scored tokens (eval `weights` multiply the mask).

    A model with a memory reads each window in segments of `segment_length`, in order, from an
    empty memory (evaluation windows are independent; see docs/recurrence.md)."""
    inputs = batch["inputs"]
    seg = int(getattr(model, "segment_length", 0) or 0)
    if not seg:
      return self._sums(model(inputs, rng=rng), batch)
    state, logits = model.init_memory(inputs.shape[0]), []
    for start in range(0, inputs.shape[1], seg):
      out, state, _ = model(inputs[:, start:start + seg], rng=rng, memory=state)
      logits.append(out)
    return self._sums(jnp.concatenate(logits, axis=1), batch)

  def _sums(self, logits, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    inputs = batch["inputs"]                                               # logits [B, L, V]
    if "targets" in batch:
      targets = batch["targets"]                                           # [B, L]
      mask = batch["mask"] if "mask" in batch else targets > 0
    else:
      logits = logits[:, :-1]                                              # [B, L-1, V]
      targets = inputs[:, 1:]                                              # [B, L-1]
      mask = targets > 0
    weights = mask.astype("float32")
    if "weights" in batch:
      weights = weights * batch["weights"].astype("float32")[:, None]
    return weighted_sums(logits, targets, weights)

  def derived_metrics(self, metrics: Mapping[str, float]) -> dict[str, float]:
    return {"bpc": metrics["loss"] / math.log(2.0)}

  def better(self, metrics: Mapping[str, float], best: Mapping[str, Any]) -> bool:
    return metrics["loss"] < best.get("loss", float("inf"))

  def result_fields(self, *, test_best, test_final, final_validation, best) -> dict[str, Any]:
    return {"test_bpc": test_best["bpc"], "final_test_bpc": test_final["bpc"],
            "final_validation_bpc": final_validation["bpc"],
            "best_validation_bpc": best.get("loss", float("nan")) / math.log(2.0)}

  def result_line(self, results: Mapping[str, Any], where: str) -> str:
    return (f"test bits per character {results['test_bpc']:.4f} (uniform over bytes: 8), best "
            f"validation {results['best_validation_bpc']:.4f} at step "
            f"{results['best_validation_step']}; results in {where}")
