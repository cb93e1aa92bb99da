"""The optimizer of every run: AdamW with the LRA learning-rate schedules."""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """The LRA schedules: "rsqrt" (warmup then 1/sqrt(step)), "cosine" or "constant"."""
  base, warmup = float(config.learning_rate), max(int(config.warmup_steps), 0)
  total = int(config.num_train_steps)
  if config.schedule == "rsqrt":
    def rsqrt(step):
      step = jnp.asarray(step, jnp.float32)
      w = max(warmup, 1)
      return base * jnp.minimum(1.0, step / w) / jnp.sqrt(jnp.maximum(step, w))
    return rsqrt
  if config.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, base, max(warmup, 1), max(total, warmup + 1))
  if config.schedule == "constant":
    return optax.linear_schedule(0.0, base, max(warmup, 1))
  raise ValueError(f"unknown schedule {config.schedule!r}; valid: rsqrt, cosine, constant.")


def make_optimizer(config: ml_collections.ConfigDict, decay_mask=None
                   ) -> optax.GradientTransformation:
  """AdamW (decoupled weight decay) with the schedule, after optional global-norm clipping.
  `decay_mask` (params -> bools) leaves the parameters it marks False out of the weight decay
  (adaptive span's spans, which have their own L1 term); None decays every parameter."""
  parts = []
  if config.grad_clip and config.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(float(config.grad_clip)))
  parts.append(optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                           eps=config.adam_eps, weight_decay=config.weight_decay,
                           mask=decay_mask))
  return optax.chain(*parts)
