"""Hugging Face checkpoints in our models: `load(path, **overrides) -> (model, report)`.

Longformer continued RoBERTa's pretraining after swapping in its attention pattern, and LED
started from BART: researchers start from those checkpoints too. This module reads a local
Hugging Face checkpoint folder (`config.json` and `model.safetensors`, or the shards that
`model.safetensors.index.json` lists), read with safetensors' NumPy loader: no torch, and never
a download, and builds our own model with its weights. What our blocks lack to compute the same
function is a model setting (`models.settings.ModelSettings`: post-LayerNorm blocks, exact GELU,
projection biases, token types, RoBERTa's position offset, the embedding LayerNorm, Longformer's
global projections, BERT's masked-LM head), not a copy of the model.

Supported architectures (`config.json`'s `model_type`):

  * `bert`, `roberta`: our `Encoder` with dense attention (`dot_product`).
  * `longformer`: our `Encoder` with band attention, one window per layer (Hugging Face's
    `attention_window` is two-sided: our one-sided window is half of it), and Longformer's
    separate global projections.
  * `big_bird`: our `Encoder` with dense attention (`attention_type` "original_full") or our
    `bigbird` kind (block_sparse: HF's block size and random blocks, first and last blocks
    global). At inference Hugging Face draws no random blocks: every one is block 0, which its
    softmax then counts 1 + r times (`_bigbird_block_rand_mask`, "During inference (eval) no
    randomness"); the import sets `random_blocks="first"`, which computes exactly that (set
    "drawn" to train with the paper's random blocks).
  * `bart`, `led` (`SEQ2SEQ`): our encoder-decoder `models.seq2seq.LED`, through
    `models.pretrained_seq2seq.load_seq2seq` (its docstring says how to call the model).

The encoder's `encode(input_ids, attention_mask, global_attention_mask=None,
token_type_ids=None)` returns what Hugging Face calls `last_hidden_state` (padded positions are
zeros) and `mlm_logits(x)` the masked-LM logits when the checkpoint has the head. Padding must be
on the right: our positions count from the first token, as Hugging Face's do for right padding.

`overrides` replace settings of the imported model (`attention={"kind": "band", "window":
256}`, `max_length=4096`, `dropout=0.0`, ...). A `max_length` beyond the checkpoint's positions
copies the learned positions over the longer table, as Longformer did (RoBERTa's 512 positions
tiled to 4,096; the rows before the first position are kept).

A folder that is not such a checkpoint raises `CheckpointError` (a ValueError) with one line
naming the file, field or tensor and what was expected.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from models import hf_format
from models.hf_format import (ACTIVATIONS, INVERSES, CheckpointError, Report, field as _field,
                              read, read_json as _read_json, target as _target)

SUPPORTED = ("bert", "roberta", "longformer", "big_bird")
EXPORTS = ("bert", "roberta", "longformer")     # what `export` writes
# The prefix of a head model's encoder tensors, where it is not the model_type.
PREFIXES = {"big_bird": "bert"}
SEQ2SEQ = ("bart", "led")        # encoder-decoders: models.pretrained_seq2seq
def read_config(path: str) -> dict[str, Any]:
  """The folder's config.json, checked to name a supported architecture (no tensor is read)."""
  config = _read_json(path)
  if config.get("model_type") not in SUPPORTED + SEQ2SEQ:
    raise CheckpointError(f"{path}/config.json: model_type = {config.get('model_type')!r} is "
                          f"not supported; supported: {', '.join(SUPPORTED + SEQ2SEQ)}.")
  return config


def _activation(config: dict[str, Any], path: str) -> str:
  act = config.get("hidden_act", "gelu")
  if act not in ACTIVATIONS:
    raise CheckpointError(f"{path}/config.json: hidden_act = {act!r} is not supported; "
                          f"supported: {', '.join(ACTIVATIONS)}.")
  return ACTIVATIONS[act]


def encoder_settings(config: dict[str, Any], path: str = ".") -> dict[str, Any]:
  """Our `config.model` settings of a BERT, RoBERTa or Longformer `config.json`."""
  kind = config.get("model_type")
  hidden = int(_field(config, "hidden_size", path))
  layers = int(_field(config, "num_hidden_layers", path))
  offset = 0 if kind in ("bert", "big_bird") else int(_field(config, "pad_token_id", path)) + 1
  positions = int(_field(config, "max_position_embeddings", path))
  pos_type = config.get("position_embedding_type", "absolute")
  if pos_type != "absolute":
    raise CheckpointError(f"{path}/config.json: position_embedding_type = {pos_type!r} is not "
                          f"supported; only absolute positions are.")
  out = dict(
      vocab_size=int(_field(config, "vocab_size", path)), max_length=positions - offset,
      num_layers=layers, num_heads=int(_field(config, "num_attention_heads", path)),
      emb_dim=hidden, qkv_dim=hidden, mlp_dim=int(_field(config, "intermediate_size", path)),
      dropout=float(config.get("hidden_dropout_prob", 0.0)), pos_emb="learned",
      attention={"kind": "dot_product"}, attention_bias=True, norm="post",
      layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
      activation=_activation(config, path), embed_norm=True,
      type_vocab_size=int(config.get("type_vocab_size", 0) or 0), position_offset=offset)
  if kind == "longformer":
    window = _field(config, "attention_window", path)
    windows = list(window) if isinstance(window, (list, tuple)) else [window] * layers
    if len(windows) != layers or any(int(w) % 2 or int(w) <= 0 for w in windows):
      raise CheckpointError(f"{path}/config.json: attention_window = {window!r}: must be one "
                            f"positive even size or one per layer ({layers}).")
    out["attention"] = {"kind": "band", "window": int(windows[0]) // 2}
    out["layer_attention"] = tuple({"window": int(w) // 2} for w in windows)
    out["global_projections"] = True
  if kind == "big_bird":
    if not config.get("use_bias", True):
      raise CheckpointError(f"{path}/config.json: use_bias = false is not supported (our "
                            f"attention_bias adds biases to every projection).")
    if config.get("rescale_embeddings"):
      out["embed_scale"] = float(hidden) ** 0.5
    attention_type = config.get("attention_type", "block_sparse")
    if attention_type == "block_sparse":
      out["attention"] = {"kind": "bigbird", "block_size": int(_field(config, "block_size", path)),
                          "num_global_blocks": 2,
                          "num_random_blocks": int(_field(config, "num_random_blocks", path)),
                          "random_blocks": "first"}
    elif attention_type != "original_full":
      raise CheckpointError(f"{path}/config.json: attention_type = {attention_type!r}: must be "
                            f"block_sparse or original_full.")
  return out


def _encoder_entries(prefix: str, config: dict[str, Any], *, lm: str | None
                     ) -> list[tuple[str, str, str]]:
  """(Hugging Face name, our path, transform) of every tensor of a BERT-family encoder."""
  e = [(f"{prefix}embeddings.word_embeddings.weight", "embed.embedding", "copy"),
       (f"{prefix}embeddings.position_embeddings.weight", "positions.table", "copy"),
       (f"{prefix}embeddings.LayerNorm.weight", "ln_embed.scale", "copy"),
       (f"{prefix}embeddings.LayerNorm.bias", "ln_embed.bias", "copy")]
  if config.get("type_vocab_size"):
    e.append((f"{prefix}embeddings.token_type_embeddings.weight", "types.embedding", "copy"))
  names = ["query", "key", "value"]
  if config.get("model_type") == "longformer":
    names += ["query_global", "key_global", "value_global"]
  for i in range(int(config["num_hidden_layers"])):
    hf, ours = f"{prefix}encoder.layer.{i}.", f"blocks.{i}."
    for n in names:
      e.append((f"{hf}attention.self.{n}.weight", f"{ours}attention.{n}", "linear"))
      e.append((f"{hf}attention.self.{n}.bias", f"{ours}attention.{n}_bias", "heads"))
    e += [(f"{hf}attention.output.dense.weight", f"{ours}attention.out", "heads_out"),
          (f"{hf}attention.output.dense.bias", f"{ours}attention.out_bias", "copy"),
          (f"{hf}attention.output.LayerNorm.weight", f"{ours}ln_attn.scale", "copy"),
          (f"{hf}attention.output.LayerNorm.bias", f"{ours}ln_attn.bias", "copy"),
          (f"{hf}intermediate.dense.weight", f"{ours}mlp.fc1.kernel", "linear"),
          (f"{hf}intermediate.dense.bias", f"{ours}mlp.fc1.bias", "copy"),
          (f"{hf}output.dense.weight", f"{ours}mlp.fc2.kernel", "linear"),
          (f"{hf}output.dense.bias", f"{ours}mlp.fc2.bias", "copy"),
          (f"{hf}output.LayerNorm.weight", f"{ours}ln_mlp.scale", "copy"),
          (f"{hf}output.LayerNorm.bias", f"{ours}ln_mlp.bias", "copy")]
  if lm == "roberta":      # RobertaLMHead / LongformerLMHead
    e += [("lm_head.dense.weight", "lm_head.dense.kernel", "linear"),
          ("lm_head.dense.bias", "lm_head.dense.bias", "copy"),
          ("lm_head.layer_norm.weight", "lm_head.ln.scale", "copy"),
          ("lm_head.layer_norm.bias", "lm_head.ln.bias", "copy"),
          ("lm_head.bias", "lm_head.bias", "copy")]
  elif lm == "bert":       # BertOnlyMLMHead
    e += [("cls.predictions.transform.dense.weight", "lm_head.dense.kernel", "linear"),
          ("cls.predictions.transform.dense.bias", "lm_head.dense.bias", "copy"),
          ("cls.predictions.transform.LayerNorm.weight", "lm_head.ln.scale", "copy"),
          ("cls.predictions.transform.LayerNorm.bias", "lm_head.ln.bias", "copy"),
          ("cls.predictions.bias", "lm_head.bias", "copy")]
  return e


# Tensors a checkpoint may hold that are the same as others (tied) or that our encoder does not
# compute (BERT's pooler, the position ids buffer).
_TIED_OR_UNUSED = ("lm_head.decoder.weight", "lm_head.decoder.bias",
                   "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


def _prefix(kind: str, tensors: dict[str, np.ndarray]) -> str:
  """'' for a base-model checkpoint, 'bert.' / 'roberta.' / 'longformer.' for a head model's."""
  head = f"{PREFIXES.get(kind, kind)}."
  return head if any(name.startswith(head) for name in tensors) else ""


def _check_tied(path: str, prefix: str, tensors: dict[str, np.ndarray]) -> None:
  words = tensors.get(f"{prefix}embeddings.word_embeddings.weight")
  for name in ("lm_head.decoder.weight", "cls.predictions.decoder.weight"):
    if name in tensors and words is not None and not np.array_equal(tensors[name], words):
      raise CheckpointError(f"{path}: tensor {name!r} differs from the word embeddings: an "
                            f"untied output embedding is not supported.")


def _lm(kind: str, tensors: dict[str, np.ndarray]) -> str | None:
  if "lm_head.bias" in tensors or "lm_head.dense.weight" in tensors:
    return "roberta"
  if "cls.predictions.bias" in tensors:
    return "bert"
  return None


def checkpoint_settings(path: str, config: dict[str, Any] | None = None,
                        tensors: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
  """Our model settings of the checkpoint at `path` (read unless given)."""
  if config is None or tensors is None:
    config, tensors = read(path)
  kind = config.get("model_type")
  if kind in SEQ2SEQ:
    from models.pretrained_seq2seq import seq2seq_settings
    return seq2seq_settings(config, path)
  if kind not in SUPPORTED:
    raise CheckpointError(f"{path}/config.json: model_type = {kind!r} is not supported; "
                          f"supported: {', '.join(SUPPORTED)}.")
  values = encoder_settings(config, path)
  prefix = _prefix(kind, tensors)
  _check_tied(path, prefix, tensors)
  values["lm_head"] = _lm(kind, tensors) is not None
  return values


def assign(encoder, path: str, config: dict[str, Any] | None = None,
           tensors: dict[str, np.ndarray] | None = None) -> Report:
  """Writes the weights of the checkpoint at `path` into our `encoder` (an `Encoder` built
  with its `checkpoint_settings`, any max_length, attention kind or dropout); its learned
  positions are copied over a longer table. Returns the report."""
  if config is None or tensors is None:
    config, tensors = read(path)
  kind = config.get("model_type")
  if kind in SEQ2SEQ:   # `encoder` is then the whole encoder-decoder
    from models.pretrained_seq2seq import assign_seq2seq
    return assign_seq2seq(encoder, path, config, tensors)
  source = checkpoint_settings(path, config, tensors)
  prefix, lm = _prefix(kind, tensors), _lm(kind, tensors)
  if encoder.lm_head is None:
    lm = None   # a task model's encoder: the masked-LM head is left out
  report = Report(kind, encoder.settings.as_dict())
  offset = encoder.positions.offset
  if offset != source["position_offset"]:
    raise CheckpointError(f"{path}: this model keeps {offset} rows before the first position, "
                          f"the checkpoint {source['position_offset']}.")
  hf_format.assign(encoder, path, kind, _encoder_entries(prefix, config, lm=lm), tensors, report,
                   positions="positions.table", source_length=source["max_length"],
                   offset=offset)
  if encoder.settings.attention.kind == "bigbird" and kind == "big_bird":
    report.notes.append("block-sparse attention as Hugging Face's inference computes it "
                        "(random_blocks='first': every random block is block 0); "
                        "random_blocks='drawn' draws them, as the paper and training do")
  return report


def load(path: str, **overrides: Any):
  """`(model, report)`: our model with the weights of the Hugging Face checkpoint at `path`.

  `overrides`: settings replacing the imported ones (module docstring); `seed` seeds whatever
  the checkpoint does not hold (none for the supported encoders)."""
  from flax import nnx

  from models.encoder import Encoder
  from models.settings import ModelSettings

  config, tensors = read(path)
  if config.get("model_type") in SEQ2SEQ:
    from models.pretrained_seq2seq import load_seq2seq
    return load_seq2seq(path, config, tensors, **overrides)
  seed = int(overrides.pop("seed", 0))
  values = {**checkpoint_settings(path, config, tensors), **overrides}
  try:
    settings = ModelSettings.from_mapping(values)
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}") from None
  model = Encoder(settings, rngs=nnx.Rngs(seed))
  return model, assign(model, path, config, tensors)


def hf_config(model, architecture: str, like: dict[str, Any] | None = None) -> dict[str, Any]:
  """The `config.json` of our encoder `model` as a Hugging Face `architecture` (bert, roberta,
  longformer): `like` (the imported checkpoint's config) with the fields our settings fix."""
  s = model.settings
  if architecture not in EXPORTS:
    raise ValueError(f"architecture = {architecture!r}: must be one of {', '.join(EXPORTS)}.")
  wrong = {name: getattr(s, name) for name, want in
           (("norm", "post"), ("attention_bias", True), ("embed_norm", True),
            ("pos_emb", "learned"), ("embed_scale", 1.0)) if getattr(s, name) != want}
  if s.emb_dim != s.qkv_dim:
    wrong["qkv_dim"] = s.qkv_dim
  if wrong:
    raise ValueError(f"this model has no Hugging Face {architecture} equivalent: "
                     f"{', '.join(f'{k}={v!r}' for k, v in wrong.items())}.")
  names = {v: k for k, v in ACTIVATIONS.items() if k != "gelu_pytorch_tanh"}
  config = dict(like or {})
  offset = s.position_offset
  config.update(
      model_type=architecture, vocab_size=s.vocab_size, hidden_size=s.emb_dim,
      num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
      intermediate_size=s.mlp_dim, hidden_act=names[s.activation],
      max_position_embeddings=s.max_length + offset, type_vocab_size=s.type_vocab_size,
      layer_norm_eps=s.layer_norm_eps)
  if architecture != "bert":
    if offset < 1:
      raise ValueError(f"{architecture} positions start at pad_token_id + 1: this model's "
                       f"position_offset is {offset}.")
    config["pad_token_id"] = offset - 1
  elif offset:
    raise ValueError(f"bert positions start at row 0: this model's position_offset is {offset}.")
  head = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM",
          "longformer": "LongformerForMaskedLM"}[architecture]
  config.setdefault("architectures", [head if s.lm_head else head.replace("ForMaskedLM",
                                                                            "Model")])
  if architecture == "longformer":
    specs = s.layer_specs()
    if any(spec.get("kind") != "band" or spec.get("dilation", 1) not in (1, None)
           for spec in specs) or not s.global_projections:
      raise ValueError("a longformer needs band attention without dilation in every layer "
                       "and global_projections.")
    config["attention_window"] = [2 * int(spec["window"]) for spec in specs]
  return config


def export(model, path: str, architecture: str, like: dict[str, Any] | None = None) -> None:
  """Writes our encoder `model` to the folder `path` as a Hugging Face checkpoint
  (`config.json`, `model.safetensors`; a new or empty folder, written all at once by
  `hf_format.write`) that `transformers` loads: `architecture` is bert,
  roberta or longformer; `like` a config to start from (the imported one: import then export
  gives back every tensor and field). The tied output embedding is not written, as
  `save_pretrained` does not write it. `architecture` bart or led writes our encoder-decoder
  (`models.pretrained_seq2seq.export_seq2seq`)."""
  if architecture in SEQ2SEQ or hasattr(model, "decoder_positions"):   # our LED
    from models.pretrained_seq2seq import export_seq2seq
    return export_seq2seq(model, path, architecture, like)
  config = hf_config(model, architecture, like)
  s = model.settings
  head = "roberta" if architecture != "bert" else "bert"
  prefix = f"{architecture}." if s.lm_head else ""
  tensors = {}
  for hf, ours, how in _encoder_entries(prefix, config, lm=head if s.lm_head else None):
    tensors[hf] = np.ascontiguousarray(INVERSES[how](np.asarray(_target(model, ours).get_value())),
                                       np.float32)
  hf_format.write(path, config, tensors)


# The settings a checkpoint fixes when it initialises a task model (`config.init_from_hf`): its
# architecture. The run's config keeps the attention kind, the length and the dropout.
ARCHITECTURE = ("vocab_size", "num_layers", "num_heads", "emb_dim", "qkv_dim", "mlp_dim",
                "pos_emb", "attention_bias", "norm", "layer_norm_eps", "activation", "embed_norm",
                "embed_scale", "type_vocab_size", "position_offset", "global_projections",
                "lm_head")
# An encoder-decoder's (BART, LED) adds the decoder's; its target_length (decoder positions) is
# the checkpoint's, which must cover the run's.
SEQ2SEQ_ARCHITECTURE = ARCHITECTURE + ("decoder_layers", "decoder_pos_emb",
                                       "target_length")


def task_settings(path: str, cfg: dict[str, Any], seq2seq: bool = False) -> dict[str, Any]:
  """The model constructor's fields `cfg` of a run (`lra.train.model_config`) with the
  architecture of the checkpoint at `path`; the task's token ids must fit its vocabulary, and
  an encoder-decoder task (`seq2seq`) needs a BART or LED checkpoint, any other an encoder's."""
  config = read_config(path)
  kind = config["model_type"]
  if seq2seq != (kind in SEQ2SEQ):
    task, wanted = (("an encoder-decoder", SEQ2SEQ) if seq2seq else
                    ("an encoder", SUPPORTED))
    raise CheckpointError(f"config.init_from_hf = {path}: a {kind} checkpoint, but this task's "
                          f"model is {task}: give a {' or '.join(wanted)} checkpoint.")
  arch = checkpoint_settings(path)
  if int(cfg.get("vocab_size") or 0) > arch["vocab_size"]:
    raise CheckpointError(f"config.init_from_hf = {path}: the task has {cfg['vocab_size']} token "
                          f"ids, the checkpoint's vocabulary only {arch['vocab_size']}.")
  if seq2seq and int(cfg.get("target_length") or 0) > arch["target_length"]:
    raise CheckpointError(f"config.init_from_hf = {path}: config.model.target_length = "
                          f"{cfg['target_length']}, the checkpoint's decoder has only "
                          f"{arch['target_length']} positions.")
  names = SEQ2SEQ_ARCHITECTURE if seq2seq else ARCHITECTURE
  return {**cfg, **{name: arch[name] for name in names if name in arch}}


__all__ = ["ARCHITECTURE", "SEQ2SEQ_ARCHITECTURE", "CheckpointError", "Report", "SUPPORTED",
           "assign", "checkpoint_settings", "encoder_settings", "export", "hf_config", "load",
           "read", "read_config", "task_settings"]
