"""What a trained entmax model learned: its alpha per head and how sparse its attention is.

Reads a finished `lra run TASK --attention entmax` workdir (its `best` parameters, the config it
was trained with), runs the model eagerly on test examples with `attention.REGISTRY["entmax"]`
wrapped so that every layer's call is recorded, and recomputes each layer's weights from the
recorded q, k and alpha (`attention.entmax.entmax` on the scaled scores, the layer's masks).
Per layer it prints the learned alphas and the fraction of exactly-zero weights among the
(real query, real key) pairs, per head and overall; `--json FILE` writes the same numbers.

    .venv/bin/python benchmarks/entmax_trained.py workdirs/listops-entmax-small
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
  sys.path[0] = ROOT                               # benchmarks/ would shadow the package
elif ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import attention  # noqa: E402
from attention.dot_product import allowed_mask  # noqa: E402
from attention.entmax import entmax  # noqa: E402


@contextlib.contextmanager
def recording():
  """Wraps `attention.REGISTRY["entmax"]`; yields the list of each call's q, k, alpha, masks."""
  original = attention.REGISTRY["entmax"]
  records = []

  def wrapper(q, k, v, alpha=1.5, key_mask=None, causal=False, **kwargs):
    records.append({"q": np.asarray(q, np.float32), "k": np.asarray(k, np.float32),
                    "alpha": np.asarray(alpha, np.float32), "causal": bool(causal),
                    "key_mask": None if key_mask is None else np.asarray(key_mask)})
    return original(q, k, v, alpha, key_mask=key_mask, causal=causal, **kwargs)

  attention.REGISTRY["entmax"] = wrapper
  try:
    yield records
  finally:
    attention.REGISTRY["entmax"] = original


def layer_sparsity(rec: dict) -> dict:
  """The layer's alphas and its fraction of exact zeros over allowed pairs, per head and all."""
  q, k = jnp.asarray(rec["q"]), jnp.asarray(rec["k"])
  b, lq, h, d = q.shape
  key_mask = None if rec["key_mask"] is None else jnp.asarray(rec["key_mask"])
  query_mask = key_mask if key_mask is not None and lq == k.shape[1] else None
  allowed = allowed_mask(b, h, lq, k.shape[1], causal=rec["causal"], key_mask=key_mask,
                         query_mask=query_mask)
  z = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
  p = np.asarray(entmax(z, jnp.broadcast_to(jnp.asarray(rec["alpha"]), (h,)), allowed))
  allowed = np.broadcast_to(np.asarray(allowed), p.shape)
  zeros = (p == 0) & allowed
  per_head = zeros.sum(axis=(0, 2, 3)) / allowed.sum(axis=(0, 2, 3))
  return {"alpha": [round(float(a), 4) for a in np.broadcast_to(rec["alpha"], (h,))],
          "zero_fraction_per_head": [round(float(x), 4) for x in per_head],
          "zero_fraction": round(float(zeros.sum() / allowed.sum()), 4),
          "pairs": int(allowed.sum())}


def report(workdir: str, examples: int) -> list[dict]:
  """Per-layer numbers of the trained model in `workdir` on `examples` test examples."""
  from flax import nnx
  import ml_collections

  from lra import checkpoint
  from lra import tasks as tasks_lib
  from lra import train as lra_train
  from lra.data import pipeline
  from lra.rundir import RunDir
  with open(RunDir(workdir).config) as f:
    config = ml_collections.ConfigDict(json.load(f))
  trainer = lra_train.Trainer(config)
  params, _ = checkpoint.load_params(RunDir(workdir).best,
                                     checkpoint.abstract_like(trainer.params))
  model = nnx.merge(trainer.graphdef, params, trainer.rest)
  task = tasks_lib.get_task(config.task)
  source = task.get_source(config.data, "test")
  batch = next(iter(pipeline.eval_batches(source, batch_size=examples)))
  batch = {key: jnp.asarray(x) for key, x in batch.items()}
  with recording() as records:
    task.objective(model, batch, None)
  return [dict(layer=i, **layer_sparsity(rec)) for i, rec in enumerate(records)]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdir", help="a finished `lra run ... --attention entmax` workdir")
  parser.add_argument("--examples", type=int, default=256, help="test examples to run")
  parser.add_argument("--json", help="also write the per-layer numbers to this file")
  args = parser.parse_args(argv)
  layers = report(args.workdir, args.examples)
  for row in layers:
    alphas = ", ".join(f"{a:.4f}" for a in row["alpha"])
    print(f"layer {row['layer']}: alpha per head {alphas}; exact zeros "
          f"{row['zero_fraction']:.1%} of {row['pairs']} real pairs (per head "
          f"{', '.join(f'{x:.1%}' for x in row['zero_fraction_per_head'])})")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(layers, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
