"""The Pathfinder dataset (LRA): are the two dots joined by one path? Binary labels on flattened
PNG images; the tasks `pathfinder` and `pathx` are in `lra.tasks.pathfinder`.

Release layout (the LRA release `lra_release.gz`, Kim, Linsley et al. 2020 generator):
`pathfinder{32,64,128,256}/curv_{baseline,contour_length_9,contour_length_14}/` holding
`imgs/<batch>/sample_<i>.png` and `metadata/<batch>.npy`. Despite the suffix the metadata files are
text: one line per image, whitespace-separated, `imgs/<batch> sample_<i>.png <i> <label> ...`;
the image path is fields 0 and 1 joined, the label is field 3. The folder is found (or extracted
from `manual_dir/lra_release.gz`) by `archives.release_path`, and the builder reads it as tfds'
manual_dir.

Settings (`data.*`, see configs/pathfinder.py): `difficulty` easy (curv_baseline), intermediate
(curv_contour_length_9) or hard (curv_contour_length_14, what LRA used for Pathfinder at 32x32
and Path-X at 128x128); `resolution`; `generate`: when the release folder is absent, write a
dataset in the same layout with `lra.data.pathfinder_generator.write_dataset` into
`data_dir/generated/<settings name>/` and build from it exactly as from the release.

Examples: each PNG is decoded to grayscale uint8 [res, res] (another size is an error naming the
file), flattened row-major and stored raw; pixel v is token id v + 1, so black pixels (most of
the image) are data, not padding. Empty (all-zero) images are dropped as LRA did, and counted.
Splits 80/10/10 as LRA's tfds `[:80%]/[80%:90%]/[90%:]`: the metadata rows are ordered by
(batch number, sample index), permuted with a fixed seed (SPLIT_SEED) and cut; empty images are
dropped after the cut, as LRA filtered them after slicing. The builder reads every PNG once.

Path-X is this task at 128x128 (`data.resolution=128`, LRA's choice) with its own data folder;
the functions here take the task name for messages and data folders (`DATA[task]`).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import shutil
import sys
import tempfile
from typing import Iterator, NamedTuple

import ml_collections
import numpy as np
import tensorflow_datasets as tfds
import tqdm

from lra.data import archives, builders, png

NAME = "pathfinder"
NUM_CLASSES = 2
VOCAB_SIZE = builders.BYTE_VOCAB_SIZE   # padding + 256 gray levels
PAD_ID = 0

DIFFICULTIES = {"easy": "curv_baseline", "intermediate": "curv_contour_length_9",
                "hard": "curv_contour_length_14"}
CONTOUR_LENGTHS = {"easy": 6, "intermediate": 9, "hard": 14}  # paddles per path
SPLIT_SEED = 0                  # the permutation of the rows before the 80/10/10 cut


# ----------------------------------------------------------------------------------------------
# The release layout.


class Row(NamedTuple):
  batch: int     # the <batch> of imgs/<batch>
  index: int     # the <i> of sample_<i>.png
  path: str      # relative to the folder: imgs/<batch>/sample_<i>.png
  label: int


def _batch_number(field: str, where: str) -> int:
  try:
    return int(field.rstrip("/").rsplit("/", 1)[-1])
  except ValueError:
    raise archives.CorruptArchiveError(
        f"{where}: expected `imgs/<batch number>` as the first field, got {field!r}.") from None


def read_metadata(folder: str) -> list[Row]:
  """Every row of folder/metadata/*.npy (text), ordered by (batch number, sample index)."""
  meta_dir = os.path.join(folder, "metadata")
  names = sorted(f for f in os.listdir(meta_dir) if f.endswith(".npy")) \
      if os.path.isdir(meta_dir) else []
  if not names:
    raise archives.CorruptArchiveError(
        f"{meta_dir} has no metadata/<batch>.npy files; expected the Pathfinder release layout "
        f"(imgs/<batch>/sample_<i>.png and metadata/<batch>.npy). Delete {folder} and extract "
        f"or generate it again.")
  rows = []
  for name in names:
    path = os.path.join(meta_dir, name)
    with open(path, "rb") as f:
      text = f.read()
    try:
      lines = text.decode("ascii").splitlines()
    except UnicodeDecodeError:
      raise archives.CorruptArchiveError(
          f"{path} is not a text metadata file (Pathfinder's .npy metadata files are text, one "
          f"line per image); delete {folder} and extract or generate it again.") from None
    for number, line in enumerate(lines, start=1):
      fields = line.split()
      if not fields:
        continue
      where = f"{path}:{number}"
      if len(fields) < 4:
        raise archives.CorruptArchiveError(
            f"{where}: expected `imgs/<batch> sample_<i>.png <i> <label> ...`, got {line!r}.")
      try:
        index, label = int(fields[2]), int(fields[3])
      except ValueError:
        raise archives.CorruptArchiveError(
            f"{where}: fields 3 and 4 should be the sample index and the label, got "
            f"{line!r}.") from None
      if label not in (0, 1):
        raise archives.CorruptArchiveError(f"{where}: label {label} is not 0 or 1.")
      rows.append(Row(_batch_number(fields[0], where), index,
                      f"{fields[0].rstrip('/')}/{fields[1]}", label))
  rows.sort(key=lambda r: (r.batch, r.index))
  return rows


def split_rows(rows: list[Row]) -> dict[str, list[Row]]:
  """80/10/10 of the rows after a fixed permutation (SPLIT_SEED)."""
  n = len(rows)
  order = np.random.default_rng(SPLIT_SEED).permutation(n)
  cut1, cut2 = n * 8 // 10, n * 9 // 10
  return {"train": [rows[i] for i in order[:cut1]],
          "validation": [rows[i] for i in order[cut1:cut2]],
          "test": [rows[i] for i in order[cut2:]]}


def read_image(folder: str, row: Row, resolution: int) -> np.ndarray:
  """The image of `row` as gray uint8 [resolution, resolution]; errors name the file."""
  path = os.path.join(folder, row.path)
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    raise archives.CorruptArchiveError(
        f"{path} is listed in metadata/{row.batch}.npy but does not exist; {folder} is "
        f"incomplete: delete it and extract or generate it again.") from None
  try:
    image = png.decode_gray(data)
  except png.PngError as e:
    raise archives.CorruptArchiveError(
        f"{path}: {e} Delete {folder} and extract or generate it again.") from None
  if image.shape != (resolution, resolution):
    raise ValueError(
        f"{path} is {image.shape[1]}x{image.shape[0]} pixels but data.resolution is "
        f"{resolution}; set data.resolution={image.shape[0]} or use the "
        f"pathfinder{resolution} folder.")
  return image


# ----------------------------------------------------------------------------------------------
# tfds dataset (array_record).


@dataclasses.dataclass
class PathfinderConfig(tfds.core.BuilderConfig):
  """`resolution`: the image size of the origin in the name; `task`: the name in messages."""
  resolution: int = 32
  task: str = NAME


class PathfinderBuilder(builders.LabelledBuilder, skip_registration=True):
  """Pathfinder pixels (uint8 [res * res], raw values, row-major) and an int32 label, from a
  release-layout folder (the manual_dir); stored in the permuted order."""

  name = "lra_pathfinder"
  RELEASE_NOTES = {"1.0.0": "LRA release layout or generated; 80/10/10 seeded split."}
  HOMEPAGE = "https://github.com/google-research/long-range-arena"

  def _split_generators(self, dl_manager):
    folder = os.fspath(dl_manager.manual_dir)
    splits = split_rows(read_metadata(folder))
    progress = tqdm.tqdm(total=sum(len(r) for r in splits.values()), unit="image",
                         desc=f"{self.builder_config.task}: reading images", mininterval=1.0)
    return {split: self._generate_examples(folder, split, rows, progress)
            for split, rows in splits.items()}

  def _generate_examples(self, folder: str, split: str, rows: list[Row], progress: tqdm.tqdm
                         ) -> Iterator[tuple[int, dict]]:
    cfg = self.builder_config
    empty = 0
    for i, row in enumerate(rows):
      image = read_image(folder, row, cfg.resolution)   # [R, R]
      progress.update()
      if progress.n == progress.total:
        progress.close()
      if not image.any():
        empty += 1
        continue
      yield i, {"inputs": image.reshape(-1), "targets": np.int32(row.label)}
    print(f"{cfg.task}: {split}: kept {len(rows) - empty} of {len(rows)} images, dropped "
          f"{empty} empty (all-zero) image(s) as LRA does.", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Where the images come from, building, sources.


def release_relpath(data_cfg: ml_collections.ConfigDict) -> str:
  """`pathfinder<res>/<difficulty folder>` inside the LRA release."""
  if data_cfg.difficulty not in DIFFICULTIES:
    raise ValueError(f"unknown data.difficulty {data_cfg.difficulty!r}; valid: "
                     f"{', '.join(DIFFICULTIES)}.")
  return f"pathfinder{int(data_cfg.resolution)}/{DIFFICULTIES[data_cfg.difficulty]}"


def generated_name(data_cfg: ml_collections.ConfigDict) -> str:
  """The builder config (and generated folder) name of the generator settings."""
  c = data_cfg
  return (f"generated{int(c.resolution)}_{c.difficulty}_n{int(c.num_generated)}"
          f"_seed{int(c.generator_seed)}")


def _origin(data_cfg: ml_collections.ConfigDict) -> tuple[str, str | None]:
  """(config name, folder if it exists now), without extracting or generating anything."""
  relpath = release_relpath(data_cfg)
  found = archives.find_release_path(data_cfg.manual_dir, relpath)
  if found or not data_cfg.generate:
    return f"release{int(data_cfg.resolution)}_{data_cfg.difficulty}", found
  folder = os.path.join(os.path.expanduser(data_cfg.data_dir), "generated",
                        generated_name(data_cfg))
  return generated_name(data_cfg), folder if os.path.isdir(folder) else None


def _builder(data_cfg: ml_collections.ConfigDict, task: str) -> PathfinderBuilder:
  name, _ = _origin(data_cfg)
  return PathfinderBuilder(
      config=PathfinderConfig(name=name, resolution=int(data_cfg.resolution), task=task,
                              description=f"{task} images ({name})."),
      data_dir=os.path.expanduser(data_cfg.data_dir))


def generate(data_cfg: ml_collections.ConfigDict, folder: str) -> str:
  """Writes the generated images of data_cfg into `folder` (via a temporary folder renamed when
  complete, under a lock file in its parent)."""
  try:
    from lra.data import pathfinder_generator
    write_dataset = pathfinder_generator.write_dataset
  except (ImportError, AttributeError) as e:
    raise ImportError(f"data.generate=True needs lra.data.pathfinder_generator.write_dataset "
                      f"({e}); put the release folder in place instead.") from None
  parent = os.path.dirname(folder)
  # One generation at a time; what killed ones left (.generating-*) is removed first.
  with archives.exclusive(os.path.join(parent, ".generate.lock"), "Pathfinder generation",
                          stale=[os.path.join(glob.escape(parent), ".generating-*")]):
    if os.path.isdir(folder):   # generated by another process while this one waited
      return folder
    tmp = tempfile.mkdtemp(prefix=".generating-", dir=parent)
    print(f"generating {int(data_cfg.num_generated)} Pathfinder images "
          f"({int(data_cfg.resolution)}x{int(data_cfg.resolution)}, {data_cfg.difficulty}) "
          f"into {folder} ...", file=sys.stderr, flush=True)
    try:
      write_dataset(
          tmp, resolution=int(data_cfg.resolution), num_images=int(data_cfg.num_generated),
          seed=int(data_cfg.generator_seed),
          contour_length=CONTOUR_LENGTHS[data_cfg.difficulty])
      os.replace(tmp, folder)
    finally:
      if os.path.exists(tmp):
        shutil.rmtree(tmp)
  return folder


def locate(data_cfg: ml_collections.ConfigDict, task: str) -> str:
  """The release-layout folder of data_cfg's images (the build's manual_dir).

  Uses the extracted release folder when present; otherwise generates the images
  (data.generate) or extracts the folder from lra_release.gz (downloading it with
  data.download); raises DataMissingError saying what to get when none of these is possible.
  """
  name, folder = _origin(data_cfg)
  if folder:
    return folder
  if data_cfg.generate:
    return generate(data_cfg, os.path.join(os.path.expanduser(data_cfg.data_dir), "generated",
                                           name))
  relpath = release_relpath(data_cfg)
  try:
    return archives.release_path(data_cfg.manual_dir, relpath, download=data_cfg.download)
  except archives.DataMissingError as e:
    raise archives.DataMissingError(
        f"{task}: the Pathfinder images ({relpath}/imgs and metadata) were not found. {e} Or "
        f"set data.generate=True to generate them.") from None


def _pending(data_cfg: ml_collections.ConfigDict, builder: PathfinderBuilder, task: str
             ) -> builders.Status:
  """The status before building: where the images will come from."""
  name, folder = _origin(data_cfg)
  later = f"on first use (or by `lra data prepare {task}`)"
  if folder:
    return builders.Status(task, False, f"built from the images in {folder} {later}.")
  if data_cfg.generate:
    return builders.Status(
        task, False, f"{int(data_cfg.num_generated)} images generated ({name}) {later}.")
  tarball = os.path.join(os.path.expanduser(data_cfg.manual_dir),
                         archives.LRA_RELEASE.filename)
  return builders.archive_status(task, builder, [(archives.LRA_RELEASE, data_cfg.manual_dir)],
                                 present=[os.path.isfile(tarball)])


def task_data(task: str) -> builders.TaskData:
  """build/prepare/status of `task` (pathfinder or pathx); images are found only to build."""
  return builders.TaskData(
      task, functools.partial(_builder, task=task), locate=functools.partial(locate, task=task),
      pending=functools.partial(_pending, task=task),
      refresh=lambda data_cfg: builders.drop_stale_extraction(data_cfg.manual_dir,
                                                              release_relpath(data_cfg)))


DATA = {NAME: task_data(NAME), "pathx": task_data("pathx")}


def get_source(data_cfg: ml_collections.ConfigDict, split: str,
               task: str = NAME) -> builders.PaddedSource:
  """A random-access source for `split`; builds the dataset if needed.

  Examples are {"inputs": int32 [res * res] (gray level + 1; no padding), "targets": int32}.
  """
  builders.check_split(task, split)
  length = int(data_cfg.resolution) ** 2
  if int(data_cfg.max_length) != length:
    raise ValueError(f"{task}: data.max_length is {data_cfg.max_length} but the images have "
                     f"{length} pixels at data.resolution={data_cfg.resolution}; change "
                     f"data.resolution (max_length follows it) or set data.max_length={length}.")
  builder = DATA[task].build(data_cfg)
  return builders.PaddedSource(builder.as_data_source(split=split), {"inputs": length},
                               offset=builders.BYTE_OFFSET)

