"""The Image dataset (LRA): CIFAR-10 as sequences of 1,024 grayscale pixels, 10 classes; the
task is `lra.tasks.image`.

Source: the CIFAR-10 python archive `cifar-10-python.tar.gz`
(https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, 163 MB), members
`cifar-10-batches-py/data_batch_1` .. `data_batch_5`, `test_batch` and `batches.meta`. Each batch
is a Python pickle (written by Python 2, so loaded with `encoding="bytes"`) of a dict with
b"data", a uint8 array [10000, 3072] (per image 1024 red, 1024 green, then 1024 blue values, each
32x32 row-major), and b"labels", a list of ints 0..9. An archive is untrusted input: the pickles
are read by an Unpickler that resolves only the globals needed to rebuild a numpy array
(`numpy.core.multiarray._reconstruct`, `numpy.ndarray`, `numpy.dtype`) and refuses anything else,
so a crafted file cannot run code.

Grayscale exactly as LRA (`tf.image.rgb_to_grayscale` on uint8): x * float32(1/255), the float32
dot product with the weights (0.2989, 0.5870, 0.1140), then `convert_image_dtype` back to uint8,
which multiplies by 255.5 and truncates (clipped to 0..255, which the weights never exceed).
The image is flattened row-major to 1024 pixels; pixel value v is token id v + 1, so a black
pixel is data, not padding (LRA fed raw values and masked `inputs > 0`, which hid every black
pixel from attention).

Splits as LRA's sizes: 45,000 train / 5,000 validation / 10,000 test. LRA took tfds
`train[:90%]` / `train[90%:]`, whose order is tfds' own; here train is the first 90% of
data_batch_1..5 in archive order (the first 45,000 images), validation the last 10% (the last
5,000 images, all from data_batch_5), and test is test_batch. The stored order is the archive
order; the training iterator shuffles.
"""

from __future__ import annotations

import io
import os
import pickle

import ml_collections
import numpy as np
from numpy._core.multiarray import _reconstruct
import tensorflow_datasets as tfds
import tqdm

from lra.data import archives, builders

NAME = "image"
NUM_CLASSES = 10
VOCAB_SIZE = builders.BYTE_VOCAB_SIZE   # padding + 256 gray levels
PAD_ID = 0
IMAGE_SIZE = 32
LENGTH = IMAGE_SIZE * IMAGE_SIZE        # 1024 tokens

CIFAR10 = archives.Archive(
    "cifar-10-python.tar.gz", "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "the CIFAR-10 python version; a tar.gz of 163 MB")
MEMBER_DIR = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
VALIDATION_FRACTION = 10               # the last 1/10 of the training images (5,000)
RGB_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], np.float32)  # tf.image.rgb_to_grayscale


# ----------------------------------------------------------------------------------------------
# Reading the archive.


class NumpyOnlyUnpickler(pickle.Unpickler):
  """Unpickles plain containers and numpy arrays; any other global is refused.

  The CIFAR-10 pickles name numpy 1's `numpy.core.multiarray._reconstruct`, which numpy 2 keeps
  as `numpy._core.multiarray._reconstruct`; both names resolve to it.
  """

  _ALLOWED = {
      ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
      ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
      ("numpy", "ndarray"): np.ndarray,
      ("numpy", "dtype"): np.dtype,
  }

  def find_class(self, module: str, name: str):
    try:
      return self._ALLOWED[(module, name)]
    except KeyError:
      raise pickle.UnpicklingError(
          f"refusing to load the global {module}.{name}: a CIFAR-10 batch holds only numpy "
          f"arrays, lists and strings") from None


def load_pickle(data: bytes) -> dict:
  """A CIFAR-10 batch pickle (Python 2 strings as bytes) through NumpyOnlyUnpickler."""
  return NumpyOnlyUnpickler(io.BytesIO(data), encoding="bytes").load()


def rgb_to_grayscale(rgb: np.ndarray) -> np.ndarray:
  """uint8 [..., 3] RGB -> uint8 [...] gray, as tf.image.rgb_to_grayscale computes it."""
  x = np.asarray(rgb, np.uint8).astype(np.float32) * np.float32(1.0 / 255.0)
  w = RGB_WEIGHTS
  gray = x[..., 0] * w[0] + x[..., 1] * w[1] + x[..., 2] * w[2]           # float32 [...]
  return np.clip(gray * np.float32(255.5), 0, 255).astype(np.uint8)


def cifar_to_gray(data: np.ndarray) -> np.ndarray:
  """CIFAR rows uint8 [N, 3072] (R plane, G plane, B plane) -> gray pixels uint8 [N, 1024]."""
  n = data.shape[0]
  rgb = data.reshape(n, 3, IMAGE_SIZE, IMAGE_SIZE).transpose(0, 2, 3, 1)  # [N, 32, 32, 3]
  return rgb_to_grayscale(rgb).reshape(n, LENGTH)                         # [N, 1024] row-major


def _check_batch(path: str, member: str, batch) -> tuple[np.ndarray, np.ndarray]:
  """(data uint8 [N, 3072], labels int64 [N]) of one unpickled batch, or CorruptArchiveError."""
  where = f"{path}: member {MEMBER_DIR}/{member}"
  if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
    keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
    raise archives.CorruptArchiveError(
        f"{where} is not a CIFAR-10 batch (expected a dict with b'data' and b'labels', got "
        f"{keys}); get the python version of CIFAR-10 from {CIFAR10.url}.")
  data = batch[b"data"]
  labels = np.asarray(batch[b"labels"])
  if (not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2
      or data.shape[1] != 3 * LENGTH):
    got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
    raise archives.CorruptArchiveError(
        f"{where}: b'data' should be uint8 [N, {3 * LENGTH}], got {got}; get the python "
        f"version of CIFAR-10 from {CIFAR10.url}.")
  if labels.shape != (data.shape[0],) or not np.issubdtype(labels.dtype, np.integer) or (
      labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES)):
    raise archives.CorruptArchiveError(
        f"{where}: b'labels' should be {data.shape[0]} ints in 0..{NUM_CLASSES - 1}; delete "
        f"the archive and download it again from {CIFAR10.url}.")
  return data, labels.astype(np.int64)


def read_archive(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Batch name -> (gray pixels uint8 [N, 1024], labels int64 [N]) for the six batches.

  One sequential pass over the tar.gz, which verifies it to its end before any batch is
  unpickled; truncated or corrupt files raise CorruptArchiveError.
  """
  wanted = {f"{MEMBER_DIR}/{m}": m for m in (*TRAIN_BATCHES, TEST_BATCH)}
  blobs = {}
  for name, contents in archives.tar_members(path, CIFAR10):
    member = wanted.get(name.lstrip("./"))
    if member is not None:
      blobs[member] = contents
  out = {}
  with tqdm.tqdm(blobs.items(), desc="image: reading batches", unit=" batch") as bar:
    for member, blob in bar:
      with archives.reading(path, CIFAR10):   # the archive was read and verified to its end
        data, labels = _check_batch(path, member, load_pickle(blob))
      out[member] = (cifar_to_gray(data), labels)
  missing = [m for m in wanted.values() if m not in out]
  if missing:
    raise archives.CorruptArchiveError(
        f"{path} lacks {', '.join(f'{MEMBER_DIR}/{m}' for m in missing)}; it is truncated or "
        f"not the python version of CIFAR-10. Delete it and download it again from "
        f"{CIFAR10.url}; no dataset was written.")
  return out


def split_rows(batches: dict[str, tuple[np.ndarray, np.ndarray]]
               ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Split -> (pixels [N, 1024], labels [N]): train/validation cut 90/10 in archive order."""
  pixels = np.concatenate([batches[b][0] for b in TRAIN_BATCHES])       # [50000, 1024]
  labels = np.concatenate([batches[b][1] for b in TRAIN_BATCHES])       # [50000]
  num_train = len(labels) - len(labels) // VALIDATION_FRACTION
  return {"train": (pixels[:num_train], labels[:num_train]),
          "validation": (pixels[num_train:], labels[num_train:]),
          "test": batches[TEST_BATCH]}


# ----------------------------------------------------------------------------------------------
# tfds dataset (array_record) and the random-access source.


class ImageBuilder(builders.LabelledBuilder, skip_registration=True):
  """CIFAR-10 grayscale pixels (uint8 [1024], raw values 0..255, row-major) and an int32 label,
  from cifar-10-python.tar.gz in the manual_dir; stored in the archive order."""

  name = "lra_image"
  RELEASE_NOTES = {"1.0.0": "CIFAR-10 python archive, LRA grayscale, 45K/5K/10K splits."}
  HOMEPAGE = "https://www.cs.toronto.edu/~kriz/cifar.html"

  def _split_generators(self, dl_manager):
    splits = split_rows(read_archive(os.fspath(dl_manager.manual_dir / CIFAR10.filename)))
    return {split: self._generate_examples(*rows) for split, rows in splits.items()}

  def _generate_examples(self, pixels, labels):
    for i in range(len(labels)):
      yield i, {"inputs": pixels[i], "targets": np.int32(labels[i])}


def _builder(data_cfg: ml_collections.ConfigDict) -> ImageBuilder:
  return ImageBuilder(config=tfds.core.BuilderConfig(name="grayscale",
                                                     description="LRA grayscale CIFAR-10."),
                      data_dir=os.path.expanduser(data_cfg.data_dir))


# build/prepare/status: the archive is found (or downloaded) in data.manual_dir only to build.
DATA = builders.TaskData.from_archive(NAME, CIFAR10, _builder)


def get_source(data_cfg: ml_collections.ConfigDict, split: str) -> builders.PaddedSource:
  """A random-access source for `split`; builds the dataset if needed.

  Examples are {"inputs": int32 [1024] (gray level + 1; no padding), "targets": int32}.
  """
  builders.check_split(NAME, split)
  if int(data_cfg.max_length) != LENGTH:
    raise ValueError(f"image: data.max_length is {data_cfg.max_length} but a CIFAR-10 image is "
                     f"{LENGTH} pixels; set data.max_length={LENGTH}.")
  builder = DATA.build(data_cfg)
  return builders.PaddedSource(builder.as_data_source(split=split), {"inputs": LENGTH},
                               offset=builders.BYTE_OFFSET)

