"""FAVOR+ error on the queries, keys and values of trained models: the realistic norms.

`benchmarks/favor_quality.py` measures the error on synthetic q and k of fixed norm; which norm
is realistic depends on the model. This benchmark trains small models with head_dim 64 and
measures on what they actually produce:

1. For each task (ListOps small, a classifier; enwik8 small, a causal character LM, on the
   fallback corpus unless `enwik8.zip` is in the data root) it trains three models through the
   trainer: FAVOR+ attention with 256 orthogonal features drawn once per layer (`favor`), the
   same with fresh features at every training step (`favor_redraw`, the paper's redrawing), and
   exact softmax attention (`dot_product`). A finished run in `--workdir` is reused.
2. It runs each trained model (best validation parameters) on validation examples and records
   q, k, v, the key mask and causality at every attention call.
3. On every recorded layer it computes exact softmax attention and FAVOR+ with m = 16 .. 256
   freshly drawn features (orthogonal and i.i.d., several draws), and reports the mean relative
   error |o - o*| / |o*| over real query positions and heads, next to the scaled squared norms
   s = |q d^-1/4|^2 and |k d^-1/4|^2 and the logit spread (std over each query's real keys), so
   each row can be placed on the synthetic table. For FAVOR+ models it also gives the error of
   the draw the model evaluates with ("model's draw").

    .venv/bin/python benchmarks/favor_trained.py --workdir /tmp/favor_trained   # ~30 min, 2 cores
    .venv/bin/python benchmarks/favor_trained.py --tasks listops --steps 100 --seeds 1   # quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
  sys.path[0] = ROOT                               # benchmarks/ would shadow the package
elif ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import attention  # noqa: E402

FEATURES = (16, 32, 64, 128, 256)
HEAD_DIM = 64
# Trained-with name -> (attention kind, config overrides).
VARIANTS = {
    "favor": ("favor", {}),
    "favor_redraw": ("favor", {"model.attention.redraw": "true"}),
    "dot_product": ("dot_product", {}),
}
# Per task: the config overrides giving head_dim 64, and how many validation examples to record.
TASKS = {
    "listops": {"overrides": {"model.emb_dim": "128", "model.qkv_dim": "128",
                              "model.num_heads": "2", "model.mlp_dim": "256"},
                "examples": 256},
    "enwik8": {"overrides": {"model.num_heads": "2"}, "examples": 64},
}


@contextlib.contextmanager
def recording(kind: str):
  """Replaces `attention.REGISTRY[kind]` by a wrapper that records every call's inputs.

  Yields the list of records: dicts with numpy `q`, `k`, `v` `[B, L, H, D]`, `key_mask` `[B, L]`
  (or None), `causal`, and `features` (FAVOR+ calls only). The model must run eagerly.
  """
  original = attention.REGISTRY[kind]
  records = []

  def wrapper(q, k, v, *, key_mask=None, causal=False, **kwargs):
    records.append({"q": np.asarray(q), "k": np.asarray(k), "v": np.asarray(v),
                    "key_mask": None if key_mask is None else np.asarray(key_mask),
                    "causal": bool(causal), "features": kwargs.get("features")})
    return original(q, k, v, key_mask=key_mask, causal=causal, **kwargs)

  attention.REGISTRY[kind] = wrapper
  try:
    yield records
  finally:
    attention.REGISTRY[kind] = original


def masked_relative_error(out, exact, query_mask) -> float:
  """Mean of |out - exact| / |exact| (over head_dim) over real query positions and heads."""
  err = jnp.linalg.norm(out - exact, axis=-1) / jnp.linalg.norm(exact, axis=-1)   # [B, L, H]
  weights = jnp.broadcast_to(query_mask[..., None], err.shape).astype(err.dtype)
  return float(jnp.sum(jnp.where(weights > 0, err, 0.0)) / jnp.sum(weights))


def input_stats(rec: dict) -> dict:
  """Mean scaled squared norms of real queries and keys, and the std of real logits."""
  q, k = rec["q"].astype(np.float64), rec["k"].astype(np.float64)
  d = q.shape[-1]
  mask = rec["key_mask"] if rec["key_mask"] is not None else np.ones(q.shape[:2], bool)
  sq = lambda x: np.sum(x * x, axis=-1) / np.sqrt(d)                      # [B, L, H]
  logits = np.einsum("blhd,bkhd->bhlk", q, k) / np.sqrt(d)               # [B, H, L, L]
  pair = mask[:, None, :, None] & mask[:, None, None, :]
  if rec["causal"]:
    n = q.shape[1]
    pair = pair & np.tril(np.ones((n, n), bool))
  pair = np.broadcast_to(pair, logits.shape)
  real = np.broadcast_to(mask[..., None], sq(q).shape)
  with warnings.catch_warnings():                                          # all-padding rows
    warnings.simplefilter("ignore", RuntimeWarning)
    row_std = np.nanstd(np.where(pair, logits, np.nan), axis=-1)           # [B, H, L]
    return {"s_q": float(sq(q)[real].mean()), "s_k": float(sq(k)[real].mean()),
            "logit_std": float(np.nanmean(row_std))}


def layer_errors(rec: dict, seeds: int) -> dict:
  """{(kind, m): mean error over `seeds` fresh draws}, plus "trained" for a FAVOR+ record."""
  q, k, v = (jnp.asarray(rec[x], jnp.float32) for x in ("q", "k", "v"))
  key_mask = None if rec["key_mask"] is None else jnp.asarray(rec["key_mask"])
  query_mask = key_mask if key_mask is not None else jnp.ones(q.shape[:2], bool)
  causal = rec["causal"]
  exact = attention.dot_product_attention(q, k, v, key_mask=key_mask, causal=causal)
  out = {}
  for kind in ("orthogonal", "iid"):
    for m in FEATURES:
      errors = []
      for seed in range(seeds):
        w = attention.favor_features(jax.random.key(7000 + seed), m, q.shape[-1],
                                     orthogonal=kind == "orthogonal")
        o = attention.favor_attention(q, k, v, features=w, key_mask=key_mask, causal=causal)
        errors.append(masked_relative_error(o, exact, query_mask))
      out[kind, m] = float(np.mean(errors))
  if rec["features"] is not None:
    o = attention.favor_attention(q, k, v, features=rec["features"], key_mask=key_mask,
                                  causal=causal)
    out["trained"] = masked_relative_error(o, exact, query_mask)
  return out


def config_for(task: str, trained_with: str, steps: int | None):
  import configs
  kind, extra = VARIANTS[trained_with]
  overrides = list(TASKS[task]["overrides"].items()) + list(extra.items())
  config = configs.build_config(task, attention=kind, size="small", overrides=overrides)
  if steps is not None:
    with config.unlocked():
      if config.get("phases"):
        config.phases = tuple(dict(p, steps=steps) for p in config.phases)
      config.num_train_steps = steps
  return config


def train(task: str, trained_with: str, workdir: str, steps: int | None):
  """Trains (or reuses) one model; returns (config, directory of the final params, results)."""
  from lra import phases
  from lra import tasks as tasks_lib
  from lra import train as lra_train
  from lra.rundir import RunDir
  config = config_for(task, trained_with, steps)
  tasks_lib.get_task(config.task).prepare(config.data)
  run_dir = os.path.join(workdir, f"{task}-{trained_with}")
  if config.get("phases"):
    results = phases.run_phases(config, run_dir)
    final = phases.phase_config(config, len(config.phases) - 1)
    params_dir = RunDir(run_dir).phase(len(config.phases)).path
  else:
    results = phases.finished_results(run_dir)
    if results is not None:
      print(f"{task}/{trained_with}: finished earlier ({run_dir}); reused.", flush=True)
    else:
      results = lra_train.train_and_evaluate(config, run_dir)
    final = config
  if results.get("interrupted"):
    raise KeyboardInterrupt
  return final, RunDir(params_dir if config.get("phases") else run_dir).best, results


def record(config, params_dir: str, trained_with: str, examples: int) -> list[dict]:
  """Runs the trained model eagerly on `examples` validation examples; the layers' inputs."""
  from flax import nnx

  from lra import checkpoint
  from lra.data import pipeline
  from lra import tasks as tasks_lib
  from lra import train as lra_train
  trainer = lra_train.Trainer(config)
  params, _ = checkpoint.load_params(params_dir, checkpoint.abstract_like(trainer.params))
  model = nnx.merge(trainer.graphdef, params, trainer.rest)
  task = tasks_lib.get_task(config.task)
  source = task.get_source(config.data, "validation")
  batch = next(iter(pipeline.eval_batches(source, batch_size=examples)))
  batch = {key: jnp.asarray(x) for key, x in batch.items()}
  with recording(VARIANTS[trained_with][0]) as records:
    task.objective(model, batch, None)
  return records


def summary_line(task, trained_with, results) -> str:
  if "test_bpc" in results:
    return f"{task}, trained with {trained_with}: test BPC {results['test_bpc']:.3f}"
  return f"{task}, trained with {trained_with}: test accuracy {results['test_accuracy']:.4f}"


def table(rows: list[dict], seeds: int) -> str:
  head = ("| task | trained with | layer | s_q | s_k | logit std | "
          + " | ".join(f"m={m}" for m in FEATURES) + " | iid m=256 | model's draw |")
  lines = [head, "|---|---|---:|" + "---:|" * (3 + len(FEATURES) + 2)]
  for r in rows:
    e = r["errors"]
    trained = f"{e['trained']:.3f}" if "trained" in e else ""
    lines.append(f"| {r['task']} | {r['trained_with']} | {r['layer']} | {r['s_q']:.2f} | "
                 f"{r['s_k']:.2f} | {r['logit_std']:.2f} | "
                 + " | ".join(f"{e['orthogonal', m]:.3f}" for m in FEATURES)
                 + f" | {e['iid', FEATURES[-1]]:.3f} | {trained} |")
  lines.append("")
  lines.append(f"Mean relative error of FAVOR+ outputs against exact softmax attention on each "
               f"layer's recorded q, k, v (orthogonal features unless marked; mean over {seeds} "
               f"fresh draws).")
  return "\n".join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default=os.path.join("workdirs", "favor_trained"),
                 help="where the models are trained (finished runs are reused)")
  p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {list(TASKS)}")
  p.add_argument("--steps", type=int, default=None,
                 help="train steps per run (per phase for enwik8); default: the small config's")
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help=f"models to train, comma-separated, from {list(VARIANTS)}")
  p.add_argument("--seeds", type=int, default=3, help="fresh feature draws per point")
  p.add_argument("--json", default=None, help="also write the rows to this JSON file")
  args = p.parse_args(argv)
  tasks = [t for t in args.tasks.split(",") if t]
  unknown = [t for t in tasks if t not in TASKS]
  if unknown:
    p.error(f"unknown task(s) {unknown}; choose from {list(TASKS)}.")
  variants = [v for v in args.variants.split(",") if v]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}.")
  jax.config.update("jax_default_matmul_precision", "highest")
  t0 = time.perf_counter()
  rows, summaries = [], []
  for task in tasks:
    for trained_with in variants:
      config, params_dir, results = train(task, trained_with, args.workdir, args.steps)
      summaries.append(summary_line(task, trained_with, results))
      records = record(config, params_dir, trained_with, TASKS[task]["examples"])
      for layer, rec in enumerate(records):
        print(f"measuring {task}/{trained_with} layer {layer} ...", file=sys.stderr, flush=True)
        rows.append({"task": task, "trained_with": trained_with, "layer": layer,
                     **input_stats(rec), "errors": layer_errors(rec, args.seeds)})
  print(f"\nFAVOR+ on trained models' q, k, v, head_dim {HEAD_DIM} "
        f"({time.perf_counter() - t0:.0f} s)\n")
  print("\n".join(summaries) + "\n")
  print(table(rows, args.seeds))
  if args.json:
    with open(args.json, "w") as f:
      json.dump([{**r, "errors": {f"{k[0]}_{k[1]}" if isinstance(k, tuple) else k: v
                                  for k, v in r["errors"].items()}} for r in rows], f, indent=1)


if __name__ == "__main__":
  main()
