"""The report of `benchmarks/lra_speed.py`: its Markdown tables, and its plots drawn with Pillow
(a core dependency; matplotlib is not).

`render_table`: one row per (kind, length); `render_growth`: peak memory above the process
baseline per doubling of the length; `render_lra_layout`: the LRA paper's Table 2 layout
(kinds as rows, speed and memory relative to dot_product per length, or to flash, exact and
memory-efficient, where dot_product ran out of memory). `plot_lengths`: steps/s and peak memory against the sequence length, both axes logarithmic, one
line per attention kind (the references dashed). `read_accuracy` reads the test accuracy per
kind from `lra results DIR --format json` (a list of runs) or `lra results DIR --lra --format
json` (`{"common", "cells"}`), `speed_accuracy_points` pairs it with the measured steps/s, and
`plot_accuracy` draws steps/s (log) against test accuracy. `write_markdown` writes the tables
into a document between its marker lines.
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


class Axes:
  """A rectangle of the image with data limits; x and y each linear or logarithmic."""

  def __init__(self, image, box, xlim, ylim, xlog, ylog):
    self.image, self.draw = image, ImageDraw.Draw(image)
    self.box, self.xlog, self.ylog = box, xlog, ylog
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
    d, (x0, y0, x1, y1) = self.draw, self.box
    xticks = xticks or (_log_ticks(*self.xlim) if self.xlog else _linear_ticks(*self.xlim))
    yticks = _log_ticks(*self.ylim) if self.ylog else _linear_ticks(*self.ylim)
    for t in xticks:
      px = self.xy(t, self.ylim[0])[0]
      d.line([(px, y0), (px, y1)], fill="#e6e6e6")
      d.text((px, y1 + 6), (xlabel_of or _label)(t), fill="black", font=small, anchor="mt")
    for t in yticks:
      py = self.xy(self.xlim[0], t)[1]
      d.line([(x0, py), (x1, py)], fill="#e6e6e6")
      d.text((x0 - 6, py), _label(t), fill="black", font=small, anchor="rm")
    d.rectangle(self.box, outline="black")
    d.text(((x0 + x1) / 2, y0 - 10), title, fill="black", font=font, anchor="md")
    d.text(((x0 + x1) / 2, y1 + 30), xlabel, fill="black", font=small, anchor="mt")
    label = Image.new("RGBA", (int(y1 - y0), 24), (255, 255, 255, 0))
    ImageDraw.Draw(label).text((label.width / 2, 12), ylabel, fill="black", font=small,
                               anchor="mm")
    label = label.rotate(90, expand=True)
    self.image.paste(label, (int(x0 - 78), int(y0)), label)

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
    if marker:
      for x, y in pts:
        self.draw.ellipse([x - 5, y - 5, x + 5, y + 5], fill=color)


def _linear_ticks(lo: float, hi: float) -> list[float]:
  step = 10.0 ** math.floor(math.log10(max(hi - lo, 1e-9) / 2))
  for mult in (1, 2, 5, 10):
    if (hi - lo) / (step * mult) <= 8:
      step *= mult
      break
  return [step * i for i in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def _length_label(v: float) -> str:
  return f"{int(v) // 1024}K" if v >= 1024 and int(v) % 1024 == 0 else _label(v)


def plot_lengths(records: list[dict], path: str, xticks: list[int] | None = None) -> None:
  """Two panels (steps/s, peak GB) against length, log-log, one line per kind; a kind's
  unmeasured lengths (OOM, timeout, skipped) are listed in its legend entry. `xticks`: the
  labelled lengths (default: every length in `records`)."""
  ok = [r for r in records if r.get("status") == "ok"]
  kinds = list(dict.fromkeys(r["kind"] for r in records))
  if not ok:
    return
  palette = colors(kinds)
  lengths = sorted({r["length"] for r in records})
  image = Image.new("RGB", (1500, 640), "white")
  draw = ImageDraw.Draw(image)
  font, small = _font(20), _font(15)
  for i, (field, title, ylabel) in enumerate((
      ("steps_per_s", "Training steps per second", "steps/s (median)"),
      ("peak_gb", "Peak memory", "GB"))):
    values = [r[field] for r in ok]
    ax = Axes(image, (110 + i * 560, 60, 580 + i * 560, 540), (lengths[0], lengths[-1]),
              (min(values), max(values)), True, True)
    ax.frame(title, "sequence length (log)", ylabel + " (log)", xticks=xticks or lengths,
             font=font, small=small, xlabel_of=_length_label)
    for k in kinds:
      pts = sorted((r["length"], r[field]) for r in ok if r["kind"] == k)
      if pts:
        ax.series(pts, palette[k], dashed=k in REFERENCES)
  y = 60
  setup = ok[0]
  draw.text((1240, 30), f"batch {setup['batch']}, {setup['setup']}", fill="black", font=small)
  for k in kinds:
    missing = sorted((r for r in records if r["kind"] == k and r.get("status") != "ok"),
                     key=lambda r: r["length"])           # the first failure says why
    text = k + (f"  ({missing[0]['status'].upper()} at {missing[0]['length']})"
                if missing else "")
    draw.line([(1240, y + 9), (1275, y + 9)], fill=palette[k], width=4)
    draw.text((1283, y), text, fill="black", font=small)
    y += 26
  image.save(path)


def read_accuracy(path: str, task: str = "text") -> dict[str, list[float]]:
  """{kind: [test accuracy in percent, one per finished run (or per cell's mean)]} of `task`."""
  with open(path) as f:
    data = json.load(f)
  out: dict[str, list[float]] = {}
  if isinstance(data, dict) and "cells" in data:            # lra results --lra --format json
    names = {"listops": "ListOps", "text": "Text", "retrieval": "Retrieval", "image": "Image",
             "pathfinder": "Pathfinder", "pathx": "Path-X"}
    for c in data["cells"]:
      if c.get("task") in (task, names.get(task)) and c.get("mean") is not None:
        out.setdefault(str(c["row"]).split()[0], []).append(float(c["mean"]))
    return out
  for row in data:                                           # lra results --format json
    if (row.get("task") == task and row.get("status") == "finished"
        and row.get("metric", "accuracy") == "accuracy" and row.get("test") is not None):
      out.setdefault(row["attention"], []).append(100.0 * float(row["test"]))
  return out


def speed_accuracy_points(records: list[dict], accuracy: dict[str, list[float]],
                          length: int | None = None) -> list[dict]:
  """One point per kind with both a measured speed at `length` (default: the shortest length
  measured) and an accuracy: mean accuracy over its runs."""
  ok = [r for r in records if r.get("status") == "ok"]
  if not ok:
    return []
  length = length or min(r["length"] for r in ok)
  speed = {r["kind"]: r["steps_per_s"] for r in ok if r["length"] == length}
  return [dict(kind=k, length=length, accuracy=statistics.fmean(accs), runs=len(accs),
               steps_per_s=speed[k]) for k, accs in sorted(accuracy.items()) if k in speed]


def plot_accuracy(points: list[dict], path: str) -> None:
  """Steps/s (log) against test accuracy, one labelled point per kind."""
  image = Image.new("RGB", (1000, 680), "white")
  draw = ImageDraw.Draw(image)
  font, small = _font(20), _font(15)
  acc = [p["accuracy"] for p in points]
  speed = [p["steps_per_s"] for p in points]
  ax = Axes(image, (110, 60, 960, 580), (min(acc), max(acc)), (min(speed), max(speed)),
            False, True)
  ax.frame(f"Speed and accuracy (length {points[0]['length']})", "test accuracy (%)",
           "training steps/s (log)", font=font, small=small)
  palette = colors(p["kind"] for p in points)
  for p in points:
    x, y = ax.xy(p["accuracy"], p["steps_per_s"])
    draw.ellipse([x - 7, y - 7, x + 7, y + 7], fill=palette[p["kind"]])
    if x + 10 + draw.textlength(p["kind"], font=small) <= ax.box[2] - 4:
      draw.text((x + 10, y - 10), p["kind"], fill="black", font=small)
    else:                              # would cross the frame's right edge: label to the left
      draw.text((x - 10, y - 10), p["kind"], fill="black", font=small, anchor="ra")
  image.save(path)


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
