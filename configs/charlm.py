"""Shared config of the character-LM tasks (enwik8, text8): Longformer models and staged phases.

`get_config(task, arg)` builds the config of task `task` ("enwik8" or "text8") for `arg` keys
`attention` (default `band`), `size` (`base` = Longformer-small, `large` = Longformer-large,
`small` = a CPU demo) and `window` (the top layer's one-sided window in phase 1; 0 = the size's
default). The settings follow Longformer (Beltagy, Peters, Cohan 2020) section 4 and Appendix B,
Table 12; docs/character_lm.md has the table, where this config reads a misprinted cell, and
where it differs from the paper (Transformer-XL relative positions as the paper, for band and
dot_product; other kinds keep absolute sinusoids; our `dilation` is the stride, so
the paper's d = 1, 2, 3 are 2, 3, 4 here; MLP width 2048 and PyTorch's Adam betas, which the
paper does not list).

`small` is a CPU demo: 4 layers of width 128, two phases (lengths 128 then 256, windows doubled,
learning rate and batch halved), and the fallback corpus when the archive is absent.
"""

from __future__ import annotations

import ml_collections

from attention import kinds
from configs import common

SIZES = ("base", "large", "small", "xl-base", "xl-small", "compressive-base", "compressive-small")

# Longformer Table 12: (steps, max_length, window scale, learning rate, batch size) per phase.
_LENGTHS = (2048, 4096, 8192, 16384, 23040)
_BATCHES = (32, 32, 16, 16, 16)
_STEPS = {"base": (430_000, 50_000, 50_000, 35_000, 5_000),
          "large": (350_000, 25_000, 10_000, 5_000, 5_000)}
_LAYERS = {"base": 12, "large": 30}
_DROPOUT = {"base": 0.2, "large": 0.4}
# Layers with dilation (the paper's d + 1) on the last two heads: (first layer, dilation).
_DILATED = {"base": ((6, 2), (8, 3), (10, 4)), "large": ((15, 2), (20, 3), (25, 4))}


def layer_windows(bottom: int, top: int, num_layers: int, multiple: int) -> tuple[int, ...]:
  """One-sided windows growing geometrically from `bottom` to `top`, rounded to `multiple`."""
  if num_layers == 1:
    return (top,)
  ratio = (top / bottom) ** (1.0 / (num_layers - 1))
  return tuple(max(multiple, int(round(bottom * ratio**i / multiple)) * multiple)
               for i in range(num_layers))


def layer_dilations(num_layers: int, num_heads: int, dilated: tuple[tuple[int, int], ...],
                    heads: int = 2) -> tuple[tuple[int, ...] | int, ...]:
  """Per layer: 1, or a per-head tuple with `dilation` on the last `heads` heads."""
  out = []
  for layer in range(num_layers):
    d = 1
    for first, value in dilated:
      if layer >= first:
        d = value
    out.append(1 if d == 1 else (1,) * (num_heads - heads) + (d,) * heads)
  return tuple(out)


def longformer_phases(size: str, learning_rate: float = 2.5e-4) -> tuple[dict, ...]:
  """The five phases of Table 12: lengths and windows doubling, learning rate halving."""
  phases = []
  for k, (steps, length, batch) in enumerate(zip(_STEPS[size], _LENGTHS, _BATCHES)):
    phases.append({"steps": steps, "max_length": length, "window_scale": 2**k,
                   "learning_rate": learning_rate / 2**k, "batch_size": batch,
                   "warmup_steps": min(steps // 10, 10_000)})
  return tuple(phases)


STANDARD_SPLIT = (90_000_000, 5_000_000, 5_000_000)   # train, validation, test characters


def data_config(task: str) -> ml_collections.ConfigDict:
  """Data settings: the standard split and window lengths; the sizes override them."""
  return common.data_fields(
      task,
      max_length=2048,        # training window: inputs and targets of max_length characters
      eval_length=0,          # evaluation window L (0: max_length)
      eval_context=1536,      # evaluation stride is L - eval_context (Longformer: 512)
      split_sizes=STANDARD_SPLIT,
      fallback=False)         # without the archive, use the fallback corpus (CPU demo)


def get_config(task: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """The config of character-LM task `task` for `arg` = "attention=NAME,size=...,window=W"."""
  a = common.task_arg(arg, attention="band", sizes=SIZES)
  memory, _, a.size = a.size.rpartition("-")    # "xl-small": Transformer-XL memory, small
  if memory and "attention=" not in (arg or ""):
    a.attention = "dot_product"                 # both papers' dense relative attention

  c = common.task_config(task, data_config(task))
  c.model.pos_emb = "sinusoidal"       # no parameters: the phases change the length
  c.init_from = ""                     # a checkpoint directory whose params start this run
  c.schedule = "constant"
  c.adam_b2, c.adam_eps = 0.999, 1e-8
  if a.size in ("base", "large"):
    num_layers = _LAYERS[a.size]
    c.model.num_layers = num_layers
    c.model.emb_dim = c.model.qkv_dim = 512
    c.model.num_heads = 8
    c.model.mlp_dim = 2048
    c.model.dropout = _DROPOUT[a.size]
    c.weight_decay = 0.01
    c.grad_clip = 0.25
    c.data.eval_length = 32_256
    c.data.eval_context = 32_256 - 512
    c.eval_batch_size = 8
    c.log_every = 500
    c.eval_every = 50_000            # a full validation pass is 9,766 windows of 32,256
    c.checkpoint_every = 5_000
    c.phases = longformer_phases(a.size)
    top, ratio, multiple = a.window or 512, 16, 16
    dilated = _DILATED[a.size]
  else:
    c.data.fallback = True            # no enwik8.zip on the machine: the fallback corpus
    c.data.download = False           # never wait on the network for a demo
    c.model.num_layers = 4
    c.model.emb_dim = c.model.qkv_dim = 128
    c.model.num_heads = 4
    c.model.mlp_dim = 256
    c.model.dropout = 0.1
    c.weight_decay = 0.01
    c.grad_clip = 0.25
    c.data.eval_length = 256
    c.data.eval_context = 192          # stride 64
    c.eval_batch_size = 64
    c.log_every = 50
    c.eval_every = 200
    c.checkpoint_every = 200
    # Longformer's pattern at toy scale: length and windows doubled, learning rate and batch
    # halved (so the tokens per step stay 4,096), 10% warmup, constant schedule.
    c.phases = (
        {"steps": 250, "max_length": 128, "window_scale": 1, "learning_rate": 2e-3,
         "batch_size": 32, "warmup_steps": 25},
        {"steps": 125, "max_length": 256, "window_scale": 2, "learning_rate": 1e-3,
         "batch_size": 16, "warmup_steps": 12},
    )
    top, ratio, multiple = a.window or 32, 4, 4
    dilated = ((3, 2),)
  first = c.phases[0]
  c.num_train_steps = first["steps"]
  c.data.max_length = first["max_length"]
  c.learning_rate = first["learning_rate"]
  c.batch_size = first["batch_size"]
  c.warmup_steps = first["warmup_steps"]

  # Transformer-XL memory and the Compressive Transformer (models/memory.py, docs/recurrence.md):
  # n_m cached layer inputs per layer, n_cm compressed slots fed at rate c; a memory needs the
  # training batches as contiguous streams (data.streams = batch_size).
  c.model.memory_length = 0
  c.model.compressed_length = 0
  c.model.compression = "conv"        # mean | max | conv
  c.model.compression_rate = 1
  c.model.segment_length = 0          # evaluation segments through the memory (0: memory_length)
  c.model.eval_memory_length = 0      # evaluation memory states per layer (0: memory_length)
  c.model.clamp_len = 0               # evaluation's relative distances clamped (0: not clamped)
  c.model.same_length = False         # evaluation: every query sees as many keys as the memory
  c.data.streams = 0                  # rows of contiguous training streams (0: shuffled windows)
  c.data.eval_streams = 0             # evaluation splits as rows of contiguous streams (0: windows)
  if memory:   # the memory sizes set the layers: the per-layer windows follow them
    _memory_sizes(c, memory, a.size)
  n = c.model.num_layers
  if a.attention == "band":
    windows = layer_windows(max(multiple, top // ratio), top, n, multiple)
    dilations = layer_dilations(n, c.model.num_heads, dilated)
    c.model.attention = ml_collections.ConfigDict({"kind": "band", "window": top},
                                                  type_safe=False)
    c.model.layer_attention = tuple({"window": w, "dilation": d}
                                    for w, d in zip(windows, dilations))
  else:
    c.model.attention = ml_collections.ConfigDict(
        {"kind": a.attention, **common.attention_defaults(
            a.attention, window=top, max_length=c.data.max_length)}, type_safe=False)
    if a.attention == "adaptive_span" and a.size in ("base", "large"):
      c.model.attention.max_span = 8192   # Sukhbaatar et al.'s small model (R 32, lambda 2e-6)
  # Transformer-XL relative positions, as the Longformer character LM (no parameter depends on
  # the length, so the phases can change it); kinds without them keep sinusoids.
  c.model.pos_emb = "relative" if kinds.get(a.attention).relative else "sinusoidal"
  c.size = f"{memory}-{a.size}" if memory else a.size   # the run's identity (lra.identity)
  return c


def _memory_sizes(c: ml_collections.ConfigDict, memory: str, size: str) -> None:
  """Transformer-XL (Dai et al. 2019, enwik8 base: 12 layers, d 512, 8 heads, d_inner 2048,
  target 512, memory 512) or the Compressive Transformer (Rae et al. 2020, enwik8: 24 layers, d
  1024, 8 heads, d_inner 3072, window 768, memory 768, compressed memory 1152, rate 3, conv), one
  phase; `small`: the CPU demo of docs/recurrence.md."""
  c.phases = ()
  if size == "small":
    c.num_train_steps, c.batch_size, c.warmup_steps, c.learning_rate = 300, 16, 30, 2e-3
    c.data.max_length, c.data.eval_length, c.data.eval_context = 128, 256, 128
    c.model.memory_length, c.model.segment_length = 128, 128
    if memory == "compressive":   # the same 128 attended slots: 64 states + 64 compressed ones
      c.model.memory_length, c.model.compressed_length, c.model.compression_rate = 64, 64, 2
    c.eval_every, c.checkpoint_every = 100_000, 300
  elif memory == "xl":
    c.model.num_layers, c.model.emb_dim, c.model.qkv_dim = 12, 512, 512
    c.model.num_heads, c.model.mlp_dim, c.model.dropout = 8, 2048, 0.1
    c.num_train_steps, c.batch_size, c.learning_rate = 400_000, 22, 2.5e-4
    c.data.max_length = c.model.memory_length = 512
    # Evaluated as the paper: the split as contiguous rows, segments of 80, memory 2100, clamp
    # 820, and `same_length` (every query sees 2,100 keys, itself included).
    c.model.segment_length, c.model.eval_memory_length, c.model.clamp_len = 80, 2100, 820
    c.model.same_length = True
    c.data.eval_streams = c.eval_batch_size
  else:
    c.model.num_layers, c.model.emb_dim, c.model.qkv_dim = 24, 1024, 1024
    c.model.num_heads, c.model.mlp_dim, c.model.dropout = 8, 3072, 0.1
    c.num_train_steps, c.batch_size, c.learning_rate = 400_000, 22, 2.5e-4
    c.data.max_length = c.model.memory_length = c.model.segment_length = 768
    c.model.compressed_length, c.model.compression_rate = 1152, 3
    c.data.eval_length, c.data.eval_context = 3072, 3072 - 768
  c.model.compression = "conv"
  c.data.streams = c.batch_size


def sweep(add, sizes: tuple[str, ...] = ("base",)) -> None:
  """The Longformer run per size, three seeds."""
  for size in sizes:
    for seed in (0, 1, 2):
      add(config_arg=f"attention=band,size={size}", seed=seed)
