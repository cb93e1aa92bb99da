"""`pretrained.export` writes a checkpoint folder all at once (`models.hf_format.write`): a
process killed while writing leaves the target as it was, never half a checkpoint, and the same
export run again succeeds; a target that holds files is refused in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from models import hf_format, pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = dict(vocab_size=40, max_length=16, num_layers=1, num_heads=2, emb_dim=8, qkv_dim=8,
                mlp_dim=16, dropout=0.0, pos_emb="learned", attention={"kind": "dot_product"},
                attention_bias=True, norm="post", layer_norm_eps=1e-5, activation="gelu",
                embed_norm=True, type_vocab_size=1, position_offset=2)

# Exports a small RoBERTa to argv[1], killed (SIGKILL) at argv[2]: "config" after
# model.safetensors is written and before config.json, "rename" after both, before the folder
# is renamed into place, "none" not at all.
CHILD = textwrap.dedent(f"""
    import json, os, signal, sys
    target, point = sys.argv[1], sys.argv[2]
    kill = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if point == "config":
      json.dump = kill
    elif point == "rename":
      os.replace = kill
    from flax import nnx
    from models import pretrained
    from models.encoder import Encoder
    model = Encoder({SETTINGS!r}, rngs=nnx.Rngs(0))
    pretrained.export(model, target, "roberta")
    """)


def _export(target, point):
  return subprocess.run([sys.executable, "-c", CHILD, str(target), point], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def _model(seed=0):
  from flax import nnx

  from models.encoder import Encoder
  return Encoder(dict(SETTINGS), rngs=nnx.Rngs(seed))


@pytest.mark.slow
@pytest.mark.parametrize("point", ["config", "rename"])
@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "empty-folder"])
def test_a_kill_while_exporting_leaves_the_target_as_it_was(tmp_path, point, existing):
  target = tmp_path / "checkpoint"
  if existing:
    target.mkdir()
  done = _export(target, point)
  assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
  # As before: absent, or the same empty folder; no file of the checkpoint in it.
  assert target.is_dir() == existing
  if existing:
    assert os.listdir(target) == []
  with pytest.raises(hf_format.CheckpointError):
    pretrained.load(str(target))
  # The same export again succeeds beside the partial folder the kill left.
  assert [p.name.startswith(".checkpoint.partial-") for p in tmp_path.iterdir()
          if p.name != "checkpoint"] == [True]
  again = _export(target, "none")
  assert again.returncode == 0, again.stderr[-2000:]
  assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
  model, report = pretrained.load(str(target))
  assert report.architecture == "roberta" and not report.unused


def test_an_export_in_this_process_leaves_no_partial_folder(tmp_path):
  pretrained.export(_model(), str(tmp_path / "out"), "roberta")
  assert os.listdir(tmp_path) == ["out"]
  assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]


def test_a_failed_write_removes_its_partial_folder(tmp_path, monkeypatch):
  def fail(*args, **kwargs):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(hf_format.json, "dump", fail)
  with pytest.raises(OSError, match="No space left"):
    pretrained.export(_model(), str(tmp_path / "out"), "roberta")
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["folder-with-a-file", "file"])
def test_a_target_that_holds_something_is_refused_in_one_line(tmp_path, kind):
  target = tmp_path / "out"
  if kind == "file":
    target.write_text("notes")
  else:
    target.mkdir()
    (target / "tokenizer.json").write_text("{}")
  with pytest.raises(hf_format.CheckpointError) as e:
    pretrained.export(_model(), str(target), "roberta")
  assert "\n" not in str(e.value) and "not an empty folder" in str(e.value)
  assert (target.read_text() == "notes") if kind == "file" else \
      os.listdir(target) == ["tokenizer.json"]
  assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_second_process_that_exports_to_the_same_folder_meanwhile_is_refused(tmp_path,
                                                                                monkeypatch):
  """Two exports to one folder: the one that renames second finds the first's checkpoint there
  and says so in one line; the first's files are kept."""
  target = tmp_path / "out"
  rename = os.replace

  def first_wins(src, dst):
    monkeypatch.setattr(os, "replace", rename)
    pretrained.export(_model(1), str(target), "roberta")   # the other process, in between
    return rename(src, dst)

  monkeypatch.setattr(os, "replace", first_wins)
  with pytest.raises(hf_format.CheckpointError) as e:
    pretrained.export(_model(0), str(target), "roberta")
  assert "\n" not in str(e.value) and "meanwhile" in str(e.value)
  kept, _ = pretrained.load(str(target))
  import numpy as np
  np.testing.assert_array_equal(np.asarray(kept.embed.embedding.get_value()),
                                np.asarray(_model(1).embed.embedding.get_value()))
  assert sorted(os.listdir(tmp_path)) == ["out"]
