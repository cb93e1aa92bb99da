"""PNG files through Pillow: 8-bit decode (every colour type, every filter) and encode.

Pathfinder images are 8-bit PNGs (the LRA release and our generator both write them). Pillow
decodes the pixels; before it does, `decode` walks the file's chunks and checks every chunk's
CRC (Pillow does not check those of the image data), the header, the palette and the size of
the inflated image data (Pillow fills missing rows with zeros when the compressed stream ends
early but cleanly), so that a damaged or unsupported file raises `PngError` saying what is
wrong instead of giving wrong pixels. Supported: bit depth 8 in every colour type (grayscale,
RGB, palette, grayscale+alpha, RGBA), all five scanline filters, no interlacing. `decode_gray`
returns a grayscale image (RGB and palette converted with ITU-R 601-2 luma weights, rounded to
nearest, alpha dropped). `encode` writes grayscale `[H, W]` or RGB `[H, W, 3]` uint8 arrays.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import Iterator

import numpy as np
from PIL import Image

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
_MODES = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}  # Pillow mode of an 8-bit PNG -> samples


class PngError(ValueError):
  """Not a PNG this module can read (or a corrupt one)."""


def _chunks(data: bytes) -> Iterator[tuple[bytes, memoryview]]:
  """(type, body) of every chunk up to IEND, each checked against its CRC."""
  if not data.startswith(SIGNATURE):
    raise PngError("not a PNG file (bad signature).")
  view = memoryview(data)
  pos = len(SIGNATURE)
  while pos + 8 <= len(data):
    length, kind = struct.unpack_from(">I4s", data, pos)
    body = view[pos + 8:pos + 8 + length]
    crc = data[pos + 8 + length:pos + 12 + length]
    if len(body) != length or len(crc) != 4:
      raise PngError(f"truncated PNG chunk {kind!r}.")
    if zlib.crc32(body, zlib.crc32(kind)) != struct.unpack(">I", crc)[0]:
      raise PngError(f"PNG chunk {kind!r} fails its CRC check (corrupt file).")
    yield kind, body
    if kind == b"IEND":
      return
    pos += 12 + length
  raise PngError("truncated PNG (no IEND chunk).")


def _check(data: bytes) -> int:
  """Checks the chunks, header, palette and image data size of a PNG; returns its colour type.
  The image data is inflated here only to count it and read the filter bytes."""
  header, palette, idat = None, False, []
  for kind, body in _chunks(data):
    if kind == b"IHDR" and len(body) == 13:
      header = struct.unpack(">IIBBBBB", body)
    elif kind == b"PLTE":
      palette = True
    elif kind == b"IDAT":
      idat.append(body)
  if header is None:
    raise PngError("PNG has no IHDR chunk.")
  width, height, depth, colour, _, _, interlace = header
  if depth != 8 or colour not in _CHANNELS:
    raise PngError(f"only 8-bit PNGs are supported, got bit depth {depth}, colour type {colour}.")
  if interlace:
    raise PngError("interlaced PNGs are not supported; re-save the image without interlacing.")
  if colour == 3 and not palette:
    raise PngError("palette PNG without a PLTE chunk.")
  try:
    raw = zlib.decompress(b"".join(idat))
  except zlib.error as e:
    raise PngError(f"corrupt PNG image data ({e}).") from None
  stride = width * _CHANNELS[colour] + 1                    # filter byte + samples
  if len(raw) != height * stride:
    raise PngError(f"PNG image data has {len(raw)} bytes, expected {height * stride}.")
  filters = np.frombuffer(raw, np.uint8)[::stride]          # [H] filter type per row
  if height and filters.max() > 4:
    y = int(np.argmax(filters > 4))
    raise PngError(f"unknown PNG filter type {filters[y]} on row {y}.")
  return colour


def decode(data: bytes) -> np.ndarray:
  """An 8-bit PNG as uint8 [H, W] (gray), [H, W, 2] (gray+alpha), [H, W, 3] (RGB, palette) or
  [H, W, 4] (RGBA)."""
  colour = _check(data)
  try:
    with Image.open(io.BytesIO(data), formats=("PNG",)) as image:
      image.load()
      if colour == 3:
        image = image.convert("RGB")          # palette entries, transparency dropped
      if image.mode not in _MODES:
        raise PngError(f"unexpected PNG pixel format {image.mode!r} for colour type {colour}.")
      return np.array(image, np.uint8)
  except PngError:
    raise
  except (OSError, SyntaxError, ValueError, zlib.error) as e:
    raise PngError(f"corrupt PNG image data ({e}).") from None


def to_gray(image: np.ndarray) -> np.ndarray:
  """uint8 [H, W] from a decoded image: luma (0.299 R + 0.587 G + 0.114 B) for colour images."""
  if image.ndim == 2:
    return image
  if image.shape[-1] in (1, 2):
    return image[..., 0]
  rgb = image[..., :3].astype(np.float64)
  return np.clip(np.rint(rgb @ np.array([0.299, 0.587, 0.114])), 0, 255).astype(np.uint8)


def decode_gray(data: bytes) -> np.ndarray:
  """An 8-bit PNG as a grayscale uint8 [H, W] array."""
  return to_gray(decode(data))


def encode(image: np.ndarray) -> bytes:
  """PNG bytes of a uint8 grayscale [H, W] or RGB [H, W, 3] image (Pillow, zlib level 9)."""
  image = np.asarray(image)
  if image.dtype != np.uint8 or image.ndim not in (2, 3) or (
      image.ndim == 3 and image.shape[2] != 3):
    raise ValueError(f"expected uint8 [H, W] or [H, W, 3], got {image.dtype} {image.shape}.")
  out = io.BytesIO()
  Image.fromarray(np.ascontiguousarray(image)).save(out, format="PNG", compress_level=9)
  return out.getvalue()


def read_gray(path: str) -> np.ndarray:
  """The PNG file at `path` as a grayscale uint8 [H, W] array."""
  with open(path, "rb") as f:
    return decode_gray(f.read())


def write(path: str, image: np.ndarray) -> None:
  """Writes a uint8 grayscale [H, W] or RGB [H, W, 3] image to `path` as a PNG."""
  with open(path, "wb") as f:
    f.write(encode(image))
