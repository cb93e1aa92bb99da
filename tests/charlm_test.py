"""Tests for the character-LM tasks (lra/data/charlm.py, lra/tasks/charlm.py), their configs and
the staged schedule: tiny enwik8.zip/text8.zip written in the original format (one member named
enwik8/text8), the 90/5/5 split scaled down, windows, exact bits per character against a
per-character computation, missing and corrupt archives, the fallback corpus, training steps and
a two-phase run through the `lra` command."""

import json
import math
import os
import zipfile

import jax
import numpy as np
import pytest
from flax import nnx

import configs
import task_helpers
from launch import cli
from lra import checkpoint, phases, tasks, train
from configs import charlm as charlm_config
from lra.data import archives, builders, charlm, pipeline
from lra.tasks.language_model import LanguageModelTask

jax.config.update("jax_disable_most_optimizations", True)

enwik8 = tasks.get_task("enwik8")
text8 = tasks.get_task("text8")


def corpus(task) -> charlm.Corpus:
  return charlm.CORPORA[task.name]

ENWIK8_HEAD = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.3/">\n  <page>\n'
               '    <title>Caf\u00e9 M\u00fcller</title>\n    <text xml:space="preserve">'
               "'''Anarchism''' originated as a term of abuse &amp; [[Category:Politics]]"
               ).encode("utf-8")


def enwik8_bytes(n: int, seed: int = 0) -> bytes:
  """XML-like bytes with UTF-8, a NUL and a 0xFF byte (every byte value is data)."""
  rng = np.random.default_rng(seed)
  body = bytes(rng.choice(list(b"abcdefghij <>[]'\n\x00\xff\xc3\xa9"), n))
  return (ENWIK8_HEAD + body)[:n]


def text8_bytes(n: int, seed: int = 0) -> bytes:
  rng = np.random.default_rng(seed)
  words = ["anarchism", "originated", "as", "a", "term", "of", "abuse", "first", "used"]
  text = " ".join(rng.choice(words, n))
  return text[:n].encode("ascii")


def write_zip(manual_dir, corpus: charlm.Corpus, data: bytes,
              compression=zipfile.ZIP_DEFLATED) -> str:
  os.makedirs(manual_dir, exist_ok=True)
  path = os.path.join(manual_dir, corpus.archive.filename)
  with zipfile.ZipFile(path, "w", compression=compression) as z:
    z.writestr(corpus.member, data)
  return path


def data_cfg(task, tmp_path, sizes=(900, 60, 40), **kw):
  return task_helpers.local_data(charlm_config.data_config(task.name), tmp_path,
                                 {"split_sizes": sizes, **kw})


def tiny_config(task, tmp_path, sizes=(900, 60, 40), **overrides):
  """Two band layers (one dilated head), width 16, length 16, 8 fake devices x batch 1."""
  c = configs.build_config(task.name, size="small")
  c.data = data_cfg(task, tmp_path, sizes, fallback=False)
  c.data.max_length, c.data.eval_length, c.data.eval_context = 16, 16, 10
  c.model.emb_dim, c.model.qkv_dim, c.model.mlp_dim = 16, 16, 32
  c.model.num_heads, c.model.num_layers = 2, 2
  c.model.layer_attention = ({"window": 2, "dilation": 1}, {"window": 3, "dilation": (1, 2)})
  c.model.attention = {"kind": "band", "window": 3}
  c.phases = ()
  return task_helpers.override(task_helpers.short_run(c), overrides)


# ----------------------------------------------------------------------------------------------
# Split boundaries and windows.


def test_split_bounds_standard_scaled_and_fallback():
  assert charlm.split_bounds(100_000_000, charlm.STANDARD_SPLIT) == [
      (0, 90_000_000), (90_000_000, 95_000_000), (95_000_000, 100_000_000)]
  assert charlm.split_bounds(1000, (900, 50, 50)) == [(0, 900), (900, 950), (950, 1000)]
  assert charlm.split_bounds(1000, None) == [(0, 900), (900, 950), (950, 1000)]
  with pytest.raises(ValueError, match="add up to 100,000,000 .* has 1,000"):
    charlm.split_bounds(1000, charlm.STANDARD_SPLIT)


@pytest.mark.parametrize("n, length, context", [(50, 8, 5), (9, 8, 3), (3, 8, 0), (100, 7, 6)])
def test_eval_windows_score_every_character_once(n, length, context):
  stream = np.arange(n, dtype=np.uint8)  # value = position, so targets name their index
  windows = charlm.eval_windows(stream, length, context)
  scored = []
  for i in range(len(windows)):
    ex = windows[i]
    start = int(windows.starts[i])
    for p in np.flatnonzero(ex["mask"]):
      t = int(ex["targets"][p]) - builders.BYTE_OFFSET
      assert t == start + p + 1
      np.testing.assert_array_equal(ex["inputs"][:p + 1] - 1, stream[start:t])  # its context
      if i > 0:
        assert p + 1 >= context + 1
      scored.append(t)
    assert not ex["mask"][ex["targets"] == 0].any()
  assert sorted(scored) == list(range(1, n))


def test_train_windows_cover_the_split():
  stream = np.arange(37, dtype=np.uint8)
  windows = charlm.train_windows(stream, 8)
  seen = set()
  for ex in windows.__getitems__(range(len(windows))):
    assert ex["mask"].all()
    np.testing.assert_array_equal(ex["targets"][:-1], ex["inputs"][1:])
    seen.update((ex["targets"] - 1).tolist())
  assert seen == set(range(1, 37))


# ----------------------------------------------------------------------------------------------
# The tfds dataset from the original zip format.


@pytest.mark.parametrize("task, make", [(enwik8, enwik8_bytes), (text8, text8_bytes)])
def test_dataset_from_the_zip_recovers_each_split(task, make, tmp_path, monkeypatch):
  monkeypatch.setattr(charlm, "CHUNK_BYTES", 64)  # several chunks per split
  data = make(1000)
  write_zip(tmp_path / "manual", corpus(task), data)
  cfg = data_cfg(task, tmp_path, max_length=100, eval_length=0, eval_context=50)
  folder = task.prepare(cfg)
  assert folder.endswith(os.path.join("char_lm", f"{task.name}_split900_60_40", "1.0.0"))
  builder = charlm.resolve(corpus(task), cfg)[0]
  for split, (a, b) in zip(builders.SPLITS, [(0, 900), (900, 960), (960, 1000)]):
    assert charlm.read_stream(builder, split).tobytes() == data[a:b]
  assert len(builder.as_data_source(split="train")) == math.ceil(900 / 64)
  train_src = task.get_source(cfg, "train")
  ex = train_src[0]
  np.testing.assert_array_equal(ex["inputs"], np.frombuffer(data[:cfg.max_length], np.uint8) + 1)
  assert task.vocab_size == 257 and isinstance(task, LanguageModelTask) and task.pad_id == 0
  if task is enwik8:  # NUL is id 1 and 0xFF id 256, never padding
    ids = np.concatenate([train_src[i]["inputs"] for i in range(len(train_src))])
    assert ids.min() == 1 and ids.max() == 256
  assert task.status(cfg).ready


def test_missing_archive_names_url_file_and_directory(tmp_path):
  cfg = data_cfg(enwik8, tmp_path)
  with pytest.raises(archives.DataMissingError) as e:
    enwik8.get_source(cfg, "train")
  msg = str(e.value)
  assert "http://mattmahoney.net/dc/enwik8.zip" in msg and "enwik8.zip" in msg
  assert str(tmp_path / "manual") in msg and "data.fallback=True" in msg
  st = text8.status(data_cfg(text8, tmp_path))
  assert not st.ready and "http://mattmahoney.net/dc/text8.zip" in st.detail


def test_corrupt_or_wrong_archives_leave_no_dataset(tmp_path):
  data = enwik8_bytes(1000)
  path = write_zip(tmp_path / "manual", corpus(enwik8), data, compression=zipfile.ZIP_STORED)
  cfg = data_cfg(enwik8, tmp_path)
  raw = bytearray(open(path, "rb").read())
  raw[raw.index(data[:40]) + 200] ^= 0x55          # one flipped byte in the member: bad CRC
  open(path, "wb").write(bytes(raw))
  with pytest.raises(archives.CorruptArchiveError, match="enwik8.zip is truncated or corrupt"):
    enwik8.prepare(cfg)
  assert charlm.resolve(corpus(enwik8), cfg)[0].is_prepared() is False
  open(path, "wb").write(bytes(raw[:len(raw) // 2]))  # truncated
  with pytest.raises(archives.CorruptArchiveError, match="download it again from http"):
    enwik8.prepare(cfg)
  assert charlm.resolve(corpus(enwik8), cfg)[0].is_prepared() is False
  with zipfile.ZipFile(path, "w") as z:                # a zip without the `enwik8` member
    z.writestr("enwik9", data)
  with pytest.raises(archives.CorruptArchiveError, match="no member 'enwik8'"):
    enwik8.prepare(cfg)
  write_zip(tmp_path / "manual", corpus(enwik8), data)  # too short for the standard split
  standard = data_cfg(enwik8, tmp_path, sizes=charlm.STANDARD_SPLIT)
  with pytest.raises(ValueError, match="data.split_sizes"):
    enwik8.prepare(standard)
  assert charlm.resolve(corpus(enwik8), standard)[0].is_prepared() is False
  assert not os.path.exists(tmp_path / "data" / "char_lm" / "enwik8" / "1.0.0")


def test_fallback_corpus_when_the_archive_is_absent(tmp_path, capsys):
  from pydoc_data import topics
  cfg = data_cfg(enwik8, tmp_path, fallback=True)
  source = enwik8.get_source(cfg, "validation")
  err = capsys.readouterr().err
  assert "pydoc_data.topics" in err and "http://mattmahoney.net/dc/enwik8.zip" in err
  assert os.path.join(str(tmp_path / "manual"), "enwik8.zip") in err
  text = "\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
  n = len(text)
  assert source.stream.tobytes() == text[n - 2 * (n // 20):n - n // 20]
  assert enwik8.status(cfg).ready and "fallback" in enwik8.status(cfg).detail
  t8 = text8.get_source(data_cfg(text8, tmp_path, fallback=True), "test").stream.tobytes()
  assert set(t8) <= set(b"abcdefghijklmnopqrstuvwxyz ") and b"  " not in t8 and len(t8) > 1000
  assert "text8.zip" in capsys.readouterr().err
  # The archive, once there, wins over the fallback.
  write_zip(tmp_path / "manual", corpus(enwik8), enwik8_bytes(1000))
  assert enwik8.get_source(cfg, "test").stream.tobytes() == enwik8_bytes(1000)[960:]


# ----------------------------------------------------------------------------------------------
# Bits per character and training.


def direct_bits(model, text: bytes, length: int, context: int) -> tuple[float, int]:
  """Sum of -log2 p(c) over every character but the first, each predicted by running the model
  on exactly its context: the characters from its evaluation window's start up to it."""
  stride = length - context
  forward = jax.jit(lambda ids: model(ids, rng=None))    # one compilation per context length
  total, count = 0.0, 0
  for t in range(1, len(text)):
    k = 0 if t <= length else math.ceil((t - length) / stride)  # the window that scores t
    start = k * stride
    ids = np.frombuffer(text[start:t], np.uint8).astype(np.int32)[None] + 1   # [1, t - start]
    logits = np.asarray(forward(ids), np.float64)[0, -1]                      # [V]
    logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    total -= logp[text[t] + 1] / math.log(2.0)
    count += 1
  return total, count


@pytest.mark.slow
def test_trainer_bpc_equals_a_per_character_computation(tmp_path):
  data = enwik8_bytes(1000)
  write_zip(tmp_path / "manual", corpus(enwik8), data)
  config = tiny_config(enwik8, tmp_path, **{"data.eval_length": 8, "data.eval_context": 5})
  results = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert results["train_step_traces"] == 1 and int(results["state"]["step"]) == 2
  trainer = train.Trainer(config)
  model = nnx.merge(trainer.graphdef, results["state"]["params"], trainer.rest)
  bits, count = direct_bits(model, data[960:], length=8, context=5)
  assert results["test_examples"] == count == 39
  assert abs(results["test_bpc"] - bits / count) < 1e-5
  assert 0.0 < results["test_bpc"] < 12.0
  # The same through Trainer.evaluate with other batch sizes (fillers have weight 0).
  for batch_size in (8, 16):
    m = trainer.evaluate(results["state"]["params"], pipeline.eval_batches(
        enwik8.get_source(config.data, "test"), batch_size=batch_size))
    assert abs(m["bpc"] - bits / count) < 1e-5 and m["examples"] == 39


@pytest.mark.slow
def test_two_phase_schedule_on_text8_through_the_lra_command(tmp_path, capsys):
  write_zip(tmp_path / "manual", corpus(text8), text8_bytes(1000))
  # Phase 2 has learning rate 0: it must end exactly where phase 1 did, which only holds if it
  # started from phase 1's parameters.
  schedule = ({"steps": 2, "max_length": 8, "window_scale": 1, "learning_rate": 0.01,
             "batch_size": 8, "warmup_steps": 1},
            {"steps": 1, "max_length": 16, "window_scale": 2, "learning_rate": 0.0,
             "batch_size": 8, "warmup_steps": 1})
  config = tiny_config(text8, tmp_path)
  args = ["run", "text8", "--size", "small", "--workdir", str(tmp_path / "run")]
  overrides = [f"--config.{k}={v if isinstance(v, str) else repr(v)}" for k, v in (
      ("phases", schedule), ("data.data_dir", config.data.data_dir),
      ("data.manual_dir", config.data.manual_dir), ("data.split_sizes", (900, 60, 40)),
      ("data.fallback", False), ("data.eval_length", 16), ("data.eval_context", 10),
      ("model.emb_dim", 16), ("model.qkv_dim", 16), ("model.mlp_dim", 32),
      ("model.num_heads", 2), ("model.num_layers", 2),
      ("model.layer_attention", config.model.layer_attention), ("eval_batch_size", 8),
      ("log_every", 1), ("eval_every", 100), ("checkpoint_every", 100), ("progress", False))]
  assert cli.main(args + overrides) == 0
  out = capsys.readouterr().out
  assert "Phase 1/2" in out and "Phase 2/2" in out
  assert f"Initialised the parameters from {tmp_path / 'run' / 'phase1' / 'checkpoints'}" in out
  last = out.strip().splitlines()[-1]
  assert last.startswith("test bits per character ") and "phase2" in last
  p1 = json.load(open(tmp_path / "run" / "phase1" / "config.json"))
  p2 = json.load(open(tmp_path / "run" / "phase2" / "config.json"))
  assert (p1["data"]["max_length"], p2["data"]["max_length"]) == (8, 16)
  assert [x["window"] for x in p2["model"]["layer_attention"]] == [4, 6]
  assert p2["learning_rate"] == 0.0 and p2["init_from"].endswith("phase1/checkpoints")
  for phase, (steps, tokens) in ((1, (2, 8 * 8)), (2, (1, 8 * 16))):
    run = tmp_path / "run" / f"phase{phase}"
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, steps + 1))
    assert all(r["examples"] == tokens for r in records if r["split"] == "train")
    results = json.load(open(run / "results.json"))
    assert results["train_step_traces"] == 1 and results["test_examples"] == 39
    assert np.isfinite(results["test_bpc"]) and results["task"] == "text8"

  full = configs.build_config("text8", size="small", overrides=[
      tuple(o[len("--config."):].split("=", 1)) for o in overrides])
  target = checkpoint.abstract_like(train.Trainer(phases.phase_config(full, 0)).params)

  def final_params(phase):
    params, _ = checkpoint.load_params(str(tmp_path / "run" / f"phase{phase}"), target)
    return jax.tree.leaves(params)

  one, two = final_params(1), final_params(2)
  assert any(np.abs(np.asarray(a)).sum() > 0 for a in one)
  for a, b in zip(one, two):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Rerunning skips both finished phases and prints the same result.
  assert cli.main(args + overrides) == 0
  again = capsys.readouterr().out
  assert again.count("skipped") == 2 and again.strip().splitlines()[-1] == last
