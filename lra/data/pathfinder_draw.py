"""Drawing one Pathfinder stamp: segment lines, occupancy masks and markers, with Pillow.

The Pathfinder generator (`lra.data.pathfinder_generator`, the algorithm in its docstring) draws
every segment and marker once, as a stamp, and pastes stamps into many images at once
(`lra.data.pathfinder_snakes`). Stamps are drawn as the original generator (drewlinsley/pathfinder,
`snakes.py`) drew its images:

- a segment is a line drawn with Pillow's `ImageDraw.line` at `aa` times the resolution, then
  shrunk with Pillow's Lanczos filter (`shrink`); its occupancy mask is the same line dilated by
  a disk of radius `margin * aa` before shrinking. The line runs from pivot to pivot (continuous
  style) or, as in the original, covers only the middle `length` pixels of the segment (dashed
  style, `Shape.dashed`, `paddle_ends`);
- a marker is a disk centred on a pixel, drawn at `aa` times the resolution and shrunk;
- a finished image is byte-scaled to 0..255 (`byte_scale`), as the original saved it.

Shapes: stamps are [S, S], S = 2 half + 1, centred on the segment's first pixel.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw


def shrink(blown: np.ndarray, out_size: int) -> np.ndarray:
  """A square image of whole values 0..255 resized to [out_size, out_size] with Pillow's Lanczos
  filter on 8-bit pixels (as the original); returns values in [0, 1]."""
  image = Image.fromarray(np.asarray(blown).astype(np.uint8))
  small = image.resize((out_size, out_size), Image.Resampling.LANCZOS)
  return np.asarray(small, np.float64) / 255.0


def disk(radius: float) -> np.ndarray:
  """bool [2r+1, 2r+1] disk, r = floor(radius): the dilation element of the original."""
  r = int(radius)
  y, x = np.ogrid[-r:r + 1, -r:r + 1]
  return x * x + y * y <= radius * radius


def dilate(image: np.ndarray, element: np.ndarray) -> np.ndarray:
  """Grey dilation (max filter) of a non-negative image by a centred boolean element."""
  ry, rx = element.shape[0] // 2, element.shape[1] // 2
  h, w = image.shape
  padded = np.pad(image, ((ry, ry), (rx, rx)))
  out = np.zeros_like(image)
  for dy, dx in zip(*np.nonzero(element)):
    np.maximum(out, padded[dy:dy + h, dx:dx + w], out=out)
  return out


def translate(coord: tuple[int, int], angle: float, dist: float) -> tuple[int, int]:
  """(row, col) moved by `dist` along `angle` (radians, row = sin), rounded up as the original."""
  return (int(math.ceil(coord[0] + dist * math.sin(angle))),
          int(math.ceil(coord[1] + dist * math.cos(angle))))


def raster_line(size: int, start: tuple[int, int], end: tuple[int, int],
                width: int) -> np.ndarray:
  """0/255 float [size, size]: Pillow's `ImageDraw.line` of `width` pixels from the pixel
  `start` to the pixel `end` (both (row, col))."""
  image = Image.new("L", (size, size))
  ImageDraw.Draw(image).line([(int(start[1]), int(start[0])), (int(end[1]), int(end[0]))],
                             fill=255, width=width)
  return np.asarray(image, np.float64)


@functools.lru_cache(maxsize=64)
def marker_stamp(radius: float, aa: int) -> np.ndarray:
  """float [S, S] in [0, 1]: a marker disk centred on the middle pixel, drawn at `aa` times the
  resolution (centred on the blown-up grid point of that pixel, as the original) and shrunk."""
  half = int(math.ceil(radius)) + 4
  n = (2 * half + 1) * aa
  y, x = np.ogrid[0:n, 0:n]
  blown = ((y - half * aa) ** 2 + (x - half * aa) ** 2 <= (radius * aa) ** 2) * 255.0
  return shrink(blown, 2 * half + 1)


class Shape(NamedTuple):
  """Paddle geometry of one image (the margin is drawn per image from the margin list)."""
  length: int        # paddle_length: the drawn part of a segment in the original
  thickness: float   # line width in pixels (drawn as round(thickness * aa) at aa x)
  margin: int        # clearance radius of the occupancy mask
  aa: int            # antialias scale
  dashed: bool = False   # draw only the middle `length` pixels of a segment (the original)

  @property
  def step(self) -> int:
    """Pivot-to-pivot distance, length + 2 margin (the original's paddle period)."""
    return self.length + 2 * self.margin

  @property
  def half(self) -> int:
    """Stamp half size: a segment (up to step + 1 long), its mask margin and the line width."""
    return self.step + 1 + self.margin + int(math.ceil(self.thickness)) + 1


def _ceil(x: np.ndarray) -> np.ndarray:
  """Rounding up as the original's translate_coord, ignoring float noise (sin(pi) ~ 1e-16)."""
  return np.ceil(np.asarray(x) - 1e-9).astype(np.int64)


def paddle_ends(shape: Shape, disp: np.ndarray, scale: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """The dashed paddle of segments with displacements disp [..., 2] (pivot to next pivot), as
  the original drew it: its head is the point `length + margin` from the pivot towards the next
  one, and the line goes back `length` from there, ending about `margin` from the pivot.
  Returns (tail, head) [..., 2] offsets from the pivot in pixels of 1/scale (rounded up)."""
  disp = np.asarray(disp, np.float64)
  angle = np.arctan2(disp[..., 0], disp[..., 1])
  unit = np.stack([np.sin(angle), np.cos(angle)], axis=-1)
  head = _ceil((shape.length + shape.margin) * unit) * scale
  return head + _ceil(-shape.length * scale * unit), head


def segment(shape: Shape, dy: int, dx: int) -> tuple[np.ndarray, np.ndarray]:
  """(line, mask) float [S, S] in [0, 1]: the segment from the centre pixel to the pixel
  (dy, dx) away (dashed: its paddle, `paddle_ends`), and the same line dilated by a disk of
  radius `margin` (its occupancy)."""
  width = int(round(shape.thickness * shape.aa))
  if width != shape.thickness * shape.aa:
    raise ValueError(f"paddle thickness {shape.thickness} times antialias scale {shape.aa} "
                     "must be a whole number of pixels.")
  half, aa = shape.half, shape.aa
  centre = half * aa
  if shape.dashed:  # drawn from the head as the original: head on the pixel grid, tail at aa x
    tail, head = paddle_ends(shape, (dy, dx), scale=aa)
    line = raster_line(2 * half * aa + 1, tuple(centre + head), tuple(centre + tail), width)
  else:
    line = raster_line(2 * half * aa + 1, (centre, centre), (centre + aa * dy, centre + aa * dx),
                       width)
  mask = dilate(line, disk(shape.margin * aa))
  return shrink(line, 2 * half + 1), shrink(mask, 2 * half + 1)


@functools.lru_cache(maxsize=64)
def circle(radius: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Candidate displacements (dy [K], dx [K], angle [K]) around a pivot, as the original
  `get_coords_cmf` finds them: one sample per pixel of arc, truncated to integers, unique, in
  (row, col) order."""
  angles = np.deg2rad(np.arange(0.0, 360.0, 360.0 / (2 * radius * np.pi)))
  d = np.stack([np.floor(radius * np.sin(angles)), np.floor(radius * np.cos(angles))], 1)
  d = np.unique(d.astype(np.int64), axis=0)
  return d[:, 0], d[:, 1], np.arctan2(d[:, 0], d[:, 1])


def grow8(masks: np.ndarray) -> np.ndarray:
  """bool [..., S, S] grown by one pixel in the 8 directions (within the window)."""
  out = masks.copy()
  padded = np.pad(masks, [(0, 0)] * (masks.ndim - 2) + [(1, 1), (1, 1)])
  s0, s1 = masks.shape[-2:]
  for dy in (0, 1, 2):
    for dx in (0, 1, 2):
      out |= padded[..., dy:dy + s0, dx:dx + s1]
  return out


def byte_scale(image: np.ndarray) -> np.ndarray:
  """uint8 image spanning 0..255 from min to max, rounded as `scipy.misc.bytescale`."""
  lo, hi = float(image.min()), float(image.max())
  scale = 255.0 / (hi - lo) if hi > lo else 1.0
  return np.floor(np.clip((image - lo) * scale, 0, 255) + 0.5).astype(np.uint8)
