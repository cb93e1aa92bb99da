"""Tests for lra/data/png.py on Path-X-sized images: every scanline filter type decodes to the
known pixels, the encoder round trip, what is refused and why, and a tiny run of
benchmarks/png_decode.py (no timing is asserted)."""

import io
import os
import struct
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import png_decode  # noqa: E402
from lra.data import png  # noqa: E402


@pytest.fixture(scope="module")
def pictures():
  """Two 128x128 line images (Path-X's size) and one of random bytes, where every predictor
  matters."""
  noise = np.random.default_rng(3).integers(0, 256, (128, 128), dtype=np.uint8)
  return png_decode.path_images(2, 128) + [noise]


def _filter_bytes(data: bytes, height: int) -> set[int]:
  """The filter type byte of every scanline of a grayscale PNG with one IDAT chunk."""
  start = data.index(b"IDAT") + 4
  (length,) = struct.unpack(">I", data[start - 8:start - 4])
  raw = np.frombuffer(zlib.decompress(data[start:start + length]), np.uint8)
  return set(raw.reshape(height, -1)[:, 0].tolist())


@pytest.mark.parametrize("kind", range(5), ids=png_decode.FILTERS)
def test_every_filter_type_decodes_to_the_known_pixels(pictures, kind):
  for picture in pictures:
    data = png_decode.filtered_png(picture, kind)
    assert _filter_bytes(data, 128) == {kind}            # the encoder used that filter
    got = png.decode_gray(data)
    assert got.dtype == np.uint8 and got.shape == (128, 128)
    np.testing.assert_array_equal(got, picture)


def test_a_hand_worked_paeth_and_average_image():
  # Row 0 Paeth of [10, 20, 30]: predictors 0, 10, 20 -> stored 10, 10, 10. Row 1 Average of
  # [20, 40, 60] below it: predictors (0 + 10) // 2 = 5, (20 + 20) // 2 = 20, (40 + 30) // 2 = 35.
  raw = bytes([4, 10, 10, 10, 3, 15, 20, 25])
  data = (png.SIGNATURE + png_decode.chunk(b"IHDR", struct.pack(">IIBBBBB", 3, 2, 8, 0, 0, 0, 0))
          + png_decode.chunk(b"IDAT", zlib.compress(raw)) + png_decode.chunk(b"IEND", b""))
  np.testing.assert_array_equal(png.decode(data), [[10, 20, 30], [20, 40, 60]])


def test_encode_round_trips_and_pillow_reads_it(pictures, tmp_path):
  rgb = np.random.default_rng(4).integers(0, 256, (7, 9, 3), dtype=np.uint8)
  for image in pictures + [rgb]:
    data = png.encode(image)
    np.testing.assert_array_equal(png.decode(data), image)
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(data))), image)
  path = str(tmp_path / "a.png")
  png.write(path, pictures[0])
  np.testing.assert_array_equal(png.read_gray(path), pictures[0])
  np.testing.assert_array_equal(png.decode_gray(png.encode(rgb)), png.to_gray(rgb))


def test_palette_and_alpha_images_from_pillow():
  rng = np.random.default_rng(5)
  palette = Image.fromarray(rng.integers(0, 4, (6, 5), dtype=np.uint8), mode="P")
  palette.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 10, 20, 30] + [0] * 756)
  rgba = rng.integers(0, 256, (4, 3, 4), dtype=np.uint8)
  for image, expected in ((palette, np.asarray(palette.convert("RGB"))),
                          (Image.fromarray(rgba), rgba),
                          (Image.fromarray(rgba[..., :2].copy(), mode="LA"), rgba[..., :2])):
    out = io.BytesIO()
    image.save(out, format="PNG", bits=8)
    np.testing.assert_array_equal(png.decode(out.getvalue()), expected)


def _with_header(depth: int, colour: int, interlace: int, idat: bytes = b"") -> bytes:
  chunk = png_decode.chunk
  return (png.SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, depth, colour, 0, 0,
                                                     interlace))
          + chunk(b"IDAT", idat or zlib.compress(bytes(6))) + chunk(b"IEND", b""))


@pytest.mark.parametrize("data, message", [
    (_with_header(8, 0, 1), "interlaced PNGs are not supported"),
    (_with_header(16, 0, 0), "only 8-bit PNGs are supported, got bit depth 16, colour type 0"),
    (_with_header(8, 3, 0), "palette PNG without a PLTE chunk"),
    (_with_header(8, 0, 0, zlib.compress(bytes(3))), "image data has 3 bytes, expected 6"),
    (_with_header(8, 0, 0, zlib.compress(bytes(6))[:-3]), "corrupt PNG image data"),
    (_with_header(8, 0, 0, b"not zlib"), "corrupt PNG image data"),
    (_with_header(8, 0, 0, zlib.compress(bytes([0, 1, 2, 5, 3, 4]))), "filter type 5 on row 1"),
    (png.SIGNATURE + b"\0\0\0\0IEND\xae\x42\x60\x82", "no IHDR chunk"),
])
def test_refusals_say_what_is_wrong(data, message):
  with pytest.raises(png.PngError, match=message):
    png.decode(data)


def test_a_damaged_image_data_chunk_is_refused(pictures):
  data = bytearray(png_decode.filtered_png(pictures[0], 4))
  data[data.index(b"IDAT") + 20] ^= 0x10
  with pytest.raises(png.PngError, match="IDAT.*CRC"):
    png.decode(bytes(data))


def test_benchmark_prints_a_row_per_filter(capsys):
  png_decode.main(["--images", "2", "--repeats", "1", "--size", "16"])
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| ") and "filter" not in line]
  assert [row.split("|")[1].strip() for row in rows] == [
      f"{k} {name}" for k, name in enumerate(png_decode.FILTERS)]
