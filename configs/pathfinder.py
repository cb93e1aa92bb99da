"""Pathfinder (LRA): 32x32 images as 1,024 pixels, 2 classes, one config for every attention kind.

`arg` keys: `attention` (any name in `attention.kinds`; default `dot_product` for base, `band`
for small), `size` (`base`: the LRA settings on the released images; `small`: generated images
and a model sized for a CPU), `window` (one-sided window of the local kinds).

Main command (generates 4,000 32x32 "hard" images, then trains a 2-layer, 32-wide
band-attention model for 400 steps of batch 32):

  .venv/bin/lra run pathfinder --size small

Expected: chance level (the measured value and time are in docs/image_and_pathfinder.md). It
checks the pipeline end to end; Pathfinder is learned only after far more training (LRA: 200
epochs of 160,000 images).

LRA base: `lra run pathfinder --size base --attention NAME --workdir DIR` needs
`pathfinder32/curv_contour_length_14` of the LRA release (`lra_release.gz` or its extracted
`lra_release/` tree in `~/lra_data/manual/`). 62,400 steps of batch 512; LRA reports 71.4% for
its Transformer, but the public config is reported to stay at 50% (docs/image_and_pathfinder.md).
"""

from __future__ import annotations

import ml_collections

from configs import common

SMALL_IMAGES = 4000
SMALL_STEPS = 400


def data_config(task: str = "pathfinder", resolution: int = 32) -> ml_collections.ConfigDict:
  """Data settings for Pathfinder (or Path-X with task="pathx", resolution=128)."""
  c = common.data_fields(task, resolution=resolution)
  c.max_length = c.get_ref("resolution") * c.get_ref("resolution")   # follows data.resolution
  c.difficulty = "hard"         # easy | intermediate | hard (LRA: hard)
  c.generate = False            # without the release folder: generate the images
  c.num_generated = 200_000     # images to generate (LRA: 200,000 per difficulty)
  c.generator_seed = 0
  return c


def small(c: ml_collections.ConfigDict, *, images: int, layers: int) -> None:
  """The CPU demo of Pathfinder and Path-X: generated images and a 32-wide model."""
  c.data.generate = True
  c.data.num_generated = images
  common.set_model(c.model, layers=layers, width=32, heads=2, mlp=64, classifier=64,
                   dropout=0.0, pos_emb="learned", pool="mean")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The Pathfinder config for `arg` = "attention=NAME,size=base|small,window=W"."""
  # Default kind: LRA's dense Transformer for base; band for small (dense attention over 1,024
  # tokens is several times slower per step than band on a CPU: docs/image_and_pathfinder.md).
  a = common.task_arg(arg, attention={"base": "dot_product", "small": "band"})
  c = common.task_config("pathfinder", data_config())
  if a.size == "base":
    # LRA image/configs/pathfinder32/transformer_base.py (after commit ee6649e). LRA's
    # attention dropout 0.1 is left out: the models here have none on attention weights.
    common.set_model(c.model, layers=4, width=32, heads=4, qkv=16, mlp=32, classifier=32,
                     dropout=0.2, pos_emb="sinusoidal", pool="mean")
    common.epoch_schedule(c, train_examples=160_000, batch=512, learning_rate=1e-3)
    window = a.window or 128
  else:
    small(c, images=SMALL_IMAGES, layers=2)
    common.cpu_schedule(c, steps=SMALL_STEPS, batch=32, eval_batch=256, learning_rate=1e-3,
                        warmup=100, weight_decay=0.0, eval_every=200, checkpoint_every=200)
    window = a.window or 32
  common.set_attention(c, a, window)
  return c


def sweep(add) -> None:
  """The LRA comparison: every attention kind on Pathfinder base, three seeds."""
  common.lra_sweep(add)
