"""Pathfinder image generator: a numpy port of the Linsley et al. snakes generator.

Pathfinder (Linsley et al. 2018; Kim, Linsley et al. 2020; the generator drewlinsley/pathfinder,
`snakes2.py`) shows two markers and several curved paths ("snakes") made of short segments; the
label is 1 when both markers sit on the two ends of the same path. LRA used 32x32 images with
paths of 14 segments (Pathfinder) and 128x128 ones (Path-X). Per image:

1. two target snakes of `contour_length` segments: the first starts at a free pixel at least
   2 seed_distance from the edges, the second seed_distance away from it; they grow one segment
   at a time, alternately. A segment goes from the current end (the pivot) to a point of the
   circle of radius paddle_length + 2 margin around it, drawn with probability proportional to
   cos(min(continuity * turn, pi/2))^2 times the free space there, and it must not overlap
   anything drawn so far (occupancy masks: each segment dilated by `margin`);
2. two markers (disks of marker_radius): on both ends of one target snake for label 1, on ends
   of different target snakes for label 0;
3. distractor snakes of contour_length // 3 segments, num_distractors // that many, each tried
   up to 5 times and skipped when it does not fit.

Everything is drawn at antialias_scale x the resolution and shrunk with a Lanczos filter, as the
original did with PIL and scipy, and the image is byte-scaled to 0..255 by its maximum (what
`scipy.misc.imsave` did). Where we differ from the original, and why, is listed in
docs/pathfinder_generator.md. The main ones: a segment is drawn from pivot to pivot (the
original drew only its middle `paddle_length` pixels, so its paths were dashed), and the target
snakes with their markers touch no other object, so that thresholding the image at any level in
FLOOD_FILL_RANGE[resolution] and flood-filling (8-connected) from one marker reaches the other
marker exactly when the label is 1. Each image is checked this way before it is returned.

`style="dashed"` draws as the original instead, for data that looks like the LRA release: each
segment shows only its middle `paddle_length` pixels (the original's gaps of about 2 margin
around every pivot), the occupancy masks and free-space weights are those of these paddles, and
the targets-apart rule is dropped (markers are drawn last, over whatever is there, as the
original did). The pixels then no longer decide the label by a flood fill, so dashed images are
not flood-fill checked; `style="continuous"` (the default) is as described above.

`write_dataset` writes the LRA release layout (`imgs/<batch>/sample_<i>.png`, text
`metadata/<batch>.npy`); `python -m lra.data.pathfinder_generator --output_dir D` runs it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Iterator

import numpy as np
import tqdm

from lra.data import pathfinder_draw as draw
from lra.data import pathfinder_snakes as snakes
from lra.data import png

# LRA's settings per resolution (the docstrings of lra_benchmarks/data/pathfinder.py applied to
# the defaults of snakes2_wrapper.py). num_distractors is divided by the distractor length.
PARAMS: dict[int, dict] = {
    32: dict(padding=1, paddle_length=2, paddle_thickness=0.5, paddle_margins=(1,),
             marker_radius=1.5, antialias_scale=2, seed_distance=7, continuity=1.0,
             num_distractors=20, snake_contrasts=(2.0,), paddle_contrasts=(0.75,)),
    64: dict(padding=1, paddle_length=5, paddle_thickness=1.0, paddle_margins=(1,),
             marker_radius=2.5, antialias_scale=2, seed_distance=12, continuity=1.8,
             num_distractors=22, snake_contrasts=(0.8,), paddle_contrasts=(1.0,)),
    128: dict(padding=1, paddle_length=5, paddle_thickness=1.5, paddle_margins=(2, 3),
              marker_radius=3.0, antialias_scale=2, seed_distance=20, continuity=1.8,
              num_distractors=35, snake_contrasts=(0.9,), paddle_contrasts=(1.0,)),
    256: dict(padding=22, paddle_length=5, paddle_thickness=2.0, paddle_margins=(3,),
              marker_radius=5.0, antialias_scale=2, seed_distance=27, continuity=1.8,
              num_distractors=30, snake_contrasts=(1.0,), paddle_contrasts=(1.0,)),
}
CONTOUR_LENGTHS = (6, 9, 14)     # easy (curv_baseline), intermediate, hard
SEGMENT_RETRIES = 2              # the original's max_paddle_retrial
DISTRACTOR_RETRIES = 4           # max_distractor_contour_retrial
MAX_ATTEMPTS = 20000            # attempts per image before giving up (the original: forever)
# The flood-fill guarantee per resolution: at any threshold t in [low, high], the 8-connected
# pixels >= t that hold one marker hold the other exactly when the label is 1. PF-64's thin
# dim lines (thickness 1, contrast 0.8) need a lower band.
FLOOD_FILL_RANGE: dict[int, tuple[int, int]] = {32: (64, 100), 64: (40, 56), 128: (64, 100),
                                                256: (64, 100)}
STYLES = ("continuous", "dashed")  # pivot-to-pivot lines (the default); the original's paddles
IMAGES_PER_BATCH = 1000         # images per imgs/<batch> folder
PROGRESS_CHUNK = 256            # images generated between progress bar updates
ATTEMPTS_PER_BATCH = 1024        # attempts drawn together at 32x32 (fewer for larger images)


def check_settings(resolution: int, contour_length: int, style: str = "continuous") -> None:
  """Raises ValueError naming the valid values when a setting is not one of them."""
  if style not in STYLES:
    raise ValueError(f"Pathfinder style {style!r} is not supported; valid styles: "
                     f"{', '.join(STYLES)}.")
  if resolution not in PARAMS:
    raise ValueError(f"Pathfinder resolution {resolution!r} is not supported; valid "
                     f"resolutions: {', '.join(map(str, PARAMS))}.")
  if contour_length not in CONTOUR_LENGTHS:
    raise ValueError(f"Pathfinder contour_length {contour_length!r} is not supported; valid "
                     f"lengths: {', '.join(map(str, CONTOUR_LENGTHS))} (easy, intermediate, "
                     f"hard).")


def _contrasts(p: dict) -> tuple[tuple[float, ...], np.ndarray]:
  """Every contrast a segment can have (targets: paddle x snake contrast; distractors: snake
  contrast) and the [paddle, snake] table of target contrast indices."""
  values = sorted({pc * sc for pc in p["paddle_contrasts"] for sc in p["snake_contrasts"]}
                  | set(p["snake_contrasts"]))
  target = np.array([[values.index(pc * sc) for sc in p["snake_contrasts"]]
                     for pc in p["paddle_contrasts"]])
  return tuple(values), target


def _lit_level(p: dict, low: int) -> float:
  """The drawn intensity from which a pixel can reach `low` in the saved image: images are
  scaled by their maximum, which is at least the marker's peak."""
  peak = float(draw.marker_stamp(p["marker_radius"], p["antialias_scale"]).max())
  return (low - 1) / 255.0 * peak   # rounding up to `low` needs low - 0.5


class _Recipe:
  """Draws images of one resolution, contour length, margin and style, many attempts at a
  time."""

  def __init__(self, resolution: int, contour_length: int, margin: int,
               style: str = "continuous"):
    self.p = p = PARAMS[resolution]
    self.resolution, self.length, self.margin = resolution, contour_length, margin
    self.dashed = style == "dashed"
    self.values, self.target_c = _contrasts(p)
    self.paddle_c = np.arange(len(p["paddle_contrasts"]))
    self.distractor_c = np.array([self.values.index(c) for c in p["snake_contrasts"]])
    shape = self.shape = draw.Shape(p["paddle_length"], p["paddle_thickness"], margin,
                                    p["antialias_scale"], self.dashed)
    self.low, self.high = FLOOD_FILL_RANGE[resolution]
    self.lit = _lit_level(p, self.low)
    self.tables = snakes.tables(shape, self.values, self.lit)
    marker = draw.marker_stamp(p["marker_radius"], p["antialias_scale"])
    if marker.shape[0] > 2 * shape.half + 1:
      raise ValueError("marker_radius is too large for the paddle stamps.")
    grow = (2 * shape.half + 1 - marker.shape[0]) // 2
    marker = np.pad(marker, grow).astype(np.float32)
    foot = marker >= self.lit
    halo = draw.grow8(foot)
    self.marker = marker
    self.marker_stamps = (snakes.sparse(marker, marker > 0), snakes.sparse(foot, foot),
                          snakes.sparse(halo, halo))
    self.distractor_length = contour_length // 3
    self.num_distractors = p["num_distractors"] // self.distractor_length

  def _pick(self, rng: np.random.Generator, table: np.ndarray, n: int) -> np.ndarray:
    return table[rng.integers(len(table), size=n)] if len(table) > 1 else np.full(n, table[0])

  def targets(self, batch: snakes.Batch, rng: np.random.Generator):
    """Two target snakes (objects 1, 2) in every image; returns (ok [n], pivots
    [n, 2, length + 1, 2]): pivots[i, s] = the pivots of snake s, from its start to its end."""
    p, n = self.p, batch.n
    # Each target snake's contrast: the first two of the doubled snake contrast list shuffled,
    # times a paddle contrast drawn per segment (as the original's two_snakes).
    mu = np.argsort(rng.random((n, 2 * len(p["snake_contrasts"]))), axis=1)[:, :2]
    mu %= len(p["snake_contrasts"])
    tc = lambda s, i: self.target_c[self._pick(rng, self.paddle_c, i.size), mu[i, s]]  # noqa
    tips = np.zeros((n, 2, 2, 2), np.int64)
    pivots = np.zeros((n, 2, self.length + 1, 2), np.int64)
    heading = np.zeros((n, 2))
    idx = np.arange(n)
    ok, start, angle, end = batch.seed(idx, 1, tc(0, idx), border=2 * p["seed_distance"],
                                       slot=0, pair=True)
    idx = idx[ok]
    tips[idx, 0, 0], tips[idx, 0, 1], heading[idx, 0] = start[ok], end[ok], angle[ok]
    todo, alive = idx, np.zeros(n, bool)
    for _ in range(SEGMENT_RETRIES + 1):
      if not todo.size:
        break
      deg = rng.integers(0, 360, size=todo.size)
      where = np.deg2rad(rng.integers(0, 360, size=todo.size))
      at = np.stack([np.round(tips[todo, 0, 0, 0] + p["seed_distance"] * np.sin(where)),
                     np.round(tips[todo, 0, 0, 1] + p["seed_distance"] * np.cos(where))],
                    axis=1).astype(np.int64)
      ok, to = batch.seed_at(todo, at, deg, tc(1, todo), 2, slot=1)
      won = todo[ok]
      tips[won, 1, 0], tips[won, 1, 1] = at[ok], to[ok]
      heading[won, 1] = batch.t.seed_angle[deg[ok]]
      alive[won] = True
      todo = todo[~ok]
    pivots[:, :, 0], pivots[:, :, 1] = tips[:, :, 0], tips[:, :, 1]
    for step in range(2, self.length + 1):
      paddle = self._pick(rng, self.paddle_c, n)
      for s in range(2):
        idx = np.flatnonzero(alive)
        c = self.target_c[paddle[idx], mu[idx, s]]
        ok, end, angle = batch.extend(idx, s + 1, tips[idx, s, 1], heading[idx, s], c,
                                      slot=s, pair=True)
        alive[idx[~ok]] = False
        tips[idx[ok], s, 1], heading[idx[ok], s] = end[ok], angle[ok]
        pivots[idx[ok], s, step] = end[ok]
    idx = np.flatnonzero(alive)
    batch.finish(idx, 0)
    batch.finish(idx, 1)
    return alive, pivots

  def distractors(self, batch: snakes.Batch, rng: np.random.Generator,
                  idx: np.ndarray) -> np.ndarray:
    """Adds distractor snakes to images idx (each tried DISTRACTOR_RETRIES + 1 times, skipped
    when it never fits); returns how many each image got."""
    placed = np.zeros(batch.n, np.int64)
    for i in range(self.num_distractors):
      obj, todo = 3 + i, idx
      for _ in range(DISTRACTOR_RETRIES + 1):
        if not todo.size:
          break
        state = batch.snapshot(todo)
        c = self._pick(rng, self.distractor_c, todo.size)
        ok, _, heading, end = batch.seed(todo, obj, c, border=1, slot=0, pair=False,
                                         stop_fraction=0.01)
        for _ in range(self.distractor_length - 1):
          live = np.flatnonzero(ok)
          c = self._pick(rng, self.distractor_c, live.size)
          grown, end[live], heading[live] = batch.extend(todo[live], obj, end[live],
                                                         heading[live], c, slot=0, pair=False)
          ok[live[~grown]] = False
        batch.finish(todo[ok], 0)
        batch.restore(state, ~ok)
        placed[todo[ok]] += 1
        todo = todo[~ok]
    return placed

  def pairs(self, rng: np.random.Generator, labels: np.ndarray):
    """Target snakes and markers for one attempt per label; returns (batch, idx, a, b, paths,
    grown): the images idx [M] of `batch` that succeeded, their marker pixels a, b [M, 2], the
    pivots [M, 2, length + 1, 2] of the snake marked by a, then of the other one, and how many
    attempts had grown both target snakes.

    Markers sit on the ends of the drawn lines: the first and last pivot (continuous), or the
    tail of the first paddle and the head of the last one (dashed, as the original); continuous
    markers are reserved before the distractors (`Batch.place`), dashed ones are not."""
    p, n = self.p, len(labels)
    batch = snakes.Batch(self.tables, n, self.resolution, padding=p["padding"],
                         continuity=p["continuity"], retries=SEGMENT_RETRIES, rng=rng,
                         separate=not self.dashed)
    ok, pivots = self.targets(batch, rng)
    first = rng.integers(2, size=n)
    second = np.where(labels == 1, first, 1 - first)
    rows = np.arange(n)
    a, b = pivots[rows, first, 0], pivots[rows, second, -1]
    if self.dashed:
      a = a + draw.paddle_ends(self.shape, pivots[rows, first, 1] - a)[0]
      before = pivots[rows, second, -2]
      b = before + draw.paddle_ends(self.shape, b - before)[1]
    idx = np.flatnonzero(ok & batch.inside_image(a) & batch.inside_image(b))
    if not self.dashed:
      idx = idx[batch.place(idx, a[idx], self.marker_stamps, first[idx] + 1)]
      idx = idx[batch.place(idx, b[idx], self.marker_stamps, second[idx] + 1)]
    paths = np.stack([pivots[idx, first[idx]], pivots[idx, 1 - first[idx]]], axis=1)
    return batch, idx, a[idx], b[idx], paths, int(ok.sum())

  def finish(self, rng: np.random.Generator, batch: snakes.Batch, labels: np.ndarray,
             a: np.ndarray, b: np.ndarray, paths: np.ndarray) -> list:
    """Distractors, markers and the saved form of every image of `batch`; returns
    [(image, info)] for those that pass the flood-fill check (continuous style; dashed images
    are not checked)."""
    idx = np.arange(batch.n)
    placed = self.distractors(batch, rng, idx)
    out = []
    half = self.marker.shape[0] // 2
    for k, drawn in zip(idx, batch.crops(idx)):
      drawn = np.pad(drawn, half)
      for y, x in (a[k], b[k]):
        win = drawn[y:y + 2 * half + 1, x:x + 2 * half + 1]
        np.maximum(win, self.marker, out=win)
      image = draw.byte_scale(drawn[half:-half, half:-half])
      ma, mb = tuple(int(v) for v in a[k]), tuple(int(v) for v in b[k])
      if self.dashed:
        good = True
      elif labels[k] == 1:
        good = connected(image, ma, mb, self.high)
      else:
        good = not connected(image, ma, mb, self.low)
      if good:
        path = tuple(tuple((int(y), int(x)) for y, x in snake) for snake in paths[k])
        out.append((image, dict(label=int(labels[k]), markers=(ma, mb), margin=self.margin,
                                distractors=int(placed[k]), paths=path)))
    return out


def connected(image: np.ndarray, a: tuple[int, int], b: tuple[int, int],
              threshold: int) -> bool:
  """Whether pixel b is in the 8-connected set of pixels >= threshold that holds pixel a."""
  lit = np.asarray(image) >= threshold
  if not (lit[a] and lit[b]):
    return False
  h, w = lit.shape
  flat = np.pad(lit, 1).ravel().tolist()     # a ring of unlit pixels: no bounds checks
  stride = w + 2
  steps = (-stride - 1, -stride, -stride + 1, -1, 1, stride - 1, stride, stride + 1)
  start, goal = (a[0] + 1) * stride + a[1] + 1, (b[0] + 1) * stride + b[1] + 1
  flat[start] = False
  stack = [start]
  while stack:
    i = stack.pop()
    if i == goal:
      return True
    for s in steps:
      j = i + s
      if flat[j]:
        flat[j] = False
        stack.append(j)
  return False


def generate_images(rng: np.random.Generator, labels, *, resolution: int = 32,
                    contour_length: int = 14, stats: dict | None = None,
                    style: str = "continuous") -> list[tuple[np.ndarray, dict]]:
  """One image per entry of `labels` (0 or 1), in order: [(uint8 [R, R], info)] (info as for
  `generate_image`).

  `style`: "continuous" (pivot-to-pivot lines; every image passes the flood-fill check of the
  module docstring before it is returned) or "dashed" (the original's paddles, which leave gaps
  along every path, so no flood-fill check is made: the pixels alone do not decide the label).

  Each image draws its margin from the margin list first. Attempts for images of one margin run
  together: target snakes and markers for up to ATTEMPTS_PER_BATCH attempts at a time, then
  distractors for all the attempts that got that far. Raises RuntimeError when MAX_ATTEMPTS
  attempts per image are not enough. `stats`, if given, counts attempts: "attempts", "grown"
  (both target snakes grown), "marked" (markers placed too), "checked" (drawn completely and
  flood-filled), "kept" (passed the flood-fill check; some may serve no waiting image).
  """
  counts = stats if stats is not None else {}
  for key in ("attempts", "grown", "marked", "checked", "kept"):
    counts.setdefault(key, 0)
  check_settings(resolution, contour_length, style)
  labels = [int(v) for v in labels]
  if any(v not in (0, 1) for v in labels):
    raise ValueError(f"labels must be 0 or 1, got {sorted(set(labels))}.")
  margins = PARAMS[resolution]["paddle_margins"]
  drawn = np.asarray(margins)[rng.integers(len(margins), size=len(labels))]
  out: list = [None] * len(labels)
  per_batch = max(8, ATTEMPTS_PER_BATCH * 32 * 32 // resolution ** 2)
  for margin in sorted(set(drawn.tolist())):
    recipe = _Recipe(resolution, contour_length, int(margin), style)
    slots = [i for i in range(len(labels)) if drawn[i] == margin]
    budget, tried, won = MAX_ATTEMPTS * len(slots), 0, 0
    while slots:
      pool, pool_size = [], 0
      while pool_size < min(len(slots), per_batch):
        if tried >= budget:
          raise RuntimeError(
              f"could not draw {resolution}x{resolution} Pathfinder images with contour "
              f"length {contour_length} in {MAX_ATTEMPTS} attempts per image; use the LRA "
              f"settings in PARAMS.")
        rate = (won + 1) / (tried + 20)       # successes per attempt so far (from 5%)
        want = len(slots) - pool_size
        n = int(min(per_batch, max(16, 1.2 * want / rate)))
        tries = np.array([labels[slots[k % len(slots)]] for k in range(n)])
        batch, idx, a, b, paths, grown = recipe.pairs(rng, tries)
        tried, won = tried + n, won + idx.size
        counts["attempts"] += n
        counts["grown"] += grown
        counts["marked"] += idx.size
        if idx.size:  # keep only the images that got this far
          pool.append((snakes.Batch.stack([(batch, idx)]), tries[idx], a, b, paths))
          pool_size += idx.size
      batch = snakes.Batch.stack([(part[0], np.arange(part[0].n)) for part in pool])
      done = recipe.finish(rng, batch, np.concatenate([part[1] for part in pool]),
                           np.concatenate([part[2] for part in pool]),
                           np.concatenate([part[3] for part in pool]),
                           np.concatenate([part[4] for part in pool]))
      counts["checked"] += batch.n
      counts["kept"] += len(done)
      for image, info in done:
        # An attempt made for label L serves the first waiting image with label L.
        k = next((j for j, s in enumerate(slots) if labels[s] == info["label"]), None)
        if k is not None:
          out[slots.pop(k)] = (image, info)
  return out


def generate_image(rng: np.random.Generator, *, resolution: int = 32, label: int,
                   contour_length: int = 14,
                   style: str = "continuous") -> tuple[np.ndarray, dict]:
  """One Pathfinder image, uint8 [resolution, resolution], and an info dict: label, markers
  ((row, col) of both marker centres), margin, distractors (how many fitted), paths (the
  (row, col) pivots of the target snake holding the first marker, then of the other one).

  `style`: "continuous" (default; flood-fill checked) or "dashed" (as the original and the LRA
  release; not flood-fill checked), see `generate_images`."""
  if label not in (0, 1):
    raise ValueError(f"label must be 0 or 1, got {label!r}.")
  return generate_images(rng, [label], resolution=resolution, contour_length=contour_length,
                         style=style)[0]


# ----------------------------------------------------------------------------------------------
# The release layout.


def metadata_line(batch: int, index: int, label: int, resolution: int, contour_length: int,
                  margin: int) -> str:
  """A metadata row as the original wrapper wrote it: image folder, file name, index, label,
  continuity, contour length, distractor length, paddle length, paddle thickness, margin,
  number of paddle contrasts."""
  p = PARAMS[resolution]
  return " ".join(str(v) for v in (
      f"imgs/{batch}", f"sample_{index}.png", index, label, p["continuity"], contour_length,
      contour_length // 3, p["paddle_length"], p["paddle_thickness"], margin,
      len(p["paddle_contrasts"])))


def batch_images(seed: int, batch: int, count: int, *, resolution: int = 32,
                 contour_length: int = 14, stats: dict | None = None,
                 style: str = "continuous") -> Iterator[list[tuple[np.ndarray, dict]]]:
  """The images of imgs/<batch> of a dataset written with `seed`, in chunks of
  PROGRESS_CHUNK: a generator seeded by (seed, batch) draws a balanced, shuffled label list
  (one more of a random label when `count` is odd), then the images in order. `stats`,
  `style`: as for generate_images."""
  rng = np.random.default_rng([seed, batch])
  ones = count // 2 + (count % 2) * int(rng.integers(2))
  labels = rng.permutation(np.array([0] * (count - ones) + [1] * ones))
  for lo in range(0, count, PROGRESS_CHUNK):
    yield generate_images(rng, labels[lo:lo + PROGRESS_CHUNK], resolution=resolution,
                          contour_length=contour_length, stats=stats, style=style)


def write_dataset(output_dir: str, *, resolution: int = 32, num_images: int, seed: int = 0,
                  contour_length: int = 14, images_per_batch: int = IMAGES_PER_BATCH,
                  style: str = "continuous") -> None:
  """Writes `num_images` generated images in the LRA release layout into output_dir:
  imgs/<batch>/sample_<i>.png and metadata/<batch>.npy (text, one `metadata_line` per image),
  `images_per_batch` per batch, each batch as `batch_images` draws it (half of each label), so
  the output depends only on the arguments. Everything goes to a temporary folder next to
  output_dir, renamed to output_dir when complete (output_dir may exist if it is empty).
  Progress goes to stderr. `style`: "continuous" (default; every image flood-fill checked) or
  "dashed" (paddles as the original drew them, like the LRA release; not flood-fill checked,
  see generate_images). The metadata lines are the same for both.
  """
  check_settings(resolution, contour_length, style)
  if num_images < 1 or images_per_batch < 1:
    raise ValueError(f"num_images and images_per_batch must be positive, got {num_images} and "
                     f"{images_per_batch}.")
  output_dir = os.path.abspath(output_dir)
  if os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
    raise FileExistsError(f"{output_dir} exists and is not an empty folder; delete it or "
                          f"choose another output folder.")
  parent = os.path.dirname(output_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".pathfinder-generating-", dir=parent)
  bar = tqdm.tqdm(total=num_images, desc="pathfinder generator", unit=" images",
                  bar_format="{desc}: {n_fmt}/{total_fmt} images |{bar}| {rate_fmt} "
                             "ETA {remaining}", mininterval=1.0)
  try:
    os.makedirs(os.path.join(tmp, "metadata"))
    for batch in range(-(-num_images // images_per_batch)):
      count = min(images_per_batch, num_images - batch * images_per_batch)
      folder = os.path.join(tmp, "imgs", str(batch))
      os.makedirs(folder)
      lines, i = [], 0
      for chunk in batch_images(seed, batch, count, resolution=resolution,
                                contour_length=contour_length, style=style):
        for image, info in chunk:
          png.write(os.path.join(folder, f"sample_{i}.png"), image)
          lines.append(metadata_line(batch, i, info["label"], resolution, contour_length,
                                     info["margin"]))
          i += 1
        bar.update(len(chunk))
      with open(os.path.join(tmp, "metadata", f"{batch}.npy"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if os.path.isdir(output_dir):
      os.rmdir(output_dir)  # empty (checked above)
    os.replace(tmp, output_dir)
  finally:
    bar.close()
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m lra.data.pathfinder_generator",
      description="Writes generated Pathfinder images in the LRA release layout.")
  parser.add_argument("--output_dir", required=True, help="folder to create (absent or empty)")
  parser.add_argument("--resolution", type=int, default=32,
                      help=f"image size: one of {', '.join(map(str, PARAMS))} (default 32)")
  parser.add_argument("--num_images", type=int, default=IMAGES_PER_BATCH)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--contour_length", type=int, default=14,
                      help="segments per path: 6 (easy), 9 (intermediate), 14 (hard; LRA)")
  parser.add_argument("--images_per_batch", type=int, default=IMAGES_PER_BATCH)
  parser.add_argument("--style", default="continuous",
                      help="continuous (default: connected paths, the label decidable by a "
                           "flood fill) or dashed (the original's paddles with gaps, like the "
                           "LRA release)")
  args = parser.parse_args(argv)
  try:
    check_settings(args.resolution, args.contour_length, args.style)
    write_dataset(args.output_dir, resolution=args.resolution, num_images=args.num_images,
                  seed=args.seed, contour_length=args.contour_length,
                  images_per_batch=args.images_per_batch, style=args.style)
  except (ValueError, FileExistsError) as e:
    parser.error(str(e))


if __name__ == "__main__":
  main()
