"""Pieces shared by the task configs: the value converter, `parse_arg`, data folders, trainer and
model defaults, the CPU-demo and LRA blocks, attention settings and the LRA sweep.

`get_config(arg)` in a task file receives `arg` as "key=value,key=value" (for example
"attention=band,size=small"); `parse_arg(arg, **defaults)` turns it into a typed ConfigDict and
rejects unknown keys with the list of valid ones. `convert` is the one string-to-value converter,
used for `arg` values and for `--config.x=y` overrides alike.

This module, like every config file, imports only ml_collections and pure-Python names (the
attention kinds' records and the data folders), never jax or tensorflow_datasets.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Mapping

import ml_collections

from attention import kinds
from lra import schema
from lra.data import paths

# Logical axis name (carried by parameters, see models/sharding.py) -> mesh axis or None.
AXIS_RULES = (
    ("vocab", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("length", None),
)

_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")


def convert(text: str, current: Any) -> Any:
  """The value of the command-line string `text` for a field whose current value is `current`.

  The type of `current` decides: booleans take true/false (yes/no, 1/0), ints and floats their
  numbers, strings the text as is, tuples a Python tuple or list; a field with no value yet
  (None, or a free-form attention argument) takes a Python literal when `text` is one, else the
  text. Raises ValueError saying what was expected.
  """
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text
  if isinstance(current, bool):
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
      return word in _TRUE
    raise ValueError(f"expected true or false, got {text!r}.")
  if isinstance(current, int):
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"expected an integer, got {text!r}.")
    return value
  if isinstance(current, float):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"expected a number, got {text!r}.")
    return float(value)
  if isinstance(current, str):
    return text
  if isinstance(current, (tuple, list)):
    if not isinstance(value, (tuple, list)):
      raise ValueError(f"expected a tuple such as (1, 2), got {text!r}.")
    return tuple(value)
  if current is not None and not isinstance(value, type(current)):
    raise ValueError(f"expected a {type(current).__name__}, got {text!r}.")
  return value


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
  """Parses "a=1,b=x" against `defaults` (which also fix each value's type)."""
  out = dict(defaults)
  for key, value in schema.arg_items(arg).items():
    if key not in defaults:
      raise ValueError(f"unknown config argument {key!r} in {arg!r}; valid arguments: "
                       f"{', '.join(sorted(defaults))}.")
    try:
      out[key] = convert(value, defaults[key])
    except ValueError as e:
      raise ValueError(f"config argument {key}={value}: {e}") from None
  return ml_collections.ConfigDict(out)


def data_fields(task: str, **fields: Any) -> ml_collections.ConfigDict:
  """Data settings: data_dir (the prepared dataset), manual_dir (the original archives),
  download (fetch missing archives from their public address when online), then `fields`."""
  c = ml_collections.ConfigDict()
  c.data_dir = paths.default_data_dir(task)
  c.manual_dir = paths.default_manual_dir()
  c.download = True
  for key, value in fields.items():
    c[key] = value
  return c


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
  # Mesh: sizes of the (data, fsdp, sequence, tensor) axes; -1 = all remaining devices. A
  # sequence axis splits the length (band, favor and linear attention; models/sequence.py).
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "sequence": 1, "tensor": 1})
  c.axis_rules = AXIS_RULES
  # Rematerialisation: "none", "block" (each block's activations are recomputed in the backward
  # pass, keeping only its input) or a jax.checkpoint policy name (lra/schema.py REMATS).
  c.remat = "none"
  # Activations: "float32", or "bfloat16" (parameters, optimizer state and softmax statistics
  # stay float32).
  c.dtype = "float32"
  # A run's initial parameters: another run's checkpoint directory (or workdir), "" = fresh;
  # init_length: that run's max_length when shorter (its learned positions are tiled, Longformer).
  c.init_from = ""
  c.init_length = 0
  # Or a local Hugging Face checkpoint folder (BERT, RoBERTa, Longformer): the encoder's
  # architecture and weights come from it, attention kind, length and dropout from this config
  # (models/pretrained.py, docs/pretrained.md).
  c.init_from_hf = ""
  c.protocol = "scratch"       # scratch (as LRA) | spt (self-pretrain, then fine-tune)
  c.pretrain = ml_collections.ConfigDict({
      "objective": "mlm",      # mlm | clm | mpnet, over the task's inputs (labels unused)
      "steps": 0,              # pretraining steps of num_train_steps; 0 = half of them
      "learning_rate": 0.0})   # 0 = config.learning_rate
  c.distributed = False        # jax.distributed.initialize() (or set LRA_DISTRIBUTED=1)
  # Seconds a process of a multi-process run waits for the others (jax.distributed's start,
  # heartbeats and shutdown, and lra/mesh.py `wait_for_peers` before the first collectives):
  # long enough for a slow peer's compile on a busy host.
  c.peer_timeout_s = 900
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
  # sinusoidal | learned | none (added to the embeddings) | rotary | infused | relative (inside
  # every attention layer; relative only with dot_product and band): docs/positions.md.
  m.pos_emb = "sinusoidal"
  m.rotary_base = 10000.0      # rotary frequencies base^(-2f/D); raise it for longer sequences
  # Sublayer order: "" = "sf" * num_layers, or any string of s (attention) and f (feed-forward);
  # sandwich = k gives s^k (sf)^(n-k) f^k (Press et al. 2020).
  m.sublayers = ""
  m.sandwich = 0
  m.pool = "cls"               # cls | mean
  m.mask_rate = 0.15           # masked (MLM) or predicted (MPNet) tokens when pretraining
  m.classifier_dim = 1024
  # The attention primitive of every layer ({"kind": name in attention.kinds.KINDS, **its
  # arguments}); layer_attention optionally holds one dict per layer updating it.
  m.attention = ml_collections.ConfigDict({"kind": "dot_product"}, type_safe=False)
  m.layer_attention = ()
  # The TPU splash kernel's tiles (attention.splash.Tiles, used when a layer's backend is
  # splash): forward, dK/dV, their compute sub-tiles, and the fused backward. MaxText's defaults.
  m.splash = ml_collections.ConfigDict(dict(
      block_q=512, block_kv=512, block_kv_compute=512, block_q_dkv=512, block_kv_dkv=512,
      block_kv_dkv_compute=512, use_fused_bwd_kernel=False))
  return m


def set_model(m: ml_collections.ConfigDict, *, layers: int, width: int, heads: int, mlp: int,
              classifier: int, dropout: float, pos_emb: str, pool: str, qkv: int = 0) -> None:
  """Sets the model fields in one call (`qkv` defaults to `width`)."""
  m.num_layers, m.emb_dim, m.num_heads, m.qkv_dim = layers, width, heads, qkv or width
  m.mlp_dim, m.classifier_dim, m.dropout = mlp, classifier, dropout
  m.pos_emb, m.pool = pos_emb, pool


def set_schedule(c: ml_collections.ConfigDict, *, steps: int, batch: int, eval_batch: int,
                 learning_rate: float, schedule: str, warmup: int, weight_decay: float,
                 log_every: int, eval_every: int, checkpoint_every: int,
                 grad_clip: float = 0.0) -> None:
  """Sets the training length, batches, optimiser schedule and logging cadence in one call."""
  c.num_train_steps, c.batch_size, c.eval_batch_size = steps, batch, eval_batch
  c.learning_rate, c.schedule, c.warmup_steps = learning_rate, schedule, warmup
  c.weight_decay, c.grad_clip = weight_decay, grad_clip
  c.log_every, c.eval_every, c.checkpoint_every = log_every, eval_every, checkpoint_every


def cpu_schedule(c: ml_collections.ConfigDict, *, steps: int, batch: int, eval_batch: int,
                 learning_rate: float, warmup: int, weight_decay: float, eval_every: int,
                 checkpoint_every: int, log_every: int = 50) -> None:
  """The CPU demos' schedule: cosine with warmup and global-norm clipping at 1."""
  set_schedule(c, steps=steps, batch=batch, eval_batch=eval_batch, learning_rate=learning_rate,
               schedule="cosine", warmup=warmup, weight_decay=weight_decay, grad_clip=1.0,
               log_every=log_every, eval_every=eval_every, checkpoint_every=checkpoint_every)


def epoch_schedule(c: ml_collections.ConfigDict, *, train_examples: int, batch: int,
                   learning_rate: float, epochs: int = 200, checkpoint_epochs: int = 10,
                   log_every: int = 0, grad_clip: float = 0.0) -> None:
  """LRA's image-task schedule: `epochs` epochs of cosine decay without weight decay, one epoch
  of warmup, validation (and by default logging) every epoch, a checkpoint every
  `checkpoint_epochs` epochs; an epoch is `train_examples // batch` steps."""
  epoch = train_examples // batch
  set_schedule(c, steps=epochs * epoch, batch=batch, eval_batch=batch,
               learning_rate=learning_rate, schedule="cosine", warmup=epoch, weight_decay=0.0,
               grad_clip=grad_clip, log_every=log_every or epoch, eval_every=epoch,
               checkpoint_every=checkpoint_epochs * epoch)


def attention_defaults(kind: str, *, window: int, max_length: int) -> dict[str, Any]:
  """Default arguments for attention `kind` in a model over `max_length` tokens (its record's
  `defaults` in `attention.kinds`; `window` sizes the local kinds)."""
  return kinds.defaults(kind, window=window, max_length=max_length)


# The sizes of a task config that names none (`SIZES` in its module otherwise; the first is
# the default).
DEFAULT_SIZES = ("base", "small")


def task_arg(arg: str | None, *, attention: str | Mapping[str, str] = "dot_product",
             sizes: tuple[str, ...] = DEFAULT_SIZES) -> ml_collections.ConfigDict:
  """Parses a task config's `arg` ("attention=NAME,size=S,window=W") and checks the names.

  `attention` is the default kind, or one default per size ({"base": ..., "small": ...}); NAME
  may be a paper's name (`performer`), which becomes the kind's (`favor`).
  """
  a = parse_arg(arg, attention="", size=sizes[0], window=0)
  if a.size not in sizes:
    raise ValueError(f"unknown size {a.size!r}; valid sizes: {', '.join(sizes)}.")
  if not a.attention:
    a.attention = attention if isinstance(attention, str) else attention[a.size]
  a.attention = kinds.resolve(a.attention)  # a paper's name -> the kind; unknown: the names
  return a


def task_config(name: str, data: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Trainer and model defaults plus the task's name and data settings."""
  c = trainer_defaults()
  c.task = name
  c.data = data
  c.model = model_defaults()
  return c


def set_attention(c: ml_collections.ConfigDict, a: ml_collections.ConfigDict,
                  window: int) -> None:
  """Sets the model's attention to kind `a.attention` with its defaults for `window`, and the
  config's size (with the task and the kind, the run's identity: `lra.identity`)."""
  c.model.attention = ml_collections.ConfigDict(
      {"kind": a.attention,
       **attention_defaults(a.attention, window=window, max_length=c.data.max_length)},
      type_safe=False)
  c.size = a.size


def lra_sweep(add: Callable[..., None], *, skip: tuple[str, ...] = (),
              seeds: tuple[int, ...] = (0, 1, 2), size: str = "base") -> None:
  """The LRA comparison: every attention kind (but `skip` and the exact copies of another
  kind, `Kind.copy_of`, whose points would repeat that kind's numbers) at `size`, one run per
  seed."""
  for name in kinds.names_where(lambda k: k.copy_of is None):
    if name in skip:
      continue
    for seed in seeds:
      add(config_arg=f"attention={name},size={size}", seed=seed)


# ---- Self-pretraining (`config.protocol`; lra/tasks/pretraining.py, docs/pretraining.md) ----

PROTOCOLS = ("scratch", "spt")
OBJECTIVES = ("mlm", "clm", "mpnet")
def apply_protocol(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`c` with `protocol = "spt"` turned into two phases in one workdir (`lra.phases`): phase 1
  trains `pretrain.objective` on the task's inputs (task `<task>+<objective>`) for
  `pretrain.steps` steps (0: half of num_train_steps), phase 2 fine-tunes the task from its
  parameters for the rest, so both protocols take num_train_steps steps in all."""
  protocol = c.get("protocol", "scratch")
  if protocol not in PROTOCOLS:
    raise ValueError(f"config.protocol = {protocol!r}: must be one of {', '.join(PROTOCOLS)} "
                     f"(scratch trains from random parameters; spt self-pretrains on the "
                     f"task's inputs, then fine-tunes).")
  if protocol == "scratch":
    return c
  p = c.pretrain
  if p.objective not in OBJECTIVES:
    raise ValueError(f"config.pretrain.objective = {p.objective!r}: must be one of "
                     f"{', '.join(OBJECTIVES)} (the self-pretraining objective).")
  pretraining = f"{c.task}+{p.objective}"
  if c.get("phases") and dict(c.phases[0]).get("task") == pretraining:
    return c   # already applied
  if c.get("phases"):
    raise ValueError("config.protocol = 'spt' makes its own two phases; it cannot be combined "
                     "with config.phases.")
  total = int(c.num_train_steps)
  steps = int(p.steps) or total // 2
  if not 0 < steps < total:
    raise ValueError(f"config.pretrain.steps = {p.steps!r}: must leave both phases steps, "
                     f"in [1, {total - 1}] (num_train_steps {total}), or 0 for half.")
  if p.objective == "mpnet":
    specs = [dict(c.model.attention)] + [dict(x) for x in (c.model.layer_attention or ())]
    kinds.check_permutation(s.get("kind", specs[0].get("kind")) for s in specs)
  common = dict(max_length=int(c.data.max_length), window_scale=1.0,
                batch_size=int(c.batch_size), warmup_steps=int(c.warmup_steps))
  pretrain_lr = float(p.learning_rate) or float(c.learning_rate)
  with c.unlocked():
    c.phases = (
        {**common, "steps": steps, "learning_rate": pretrain_lr,
         "task": pretraining},
        {**common, "steps": total - steps, "learning_rate": float(c.learning_rate),
         "task": c.task})
  return c
