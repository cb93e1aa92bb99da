"""Shared config of the character-LM tasks (enwik8, text8): Longformer models and staged phases.

`get_config(task, arg)` builds the config of `task` (the module `lra.tasks.enwik8` or
`lra.tasks.text8`) for `arg` keys `attention` (default `band`), `size` (`base`, `large` or
`small`) and `window` (the top layer's one-sided window in phase 1; 0 = the size's default).

Sizes follow Longformer (Beltagy, Peters, Cohan 2020, arXiv:2004.05150v2): section 4.1
(windows growing with depth, no dilation in the lower layers, a little increasing dilation on
2 heads of the upper layers), section 4.2 (the staged schedule and the evaluation protocol) and
Appendix B, Table 12 ("Hyperparameters for the best performing model for character-level
language modeling"):

| Table 12 | value | here |
|---|---|---|
| small / large model | 12 / 30 layers, 8 heads, 512 hidden | `base` / `large` |
| dropout | 0.2 (small), 0.4 (large) | same |
| optimizer, grad clip, weight decay | AdamW, 0.25, 0.01 | same |
| layernorm, activation | pre-layernorm, GeLU | same (the repo's Block) |
| phases | 5 | same |
| sequence length | 2,048 (phase 1) ... 23,040 (phase 5) | 2048, 4096, 8192, 16384, 23040 |
| learning rate | 0.00025 (phase 1) ... 0.000015625 (phase 5) | halved each phase |
| batch size per phase | 32, 32, 16, 16, 16 | same |
| steps per phase (small) | 430K, 50K, 50K, 35K, 5K | same |
| steps per phase (large) | 350K, 25K, 10K, 5K, 5K | same |
| warmup, LR schedule | 10% of the phase (at most 10K), constant | `schedule="constant"` |
| dilation (small) | 0 (layers 0-5), 1 (6-7), 2 (8-9), 3 (10-11), 2 heads only | see below |
| dilation (large) | 0 (layers 0-14), 1 (15-19), 2 (20-24), 3 (25-29) | see below |
| window sizes | phase 1: 32 (bottom) - 512 (top); doubled each phase | see below |

Where this config differs from or has to interpret the paper:
- Positions: the paper uses Transformer-XL's relative and sinusoidal positions; this repo's
  models have absolute sinusoids (no parameters, so one model serves every phase length).
- Windows: Table 12 prints "Phase 1 window sizes 32 (bottom layer) - 8,192 (top layer)" and
  "Phase 5 window sizes 512 (bottom layer) - (top layer)", cells that are split wrongly (a
  phase-1 window of 8,192 exceeds its 2,048-long sequences). With "double the window size each
  phase" (section 4.2) the reading used here is phase 1 = 32 -> 512 and phase 5 = 512 -> 8,192.
  The per-layer values in between are not given; they grow geometrically with depth, rounded to
  multiples of 16. A window here is one-sided (`band` semantics; causal, so the left side).
- Dilation: the paper's d counts the gaps (0 = none); our `dilation` is the stride (1 = none),
  so its 1, 2, 3 become 2, 3, 4 on the last 2 of the 8 heads.
- MLP width 2048 (Transformer-XL's d_inner for this model; the paper does not list it). Adam
  betas (0.9, 0.999) and eps 1e-8 (PyTorch's AdamW defaults; not listed either).
- Evaluation: sequences of 32,256 with a step of 512, scored on their last 512 characters
  (section 4.2), i.e. `eval_length=32256, eval_context=31744`, with the first window scored in
  full so every character counts once.

`small` is a CPU demo: 4 layers of width 128, two phases (lengths 128 then 256, windows doubled,
learning rate and batch halved), and the fallback corpus when the archive is absent.
"""

from __future__ import annotations

from types import ModuleType

import ml_collections

from configs import common

SIZES = ("base", "large", "small")

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


def get_config(task: ModuleType, arg: str | None = None) -> ml_collections.ConfigDict:
  """The config of character-LM `task` for `arg` = "attention=NAME,size=...,window=W"."""
  a = common.task_arg(arg, attention="band", sizes=SIZES)

  c = common.task_config(task)
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
  c.config_arg = f"attention={a.attention},size={a.size},window={a.window}"
  return c


def sweep(add, sizes: tuple[str, ...] = ("base",)) -> None:
  """The Longformer run per size, three seeds."""
  for size in sizes:
    for seed in (0, 1, 2):
      add(config_arg=f"attention=band,size={size}", seed=seed)

