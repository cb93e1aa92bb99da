"""Hugging Face BART and LED checkpoints imported into our LED compute what Hugging Face does.

The fixtures (tests/fixtures/hf/{bart,led}, written by benchmarks/hf_fixtures.py with the pinned
transformers) are tiny random-weight BartForConditionalGeneration and
LEDForConditionalGeneration models with Hugging Face's own outputs on right-padded inputs (LED:
600 tokens, windows of 32, the first token global): the encoder's last hidden state, the
decoder's and the logits under teacher forcing, and the tokens of `generate` with 1 and 4 beams
(forced BOS and EOS, early stopping, length penalty 1; generation.json), which our decoding
matches with and without its key-value cache. Nothing here needs torch
or transformers. Hidden states and logits are compared at real positions within 1e-5 relative
to max(1, |reference|), in float32; tokens exactly.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decoding, pretrained, pretrained_seq2seq

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
TOL = 1e-5
NAMES = ["bart", "led"]
_CACHE: dict[str, tuple] = {}


def _fixture(name):
  path = os.path.join(FIXTURES, name)
  ref = dict(np.load(os.path.join(path, "reference.npz")))
  with open(os.path.join(path, "generation.json")) as f:
    return path, ref, json.load(f)


def _loaded(name):
  """(model, report, reference, generation settings, encoder output, its mask), built once."""
  if name not in _CACHE:
    path, ref, gen = _fixture(name)
    model, report = pretrained.load(path)
    glob = ref.get("global_attention_mask")
    memory, mask = model.encode(jnp.asarray(ref["input_ids"]),
                                key_mask=jnp.asarray(ref["attention_mask"] > 0),
                                global_mask=None if glob is None else jnp.asarray(glob > 0))
    _CACHE[name] = (model, report, ref, gen, memory, mask)
  return _CACHE[name]


def _close(ours, theirs, real, what):
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  diff = np.abs(ours - theirs)[real.astype(bool)]
  scale = max(1.0, float(np.abs(theirs).max()))
  assert diff.max() <= TOL * scale, f"{what}: max difference {diff.max():.3g} (scale {scale:.3g})"


def _decoder(model, memory, mask, ref):
  tokens = jnp.asarray(ref["decoder_input_ids"])
  token_mask = jnp.asarray(ref["decoder_attention_mask"] > 0)
  states = model.decoder_states(memory, mask, tokens, token_mask=token_mask)
  return states, model.decode(memory, mask, tokens, token_mask=token_mask)


@pytest.mark.parametrize("name", NAMES)
def test_encoder_decoder_states_and_logits_equal_hugging_faces(name):
  model, report, ref, _, memory, mask = _loaded(name)
  assert report.architecture == name and report.unused == [] and not report.notes
  assert report.settings["norm"] == "post" and report.settings["decoder_pos_emb"] == "learned"
  real = ref["attention_mask"]
  assert real.min() == 0 and (name == "bart" or ref["global_attention_mask"][:, 0].all())
  _close(memory, ref["encoder_last_hidden_state"], real, "encoder_last_hidden_state")
  states, logits = _decoder(model, memory, mask, ref)
  dec_real = ref["decoder_attention_mask"]
  assert dec_real.min() == 0
  _close(states, ref["last_hidden_state"], dec_real, "decoder last_hidden_state")
  _close(logits, ref["logits"], dec_real, "logits")


def test_leds_global_token_and_bias_matter():
  """Without the global first token LED's encoder output changes; without final_logits_bias
  the logits change: the comparisons above see both."""
  model, _, ref, _, memory, mask = _loaded("led")
  plain, _ = model.encode(jnp.asarray(ref["input_ids"]),
                          key_mask=jnp.asarray(ref["attention_mask"] > 0))
  assert np.abs(np.asarray(plain) - ref["encoder_last_hidden_state"])[:, 0].max() > 1e-3
  bias = model.logits_bias.get_value()
  model.logits_bias.set_value(np.zeros_like(bias))
  try:
    _, logits = _decoder(model, memory, mask, ref)
  finally:
    model.logits_bias.set_value(bias)
  real = ref["decoder_attention_mask"].astype(bool)
  assert np.abs(np.asarray(logits) - ref["logits"])[real].max() > 1e-2


def _hf_tokens(ref_tokens, length, pad):
  """Hugging Face's generated tokens (after the decoder start) padded to `length`."""
  out = np.full((ref_tokens.shape[0], length), pad, np.int64)
  out[:, :ref_tokens.shape[1] - 1] = ref_tokens[:, 1:]
  return out


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_decoding_equals_hugging_faces_generate(name, cache):
  model, _, ref, gen, memory, mask = _loaded(name)
  kw = pretrained_seq2seq.generation(gen["greedy"])
  length = gen["greedy"]["max_new_tokens"]
  tokens = decoding.greedy(model, memory, mask, length=length, cache=cache, **kw)
  want = _hf_tokens(ref["greedy_tokens"], length, kw["hf"].pad_id)
  assert want[:, 0].tolist() == [0, 0] and len(set(want[:, 1:].ravel().tolist())) > 3
  np.testing.assert_array_equal(np.asarray(tokens), want)


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_beam_search_equals_hugging_faces_generate(name, cache):
  model, _, ref, gen, memory, mask = _loaded(name)
  kw = pretrained_seq2seq.generation(gen["beam"])
  length = gen["beam"]["max_new_tokens"]
  tokens, scores = decoding.beam_search(model, memory, mask, length=length,
                                        beam=gen["beam"]["num_beams"], cache=cache, **kw)
  want = _hf_tokens(ref["beam_tokens"], length, kw["hf"].pad_id)
  np.testing.assert_array_equal(np.asarray(tokens), want)
  greedy = _hf_tokens(ref["greedy_tokens"], length, kw["hf"].pad_id)
  assert not np.array_equal(want, greedy)          # the beams find something greedy does not
  # HF's sequences_scores: the sum of the log-probabilities up to EOS (forced tokens 0) over
  # the length (tokens up to EOS) ** length_penalty (1 here).
  full = model.decode(memory, mask, decoding.shift_right(jnp.asarray(want), kw["bos_id"]),
                      token_mask=jnp.ones(want.shape, bool))
  lp = np.take_along_axis(np.asarray(jax.nn.log_softmax(full, axis=-1)), want[..., None],
                          axis=-1)[..., 0]
  lp[:, 0] = lp[:, -1] = 0.0                       # forced BOS and EOS
  ends = np.argmax(want == kw["eos_id"], axis=1) + 1
  expected = [lp[i, :n].sum() / n for i, n in enumerate(ends)]
  np.testing.assert_allclose(np.asarray(scores), expected, atol=1e-4)


# Hugging Face's beam search beyond the fixture's settings, recorded with transformers 5.23 on
# the fixture models: `XForConditionalGeneration.from_pretrained(fixture)`, its
# final_logits_bias[0, 2] (EOS) raised by `eos_bias`, then `generate(input_ids, attention_mask,
# [global_attention_mask], generation_config=GenerationConfig(**generation.json["beam"], with
# the changes), return_dict_in_generate=True, output_scores=True)`: sequences[:, 1:] and
# sequences_scores. (BART's config keeps forced_eos_token_id 2 where the generation config's is
# None.) These cases fail when a finished hypothesis may still join a full finished set with
# early_stopping=True, or when only `beam` candidates (not 2 * beam) are drawn per step. The
# rules do not depend on how the logits come (cached step or whole decoder): without the cache
# these cases are exhaustive, the uncached beams being checked against Hugging Face above.
HF_BEAMS = [
    ("led", 0.0, dict(length_penalty=2.0, early_stopping=True),
     [[0, 83, 83, 64, 64, 64, 2, 1, 1, 1, 1, 1], [0, 83, 83, 64, 64, 64, 96, 23, 23, 23, 23, 2]],
     [-0.2864578664302826, -0.15874646604061127]),
    ("led", 1.5, dict(length_penalty=2.0, early_stopping="never"),
     [[0, 83, 83, 64, 87, 87, 87, 87, 87, 87, 23, 2]] * 2,
     [-0.16652105748653412, -0.16591468453407288]),
    ("bart", 3.5, dict(length_penalty=2.0, early_stopping=False, forced_bos_token_id=None),
     [[44, 44, 44, 44, 44, 44, 2, 1, 1, 1, 1, 1]] * 2,
     [-0.33827564120292664, -0.33991849422454834]),
]


@pytest.mark.parametrize("cache", [True, pytest.param(False, marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("name,eos_bias,changes,want,want_scores", HF_BEAMS)
def test_beam_search_follows_hugging_faces_rules_with_other_settings(name, eos_bias, changes,
                                                                     want, want_scores, cache):
  model, _, _, gen, memory, mask = _loaded(name)
  kw = pretrained_seq2seq.generation({**gen["beam"], **changes})
  bias = model.logits_bias.get_value()
  raised = np.array(bias)
  raised[2] += eos_bias
  model.logits_bias.set_value(jnp.asarray(raised))
  try:
    tokens, scores = decoding.beam_search(model, memory, mask, length=12, beam=4, cache=cache,
                                          **kw)
  finally:
    model.logits_bias.set_value(bias)
  np.testing.assert_array_equal(np.asarray(tokens), want)
  np.testing.assert_allclose(np.asarray(scores), want_scores, atol=1e-5)


def _copy(tmp_path, name):
  dest = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), dest)
  return str(dest)


def _rewrite(path, change):
  from safetensors.numpy import load_file, save_file
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  change(tensors)
  save_file(tensors, file)


@pytest.mark.parametrize("name", NAMES)
def test_a_missing_or_misshapen_tensor_is_one_line_naming_it(tmp_path, name):
  prefix = "model." if name == "bart" else "led."
  gone = f"{prefix}decoder.layers.1.encoder_attn.k_proj.weight"
  path = _copy(tmp_path, name)
  _rewrite(path, lambda t: t.pop(gone))
  with pytest.raises(pretrained.CheckpointError) as e:
    pretrained.load(path)
  assert "\n" not in str(e.value) and repr(gone) in str(e.value) and "missing" in str(e.value)
  path = _copy(tmp_path / "shape", name)
  wrong = f"{prefix}encoder.layers.0.fc1.weight"
  _rewrite(path, lambda t: t.update({wrong: t[wrong][:, :-1].copy()}))
  with pytest.raises(pretrained.CheckpointError) as e:
    pretrained.load(path)
  message = str(e.value)
  assert "\n" not in message and repr(wrong) in message and "(48, 31)" in message


def test_a_config_our_model_cannot_hold_is_refused(tmp_path):
  path = _copy(tmp_path, "bart")
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  config["decoder_ffn_dim"] = 64
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(pretrained.CheckpointError, match="decoder_ffn_dim = 64"):
    pretrained.load(path)


def test_an_untied_output_layer_is_refused(tmp_path):
  path = _copy(tmp_path, "bart")
  _rewrite(path, lambda t: t.update({"lm_head.weight": t["model.shared.weight"] + 1.0}))
  with pytest.raises(pretrained.CheckpointError, match="'lm_head.weight' differs"):
    pretrained.load(path)


def test_a_longer_encoder_copies_the_positions_and_computes_the_same():
  path, ref, _ = _fixture("bart")
  model, report = pretrained.load(path, max_length=150)
  table = np.asarray(model.encoder.positions.table.get_value())
  assert table.shape[0] == 152 and np.array_equal(table[2:66], table[66:130])
  assert report.notes == ["encoder positions: 64 copied to 150"]
  memory, _ = model.encode(jnp.asarray(ref["input_ids"]),
                           key_mask=jnp.asarray(ref["attention_mask"] > 0))
  _close(memory, ref["encoder_last_hidden_state"], ref["attention_mask"], "encoder output")


# Export: our encoder-decoder as a Hugging Face BART or LED checkpoint.


@pytest.mark.parametrize("name", NAMES)
def test_import_then_export_gives_back_every_tensor_and_config_field(tmp_path, name):
  from safetensors.numpy import load_file
  path, _, _ = _fixture(name)
  model, report = pretrained.load(path)
  with open(os.path.join(path, "config.json")) as f:
    like = json.load(f)
  pretrained.export(model, str(tmp_path / "out"), report.architecture, like)
  theirs = load_file(os.path.join(path, "model.safetensors"))
  ours = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert sorted(ours) == sorted(theirs) and len(theirs) == {"bart": 92, "led": 104}[name]
  for key in theirs:
    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
  assert json.loads((tmp_path / "out" / "config.json").read_text()) == like
  # Without `like`, the fields our settings fix are the checkpoint's all the same.
  fixed = pretrained_seq2seq.hf_seq2seq_config(model, name)
  assert fixed == {k: like[k] for k in fixed}


def test_an_exported_led_loads_in_transformers_and_gives_the_fixtures_logits(tmp_path):
  """Our LED written with no config to start from: Hugging Face's own model, with its defaults
  for the token ids, computes the fixture's logits (the reference recorded from the original)."""
  pytest.importorskip("transformers")
  import torch
  from transformers import LEDForConditionalGeneration
  path, ref, _ = _fixture("led")
  model, _ = pretrained.load(path)
  pretrained.export(model, str(tmp_path / "out"), "led")
  hf = LEDForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
  args = {k: torch.as_tensor(ref[k]) for k in ("input_ids", "attention_mask",
                                               "global_attention_mask", "decoder_input_ids",
                                               "decoder_attention_mask")}
  with torch.no_grad():
    logits = hf(**args).logits.numpy()
  _close(logits, ref["logits"], ref["decoder_attention_mask"], "transformers' logits")


def test_a_model_without_a_hugging_face_equivalent_is_refused():
  from flax import nnx

  from models.seq2seq import LED
  path, _, _ = _fixture("led")
  with open(os.path.join(path, "config.json")) as f:
    settings = pretrained_seq2seq.seq2seq_settings(json.load(f))
  cases = [({"norm": "pre"}, "led", "norm='pre'"),
           ({"attention": {"kind": "dot_product"}, "layer_attention": ()}, "led",
            "attention="),
           ({"decoder_pos_emb": "sinusoidal"}, "led", "decoder_pos_emb='sinusoidal'"),
           ({}, "bart", "position_offset=0"),
           ({}, "t5", "must be one of bart, led")]
  for change, architecture, says in cases:
    model = LED({**settings, **change, "max_length": 64}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError) as e:
      pretrained.export(model, "/nonexistent/never-written", architecture)
    assert "\n" not in str(e.value) and says in str(e.value), (change, str(e.value))


# config.init_from_hf for the encoder-decoder task (sort_marked).


def _sort_marked(data_dir, **overrides):
  import configs
  import task_helpers
  settings = dict(max_length=64, min_length=32, num_train=16, num_val=8, num_test=8)
  c = configs.build_config("sort_marked", size="small", overrides=[
      ("data.data_dir", data_dir), *((f"data.{k}", str(v)) for k, v in settings.items())])
  c.batch_size, c.eval_batch_size = 8, 8
  c.num_train_steps, c.warmup_steps = 1, 1
  c.log_every, c.eval_every, c.checkpoint_every = 1, 100, 100
  c.progress = False
  return task_helpers.override(c, overrides)


def _led_with_vocabulary(path, vocab_size):
  """An LED checkpoint with the fixture's architecture and `vocab_size` token ids (our random
  weights, exported): sort_marked's vocabulary is 256 ids, the fixture's 101."""
  from flax import nnx

  from models.seq2seq import LED
  fixture, _, _ = _fixture("led")
  with open(os.path.join(fixture, "config.json")) as f:
    like = json.load(f)
  settings = pretrained_seq2seq.seq2seq_settings(like)
  model = LED({**settings, "vocab_size": vocab_size}, rngs=nnx.Rngs(7))
  pretrained.export(model, path, "led", like)
  return path


def test_the_fixture_cannot_start_sort_marked_its_vocabulary_is_too_small(tmp_path):
  """sort_marked's vocabulary is marked_sort.MAX_VOCAB = 256 ids (the embedding has a row for
  every id the generator may write), the led fixture's 101: the run is refused at once."""
  from lra import train
  path, _, _ = _fixture("led")
  config = _sort_marked(str(tmp_path / "data"), init_from_hf=path)
  with pytest.raises(pretrained.CheckpointError) as e:
    train.model_config(config, _task("sort_marked"))
  assert "\n" not in str(e.value) and "the task has 256 token ids" in str(e.value)
  assert "vocabulary only 101" in str(e.value)


def _task(name):
  from lra.tasks import get_task
  return get_task(name)


def test_task_and_checkpoint_kinds_that_do_not_fit_are_one_line_errors(tmp_path):
  from lra import schema, train
  led = _led_with_vocabulary(str(tmp_path / "led256"), 256)
  roberta = os.path.join(FIXTURES, "roberta")
  config = _sort_marked(str(tmp_path / "data"), init_from_hf=roberta)
  with pytest.raises(pretrained.CheckpointError, match="a roberta checkpoint, but this task's "
                     "model is an encoder-decoder: give a bart or led checkpoint"):
    train.model_config(config, _task("sort_marked"))
  import length_extension_test as tiny_runs
  config = tiny_runs.tiny(str(tmp_path / "data"), 100, init_from_hf=led)
  with pytest.raises(pretrained.CheckpointError, match="a led checkpoint, but this task's "
                     "model is an encoder: give a bert or roberta"):
    train.model_config(config, _task("listops"))
  config = _sort_marked(str(tmp_path / "data"), init_from_hf=led)
  config.model.target_length = 65
  with pytest.raises(pretrained.CheckpointError, match="target_length = 65, the checkpoint's "
                     "decoder has only 64 positions"):
    train.model_config(config, _task("sort_marked"))
  for name in NAMES:   # lra.schema reads the folder's config.json: bart and led pass
    schema._check_init_from_hf(_sort_marked(str(tmp_path / "data"),
                                            init_from_hf=os.path.join(FIXTURES, name)))


@pytest.mark.slow
def test_a_sort_marked_run_starts_from_an_led_checkpoint(tmp_path, capsys):
  """`config.init_from_hf` with an LED checkpoint: the whole encoder-decoder has its
  architecture and weights (encoder positions cut to the run's 64, decoder's all 64), the run's
  band attention with the first token global; with a zero learning rate the trained model is
  still the checkpoint's, every parameter."""
  from lra import train
  path = _led_with_vocabulary(str(tmp_path / "led256"), 256)
  source, _ = pretrained.load(path)
  config = _sort_marked(str(tmp_path / "data"), init_from_hf=path, learning_rate=0.0)
  cfg = train.model_config(config, _task("sort_marked"))
  assert (cfg["emb_dim"], cfg["num_layers"], cfg["decoder_layers"], cfg["target_length"],
          cfg["max_length"], cfg["num_global"]) == (32, 2, 2, 64, 64, 1)
  assert cfg["attention"] == {**config.model.attention.to_dict()} and cfg["pos_emb"] == "learned"
  results = train.train_and_evaluate(config, str(tmp_path / "run"))
  out = capsys.readouterr().out
  assert "Initialised the model from the led checkpoint" in out and "64 copied to 64" not in out
  from flax import nnx
  want = nnx.to_pure_dict(nnx.state(source, nnx.Param))
  got = results["state"]["params"]
  flat = lambda tree: {jax.tree_util.keystr(k).removesuffix(".value"): np.asarray(v)
                       for k, v in jax.tree_util.tree_leaves_with_path(tree)}
  flat_want, flat_got = flat(want), flat(got)
  assert sorted(flat_got) == sorted(flat_want) and len(flat_want) > 100
  for key, value in flat_want.items():
    if key == "['encoder']['positions']['table']":
      assert value.shape[0] == 1024
      value = value[:64]                          # the run's 64 of the checkpoint's 1,024
    np.testing.assert_array_equal(flat_got[key], value, err_msg=key)
  assert np.isfinite(results["test_loss"])


# LED's recipe: BART's positions copied 4 times, band attention with the first token global.


def test_bart_becomes_a_band_encoder_with_a_global_first_token_at_4x_its_positions():
  """The bart fixture (64 positions) loaded with max_length 256, band attention and LED's global
  first token: the positions are BART's copied 4 times; on the fixture's inputs (24 tokens)
  with a window covering them it computes the dense original's encoder output, logits and
  greedy tokens (Hugging Face's); on 256 tokens it decodes (greedy), and there a narrower
  window and the global token change the encoder output."""
  path, ref, gen = _fixture("bart")
  model, report = pretrained.load(path, max_length=256, num_global=1,
                                  attention={"kind": "band", "window": 24})
  assert report.unused == [] and report.notes == ["encoder positions: 64 copied to 256"]
  table = np.asarray(model.encoder.positions.table.get_value())
  assert table.shape == (258, 32)
  for k in range(4):
    np.testing.assert_array_equal(table[2 + 64 * k:66 + 64 * k], table[2:66])
  assert type(model.encoder.blocks[0].attention).__name__ == "GlobalBandAttention"
  memory, mask = model.encode(jnp.asarray(ref["input_ids"]),
                              key_mask=jnp.asarray(ref["attention_mask"] > 0))
  _close(memory, ref["encoder_last_hidden_state"], ref["attention_mask"], "band encoder")
  _, logits = _decoder(model, memory, mask, ref)
  _close(logits, ref["logits"], ref["decoder_attention_mask"], "logits")
  kw = pretrained_seq2seq.generation(gen["greedy"])
  length = gen["greedy"]["max_new_tokens"]
  tokens = decoding.greedy(model, memory, mask, length=length, **kw)
  np.testing.assert_array_equal(np.asarray(tokens),
                                _hf_tokens(ref["greedy_tokens"], length, kw["hf"].pad_id))
  # 256 tokens: BART's 64 positions could not hold them; the band model decodes them.
  ids = jnp.asarray(np.random.default_rng(0).integers(3, 101, (2, 256)))
  long_memory, long_mask = model.encode(ids)
  assert long_memory.shape == (2, 256, 32) and np.isfinite(np.asarray(long_memory)).all()
  out = np.asarray(decoding.greedy(model, long_memory, long_mask, length=length, **kw))
  assert out.shape == (2, length) and out[:, 0].tolist() == [0, 0]   # forced BOS
  outputs = {}
  for glob in (0, 1):
    narrow, _ = pretrained.load(path, max_length=256, num_global=glob,
                                attention={"kind": "band", "window": 8})
    outputs[glob] = np.asarray(narrow.encode(ids)[0])
  assert np.abs(outputs[1] - np.asarray(long_memory)).max() > 1e-3    # the window matters
  assert np.abs(outputs[1] - outputs[0])[:, 0].max() > 1e-3           # so does the global token
