"""Checks of the Hugging Face reference fixtures in tests/fixtures/hf (no torch, no transformers).

`benchmarks/hf_fixtures.py` writes one folder per architecture: `config.json` and
`model.safetensors` exactly as `save_pretrained` wrote them, and `reference.npz` with the inputs
and Hugging Face's outputs. The importer's tests trust these files, so this checks that every
folder is complete, that every tensor's shape follows from config.json (hidden size, vocab,
layers, heads, FFN width, position table), that the reference arrays have the shapes the inputs
and config imply, and that the folder stays small enough to live in the repository.
"""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
FOLDERS = ["roberta", "bert", "longformer", "bart", "led", "bigbird", "bigbird_full"]
ENCODERS = {"roberta": "roberta", "bert": "bert", "longformer": "longformer", "bigbird": "bert",
            "bigbird_full": "bert"}
MAX_BYTES = 4 * 1024 * 1024


def _load(name):
  folder = os.path.join(HF, name)
  with open(os.path.join(folder, "config.json")) as f:
    config = json.load(f)
  tensors = load_file(os.path.join(folder, "model.safetensors"))
  with np.load(os.path.join(folder, "reference.npz")) as npz:
    ref = {k: npz[k] for k in npz.files}
  return config, tensors, ref


def _layer_indices(tensors, marker):
  """The set of layer numbers n in tensor names containing `marker` + 'n.'."""
  found = set()
  for name in tensors:
    if marker in name:
      found.add(int(name.split(marker, 1)[1].split(".", 1)[0]))
  return found


@pytest.mark.parametrize("name", FOLDERS)
def test_folder_complete(name):
  files = set(os.listdir(os.path.join(HF, name)))
  assert {"config.json", "model.safetensors", "reference.npz"} <= files
  if name in ("bart", "led"):
    assert "generation.json" in files


def test_total_size_small():
  total = sum(os.path.getsize(os.path.join(root, f))
              for root, _, files in os.walk(HF) for f in files)
  assert total < MAX_BYTES, total


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_encoder_shapes(name):
  config, tensors, ref = _load(name)
  prefix = ENCODERS[name]
  d, v, n = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
  ffn = config["intermediate_size"]
  emb = f"{prefix}.embeddings."
  assert tensors[emb + "word_embeddings.weight"].shape == (v, d)
  assert tensors[emb + "position_embeddings.weight"].shape == (config["max_position_embeddings"], d)
  assert tensors[emb + "token_type_embeddings.weight"].shape == (config["type_vocab_size"], d)
  assert _layer_indices(tensors, f"{prefix}.encoder.layer.") == set(range(n))
  for i in range(n):
    layer = f"{prefix}.encoder.layer.{i}."
    for proj in ("query", "key", "value"):
      assert tensors[layer + f"attention.self.{proj}.weight"].shape == (d, d)
      assert tensors[layer + f"attention.self.{proj}.bias"].shape == (d,)
    assert tensors[layer + "intermediate.dense.weight"].shape == (ffn, d)
    assert tensors[layer + "output.dense.weight"].shape == (d, ffn)
    if name == "longformer":
      assert tensors[layer + "attention.self.query_global.weight"].shape == (d, d)
  head_bias = "lm_head.bias" if prefix in ("roberta", "longformer") else "cls.predictions.bias"
  assert tensors[head_bias].shape == (v,)
  ids = ref["input_ids"]
  b, length = ids.shape
  assert ref["attention_mask"].shape == (b, length)
  assert ids.max() < v and ids.min() >= 0
  assert ref["last_hidden_state"].shape == (b, length, d)
  assert ref["last_hidden_state"].dtype == np.float32
  positions = ref.get("logits_positions", np.arange(length))
  assert ref["logits"].shape == (b, len(positions), v)
  assert positions.max() < length
  if "hidden_states" in ref:
    assert ref["hidden_states"].shape == (n + 1, b, length, d)
    np.testing.assert_array_equal(ref["hidden_states"][-1], ref["last_hidden_state"])
  assert np.all(np.isfinite(ref["logits"]))


def test_roberta_positions_fit_offset():
  config, _, ref = _load("roberta")
  # RoBERTa positions start at padding_idx + 1 = 2: the longest row must fit the table.
  assert ref["attention_mask"].sum(1).max() + config["pad_token_id"] < config[
    "max_position_embeddings"]
  assert (ref["input_ids"][ref["attention_mask"] == 0] == config["pad_token_id"]).all()


def test_longformer_global_cases():
  config, _, ref = _load("longformer")
  length = ref["input_ids"].shape[1]
  assert length % (2 * max(config["attention_window"]) // 2) != 0   # HF pads internally
  assert ref["global_attention_mask"].sum(1).tolist() == [3, 1]
  assert ref["last_hidden_state_noglobal"].shape == ref["last_hidden_state"].shape
  assert ref["logits_noglobal"].shape == ref["logits"].shape
  assert not np.allclose(ref["last_hidden_state_noglobal"], ref["last_hidden_state"])


def test_bigbird_block_sparse_case():
  config, _, ref = _load("bigbird")
  _, full_tensors, full_ref = _load("bigbird_full")
  length = ref["input_ids"].shape[1]
  assert config["attention_type"] == "block_sparse"
  # HF falls back to full attention when length <= (5 + 2 r) * block_size.
  assert length > (5 + 2 * config["num_random_blocks"]) * config["block_size"]
  blocks = -(-length // config["block_size"])
  assert ref["rand_attn"].shape == (config["num_hidden_layers"], config["num_attention_heads"],
                                    blocks - 2, config["num_random_blocks"])
  np.testing.assert_array_equal(ref["input_ids"], full_ref["input_ids"])
  assert not np.allclose(ref["last_hidden_state"], full_ref["last_hidden_state"])
  _, tensors, _ = _load("bigbird")
  assert sorted(tensors) == sorted(full_tensors)


@pytest.mark.parametrize("name", ["bart", "led"])
def test_seq2seq_shapes(name):
  config, tensors, ref = _load(name)
  d, v, ffn = config["d_model"], config["vocab_size"], config["encoder_ffn_dim"]
  prefix = "model" if name == "bart" else "led"
  assert tensors[f"{prefix}.shared.weight"].shape == (v, d)
  assert tensors["final_logits_bias"].shape == (1, v)
  offset = 2 if name == "bart" else 0          # BartLearnedPositionalEmbedding's offset
  if name == "bart":
    enc_pos = dec_pos = config["max_position_embeddings"]
  else:
    enc_pos = config["max_encoder_position_embeddings"]
    dec_pos = config["max_decoder_position_embeddings"]
  assert tensors[f"{prefix}.encoder.embed_positions.weight"].shape == (enc_pos + offset, d)
  assert tensors[f"{prefix}.decoder.embed_positions.weight"].shape == (dec_pos + offset, d)
  for side, n in (("encoder", config["encoder_layers"]), ("decoder", config["decoder_layers"])):
    assert _layer_indices(tensors, f"{prefix}.{side}.layers.") == set(range(n))
    for i in range(n):
      layer = f"{prefix}.{side}.layers.{i}."
      assert tensors[layer + "fc1.weight"].shape == (ffn, d)
      assert tensors[layer + "fc2.weight"].shape == (d, ffn)
  b, enc_len = ref["input_ids"].shape
  dec_len = ref["decoder_input_ids"].shape[1]
  assert ref["encoder_last_hidden_state"].shape == (b, enc_len, d)
  assert ref["last_hidden_state"].shape == (b, dec_len, d)
  assert ref["logits"].shape == (b, dec_len, v)
  with open(os.path.join(HF, name, "generation.json")) as f:
    gen = json.load(f)
  new = gen["greedy"]["max_new_tokens"]
  assert gen["beam"]["num_beams"] == 4 and gen["greedy"]["num_beams"] == 1
  for key in ("greedy_tokens", "beam_tokens"):
    tokens = ref[key]
    assert tokens.shape[0] == b and 2 <= tokens.shape[1] <= new + 1
    assert (tokens[:, 0] == config["decoder_start_token_id"]).all()
    assert (tokens[:, 1] == gen["greedy"]["forced_bos_token_id"]).all()
  # Not a trivial model: greedy output runs past the forced BOS without stopping at once.
  assert (ref["greedy_tokens"][:, 2] != config["eos_token_id"]).all()
