"""Checks of the Hugging Face reference fixtures in tests/fixtures/hf (no torch, no transformers).

`benchmarks/hf_fixtures.py` writes one folder per architecture: `config.json` and
`model.safetensors` exactly as `save_pretrained` wrote them, and `reference.npz` with the inputs
and Hugging Face's outputs. The importer's tests trust these files, so this checks that every
folder is complete, that every tensor's shape follows from config.json (hidden size, vocab,
layers, heads, FFN width, position table), that the reference arrays have the shapes the inputs
and config imply, and that the folder stays small enough to live in the repository.
"""

import json
import math
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
  assert not np.array_equal(ref["beam_tokens"], ref["greedy_tokens"])
  assert not np.array_equal(ref["beam_tokens"][0], ref["beam_tokens"][1])


def test_led_generation_ends_both_ways():
  """LED's rows stop once by a generated EOS (then pad) and once by the forced EOS at the end."""
  config, _, ref = _load("led")
  eos, pad = config["eos_token_id"], config["pad_token_id"]
  for key in ("greedy_tokens", "beam_tokens"):
    ends = [int(np.flatnonzero(row[1:] == eos)[0]) + 1 for row in ref[key]]
    n = ref[key].shape[1]
    assert sorted(e == n - 1 for e in ends) == [False, True], (key, ends)
    for row, end in zip(ref[key], ends):
      assert (row[end + 1:] == pad).all()


# An independent reference: Hugging Face's forward passes written again in float64 NumPy from the
# equations in their modeling files, read straight from model.safetensors. Matching reference.npz
# shows the fixtures hold what the docs say HF computes (and gives the importer a plain model of
# each quirk: RoBERTa's position offset, Longformer's global rows, BigBird's eval-time random
# blocks). Dense masks stand in for the banded and blocked kernels.

def _load64(name):
  config, tensors, ref = _load(name)
  return config, {k: v.astype(np.float64) for k, v in tensors.items()}, ref


_ERF = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x, act):
  if act == "gelu":
    return 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0)))
  assert act == "gelu_new", act
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _layer_norm(x, w, b, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * w + b


def _linear(t, name, x):
  out = x @ t[name + ".weight"].T
  if name + ".bias" in t:
    out = out + t[name + ".bias"]
  return out


def _heads(x, h):
  b, n, d = x.shape
  return x.reshape(b, n, h, d // h).transpose(0, 2, 1, 3)


def _attend(q, k, v, allowed, log_count=None):
  """softmax(q k^T / sqrt(dh) + log count) v over allowed keys; rows with none allowed give 0.

  `allowed` is [B, 1 or H, Lq, Lk]; `log_count` adds log(multiplicity) for keys that a
  gathered kernel visits more than once (BigBird's eval random blocks)."""
  s = q @ k.transpose(0, 1, 3, 2)
  s *= 1.0 / math.sqrt(q.shape[-1])
  if log_count is not None:
    s += log_count
  s[~np.broadcast_to(allowed, s.shape)] = -np.inf
  m = np.max(s, -1, keepdims=True)
  m[~np.isfinite(m)] = 0.0
  s -= m
  np.exp(s, out=s)
  out = (s @ v) / np.maximum(s.sum(-1, keepdims=True), 1e-300)
  b, h, n, dh = out.shape
  return out.transpose(0, 2, 1, 3).reshape(b, n, h * dh)


def _bert_layer(t, pre, x, config, attention):
  eps = config["layer_norm_eps"]
  ctx = attention(x)
  x = _layer_norm(x + _linear(t, pre + "attention.output.dense", ctx),
                  t[pre + "attention.output.LayerNorm.weight"],
                  t[pre + "attention.output.LayerNorm.bias"], eps)
  hid = _gelu(_linear(t, pre + "intermediate.dense", x), config["hidden_act"])
  return _layer_norm(x + _linear(t, pre + "output.dense", hid),
                     t[pre + "output.LayerNorm.weight"], t[pre + "output.LayerNorm.bias"], eps)


def _qkv(t, pre, x, h, suffix=""):
  return [_heads(_linear(t, f"{pre}attention.self.{n}{suffix}", x), h)
          for n in ("query", "key", "value")]


def _embed(t, prefix, ids, positions, types, eps):
  e = t[prefix + "embeddings.word_embeddings.weight"][ids]
  e = e + t[prefix + "embeddings.position_embeddings.weight"][positions]
  e = e + t[prefix + "embeddings.token_type_embeddings.weight"][types]
  return _layer_norm(e, t[prefix + "embeddings.LayerNorm.weight"],
                     t[prefix + "embeddings.LayerNorm.bias"], eps)


def _roberta_positions(ids, pad):
  """RobertaEmbeddings.create_position_ids_from_input_ids: pad + cumsum over non-pad tokens."""
  real = (ids != pad).astype(np.int64)
  return np.cumsum(real, 1) * real + pad


def _mlm_head(t, x, config, kind):
  if kind in ("roberta", "longformer"):
    dense, norm, bias = "lm_head.dense", "lm_head.layer_norm", "lm_head.bias"
    act = "gelu"                                      # RobertaLMHead calls gelu() itself
    emb = f"{kind}.embeddings.word_embeddings.weight"
  else:
    dense = "cls.predictions.transform.dense"
    norm, bias = "cls.predictions.transform.LayerNorm", "cls.predictions.bias"
    act, emb = config["hidden_act"], "bert.embeddings.word_embeddings.weight"
  y = _gelu(_linear(t, dense, x), act)
  y = _layer_norm(y, t[norm + ".weight"], t[norm + ".bias"], config["layer_norm_eps"])
  return y @ t[emb].T + t[bias]


def _dense_encoder(t, config, prefix, ids, mask, positions, types):
  h, eps = config["num_attention_heads"], config["layer_norm_eps"]
  x = _embed(t, prefix, ids, positions, types, eps)
  allowed = mask.astype(bool)[:, None, None, :]
  states = [x]
  for i in range(config["num_hidden_layers"]):
    pre = f"{prefix}encoder.layer.{i}."
    x = _bert_layer(t, pre, x, config, lambda y, pre=pre: _attend(*_qkv(t, pre, y, h), allowed))
    states.append(x)
  return x, states


def _close(ours, theirs, tol=2e-4):
  err = np.max(np.abs(ours - theirs))
  assert err < tol * max(1.0, np.max(np.abs(theirs))), err


@pytest.mark.parametrize("name", ["roberta", "bert"])
def test_numpy_reference_bert_family(name):
  config, t, ref = _load64(name)
  ids, mask = ref["input_ids"], ref["attention_mask"]
  if name == "roberta":
    positions = _roberta_positions(ids, config["pad_token_id"])
    types = np.zeros_like(ids)
  else:
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    types = ref["token_type_ids"]
  x, states = _dense_encoder(t, config, name + ".", ids, mask, positions, types)
  _close(x, ref["last_hidden_state"])
  _close(np.stack(states), ref["hidden_states"])
  _close(_mlm_head(t, x, config, name), ref["logits"])


def _longformer_attention(t, pre, x, h, w, mask, glob):
  """LongformerSelfAttention as dense masks. x: [B, L, D] (L already padded by HF's rule).

  Local rows: keys |i - j| <= w that are neither padding nor global, plus every global key, all
  with the ordinary query/key/value projections. Global rows: every non-padding key with
  query_global/key_global/value_global. Padding rows: zero."""
  n = x.shape[1]
  pad = ~mask.astype(bool)
  band = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :]) <= w
  local = (band[None] & ~glob[:, None, :]) | glob[:, None, :]
  local = (local & ~pad[:, None, :])[:, None]
  out = _attend(*[_heads(_linear(t, pre + p, x), h) for p in ("query", "key", "value")], local)
  rows = np.flatnonzero(glob.any(0))                 # positions global in some batch row
  if rows.size:
    qg, kg, vg = [_heads(_linear(t, pre + p + "_global", x), h)
                  for p in ("query", "key", "value")]
    full = np.broadcast_to(~pad[:, None, None, :], (x.shape[0], 1, rows.size, n))
    out[:, rows] = np.where(glob[:, rows, None], _attend(qg[:, :, rows], kg, vg, full),
                            out[:, rows])
  return np.where(pad[:, :, None], 0.0, out)


def _pad_to(arrays, multiple, values):
  n = arrays[0].shape[1]
  extra = (-n) % multiple
  return [np.pad(a, ((0, 0), (0, extra)), constant_values=v) for a, v in zip(arrays, values)]


def test_numpy_reference_longformer():
  config, t, ref = _load64("longformer")
  n = ref["input_ids"].shape[1]
  h, pad_id = config["num_attention_heads"], config["pad_token_id"]
  ids, mask, glob = _pad_to([ref["input_ids"], ref["attention_mask"],
                             ref["global_attention_mask"]],
                            max(config["attention_window"]), [pad_id, 0, 0])
  pos = ref["logits_positions"]
  for glob_case, suffix in ((glob.astype(bool), ""), (np.zeros_like(glob, bool), "_noglobal")):
    x = _embed(t, "longformer.", ids, _roberta_positions(ids, pad_id), np.zeros_like(ids),
               config["layer_norm_eps"])
    states = [x]
    for i, window in enumerate(config["attention_window"]):
      pre = f"longformer.encoder.layer.{i}."
      x = _bert_layer(t, pre, x, config, lambda y, pre=pre, w=window // 2: _longformer_attention(
        t, pre + "attention.self.", y, h, w, mask, glob_case))
      states.append(x)
    _close(x[:, :n], ref["last_hidden_state" + suffix])
    _close(_mlm_head(t, x[:, :n], config, "longformer")[:, pos], ref["logits" + suffix])
    if not suffix:
      _close(np.stack(states)[:, :, :n], ref["hidden_states"])


def _bigbird_log_count(nb, bs, rand, heads):
  """log(how often each key block is visited) per (head, query block), BigBird block sparse.

  Query blocks 0 and nb-1 see every key once. Block 1 sees key blocks 0, 1, 2, nb-1 and its
  random blocks rand[h, 0]; block nb-2 sees 0, nb-3, nb-2, nb-1 and rand[h, -1]; middle block q
  sees 0, q-1, q, q+1, nb-1 and rand[h, q-1]. A block listed twice (in eval all random blocks are
  block 0) counts twice in the softmax."""
  count = np.zeros((heads, nb, nb))
  count[:, 0, :] = count[:, nb - 1, :] = 1
  for h in range(heads):
    for q in range(1, nb - 1):
      fixed = {1: [0, 1, 2, nb - 1], nb - 2: [0, nb - 3, nb - 2, nb - 1]}.get(
        q, [0, q - 1, q, q + 1, nb - 1])
      for k in list(fixed) + list(rand[h, q - 1]):
        count[h, q, k] += 1
  count = np.repeat(np.repeat(count, bs, 1), bs, 2)
  with np.errstate(divide="ignore"):
    return np.log(count)[None]


@pytest.mark.parametrize("name", ["bigbird", "bigbird_full"])
def test_numpy_reference_bigbird(name):
  config, t, ref = _load64(name)
  n = ref["input_ids"].shape[1]
  h = config["num_attention_heads"]
  ids, mask = ref["input_ids"], ref["attention_mask"]
  sparse = config["attention_type"] == "block_sparse"
  if sparse:
    ids, mask = _pad_to([ids, mask], config["block_size"], [config["pad_token_id"], 0])
  m = ids.shape[1]
  x = _embed(t, "bert.", ids, np.broadcast_to(np.arange(m), ids.shape), np.zeros_like(ids),
             config["layer_norm_eps"])
  real = mask.astype(bool)
  for i in range(config["num_hidden_layers"]):
    pre = f"bert.encoder.layer.{i}."
    if sparse:
      log_count = _bigbird_log_count(m // config["block_size"], config["block_size"],
                                     ref["rand_attn"][i], h)
      allowed = np.isfinite(log_count) & real[:, None, None, :]

      def attention(y, pre=pre, allowed=allowed, log_count=log_count):
        out = _attend(*_qkv(t, pre, y, h), allowed, np.where(allowed, log_count, 0.0))
        return np.where(real[:, :, None], out, 0.0)   # context * from_mask
    else:
      def attention(y, pre=pre):
        return _attend(*_qkv(t, pre, y, h), real[:, None, None, :])
    x = _bert_layer(t, pre, x, config, attention)
  _close(x[:, :n], ref["last_hidden_state"])
  logits = _mlm_head(t, x[:, :n], config, "bigbird")
  _close(logits[:, ref["logits_positions"]], ref["logits"])


def _seq2seq_prefix(name):
  return "model." if name == "bart" else "led."


def _bart_attention(t, pre, xq, xkv, h, allowed, kv=None):
  """BartAttention: q/k/v/out projections with biases, scores scaled by head_dim^-0.5.
  `kv` = precomputed (k, v) heads for cross-attention over a fixed encoder output."""
  k, v = kv if kv is not None else [_heads(_linear(t, pre + p, xkv), h) for p in ("k_proj",
                                                                                  "v_proj")]
  q = _heads(_linear(t, pre + "q_proj", xq), h)
  return _linear(t, pre + "out_proj", _attend(q, k, v, allowed))


def _ffn_block(t, pre, x, config, side):
  hid = _gelu(_linear(t, pre + "fc1", x), config["activation_function"])
  return _layer_norm(x + _linear(t, pre + "fc2", hid), t[pre + "final_layer_norm.weight"],
                     t[pre + "final_layer_norm.bias"], 1e-5)


def _seq2seq_embed(t, config, name, side, ids):
  """Token embedding (x sqrt(d) with BART's scale_embedding) + learned positions (offset 2 in
  BART, none in LED), then layernorm_embedding (eps 1e-5)."""
  p = _seq2seq_prefix(name)
  scale = math.sqrt(config["d_model"]) if config.get("scale_embedding") else 1.0
  offset = 2 if name == "bart" else 0
  x = t[p + "shared.weight"][ids] * scale
  x = x + t[f"{p}{side}.embed_positions.weight"][np.arange(ids.shape[1]) + offset]
  return _layer_norm(x, t[f"{p}{side}.layernorm_embedding.weight"],
                     t[f"{p}{side}.layernorm_embedding.bias"], 1e-5)


def _seq2seq_encode(t, config, name, ids, mask, glob=None):
  p, h = _seq2seq_prefix(name), config["encoder_attention_heads"]
  n = ids.shape[1]
  if name == "led":
    ids, mask, glob = _pad_to([ids, mask, glob], max(config["attention_window"]),
                              [config["pad_token_id"], 0, 0])
  x = _seq2seq_embed(t, config, name, "encoder", ids)
  states = [x]
  for i in range(config["encoder_layers"]):
    pre = f"{p}encoder.layers.{i}."
    if name == "bart":
      a = _bart_attention(t, pre + "self_attn.", x, x, h, mask.astype(bool)[:, None, None, :])
    else:
      w = config["attention_window"][i] // 2
      a = _linear(t, pre + "self_attn.output", _longformer_attention(
        t, pre + "self_attn.longformer_self_attn.", x, h, w, mask, glob.astype(bool)))
    x = _layer_norm(x + a, t[pre + "self_attn_layer_norm.weight"],
                    t[pre + "self_attn_layer_norm.bias"], 1e-5)
    x = _ffn_block(t, pre, x, config, "encoder")
    states.append(x)
  return x[:, :n], [s[:, :n] for s in states]


def _cross_kv(t, config, name, enc):
  p, h = _seq2seq_prefix(name), config["decoder_attention_heads"]
  return [[_heads(_linear(t, f"{p}decoder.layers.{i}.encoder_attn.{n}", enc), h)
           for n in ("k_proj", "v_proj")] for i in range(config["decoder_layers"])]


def _seq2seq_decode(t, config, name, enc, enc_mask, dec_ids, dec_mask=None, cross_kv=None):
  """Decoder states and logits (no cache: every call runs the whole prefix)."""
  p, h = _seq2seq_prefix(name), config["decoder_attention_heads"]
  steps = dec_ids.shape[1]
  if dec_mask is None:
    dec_mask = np.ones_like(dec_ids)
  y = _seq2seq_embed(t, config, name, "decoder", dec_ids)
  causal = np.tril(np.ones((steps, steps), bool))[None, None] & dec_mask.astype(bool)[:, None, None]
  cross = enc_mask.astype(bool)[:, None, None, :]
  states = [y]
  for i in range(config["decoder_layers"]):
    pre = f"{p}decoder.layers.{i}."
    y = _layer_norm(y + _bart_attention(t, pre + "self_attn.", y, y, h, causal),
                    t[pre + "self_attn_layer_norm.weight"], t[pre + "self_attn_layer_norm.bias"],
                    1e-5)
    kv = None if cross_kv is None else cross_kv[i]
    y = _layer_norm(y + _bart_attention(t, pre + "encoder_attn.", y, enc, h, cross, kv),
                    t[pre + "encoder_attn_layer_norm.weight"],
                    t[pre + "encoder_attn_layer_norm.bias"], 1e-5)
    y = _ffn_block(t, pre, y, config, "decoder")
    states.append(y)
  logits = y @ t[p + "shared.weight"].T + t["final_logits_bias"]
  return y, states, logits


def _force(scores, cur_len, max_length, gen):
  """ForcedBOSTokenLogitsProcessor at length 1, ForcedEOSTokenLogitsProcessor at max_length-1."""
  forced = {1: gen["forced_bos_token_id"], max_length - 1: gen["forced_eos_token_id"]}
  if cur_len in forced and forced[cur_len] is not None:
    scores = np.full_like(scores, -np.inf)
    scores[..., forced[cur_len]] = 0.0
  return scores


def _greedy(step_logits, batch, gen):
  max_length = 1 + gen["max_new_tokens"]
  seqs = np.full((batch, 1), gen["decoder_start_token_id"])
  done = np.zeros(batch, bool)
  while seqs.shape[1] < max_length and not done.all():
    scores = _force(step_logits(seqs, np.arange(batch)), seqs.shape[1], max_length, gen)
    tok = np.where(done, gen["pad_token_id"], np.argmax(scores, -1))
    seqs = np.concatenate([seqs, tok[:, None]], 1)
    done |= tok == gen["eos_token_id"]
  return seqs


def _log_softmax(x):
  m = np.max(x, -1, keepdims=True)
  return x - m - np.log(np.sum(np.exp(x - m), -1, keepdims=True))


def _beam_row(step_logits, row, gen):
  """generation/utils.py::_beam_search for one batch row (rows are independent)."""
  nb, lp = gen["num_beams"], gen["length_penalty"]
  eos, max_length = gen["eos_token_id"], 1 + gen["max_new_tokens"]
  k = max(2, 2) * nb                                       # (1 + number of eos ids) * num_beams
  running = [[gen["decoder_start_token_id"]]] * nb
  run_scores = np.array([0.0] + [-1e9] * (nb - 1))
  fin = [(-1e9, None, False)] * nb                           # (score, sequence, finished)
  open_row = True
  while len(running[0]) < max_length:
    cur_len = len(running[0])
    logp = _log_softmax(step_logits(np.array(running), np.full(nb, row)))
    acc = (_force(logp, cur_len, max_length, gen) + run_scores[:, None]).reshape(-1)
    top = np.argsort(-acc, kind="stable")[:k]
    vocab = logp.shape[-1]
    cands = [(acc[i], running[i // vocab] + [int(i % vocab)]) for i in top]
    hits = [s[-1] == eos or len(s) >= max_length for _, s in cands]
    order = sorted(range(k), key=lambda j: -(cands[j][0] - 1e9 * hits[j]))[:nb]
    running = [cands[j][1] for j in order]
    run_scores = np.array([cands[j][0] - 1e9 * hits[j] for j in order])
    full = all(f for _, _, f in fin) and gen["early_stopping"] is True
    new = [(s / (cur_len + 1 - 1) ** lp, seq, True) for j, (s, seq) in enumerate(cands)
           if j < nb and hits[j] and open_row and not full]
    fin = sorted(fin + new, key=lambda f: -f[0])[:nb]
    if all(f for _, _, f in fin):                          # _check_early_stop_heuristic
      best = run_scores[0] / (cur_len + 1 - 1) ** lp
      open_row = open_row and best > min(s for s, _, _ in fin)
  return fin[0][1]


@pytest.mark.parametrize("name", ["bart", "led"])
def test_numpy_reference_seq2seq(name):
  config, t, ref = _load64(name)
  ids, mask = ref["input_ids"], ref["attention_mask"]
  enc, enc_states = _seq2seq_encode(t, config, name, ids, mask, ref.get("global_attention_mask"))
  _close(enc, ref["encoder_last_hidden_state"])
  if "encoder_hidden_states" in ref:
    _close(np.stack(enc_states), ref["encoder_hidden_states"])
  y, states, logits = _seq2seq_decode(t, config, name, enc, mask, ref["decoder_input_ids"],
                                      ref["decoder_attention_mask"])
  _close(y, ref["last_hidden_state"])
  _close(np.stack(states), ref["decoder_hidden_states"])
  _close(logits, ref["logits"])

  cross_kv = _cross_kv(t, config, name, enc)

  def step_logits(seqs, rows):
    kv = [[c[rows] for c in layer] for layer in cross_kv]
    return _seq2seq_decode(t, config, name, enc[rows], mask[rows], seqs, cross_kv=kv)[2][:, -1]

  with open(os.path.join(HF, name, "generation.json")) as f:
    gen = json.load(f)
  np.testing.assert_array_equal(_greedy(step_logits, len(ids), gen["greedy"]),
                                ref["greedy_tokens"])
  beams = [_beam_row(step_logits, row, gen["beam"]) for row in range(len(ids))]
  width = max(len(b) for b in beams)
  beams = np.array([b + [gen["beam"]["pad_token_id"]] * (width - len(b)) for b in beams])
  np.testing.assert_array_equal(beams, ref["beam_tokens"])
