"""What `lra run --dry_run` prints of a preflight report (`lra.preflight.check`): how parameters
and batches lie on the mesh, each attention layer's backend, the memory estimate program by
program, and (`--dry_run=steps:N`) timed steps of the compiled train step."""

from __future__ import annotations

import math
import time

import jax
import ml_collections
import numpy as np

from lra import mesh as mesh_lib, schema
from lra.preflight import GB, Report, abstract_batch, nbytes_per_device


def sharding_table(report: Report) -> list[str]:
  """Lines describing how parameters and batches are laid out over the mesh."""
  trainer = report.trainer
  groups: dict[str, list[int]] = {}
  for leaf in jax.tree.leaves(trainer.abstract_state()["params"]):
    spec = str(tuple(leaf.sharding.spec)) if tuple(leaf.sharding.spec) else "replicated"
    g = groups.setdefault(spec, [0, 0, 0])
    g[0] += 1
    g[1] += math.prod(leaf.shape)
    g[2] += nbytes_per_device([leaf])
  lines = [f"  params {spec:<33} {n:>4} arrays {count:>13,} values {b / 1e6:>10.1f} MB/device"
           for spec, (n, count, b) in sorted(groups.items())]
  c = report.config
  for split, size in (("train", c.batch_size), ("eval", c.eval_batch_size)):
    batch = abstract_batch(trainer.task, c.data, int(size), trainer.mesh,
                           "train" if split == "train" else "test")
    for name, leaf in batch.items():
      rows = leaf.sharding.shard_shape(leaf.shape)[0]
      lines.append(f"  {split + ' batch ' + name:<20} {str(list(leaf.shape)):<16} "
                   f"{str(leaf.dtype):<8} split over {mesh_lib.BATCH_AXES}: {rows} rows per "
                   f"device")
  return lines


def layer_backends(config: ml_collections.ConfigDict, platform: str) -> list[tuple[str, str]]:
  """(kind, backend) of every attention sublayer of `config` on `platform`, as the layers choose
  them (`attention.backends.choose`; relative positions compute with xla)."""
  from attention import backends
  from lra import tasks
  from models import settings as model_settings
  model = config.model
  causal = tasks.get_task(config.task).causal_attention(model)
  specs = model_settings.layer_specs(model.attention.to_dict(),
                                     model.get("layer_attention") or (),
                                     schema.attention_sublayers(model))
  out = []
  for spec in specs:
    kind = spec["kind"]
    args = {k: v for k, v in spec.items() if k not in ("kind", model_settings.IMPLEMENTATION)}
    requested = spec.get(model_settings.IMPLEMENTATION) or backends.AUTO
    backend = "xla" if model.get("pos_emb") == "relative" else backends.choose(
        kind, args, implementation=requested, platform=platform,
        global_tokens=bool(model.get("num_global", 0)) and kind == "band", causal=causal)
    out.append((kind, backend))
  return out


def attention_lines(config: ml_collections.ConfigDict, platform: str) -> list[str]:
  """Lines naming the backend of every attention layer (runs of equal layers grouped)."""
  from models import settings as model_settings
  requested = config.model.attention.get(model_settings.IMPLEMENTATION) or "auto"
  how = f"auto on {platform}" if requested == "auto" else "asked for"
  runs: list[list] = []
  for i, pair in enumerate(layer_backends(config, platform)):
    if runs and runs[-1][2] == pair:
      runs[-1][1] = i
    else:
      runs.append([i, i, pair])
  return [f"  {f'layer {a}' if a == b else f'layers {a}-{b}':<12} {kind:<12} {backend} ({how})"
          for a, b, (kind, backend) in runs]


def memory_lines(report: Report) -> list[str]:
  """The estimate per device, program by program, and the verdict."""
  lines = [f"  {'GB per device':<13} {'arguments':>10} {'outputs':>8} {'aliased':>8} "
           f"{'temporaries':>12} {'code':>6} {'library':>8} {'peak':>8}"]
  for program, peak in ((report.train, report.train_peak), (report.eval, report.eval_peak)):
    p = program
    lines.append(f"  {p.name:<13} {p.argument / GB:10.3f} {p.output / GB:8.3f} "
                 f"{-p.alias / GB:8.3f} {p.temp / GB:12.3f} {p.code / GB:6.3f} "
                 f"{p.library / GB:8.3f} {peak / GB:8.3f}")
  free = "unknown" if report.available is None else f"{report.available / GB:.1f} GB"
  verdict = "fits" if report.fits else "does NOT fit"
  lines.append(f"  estimate {report.peak / GB:.3f} GB per device (the eval step's peak counts "
               f"the optimizer state too); available {free} ({report.available_source}): "
               f"{verdict}")
  return lines


def time_steps(report: Report, steps: int, seed: int = 0) -> list[float]:
  """Seconds of each of `steps` train steps on random batches (after one untimed step), with the
  report's compiled train step; allocates the report's trainer."""
  trainer, config = report.trainer.allocate(), report.config
  rng = np.random.default_rng(seed)
  spec = trainer.task.batch_spec(config.data, int(config.batch_size), "train")
  batch = {}
  for name, leaf in spec.items():
    high = trainer.task.num_classes if name == "targets" and len(leaf.shape) == 1 else (
        2 if name == "mask" else trainer.task.vocab_size)
    batch[name] = rng.integers(1 if name != "targets" else 0, high, leaf.shape).astype(leaf.dtype)
  batch = mesh_lib.global_batch(batch, trainer.mesh)
  state = trainer.state
  times = []
  for k in range(steps + 1):
    t0 = time.perf_counter()
    state, sums = trainer.train_step(state, batch, trainer.rest)
    jax.block_until_ready(sums)
    if k:
      times.append(time.perf_counter() - t0)
  return times

