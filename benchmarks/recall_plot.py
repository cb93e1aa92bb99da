"""The recall figures from a sweep's runs: needle accuracy against distance per attention kind,
or MQAR accuracy against model width per kind (Zoology's figure).

  python benchmarks/recall_plot.py DIR [--task needle|mqar] [--plot PNG] [--reach N]

DIR holds runs of one task (`lra sweep needle --sweep distance --workdir DIR`, `lra sweep mqar
--sweep zoology --workdir DIR`, or single `lra run` folders). For needle (the default), each
finished run's `results.json` has `test_accuracy_by_distance` (the test needles retrieved per
distance bin [2, 4), [4, 8), ...; `lra.tasks.needle`), its `config.json` the kind, the variant
and whether the query was a global token. For mqar, a run is one point: its `test_accuracy`
(the answers recalled, on the best validation checkpoint) at its model width
(`model.emb_dim`). Runs that differ only in the seed are one line: the mean over seeds, with a
bar from the lowest to the highest seed.

Prints a Markdown table (one row per kind, one column per distance bin or width: mean and,
over several seeds, the range); `--plot PNG` draws accuracy against distance or width (log2
axis), one line per kind, chance (needle: one in the number of values) dotted, and, with
`--reach N`, a vertical line at the band models' reach (window x layers). Drawn with Pillow
(benchmarks/pillow_canvas.py), as the other plots of this repository.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
  sys.path[0] = os.path.dirname(HERE)    # benchmarks/attention.py would shadow the package

from benchmarks.lra_speed_plot import COLORS  # noqa: E402
from benchmarks.pillow_canvas import Axes, Canvas, dashes, load_font  # noqa: E402
from lra import rundir  # noqa: E402
from lra.rundir import RunDir  # noqa: E402


def label(config: dict) -> str:
  """A run's line: its kind, `+ global query` when its query was global, `(bidirectional)`."""
  model = config.get("model", {})
  text = model.get("attention", {}).get("kind", "?")
  if model.get("global_query"):
    text += " + global query"
  if model.get("variant") == "bidirectional":
    text += " (bidirectional)"
  return text


def _bin_low(name: str) -> int:
  return int(name.split("-")[0])


TASKS = ("needle", "mqar")


def read_runs(root: str, task: str = "needle"
              ) -> tuple[dict[str, dict[int, list[float]]], dict]:
  """({line: {x: [accuracy per seed]}}, one run's data config) of the finished runs of `task`
  under `root`, in the order their folders sort; x is a distance bin's low end (needle) or the
  model width (mqar)."""
  lines: dict[str, dict[int, list[float]]] = {}
  data: dict = {}
  runs = sorted(base for base, _, files in os.walk(root) if rundir.RESULTS in files)
  for run in runs:
    try:
      with open(RunDir(run).results) as f:
        result = json.load(f)
      with open(RunDir(run).config) as f:
        config = json.load(f)
    except (OSError, ValueError):
      continue                                # not finished, or not a run of its own
    if result.get("task") != task:
      continue
    if task == "mqar":
      width = config.get("model", {}).get("emb_dim")
      if width is None or result.get("test_accuracy") is None:
        continue
      points = {int(width): float(result["test_accuracy"])}
    else:
      by_distance = result.get("test_accuracy_by_distance")
      if not by_distance:
        continue
      points = {_bin_low(name): float(acc) for name, acc in by_distance.items()}
    data = data or config.get("data", {})
    line = lines.setdefault(label(config), {})
    for x, accuracy in points.items():
      line.setdefault(x, []).append(accuracy)
  return lines, data


def table(lines: dict[str, dict[int, list[float]]], task: str = "needle") -> str:
  """Markdown: one row per line, one column per distance bin (needle) or width (mqar),
  `mean (lo-hi)` over seeds."""
  bins = sorted({b for line in lines.values() for b in line})
  head = (lambda b: f"width {b}") if task == "mqar" else (lambda b: f"d {b}-{2 * b - 1}")
  out = ["| kind | seeds | " + " | ".join(head(b) for b in bins) + " |",
         "|---|---|" + "---|" * len(bins)]
  for name, line in lines.items():
    seeds = max(len(v) for v in line.values())
    cells = []
    for b in bins:
      values = line.get(b)
      if not values:
        cells.append("-")
      elif len(values) == 1:
        cells.append(f"{values[0]:.3f}")
      else:
        cells.append(f"{statistics.mean(values):.3f} ({min(values):.2f}-{max(values):.2f})")
    out.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
  return "\n".join(out)


def plot(lines: dict[str, dict[int, list[float]]], path: str, *, chance: float | None = None,
         reach: int | None = None, title: str = "", task: str = "needle") -> Canvas:
  """Accuracy against distance or width (log2), one line per kind: the mean over seeds at each
  bin's middle (needle) or width (mqar), a bar over the seeds' range; chance dotted, the band
  reach a vertical line."""
  bins = sorted({b for line in lines.values() for b in line})
  if task == "mqar":
    middle = lambda b: float(b)
    xlabel, name_of = "model width (log)", lambda m: f"{int(m)}"
    title = title or "MQAR answers recalled against model width"
  else:
    middle = lambda b: (b * 2 - 1 + b) / 2
    xlabel = "distance d from the query to the key (bins [2^k, 2^(k+1)), log)"
    name_of = lambda m: next(f"{b}-{2 * b - 1}" for b in bins if middle(b) == m)
    title = title or "Needles retrieved against distance"
  lo, hi = middle(bins[0]), middle(bins[-1])
  if hi == lo:                                  # one column: an axis around it
    lo, hi = lo / 1.5, hi * 1.5
  canvas = Canvas((1300, 640))
  font, small = load_font(20), load_font(15)
  ax = Axes(canvas, (100, 70, 900, 540), (lo, hi), (0.0, 1.0), True, False)
  ax.frame(title, xlabel, "test accuracy", xticks=[middle(b) for b in bins], font=font,
           small=small, xlabel_of=name_of)
  draw = canvas.draw
  if chance is not None:
    dashes(draw, ax.xy(ax.xlim[0], chance), ax.xy(ax.xlim[1], chance), "#999999", width=2,
           dash=4)
  if reach:
    x, _ = ax.xy(reach, 0.0)
    draw.line([(x, ax.box[1]), (x, ax.box[3])], fill="#999999", width=2)
    canvas.text((x + 6, ax.box[1] + 6), f"band reach {reach}", small)
  legend_x, y = 940, 80
  for i, (name, line) in enumerate(lines.items()):
    color = COLORS[i % len(COLORS)]
    points = [(middle(b), statistics.mean(v)) for b, v in sorted(line.items())]
    for b, values in line.items():
      if len(values) > 1:
        (x, lo), (_, hi) = ax.xy(middle(b), min(values)), ax.xy(middle(b), max(values))
        draw.line([(x, lo), (x, hi)], fill=color, width=2)
    ax.series(points, color)
    draw.line([(legend_x, y + 9), (legend_x + 35, y + 9)], fill=color, width=4)
    canvas.text((legend_x + 43, y), name, small)
    y += 26
  if chance is not None:
    dashes(draw, (legend_x, y + 9), (legend_x + 36, y + 9), "#999999", width=2, dash=4)
    canvas.text((legend_x + 43, y), f"chance ({chance:.3f})", small)
    y += 26
  canvas.legends.append((legend_x, 80, 1290, y))
  return canvas.save(path)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("dir", help="a folder of runs (a sweep's workdir)")
  p.add_argument("--task", default="needle", choices=TASKS,
                 help="needle: accuracy against distance; mqar: accuracy against width")
  p.add_argument("--plot", default=None, help="write the figure to this PNG")
  p.add_argument("--reach", type=int, default=None,
                 help="draw the band models' reach (window x layers) at this distance")
  args = p.parse_args(argv)
  if not os.path.isdir(args.dir):
    print(f"error: {args.dir} is not a folder of runs.", file=sys.stderr)
    return 2
  lines, data = read_runs(args.dir, args.task)
  if not lines:
    what = ("with accuracy by distance" if args.task == "needle" else "with a test accuracy")
    print(f"error: no finished {args.task} run {what} under {args.dir}.", file=sys.stderr)
    return 2
  print(table(lines, args.task))
  if args.plot:
    if args.task == "mqar":
      plot(lines, args.plot, task="mqar", title=f"MQAR, {data.get('num_kv_pairs', '?')} pairs "
           f"in {data.get('max_length', '?')} tokens: answers recalled against width")
    else:
      values = data.get("num_values")
      plot(lines, args.plot, chance=1.0 / values if values else None, reach=args.reach,
           title=f"Needle retrieval, sequences of {data.get('max_length', '?')} tokens")
    print(f"wrote {args.plot}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
