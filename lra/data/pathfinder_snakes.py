"""Snakes grown in many Pathfinder images at once, from stamps.

`lra.data.pathfinder_generator` composes these into images (see its docstring for the
algorithm); `lra.data.pathfinder_draw` draws the stamps. This module follows the original
generator (drewlinsley/pathfinder, `snakes.py`) for the steps of a snake:

- segments start on whole pixels, so one stamp per displacement serves every image (`Tables`);
- `Batch`: the canvases of n images and the snake steps (seed, extend), each applied to a
  subset of the images at once with gathers and scatters of sparse stamps.

Shapes: stamps are [S, S], S = 2 half + 1, centred on the segment's first pixel; canvases are
[n, R + 2P, R + 2P] with P = half, flat views for the gathers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from lra.data.pathfinder_draw import (Shape, circle, disk, grow8, paddle_ends, segment,
                                      translate)

TARGETS = 2      # object ids 1 and 2 are the target snakes (with their markers)


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
