"""PNG files without an imaging library: 8-bit decode (all filters) and grayscale/RGB encode.

Pathfinder images are 8-bit PNGs (the LRA release and our generator both write them). Decoding
supports bit depth 8 in every colour type (grayscale, RGB, palette, grayscale+alpha, RGBA) and all
five scanline filters, without interlacing; anything else raises `PngError` saying what it got.
`decode_gray` returns a grayscale image (RGB and palette converted with ITU-R 601-2 luma
weights, alpha dropped). `encode` writes grayscale `[H, W]` or RGB `[H, W, 3]` uint8 arrays.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel


class PngError(ValueError):
  """Not a PNG this module can read (or a corrupt one)."""


def _chunks(data: bytes):
  if not data.startswith(SIGNATURE):
    raise PngError("not a PNG file (bad signature).")
  pos = len(SIGNATURE)
  while pos + 8 <= len(data):
    length, kind = struct.unpack(">I4s", data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + length]
    crc = data[pos + 8 + length:pos + 12 + length]
    if len(body) != length or len(crc) != 4:
      raise PngError(f"truncated PNG chunk {kind!r}.")
    if zlib.crc32(kind + body) != struct.unpack(">I", crc)[0]:
      raise PngError(f"PNG chunk {kind!r} fails its CRC check (corrupt file).")
    yield kind, body
    if kind == b"IEND":
      return
    pos += 12 + length
  raise PngError("truncated PNG (no IEND chunk).")


def _unfilter(raw: bytes, height: int, stride: int, bpp: int) -> np.ndarray:
  """Undoes the per-scanline filters; returns [height, stride] uint8."""
  if len(raw) != height * (stride + 1):
    raise PngError(f"PNG image data has {len(raw)} bytes, expected {height * (stride + 1)}.")
  rows = np.frombuffer(raw, np.uint8).reshape(height, stride + 1)
  out = np.zeros((height, stride), np.uint8)
  prev = np.zeros(stride, np.int64)
  for y in range(height):
    kind, line = int(rows[y, 0]), rows[y, 1:].astype(np.int64)
    if kind == 0:
      cur = line
    elif kind == 1:  # sub: a running sum along each channel
      cur = np.cumsum(line.reshape(-1, bpp), axis=0).reshape(-1) & 0xFF
    elif kind == 2:  # up
      cur = (line + prev) & 0xFF
    elif kind in (3, 4):  # average, Paeth: sequential in x (plain ints are fastest here)
      ln, up, cur = line.tolist(), prev.tolist(), [0] * stride
      for x in range(stride):
        a = cur[x - bpp] if x >= bpp else 0
        b = up[x]
        if kind == 3:
          pred = (a + b) >> 1
        else:
          c = up[x - bpp] if x >= bpp else 0
          p = a + b - c
          pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
          pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
        cur[x] = (ln[x] + pred) & 0xFF
      cur = np.array(cur, np.int64)
    else:
      raise PngError(f"unknown PNG filter type {kind} on row {y}.")
    out[y] = cur
    prev = cur
  return out


def decode(data: bytes) -> np.ndarray:
  """An 8-bit PNG as uint8 [H, W] (gray), [H, W, 2] (gray+alpha), [H, W, 3] (RGB, palette) or
  [H, W, 4] (RGBA)."""
  header, idat, palette = None, [], None
  for kind, body in _chunks(data):
    if kind == b"IHDR":
      header = struct.unpack(">IIBBBBB", body)
    elif kind == b"IDAT":
      idat.append(body)
    elif kind == b"PLTE":
      palette = np.frombuffer(body, np.uint8).reshape(-1, 3)
  if header is None:
    raise PngError("PNG has no IHDR chunk.")
  width, height, depth, colour, _, _, interlace = header
  if depth != 8 or colour not in _CHANNELS:
    raise PngError(f"only 8-bit PNGs are supported, got bit depth {depth}, colour type {colour}.")
  if interlace:
    raise PngError("interlaced PNGs are not supported; re-save the image without interlacing.")
  try:
    raw = zlib.decompress(b"".join(idat))
  except zlib.error as e:
    raise PngError(f"corrupt PNG image data ({e}).") from None
  channels = _CHANNELS[colour]
  pixels = _unfilter(raw, height, width * channels, channels).reshape(height, width, channels)
  if colour == 3:
    if palette is None:
      raise PngError("palette PNG without a PLTE chunk.")
    return palette[pixels[..., 0]]
  return pixels[..., 0] if channels == 1 else pixels


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


def _chunk(kind: bytes, body: bytes) -> bytes:
  return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def encode(image: np.ndarray) -> bytes:
  """PNG bytes of a uint8 grayscale [H, W] or RGB [H, W, 3] image (filter 0, zlib level 9)."""
  image = np.asarray(image)
  if image.dtype != np.uint8 or image.ndim not in (2, 3) or (
      image.ndim == 3 and image.shape[2] != 3):
    raise ValueError(f"expected uint8 [H, W] or [H, W, 3], got {image.dtype} {image.shape}.")
  height, width = image.shape[:2]
  colour = 0 if image.ndim == 2 else 2
  rows = image.reshape(height, -1)
  raw = np.concatenate([np.zeros((height, 1), np.uint8), rows], axis=1).tobytes()
  return (SIGNATURE
          + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0))
          + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))


def read_gray(path: str) -> np.ndarray:
  with open(path, "rb") as f:
    return decode_gray(f.read())


def write(path: str, image: np.ndarray) -> None:
  with open(path, "wb") as f:
    f.write(encode(image))
