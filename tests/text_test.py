"""Tests for lra.data.text, lra.tasks.text and configs/text.py on a tiny aclImdb_v1.tar.gz in the
original layout: the stored bytes and labels, first-bytes truncation, the holdout validation
option, missing and truncated archives, status, and two training steps."""

import os

import jax
import numpy as np
import pytest

import task_helpers
from configs import text as text_config
from lra.data import archives, text
from lra.tasks import text as text_task
from lra.tasks.classification import ClassificationTask

jax.config.update("jax_disable_most_optimizations", True)

MAX_LENGTH = 64
LONG = ("This film is long. " * 20 + "The end.").encode()  # 388 bytes > MAX_LENGTH
# (split, folder, review id, rating) -> file contents, as in aclImdb/<split>/<folder>/<id>_<r>.txt
REVIEWS = {
    ("train", "pos", 0, 9): "Bromwell High is a cartoon comedy.<br /><br />I loved it!".encode(),
    ("train", "pos", 12, 7): "Amélie à Paris, 東京 and \"quotes\" 🎬 - great.".encode(),
    ("train", "pos", 3, 10): LONG,
    ("train", "neg", 5, 1): b"  Terrible.\tNothing works.\n",   # stripped like tfds imdb_reviews
    ("train", "neg", 1, 3): "Naïve plot; dull 'acting'.".encode(),
    ("train", "neg", 10, 2): b"Bad." * 30,
    ("test", "pos", 7, 8): "Superb – worth it.".encode(),
    ("test", "pos", 2, 10): LONG[::-1],
    ("test", "neg", 4, 4): b"Meh.",
    ("test", "neg", 0, 2): "Schrecklich! Ärgerlich.".encode(),
}
EXTRA = {  # members the builder must ignore
    "aclImdb/README": b"Large Movie Review Dataset v1.0\n",
    "aclImdb/imdb.vocab": b"the\nand\n",
    "aclImdb/imdbEr.txt": b"0.1\n",
    "aclImdb/train/unsup/0_0.txt": b"unlabelled review",
    "aclImdb/train/urls_pos.txt": b"http://www.imdb.com/title/tt0453418/usercomments\n",
    "aclImdb/train/labeledBow.feat": b"9 0:9 1:1\n",
    "aclImdb/test/urls_neg.txt": b"http://www.imdb.com/title/tt0064354/usercomments\n",
}


def write_archive(path, reviews=REVIEWS, extra=EXTRA):
  """A gzip'd tar with the aclImdb member layout (directories, then files)."""
  task_helpers.write_imdb(path, reviews, extra)


@pytest.fixture(scope="module", autouse=True)
def tiny_archive_is_not_the_published_one():
  with task_helpers.unpublished(text, "IMDB"):
    yield


def expected(split):
  """(ids without padding, label) in the stored order: sorted by (label, review id)."""
  rows = sorted((text.LABELS[f], i, data.strip()) for (s, f, i, _), data in REVIEWS.items()
                if s == split)
  return [(np.frombuffer(data, np.uint8).astype(np.int32) + 1, label) for label, _, data in rows]


def data_cfg(root, **kw):
  return task_helpers.local_data(text_config.data_config(), root,
                                 {"max_length": MAX_LENGTH, **kw})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  root = tmp_path_factory.mktemp("text")
  os.makedirs(root / "manual")
  write_archive(str(root / "manual" / text.IMDB.filename))
  cfg = data_cfg(root)
  return (root, cfg, *task_helpers.prepare_with_status(text_task.TASK, cfg))


def rows_of(source):
  return [source[i] for i in range(len(source))]


def test_examples_are_the_review_bytes_plus_one_first_bytes_kept(built):
  _, cfg, _, _ = built
  for split in ("train", "test"):
    got = rows_of(text.get_source(cfg, split))
    want = expected(split)
    assert len(got) == len(want) == (6 if split == "train" else 4)
    for ex, (ids, label) in zip(got, want):
      assert ex["inputs"].shape == (MAX_LENGTH,) and ex["inputs"].dtype == np.int32
      n = min(ids.size, MAX_LENGTH)
      np.testing.assert_array_equal(ex["inputs"][:n], ids[:n])   # the FIRST bytes
      assert not ex["inputs"][n:].any()
      assert int(ex["targets"]) == label
  # Spot checks independent of the helper: a non-ASCII review, the stripped one, labels.
  train_rows = rows_of(text.get_source(cfg, "train"))
  assert [int(r["targets"]) for r in train_rows] == [0, 0, 0, 1, 1, 1]
  row = train_rows[1]["inputs"]
  terrible = bytes((row[row > 0] - 1).astype(np.uint8))
  assert terrible == b"Terrible.\tNothing works."
  amelie = train_rows[5]["inputs"]
  assert bytes((amelie[amelie > 0] - 1).astype(np.uint8)).decode() == \
      "Amélie à Paris, 東京 and \"quotes\" 🎬 - great."
  long_row = train_rows[4]["inputs"]
  assert np.count_nonzero(long_row) == MAX_LENGTH
  np.testing.assert_array_equal(long_row, np.frombuffer(LONG[:MAX_LENGTH], np.uint8) + 1)
  batch = text.get_source(cfg, "test").__getitems__([3, 0])
  np.testing.assert_array_equal(batch[0]["inputs"], text.get_source(cfg, "test")[3]["inputs"])


def test_storage_keeps_whole_reviews_and_max_length_is_a_read_setting(built):
  _, cfg, _, _ = built
  wide = data_cfg(built[0], max_length=1000)
  row = text.get_source(wide, "train")[4]["inputs"]   # the 388-byte review, untruncated
  assert np.count_nonzero(row) == len(LONG)
  np.testing.assert_array_equal(row[:len(LONG)], np.frombuffer(LONG, np.uint8) + 1)
  assert os.listdir(os.path.join(cfg.data_dir, "lra_text")) == ["bytes"]


def test_validation_is_test_by_default_as_in_lra(built):
  _, cfg, _, _ = built
  assert cfg.validation == "test"
  val = rows_of(text.get_source(cfg, "validation"))
  test = rows_of(text.get_source(cfg, "test"))
  assert len(val) == 4
  for a, b in zip(val, test):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_holdout_validation_is_a_seeded_part_of_train(built):
  root, cfg, _, _ = built
  full = [tuple(r["inputs"]) for r in rows_of(text.get_source(cfg, "train"))]
  hold = data_cfg(root, validation="holdout", holdout_fraction=0.34)
  train_rows = [tuple(r["inputs"]) for r in rows_of(text.get_source(hold, "train"))]
  val_rows = [tuple(r["inputs"]) for r in rows_of(text.get_source(hold, "validation"))]
  assert (len(train_rows), len(val_rows)) == (4, 2)
  assert sorted(train_rows + val_rows) == sorted(full) and not set(train_rows) & set(val_rows)
  assert len(text.get_source(hold, "test")) == 4
  again = [tuple(r["inputs"]) for r in rows_of(text.get_source(hold, "validation"))]
  assert again == val_rows
  kept, held = text.holdout_indices(25_000, 0.1, 0)
  assert (kept.size, held.size) == (22_500, 2_500) and not np.intersect1d(kept, held).size
  assert not np.array_equal(held, text.holdout_indices(25_000, 0.1, 1)[1])
  with pytest.raises(ValueError, match="valid: test, holdout"):
    text.get_source(data_cfg(root, validation="val"), "validation")
  with pytest.raises(ValueError, match="holdout_fraction"):
    text.holdout_indices(10, 1.5, 0)


def test_status_before_and_after_prepare(built):
  root, cfg, before, folder = built
  task_helpers.check_status(text_task.TASK, cfg, before, folder,
                            missing_cfg=data_cfg(root / "elsewhere"), url=text.IMDB.url)


def test_missing_archive_names_url_file_and_directory(tmp_path):
  msg = task_helpers.missing_data_message(text_task.TASK, data_cfg(tmp_path), "dev")
  for part in (text.IMDB.url, "aclImdb_v1.tar.gz", str(tmp_path / "manual")):
    assert part in msg


def test_truncated_archive_raises_and_leaves_no_dataset(tmp_path):
  cfg = data_cfg(tmp_path)
  task_helpers.check_truncated_archive(
      text_task.TASK, cfg, os.path.join(cfg.manual_dir, text.IMDB.filename), write_archive,
      match="truncated or corrupt.*download it")


def test_archive_without_the_aclimdb_layout_is_refused(tmp_path):
  os.makedirs(tmp_path / "manual")
  reviews = {k: v for k, v in REVIEWS.items() if k[0] == "train"}   # no test reviews
  write_archive(str(tmp_path / "manual" / text.IMDB.filename), reviews)
  with pytest.raises(archives.CorruptArchiveError, match="aclImdb/test/pos/"):
    text_task.TASK.prepare(data_cfg(tmp_path))
  task_helpers.assert_nothing_built(text_task.TASK, data_cfg(tmp_path))


def test_two_training_steps(built, tmp_path):
  results = task_helpers.two_training_steps(text_config, data_cfg(built[0]),
                                            str(tmp_path / "run"), num_layers=1)
  assert results["test_examples"] == 4 and results["majority_class_rate"] == 0.5


def test_configs_base_is_lra_and_small_is_smaller():
  lra = {"data.max_length": 1000, "data.validation": "test", "model.num_layers": 4,
         "model.emb_dim": 256, "model.num_heads": 4, "model.qkv_dim": 256, "model.mlp_dim": 1024,
         "model.dropout": 0.1, "model.pos_emb": "sinusoidal", "model.pool": "cls",
         "batch_size": 32, "learning_rate": 0.05, "schedule": "rsqrt", "warmup_steps": 8000,
         "weight_decay": 0.1, "num_train_steps": 20_000}
  task_helpers.check_config_module(text_config, "text", lra, bad_arg="size=large",
                                   error="valid sizes")


def test_task_interface():
  task_helpers.check_task(text_task, ClassificationTask, num_classes=2, vocab_size=257)


def test_lra_run_text_starts_from_a_roberta_checkpoint_with_band_attention(built, tmp_path,
                                                                             capsys):
  """The fine-tuning command of docs/pretrained.md, `lra run text --config.init_from_hf=PATH
  --config.model.attention.kind=band`, through the CLI: a byte-level RoBERTa checkpoint (257
  ids, 32 positions, written by our export) becomes the Text model's encoder, its positions
  copied over the run's 64, and the run trains with band attention."""
  import json

  from flax import nnx

  from launch import cli
  from models import pretrained
  from models.encoder import Encoder
  source = Encoder(dict(vocab_size=257, max_length=32, num_layers=1, num_heads=2, emb_dim=16,
                        qkv_dim=16, mlp_dim=32, dropout=0.0, pos_emb="learned",
                        attention={"kind": "dot_product"}, attention_bias=True, norm="post",
                        layer_norm_eps=1e-5, activation="gelu", embed_norm=True,
                        type_vocab_size=1, position_offset=2), rngs=nnx.Rngs(0))
  checkpoint = tmp_path / "roberta"
  pretrained.export(source, str(checkpoint), "roberta")
  root, workdir = built[0], tmp_path / "run"
  assert cli.main(["run", "text", "--size", "small", "--workdir", str(workdir), "--no_preflight",
                   f"--config.init_from_hf={checkpoint}", "--config.model.attention.kind=band",
                   f"--config.data.data_dir={root / 'data'}",
                   f"--config.data.manual_dir={root / 'manual'}", "--config.data.download=false",
                   f"--config.data.max_length={MAX_LENGTH}", "--config.batch_size=8",
                   "--config.eval_batch_size=8", "--config.num_train_steps=2",
                   "--config.warmup_steps=1", "--config.eval_every=100",
                   "--config.checkpoint_every=100", "--config.progress=false"]) == 0
  out = capsys.readouterr().out
  assert f"Initialised the encoder from the roberta checkpoint {checkpoint}" in out
  assert f"positions: 32 copied to {MAX_LENGTH}" in out
  config = json.loads((workdir / "config.json").read_text())
  assert config["model"]["attention"]["kind"] == "band"
  results = json.loads((workdir / "results.json").read_text())
  assert np.isfinite(results["test_loss"]) and results["test_examples"] == 4
