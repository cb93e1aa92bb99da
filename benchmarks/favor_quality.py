"""How well FAVOR+ approximates softmax attention: error vs number of features, orthogonal vs iid.

For each input regime, q and k rows are random directions of a fixed norm, v is N(0, 1), and the
error is the mean over (position, head) of |o - o*| / |o*|, where o* is exact softmax attention
(`attention.dot_product_attention`) and o is `attention.favor_attention` with m features; it is
averaged over several independent feature draws (seeds). head_dim 64, n = 1024, 4 heads.

Input regimes. The estimator's relative variance for one (query, key) weight is about
(exp(|q' + k'|^2) - 1) / m with x' = x d^{-1/4} (Choromanski et al. 2020, Lemma 2), so the error
is governed by the scaled squared norm s = |q'|^2 = |k'|^2, not by the logits alone. With random
directions the logits q.k / sqrt(d) = q'.k' have standard deviation s / sqrt(d) = s / 8; the
regimes below run from s = 0.25 (almost uniform attention) to s = 12 (logit std 1.5, a spread
like a trained model's). A last column gives the error of the ReLU kernel (the LRA Performer's
default) at 256 features, which does not estimate softmax at all.

    .venv/bin/python benchmarks/favor_quality.py            # table; plot to docs/favor_quality.png
    .venv/bin/python benchmarks/favor_quality.py --seeds 2 --length 256 --no-plot   # quick look
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
  sys.path[0] = ROOT                               # benchmarks/ would shadow the package
elif ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from attention import dot_product_attention, favor_attention, favor_features  # noqa: E402

HEAD_DIM = 64
FEATURES = (16, 32, 64, 128, 256)
SQ_NORMS = (0.25, 0.5, 1.0, 2.0, 4.0, 12.0)       # s = |q d^-1/4|^2 = |k d^-1/4|^2


def make_inputs(seed: int, length: int, heads: int, sq_norm: float):
  """q, k: random directions with |x d^-1/4|^2 = sq_norm; v: N(0, 1). `[1, L, H, 64]` each."""
  rng = np.random.default_rng(seed)
  shape = (1, length, heads, HEAD_DIM)
  q, k = rng.normal(size=shape), rng.normal(size=shape)
  radius = np.sqrt(sq_norm * np.sqrt(HEAD_DIM))
  q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) * radius for x in (q, k))
  v = rng.normal(size=shape)
  return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def mean_relative_error(out, exact) -> float:
  """Mean over (batch, position, head) of |out - exact| / |exact| (vectors over head_dim)."""
  err = jnp.linalg.norm(out - exact, axis=-1) / jnp.linalg.norm(exact, axis=-1)
  return float(jnp.mean(err))


def measure(length: int, heads: int, seeds: int) -> dict:
  """{(sq_norm, kind, m): (mean error, std over seeds)}; kind in orthogonal / iid / relu."""
  jax.config.update("jax_default_matmul_precision", "highest")
  results = {}
  for sq_norm in SQ_NORMS:
    q, k, v = make_inputs(0, length, heads, sq_norm)
    exact = dot_product_attention(q, k, v)
    logit_std = float(jnp.std(jnp.einsum("blhd,bkhd->bhlk", q, k) / np.sqrt(HEAD_DIM)))
    results[sq_norm, "logit_std"] = logit_std
    for kind in ("orthogonal", "iid", "relu"):
      for m in (FEATURES if kind != "relu" else FEATURES[-1:]):
        errors = []
        for seed in range(seeds):
          w = favor_features(jax.random.key(1000 + seed), m, HEAD_DIM,
                             orthogonal=kind != "iid")
          out = favor_attention(q, k, v, features=w,
                                kernel="relu" if kind == "relu" else "softmax")
          errors.append(mean_relative_error(out, exact))
        results[sq_norm, kind, m] = (float(np.mean(errors)), float(np.std(errors)))
  return results


def table(results: dict, seeds: int) -> str:
  """Markdown table: one row per (regime, kind), one column per feature count."""
  head = ("| s = \\|q'\\|^2 | logit std | features | " + " | ".join(f"m={m}" for m in FEATURES)
          + " | ReLU kernel, m=256 |")
  lines = [head, "|" + "---:|" * 3 + "---:|" * (len(FEATURES) + 1)]
  for sq_norm in SQ_NORMS:
    for kind in ("orthogonal", "iid"):
      cells = [f"{results[sq_norm, kind, m][0]:.3f}" for m in FEATURES]
      relu = f"{results[sq_norm, 'relu', FEATURES[-1]][0]:.3f}" if kind == "orthogonal" else ""
      lines.append(f"| {sq_norm:g} | {results[sq_norm, 'logit_std']:.2f} | {kind} | "
                   + " | ".join(cells) + f" | {relu} |")
  lines.append("")
  lines.append(f"Mean relative error of outputs, mean over {seeds} feature draws.")
  return "\n".join(lines)


def figure(results: dict, length: int | None = None, heads: int | None = None,
           seeds: int | None = None):
  """Mean relative error against the number of features, log-log, one colour per regime s,
  orthogonal solid and iid dashed, each point with its standard deviation over the feature
  draws as an error bar; the legend right of the axes (off the data); the title names the
  length, heads and draws. None when matplotlib is not installed."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, ax = plt.subplots(figsize=(9, 4.8))
  colors = plt.cm.viridis(np.linspace(0, 0.9, len(SQ_NORMS)))
  for color, sq_norm in zip(colors, SQ_NORMS):
    for kind, style, shift in (("orthogonal", "-", 0.97), ("iid", "--", 1.03)):
      means = [results[sq_norm, kind, m][0] for m in FEATURES]
      stds = [results[sq_norm, kind, m][1] for m in FEATURES]
      label = (f"s={sq_norm:g} (logit std {results[sq_norm, 'logit_std']:.2f})"
               if kind == "orthogonal" else None)
      # iid and orthogonal a little apart along x, so that their bars do not hide each other
      ax.errorbar([m * shift for m in FEATURES], means, yerr=stds, fmt=style,
                  marker="o" if kind == "orthogonal" else "x", color=color, label=label,
                  markersize=4, capsize=2, elinewidth=0.8)
  ax.axhline(0.1, color="gray", lw=0.8, ls=":")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(FEATURES, [str(m) for m in FEATURES])
  ax.set_xlabel("number of random features m")
  ax.set_ylabel("mean relative error vs exact softmax attention")
  shape = ", ".join(x for x in (length and f"length {length}", heads and f"{heads} heads") if x)
  ax.set_title(f"FAVOR+ output error at head_dim {HEAD_DIM}" + (f", {shape}" if shape else "")
               + "\northogonal (solid) vs iid (dashed) features"
               + (f"; bars: std over {seeds} draws" if seeds else ""), fontsize=11)
  ax.legend(fontsize=8, title="s = |q d^-1/4|^2", title_fontsize=8, loc="upper left",
            bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  return fig


def plot(results: dict, path: str, length: int | None = None, heads: int | None = None,
         seeds: int | None = None) -> None:
  fig = figure(results, length, heads, seeds)
  if fig is None:
    print("matplotlib is not installed: no plot (pip install -e '.[bench]').", file=sys.stderr)
    return
  fig.savefig(path, dpi=120, bbox_inches="tight")
  import matplotlib.pyplot as plt
  plt.close(fig)
  print(f"wrote {path}", file=sys.stderr)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--length", type=int, default=1024)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seeds", type=int, default=5, help="independent feature draws per point")
  p.add_argument("--plot", default=os.path.join(ROOT, "docs", "favor_quality.png"))
  p.add_argument("--no-plot", action="store_true")
  args = p.parse_args(argv)
  t0 = time.perf_counter()
  results = measure(args.length, args.heads, args.seeds)
  print(f"FAVOR+ approximation error, head_dim {HEAD_DIM}, n = {args.length}, {args.heads} heads "
        f"({time.perf_counter() - t0:.0f} s)\n")
  print(table(results, args.seeds))
  if not args.no_plot:
    plot(results, args.plot, args.length, args.heads, args.seeds)


if __name__ == "__main__":
  main()
