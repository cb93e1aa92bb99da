"""PNG decoding speed on Path-X-sized images: `lra.data.png.decode_gray` per scanline filter.

Path-X reads 128x128 8-bit grayscale PNGs, hundreds of thousands of them when its dataset is
built, so the decoder's speed per filter type matters: a filter that must be undone pixel by
pixel (Average, Paeth) is where a slow decoder shows. Pillow cannot be told which filter to
write, so `filtered_png` builds the scanlines with numpy (every row with the same filter) and
compresses them with zlib; the images are lines on black, like Path-X's.

For every filter type the benchmark decodes the same set of images once to warm up, then
`--repeats` times; it reports the median time per image of `lra.data.png.decode_gray` and, as
the peer in the same run, of Pillow alone (`Image.open(...).load()` and a numpy copy), and the
ratio of the two. Run it as

  .venv/bin/python benchmarks/png_decode.py [--images 32] [--repeats 5] [--size 128]

To measure another checkout of the codebase, put it first on the path:
`PYTHONPATH=/path/to/checkout .venv/bin/python benchmarks/png_decode.py`; the header line names
the module that was measured.
"""

from __future__ import annotations

import argparse
import io
import statistics
import struct
import time
import zlib
from typing import Callable

import numpy as np
from PIL import Image

from lra.data import png

FILTERS = ("None", "Sub", "Up", "Average", "Paeth")   # PNG filter types 0..4


def chunk(kind: bytes, body: bytes) -> bytes:
  """One PNG chunk: length, type, body and the CRC of type and body."""
  return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def filtered_png(image: np.ndarray, kind: int, level: int = 6) -> bytes:
  """PNG bytes of a uint8 grayscale [H, W] image whose every row uses filter type `kind`."""
  cur = image.astype(np.int64)                                              # [H, W]
  up = np.concatenate([np.zeros_like(cur[:1]), cur[:-1]], axis=0)          # row above
  left = np.concatenate([np.zeros_like(cur[:, :1]), cur[:, :-1]], axis=1)  # pixel to the left
  upleft = np.concatenate([np.zeros_like(up[:, :1]), up[:, :-1]], axis=1)
  if kind == 4:
    p = left + up - upleft
    pa, pb, pc = np.abs(p - left), np.abs(p - up), np.abs(p - upleft)
    pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upleft))
  else:
    pred = [np.zeros_like(cur), left, up, (left + up) // 2][kind]
  rows = ((cur - pred) & 0xFF).astype(np.uint8)
  raw = np.concatenate([np.full((len(rows), 1), kind, np.uint8), rows], axis=1).tobytes()
  h, w = image.shape
  return (png.SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
          + chunk(b"IDAT", zlib.compress(raw, level)) + chunk(b"IEND", b""))


def path_images(count: int, size: int, seed: int = 0) -> list[np.ndarray]:
  """uint8 [size, size] images of a few bright polylines with soft edges on black."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    canvas = np.zeros((size + 2, size + 2))
    for _ in range(12):
      pos, heading = rng.uniform(8, size - 8, 2), rng.uniform(0, 2 * np.pi)
      for _ in range(10):
        heading += rng.normal(0, 0.5)
        end = np.clip(pos + 6 * np.array([np.sin(heading), np.cos(heading)]), 0, size - 1)
        t = np.linspace(0, 1, 13)[:, None]
        y, x = np.rint(pos + t * (end - pos)).astype(int).T
        canvas[y + 1, x + 1] = 1.0
        pos = end
    soft = sum(np.roll(np.roll(canvas, dy, 0), dx, 1) * (0.5 if dy or dx else 1.0)
               for dy in (-1, 0, 1) for dx in (-1, 0, 1))
    out.append(np.clip(np.rint(soft[1:-1, 1:-1] * 255 / 3), 0, 255).astype(np.uint8))
  return out


def pillow_gray(data: bytes) -> np.ndarray:
  """The peer: Pillow alone, no checks of ours."""
  with Image.open(io.BytesIO(data)) as im:
    im.load()
    return np.array(im)


def time_per_image(decode: Callable[[bytes], np.ndarray], files: list[bytes],
                   repeats: int) -> list[float]:
  """Seconds per image of each of `repeats` passes over `files`, after one warm-up pass."""
  for data in files:
    decode(data)
  runs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for data in files:
      decode(data)
    runs.append((time.perf_counter() - t0) / len(files))
  return runs


def run(images: int, repeats: int, size: int) -> list[dict]:
  """One row per filter type: sizes, median ms per image (ours and Pillow's), images/s."""
  pictures = path_images(images, size)
  rows = []
  for kind, name in enumerate(FILTERS):
    files = [filtered_png(p, kind) for p in pictures]
    for data, picture in zip(files, pictures):   # both decoders give the pixels back
      np.testing.assert_array_equal(png.decode_gray(data), picture)
      np.testing.assert_array_equal(pillow_gray(data), picture)
    ours = statistics.median(time_per_image(png.decode_gray, files, repeats))
    peer = statistics.median(time_per_image(pillow_gray, files, repeats))
    rows.append(dict(filter=f"{kind} {name}", bytes=statistics.median(map(len, files)),
                     ms=1e3 * ours, per_s=1.0 / ours, pillow_ms=1e3 * peer, ratio=ours / peer))
  return rows


def table(rows: list[dict]) -> str:
  lines = ["| filter | PNG bytes (median) | decode_gray ms/image | images/s | Pillow alone "
           "ms/image | decode_gray / Pillow |", "|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['filter']} | {r['bytes']:.0f} | {r['ms']:.3f} | {r['per_s']:.0f} | "
                 f"{r['pillow_ms']:.3f} | {r['ratio']:.2f} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--images", type=int, default=32, help="images per filter type")
  parser.add_argument("--repeats", type=int, default=5, help="timed passes (median reported)")
  parser.add_argument("--size", type=int, default=128, help="image side (Path-X: 128)")
  args = parser.parse_args(argv)
  rows = run(args.images, args.repeats, args.size)
  print(f"decode_gray of {png.__name__} ({png.__file__}); Pillow {Image.__version__}; "
        f"{args.images} images of {args.size}x{args.size} per filter, median of "
        f"{args.repeats} passes after a warm-up pass\n")
  print(table(rows))


if __name__ == "__main__":
  main()
