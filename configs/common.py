"""Pieces shared by the task configs: `parse_arg`, trainer defaults, the mesh and rules table.

`get_config(arg)` in a task file receives `arg` as "key=value,key=value" (for example
"attention=band,size=small"); `parse_arg(arg, **defaults)` turns it into a typed ConfigDict and
rejects unknown keys with the list of valid ones.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Mapping

import ml_collections

from attention import kinds

# Logical axis name (carried by parameters, see models/sharding.py) -> mesh axis or None.
AXIS_RULES = (
    ("vocab", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("length", None),
)


def _convert(text: str, default: Any) -> Any:
  if isinstance(default, bool):
    if text.lower() in ("1", "true", "yes", ""):
      return True
    if text.lower() in ("0", "false", "no"):
      return False
    raise ValueError(f"expected a boolean, got {text!r}.")
  if isinstance(default, int):
    return int(text)
  if isinstance(default, float):
    return float(text)
  return text


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
  """Parses "a=1,b=x" against `defaults` (which also fix each value's type)."""
  out = dict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"unknown config argument {key!r} in {arg!r}; valid arguments: "
                       f"{', '.join(sorted(defaults))}.")
    out[key] = _convert(value.strip(), defaults[key])
  return ml_collections.ConfigDict(out)


def trainer_defaults() -> ml_collections.ConfigDict:
  """Trainer fields with the LRA text-task defaults; task configs override them."""
  c = ml_collections.ConfigDict()
  c.task = ""
  c.seed = 0
  c.batch_size = 32
  c.eval_batch_size = 32
  c.num_train_steps = 5000
  c.log_every = 50
  c.eval_every = 500
  c.checkpoint_every = 1000
  c.keep_checkpoints = 3
  # Optimiser: AdamW with the LRA betas; schedule "rsqrt" (LRA: base * min(1, t/w) /
  # sqrt(max(t, w))), "cosine" (linear warmup then cosine to 0) or "constant" (after warmup).
  c.learning_rate = 0.05
  c.schedule = "rsqrt"
  c.warmup_steps = 1000
  c.weight_decay = 0.1
  c.grad_clip = 0.0            # global-norm clipping; 0 disables
  c.adam_b1 = 0.9
  c.adam_b2 = 0.98
  c.adam_eps = 1e-9
  # Mesh: sizes of the (data, fsdp, tensor) axes; -1 = all remaining devices.
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  c.axis_rules = AXIS_RULES
  c.distributed = False        # jax.distributed.initialize() (or set LRA_DISTRIBUTED=1)
  c.progress = True            # the stderr progress line
  return c


def model_defaults() -> ml_collections.ConfigDict:
  """Model fields (LRA Transformer defaults). vocab/classes/length come from the task."""
  m = ml_collections.ConfigDict()
  m.emb_dim = 512
  m.num_heads = 8
  m.qkv_dim = 512
  m.mlp_dim = 1024
  m.num_layers = 4
  m.dropout = 0.1
  m.pos_emb = "sinusoidal"     # sinusoidal | learned | none
  m.pool = "cls"               # cls | mean
  m.classifier_dim = 1024
  # The attention primitive of every layer ({"kind": name in attention.REGISTRY, **its
  # arguments}); layer_attention optionally holds one dict per layer updating it.
  m.attention = ml_collections.ConfigDict({"kind": "dot_product"}, type_safe=False)
  m.layer_attention = ()
  return m


def attention_defaults(kind: str, *, window: int, max_length: int) -> dict[str, Any]:
  """Default arguments for attention `kind` in a model over `max_length` tokens (its record's
  `defaults` in `attention.kinds`; `window` sizes the local kinds)."""
  return kinds.defaults(kind, window=window, max_length=max_length)


def task_arg(arg: str | None, *, attention: str | Mapping[str, str] = "dot_product",
             sizes: tuple[str, ...] = ("base", "small")) -> ml_collections.ConfigDict:
  """Parses a task config's `arg` ("attention=NAME,size=S,window=W") and checks the names.

  `attention` is the default kind, or one default per size ({"base": ..., "small": ...}).
  """
  a = parse_arg(arg, attention="", size=sizes[0], window=0)
  if a.size not in sizes:
    raise ValueError(f"unknown size {a.size!r}; valid sizes: {', '.join(sizes)}.")
  if not a.attention:
    a.attention = attention if isinstance(attention, str) else attention[a.size]
  kinds.get(a.attention)  # raises with the valid names when unknown
  return a


def task_config(task: ModuleType) -> ml_collections.ConfigDict:
  """Trainer and model defaults plus the task's name and data settings."""
  c = trainer_defaults()
  c.task = task.NAME
  c.data = task.data_config()
  c.model = model_defaults()
  return c


def set_attention(c: ml_collections.ConfigDict, a: ml_collections.ConfigDict,
                  window: int) -> None:
  """Sets the model's attention to kind `a.attention` with its defaults for `window`, and
  `config_arg` (which names the run's default workdir)."""
  c.model.attention = ml_collections.ConfigDict(
      {"kind": a.attention,
       **attention_defaults(a.attention, window=window, max_length=c.data.max_length)},
      type_safe=False)
  c.config_arg = f"attention={a.attention},size={a.size},window={a.window}"
