"""The self-pretraining family: a task's inputs, their labels unused, as a language-model task.

`get_task("<task>+<objective>")` wraps any classification task (its data, its model) in a
`PretrainingTask`. The model is the task's own (`Classifier`, `DualEncoder`), trained through
its encoder by `models.pretraining`, so the run's parameters load as they are into the
fine-tuning run (`config.init_from`; `config.protocol = "spt"` chains both, configs/common.py
`apply_protocol`). Objectives, with `config.model.mask_rate`:

  * `mlm`: BERT's masked LM. Each real token is chosen with probability mask_rate; a chosen
    token is shown as [MASK] (80%), as a uniformly drawn token (10%) or unchanged (10%), and
    predicted. The 10% unchanged are visible to their own prediction by BERT's design.
  * `clm`: next-token prediction with the encoder built causal (kinds that cannot be causal are
    refused with the reason).
  * `mpnet`: MPNet's masked and permuted LM: a permutation per example, its last
    max(1, round(mask_rate * n)) tokens predicted, each from the tokens before it in the
    permutation and the mask tokens that carry every position (`attention.masks`).

Evaluation draws its masks and permutations from a fixed key, so every validation pass scores
the same predictions. `accuracy` is the accuracy on the predicted tokens; the best checkpoint
has the lowest validation loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from attention import kinds as attention_kinds
from lra.tasks.base import Task, weighted_sums
from lra.tasks.classification import ClassificationTask
from models import pretraining as heads
from models.encoder import Encoder, layer_specs, sublayer_order

EVAL_KEY = 20240101      # the fixed key of evaluation masks and permutations
BERT_SPLIT = (0.8, 0.1)  # of the chosen tokens: [MASK], random token (the rest unchanged)


def bert_corruption(tokens: jax.Array, rate: float, vocab_size: int, key
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """BERT's 80/10/10: (inputs with the random replacements, shown-as-[MASK] bool, chosen bool),
  all `[B, L]`; padding (id 0) is never chosen, random tokens are drawn from 1 .. vocab-1."""
  k_choose, k_split, k_token = jax.random.split(key, 3)
  chosen = (tokens > 0) & (jax.random.uniform(k_choose, tokens.shape) < rate)
  u = jax.random.uniform(k_split, tokens.shape)
  shown_as_mask = chosen & (u < BERT_SPLIT[0])
  replaced = chosen & (u >= BERT_SPLIT[0]) & (u < BERT_SPLIT[0] + BERT_SPLIT[1])
  random_tokens = jax.random.randint(k_token, tokens.shape, 1, vocab_size)
  return jnp.where(replaced, random_tokens, tokens), shown_as_mask, chosen


def permutation(tokens: jax.Array, rate: float, key) -> tuple[jax.Array, jax.Array]:
  """One random permutation of each example's real tokens: (ranks int `[B, L]`, the place of
  each token in it; predicted bool `[B, L]`, its last max(1, round(rate * n)) tokens)."""
  real = tokens > 0
  noise = jnp.where(real, jax.random.uniform(key, tokens.shape), 2.0)     # padding last
  ranks = jnp.argsort(jnp.argsort(noise, axis=1), axis=1)
  n = real.sum(axis=1, keepdims=True)
  count = jnp.minimum(jnp.maximum(jnp.round(rate * n), 1), n).astype(ranks.dtype)
  return ranks, real & (ranks >= n - count)


@dataclasses.dataclass(frozen=True)
class PretrainingTask(Task):
  """`objective_name` ("mlm", "clm" or "mpnet") over the inputs of classification task `base`."""

  base: Any = None
  objective_name: str = "mlm"

  @property
  def inputs(self) -> tuple[str, ...]:
    return tuple(getattr(self.base, "inputs", ("inputs",)))

  def build_model(self, model_cfg: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    model = self.base.build_model(model_cfg, rngs)
    if self.objective_name == "clm":   # the same parameters, attention made causal
      model.encoder = Encoder(model_cfg, cls_token=model.encoder.cls_token, causal=True,
                              rngs=rngs)
    order = sublayer_order(model_cfg["num_layers"], str(model_cfg.get("sublayers", "") or ""),
                           int(model_cfg.get("sandwich", 0) or 0))
    specs = layer_specs(model_cfg["attention"], model_cfg.get("layer_attention", ()),
                        order.count("s"))
    model.pretraining = (self.objective_name, float(model_cfg.get("mask_rate", 0.15)),
                         tuple(tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                            for k, v in s.items())) for s in specs))
    return model

  def batch_spec(self, data_cfg: ml_collections.ConfigDict, batch_size: int,
                 split: str = "train") -> dict[str, jax.ShapeDtypeStruct]:
    return self.base.batch_spec(data_cfg, batch_size, split)

  def check_layers(self, kinds: Sequence[str]) -> None:
    if self.objective_name == "clm":
      for kind in kinds:
        attention_kinds.get(kind).check_causal()
    if self.objective_name == "mpnet":
      attention_kinds.check_permutation(kinds)

  def logits_and_targets(self, model, tokens: jax.Array, key, rng):
    """(logits `[B, L', V]`, targets `[B, L']`, scored bool `[B, L']`) of one token field."""
    objective, rate, specs = model.pretraining
    encoder = model.encoder
    if objective == "mlm":
      inputs, shown, chosen = bert_corruption(tokens, rate, self.vocab_size, key)
      return heads.masked_logits(encoder, inputs, shown, rng=rng), tokens, chosen
    if objective == "clm":
      logits = heads.causal_logits(encoder, tokens, rng=rng)
      return logits[:, :-1], tokens[:, 1:], tokens[:, 1:] > 0
    ranks, predicted = permutation(tokens, rate, key)
    logits = heads.mpnet_logits(encoder, [dict(s) for s in specs], tokens, ranks, predicted,
                                rng=rng)
    return logits, tokens, predicted

  def objective(self, model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
    key = jax.random.PRNGKey(EVAL_KEY) if rng is None else jax.random.fold_in(rng, 7)
    example = batch["weights"].astype(jnp.float32) if "weights" in batch else None
    total = None
    for i, field in enumerate(self.inputs):
      model_rng = None if rng is None else jax.random.fold_in(rng, 100 + i)
      logits, targets, scored = self.logits_and_targets(
          model, batch[field], jax.random.fold_in(key, i), model_rng)
      weights = scored.astype(jnp.float32)
      if example is not None:
        weights = weights * example[:, None]
      sums = weighted_sums(logits, targets, weights)
      total = sums if total is None else {k: total[k] + sums[k] for k in total}
    return total

  def better(self, metrics: Mapping[str, float], best: Mapping[str, Any]) -> bool:
    return metrics["loss"] < best.get("loss", float("inf"))

  def chance_reference(self) -> tuple[str, int] | None:
    return ("most_frequent_token_rate", self.vocab_size)

  def chance_ids(self, batch: Mapping[str, Any]) -> np.ndarray:
    """The real tokens of the batch's real examples: every objective predicts tokens drawn from
    them (uniformly for mlm and mpnet, all but the first for clm), so the share of the most
    frequent is the accuracy of always predicting it."""
    real = np.asarray(batch["weights"]) > 0
    tokens = np.concatenate([np.asarray(batch[f])[real].reshape(-1) for f in self.inputs])
    return tokens[tokens > 0]

  def result_line(self, results: Mapping[str, Any], where: str) -> str:
    line = (f"{self.objective_name} pretraining: test accuracy on the predicted tokens "
            f"{results['test_accuracy']:.4f}")
    if "most_frequent_token_rate" in results:
      line += f" (most frequent token {results['most_frequent_token_rate']:.4f})"
    return f"{line}, loss {results['test_loss']:.4f}; results in {where}"


def pretraining_task(base: Task, objective: str) -> PretrainingTask:
  """The pretraining task `objective` over `base`'s data and model."""
  if not isinstance(base, ClassificationTask):
    raise ValueError(f"task {base.name!r} is not a classification task; self-pretraining "
                     f"uses the inputs of classification tasks.")
  return PretrainingTask(name=f"{base.name}+{objective}", vocab_size=base.vocab_size,
                         num_classes=base.num_classes, get_source=base.get_source,
                         prepare=base.prepare, status=base.status, pad_id=base.pad_id,
                         base=base, objective_name=objective)
