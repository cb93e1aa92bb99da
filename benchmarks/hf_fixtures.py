"""Reference fixtures for importing Hugging Face checkpoints: tiny random models and their outputs.

`models.pretrained.load(path)` reads a Hugging Face checkpoint folder (`config.json` +
`model.safetensors`) into our own models. Its tests must not need torch or transformers, so this
script builds, once, one tiny randomly initialised model per supported architecture with the
pinned transformers (`bench` extra in setup.py), saves it with `save_pretrained` exactly as a real
checkpoint is saved (nothing stripped or renamed), and records Hugging Face's own outputs for fixed
inputs in `reference.npz` (float32, `model.eval()`, so no dropout):

  roberta/     RobertaForMaskedLM, right-padded batch; hidden states of every layer, MLM logits
  bert/        BertForMaskedLM, with token_type_ids (0 then 1)
  longformer/  LongformerForMaskedLM, attention_window [32, 64], length 1000 (not a multiple of
               64, so HF pads internally), global tokens; and the same inputs without any global
  bart/        BartForConditionalGeneration: encoder/decoder states, logits, greedy and beam tokens
  led/         LEDForConditionalGeneration, ~600 encoder tokens, global attention on token 0
  bigbird/     BigBirdForMaskedLM, block_sparse (long enough not to fall back to full attention)
               with the random-block indices HF used (in eval: all block 0)
  bigbird_full/  the same weights and inputs run as original_full

Generation settings are all set explicitly (never the config's defaults) and written to
`generation.json` in the folder. Weights are not HF's init (std 0.02, LayerNorm 1/0, which makes
attention nearly uniform and hides swapped LayerNorm parameters): every parameter is redrawn from
a fixed seed so attention is peaked and every tensor matters. Shapes are chosen distinct where it
is cheap (hidden 32, intermediate 48, vocab 101, 4 heads) so a transposed matrix fails loudly.
For BART and LED the seed is the first one whose greedy output is varied and whose beam output
differs from greedy and between the rows; LED's EOS logit is raised so that one row of each
generation ends by a generated EOS (then padding) and the other by the forced EOS.

The logits of the long models (longformer, bigbird) are kept only at `logits_positions` (every
7th and the last): in full they would triple the folder. `tests/hf_fixtures_test.py` checks the
files and rebuilds every output (tokens included) in float64 NumPy from Hugging Face's equations.

Deterministic: rerunning writes identical arrays (the safetensors files too). The whole folder is
about 3 MB. To regenerate (needs the `bench` extra, CPU torch is enough):

    .venv-bench/bin/python benchmarks/hf_fixtures.py --out tests/fixtures/hf
    .venv-bench/bin/python benchmarks/hf_fixtures.py --out /tmp/hf --only bart   # one model
"""

from __future__ import annotations

import argparse
import json
import os
import sys

try:
  import numpy as np
  import torch
  import transformers
except ImportError:
  print("hf_fixtures.py needs torch and transformers: pip install -e .[bench]", file=sys.stderr)
  sys.exit(2)

VOCAB = 101
HIDDEN = 32
HEADS = 4
FFN = 48
LAYERS = 2
MAX_NEW_TOKENS = 12
LED_EOS_BIAS = 1.75


def _common(**kw):
  """Config fields shared by every model (dropouts are irrelevant in eval but zeroed anyway)."""
  base = dict(vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  base.update(kw)
  return base


def _encoder_config(**kw):
  return _common(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 intermediate_size=FFN, hidden_act="gelu", **kw)


def _seq2seq_config(**kw):
  return dict(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
              encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
              encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, activation_function="gelu",
              dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
              pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **kw)


def _randomize(model, seed, seq2seq=False):
  """Redraws every parameter (and BART/LED's final_logits_bias buffer) from `seed`.

  Matrices and embeddings ~ N(0, 0.2^2) (/ sqrt(fan_in / 32) for wide inputs), LayerNorm weights
  1 + N(0, 0.1^2), biases N(0, 0.1^2). Tied tensors are one parameter, so ties survive. With
  `seq2seq`, cross-attention's output projection is scaled by 0.1, fc2 by 0.3 and position
  embeddings by 3: otherwise the random decoder's states collapse to one vector (cross-attention
  averages a near-constant encoder memory) and greedy decoding repeats one token forever.
  """
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
      if p.ndim == 1 and ("LayerNorm" in name or "layer_norm" in name or "layernorm" in name):
        p.copy_(1.0 + 0.1 * noise)
      elif p.ndim == 1:
        p.copy_(0.1 * noise)
      else:
        fan_in = p.shape[-1] if "embed" not in name and "embeddings" not in name else HIDDEN
        factor = 1.0
        if seq2seq and "encoder_attn.out_proj" in name:
          factor = 0.1
        elif seq2seq and "fc2" in name:
          factor = 0.3
        elif seq2seq and "embed_positions" in name:
          factor = 3.0
        p.copy_(factor * 0.2 * noise * (HIDDEN / fan_in) ** 0.5)
    for name, b in model.named_buffers():
      if name.endswith("final_logits_bias"):
        b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def _tokens(rng, lengths, total, pad_id, bos=0, eos=2):
  """[B, total] ids: `bos`, random ids in [3, VOCAB), `eos`, then `pad_id`; and the 0/1 mask."""
  ids = np.full((len(lengths), total), pad_id, np.int64)
  mask = np.zeros((len(lengths), total), np.int64)
  for b, n in enumerate(lengths):
    ids[b, :n] = rng.integers(3, VOCAB, n)
    ids[b, 0], ids[b, n - 1] = bos, eos
    mask[b, :n] = 1
  return ids, mask


def _np(x):
  return x.detach().to(torch.float32).numpy()


def _stack_hidden(hidden_states, length):
  """HF's tuple of [B, L', D] (L' may include internal padding) as one [n+1, B, length, D]."""
  return np.stack([_np(h)[:, :length] for h in hidden_states])


def _save(folder, model, arrays, extra_json=None):
  os.makedirs(folder, exist_ok=True)
  model.save_pretrained(folder)
  np.savez_compressed(os.path.join(folder, "reference.npz"), **arrays)
  if extra_json is not None:
    with open(os.path.join(folder, "generation.json"), "w") as f:
      json.dump(extra_json, f, indent=2, sort_keys=True)
      f.write("\n")


def _logit_positions(length):
  """For long inputs, the positions whose MLM logits are kept: every 7th and the last (the head is
  position-wise and checked in full on roberta/bert; full [B, L, 101] logits would triple the size
  of the fixtures)."""
  return np.unique(np.r_[np.arange(0, length, 7), length - 1]).astype(np.int64)


def _masked_lm(model, base, feeds, length, positions=None, suffix="", hidden=True):
  """Runs the base encoder (with hidden states) and the MLM head; returns float32 arrays.

  With `positions`, `logits` holds only those positions ([B, len(positions), V]) and
  `logits_positions` says which they are. With `suffix` or not `hidden`, no hidden states.
  """
  hidden = hidden and not suffix
  with torch.no_grad():
    enc = base(**feeds, output_hidden_states=hidden)
    logits = _np(model(**feeds).logits)
  arrays = {"last_hidden_state" + suffix: _np(enc.last_hidden_state)}
  if positions is None:
    arrays["logits" + suffix] = logits
  else:
    arrays["logits" + suffix] = logits[:, positions]
    arrays["logits_positions"] = positions
  if hidden:
    arrays["hidden_states"] = _stack_hidden(enc.hidden_states, length)
  return arrays


def roberta(out):
  torch.manual_seed(0)
  cfg = transformers.RobertaConfig(**_encoder_config(
    max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    type_vocab_size=1, layer_norm_eps=1e-5))
  model = transformers.RobertaForMaskedLM(cfg).eval()
  _randomize(model, 1)
  ids, mask = _tokens(np.random.default_rng(2), [40, 29], 40, pad_id=1)
  feeds = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
  arrays = {"input_ids": ids, "attention_mask": mask}
  arrays.update(_masked_lm(model, model.roberta, feeds, 40))
  _save(os.path.join(out, "roberta"), model, arrays)


def bert(out):
  torch.manual_seed(0)
  cfg = transformers.BertConfig(**_encoder_config(
    max_position_embeddings=64, pad_token_id=0, type_vocab_size=2, layer_norm_eps=1e-12))
  model = transformers.BertForMaskedLM(cfg).eval()
  _randomize(model, 3)
  ids, mask = _tokens(np.random.default_rng(4), [40, 29], 40, pad_id=0, bos=1, eos=2)
  types = np.zeros_like(ids)
  types[0, 20:] = 1
  types[1, 15:29] = 1
  feeds = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
           "token_type_ids": torch.tensor(types)}
  arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
  arrays.update(_masked_lm(model, model.bert, feeds, 40))
  _save(os.path.join(out, "bert"), model, arrays)


def longformer(out):
  torch.manual_seed(0)
  cfg = transformers.LongformerConfig(**_encoder_config(
    attention_window=[32, 64], max_position_embeddings=1026, pad_token_id=1, bos_token_id=0,
    eos_token_id=2, sep_token_id=2, type_vocab_size=1, layer_norm_eps=1e-5))
  model = transformers.LongformerForMaskedLM(cfg).eval()
  _randomize(model, 5)
  length = 1000
  ids, mask = _tokens(np.random.default_rng(6), [length, 700], length, pad_id=1)
  glob = np.zeros_like(ids)
  glob[0, [0, 5, 400]] = 1
  glob[1, 0] = 1
  feeds = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
           "global_attention_mask": torch.tensor(glob)}
  arrays = {"input_ids": ids, "attention_mask": mask, "global_attention_mask": glob}
  positions = _logit_positions(length)
  arrays.update(_masked_lm(model, model.longformer, feeds, length, positions))
  del feeds["global_attention_mask"]
  arrays.update(_masked_lm(model, model.longformer, feeds, length, positions, "_noglobal"))
  _save(os.path.join(out, "longformer"), model, arrays)


def _generation_settings(model):
  """Every setting that decides generated tokens, explicit, so config defaults hide nothing."""
  cfg = model.config
  return dict(decoder_start_token_id=cfg.decoder_start_token_id, bos_token_id=cfg.bos_token_id,
              eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
              forced_bos_token_id=0, forced_eos_token_id=cfg.eos_token_id,
              max_new_tokens=MAX_NEW_TOKENS, min_length=0, min_new_tokens=None,
              no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, repetition_penalty=1.0,
              length_penalty=1.0, early_stopping=True, do_sample=False,
              num_return_sequences=1, bad_words_ids=None, suppress_tokens=None,
              begin_suppress_tokens=None, renormalize_logits=False, use_cache=True)


def _generate(model, feeds, num_beams):
  settings = _generation_settings(model)
  gen_cfg = transformers.GenerationConfig(num_beams=num_beams, **settings)
  with torch.no_grad():
    out = model.generate(**feeds, generation_config=gen_cfg)
  return out.numpy().astype(np.int64)


def _seq2seq(model, feeds, dec_ids, dec_mask, encoder_hidden=True):
  """Encoder/decoder states and logits (teacher forced), greedy and beam tokens.

  Without `encoder_hidden` the per-layer encoder states are left out (LED's are 600 long)."""
  with torch.no_grad():
    res = model(**feeds, decoder_input_ids=torch.tensor(dec_ids),
                decoder_attention_mask=torch.tensor(dec_mask), output_hidden_states=True)
  enc_len = feeds["input_ids"].shape[1]
  arrays = {"decoder_input_ids": dec_ids, "decoder_attention_mask": dec_mask,
            "encoder_last_hidden_state": _np(res.encoder_last_hidden_state),
            "last_hidden_state": _np(res.decoder_hidden_states[-1]),
            "decoder_hidden_states": _stack_hidden(res.decoder_hidden_states, dec_ids.shape[1]),
            "logits": _np(res.logits),
            "greedy_tokens": _generate(model, feeds, 1),
            "beam_tokens": _generate(model, feeds, 4)}
  if encoder_hidden:
    arrays["encoder_hidden_states"] = _stack_hidden(res.encoder_hidden_states, enc_len)
  return arrays


def _decoder_inputs(rng, model, lengths, total):
  """decoder_start_token_id, then random ids; row b has lengths[b] real tokens, then padding."""
  start = model.config.decoder_start_token_id
  ids, mask = _tokens(rng, lengths, total, pad_id=model.config.pad_token_id, bos=start, eos=2)
  for b, n in enumerate(lengths):
    ids[b, n - 1] = rng.integers(3, VOCAB)        # a prefix, not a finished sentence
  return ids, mask


def _nontrivial(tokens, eos):
  """True when every greedy row has >= 4 tokens before EOS, of >= 3 kinds, and the rows differ."""
  for row in tokens:
    body = row[2:]                                  # after decoder_start and the forced BOS
    stop = np.flatnonzero(body == eos)
    n = stop[0] if stop.size else body.size
    if n < 4 or len(set(body[:n].tolist())) < 3:
      return False
  return not np.array_equal(tokens[0], tokens[1])


def _pick_seed(build, feeds, first_seed):
  """The first seed from first_seed on whose greedy output is non-trivial and whose beam output
  differs from greedy and between the rows, so that batch and beam bookkeeping both show."""
  for seed in range(first_seed, first_seed + 50):
    model = build(seed)
    greedy = _generate(model, feeds, 1)
    if not _nontrivial(greedy, model.config.eos_token_id):
      continue
    beam = _generate(model, feeds, 4)
    if not np.array_equal(beam[0], beam[1]) and not np.array_equal(beam, greedy):
      return seed, model
  raise RuntimeError("no seed gave non-trivial greedy and beam outputs")


def bart(out):
  cfg = transformers.BartConfig(**_seq2seq_config(
    max_position_embeddings=64, scale_embedding=False, forced_bos_token_id=0,
    forced_eos_token_id=2))

  def build(seed):
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg).eval()
    _randomize(model, seed, seq2seq=True)
    return model

  rng = np.random.default_rng(8)
  ids, mask = _tokens(rng, [24, 17], 24, pad_id=1)
  feeds = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
  seed, model = _pick_seed(build, feeds, 100)
  dec_ids, dec_mask = _decoder_inputs(rng, model, [10, 7], 10)
  arrays = {"input_ids": ids, "attention_mask": mask, "weight_seed": np.int64(seed)}
  arrays.update(_seq2seq(model, feeds, dec_ids, dec_mask))
  _save(os.path.join(out, "bart"), model, arrays, _generation_json(model))


def _generation_json(model):
  return {"greedy": dict(num_beams=1, **_generation_settings(model)),
          "beam": dict(num_beams=4, **_generation_settings(model)),
          "transformers": transformers.__version__, "torch": torch.__version__}


def led(out):
  cfg = transformers.LEDConfig(**_seq2seq_config(
    attention_window=[32, 32], max_encoder_position_embeddings=1024,
    max_decoder_position_embeddings=64, forced_bos_token_id=0, forced_eos_token_id=2))

  def build(seed):
    torch.manual_seed(0)
    model = transformers.LEDForConditionalGeneration(cfg).eval()
    _randomize(model, seed, seq2seq=True)
    # EOS made likelier, so that some greedy and beam rows end by a generated EOS before
    # max_length and are then filled with pad_token_id (the others end by the forced EOS).
    with torch.no_grad():
      model.final_logits_bias[0, cfg.eos_token_id] += LED_EOS_BIAS
    return model

  rng = np.random.default_rng(9)
  length = 600
  ids, mask = _tokens(rng, [length, 451], length, pad_id=1)
  glob = np.zeros_like(ids)
  glob[:, 0] = 1
  feeds = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
           "global_attention_mask": torch.tensor(glob)}
  seed, model = _pick_seed(build, feeds, 200)
  dec_ids, dec_mask = _decoder_inputs(rng, model, [10, 7], 10)
  arrays = {"input_ids": ids, "attention_mask": mask, "global_attention_mask": glob,
            "weight_seed": np.int64(seed)}
  arrays.update(_seq2seq(model, feeds, dec_ids, dec_mask, encoder_hidden=False))
  _save(os.path.join(out, "led"), model, arrays, _generation_json(model))


def _record_random_blocks(model):
  """Wraps every layer's random-block helpers to keep the indices HF actually used, per layer."""
  record = []
  for layer in model.bert.encoder.layer:
    attn = layer.attention.self
    if not isinstance(attn, transformers.models.big_bird.modeling_big_bird
                      .BigBirdBlockSparseAttention):
      continue
    for helper in ("_bigbird_block_rand_mask_with_head", "_bigbird_block_rand_mask"):
      original = getattr(attn, helper)

      def wrapped(*args, _original=original, **kwargs):
        result = _original(*args, **kwargs)
        record.append(np.array(result))
        return result
      setattr(attn, helper, wrapped)
  return record


def bigbird(out):
  torch.manual_seed(0)
  # hidden_act "gelu_new" (tanh GELU) as google/bigbird-roberta-base has it; the others use erf.
  cfg = transformers.BigBirdConfig(**{**_encoder_config(
    attention_type="block_sparse", block_size=16, num_random_blocks=2,
    max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    sep_token_id=66, type_vocab_size=2, layer_norm_eps=1e-12, rescale_embeddings=False,
    use_bias=True), "hidden_act": "gelu_new"})
  model = transformers.BigBirdForMaskedLM(cfg).eval()
  _randomize(model, 10)
  # Longer than (5 + 2 r) * block_size = 144, and 300 is not a multiple of 16 (HF pads to 304).
  length = 300
  ids, mask = _tokens(np.random.default_rng(11), [length, 210], length, pad_id=0, bos=1, eos=2)
  feeds = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
  arrays = {"input_ids": ids, "attention_mask": mask}
  record = _record_random_blocks(model)
  arrays.update(_masked_lm(model, model.bert, feeds, length, _logit_positions(length)))
  # HF switches the model object (not its config) to full attention for short inputs, for good.
  if model.bert.attention_type != "block_sparse" or not record:
    raise RuntimeError("BigBird fell back to full attention: the case is not block sparse")
  # One entry per (call, layer): [heads, num_blocks - 2, num_random_blocks]; the base-model call
  # and the MLM call each run both layers, so keep the first run's layers.
  arrays["rand_attn"] = np.stack(record[:LAYERS]).astype(np.int64)
  if any(not np.array_equal(r, record[0]) for r in record):
    raise RuntimeError("random blocks differ between calls in eval: the fixture cannot pin them")
  _save(os.path.join(out, "bigbird"), model, arrays)
  full = transformers.BigBirdForMaskedLM(
    transformers.BigBirdConfig(**{**cfg.to_dict(), "attention_type": "original_full"})).eval()
  full.load_state_dict(model.state_dict())
  full_arrays = {"input_ids": ids, "attention_mask": mask}
  full_arrays.update(_masked_lm(full, full.bert, feeds, length, _logit_positions(length),
                                hidden=False))
  _save(os.path.join(out, "bigbird_full"), full, full_arrays)


BUILDERS = {"roberta": roberta, "bert": bert, "longformer": longformer, "bart": bart, "led": led,
            "bigbird": bigbird}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="tests/fixtures/hf")
  parser.add_argument("--only", choices=sorted(BUILDERS), action="append")
  args = parser.parse_args(argv)
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  transformers.set_seed(0)
  for name in args.only or BUILDERS:
    BUILDERS[name](args.out)
    print(f"wrote {os.path.join(args.out, name)}")


if __name__ == "__main__":
  main()
