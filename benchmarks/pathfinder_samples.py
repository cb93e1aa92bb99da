"""Generated Pathfinder images: a sample grid, label balance, flood-fill agreement and speed.

- grid: the first 32 images of imgs/0 of a dataset written with `--seed 0` (16 of each label),
  each titled with its label, and below them the first 8 of the same dataset in the dashed
  style (`--style dashed`), to docs/pathfinder_samples.png;
- check: for --check N images of one batch (as `write_dataset` draws them), the label counts
  and, at several thresholds, how often "the 8-connected lit region of one marker holds the
  other" (scipy.ndimage.label, independent of the generator's own check) equals the label; the
  generator guarantees it for thresholds in FLOOD_FILL_RANGE[32] (64..100) in the continuous
  style. The same for the dashed style, with the number of separate lit pieces along each
  target path;
- speed: images per second (wall and CPU time of this process) at 32x32 and 128x128, hard,
  in both styles.

    .venv-bench/bin/python benchmarks/pathfinder_samples.py              # all three
    .venv-bench/bin/python benchmarks/pathfinder_samples.py --check 200 --speed 0 --no-plot
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

import numpy as np  # noqa: E402

from lra.data import pathfinder_generator as gen  # noqa: E402

LOW, HIGH = gen.FLOOD_FILL_RANGE[32]
THRESHOLDS = (1, 32, LOW, (LOW + HIGH) // 2, HIGH, 128, 192)


def images(seed: int, count: int, resolution: int = 32, stats: dict | None = None,
           style: str = "continuous") -> list:
  """The images of imgs/0 of a dataset written with this seed (stats: generator counts)."""
  return [img for chunk in gen.batch_images(seed, 0, count, resolution=resolution,
                                            stats=stats, style=style) for img in chunk]


def draw_grid(path: str, seed: int = 0, rows: int = 4, cols: int = 8) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(rows + 1, cols, figsize=(cols * 1.35, (rows + 1) * 1.5))
  for style, axs, count in (("continuous", axes[:rows].flat, rows * cols),
                            ("dashed", axes[rows], cols)):
    samples = images(seed, count, style=style)
    order = sorted(range(len(samples)), key=lambda i: -samples[i][1]["label"])  # 1s first
    for ax, i in zip(axs, order):
      image, info = samples[i]
      ax.imshow(image, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
      ax.set_title(f"{'dashed, ' if style == 'dashed' else ''}label {info['label']}",
                   fontsize=9, color="tab:green" if info["label"] else "tab:red")
      ax.set_xticks([])
      ax.set_yticks([])
  fig.suptitle(f"Generated Pathfinder 32x32, contour length 14 (seed {seed}, imgs/0 "
               f"sample_0..{rows * cols - 1}; last row: --style dashed, sample_0..{cols - 1})",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


def reaches(image: np.ndarray, a, b, threshold: int) -> bool:
  from scipy import ndimage
  labels, _ = ndimage.label(image >= threshold, structure=np.ones((3, 3)))
  return bool(labels[a] and labels[a] == labels[b])


def pieces(image: np.ndarray, pivots, threshold: int) -> int:
  """The number of 8-connected lit pieces (pixels >= threshold) along a path's polyline."""
  from scipy import ndimage
  labels, _ = ndimage.label(image >= threshold, structure=np.ones((3, 3)))
  seen = set()
  for (y0, x0), (y1, x1) in zip(pivots[:-1], pivots[1:]):
    for t in np.linspace(0.0, 1.0, 4 * max(abs(y1 - y0), abs(x1 - x0)) + 1):
      seen.add(int(labels[int(round(y0 + t * (y1 - y0))), int(round(x0 + t * (x1 - x0)))]))
  return len(seen - {0})


def check(count: int, seed: int, style: str = "continuous") -> None:
  stats: dict = {}
  start = time.perf_counter()
  samples = images(seed, count, stats=stats, style=style)
  took = time.perf_counter() - start
  labels = np.array([info["label"] for _, info in samples])
  print(f"\n{style} style")
  print(f"{count} images (seed {seed}, one batch): {int((labels == 1).sum())} label 1, "
        f"{int((labels == 0).sum())} label 0; generated in {took:.1f} s")
  print(f"generator attempts: {stats['attempts']}, both targets grown {stats['grown']}, "
        f"markers placed {stats['marked']}, drawn and flood-filled {stats['checked']}, "
        f"passed {stats['kept']}")
  print("| threshold | flood fill == label, label 1 | label 0 | all |")
  print("|---|---|---|---|")
  for t in THRESHOLDS:
    agree = np.array([reaches(img, *info["markers"], t) == bool(info["label"])
                      for img, info in samples])
    inside = " (guaranteed)" if LOW <= t <= HIGH and style == "continuous" else ""
    print(f"| {t}{inside} | {agree[labels == 1].mean():.1%} | {agree[labels == 0].mean():.1%} "
          f"| {agree.mean():.1%} ({int(agree.sum())}/{count}) |")
  distractors = np.array([info["distractors"] for _, info in samples])
  print(f"distractor snakes per image: mean {distractors.mean():.2f} of "
        f"{gen.PARAMS[32]['num_distractors'] // (14 // 3)}")
  for t in (LOW, HIGH):
    n = np.array([pieces(img, path, t) for img, info in samples for path in info["paths"]])
    print(f"lit pieces (8-connected, >= {t}) along a target path: mean {n.mean():.2f}, "
          f"min {n.min()}, max {n.max()}; paths in one piece: {(n == 1).mean():.1%}")


def speed(count32: int, seed: int) -> None:
  print(f"load average before: {os.getloadavg()[0]:.1f} (2 CPU cores)")
  print("| style | resolution | images | wall s | images/s (wall) | CPU s | images/s (CPU) |")
  print("|---|---|---|---|---|---|---|")
  for style in gen.STYLES:
    for resolution, count in ((32, count32), (128, max(count32 // 10, 10))):
      images(seed + 1, 8, resolution, style=style)  # stamp tables built outside the timing
      wall, cpu = time.perf_counter(), time.process_time()
      images(seed, count, resolution, style=style)
      wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
      print(f"| {style} | {resolution} | {count} | {wall:.1f} | {count / wall:.1f} | {cpu:.1f} "
            f"| {count / cpu:.1f} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.path.join(ROOT, "docs", "pathfinder_samples.png"))
  parser.add_argument("--no-plot", action="store_true")
  parser.add_argument("--check", type=int, default=1000, help="images to check (0: skip)")
  parser.add_argument("--speed", type=int, default=1000,
                      help="images to time at 32x32 (a tenth at 128x128; 0: skip)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  if not args.no_plot:
    draw_grid(args.out, args.seed)
  if args.check:
    for style in gen.STYLES:
      check(args.check, args.seed, style)
  if args.speed:
    speed(args.speed, args.seed)


if __name__ == "__main__":
  main()
