"""Pillow drawing for the benchmark plots: a `Canvas` that records the box of every text it
draws (so tests can check that no two texts overlap and that legends stay off the panels),
log and linear `Axes` with their ticks, and dashed lines. Pillow is a core dependency;
matplotlib is not.
"""

from __future__ import annotations

import math

from PIL import Image, ImageDraw, ImageFont


def load_font(size: int):
  for name in ("DejaVuSans.ttf", "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"):
    try:
      return ImageFont.truetype(name, size)
    except OSError:
      pass
  return ImageFont.load_default()


def log_ticks(lo: float, hi: float) -> list[float]:
  """Ticks within [lo, hi]: 1-2-5 per decade, more in a narrow range, fewer in a wide one."""
  steps = (1, 2, 3, 4, 5, 6, 8) if hi / lo < 10 else (1, 2, 5) if hi / lo < 1e3 else (1,)
  out = []
  for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
    out += [s * 10.0 ** e for s in steps if lo <= s * 10.0 ** e <= hi]
  return out


def tick_label(v: float) -> str:
  if abs(v) < 1e-12:          # zero on a linear axis (or its rounding error)
    return "0"
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
    xticks = xticks or (log_ticks(*self.xlim) if self.xlog else linear_ticks(*self.xlim))
    yticks = log_ticks(*self.ylim) if self.ylog else linear_ticks(*self.ylim)
    placed: list[Box] = []
    ylabels: list[Box] = []
    for t in xticks:
      px = self.xy(t, self.ylim[0])[0]
      d.line([(px, y0), (px, y1)], fill="#e6e6e6")
      text = (xlabel_of or tick_label)(t)
      box = d.textbbox((px, y1 + 6), text, font=small, anchor="mt")
      if not any(overlaps(box, b, 4) for b in placed):   # crowded ticks: every other label
        placed.append(c.text((px, y1 + 6), text, small, anchor="mt"))
    for t in yticks:
      py = self.xy(self.xlim[0], t)[1]
      d.line([(x0, py), (x1, py)], fill="#e6e6e6")
      ylabels.append(c.text((x0 - 6, py), tick_label(t), small, anchor="rm"))
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


def linear_ticks(lo: float, hi: float) -> list[float]:
  step = 10.0 ** math.floor(math.log10(max(hi - lo, 1e-9) / 2))
  for mult in (1, 2, 5, 10):
    if (hi - lo) / (step * mult) <= 8:
      step *= mult
      break
  return [step * i for i in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def length_label(v: float) -> str:
  return f"{int(v) // 1024}K" if v >= 1024 and int(v) % 1024 == 0 else tick_label(v)


def dashes(draw, a, b, color, width=4, dash=8):
  n = max(int(math.hypot(b[0] - a[0], b[1] - a[1]) / dash), 1)
  for i in range(0, n, 2):
    t0, t1 = i / n, min((i + 1) / n, 1.0)
    draw.line([(a[0] + t0 * (b[0] - a[0]), a[1] + t0 * (b[1] - a[1])),
               (a[0] + t1 * (b[0] - a[0]), a[1] + t1 * (b[1] - a[1]))], fill=color, width=width)
