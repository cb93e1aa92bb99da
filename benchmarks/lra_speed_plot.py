"""The report of `benchmarks/lra_speed.py`: its Markdown tables, and its plots drawn with Pillow
(a core dependency; matplotlib is not).

`render_table`: one row per (kind, length); `render_growth`: peak memory above the process
baseline per doubling of the length; `render_lra_layout`: the LRA paper's Table 2 layout
(kinds as rows, speed and memory relative to dot_product per length, or to flash, exact and
memory-efficient, where dot_product ran out of memory). `write_markdown` writes the tables into
a document between its marker lines.

Plots. `plot_lengths`: steps/s and peak memory against the sequence length, both axes
logarithmic, one line per attention kind, the legend right of the panels; the exact references
(dot_product, flash) and identity dashed with open markers and drawn last, so that a line they
coincide with (flash's memory is the linear kinds') shows through and they stay visible.
`read_accuracy` reads the test accuracy per kind from `lra results DIR --format json` (a list of
runs) or `lra results DIR --lra --format json` (`{"common", "cells"}`), `describe_accuracy` says
whose accuracy it is (task, size, its sequence length, seeds), `speed_accuracy_points` pairs it
with the measured steps/s, and `plot_accuracy` draws steps/s (log) against test accuracy, a bar
from each kind's lowest to highest run, titled with both lengths. Every text goes through a
`Canvas`, which records its box: `place_label` puts each kind's label at the first spot near its
point that covers no other label, point or bar, and the tests check that no two texts of a plot
overlap and that the legend is off the panels.
"""

from __future__ import annotations

import json
import math
import os
import statistics

from PIL import Image, ImageDraw, ImageFont

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39",
          "#7b4173", "#3182bd")
REFERENCES = {"dot_product": "#000000", "identity": "#999999"}
EXACT = ("flash",)   # exact dense attention besides dot_product: dashed like the references
TASK_NAMES = {"listops": "ListOps", "text": "Text", "retrieval": "Retrieval", "image": "Image",
              "pathfinder": "Pathfinder", "pathx": "Path-X"}


def _f(x, spec="{:.2f}", none="-"):
  return none if x is None else spec.format(x)


def _length(n: int) -> str:
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def ordered(records: list[dict]) -> tuple[list[str], list[int]]:
  """The kinds present (dot_product, identity, then the others by name) and the lengths."""
  names = sorted({r["kind"] for r in records},
                 key=lambda k: (list(REFERENCES).index(k) if k in REFERENCES else 2, k))
  return names, sorted({r["length"] for r in records})


FALLBACK_NOTE = ("† relative to `flash` (exact dense attention, memory-efficient) where "
                 "dot_product ran out of memory.")


def _vs(r: dict, field: str) -> str:
  """A ratio to the exact dense reference, marked † when that reference is not dot_product."""
  mark = "†" if r.get("dense_ref") not in (None, "dot_product") else ""
  return _f(r.get(field), "{:.2f}x" + mark)


def _note(records: list[dict]) -> str:
  return ("\n\n" + FALLBACK_NOTE) if any(r.get("dense_ref") not in (None, "dot_product")
                                          for r in records) else ""


def render_table(records: list[dict]) -> str:
  """One row per (kind, length), grouped by length; ratios as stored with each record."""
  if not records:
    return "no points measured."
  names, lengths = ordered(records)
  at = {(r["kind"], r["length"]): r for r in records}
  out = ["| kind | length | steps/s | vs dense | vs identity | peak GB | memory vs "
         "dense | compile s | step s (min) |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for n in lengths:
    for k in names:
      r = at.get((k, n))
      if r is None:
        continue
      if r["status"] != "ok":
        label = {"oom": "OOM", "timeout": "timeout"}.get(r["status"], r["status"])
        out.append(f"| {k} | {n} | {label}: {r.get('detail', '')} | | | | | | |")
        continue
      out.append(f"| {k} | {n} | {r['steps_per_s']:.3f} | {_vs(r, 'vs_dense')} | "
                 f"{_f(r.get('vs_identity'), '{:.2f}x')} | {r['peak_gb']:.2f} | "
                 f"{_vs(r, 'memory_vs_dense')} | {r['compile_s']:.1f} | "
                 f"{r['step_s']:.2f} ({r['step_min_s']:.2f}) |")
  return "\n".join(out) + _note(records)


def render_lra_layout(records: list[dict]) -> str:
  """LRA Table 2's layout: kinds as rows, steps/s then peak memory relative to dot_product per
  length (dot_product's own row: its absolute steps/s and GB); OOM and skipped points named."""
  names, lengths = ordered(records)
  at = {(r["kind"], r["length"]): r for r in records}

  def cell(k, n, field, absolute, unit):
    r = at.get((k, n))
    if r is None:
      return "-"
    if r["status"] != "ok":
      return {"oom": "OOM", "timeout": "timeout", "skipped": "skipped"}.get(r["status"], "error")
    if k == "dot_product":
      return f"{r[absolute]:.3g} {unit}"
    return _vs(r, field)

  head = [_length(n) for n in lengths]
  out = ["| kind | " + " | ".join(f"speed {h}" for h in head) + " | "
         + " | ".join(f"memory {h}" for h in head) + " |",
         "|---|" + "---:|" * (2 * len(lengths))]
  for k in names:
    out.append(f"| {k} | " + " | ".join(cell(k, n, "vs_dense", "steps_per_s", "steps/s")
                                       for n in lengths) + " | "
               + " | ".join(cell(k, n, "memory_vs_dense", "peak_gb", "GB") for n in lengths)
               + " |")
  return "\n".join(out) + _note(records)


def render_growth(records: list[dict]) -> str:
  """Peak memory above the process baseline (the imported, idle process), and its growth per
  doubling of the length: 2.0 is linear in length, 4.0 quadratic."""
  names, lengths = ordered(records)
  at = {(r["kind"], r["length"]): r for r in records
        if r.get("status") == "ok" and r.get("baseline_gb") is not None}
  pairs = [(n, 2 * n) for n in lengths if 2 * n in lengths]
  if not pairs:
    return ""
  out = ["| kind | " + " | ".join(f"{_length(a)} -> {_length(b)}" for a, b in pairs) + " |",
         "|---|" + "---:|" * len(pairs)]
  for k in names:
    cells = []
    for a, b in pairs:
      ra, rb = at.get((k, a)), at.get((k, b))
      if ra is None or rb is None:
        cells.append("-")
        continue
      grow_a, grow_b = ra["peak_gb"] - ra["baseline_gb"], rb["peak_gb"] - rb["baseline_gb"]
      cells.append(f"{grow_b / grow_a:.2f} ({grow_a:.2f} -> {grow_b:.2f} GB)")
    if any(c != "-" for c in cells):
      out.append(f"| {k} | " + " | ".join(cells) + " |")
  return ("Peak memory above the process baseline, growth per doubling of the length (2.00 = "
          "linear):\n\n" + "\n".join(out))


def describe(records: list[dict]) -> str:
  ok = [r for r in records if r.get("status") == "ok"]
  if not ok:
    return ""
  r = ok[0]
  m = r.get("machine", {})
  dates = sorted(x["date"] for x in records if x.get("date"))
  return (f"Setup `{r['setup']}`, batch {r['batch']}, on {r.get('device')} ({m.get('cpu', '?')},"
          f" {m.get('cores', '?')} cores, {m.get('mem_gib', '?')} GiB); {dates[0]} to "
          f"{dates[-1]}. Steps/s = 1 / median step; peak = {r.get('peak_source')}.")


def _font(size: int):
  for name in ("DejaVuSans.ttf", "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"):
    try:
      return ImageFont.truetype(name, size)
    except OSError:
      pass
  return ImageFont.load_default()


def colors(kinds) -> dict[str, str]:
  """A fixed colour per kind: the references black and grey, the others in order."""
  out, i = {}, 0
  for k in kinds:
    if k in REFERENCES:
      out[k] = REFERENCES[k]
    else:
      out[k] = COLORS[i % len(COLORS)]
      i += 1
  return out


def _log_ticks(lo: float, hi: float) -> list[float]:
  """Ticks within [lo, hi]: 1-2-5 per decade, more in a narrow range, fewer in a wide one."""
  steps = (1, 2, 3, 4, 5, 6, 8) if hi / lo < 10 else (1, 2, 5) if hi / lo < 1e3 else (1,)
  out = []
  for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
    out += [s * 10.0 ** e for s in steps if lo <= s * 10.0 ** e <= hi]
  return out


def _label(v: float) -> str:
  return f"{v:g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.0e}"


Box = tuple[float, float, float, float]


def overlaps(a: Box, b: Box, margin: float = 0.0) -> bool:
  """Whether boxes (x0, y0, x1, y1) intersect (or come closer than `margin`)."""
  return not (a[2] + margin <= b[0] or b[2] + margin <= a[0] or a[3] + margin <= b[1]
              or b[3] + margin <= a[1])


class Canvas:
  """An image with its texts recorded: `texts` holds (text, box) of everything written, so a
  test can check that no two labels overlap and that none leaves the image; `legends` the
  boxes of the legends and `panels` those of the axes' frames."""

  def __init__(self, size: tuple[int, int]):
    self.image = Image.new("RGB", size, "white")
    self.draw = ImageDraw.Draw(self.image)
    self.texts: list[tuple[str, Box]] = []
    self.legends: list[Box] = []
    self.panels: list[Box] = []

  def text(self, xy, text: str, font, anchor: str = "la", fill: str = "black") -> Box:
    self.draw.text(xy, text, fill=fill, font=font, anchor=anchor)
    box = self.draw.textbbox(xy, text, font=font, anchor=anchor)
    self.texts.append((text, box))
    return box

  def vertical_text(self, center: tuple[float, float], text: str, font) -> Box:
    """`text` rotated 90 degrees (read bottom to top), centred on `center`."""
    w = int(self.draw.textlength(text, font=font)) + 4
    label = Image.new("RGBA", (w, 24), (255, 255, 255, 0))
    ImageDraw.Draw(label).text((w / 2, 12), text, fill="black", font=font, anchor="mm")
    label = label.rotate(90, expand=True)
    x, y = int(center[0] - label.width / 2), int(center[1] - label.height / 2)
    self.image.paste(label, (x, y), label)
    box = label.getbbox() or (0, 0, 0, 0)
    box = (x + box[0], y + box[1], x + box[2], y + box[3])
    self.texts.append((text, box))
    return box

  def save(self, path: str) -> "Canvas":
    self.image.save(path)
    return self


class Axes:
  """A rectangle of the canvas with data limits; x and y each linear or logarithmic."""

  def __init__(self, canvas: Canvas, box, xlim, ylim, xlog, ylog):
    self.canvas, self.image, self.draw = canvas, canvas.image, canvas.draw
    self.box, self.xlog, self.ylog = box, xlog, ylog
    canvas.panels.append(tuple(box))
    pad = lambda lo, hi, log: ((lo / 1.25, hi * 1.25) if log else
                               (lo - 0.06 * (hi - lo or 1), hi + 0.06 * (hi - lo or 1)))
    self.xlim, self.ylim = pad(*xlim, xlog), pad(*ylim, ylog)

  def _frac(self, v, lim, log):
    if log:
      return (math.log(v) - math.log(lim[0])) / (math.log(lim[1]) - math.log(lim[0]))
    return (v - lim[0]) / (lim[1] - lim[0])

  def xy(self, x, y):
    x0, y0, x1, y1 = self.box
    return (x0 + self._frac(x, self.xlim, self.xlog) * (x1 - x0),
            y1 - self._frac(y, self.ylim, self.ylog) * (y1 - y0))

  def frame(self, title, xlabel, ylabel, xticks=None, font=None, small=None, xlabel_of=None):
    c, d, (x0, y0, x1, y1) = self.canvas, self.draw, self.box
    xticks = xticks or (_log_ticks(*self.xlim) if self.xlog else _linear_ticks(*self.xlim))
    yticks = _log_ticks(*self.ylim) if self.ylog else _linear_ticks(*self.ylim)
    placed: list[Box] = []
    ylabels: list[Box] = []
    for t in xticks:
      px = self.xy(t, self.ylim[0])[0]
      d.line([(px, y0), (px, y1)], fill="#e6e6e6")
      text = (xlabel_of or _label)(t)
      box = d.textbbox((px, y1 + 6), text, font=small, anchor="mt")
      if not any(overlaps(box, b, 4) for b in placed):   # crowded ticks: every other label
        placed.append(c.text((px, y1 + 6), text, small, anchor="mt"))
    for t in yticks:
      py = self.xy(self.xlim[0], t)[1]
      d.line([(x0, py), (x1, py)], fill="#e6e6e6")
      ylabels.append(c.text((x0 - 6, py), _label(t), small, anchor="rm"))
    d.rectangle(self.box, outline="black")
    if title:
      c.text(((x0 + x1) / 2, y0 - 10), title, font, anchor="md")
    c.text(((x0 + x1) / 2, y1 + 30), xlabel, small, anchor="mt")
    left = min([b[0] for b in ylabels] or [x0 - 6])
    c.vertical_text((left - 16, (y0 + y1) / 2), ylabel, small)

  def series(self, points, color, dashed=False, marker=True):
    pts = [self.xy(x, y) for x, y in points]
    for (ax, ay), (bx, by) in zip(pts, pts[1:]):
      if not dashed:
        self.draw.line([(ax, ay), (bx, by)], fill=color, width=3)
        continue
      n = max(int(math.hypot(bx - ax, by - ay) / 12), 1)
      for i in range(0, n, 2):
        t0, t1 = i / n, min((i + 1) / n, 1.0)
        self.draw.line([(ax + t0 * (bx - ax), ay + t0 * (by - ay)),
                        (ax + t1 * (bx - ax), ay + t1 * (by - ay))], fill=color, width=3)
    if marker:   # a dashed line's markers are rings: what it is drawn over shows through
      for x, y in pts:
        self.draw.ellipse([x - 6, y - 6, x + 6, y + 6], fill="white" if dashed else color,
                          outline=color, width=3 if dashed else 1)


def _linear_ticks(lo: float, hi: float) -> list[float]:
  step = 10.0 ** math.floor(math.log10(max(hi - lo, 1e-9) / 2))
  for mult in (1, 2, 5, 10):
    if (hi - lo) / (step * mult) <= 8:
      step *= mult
      break
  return [step * i for i in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def _length_label(v: float) -> str:
  return f"{int(v) // 1024}K" if v >= 1024 and int(v) % 1024 == 0 else _label(v)


def _dashes(draw, a, b, color, width=4, dash=8):
  n = max(int(math.hypot(b[0] - a[0], b[1] - a[1]) / dash), 1)
  for i in range(0, n, 2):
    t0, t1 = i / n, min((i + 1) / n, 1.0)
    draw.line([(a[0] + t0 * (b[0] - a[0]), a[1] + t0 * (b[1] - a[1])),
               (a[0] + t1 * (b[0] - a[0]), a[1] + t1 * (b[1] - a[1]))], fill=color, width=width)


def plot_lengths(records: list[dict], path: str, xticks: list[int] | None = None) -> Canvas | None:
  """Two panels (steps/s, peak GB) against length, log-log, one line per kind; a kind's
  unmeasured lengths (OOM, timeout, skipped) are listed in its legend entry. `xticks`: the
  labelled lengths (default: every length in `records`). The exact dense references
  (dot_product, flash) and identity are dashed and drawn last, over the other lines: flash's
  memory equals the linear kinds' at every length, and a solid line drawn later would hide it.
  Returns the canvas (its texts, legend and panel boxes)."""
  ok = [r for r in records if r.get("status") == "ok"]
  kinds = list(dict.fromkeys(r["kind"] for r in records))
  if not ok:
    return None
  palette = colors(kinds)
  dashed = {k for k in kinds if k in REFERENCES or k in EXACT}
  lengths = sorted({r["length"] for r in records})
  canvas = Canvas((1500, 660))
  draw = canvas.draw
  font, small = _font(20), _font(15)
  setup = ok[0]
  machine = setup.get("machine", {})
  where = ", ".join(str(x) for x in (machine.get("cpu"), machine.get("cores") and
                                     f"{machine['cores']} cores") if x)
  canvas.text((640, 8), f"Training {setup['setup']} with batch {setup['batch']}"
              + (f" on {where}" if where else ""), small, anchor="ma")
  for i, (field, title, ylabel) in enumerate((
      ("steps_per_s", "Training steps per second", "steps/s (median)"),
      ("peak_gb", "Peak memory", "GB"))):
    values = [r[field] for r in ok]
    ax = Axes(canvas, (110 + i * 560, 80, 580 + i * 560, 560), (lengths[0], lengths[-1]),
              (min(values), max(values)), True, True)
    ax.frame(title, "sequence length (log)", ylabel + " (log)", xticks=xticks or lengths,
             font=font, small=small, xlabel_of=_length_label)
    for k in sorted(kinds, key=lambda k: k in dashed):      # the dashed ones on top
      pts = sorted((r["length"], r[field]) for r in ok if r["kind"] == k)
      if pts:
        ax.series(pts, palette[k], dashed=k in dashed)
  x0, y = 1235, 80
  top = y
  if dashed:
    canvas.text((x0, y - 28), "dashed: exact and identity", small)
  for k in kinds:
    missing = sorted((r for r in records if r["kind"] == k and r.get("status") != "ok"),
                     key=lambda r: r["length"])           # the first failure says why
    text = k + (f"  ({missing[0]['status'].upper()} at {_length_label(missing[0]['length'])})"
                if missing else "")
    if k in dashed:
      _dashes(draw, (x0, y + 9), (x0 + 36, y + 9), palette[k])
    else:
      draw.line([(x0, y + 9), (x0 + 35, y + 9)], fill=palette[k], width=4)
    canvas.text((x0 + 43, y), text, small)
    y += 26
  canvas.legends.append((x0, top - 28, max(b[2] for _, b in canvas.texts[-len(kinds):]), y))
  return canvas.save(path)


def read_accuracy(path: str, task: str = "text") -> dict[str, list[float]]:
  """{kind: [test accuracy in percent, one per finished run (or per cell's mean)]} of `task`."""
  with open(path) as f:
    data = json.load(f)
  out: dict[str, list[float]] = {}
  if isinstance(data, dict) and "cells" in data:            # lra results --lra --format json
    for c in data["cells"]:
      if c.get("task") in (task, TASK_NAMES.get(task)) and c.get("mean") is not None:
        out.setdefault(str(c["row"]).split()[0], []).append(float(c["mean"]))
    return out
  for row in data:                                           # lra results --format json
    if (row.get("task") == task and row.get("status") == "finished"
        and row.get("metric", "accuracy") == "accuracy" and row.get("test") is not None):
      out.setdefault(row["attention"], []).append(100.0 * float(row["test"]))
  return out


def describe_accuracy(path: str, task: str = "text") -> str:
  """What the accuracies of `read_accuracy(path, task)` are: the task, its size and sequence
  length (from the task's config of that size) and how many seeds, e.g. "ListOps small (length
  128, 2 seeds)"."""
  with open(path) as f:
    data = json.load(f)
  name = TASK_NAMES.get(task, task)
  if isinstance(data, dict):
    return name
  rows = [r for r in data if r.get("task") == task and r.get("status") == "finished"]
  sizes = sorted({r.get("size") for r in rows if r.get("size")})
  seeds = sorted({r.get("seed") for r in rows if r.get("seed") is not None})
  details = []
  if len(sizes) == 1:
    try:
      import configs
      details.append(f"length {configs.build_config(task, size=sizes[0]).data.max_length}")
    except Exception:   # a task or size this checkout does not have: no length named
      pass
  if seeds:
    details.append(f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''}")
  return " ".join([name, *sizes]) + (f" ({', '.join(details)})" if details else "")


def speed_accuracy_points(records: list[dict], accuracy: dict[str, list[float]],
                          length: int | None = None) -> list[dict]:
  """One point per kind with both a measured speed at `length` (default: the shortest length
  measured) and an accuracy: mean accuracy over its runs (`accuracies`: each run's)."""
  ok = [r for r in records if r.get("status") == "ok"]
  if not ok:
    return []
  length = length or min(r["length"] for r in ok)
  speed = {r["kind"]: r for r in ok if r["length"] == length}
  return [dict(kind=k, length=length, accuracy=statistics.fmean(accs), runs=len(accs),
               accuracies=list(accs), steps_per_s=speed[k]["steps_per_s"],
               setup=speed[k].get("setup"), batch=speed[k].get("batch"))
          for k, accs in sorted(accuracy.items()) if k in speed]


def place_label(canvas: Canvas, point: tuple[float, float], text: str, font, frame: Box,
                taken: list[Box]) -> Box:
  """Writes `text` next to `point` at the first spot (right, left, above, below, then the
  diagonals, then the same further out) inside `frame` that overlaps no box in `taken`, with a
  thin line back to the point when it is not beside it; appends its box to `taken`."""
  w = canvas.draw.textlength(text, font=font)
  x, y = point
  spots = []
  for reach in (12, 30, 50, 75):
    spots += [(x + reach, y, "lm"), (x - reach, y, "rm"), (x, y - reach, "md"),
              (x, y + reach, "ma"), (x + reach, y - reach, "ld"), (x + reach, y + reach, "la"),
              (x - reach, y - reach, "rd"), (x - reach, y + reach, "ra")]
  for sx, sy, anchor in spots:
    box = canvas.draw.textbbox((sx, sy), text, font=font, anchor=anchor)
    box = (box[0] - 2, box[1] - 2, box[2] + 2, box[3] + 2)
    inside = (frame[0] + 2 <= box[0] and box[2] <= frame[2] - 2 and frame[1] + 2 <= box[1]
              and box[3] <= frame[3] - 2)
    if inside and not any(overlaps(box, b) for b in taken):
      break
  else:   # nowhere free: beside the point, on the side the frame leaves room on
    right = x + 12 + w <= frame[2] - 2
    sx, sy, anchor = (x + 12, y, "lm") if right else (x - 12, y, "rm")
  box = canvas.text((sx, sy), text, font, anchor=anchor)
  if math.hypot(sx - x, sy - y) > 13:
    near = (min(max(x, box[0]), box[2]), min(max(y, box[1]), box[3]))
    canvas.draw.line([point, near], fill="#888888", width=1)
  taken.append(box)
  return box


def plot_accuracy(points: list[dict], path: str, accuracy_of: str = "") -> Canvas:
  """Steps/s (log) against test accuracy, one labelled point per kind, the accuracy's spread
  over the runs (seeds) as a horizontal bar from the lowest to the highest; `accuracy_of` says
  whose accuracy it is (`describe_accuracy`). Labels are placed where they overlap no other
  label or point. Returns the canvas (its texts)."""
  canvas = Canvas((1000, 700))
  draw = canvas.draw
  font, small = _font(20), _font(15)
  lows = [min(p.get("accuracies") or [p["accuracy"]]) for p in points]
  highs = [max(p.get("accuracies") or [p["accuracy"]]) for p in points]
  speed = [p["steps_per_s"] for p in points]
  ax = Axes(canvas, (110, 90, 960, 590), (min(lows), max(highs)), (min(speed), max(speed)),
            False, True)
  first = points[0]
  length = _length_label(first["length"])
  setup = ", ".join(f"{v}" for v in (first.get("setup"),
                                     first.get("batch") and f"batch {first['batch']}") if v)
  seeds = max(p.get("runs", 1) for p in points)
  whose = accuracy_of or "test"
  canvas.text((535, 12), f"Training speed at length {length} against {whose.split(' (')[0]} "
              "accuracy", font, anchor="ma")
  canvas.text((535, 42), f"steps/s: {setup + ', ' if setup else ''}length {length}; accuracy: "
              f"{whose}" + ("; bar: lowest to highest run" if seeds > 1 else ""), small,
              anchor="ma")
  ax.frame("", f"{whose.split(' (')[0]} test accuracy (%)"
           + (f", mean of {seeds} runs" if seeds > 1 else ""),
           f"training steps/s at length {length} (log)", font=font, small=small)
  palette = colors(p["kind"] for p in points)
  taken: list[Box] = []
  centers = []
  for p, lo, hi in zip(points, lows, highs):
    x, y = ax.xy(p["accuracy"], p["steps_per_s"])
    if hi > lo:
      (xl, _), (xh, _) = ax.xy(lo, p["steps_per_s"]), ax.xy(hi, p["steps_per_s"])
      draw.line([(xl, y), (xh, y)], fill=palette[p["kind"]], width=2)
      for xe in (xl, xh):
        draw.line([(xe, y - 6), (xe, y + 6)], fill=palette[p["kind"]], width=2)
      taken.append((xl, y - 7, xh, y + 7))
    draw.ellipse([x - 7, y - 7, x + 7, y + 7], fill=palette[p["kind"]])
    taken.append((x - 8, y - 8, x + 8, y + 8))
    centers.append((x, y))
  for p, center in sorted(zip(points, centers), key=lambda pc: pc[1][0]):
    place_label(canvas, center, p["kind"], small, ax.box, taken)
  return canvas.save(path)


BEGIN, END = "<!-- lra_speed tables: begin -->", "<!-- lra_speed tables: end -->"


def write_markdown(path: str, text: str) -> None:
  """Writes the tables to `path`; a file that already holds the BEGIN and END marker lines
  keeps everything outside them (a document's prose around its generated tables)."""
  old = open(path).read() if os.path.exists(path) else ""
  if BEGIN in old and END in old.split(BEGIN, 1)[1]:
    head, rest = old.split(BEGIN, 1)
    text = f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}"
  else:
    text += "\n"
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)
