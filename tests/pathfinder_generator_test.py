"""Tests for lra.data.pathfinder_generator: images, labels against a flood fill, the release
layout it writes, determinism, settings errors, and the drawing with Pillow."""

import os

import numpy as np
import pytest

from lra.data import pathfinder_draw as draw
from lra.data import pathfinder_generator as gen
from lra.data import png


def _reaches(image: np.ndarray, a, b, threshold: int) -> bool:
  """Flood fill over 8-connected pixels >= threshold from a (whole-array dilation steps, not
  the generator's own search); whether it reaches b."""
  lit = image >= threshold
  region = np.zeros_like(lit)
  region[a] = lit[a]
  while True:
    padded = np.pad(region, 1)
    grown = np.zeros_like(region)
    for dy in range(3):
      for dx in range(3):
        grown |= padded[dy:dy + lit.shape[0], dx:dx + lit.shape[1]]
    grown &= lit
    if (grown == region).all():
      return bool(region[b])
    region = grown


@pytest.fixture(scope="module")
def images32():
  """60 positives and 60 negatives at 32x32, hard (contour length 14)."""
  labels = [0, 1] * 60
  return labels, gen.generate_images(np.random.default_rng(11), labels, resolution=32)


def test_flood_fill_from_one_marker_reaches_the_other_exactly_for_positives(images32):
  labels, images = images32
  assert [info["label"] for _, info in images] == labels
  low, high = gen.FLOOD_FILL_RANGE[32]
  for image, info in images:
    a, b = info["markers"]
    for threshold in (low, (low + high) // 2, high):
      # Both markers are visible at every threshold, so an unreached marker means a break.
      assert image[a] >= threshold and image[b] >= threshold
      assert _reaches(image, a, b, threshold) == (info["label"] == 1), (info, threshold)
  # Not a trivial layout: markers are usually far apart, and every image has distractors.
  dist = [max(abs(i["markers"][0][0] - i["markers"][1][0]),
              abs(i["markers"][0][1] - i["markers"][1][1])) for _, i in images]
  assert np.median(dist) > 8
  assert min(info["distractors"] for _, info in images) >= 1


def test_flood_fill_check_can_fail():
  """The test's flood fill is not vacuous: joining the markers with a line flips negatives."""
  image, info = gen.generate_image(np.random.default_rng(3), label=0)
  a, b = info["markers"]
  low = gen.FLOOD_FILL_RANGE[32][0]
  assert not _reaches(image, a, b, low)
  joined = image.copy()
  n = max(abs(a[0] - b[0]), abs(a[1] - b[1])) + 1
  joined[np.linspace(a[0], b[0], n).round().astype(int),
         np.linspace(a[1], b[1], n).round().astype(int)] = 255
  assert _reaches(joined, a, b, low)


@pytest.mark.parametrize("resolution", [32, 128])
def test_shapes_dtypes_and_markers(resolution):
  rng = np.random.default_rng(resolution)
  for label in (0, 1):
    image, info = gen.generate_image(rng, resolution=resolution, label=label)
    assert image.dtype == np.uint8 and image.shape == (resolution, resolution)
    assert info["label"] == label
    assert info["margin"] in gen.PARAMS[resolution]["paddle_margins"]
    assert image.max() == 255 and image.min() == 0     # byte-scaled like the original
    for y, x in info["markers"]:
      assert 0 <= y < resolution and 0 <= x < resolution
      assert image[y, x] >= gen.FLOOD_FILL_RANGE[resolution][1]
    assert (image >= 64).mean() < 0.3                        # lines on black, not a filled image


def test_other_resolutions_and_lengths_draw():
  rng = np.random.default_rng(5)
  for resolution, length in ((64, 14), (256, 14), (32, 6), (32, 9)):
    image, info = gen.generate_image(rng, resolution=resolution, label=1,
                                     contour_length=length)
    assert image.shape == (resolution, resolution)
    assert _reaches(image, *info["markers"], gen.FLOOD_FILL_RANGE[resolution][1])


def test_deterministic_for_a_seed():
  labels = [1, 0, 0, 1, 1, 0]
  first = gen.generate_images(np.random.default_rng(7), labels)
  again = gen.generate_images(np.random.default_rng(7), labels)
  other = gen.generate_images(np.random.default_rng(8), labels)
  for (x, xi), (y, yi) in zip(first, again):
    np.testing.assert_array_equal(x, y)
    assert xi == yi
  assert any((x != y).any() for (x, _), (y, _) in zip(first, other))


def _read_metadata(folder: str) -> dict[int, list[list[str]]]:
  rows = {}
  for name in os.listdir(os.path.join(folder, "metadata")):
    with open(os.path.join(folder, "metadata", name)) as f:
      rows[int(name[:-len(".npy")])] = [line.split() for line in f.read().splitlines()]
  return rows


def test_write_dataset_layout_metadata_and_balance(tmp_path, capsys):
  out = str(tmp_path / "pf")
  gen.write_dataset(out, num_images=25, seed=4, images_per_batch=10)
  assert "25/25 images" in capsys.readouterr().err
  assert sorted(os.listdir(out)) == ["imgs", "metadata"]
  assert sorted(os.listdir(os.path.join(out, "imgs"))) == ["0", "1", "2"]
  rows = _read_metadata(out)
  assert sorted(rows) == [0, 1, 2] and [len(rows[b]) for b in range(3)] == [10, 10, 5]
  for batch, lines in rows.items():
    labels = [int(f[3]) for f in lines]
    assert abs(2 * sum(labels) - len(labels)) <= len(labels) % 2   # half of each label
    assert sorted(os.listdir(os.path.join(out, "imgs", str(batch)))) == sorted(
        f"sample_{i}.png" for i in range(len(lines)))
    expected = [img for chunk in gen.batch_images(4, batch, len(lines)) for img in chunk]
    for i, fields in enumerate(lines):
      assert len(fields) == 11
      assert fields[0] == f"imgs/{batch}" and fields[1] == f"sample_{i}.png"
      assert int(fields[2]) == i and int(fields[3]) == expected[i][1]["label"]
      assert fields[4:8] == ["1.0", "14", "4", "2"]      # continuity, lengths, paddle length
      with open(os.path.join(out, fields[0], fields[1]), "rb") as f:
        np.testing.assert_array_equal(png.decode_gray(f.read()), expected[i][0])
  orders = [[int(f[3]) for f in rows[b]] for b in (0, 1)]
  assert orders[0] != sorted(orders[0]) or orders[1] != sorted(orders[1])   # shuffled


def test_write_dataset_is_deterministic_and_refuses_a_full_folder(tmp_path):
  gen.write_dataset(str(tmp_path / "a"), num_images=6, seed=1)
  (tmp_path / "b").mkdir()                                  # an empty folder is fine
  gen.write_dataset(str(tmp_path / "b"), num_images=6, seed=1)
  for name in ["metadata/0.npy"] + [f"imgs/0/sample_{i}.png" for i in range(6)]:
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
  with pytest.raises(FileExistsError, match="not an empty folder"):
    gen.write_dataset(str(tmp_path / "a"), num_images=6)


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
  calls = []

  def interrupted(*args, **kwargs):
    if calls:
      raise KeyboardInterrupt
    calls.append(1)
    return real(*args, **kwargs)

  real = gen.generate_images
  monkeypatch.setattr(gen, "generate_images", interrupted)
  monkeypatch.setattr(gen, "PROGRESS_CHUNK", 4)
  with pytest.raises(KeyboardInterrupt):
    gen.write_dataset(str(tmp_path / "pf"), num_images=12)
  assert calls and os.listdir(tmp_path) == []


def test_bad_settings_name_the_valid_values(tmp_path, capsys):
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match="valid resolutions: 32, 64, 128, 256"):
    gen.generate_image(rng, resolution=48, label=1)
  with pytest.raises(ValueError, match="valid lengths: 6, 9, 14"):
    gen.generate_image(rng, label=1, contour_length=10)
  with pytest.raises(ValueError, match="label must be 0 or 1"):
    gen.generate_image(rng, label=2)
  with pytest.raises(ValueError, match="valid lengths: 6, 9, 14"):
    gen.write_dataset(str(tmp_path / "x"), num_images=2, contour_length=12)
  with pytest.raises(SystemExit):
    gen.main(["--output_dir", str(tmp_path / "y"), "--resolution", "100"])
  assert "valid resolutions: 32, 64, 128, 256" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


def test_command_line_writes_the_layout(tmp_path):
  gen.main(["--output_dir", str(tmp_path / "cli"), "--num_images", "4", "--seed", "2",
            "--contour_length", "6"])
  (lines,) = _read_metadata(str(tmp_path / "cli")).values()
  assert [f[1] for f in lines] == [f"sample_{i}.png" for i in range(4)]
  assert sorted(int(f[3]) for f in lines) == [0, 0, 1, 1] and lines[0][5] == "6"


def test_drawing_is_pils_in_row_col_order():
  """Stamps are drawn with Pillow, (x, y) from (row, col) pixels: lines reach both ends and
  light only pixels near the segment; shrinking keeps flat areas and gives 8-bit levels."""
  rng = np.random.default_rng(0)
  for width in (1, 2, 3, 4):
    for dy, dx in rng.integers(-12, 13, size=(40, 2)):
      if dy == 0 and dx == 0:
        continue
      line = draw.raster_line(41, (20, 20), (20 + dy, 20 + dx), width)
      assert set(np.unique(line)) == {0.0, 255.0}
      near = 0 if width == 1 else 1        # wide lines are polygons, their corners rounded
      for y, x in ((20, 20), (20 + dy, 20 + dx)):
        assert line[y - near:y + near + 1, x - near:x + near + 1].any(), (width, dy, dx)
      rows, cols = np.nonzero(line)
      t = np.clip(((rows - 20) * dy + (cols - 20) * dx) / (dy * dy + dx * dx), 0, 1)
      dist = np.hypot(rows - 20 - t * dy, cols - 20 - t * dx)
      assert dist.max() <= width / 2 + 1, (width, dy, dx)
      if width == 1:
        assert len(rows) == max(abs(dy), abs(dx)) + 1
  for size_in, size_out in ((17, 9), (37, 19), (73, 37), (30, 15)):
    blown = (rng.random((size_in, size_in)) > 0.7) * 255.0
    small = draw.shrink(blown, size_out) * 255
    assert small.shape == (size_out, size_out)
    np.testing.assert_array_equal(small, np.round(small))
    assert abs(small.mean() - blown.mean()) < 12
    np.testing.assert_array_equal(draw.shrink(np.full((size_in, size_in), 255.0), size_out), 1.0)


def test_lra_parameters():
  """The LRA builder docstrings' settings (and the wrapper defaults they left alone)."""
  p32, p128 = gen.PARAMS[32], gen.PARAMS[128]
  assert (p32["paddle_length"], p32["paddle_thickness"], p32["seed_distance"],
          p32["marker_radius"], p32["continuity"]) == (2, 0.5, 7, 1.5, 1.0)
  assert p32["num_distractors"] // (14 // 3) == 5
  assert p128["paddle_margins"] == (2, 3) and p128["num_distractors"] // (14 // 3) == 8
  assert sorted(gen.PARAMS) == [32, 64, 128, 256]


# ----------------------------------------------------------------------------------------------
# The dashed style (the original's paddles).


def _components(lit: np.ndarray) -> np.ndarray:
  """int [H, W]: 8-connected component ids (from 1) of the True pixels, 0 elsewhere."""
  ids = np.zeros(lit.shape, np.int64)
  h, w = lit.shape
  for start in zip(*np.nonzero(lit)):
    if ids[start]:
      continue
    ids[start] = n = ids.max() + 1
    stack = [start]
    while stack:
      y, x = stack.pop()
      for v in range(max(y - 1, 0), min(y + 2, h)):
        for u in range(max(x - 1, 0), min(x + 2, w)):
          if lit[v, u] and not ids[v, u]:
            ids[v, u] = n
            stack.append((v, u))
  return ids


def _along(pivots) -> set:
  """The pixels of the polyline through a snake's pivots."""
  out = set()
  for (y0, x0), (y1, x1) in zip(pivots[:-1], pivots[1:]):
    for t in np.linspace(0.0, 1.0, 4 * max(abs(y1 - y0), abs(x1 - x0)) + 1):
      out.add((int(round(y0 + t * (y1 - y0))), int(round(x0 + t * (x1 - x0)))))
  return out


def _pieces(image: np.ndarray, pivots, threshold: int) -> int:
  """How many 8-connected lit pieces (pixels >= threshold) lie along a snake's path."""
  ids = _components(image >= threshold)
  return len({int(ids[p]) for p in _along(pivots)} - {0})


@pytest.fixture(scope="module")
def dashed32():
  """15 positives and 15 negatives at 32x32, hard, dashed."""
  labels = [1, 0] * 15
  return labels, gen.generate_images(np.random.default_rng(11), labels, style="dashed")


def test_dashed_paths_have_gaps_and_continuous_ones_none(images32, dashed32):
  low, high = gen.FLOOD_FILL_RANGE[32]
  labels, dashed = dashed32
  assert [info["label"] for _, info in dashed] == labels
  for threshold in (low, high):
    for image, info in images32[1][:30]:
      assert [_pieces(image, snake, threshold) for snake in info["paths"]] == [1, 1]
    pieces = [_pieces(image, snake, threshold) for image, info in dashed
              for snake in info["paths"]]
    assert min(pieces) > 1 and np.median(pieces) >= 4, pieces     # 14 paddles, mostly apart
  for image, info in dashed:
    assert image.dtype == np.uint8 and image.shape == (32, 32)
    assert image.max() == 255 and image.min() == 0 and (image >= 64).mean() < 0.3
    a, b = info["markers"]
    assert image[a] >= high and image[b] >= high
    snake = info["paths"][0]           # the markers sit about a margin inside the end pivots
    assert max(abs(a[0] - snake[0][0]), abs(a[1] - snake[0][1])) <= 2
    end = snake[-1] if info["label"] else info["paths"][1][-1]
    assert max(abs(b[0] - end[0]), abs(b[1] - end[1])) <= 2


def test_dashed_is_deterministic_and_differs_from_continuous():
  labels = [1, 0, 0, 1]
  first = gen.generate_images(np.random.default_rng(7), labels, style="dashed")
  again = gen.generate_images(np.random.default_rng(7), labels, style="dashed")
  continuous = gen.generate_images(np.random.default_rng(7), labels)
  for (x, xi), (y, yi), (z, _) in zip(first, again, continuous):
    np.testing.assert_array_equal(x, y)
    assert xi == yi
    assert (x != z).any()
  image, info = gen.generate_image(np.random.default_rng(3), label=1, resolution=128,
                                   style="dashed")
  assert image.shape == (128, 128) and info["label"] == 1


def test_dashed_dataset_is_balanced_and_deterministic(tmp_path):
  gen.write_dataset(str(tmp_path / "a"), num_images=10, seed=3, style="dashed")
  gen.main(["--output_dir", str(tmp_path / "b"), "--num_images", "10", "--seed", "3",
            "--style", "dashed"])
  gen.write_dataset(str(tmp_path / "c"), num_images=10, seed=3)
  (lines,) = _read_metadata(str(tmp_path / "a")).values()
  assert sorted(int(f[3]) for f in lines) == [0] * 5 + [1] * 5
  expected = [img for chunk in gen.batch_images(3, 0, 10, style="dashed") for img in chunk]
  for i, fields in enumerate(lines):
    assert int(fields[3]) == expected[i][1]["label"]
    data = (tmp_path / "a" / fields[0] / fields[1]).read_bytes()
    np.testing.assert_array_equal(png.decode_gray(data), expected[i][0])
    assert data == (tmp_path / "b" / fields[0] / fields[1]).read_bytes()
    assert data != (tmp_path / "c" / fields[0] / fields[1]).read_bytes()
  assert ((tmp_path / "a" / "metadata" / "0.npy").read_bytes()
          == (tmp_path / "b" / "metadata" / "0.npy").read_bytes())


def test_bad_style_names_the_valid_values(tmp_path, capsys):
  with pytest.raises(ValueError, match="valid styles: continuous, dashed"):
    gen.generate_image(np.random.default_rng(0), label=1, style="dotted")
  with pytest.raises(ValueError, match="valid styles: continuous, dashed"):
    gen.write_dataset(str(tmp_path / "x"), num_images=2, style="Dashed")
  with pytest.raises(SystemExit):
    gen.main(["--output_dir", str(tmp_path / "y"), "--style", "solid"])
  assert "valid styles: continuous, dashed" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")
