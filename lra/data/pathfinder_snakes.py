"""Drawing for the Pathfinder generator: stamps, and snakes grown in many images at once.

`lra.data.pathfinder_generator` composes these into images (see its docstring for the
algorithm). This module follows the original generator (drewlinsley/pathfinder, `snakes.py`)
for the drawing:

- rendering: a segment is a line drawn as PIL draws it at `aa` times the resolution, then shrunk
  with PIL's Lanczos filter (`shrink` gives the same 8-bit values as `Image.resize`); its
  occupancy mask is the same line dilated by a disk of radius `margin * aa` before shrinking.
  The line runs from pivot to pivot (continuous style) or, as in the original, covers only the
  middle `length` pixels of the segment (dashed style, `Shape.dashed`, `paddle_ends`).
  Segments start on whole pixels, so one stamp per displacement serves every image (`Tables`).
- `Batch`: the canvases of n images and the snake steps (seed, extend), each applied to a
  subset of the images at once with gathers and scatters of sparse stamps.

Shapes: stamps are [S, S], S = 2 half + 1, centred on the segment's first pixel; canvases are
[n, R + 2P, R + 2P] with P = half, flat views for the gathers.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

LANCZOS_SUPPORT = 3.0
TARGETS = 2      # object ids 1 and 2 are the target snakes (with their markers)


# ----------------------------------------------------------------------------------------------
# Rendering.


def _lanczos(x: np.ndarray) -> np.ndarray:
  return np.where(np.abs(x) < LANCZOS_SUPPORT, np.sinc(x) * np.sinc(x / LANCZOS_SUPPORT), 0.0)


@functools.lru_cache(maxsize=64)
def _resample_matrix(in_size: int, out_size: int) -> np.ndarray:
  """[out, in] weights of PIL's Lanczos resize along one axis (support grows when shrinking)."""
  scale = in_size / out_size
  support = LANCZOS_SUPPORT * max(scale, 1.0)
  inv = 1.0 / max(scale, 1.0)
  weights = np.zeros((out_size, in_size))
  for i in range(out_size):
    centre = (i + 0.5) * scale
    lo = max(int(centre - support + 0.5), 0)
    hi = min(int(centre + support + 0.5), in_size)
    w = _lanczos((np.arange(lo, hi) - centre + 0.5) * inv)
    weights[i, lo:hi] = w / w.sum()
  return weights


def _round8(x: np.ndarray) -> np.ndarray:
  return np.clip(np.floor(x + 0.5), 0, 255)


def shrink(blown: np.ndarray, out_size: int) -> np.ndarray:
  """A square 0..255 image resized to [out_size, out_size] as PIL does for 8-bit images
  (horizontal pass, rounding, vertical pass, rounding); returns values in [0, 1]."""
  m = _resample_matrix(blown.shape[0], out_size)
  horizontal = _round8(blown @ m.T)    # [in, out]
  return _round8(m @ horizontal) / 255.0


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


def _pil_round(f: float, up: bool) -> int:
  """PIL's ROUND_UP / ROUND_DOWN: halves away from / towards zero."""
  a = math.floor(abs(f) + 0.5) if up else math.ceil(abs(f) - 0.5)
  return int(a) if f >= 0 else -int(a)


def _raster_line(size: int, centre: int | tuple[int, int], head: tuple[int, int],
                 width: int) -> np.ndarray:
  """0/255 float [size, size]: PIL's `ImageDraw.line` of `width` from (centre, centre) (or the
  pixel `centre` = (row, col)) to `head` (row, col): a Bresenham line with both ends for width 1;
  for wider lines PIL's four corners of the line polygon, filled row by row (the same pixels as
  Pillow 13)."""
  out = np.zeros((size, size))
  y, x = (centre, centre) if np.ndim(centre) == 0 else (int(centre[0]), int(centre[1]))
  dy, dx = head[0] - y, head[1] - x
  if width <= 1:
    sy, sx, dy, dx = (1 if dy >= 0 else -1), (1 if dx >= 0 else -1), abs(dy), abs(dx)
    major, minor = max(dx, dy), min(dx, dy)
    err = 2 * minor - major
    for _ in range(major + 1):
      out[y, x] = 255.0
      if err >= 0:
        y, x, err = (y + sy, x, err - 2 * major) if dx > dy else (y, x + sx, err - 2 * major)
      err += 2 * minor
      y, x = (y, x + sx) if dx > dy else (y + sy, x)
    return out
  length, half = math.hypot(dx, dy), (width - 1) / 2.0
  big, small = _pil_round(half, True) / length, _pil_round(half, False) / length
  dx_small, dx_big = _pil_round(small * dy, False), _pil_round(big * dy, False)
  dy_small, dy_big = _pil_round(small * dx, False), _pil_round(big * dx, False)
  corners = [(y + dy_big, x - dx_small), (head[0] + dy_big, head[1] - dx_small),
             (head[0] - dy_small, head[1] + dx_big), (y - dy_small, x + dx_big)]
  rows = [c[0] for c in corners]
  for r in range(max(min(rows), 0), min(max(rows), size - 1) + 1):
    xs = []
    for (ay, ax), (by, bx) in zip(corners, corners[1:] + corners[:1]):
      if ay == by:
        xs += [ax, bx] if ay == r else []
      elif min(ay, by) <= r <= max(ay, by):
        xs.append(ax + (r - ay) * (bx - ax) / (by - ay))
    if xs:
      lo, hi = _pil_round(min(xs), True), _pil_round(max(xs), False)
      out[r, max(lo, 0):min(hi, size - 1) + 1] = 255.0
  return out


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
    line = _raster_line(2 * half * aa + 1, tuple(centre + head), tuple(centre + tail), width)
  else:
    line = _raster_line(2 * half * aa + 1, centre, (centre + aa * dy, centre + aa * dx), width)
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


class Sparse(NamedTuple):
  """The kept pixels of stacked stamps [..., S, S], M per stamp (padded entries invalid)."""
  rows: np.ndarray    # [..., M] window row
  cols: np.ndarray    # [..., M] window column
  values: np.ndarray  # [..., M] float32 (0 where invalid)
  valid: np.ndarray   # [..., M] bool


def sparse(values: np.ndarray, keep: np.ndarray) -> Sparse:
  """The pixels `keep` [..., S, S] of `values`, as a Sparse of the same leading shape."""
  lead, size = values.shape[:-2], values.shape[-1]
  keep = keep.reshape(-1, size * size)
  order = np.argsort(~keep, axis=1, kind="stable")[:, :max(int(keep.sum(1).max()), 1)]
  valid = np.take_along_axis(keep, order, 1)
  vals = np.where(valid, np.take_along_axis(values.reshape(-1, size * size), order, 1), 0)
  shape = lead + (order.shape[1],)
  return Sparse((order // size).reshape(shape), (order % size).reshape(shape),
                vals.astype(np.float32).reshape(shape), valid.reshape(shape))


class Tables:
  """Every stamp that images of one shape use, stacked so that a batch gathers them by index.

  A segment is indexed by its displacement d (seeds: whole-degree directions of length `step`;
  extensions: the candidate circle). Stamps are kept sparse: `line[d]` (its nonzero pixels),
  `mask[d]` (nonzero occupancy), `solid[d]` (occupancy >= 0.79: the only pixels where the
  overlap test, occupancy + mask >= 1.8 with occupancy <= 1, can fail), `foot[c, d]` (pixels
  that may be lit when drawn with contrast c: line * contrast >= lit) and `halo[c, d]` (those
  grown by one pixel). `core[a]` holds the offsets where the mask of a paddle-length segment in
  direction a (whole degrees from -180; dashed: of the seed segment's paddle) is 1, padded with
  (0, 0): the seeding element of the original. `probe[k]`: where the free space of candidate k
  is read (the next pivot; dashed: the paddle's head, as the original).
  """

  def __init__(self, shape: Shape, contrasts: tuple[float, ...], lit: float):
    self.shape, self.half = shape, shape.half
    angles = np.deg2rad(np.arange(-180, 180))
    seeds = [translate((0, 0), a, shape.step) for a in angles]
    paddles = [translate((0, 0), a, shape.length) for a in angles]
    cdy, cdx, self.circle_angle = circle(shape.step)
    ring = list(zip(cdy.tolist(), cdx.tolist()))
    disps = sorted(set(seeds) | set(paddles) | set(ring))
    index = {d: i for i, d in enumerate(disps)}
    stamps = [segment(shape, *d) for d in disps]
    line = np.stack([s[0] for s in stamps]).astype(np.float32)            # [D, S, S]
    mask = np.stack([s[1] for s in stamps]).astype(np.float32)            # [D, S, S]
    self.disp = np.array(disps)                                           # [D, 2]
    self.circle_index = np.array([index[d] for d in ring])                # [K]
    self.probe = (paddle_ends(shape, self.disp[self.circle_index])[1] if shape.dashed
                  else self.disp[self.circle_index])                      # [K, 2]
    self.seed_index = np.array([index[d] for d in seeds])                 # [360]
    self.seed_angle = angles                                              # [360]
    cores = []
    for d in (seeds if shape.dashed else paddles):
      off = np.argwhere(mask[index[d]] >= 1.0) - self.half
      cores.append(np.unique(np.concatenate([np.zeros((1, 2), np.int64), off]), axis=0))
    width = max(len(c) for c in cores)
    self.core = np.stack([np.concatenate([c, np.zeros((width - len(c), 2), np.int64)])
                          for c in cores])                                # [360, C, 2]
    self.contrasts = np.asarray(contrasts, np.float32)                    # [N]
    foot = line[None] * self.contrasts[:, None, None, None] >= lit        # [N, D, S, S]
    self.line = sparse(line, line > 0)
    self.mask = sparse(mask, mask > 0)
    self.solid = sparse(mask, mask >= 0.79)
    self.foot = sparse(foot, foot)
    halo = grow8(foot)
    self.halo = sparse(halo, halo)


@functools.lru_cache(maxsize=16)
def tables(shape: Shape, contrasts: tuple[float, ...], lit: float) -> Tables:
  return Tables(shape, contrasts, lit)


class Batch:
  """`n` images drawn in lockstep: each call acts on a subset `idx` [A] of them at once.

  Canvases are padded by the stamp half size P, so the stamp window of a pixel (y, x) of the
  image starts at (y, x) of the padded canvas. Drawing is cut at the image edge, as the
  original's was: stamp pixels outside the image go to a scratch element at the end of each
  flat canvas. Occupancy layers: 0 holds every finished segment; while the two target snakes
  grow, layer 1 + s also holds snake s's last segment, so snake s checks layer 2 - s
  (everything except its own last segment). A segment fits when (as in the original) its mask
  plus the occupancy stays below 1.8, and (our rule, when `separate`) none of the pixels it may
  light touches, even diagonally, a pixel that another object may light (`owner`, object ids
  from 1), one of the two being a target.
  """

  def __init__(self, t: Tables, n: int, size: int, *, padding: int, continuity: float,
               retries: int, rng: np.random.Generator, separate: bool = True):
    self.t, self.n, self.size, self.continuity, self.retries, self.rng = (
        t, n, size, continuity, retries, rng)
    self.separate = separate
    p = self.pad = t.half
    full = self.full = size + 2 * p
    self.scratch = n * full * full
    self.flat_image = np.zeros(self.scratch + 1, np.float32)
    self.flat_occ = [np.zeros(self.scratch + 1, np.float32) for _ in range(3)]
    self.flat_owner = np.zeros(self.scratch + 1, np.int16)
    self.image = self.flat_image[:-1].reshape(n, full, full)
    self.occ = [f[:-1].reshape(n, full, full) for f in self.flat_occ]
    self.owner = self.flat_owner[:-1].reshape(n, full, full)
    for layer in self.occ:
      inner = layer[:, p:p + size, p:p + size]
      inner[:, :padding], inner[:, size - padding:] = 1.0, 1.0
      inner[:, :, :padding], inner[:, :, size - padding:] = 1.0, 1.0
    inside = np.zeros((full, full), bool)
    inside[p:p + size, p:p + size] = True
    self.flat_inside = inside.reshape(-1)
    self.pending = np.full((n, 2), -1)               # last segment per slot (-1: none)
    self.pending_at = np.zeros((n, 2, 2), np.int64)  # its start pixel
    near = np.argwhere(disk(t.shape.margin)) - t.shape.margin          # [J, 2]
    ring = t.probe[:, None, :] + near[None]                           # [K, J, 2]
    self.ring_near = ring[..., 0] * full + ring[..., 1]               # [K, J] flat offsets
    self.rel = {name: getattr(t, name).rows * full + getattr(t, name).cols
                for name in ("line", "mask", "solid", "foot", "halo")}

  # -- windows ----------------------------------------------------------------------------------

  def _entries(self, idx, at, rel: np.ndarray, valid: np.ndarray):
    """Flat canvas indices [A, M] of stamp pixels (rel [A, M] offsets from the window corner
    at `at` [A, 2]) and whether each is a valid pixel inside the image; others -> scratch."""
    pixel = (at[:, 0] * self.full + at[:, 1])[:, None] + rel
    keep = valid & self.flat_inside[pixel]
    return np.where(keep, pixel + (idx * (self.full * self.full))[:, None], self.scratch), keep

  def inside_image(self, at: np.ndarray) -> np.ndarray:
    return np.all((at >= 0) & (at < self.size), axis=-1)

  def crops(self, idx: np.ndarray) -> np.ndarray:
    """float32 [A, R, R] drawn images."""
    p = self.pad
    return self.image[idx, p:p + self.size, p:p + self.size]

  @classmethod
  def stack(cls, parts: list[tuple["Batch", np.ndarray]]) -> "Batch":
    """One batch of the images parts[i][0] at indices parts[i][1], which must have no pending
    segments (only finished drawings and occupancy are kept)."""
    first = parts[0][0]
    out = cls(first.t, sum(len(idx) for _, idx in parts), first.size, padding=0,
              continuity=first.continuity, retries=first.retries, rng=first.rng,
              separate=first.separate)
    out.image[:] = np.concatenate([b.image[idx] for b, idx in parts])
    out.occ[0][:] = np.concatenate([b.occ[0][idx] for b, idx in parts])
    out.owner[:] = np.concatenate([b.owner[idx] for b, idx in parts])
    return out

  def snapshot(self, idx: np.ndarray) -> tuple:
    return (idx, self.image[idx], self.occ[0][idx], self.owner[idx], self.pending[idx],
            self.pending_at[idx])

  def restore(self, state: tuple, which: np.ndarray) -> None:
    """Restores the images state[0][which] from a snapshot."""
    idx = state[0][which]
    self.image[idx], self.occ[0][idx], self.owner[idx] = (
        state[1][which], state[2][which], state[3][which])
    self.pending[idx], self.pending_at[idx] = state[4][which], state[5][which]

  # -- placing segments -------------------------------------------------------------------------

  def _clash(self, idx, at, rel, valid, obj) -> np.ndarray:
    """bool [A]: some pixel (rel, valid) belongs to another object, one of the two being a
    target (ids 1, 2; distractors may touch each other). obj: scalar or [A]."""
    where, keep = self._entries(idx, at, rel, valid)
    owner = self.flat_owner[where]
    obj = np.broadcast_to(np.asarray(obj), idx.shape)[:, None]
    other = (owner != 0) & (owner != obj) & ((owner <= TARGETS) | (obj <= TARGETS))
    return (keep & other).any(axis=1)

  def fits(self, idx, at, d, c, obj, layer: int) -> np.ndarray:
    """bool [A]: whether segment d (contrast index c) from `at` may be drawn for `obj`."""
    t = self.t
    where, keep = self._entries(idx, at, self.rel["solid"][d], t.solid.valid[d])
    over = (keep & (self.flat_occ[layer][where] + t.solid.values[d] >= 1.8)).any(axis=1)
    if not self.separate:
      return ~over
    clash = self._clash(idx, at, self.rel["halo"][c, d], t.halo.valid[c, d], obj)
    return ~(over | clash)

  def _raise(self, layer: int, where: np.ndarray, values: np.ndarray) -> None:
    flat = self.flat_occ[layer]
    flat[where] = np.maximum(flat[where], values)

  def _commit(self, idx, slot: int, layers: tuple[int, ...]) -> None:
    has = self.pending[idx, slot] >= 0
    if not has.any():
      return
    idx = idx[has]
    d = self.pending[idx, slot]
    where, _ = self._entries(idx, self.pending_at[idx, slot], self.rel["mask"][d],
                             self.t.mask.valid[d])
    for layer in layers:
      self._raise(layer, where, self.t.mask.values[d])
    self.pending[idx, slot] = -1

  def draw(self, idx, at, d, c, obj: int, slot: int, pair: bool) -> None:
    """Draws segment d from `at`; its mask stays pending in `slot` until the next one."""
    if not idx.size:
      return
    t = self.t
    where, _ = self._entries(idx, at, self.rel["line"][d], t.line.valid[d])
    line = t.line.values[d] * t.contrasts[c][:, None]
    self.flat_image[where] = np.maximum(self.flat_image[where], line)
    if self.separate:
      where, _ = self._entries(idx, at, self.rel["foot"][c, d], t.foot.valid[c, d])
      self.flat_owner[where] = obj
    if pair:  # snake `slot` sees layer 2 - slot; the other snake sees layer 1 + slot
      self._commit(idx, slot, (0, 2 - slot))
      where, _ = self._entries(idx, at, self.rel["mask"][d], t.mask.valid[d])
      self._raise(1 + slot, where, t.mask.values[d])
    else:
      self._commit(idx, slot, (0,))
    self.pending[idx, slot], self.pending_at[idx, slot] = d, at

  def finish(self, idx, slot: int) -> None:
    """Adds the pending segment of `slot` to the occupancy."""
    self._commit(idx, slot, (0,))

  def place(self, idx, at, stamp: tuple[Sparse, Sparse, Sparse], obj) -> np.ndarray:
    """Reserves a fixed stamp (occupancy, lit pixels, lit pixels grown by one; each a Sparse
    without leading axes) for objects obj [A] where its lit pixels touch no other object:
    adds its occupancy and claims its lit pixels. Returns bool [A]."""
    mask, foot, halo = stamp
    full = self.full
    a = len(idx)
    rel = lambda s: np.broadcast_to(s.rows * full + s.cols, (a, s.rows.size))  # noqa: E731
    grid = lambda s: np.broadcast_to(s.valid, (a, s.valid.size))  # noqa: E731
    ok = ~self._clash(idx, at, rel(halo), grid(halo), obj)
    idx, at, obj = idx[ok], at[ok], np.asarray(obj)[ok]
    where, _ = self._entries(idx, at, rel(mask)[ok], grid(mask)[ok])
    self._raise(0, where, mask.values)
    where, _ = self._entries(idx, at, rel(foot)[ok], grid(foot)[ok])
    self.flat_owner[where] = np.broadcast_to(obj[:, None], where.shape)
    return ok

  # -- snake steps ------------------------------------------------------------------------------

  def _free_starts(self, idx, deg, border: int) -> tuple[np.ndarray, np.ndarray]:
    """A start pixel per image drawn uniformly among those where the seeding element of
    direction deg meets neither the occupancy (> 0.3) nor the `border` band of the edge:
    32 uniform draws per image, the first that fits, or an exact search when none does.
    Returns (start [A, 2], found [A])."""
    lo, hi = border, self.size - border
    a = len(idx)
    start, found = np.zeros((a, 2), np.int64), np.zeros(a, bool)
    if hi <= lo or not a:
      return start, found
    core = self.t.core[deg]                                           # [A, C, 2]
    cand = self.rng.integers(lo, hi, size=(a, 32, 2))
    q = cand[:, :, None, :] + core[:, None]                           # [A, T, C, 2]
    in_image = np.all((q >= 0) & (q < self.size), axis=-1)
    in_band = np.all((q >= lo) & (q < hi), axis=-1)
    qp = np.clip(q + self.pad, 0, self.size + 2 * self.pad - 1)
    occ = self.occ[0][idx[:, None, None], qp[..., 0], qp[..., 1]]
    good = np.all(~in_image | (in_band & (occ <= 0.3)), axis=-1)      # [A, T]
    found = good.any(axis=1)
    start[found] = cand[found, good[found].argmax(axis=1)]
    p = self.pad
    for k in np.flatnonzero(~found):
      lined = self.occ[0][idx[k], p:p + self.size, p:p + self.size] > 0.3
      lined[:lo], lined[hi:], lined[:, :lo], lined[:, hi:] = True, True, True, True
      free = np.flatnonzero(~_dilate_bool(lined, self.t.core[deg[k]]))
      if free.size:
        start[k] = divmod(int(free[self.rng.integers(free.size)]), self.size)
        found[k] = True
    return start, found

  def seed(self, idx, obj: int, c, *, border: int, slot: int, pair: bool,
           stop_fraction: float | None = None):
    """First segments (the original `seed_snake`): per image a random whole-degree direction
    and a free start (see _free_starts); the segment must end inside the image and fit, else
    a new direction is tried, up to retries + 1 times. No free start, or less than
    `stop_fraction` of the image free, fails at once. Returns (ok [A], start, angle, end)."""
    a = len(idx)
    ok, start, end = np.zeros(a, bool), np.zeros((a, 2), np.int64), np.zeros((a, 2), np.int64)
    angle = np.zeros(a)
    todo = np.arange(a)
    if stop_fraction is not None:
      p = self.pad
      free = (self.occ[0][idx, p:p + self.size, p:p + self.size] <= 0.3).mean(axis=(1, 2))
      todo = todo[free >= stop_fraction]
    layer = 2 - slot if pair else 0
    for _ in range(self.retries + 1):
      if not todo.size:
        break
      deg = self.rng.integers(0, 360, size=todo.size)
      at, found = self._free_starts(idx[todo], deg, border)
      todo, deg, at = todo[found], deg[found], at[found]
      d = self.t.seed_index[deg]
      to = at + self.t.disp[d]
      good = self.inside_image(to)
      good[good] = self.fits(idx[todo[good]], at[good], d[good], c[todo[good]], obj, layer)
      won = todo[good]
      self.draw(idx[won], at[good], d[good], c[won], obj, slot, pair)
      ok[won], start[won], end[won] = True, at[good], to[good]
      angle[won] = self.t.seed_angle[deg[good]]
      todo = todo[~good]
    return ok, start, angle, end

  def seed_at(self, idx, at, deg, c, obj: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """First segments of the second target snake from given starts and directions (pair
    mode); returns (ok [A], end [A, 2])."""
    d = self.t.seed_index[deg]
    to = at + self.t.disp[d]
    ok = self.inside_image(at) & self.inside_image(to)
    ok[ok] = self.fits(idx[ok], at[ok], d[ok], c[ok], obj, 2 - slot)
    self.draw(idx[ok], at[ok], d[ok], c[ok], obj, slot, True)
    return ok, to

  def extend(self, idx, obj: int, pivot, heading, c, *, slot: int, pair: bool):
    """Adds a segment at the end `pivot` [A, 2] of snakes heading along `heading` [A] (the
    original `extend_snake`): the next pivot is drawn on the circle of radius `step` with
    probability proportional to cos(min(continuity * turn, pi/2))^2 times (1 - occupancy
    dilated by the margin) there (dashed: at its paddle's head, `Tables.probe`); up to
    retries + 1 draws until the segment fits. Returns (ok [A], end [A, 2], angle [A])."""
    t, a = self.t, len(idx)
    layer = 2 - slot if pair else 0
    ends = pivot[:, None, :] + t.disp[t.circle_index][None]           # [A, K, 2]
    inside = self.inside_image(ends)
    # Occupancy dilated by the margin at each candidate. Pixels past the edge read the
    # canvas padding (0), where the original's dilation ignored them: the same maximum, as
    # the nearest edge pixel is in the disk too and the edge rows are occupied (padding).
    base = idx * (self.full * self.full) + (pivot[:, 0] + self.pad) * self.full + (
        pivot[:, 1] + self.pad)
    occ = self.flat_occ[layer][base[:, None, None] + self.ring_near].max(axis=2)   # [A, K]
    turn = np.abs(t.circle_angle[None] - heading[:, None])
    turn = np.minimum(np.minimum(turn, 2 * np.pi - turn) * self.continuity, np.pi / 2)
    pmf = np.where(inside, (1.0 - occ) * np.maximum(np.cos(turn), 0.0) ** 2, 0.0)
    total = pmf.sum(axis=1)
    todo = np.flatnonzero(total >= 1e-4)
    cmf = np.cumsum(pmf[todo], axis=1) / total[todo, None]
    ok, end, angle = np.zeros(a, bool), np.zeros((a, 2), np.int64), np.zeros(a)
    for _ in range(self.retries + 1):
      if not todo.size:
        break
      k = np.argmax(cmf > self.rng.random(todo.size)[:, None], axis=1)
      d = t.circle_index[k]
      good = self.fits(idx[todo], pivot[todo], d, c[todo], obj, layer)
      won = todo[good]
      self.draw(idx[won], pivot[won], d[good], c[won], obj, slot, pair)
      ok[won], end[won], angle[won] = True, ends[won, k[good]], t.circle_angle[k[good]]
      todo, cmf = todo[~good], cmf[~good]
    return ok, end, angle


def _dilate_bool(occupied: np.ndarray, offsets: np.ndarray) -> np.ndarray:
  """out[p] = any(occupied[p + o] for o in offsets), outside the image counted as free."""
  h, w = occupied.shape
  r = int(np.abs(offsets).max()) if offsets.size else 0
  padded = np.pad(occupied, r)
  out = np.zeros_like(occupied)
  for dy, dx in offsets:
    out |= padded[r + dy:r + dy + h, r + dx:r + dx + w]
  return out
