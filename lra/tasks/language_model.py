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
from lra.data.charlm import stream_rows
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
    eval_length (when set) in evaluation, or with `data.eval_streams` the row length of the
    split's size in `data.split_sizes` (a fallback corpus used instead has shorter rows)."""
    length = int(data_cfg.max_length)
    if split != "train":
      length = int(data_cfg.get("eval_length", 0) or length)
      rows, sizes = int(data_cfg.get("eval_streams", 0) or 0), data_cfg.get("split_sizes")
      if rows and sizes:
        length = stream_rows(sizes[1 if split == "validation" else 2], rows)[1]
    window = jax.ShapeDtypeStruct((batch_size, length), jnp.int32)
    return eval_weights({"inputs": window, "targets": window, "mask": window}, batch_size, split)

  def check_layers(self, kinds: Sequence[str]) -> None:
    for kind in kinds:
      reason = attention_kinds.get(kind).causal
      if reason is not True:
        raise ValueError(f"task {self.name!r} trains a causal language model but attention "
                         f"{kind!r} cannot be causal: {reason}")

  def causal_attention(self, model_cfg: Mapping[str, Any]) -> bool | None:
    del model_cfg
    return True   # every layer of the decoder

  def init_state(self, model_cfg: Mapping[str, Any], batch_size: int):
    """With `model.memory_length` > 0: the Transformer-XL (and compressed) memory of every
    batch row, carried from step to step (each row a contiguous stream; models/memory.py)."""
    m_len = int(model_cfg.get("memory_length", 0) or 0)
    if not m_len:
      return None
    return memory_lib.init_state(
        memory_lib.memory_layers(model_cfg), batch_size, int(model_cfg["emb_dim"]), m_len,
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

    A model with a memory reads each row in segments of `segment_length`, in order, from an
    empty memory of `eval_memory_length` states carried from segment to segment (a scan; the
    row zero-padded to a whole number of segments), relative distances clamped to `clamp_len`,
    and with `same_length` every query seeing as many keys as the memory holds.
    A row is an evaluation window, or with `data.eval_streams` a contiguous stretch of the split
    (docs/recurrence.md)."""
    inputs = batch["inputs"]
    seg = int(getattr(model, "segment_length", 0) or 0)
    if not seg:
      return self._sums(model(inputs, rng=rng), batch)
    if "targets" in batch:
      targets = batch["targets"]
      mask = batch["mask"] if "mask" in batch else targets > 0
    else:                       # plain inputs predict themselves shifted by one
      targets = jnp.pad(inputs[:, 1:], ((0, 0), (0, 1)))
      mask = targets > 0
    b, length = inputs.shape
    count = -(-length // seg)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, count * seg - length)))
    split = lambda x: pad(x).reshape(b, count, seg).swapaxes(0, 1)          # [S, B, seg]
    weights = batch["weights"] if "weights" in batch else jnp.ones((b,), jnp.float32)
    clamp = int(getattr(model, "clamp_len", 0) or 0)
    same_length = bool(getattr(model, "same_length", False))

    def step(carry, xs):
      state, total = carry
      tokens, t, m = xs
      logits, state, _ = model(tokens, rng=rng, memory=state, clamp_len=clamp,
                               same_length=same_length)
      sums = self._sums(logits, {"inputs": tokens, "targets": t, "mask": m, "weights": weights})
      return (state, jax.tree.map(jnp.add, total, sums)), None

    zero = {"loss_sum": jnp.zeros(()), "correct": jnp.zeros(()), "weight": jnp.zeros(())}
    state = model.init_memory(b, getattr(model, "eval_memory_length", None))
    (_, total), _ = jax.lax.scan(step, (state, zero),
                                 (split(inputs), split(targets), split(mask.astype(jnp.int32))))
    return total

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
