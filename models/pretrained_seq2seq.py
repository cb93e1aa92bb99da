"""Hugging Face BART and LED checkpoints in our encoder-decoder (`models.seq2seq.LED`).

LED started from BART: the same post-LayerNorm encoder-decoder with learned positions, a
LayerNorm over the embeddings and a tied output embedding plus `final_logits_bias`, whose
encoder layers are Longformer's self-attention (a band per layer, global tokens through their
own projections). `load_seq2seq(path, config, tensors, **overrides) -> (model, report)` builds
our `LED` with those weights; `models.pretrained.load` calls it for `model_type` "bart" and
"led", having read the folder (`pretrained.read`).

What our model lacks to compute the same function is a setting (`seq2seq_settings`):
`norm="post"`, `attention_bias`, `layer_norm_eps` 1e-5 (torch's default), `activation`,
`embed_norm` (layernorm_embedding), `embed_scale` (sqrt(d_model) with scale_embedding), learned
positions for the encoder (`pos_emb`) and the decoder (`decoder_pos_emb`) after
`position_offset` rows (BartLearnedPositionalEmbedding's 2; LED's tables have none),
`lm_head` (logits = the tied embedding, unscaled, plus final_logits_bias) and for LED band
attention with Longformer's `global_projections` (`attention_window` is two-sided: our window is
half of it, one per layer). Encoder and decoder share one number of heads and one MLP width in
our model: a checkpoint whose decoder differs is refused.

The imported model is called with Hugging Face's masks, since BART's `<s>` is id 0, which our
code otherwise takes for padding: `model.encode(input_ids, key_mask=attention_mask > 0,
global_mask=global_attention_mask > 0)` is `encoder_last_hidden_state` (padded positions are
zeros), `model.decoder_states(memory, memory_mask, decoder_input_ids, token_mask=...)` the
decoder's `last_hidden_state` and `model.decode(...)` the logits. `generation(config)` gives the
`models.decoding.HFGeneration` of the checkpoint's generation settings, with which
`models.decoding.greedy` and `beam_search` produce what `generate` does.

`overrides` replace imported settings (`dropout=0.1`, `max_length=4096`, ...); a longer
encoder `max_length` copies the learned positions over the longer table (`pretrained`'s tiling,
LED's recipe from BART's 1,024 positions). A checkpoint that does not fit its config raises
`pretrained.CheckpointError` with one line naming the tensor or field.

`assign_seq2seq(model, ...)` writes a checkpoint into an `LED` built elsewhere: a run's
`config.init_from_hf` builds it with the checkpoint's architecture and the run's attention,
length and `num_global` (`pretrained.task_settings`). `export_seq2seq(model, path, "bart" |
"led", like)` is the way back, through `hf_format.INVERSES`: a `...ForConditionalGeneration`
checkpoint that transformers loads, `shared.weight` written once as `save_pretrained` does; a
model Hugging Face's has no equivalent of (pre-LayerNorm, sinusoidal decoder positions, a BART
with band attention, ...) is refused, naming the settings.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from models import hf_format
from models.hf_format import CheckpointError, Report
from models.hf_format import field as _field, target as _target

ARCHITECTURES = ("bart", "led")


def seq2seq_settings(config: dict[str, Any], path: str = ".") -> dict[str, Any]:
  """Our `config.model` settings of a BART or LED `config.json`."""
  kind = config.get("model_type")
  f = lambda name: _field(config, name, path)
  emb = int(f("d_model"))
  heads, mlp = int(f("encoder_attention_heads")), int(f("encoder_ffn_dim"))
  for name, value in (("decoder_attention_heads", heads), ("decoder_ffn_dim", mlp)):
    if int(f(name)) != value:
      raise CheckpointError(f"{path}/config.json: {name} = {config[name]} differs from the "
                            f"encoder's {value}; our encoder-decoder has one for both.")
  act = config.get("activation_function", "gelu")
  if act not in hf_format.ACTIVATIONS:
    raise CheckpointError(f"{path}/config.json: activation_function = {act!r} is not "
                          f"supported; supported: {', '.join(hf_format.ACTIVATIONS)}.")
  layers = int(f("encoder_layers"))
  out = dict(
      vocab_size=int(f("vocab_size")), num_layers=layers, decoder_layers=int(f("decoder_layers")),
      num_heads=heads, emb_dim=emb, qkv_dim=emb, mlp_dim=mlp,
      dropout=float(config.get("dropout", 0.0)), pos_emb="learned", decoder_pos_emb="learned",
      attention={"kind": "dot_product"}, attention_bias=True, norm="post", layer_norm_eps=1e-5,
      activation=hf_format.ACTIVATIONS[act], embed_norm=True, lm_head=True, num_global=0)
  if kind == "bart":
    out.update(max_length=int(f("max_position_embeddings")),
               target_length=int(f("max_position_embeddings")), position_offset=2,
               embed_scale=math.sqrt(emb) if config.get("scale_embedding") else 1.0)
    return out
  window = f("attention_window")
  windows = list(window) if isinstance(window, (list, tuple)) else [window] * layers
  if len(windows) != layers or any(int(w) % 2 or int(w) <= 0 for w in windows):
    raise CheckpointError(f"{path}/config.json: attention_window = {window!r}: must be one "
                          f"positive even size or one per layer ({layers}).")
  out.update(max_length=int(f("max_encoder_position_embeddings")),
             target_length=int(f("max_decoder_position_embeddings")), position_offset=0,
             attention={"kind": "band", "window": int(windows[0]) // 2},
             layer_attention=tuple({"window": int(w) // 2} for w in windows),
             global_projections=True)
  return out


def _linear(hf: str, ours: str) -> list[tuple[str, str, str]]:
  """A torch Linear into an nnx.Linear (`ours` its path)."""
  return [(f"{hf}.weight", f"{ours}.kernel", "linear"), (f"{hf}.bias", f"{ours}.bias", "copy")]


def _norm(hf: str, ours: str) -> list[tuple[str, str, str]]:
  return [(f"{hf}.weight", f"{ours}.scale", "copy"), (f"{hf}.bias", f"{ours}.bias", "copy")]


def _seq2seq_entries(prefix: str, config: dict[str, Any]) -> list[tuple[str, str, str]]:
  """(Hugging Face name, our path, transform) of every tensor of a BART or LED model."""
  p = prefix
  e = [(f"{p}shared.weight", "encoder.embed.embedding", "copy"),
       (f"{p}encoder.embed_positions.weight", "encoder.positions.table", "copy"),
       *_norm(f"{p}encoder.layernorm_embedding", "encoder.ln_embed")]
  led = config.get("model_type") == "led"
  for i in range(int(config["encoder_layers"])):
    hf, ours = f"{p}encoder.layers.{i}.", f"encoder.blocks.{i}."
    if led:
      att = f"{hf}self_attn.longformer_self_attn."
      names = [(n, n) for n in ("query", "key", "value", "query_global", "key_global",
                                "value_global")]
      out = f"{hf}self_attn.output"
    else:
      att = f"{hf}self_attn."
      names = [("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")]
      out = f"{hf}self_attn.out_proj"
    for theirs, mine in names:
      e.append((f"{att}{theirs}.weight", f"{ours}attention.{mine}", "linear"))
      e.append((f"{att}{theirs}.bias", f"{ours}attention.{mine}_bias", "heads"))
    e += [(f"{out}.weight", f"{ours}attention.out", "heads_out"),
          (f"{out}.bias", f"{ours}attention.out_bias", "copy"),
          *_norm(f"{hf}self_attn_layer_norm", f"{ours}ln_attn"),
          *_linear(f"{hf}fc1", f"{ours}mlp.fc1"), *_linear(f"{hf}fc2", f"{ours}mlp.fc2"),
          *_norm(f"{hf}final_layer_norm", f"{ours}ln_mlp")]
  e += [(f"{p}decoder.embed_positions.weight", "decoder_positions.table", "copy"),
        *_norm(f"{p}decoder.layernorm_embedding", "ln_embed")]
  for i in range(int(config["decoder_layers"])):
    hf, ours = f"{p}decoder.layers.{i}.", f"blocks.{i}."
    for theirs, mine in (("self_attn", "self_attention"), ("encoder_attn", "cross_attention")):
      for a, b in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"),
                   ("out_proj", "out")):
        e += _linear(f"{hf}{theirs}.{a}", f"{ours}{mine}.{b}")
    e += [*_norm(f"{hf}self_attn_layer_norm", f"{ours}ln_self"),
          *_norm(f"{hf}encoder_attn_layer_norm", f"{ours}ln_cross"),
          *_linear(f"{hf}fc1", f"{ours}mlp.fc1"), *_linear(f"{hf}fc2", f"{ours}mlp.fc2"),
          *_norm(f"{hf}final_layer_norm", f"{ours}ln_mlp")]
  e.append(("final_logits_bias", "logits_bias", "row"))
  return e


def _prefix(kind: str, tensors: dict[str, np.ndarray]) -> str:
  """'model.' (BartForConditionalGeneration), 'led.' (LEDForConditionalGeneration) or '' (the
  base model's own checkpoint)."""
  for head in ("model.", f"{kind}."):
    if f"{head}shared.weight" in tensors:
      return head
  return ""


def _check_tied(path: str, prefix: str, tensors: dict[str, np.ndarray]) -> None:
  """Our model has one token embedding: copies a checkpoint keeps of it must equal it."""
  shared = tensors.get(f"{prefix}shared.weight")
  for name in (f"{prefix}encoder.embed_tokens.weight", f"{prefix}decoder.embed_tokens.weight",
               "lm_head.weight"):
    if shared is not None and name in tensors and not np.array_equal(tensors[name], shared):
      raise CheckpointError(f"{path}: tensor {name!r} differs from {prefix}shared.weight; our "
                            f"encoder-decoder ties the token embeddings and the output layer.")


def load_seq2seq(path: str, config: dict[str, Any], tensors: dict[str, np.ndarray],
                 **overrides: Any):
  """`(model, report)`: our `LED` with the weights of a BART or LED checkpoint (read by
  `pretrained.read`); `overrides` replace imported settings, `seed` seeds what the checkpoint
  does not hold (final_logits_bias of a base model is zeros)."""
  from flax import nnx

  from models.seq2seq import LED
  from models.settings import ModelSettings

  kind = config.get("model_type")
  if kind not in ARCHITECTURES:
    raise CheckpointError(f"{path}/config.json: model_type = {kind!r} is not an "
                          f"encoder-decoder; supported: {', '.join(ARCHITECTURES)}.")
  seed = int(overrides.pop("seed", 0))
  values = {**seq2seq_settings(config, path), **overrides}
  try:
    settings = ModelSettings.from_mapping(values)
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}") from None
  model = LED(settings, rngs=nnx.Rngs(seed))
  return model, assign_seq2seq(model, path, config, tensors)


def _settings(model):
  """Our `LED`'s settings: its encoder's (built with lm_head off, as the LM head is the
  decoder's output layer), whose decoder fields are the model's."""
  import dataclasses
  return dataclasses.replace(model.encoder.settings, lm_head=model.logits_bias is not None)


def assign_seq2seq(model, path: str, config: dict[str, Any], tensors: dict[str, np.ndarray]
                   ) -> Report:
  """Writes the BART or LED checkpoint's weights into our `LED` `model` (built with its
  settings, any encoder max_length, attention kind or dropout: `config.init_from_hf` builds it
  with the run's); the encoder's learned positions are copied over a longer table."""
  kind = config.get("model_type")
  source_length = seq2seq_settings(config, path)["max_length"]
  settings = _settings(model)
  report = Report(kind, settings.as_dict())
  prefix = _prefix(kind, tensors)
  _check_tied(path, prefix, tensors)
  offset = settings.position_offset
  hf_format.assign(model, path, kind, _seq2seq_entries(prefix, config), tensors, report,
                   positions="encoder.positions.table", source_length=source_length,
                   offset=offset, what="encoder positions",
                   optional={"final_logits_bias": "final_logits_bias: not in the checkpoint "
                                                  "(a base model), zeros"})
  return report


_HEADS = {"bart": "BartForConditionalGeneration", "led": "LEDForConditionalGeneration"}


def hf_seq2seq_config(model, architecture: str, like: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
  """The `config.json` of our `LED` `model` as a Hugging Face `architecture` (bart, led):
  `like` (the imported checkpoint's config) with the fields our settings fix. A setting
  Hugging Face's model does not have raises ValueError naming it."""
  s = _settings(model)
  if architecture not in ARCHITECTURES:
    raise ValueError(f"architecture = {architecture!r}: must be one of "
                     f"{', '.join(ARCHITECTURES)}.")
  offset = 2 if architecture == "bart" else 0
  wrong = {name: getattr(s, name) for name, want in
           (("norm", "post"), ("attention_bias", True), ("embed_norm", True),
            ("pos_emb", "learned"), ("decoder_pos_emb", "learned"), ("lm_head", True),
            ("layer_norm_eps", 1e-5), ("position_offset", offset), ("qkv_dim", s.emb_dim))
           if getattr(s, name) != want}
  scaled = s.embed_scale != 1.0
  if scaled and (architecture == "led" or abs(s.embed_scale - math.sqrt(s.emb_dim)) > 1e-6):
    wrong["embed_scale"] = s.embed_scale
  names = {v: k for k, v in hf_format.ACTIVATIONS.items() if k != "gelu_pytorch_tanh"}
  if s.activation not in names:
    wrong["activation"] = s.activation
  specs = s.layer_specs()
  if architecture == "bart":
    if any(spec.get("kind") != "dot_product" for spec in specs):
      wrong["attention"] = sorted({str(spec.get("kind")) for spec in specs})
    if s.max_length != s.target_length:
      wrong["max_length"] = f"{s.max_length} (target_length {s.target_length})"
  elif any(spec.get("kind") != "band" or spec.get("dilation", 1) not in (1, None)
           for spec in specs) or not s.global_projections:
    wrong["attention"] = (f"{sorted({str(spec.get('kind')) for spec in specs})}, "
                          f"global_projections={s.global_projections}")
  if wrong:
    raise ValueError(f"this model has no Hugging Face {architecture} equivalent: "
                     f"{', '.join(f'{k}={v!r}' for k, v in wrong.items())}.")
  config = dict(like or {})
  config.update(
      model_type=architecture, vocab_size=s.vocab_size, d_model=s.emb_dim,
      encoder_layers=s.num_layers, decoder_layers=s.decoder_layers,
      encoder_attention_heads=s.num_heads, decoder_attention_heads=s.num_heads,
      encoder_ffn_dim=s.mlp_dim, decoder_ffn_dim=s.mlp_dim,
      activation_function=names[s.activation], dropout=s.dropout)
  if architecture == "bart":
    config.update(max_position_embeddings=s.max_length, scale_embedding=scaled)
  else:
    config.update(max_encoder_position_embeddings=s.max_length,
                  max_decoder_position_embeddings=s.target_length,
                  attention_window=[2 * int(spec["window"]) for spec in specs])
  config.setdefault("architectures", [_HEADS[architecture]])
  return config


def export_seq2seq(model, path: str, architecture: str,
                   like: dict[str, Any] | None = None) -> None:
  """Writes our `LED` `model` to the folder `path` as a Hugging Face `architecture` (bart, led)
  `...ForConditionalGeneration` checkpoint (`config.json`, `model.safetensors`; a new or empty
  folder, written all at once by `hf_format.write`); `like` a config
  to start from (the imported one: import then export gives back every tensor and field). The
  tied copies of `shared.weight` (both embed_tokens and lm_head.weight) are not written, as
  `save_pretrained` does not write them."""
  config = hf_seq2seq_config(model, architecture, like)
  prefix = "model." if architecture == "bart" else "led."
  tensors = {}
  for hf, ours, how in _seq2seq_entries(prefix, config):
    value = np.asarray(_target(model, ours).get_value())
    tensors[hf] = np.ascontiguousarray(hf_format.INVERSES[how](value), np.float32)
  hf_format.write(path, config, tensors)


def generation(config: dict[str, Any]) -> dict[str, Any]:
  """The arguments of `models.decoding.greedy` and `beam_search` that make them Hugging Face's
  `generate` with a generation config (generation_config.json's or config.json's fields):
  `bos_id` (decoder_start_token_id), `eos_id` and `hf` (`models.decoding.HFGeneration`: pad,
  forced BOS / EOS, length_penalty, early_stopping; Hugging Face's defaults where absent)."""
  from models.decoding import HFGeneration

  def get(name, default=None):
    value = config.get(name)
    return default if value is None else value

  if get("eos_token_id") is None:
    raise CheckpointError("generation config: eos_token_id is missing.")
  hf = HFGeneration(
      pad_id=int(get("pad_token_id", 0)), forced_bos_id=get("forced_bos_token_id"),
      forced_eos_id=get("forced_eos_token_id"), length_penalty=float(get("length_penalty", 1.0)),
      early_stopping=get("early_stopping", False))
  return {"bos_id": int(get("decoder_start_token_id", get("bos_token_id", 0))),
          "eos_id": int(get("eos_token_id")), "hf": hf}


__all__ = ["ARCHITECTURES", "assign_seq2seq", "export_seq2seq", "generation", "hf_seq2seq_config",
           "load_seq2seq", "seq2seq_settings"]
