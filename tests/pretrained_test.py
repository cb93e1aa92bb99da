"""Hugging Face checkpoints imported into our models compute what Hugging Face computes.

The fixtures under tests/fixtures/hf are tiny random-weight models saved by Hugging Face
transformers with their own outputs (`benchmarks/hf_fixtures.py`), so these tests need neither
torch nor transformers. Outputs are compared at real (unpadded) positions, in float32.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from models import pretrained

jax.config.update("jax_disable_most_optimizations", True)   # as the suite's training tests

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
TOL = 1e-5


def _fixture(name):
  path = os.path.join(FIXTURES, name)
  return path, dict(np.load(os.path.join(path, "reference.npz")))


def _close(ours, theirs, real, what):
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  diff = np.abs(ours - theirs)[real.astype(bool)]
  scale = max(1.0, float(np.abs(theirs).max()))
  assert diff.max() <= TOL * scale, f"{what}: max difference {diff.max():.3g}"


@pytest.mark.parametrize("name", ["roberta", "bert"])
def test_a_bert_family_checkpoint_gives_hugging_faces_hidden_states_and_logits(name):
  path, ref = _fixture(name)
  model, report = pretrained.load(path)
  assert report.architecture == name and not any("encoder.layer" in n for n in report.unused)
  x = model.encode(ref["input_ids"], ref["attention_mask"],
                   token_type_ids=ref.get("token_type_ids"))
  real = ref["attention_mask"]
  _close(x, ref["last_hidden_state"], real, "last_hidden_state")
  _close(model.mlm_logits(x), ref["logits"], real, "logits")


def test_bigbird_with_full_attention_gives_hugging_faces_outputs():
  path, ref = _fixture("bigbird_full")
  model, report = pretrained.load(path)
  assert report.settings["attention"]["kind"] == "dot_product"
  real, at = ref["attention_mask"], ref["logits_positions"]
  x = model.encode(ref["input_ids"], real)
  _close(x, ref["last_hidden_state"], real, "last_hidden_state")
  _close(np.asarray(model.mlm_logits(x))[:, at], ref["logits"], real[:, at], "logits")


def test_block_sparse_bigbird_gives_hugging_faces_inference():
  """Hugging Face's block-sparse BigBird at inference (every random block is block 0, counted
  1 + r times): our bigbird kind with random_blocks='first'."""
  path, ref = _fixture("bigbird")
  model, report = pretrained.load(path)
  attention = report.settings["attention"]
  assert (attention["kind"], attention["block_size"], attention["num_random_blocks"],
          attention["random_blocks"]) == ("bigbird", 16, 2, "first")
  assert np.all(ref["rand_attn"] == 0)            # what Hugging Face used: block 0 everywhere
  real, at = ref["attention_mask"], ref["logits_positions"]
  x = model.encode(ref["input_ids"], real)
  _close(x, ref["last_hidden_state"], real, "last_hidden_state")
  _close(np.asarray(model.mlm_logits(x))[:, at], ref["logits"], real[:, at], "logits")
  drawn, _ = pretrained.load(path, attention={**attention, "random_blocks": "drawn"})
  assert np.abs(np.asarray(drawn.encode(ref["input_ids"], real)) - np.asarray(x))[
      real.astype(bool)].max() > 1e-3


def test_longformer_with_global_tokens_and_padding_gives_hugging_faces_outputs():
  path, ref = _fixture("longformer")
  model, report = pretrained.load(path)
  assert report.settings["attention"]["kind"] == "band"
  real = ref["attention_mask"]
  x = model.encode(ref["input_ids"], real, ref["global_attention_mask"])
  _close(x, ref["last_hidden_state"], real, "last_hidden_state with global tokens")
  at = ref["logits_positions"]           # the fixture keeps the logits at these positions only
  _close(np.asarray(model.mlm_logits(x))[:, at], ref["logits"], real[:, at], "logits")
  x = model.encode(ref["input_ids"], real)
  _close(x, ref["last_hidden_state_noglobal"], real, "last_hidden_state without global tokens")


def test_the_global_projections_matter():
  """A slip in Longformer's global rows (the ordinary projections instead of the global ones)
  must change the outputs of the global tokens."""
  path, ref = _fixture("longformer")
  model, _ = pretrained.load(path)
  for block in model.blocks:
    att = block.attention
    att.query_global.set_value(att.query.get_value())
    att.key_global.set_value(att.key.get_value())
  x = model.encode(ref["input_ids"], ref["attention_mask"], ref["global_attention_mask"])
  glob = ref["global_attention_mask"].astype(bool)
  assert np.abs(np.asarray(x) - ref["last_hidden_state"])[glob].max() > 1e-3


def test_overrides_replace_settings_and_longer_positions_are_copied():
  path, _ = _fixture("roberta")
  base, _ = pretrained.load(path)
  model, report = pretrained.load(path, max_length=150, attention={"kind": "band", "window": 8})
  table = np.asarray(model.positions.table.get_value())
  source = np.asarray(base.positions.table.get_value())
  offset, rows = base.positions.offset, source.shape[0] - base.positions.offset
  assert table.shape[0] == 150 + offset
  np.testing.assert_array_equal(table[:offset], source[:offset])
  for start in range(offset, 150 + offset, rows):
    stop = min(start + rows, 150 + offset)
    np.testing.assert_array_equal(table[start:stop], source[offset:offset + stop - start])
  assert report.settings["attention"]["kind"] == "band"
  assert any("copied" in note for note in report.notes)


def _copy(tmp_path, name="roberta"):
  dst = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), dst)
  return dst


def _edit_config(folder, **changes):
  config = json.loads((folder / "config.json").read_text())
  for key, value in changes.items():
    if value is None:
      config.pop(key, None)
    else:
      config[key] = value
  (folder / "config.json").write_text(json.dumps(config))


def _edit_tensors(folder, fn):
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(folder / "model.safetensors"))
  fn(tensors)
  save_file(tensors, str(folder / "model.safetensors"))


QUERY = "roberta.encoder.layer.1.attention.self.query.weight"
POSITIONS = "roberta.embeddings.position_embeddings.weight"


@pytest.mark.parametrize("break_it, says", [
    (lambda d: shutil.rmtree(d), "not a folder"),
    (lambda d: (d / "config.json").unlink(), "config.json: missing"),
    (lambda d: (d / "config.json").write_text("{not json"), "not readable JSON"),
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors: missing"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 64), "not a readable safetensors"),
    (lambda d: _edit_config(d, model_type="gpt2"), "model_type = 'gpt2' is not supported"),
    (lambda d: _edit_config(d, hidden_size=None), "field 'hidden_size' is missing"),
    (lambda d: _edit_config(d, hidden_act="swish"), "hidden_act = 'swish'"),
    (lambda d: _edit_tensors(d, lambda t: t.pop(QUERY)), f"tensor {QUERY!r} is missing"),
    (lambda d: _edit_tensors(d, lambda t: t.update({QUERY: t[QUERY][:, :-1].copy()})),
     f"tensor {QUERY!r} has shape"),
    (lambda d: _edit_tensors(d, lambda t: t.update({POSITIONS: t[POSITIONS][:-3].copy()})),
     f"tensor {POSITIONS!r} has 63 rows, but config.json makes it 66"),
])
def test_a_bad_checkpoint_folder_is_one_line_naming_what_is_wrong(tmp_path, break_it, says):
  folder = _copy(tmp_path)
  break_it(folder)
  with pytest.raises(pretrained.CheckpointError) as info:
    pretrained.load(str(folder))
  message = str(info.value)
  assert says in message and "\n" not in message, message


@pytest.mark.parametrize("name", ["roberta", "bert", "longformer"])
def test_import_then_export_gives_back_every_tensor_and_config_field(tmp_path, name):
  from safetensors.numpy import load_file
  path, _ = _fixture(name)
  model, report = pretrained.load(path)
  with open(os.path.join(path, "config.json")) as f:
    like = json.load(f)
  pretrained.export(model, str(tmp_path / "out"), report.architecture, like)
  theirs = load_file(os.path.join(path, "model.safetensors"))
  ours = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert sorted(ours) == sorted(theirs)
  for key in theirs:
    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
  assert json.loads((tmp_path / "out" / "config.json").read_text()) == like


def test_an_exported_model_reimports_to_the_same_function(tmp_path):
  """A model built here (not imported) exports as a Longformer whose import computes the same
  hidden states: windows, global projections and positions survive the trip."""
  from flax import nnx

  from models.encoder import Encoder
  path, ref = _fixture("longformer")
  settings = pretrained.encoder_settings(json.load(open(os.path.join(path, "config.json"))))
  model = Encoder({**settings, "lm_head": True}, rngs=nnx.Rngs(3))
  pretrained.export(model, str(tmp_path / "out"), "longformer")
  again, _ = pretrained.load(str(tmp_path / "out"))
  ids, real = ref["input_ids"][:, :300], ref["attention_mask"][:, :300]
  glob = ref["global_attention_mask"][:, :300]
  np.testing.assert_allclose(np.asarray(again.encode(ids, real, glob)),
                             np.asarray(model.encode(ids, real, glob)), rtol=0, atol=1e-6)


def test_a_model_without_a_hugging_face_equivalent_is_refused():
  from flax import nnx

  from models.encoder import Encoder
  path, _ = _fixture("roberta")
  settings = pretrained.encoder_settings(json.load(open(os.path.join(path, "config.json"))))
  model = Encoder({**settings, "norm": "pre"}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="norm='pre'"):
    pretrained.export(model, "/nonexistent", "roberta")


@pytest.mark.parametrize("name", ["roberta", "longformer"])
def test_an_exported_checkpoint_loads_in_hugging_face_transformers(tmp_path, name):
  """Only where the `bench` extra is installed (torch and transformers)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  path, ref = _fixture(name)
  model, report = pretrained.load(path)
  pretrained.export(model, str(tmp_path / "out"), report.architecture)
  cls = {"roberta": transformers.RobertaModel, "longformer": transformers.LongformerModel}[name]
  hf = cls.from_pretrained(str(tmp_path / "out")).eval()
  kw = {}
  if name == "longformer":
    kw["global_attention_mask"] = torch.tensor(ref["global_attention_mask"])
  with torch.no_grad():
    out = hf(input_ids=torch.tensor(ref["input_ids"]),
             attention_mask=torch.tensor(ref["attention_mask"]), **kw).last_hidden_state
  _close(out.numpy(), ref["last_hidden_state"], ref["attention_mask"], "transformers' output")


# The runs from the roberta checkpoint: one device (the import is under test, not the mesh).
HF_RUN = {"learning_rate": 0.0, "mesh": {"data": 1, "fsdp": 1, "tensor": 1}}


@pytest.mark.slow
def test_a_training_run_starts_from_a_hugging_face_checkpoint(tmp_path, capsys):
  """`config.init_from_hf`: the task model's encoder has the checkpoint's architecture and
  weights (positions copied over the longer table), the run's attention kind; with a zero
  learning rate the trained encoder is still the checkpoint's."""
  import length_extension_test as tiny_runs
  from lra import train
  path, _ = _fixture("roberta")
  source, _ = pretrained.load(path)
  config = tiny_runs.tiny(str(tmp_path / "data"), 100, init_from_hf=path, **HF_RUN)
  config.model.attention = {"kind": "band", "window": 4}
  results = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert "Initialised the encoder from the roberta checkpoint" in capsys.readouterr().out
  encoder = results["state"]["params"]["encoder"]
  np.testing.assert_array_equal(np.asarray(encoder["embed"]["embedding"]),
                                np.asarray(source.embed.embedding.get_value()))
  np.testing.assert_array_equal(
      np.asarray(encoder["blocks"][1]["attention"]["query"]),
      np.asarray(source.blocks[1].attention.query.get_value()))
  table = np.asarray(encoder["positions"]["table"])
  assert table.shape[0] == 100 + 2                    # mean pooling: no CLS; RoBERTa's offset 2
  np.testing.assert_array_equal(table[66:], np.asarray(source.positions.table.get_value())[2:38])
  assert np.isfinite(results["test_loss"])


@pytest.mark.slow
def test_self_pretraining_continues_from_a_hugging_face_checkpoint(tmp_path):
  """`protocol=spt` with `init_from_hf`: phase 1 (masked LM) starts from the checkpoint, phase 2
  from phase 1 in the checkpoint's architecture; at learning rate 0 both keep its weights."""
  import configs.common
  import length_extension_test as tiny_runs
  from lra import phases
  path, _ = _fixture("roberta")
  source, _ = pretrained.load(path)
  config = tiny_runs.tiny(str(tmp_path / "data"), 100, init_from_hf=path, **HF_RUN,
                          protocol="spt", num_train_steps=2, **{"pretrain.learning_rate": 0.0})
  config.model.attention = {"kind": "band", "window": 4}   # phase 2 compiles as the run above
  results = phases.run(configs.common.apply_protocol(config), str(tmp_path / "run"))
  assert len(results["phases"]) == 2
  encoder = results["state"]["params"]["encoder"]
  np.testing.assert_array_equal(
      np.asarray(encoder["blocks"][0]["mlp"]["fc1"]["kernel"]),
      np.asarray(source.blocks[0].mlp.fc1.kernel.get_value()))


def test_a_task_model_takes_the_checkpoints_whole_architecture(tmp_path):
  """`init_from_hf`'s settings: BigBird's rescaled embeddings included, the run's attention."""
  folder = _copy(tmp_path, "bigbird_full")
  _edit_config(folder, rescale_embeddings=True)
  cfg = {"vocab_size": 50, "max_length": 300, "attention": {"kind": "band", "window": 8},
         "emb_dim": 128, "norm": "pre", "embed_scale": 1.0}
  out = pretrained.task_settings(str(folder), cfg)
  assert out["embed_scale"] == pytest.approx(32 ** 0.5)
  assert (out["emb_dim"], out["norm"], out["attention"]["kind"]) == (32, "post", "band")
