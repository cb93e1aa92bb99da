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
`Canvas` (benchmarks/pillow_canvas.py), which records its box:
`place_label` puts each kind's label at the first spot near its point that covers no other label,
point or bar, and the tests check that no two texts of a plot overlap and that the legend is off
the panels.
"""

from __future__ import annotations

import json
import math
import os
import statistics

from benchmarks.pillow_canvas import Axes, Box, Canvas, dashes, length_label, load_font, overlaps

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
  font, small = load_font(20), load_font(15)
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
             font=font, small=small, xlabel_of=length_label)
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
    text = k + (f"  ({missing[0]['status'].upper()} at {length_label(missing[0]['length'])})"
                if missing else "")
    if k in dashed:
      dashes(draw, (x0, y + 9), (x0 + 36, y + 9), palette[k])
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
  font, small = load_font(20), load_font(15)
  lows = [min(p.get("accuracies") or [p["accuracy"]]) for p in points]
  highs = [max(p.get("accuracies") or [p["accuracy"]]) for p in points]
  speed = [p["steps_per_s"] for p in points]
  ax = Axes(canvas, (110, 90, 960, 590), (min(lows), max(highs)), (min(speed), max(speed)),
            False, True)
  first = points[0]
  length = length_label(first["length"])
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
