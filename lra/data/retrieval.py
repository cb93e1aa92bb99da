"""The Retrieval dataset (LRA): AAN citation matching of two byte-level documents, 2 classes;
the task (a dual encoder) is `lra.tasks.retrieval`.

Data: the three TSVs of the LRA release (`lra_release.gz`, 8.2 GB, from
https://storage.googleapis.com/long-range-arena/lra_release.gz), `new_aan_pairs.train.tsv`,
`new_aan_pairs.eval.tsv` and `new_aan_pairs.test.tsv` (147,086 / 18,090 / 17,437 pairs in the
release). They are looked for in the extracted release under `data.manual_dir`:
`lra_release/tsv_data/` (the tarball's layout) or `lra_release/aan/` (the LRA README's), also
doubly nested `lra_release/lra_release/...` or directly `manual_dir/tsv_data/` or `aan/`. When
only `manual_dir/lra_release.gz` is there, its `tsv_data/` folder (and nothing else) is
extracted next to it first (`lra.data.archives.release_path`).

Format: no header, one pair per line, 5 tab-separated columns `label id1 id2 text1 text2`; the
label is a float string ("0.0"/"1.0", "0"/"1" also accepted): 1 when one paper cites the other.
There is no quoting (LRA read it with `use_quote_delim=False`): a line is split on tabs, and the
texts, which contain quotes, are taken byte for byte as they are in the file.

Stored example: the first `data.doc_bytes` (10,000) bytes of each text, as LRA cut them
(`s.numpy()[:10000]` in `matching/pipeline.py`) before its `max_length`; the label as
int32. Examples keep the file's order (example i is line i).

Tokenisation (LRA's ByteTextEncoder, `tokenizer="char"`): id = byte + 1, 0 = padding,
VOCAB_SIZE 257; each document keeps its FIRST `data.max_length` bytes (LRA: 4,000) and is
padded. Examples are {"inputs1": int32 [L], "inputs2": int32 [L], "targets": int32}, the input
of `models/dual_encoder.py` ([u, v, u*v, u-v], as in the paper; LRA's code used [u, v]).

Splits: train = `.train.tsv`, validation = `.eval.tsv`, test = `.test.tsv`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Iterator

import ml_collections
import numpy as np
import tensorflow_datasets as tfds
import tqdm

from lra.data import archives, builders

NAME = "retrieval"
NUM_CLASSES = 2
PAD_ID = 0
VOCAB_SIZE = builders.BYTE_VOCAB_SIZE   # 256 byte values + padding

TSV_FILES = {"train": "new_aan_pairs.train.tsv", "validation": "new_aan_pairs.eval.tsv",
             "test": "new_aan_pairs.test.tsv"}
RELEASE_DIRS = ("tsv_data", "aan")      # the tarball's folder, then the README's
LRA_DOC_BYTES = 10_000                  # LRA cut each text to its first 10,000 bytes
_LABELS = {b"0": 0, b"1": 1, b"0.0": 0, b"1.0": 1}


# ----------------------------------------------------------------------------------------------
# Finding and reading the TSVs.


def find_tsv_dir(manual_dir: str) -> str | None:
  """The folder of the extracted release holding all three TSVs, or None."""
  for rel in RELEASE_DIRS:
    path = archives.find_release_path(manual_dir, rel)
    if path and all(os.path.isfile(os.path.join(path, f)) for f in TSV_FILES.values()):
      return path
  return None


def locate_tsvs(manual_dir: str, *, download: bool) -> str:
  """The folder with the three TSVs; extracts (or downloads, then extracts) the release if needed.

  Raises DataMissingError naming the files, the directory and the download address.
  """
  manual_dir = os.path.expanduser(manual_dir)
  found = find_tsv_dir(manual_dir)
  if found:
    return found
  names = ", ".join(TSV_FILES.values())
  for rel in RELEASE_DIRS:
    partial = archives.find_release_path(manual_dir, rel)
    if partial:
      missing = [f for f in TSV_FILES.values() if not os.path.isfile(os.path.join(partial, f))]
      raise archives.DataMissingError(
          f"{partial} lacks {', '.join(missing)}. Copy the AAN TSVs ({names}) there from the "
          f"LRA release ({archives.LRA_RELEASE.url}), or delete the folder to extract it again "
          f"from {os.path.join(manual_dir, archives.LRA_RELEASE.filename)}.")
  try:
    path = archives.release_path(manual_dir, RELEASE_DIRS[0], download=download)
  except archives.DataMissingError as e:
    raise archives.DataMissingError(
        f"the AAN TSVs ({names}) were not found in "
        f"{os.path.join(manual_dir, 'lra_release', RELEASE_DIRS[0])} or "
        f"{os.path.join(manual_dir, 'lra_release', RELEASE_DIRS[1])}. {e}") from None
  missing = [f for f in TSV_FILES.values() if not os.path.isfile(os.path.join(path, f))]
  if missing:
    raise archives.CorruptArchiveError(
        f"the {RELEASE_DIRS[0]}/ folder extracted to {path} lacks {', '.join(missing)}; the "
        f"archive is not the LRA release or is incomplete. Delete {path} and the archive and "
        f"download it again from {archives.LRA_RELEASE.url}.")
  return path


def read_tsv(path: str, doc_bytes: int = LRA_DOC_BYTES) -> Iterator[tuple[bytes, bytes, int]]:
  """Yields (first doc_bytes of text1, of text2, label) per line of an AAN pairs TSV."""
  with open(path, "rb") as f, tqdm.tqdm(desc=f"{os.path.basename(path)}", unit=" pairs",
                                       mininterval=1.0) as progress:
    for line_no, line in enumerate(f, start=1):
      progress.update()
      line = line[:-1] if line.endswith(b"\n") else line
      line = line[:-1] if line.endswith(b"\r") else line
      if not line:
        continue
      fields = line.split(b"\t")
      if len(fields) != 5:
        raise ValueError(
            f"{path}:{line_no}: expected 5 tab-separated fields (label id1 id2 text1 text2), "
            f"got {len(fields)}. The file is not an LRA AAN TSV or is damaged: extract it again "
            f"from {archives.LRA_RELEASE.url}.")
      label = _LABELS.get(fields[0].strip())
      if label is None:
        raise ValueError(f"{path}:{line_no}: the label {fields[0][:20]!r} is not 0 or 1 "
                         f"(expected \"0.0\"/\"1.0\"); is this an AAN pairs TSV?")
      yield fields[3][:doc_bytes], fields[4][:doc_bytes], label


# ----------------------------------------------------------------------------------------------
# tfds dataset (array_record) and the random-access source.


@dataclasses.dataclass
class RetrievalConfig(tfds.core.BuilderConfig):
  """The bytes kept per document (also in the config name)."""
  doc_bytes: int = LRA_DOC_BYTES


class RetrievalBuilder(builders.LabelledBuilder, skip_registration=True):
  """AAN pairs as two variable-length uint8 byte arrays (raw, no padding) and an int32 label,
  from the three TSVs in the manual_dir; example i is line i of its TSV."""

  name = "lra_retrieval"
  RELEASE_NOTES = {"1.0.0": "LRA AAN TSVs, first doc_bytes bytes of each text, file order."}
  HOMEPAGE = "https://github.com/google-research/long-range-arena"
  INPUTS = ("inputs1", "inputs2")

  def _split_generators(self, dl_manager):
    doc_bytes = self.builder_config.doc_bytes
    return {split: self._generate_examples(os.fspath(dl_manager.manual_dir / name), doc_bytes)
            for split, name in TSV_FILES.items()}

  def _generate_examples(self, path: str, doc_bytes: int):
    print(f"{NAME}: reading {path} ...", file=sys.stderr, flush=True)
    for i, (text1, text2, label) in enumerate(read_tsv(path, doc_bytes)):
      yield i, {"inputs1": np.frombuffer(text1, np.uint8),
                "inputs2": np.frombuffer(text2, np.uint8), "targets": np.int32(label)}


def _builder(data_cfg: ml_collections.ConfigDict) -> RetrievalBuilder:
  doc_bytes = int(data_cfg.doc_bytes)
  config = RetrievalConfig(name=f"aan_first{doc_bytes}bytes", doc_bytes=doc_bytes,
                           description=f"The first {doc_bytes} bytes of each AAN document.")
  return RetrievalBuilder(config=config, data_dir=os.path.expanduser(data_cfg.data_dir))


def _pending(data_cfg: ml_collections.ConfigDict, builder: RetrievalBuilder) -> builders.Status:
  """The status before building: whether the TSVs or the release are in place."""
  manual_dir = os.path.expanduser(data_cfg.manual_dir)
  present = bool(find_tsv_dir(manual_dir)) or os.path.isfile(
      os.path.join(manual_dir, archives.LRA_RELEASE.filename))
  return builders.archive_status(NAME, builder, [(archives.LRA_RELEASE, manual_dir)],
                                 present=[present])


# build/prepare/status: the TSV folder (the manual_dir of the build) is found only to build.
DATA = builders.TaskData(
    NAME, _builder, pending=_pending,
    locate=lambda data_cfg: locate_tsvs(data_cfg.manual_dir, download=data_cfg.download),
    refresh=lambda data_cfg: builders.drop_stale_extraction(data_cfg.manual_dir,
                                                            RELEASE_DIRS[0]))


def get_source(data_cfg: ml_collections.ConfigDict, split: str) -> builders.PaddedSource:
  """A random-access source for `split` ("train", "validation" or "test"); builds data if needed.

  Examples are {"inputs1", "inputs2": int32 [max_length] (byte + 1; 0 = padding), "targets":
  int32}; each document keeps its first max_length bytes (as LRA does).
  """
  builders.check_split(NAME, split)
  if int(data_cfg.max_length) > int(data_cfg.doc_bytes):
    raise ValueError(f"data.max_length={data_cfg.max_length} is longer than the "
                     f"data.doc_bytes={data_cfg.doc_bytes} bytes stored per document; raise "
                     f"data.doc_bytes (a new dataset is built) or lower data.max_length.")
  builder = DATA.build(data_cfg)
  length = int(data_cfg.max_length)
  return builders.PaddedSource(builder.as_data_source(split=split),
                               {"inputs1": length, "inputs2": length},
                               offset=builders.BYTE_OFFSET)

