"""One point of the LRA Text `base` speed study: its config overrides and its train step, compiled.

Shared by `lra_speed.py` (one process per point), `lra_interleaved.py` (several points in one
process, their steps taken in turn) and `lra_flops.py` (multiply work). `identity` is the model
of `dot_product` with the layer's attention primitive replaced by the values themselves.
"""

from __future__ import annotations

import time

from attention import kinds as kinds_lib

DENSE, IDENTITY = "dot_product", "identity"
WINDOW = 128                    # configs/text.py: the base size's window of the local kinds
QUICK_MODEL = {"model.num_layers": 1, "model.emb_dim": 32, "model.qkv_dim": 32,
               "model.num_heads": 2, "model.mlp_dim": 64, "model.classifier_dim": 32}


def overrides(kind: str, length: int, batch: int, quick: bool) -> list[tuple[str, str]]:
  """`--config.x=y` overrides of the Text base config for one point."""
  real = DENSE if kind == IDENTITY else kind
  out = {"data.max_length": length, "batch_size": batch, "eval_batch_size": batch}
  for name, value in kinds_lib.defaults(real, window=WINDOW, max_length=length).items():
    out[f"model.attention.{name}"] = value
  if quick:
    out.update(QUICK_MODEL)
  return [(k, v if isinstance(v, str) else repr(v)) for k, v in out.items()]


def status_kb(field: str) -> int:
  try:
    with open("/proc/self/status") as f:
      return next((int(x.split()[1]) for x in f if x.startswith(field + ":")), 0)
  except OSError:
    return 0


def identity_attention():
  """Makes the attention layer call `v -> v` instead of its primitive (padded queries -> 0, as
  every primitive does). The query and key projections are then unused and XLA drops them.
  Returns a function that puts the layer's primitives back."""
  import jax.numpy as jnp

  from attention import backends
  from models import attention_layer

  def identity(q, k, v=None, *, key_mask=None, **kwargs):
    del q, kwargs
    v = k if v is None else v           # shared-QK kinds are called as fn(qk, v)
    return v if key_mask is None else jnp.where(key_mask[:, :, None, None], v, 0.0)

  class Identity:   # the layer's view of attention.backends, every kind computing identity
    def __getattr__(self, name):
      return getattr(backends, name)

    @staticmethod
    def function(kind, implementation=backends.AUTO, **kwargs):
      del kind, implementation, kwargs
      return identity

  before = attention_layer.backends
  attention_layer.backends = Identity()
  return lambda: setattr(attention_layer, "backends", before)


class Point:
  """One point's train step, compiled: `info` (compile seconds, estimated peak, ...), `oom`
  (the reason when the estimate exceeds the free memory, else None); `allocate()` then `step()`
  (seconds of one training step on alternating random byte batches)."""

  def __init__(self, spec: dict):
    import jax

    import configs
    from lra import preflight, train

    jax.config.update("jax_enable_compilation_cache", False)  # compile time is measured
    kind, length, self.batch = spec["kind"], spec["length"], spec["batch"]
    restore = identity_attention() if kind == IDENTITY else None
    try:
      config = configs.build_config(
          "text", attention=DENSE if kind == IDENTITY else kind, size="base",
          overrides=overrides(kind, length, self.batch, spec["quick"]))
      t0 = time.perf_counter()
      self.trainer = train.Trainer.abstract(config)
      self.abstract = preflight.abstract_batch(self.trainer.task, config.data, self.batch,
                                               self.trainer.mesh, "train")
      program = preflight.Program.compile("train step", self.trainer.train_step,
                                          self.trainer.abstract_state(), self.abstract,
                                          self.trainer.abstract_rest)
      compile_s = time.perf_counter() - t0
    finally:
      if restore is not None:
        restore()
    self.compiled = program.compiled
    device = jax.devices()[0]
    self.info = dict(
        compile_s=compile_s, estimate_gb=program.peak / 1e9,
        attention=config.model.attention.to_dict(), device=f"{device.platform}: "
        f"{device.device_kind}", params=int(sum(
            x.size for x in jax.tree.leaves(self.trainer.abstract_state()["params"]))))
    free, _ = preflight.available_memory(jax.devices())
    self.oom = None
    if free is not None and program.peak > free:
      self.oom = f"estimated {program.peak / 1e9:.1f} GB > {free / 1e9:.1f} GB available: not run"

  def allocate(self) -> None:
    import numpy as np

    from lra import mesh as mesh_lib

    trainer = self.trainer
    trainer.allocate()
    rng = np.random.default_rng(0)

    def random_batch():
      arrays = {}
      for name, leaf in self.abstract.items():
        high = trainer.task.num_classes if name == "targets" else trainer.task.vocab_size
        low = 0 if name == "targets" else 1           # tokens 1.. : no padding
        arrays[name] = rng.integers(low, high, leaf.shape).astype(leaf.dtype)
      return mesh_lib.global_batch(arrays, trainer.mesh)

    self.batches = [random_batch(), random_batch()]
    self.state, self.rest = trainer.state, trainer.rest
    del trainer.state, trainer.params                  # the step donates (deletes) the state
    self.steps_run, self.sums = 0, None

  def step(self) -> float:
    import jax

    t0 = time.perf_counter()
    self.state, self.sums = self.compiled(self.state, self.batches[self.steps_run % 2],
                                          self.rest)
    jax.block_until_ready((self.state, self.sums))
    self.steps_run += 1
    return time.perf_counter() - t0

  def loss(self) -> float:
    return float(self.sums["loss_sum"]) / max(float(self.sums["weight"]), 1.0)
