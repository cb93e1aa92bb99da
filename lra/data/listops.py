"""The ListOps dataset (LRA): nested list operations, 10 classes, from the generator or the
released TSVs; the task is `lra.tasks.listops`.

The examples, vocabulary, generator and the released TSV format are in
`lra.data.listops_generator`. Splits are drawn in the order test, validation, train, so the
evaluation splits do not change with `num_train`.

Storage: a tfds GeneratorBasedBuilder writes array_record files (no TensorFlow needed) with one
BuilderConfig per data origin: `released` (from the TSVs found under manual_dir or data_dir,
handed to the builder as tfds' manual_dir) or one named after the generator settings.
`get_source` builds the dataset when missing and returns a random-access source of padded
`int32` examples for grain.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from lra.data import archives, builders
from lra.data.listops_generator import UNK_ID, generate, read_tsv

NAME = "listops"

SPLITS = builders.SPLITS
RELEASED_FILES = {"train": "basic_train.tsv", "validation": "basic_val.tsv",
                  "test": "basic_test.tsv"}
RELEASED_DIRS = ("lra_release/listops-1000", "lra_release/lra_release/listops-1000",
                 "listops-1000", ".")
RELEASE_URL = archives.LRA_RELEASE.url
RELEASED = "released"   # the builder config of the released TSVs

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# tfds dataset (array_record) and the random-access source.


@dataclasses.dataclass
class ListOpsConfig(tfds.core.BuilderConfig):
  """Where the examples come from: `released` (the TSVs in the manual_dir) or the generator
  settings (also in the config name)."""
  num_train: int = 0
  num_val: int = 0
  num_test: int = 0
  gen_min_length: int = 500
  gen_max_length: int = 2000
  max_depth: int = 10
  max_args: int = 10
  seed: int = 0


class ListOpsBuilder(builders.LabelledBuilder, skip_registration=True):
  """ListOps as variable-length uint8 token ids (no padding) and an int32 label."""

  name = "lra_listops"
  RELEASE_NOTES = {"1.0.0": "Released LRA TSVs or the seeded generator; fixed vocabulary."}
  HOMEPAGE = "https://github.com/google-research/long-range-arena"
  DISABLE_SHUFFLING = False   # stored in tfds' order of the example keys, as from the start

  def _split_generators(self, dl_manager):
    cfg = self.builder_config
    if cfg.name == RELEASED:
      return {split: self._generate_examples(read_tsv(os.fspath(dl_manager.manual_dir / f)))
              for split, f in RELEASED_FILES.items()}
    seen = set()  # the three splits are disjoint; test and validation do not depend on num_train
    kw = dict(min_length=cfg.gen_min_length, max_length=cfg.gen_max_length,
              max_depth=cfg.max_depth, max_args=cfg.max_args, exclude=seen)
    test = generate(cfg.num_test, seed=cfg.seed * 3 + 2, **kw)
    val = generate(cfg.num_val, seed=cfg.seed * 3 + 1, **kw)
    train = generate(cfg.num_train, seed=cfg.seed * 3, **kw)
    return {"train": self._generate_examples(train),
            "validation": self._generate_examples(val),
            "test": self._generate_examples(test)}

  def _generate_examples(self, rows):
    unknown = 0
    for i, (ids, label) in enumerate(rows):
      unknown += int(np.count_nonzero(ids == UNK_ID))
      yield i, {"inputs": ids, "targets": np.int32(label)}
    if unknown:
      log.warning("ListOps: %d tokens outside the vocabulary were mapped to <unk> (id %d).",
                  unknown, UNK_ID)


def find_released(*dirs: str) -> str | None:
  """The first directory under any of `dirs` holding all released TSVs, or None."""
  for base in dirs:
    for sub in RELEASED_DIRS:
      d = os.path.normpath(os.path.join(os.path.expanduser(base), sub))
      if all(os.path.isfile(os.path.join(d, f)) for f in RELEASED_FILES.values()):
        return d
  return None


def _find_released(data_cfg: ml_collections.ConfigDict) -> str | None:
  """The released TSVs' folder in the LRA release layout under manual_dir, then data_dir."""
  return find_released(data_cfg.manual_dir, data_cfg.data_dir)


def builder_config(data_cfg: ml_collections.ConfigDict) -> ListOpsConfig:
  """The BuilderConfig for data_cfg: `released` when the TSVs are present or data.generate is
  off, else one named after the generator settings. Reads no file and extracts nothing."""
  if _find_released(data_cfg) or not data_cfg.generate:
    return ListOpsConfig(name=RELEASED, description="The LRA release TSVs (listops-1000).")
  c = data_cfg
  name = (f"generated_len{c.gen_min_length}to{c.gen_max_length}_depth{c.max_depth}"
          f"_args{c.max_args}_n{c.num_train}x{c.num_val}x{c.num_test}_seed{c.seed}")
  return ListOpsConfig(
      name=name, num_train=c.num_train, num_val=c.num_val, num_test=c.num_test,
      gen_min_length=c.gen_min_length, gen_max_length=c.gen_max_length,
      max_depth=c.max_depth, max_args=c.max_args, seed=c.seed,
      description="Generated with the LRA ListOps grammar.")


def _builder(data_cfg: ml_collections.ConfigDict) -> ListOpsBuilder:
  return ListOpsBuilder(config=builder_config(data_cfg),
                        data_dir=os.path.expanduser(data_cfg.data_dir))


def locate(data_cfg: ml_collections.ConfigDict) -> str | None:
  """The folder of the released TSVs (the build's manual_dir), or None to generate.

  The TSVs are looked for in the LRA release layout under `manual_dir`, then under `data_dir`;
  with `generate=False` and no TSVs, the release is extracted from `manual_dir/lra_release.gz`
  (or downloaded, with `download=True`).
  """
  if builder_config(data_cfg).name != RELEASED:
    return None
  released = _find_released(data_cfg)
  if released:
    return released
  manual_dir = os.path.expanduser(data_cfg.manual_dir)
  try:
    extracted = archives.release_path(manual_dir, "listops-1000", download=data_cfg.download)
  except archives.DataMissingError as e:
    raise archives.DataMissingError(
        f"ListOps TSVs ({', '.join(RELEASED_FILES.values())}) not found. {e} Or set "
        f"data.generate=True to build the dataset from the ListOps generator.") from None
  released = find_released(manual_dir)
  if not released:
    raise archives.CorruptArchiveError(
        f"the listops-1000/ folder extracted to {extracted} lacks some of "
        f"{', '.join(RELEASED_FILES.values())}; the archive is not the LRA release or is "
        f"incomplete. Delete {extracted} and the archive and download it again from "
        f"{RELEASE_URL}.")
  return released


def _pending(data_cfg: ml_collections.ConfigDict, builder: ListOpsBuilder) -> builders.Status:
  """The status before building: where the examples will come from."""
  released = _find_released(data_cfg)
  if released or data_cfg.generate:
    origin = f"the released TSVs in {released}" if released else "the ListOps generator"
    return builders.Status(NAME, False, f"built from {origin} on first use (or by `lra data "
                                        f"prepare listops`).")
  manual_dir = os.path.expanduser(data_cfg.manual_dir)
  present = archives.find_release_path(manual_dir, "listops-1000") is not None or \
      os.path.isfile(os.path.join(manual_dir, archives.LRA_RELEASE.filename))
  return builders.archive_status(NAME, builder, [(archives.LRA_RELEASE, manual_dir)],
                                 present=[present])


# build/prepare/status: the TSVs are found (or extracted) only to build the released dataset.
DATA = builders.TaskData(
    NAME, _builder, locate=locate, pending=_pending,
    refresh=lambda data_cfg: builders.drop_stale_extraction(data_cfg.manual_dir, "listops-1000"))


def get_source(data_cfg: ml_collections.ConfigDict, split: str) -> builders.PaddedSource:
  """A random-access source for `split` ("train", "validation" or "test"); builds data if needed.

  Examples are {"inputs": int32 [max_length] (0 = padding), "targets": int32}; longer examples
  keep their first max_length tokens (as LRA does).
  """
  builders.check_split(NAME, split)
  builder = DATA.build(data_cfg)
  if (builder.builder_config.name != RELEASED
      and data_cfg.gen_max_length - 1 > data_cfg.max_length):
    builders.warn_once(log, "ListOps: generated examples have up to %d tokens but max_length is "
                       "%d; longer ones are truncated.", data_cfg.gen_max_length - 1,
                       data_cfg.max_length)
  return builders.PaddedSource(builder.as_data_source(split=split),
                               {"inputs": data_cfg.max_length})

