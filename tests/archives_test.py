"""Tests for lra/data/archives.py (locating, downloading, corrupt archives, the LRA release),
lra/data/builders.py (PaddedSource) and lra/data/png.py (decoding every filter, encoding)."""

import io
import os
import struct
import tarfile
import zipfile
import zlib

import numpy as np
import pytest

from lra.data import archives, builders, png

ARCHIVE = archives.Archive("thing.tar.gz", "https://example.org/thing.tar.gz", "a test archive")


def _write_tar(path, members: dict, mode="w:gz"):
  with tarfile.open(path, mode) as tar:
    for name, data in members.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))


def test_missing_archive_names_url_file_and_directory(tmp_path):
  with pytest.raises(archives.DataMissingError) as err:
    archives.locate(ARCHIVE, str(tmp_path), download=False)
  msg = str(err.value)
  for part in (ARCHIVE.url, str(tmp_path / "thing.tar.gz"), "lra data prepare"):
    assert part in msg
  (tmp_path / "thing.tar.gz").write_bytes(b"x")
  assert archives.locate(ARCHIVE, str(tmp_path), download=False) == str(tmp_path / "thing.tar.gz")


def test_download_writes_the_file_only_when_complete(tmp_path):
  source = tmp_path / "src" / "thing.tar.gz"
  source.parent.mkdir()
  source.write_bytes(b"payload" * 1000)
  local = archives.Archive("thing.tar.gz", source.as_uri(), "a local file")
  dest_dir = tmp_path / "manual"
  path = archives.locate(local, str(dest_dir), download=True)
  assert open(path, "rb").read() == b"payload" * 1000
  gone = archives.Archive("gone.zip", (tmp_path / "nowhere.zip").as_uri(), "absent")
  with pytest.raises(archives.DataMissingError, match="downloading it failed") as err:
    archives.locate(gone, str(dest_dir), download=True)
  assert gone.url in str(err.value)
  assert sorted(os.listdir(dest_dir)) == ["thing.tar.gz"]  # no .part left behind


def test_truncated_tar_and_zip_are_reported_as_corrupt(tmp_path):
  path = tmp_path / "thing.tar.gz"
  _write_tar(path, {f"d/{i}.txt": os.urandom(5000) for i in range(5)})
  assert [n for n, _ in archives.tar_members(str(path))] == [f"d/{i}.txt" for i in range(5)]
  path.write_bytes(path.read_bytes()[:9000])
  with pytest.raises(archives.CorruptArchiveError) as err:
    list(archives.tar_members(str(path), ARCHIVE))
  assert "truncated or corrupt" in str(err.value) and ARCHIVE.url in str(err.value)

  zpath = tmp_path / "t.zip"
  with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr("t", os.urandom(20000))
  assert len(archives.zip_member(str(zpath), "t")) == 20000
  with pytest.raises(archives.CorruptArchiveError, match="no member 'u'"):
    archives.zip_member(str(zpath), "u")
  data = bytearray(zpath.read_bytes())
  data[100:110] = b"\0" * 10  # inside the compressed member: CRC or inflate error
  zpath.write_bytes(bytes(data))
  with pytest.raises(archives.CorruptArchiveError, match="truncated or corrupt"):
    archives.zip_member(str(zpath), "t")


def test_release_is_found_extracted_in_every_known_layout(tmp_path):
  for parent in ("lra_release", "lra_release/lra_release", ""):
    root = tmp_path / parent.replace("/", "_") if parent else tmp_path / "flat"
    (root / parent / "listops-1000").mkdir(parents=True)
    assert archives.find_release_path(str(root), "listops-1000") == \
        os.path.normpath(str(root / parent / "listops-1000"))
  assert archives.find_release_path(str(tmp_path / "empty"), "listops-1000") is None


def test_release_folder_is_extracted_from_the_tarball_alone(tmp_path):
  _write_tar(tmp_path / "lra_release.gz", {
      "lra_release/listops-1000/basic_test.tsv": b"Source\tTarget\n",
      "lra_release/tsv_data/new_aan_pairs.eval.tsv": b"1\ta\tb\tx\ty\n",
      "lra_release/tsv_data/new_aan_pairs.test.tsv": b"0\ta\tb\tx\ty\n",
  })
  path = archives.release_path(str(tmp_path), "tsv_data", download=False)
  assert path == str(tmp_path / "lra_release" / "tsv_data")
  assert sorted(os.listdir(path)) == [archives.EXTRACTED_FROM, "new_aan_pairs.eval.tsv",
                                      "new_aan_pairs.test.tsv"]   # and the archive's record
  record = archives.extraction_record(path)
  assert record == {"lra_release.gz": archives.fingerprint(str(tmp_path / "lra_release.gz"))}
  assert not (tmp_path / "lra_release" / "listops-1000").exists()  # only what was asked for
  assert archives.release_path(str(tmp_path), "tsv_data", download=False) == path  # found now
  with pytest.raises(archives.CorruptArchiveError, match="no member under pathfinder32"):
    archives.release_path(str(tmp_path), "pathfinder32", download=False)
  assert sorted(os.listdir(tmp_path / "lra_release")) == ["tsv_data"]  # nothing half-written


def test_truncated_release_leaves_nothing_extracted(tmp_path):
  _write_tar(tmp_path / "lra_release.gz",
             {f"lra_release/pathfinder32/imgs/{i}.png": os.urandom(4000) for i in range(8)})
  data = (tmp_path / "lra_release.gz").read_bytes()
  (tmp_path / "lra_release.gz").write_bytes(data[:len(data) // 2])
  with pytest.raises(archives.CorruptArchiveError, match="truncated or corrupt"):
    archives.release_path(str(tmp_path), "pathfinder32", download=False)
  assert os.listdir(tmp_path / "lra_release") == []


def test_release_member_outside_its_folder_is_refused(tmp_path):
  _write_tar(tmp_path / "lra_release.gz", {"lra_release/tsv_data/a.tsv": b"x",
                                           "lra_release/tsv_data/../../escaped": b"y"})
  with pytest.raises(archives.CorruptArchiveError, match="points outside its folder"):
    archives.release_path(str(tmp_path), "tsv_data", download=False)
  assert not (tmp_path / "escaped").exists()
  assert not (tmp_path / "lra_release" / "tsv_data").exists()


def test_missing_release_message(tmp_path):
  with pytest.raises(archives.DataMissingError) as err:
    archives.release_path(str(tmp_path), "tsv_data", download=False)
  msg = str(err.value)
  for part in ("tsv_data of the LRA release", archives.LRA_RELEASE.url,
               str(tmp_path / "lra_release.gz"), str(tmp_path / "lra_release")):
    assert part in msg


def test_padded_source_offsets_bytes_and_keeps_the_first_values():
  records = [{"inputs": np.array([0, 5, 255], np.uint8), "targets": np.int64(1)},
             {"inputs": np.arange(10, dtype=np.uint8), "targets": np.int64(0)}]

  class Source(list):
    def __getitems__(self, idx):
      return [self[i] for i in idx]

  src = builders.PaddedSource(Source(records), {"inputs": 6}, offset=builders.BYTE_OFFSET)
  ex = src[0]
  np.testing.assert_array_equal(ex["inputs"], [1, 6, 256, 0, 0, 0])  # a 0 byte is id 1, not pad
  assert ex["inputs"].dtype == np.int32 and ex["targets"].dtype == np.int32
  np.testing.assert_array_equal(src.__getitems__([1])[0]["inputs"], [1, 2, 3, 4, 5, 6])
  with pytest.raises(IndexError):
    src[2]


# ----------------------------------------------------------------------------------------------
# PNG.

# A 7x6 grayscale PNG written by another encoder (Pillow), whose rows use the sub and Paeth filters.
PILLOW_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000070000000608000000002a65dbaa00000039494441547"
    "89c63e4e312e07fc723cba2f4855d88975584e5bfa400db6f765116651e06c15fbc422c8c2ccc9c4a1f"
    "38586425be08fd13900700ddd509ea717b6dc70000000049454e44ae426082")
PILLOW_PIXELS = [[14, 24, 40, 55, 37, 49, 78], [48, 36, 47, 73, 68, 73, 98],
                 [47, 61, 77, 83, 78, 85, 119], [82, 94, 94, 111, 105, 118, 137],
                 [83, 98, 101, 120, 145, 129, 145], [112, 136, 124, 142, 143, 145, 176]]


def _filtered_png(image: np.ndarray, kinds) -> bytes:
  """A PNG whose row y is written with filter kinds[y] (an encoder independent of lra.data.png)."""
  h, w = image.shape[:2]
  bpp = 1 if image.ndim == 2 else image.shape[2]
  rows = image.reshape(h, -1).astype(np.int64)
  out = b""
  for y in range(h):
    cur = rows[y]
    up = rows[y - 1] if y else np.zeros_like(cur)
    left = np.concatenate([np.zeros(bpp, np.int64), cur[:-bpp]])
    upleft = np.concatenate([np.zeros(bpp, np.int64), up[:-bpp]])
    p = left + up - upleft
    pa, pb, pc = abs(p - left), abs(p - up), abs(p - upleft)
    paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upleft))
    pred = [0 * cur, left, up, (left + up) // 2, paeth][kinds[y]]
    out += bytes([kinds[y]]) + ((cur - pred) & 0xFF).astype(np.uint8).tobytes()
  colour = {1: 0, 2: 4, 3: 2, 4: 6}[bpp]
  chunk = lambda k, b: struct.pack(">I", len(b)) + k + b + struct.pack(">I", zlib.crc32(k + b))
  return (png.SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, colour, 0, 0, 0))
          + chunk(b"IDAT", zlib.compress(out)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("shape", [(10, 9), (7, 5, 3), (6, 4, 4), (5, 3, 2)])
def test_png_decodes_every_filter_and_colour_type(shape):
  image = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
  kinds = [i % 5 for i in range(shape[0])]
  np.testing.assert_array_equal(png.decode(_filtered_png(image, kinds)), image)


def test_png_from_another_encoder_and_round_trip():
  np.testing.assert_array_equal(png.decode_gray(PILLOW_PNG), PILLOW_PIXELS)
  rng = np.random.default_rng(1)
  for image in (rng.integers(0, 256, (32, 32), dtype=np.uint8),
                rng.integers(0, 256, (3, 8, 3), dtype=np.uint8)):
    np.testing.assert_array_equal(png.decode(png.encode(image)), image)
  rgb = np.array([[[255, 0, 0], [0, 255, 0], [0, 0, 255], [10, 10, 10]]], np.uint8)
  np.testing.assert_array_equal(png.to_gray(rgb), [[76, 150, 29, 10]])


def test_png_errors_say_what_is_wrong():
  with pytest.raises(png.PngError, match="signature"):
    png.decode(b"GIF89a")
  bad = bytearray(PILLOW_PNG)
  bad[40] ^= 0xFF
  with pytest.raises(png.PngError, match="CRC"):
    png.decode(bytes(bad))
  with pytest.raises(png.PngError, match="truncated"):
    png.decode(PILLOW_PNG[:60])
  sixteen = bytearray(_filtered_png(np.zeros((2, 2), np.uint8), [0, 0]))
  sixteen[24] = 16  # bit depth
  crc = zlib.crc32(bytes(sixteen[12:29]))
  sixteen[29:33] = struct.pack(">I", crc)
  with pytest.raises(png.PngError, match="only 8-bit"):
    png.decode(bytes(sixteen))
  with pytest.raises(ValueError, match="uint8"):
    png.encode(np.zeros((2, 2), np.float32))
