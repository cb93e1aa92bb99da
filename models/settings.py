"""The models' settings: one frozen record, built once from the `config.model` mapping.

Every model (`Classifier`, `DualEncoder`, `LanguageModel`, `LED`) takes a `ModelSettings` or
the mapping the trainer builds (`config.model` plus what the task fixes: vocab_size,
num_classes, max_length, remat, dtype) and turns a mapping into settings once, at its entry:
`ModelSettings.from_mapping(cfg)`. The names the models accept (`POSITIONS`, `POOLINGS`,
`DTYPES`, `REMATS`, `IN_LAYER`) and the rules that relate settings (qkv_dim divisible by
num_heads, an even head dimension for rotary positions, the sublayer order) live here and
nowhere else: the config schema (`lra.schema`) checks a config with these same functions, so a
bad value gives the same one-line message whether `lra run` or a model constructor finds it,
for example

  config.model.pool = 'max': must be one of cls, mean (how the classifier pools the sequence).

This module imports only the standard library, so the config schema (which must stay free of
jax) can use it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

POSITIONS = ("sinusoidal", "learned", "none", "rotary", "infused", "relative")
# The positions each attention layer applies to its queries and keys (nothing is added to the
# embeddings; models/attention_layer.py).
IN_LAYER = ("rotary", "infused", "relative")
POOLINGS = ("cls", "mean")
DTYPES = ("float32", "bfloat16")
# "none", "block" (recompute each block in the backward pass) or a policy of
# `jax.checkpoint_policies` that keeps some of a block's values (models/encoder.py REMAT).
REMATS = ("none", "block", "dots_saveable", "dots_with_no_batch_dims_saveable")
# Where each block's LayerNorms sit: "pre" (x + f(LN(x)), a final LayerNorm after the last
# block; our default) or "post" (LN(x + f(x)), no final LayerNorm; BERT, RoBERTa, BART).
NORMS = ("pre", "post")
# The MLP's nonlinearity: GELU's tanh approximation (our default), exact (erf) GELU (BERT,
# RoBERTa, BART), or ReLU.
ACTIVATIONS = ("gelu_tanh", "gelu", "relu")

# setting -> (its config field, the valid names, what the field means)
CHOICES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "remat": ("config.remat", REMATS, "what each block keeps for the backward pass (none keeps "
              "everything; block recomputes the block; dots_* keep only matmul outputs)"),
    "dtype": ("config.dtype", DTYPES, "the activations' dtype (parameters stay float32)"),
    "pos_emb": ("config.model.pos_emb", POSITIONS, "the position embedding"),
    "pool": ("config.model.pool", POOLINGS, "how the classifier pools the sequence"),
    "norm": ("config.model.norm", NORMS, "where the LayerNorms sit: pre = x + f(LN(x)), post = "
             "LN(x + f(x))"),
    "activation": ("config.model.activation", ACTIVATIONS, "the MLP's nonlinearity"),
}


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def check_choice(setting: str, value: Any) -> None:
  """Raises ValueError unless `value` is one of the names of `setting` (a key of CHOICES)."""
  field, names, meaning = CHOICES[setting]
  if value not in names:
    raise ValueError(f"{field} = {value!r}: must be one of {', '.join(names)} ({meaning}).")


def check_heads(num_heads: Any, qkv_dim: Any) -> None:
  """qkv_dim must be a multiple of num_heads (not checked while either is missing or 0)."""
  if num_heads and qkv_dim and qkv_dim % num_heads:
    raise ValueError(f"config.model.qkv_dim = {qkv_dim!r}: must be a multiple of "
                     f"config.model.num_heads = {num_heads} (each head gets qkv_dim // num_heads "
                     f"features).")


def check_rotary(pos_emb: Any, num_heads: Any, qkv_dim: Any) -> None:
  """Rotary positions rotate pairs of features: each head needs an even dimension."""
  if pos_emb == "rotary" and num_heads and qkv_dim and (qkv_dim // num_heads) % 2:
    raise ValueError(f"config.model.pos_emb = 'rotary': needs an even head dimension, but "
                     f"qkv_dim / num_heads = {qkv_dim // num_heads}.")


def check_order(num_layers: Any, sublayers: Any = "", sandwich: Any = 0) -> None:
  """model.sublayers (a string of s and f) and model.sandwich (k in [0, num_layers - 1])."""
  if not isinstance(sublayers, str) or set(sublayers) - set("sf"):
    raise ValueError(f"config.model.sublayers = {sublayers!r}: must be a string of 's' "
                     f"(self-attention) and 'f' (feed-forward) only, or '' for 'sf' * num_layers "
                     f"(the sublayer order).")
  n = num_layers or 1
  if not (_is_int(sandwich) and 0 <= sandwich <= n - 1):
    raise ValueError(f"config.model.sandwich = {sandwich!r}: must be an integer in [0, {n - 1}] "
                     f"(num_layers - 1; the Sandwich coefficient k of s^k (sf)^(n-k) f^k).")
  if sublayers and sandwich:
    raise ValueError(f"config.model.sandwich = {sandwich!r}: give config.model.sublayers or "
                     f"config.model.sandwich, not both (sublayers = {sublayers!r}).")


def sublayer_order(num_layers: int, sublayers: str = "", sandwich: int = 0) -> str:
  """The sublayer string: `sublayers` when given, else s^k (sf)^(n-k) f^k for k = `sandwich`
  (k = 0: the interleaved "sf" * n; Press et al. 2020)."""
  check_order(num_layers, sublayers, sandwich)
  if sublayers:
    return sublayers
  k = sandwich
  return "s" * k + "sf" * (num_layers - k) + "f" * k


# The attention spec's entry naming its backend (`attention.backends`): not a kind argument.
IMPLEMENTATION = "implementation"


def layer_specs(attention: Mapping[str, Any], layer_attention: Sequence[Mapping[str, Any]],
                num_layers: int) -> list[dict[str, Any]]:
  """One attention spec per layer: `attention` updated by `layer_attention[i]` when given.

  For example windows growing with depth: `layer_attention=({"window": 8}, {"window": 32})`.
  """
  layer_attention = list(layer_attention or ())
  if len(layer_attention) not in (0, num_layers):
    raise ValueError(
        f"layer_attention has {len(layer_attention)} entries but the model has {num_layers} "
        f"layers: give one dict per layer (empty dicts keep the default) or none at all.")
  specs = []
  for i in range(num_layers):
    spec = dict(attention)
    override = dict(layer_attention[i]) if layer_attention else {}
    if "kind" in override and override["kind"] != spec.get("kind"):
      # a different kind does not inherit the default kind's arguments, only the backend choice
      spec = {k: v for k, v in spec.items() if k == IMPLEMENTATION}
    spec.update(override)
    specs.append(spec)
  return specs


def _frozen(value: Any) -> Any:
  return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """An attention kind (None in a per-layer override that keeps the default kind) and the
  keyword arguments of its primitive, in their given order (lists stored as tuples)."""

  kind: str | None
  args: tuple[tuple[str, Any], ...] = ()

  @classmethod
  def from_mapping(cls, spec: AttentionSpec | Mapping[str, Any]) -> AttentionSpec:
    if isinstance(spec, cls):
      return spec
    args = dict(spec)
    kind = args.pop("kind", None)
    return cls(kind, tuple((name, _frozen(value)) for name, value in args.items()))

  def as_dict(self) -> dict[str, Any]:
    """The spec as the dict the attention layer takes (`{"kind": ..., **args}`)."""
    return {**({} if self.kind is None else {"kind": self.kind}), **dict(self.args)}


# Settings without a default: every model needs them.
REQUIRED = ("vocab_size", "max_length", "num_layers", "num_heads", "emb_dim", "qkv_dim",
            "mlp_dim", "dropout", "pos_emb", "attention")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """What the models read of `config.model` (and of the task: vocab_size, num_classes,
  max_length; of the config: remat, dtype). The rules run when the record is made."""

  # The encoder (every model).
  vocab_size: int
  max_length: int
  num_layers: int
  num_heads: int
  emb_dim: int
  qkv_dim: int
  mlp_dim: int
  dropout: float
  pos_emb: str
  attention: AttentionSpec
  layer_attention: tuple[AttentionSpec, ...] = ()
  rotary_base: float = 10000.0
  sublayers: str = ""
  sandwich: int = 0
  remat: str = "none"
  dtype: str = "float32"
  # What a pretrained checkpoint's architecture may need (models/pretrained.py); the defaults
  # are this codebase's own blocks. Biases on the query, key, value and output projections;
  # the LayerNorms' place and epsilon; the MLP's nonlinearity; a LayerNorm over the embeddings
  # (BERT's, BART's layernorm_embedding); a factor on the token embeddings (BART's
  # scale_embedding: sqrt(emb_dim)); token types (BERT; 0 = none); rows of the learned position
  # table before the first position (RoBERTa's padding_idx + 1 = 2); Longformer's separate
  # query, key and value projections of global tokens; BERT's masked-LM head (dense, activation,
  # LayerNorm, the tied embedding and a bias) instead of the scaled tied embedding.
  attention_bias: bool = False
  norm: str = "pre"
  layer_norm_eps: float = 1e-6
  activation: str = "gelu_tanh"
  embed_norm: bool = False
  embed_scale: float = 1.0
  type_vocab_size: int = 0
  position_offset: int = 0
  global_projections: bool = False
  lm_head: bool = False
  # The classifier heads (Classifier, DualEncoder): None where a model has none.
  pool: str | None = None
  classifier_dim: int | None = None
  num_classes: int | None = None
  # The Longformer encoder-decoder (models/seq2seq.py).
  decoder_layers: int | None = None
  target_length: int | None = None
  num_global: int = 0
  # The decoder's positions: fixed sinusoids (our default) or a learned table of target_length
  # rows after position_offset rows (BART's and LED's embed_positions).
  decoder_pos_emb: str = "sinusoidal"
  # The language model's Transformer-XL / compressive memory (models/memory.py).
  memory_length: int = 0
  compressed_length: int = 0
  segment_length: int = 0
  eval_memory_length: int = 0
  clamp_len: int = 0
  same_length: bool = False
  compression: str = "conv"
  compression_rate: int = 1
  # The TPU splash kernel's tiles (`config.model.splash`: names of `attention.splash.Tiles`),
  # as sorted (name, value) pairs; used only by layers whose backend is splash. Empty: the
  # kernel's defaults (`attention.splash.DEFAULT_TILES`). The values are checked where the
  # tiles are made (the config schema, a splash layer), which needs jax.
  splash: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    for setting in CHOICES:
      if getattr(self, setting) is not None:
        check_choice(setting, getattr(self, setting))
    check_heads(self.num_heads, self.qkv_dim)
    check_rotary(self.pos_emb, self.num_heads, self.qkv_dim)
    check_order(self.num_layers, self.sublayers, self.sandwich)
    if self.norm == "post" and self.order != "sf" * self.num_layers:
      raise ValueError(f"config.model.norm = 'post' needs the interleaved sublayer order, not "
                       f"{self.order!r}: leave config.model.sublayers and sandwich unset.")
    for name in ("type_vocab_size", "position_offset"):
      value = getattr(self, name)
      if not (_is_int(value) and value >= 0):
        raise ValueError(f"config.model.{name} = {value!r}: must be an integer >= 0.")
    if self.decoder_pos_emb not in ("sinusoidal", "learned"):
      raise ValueError(f"config.model.decoder_pos_emb = {self.decoder_pos_emb!r}: must be one of "
                       f"sinusoidal, learned (the decoder's positions).")
    if not self.layer_norm_eps > 0:
      raise ValueError(f"config.model.layer_norm_eps = {self.layer_norm_eps!r}: must be > 0.")

  @classmethod
  def from_mapping(cls, cfg: ModelSettings | Mapping[str, Any]) -> ModelSettings:
    """The settings of `cfg` (returned as they are when already settings). Keys the models do
    not read are ignored; a missing or None optional setting takes its default."""
    if isinstance(cfg, cls):
      return cfg
    missing = [name for name in REQUIRED if cfg.get(name) is None]
    if missing:
      raise ValueError(f"config.model.{missing[0]} is missing: every model needs "
                       f"{', '.join(REQUIRED)}.")
    values = {f.name: cfg[f.name] for f in dataclasses.fields(cls)
              if cfg.get(f.name) is not None}
    values["attention"] = AttentionSpec.from_mapping(values["attention"])
    values["layer_attention"] = tuple(AttentionSpec.from_mapping(a)
                                      for a in values.get("layer_attention") or ())
    if "splash" in values:
      try:
        tiles = dict(values["splash"])
      except (TypeError, ValueError):
        raise ValueError(f"config.model.splash = {values['splash']!r}: must be a mapping of the "
                         f"splash kernel's tile fields (block_q, block_kv, ...).") from None
      values["splash"] = tuple(sorted((str(k), v) for k, v in tiles.items()))
    for name in ("remat", "dtype", "compression"):
      if name in values:
        values[name] = str(values[name])
    for name in ("same_length", "attention_bias", "embed_norm", "global_projections", "lm_head"):
      if name in values:
        values[name] = bool(values[name])
    for name in ("rotary_base", "layer_norm_eps", "embed_scale"):
      if name in values:
        values[name] = float(values[name])
    for name in ("norm", "activation", "decoder_pos_emb"):
      if name in values:
        values[name] = str(values[name])
    for name in ("type_vocab_size", "position_offset", "num_global", "memory_length", "compressed_length", "segment_length",
                 "eval_memory_length", "clamp_len", "compression_rate", "decoder_layers",
                 "target_length"):
      if name in values:
        values[name] = int(values[name])
    return cls(**values)

  def as_dict(self) -> dict[str, Any]:
    """The settings as a mapping (`from_mapping(s.as_dict()) == s`)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["attention"] = self.attention.as_dict()
    out["layer_attention"] = tuple(a.as_dict() for a in self.layer_attention)
    out["splash"] = dict(self.splash)
    return out

  def require(self, *names: str, model: str) -> None:
    """Raises ValueError naming the first of `names` that is unset (None) for `model`."""
    for name in names:
      if getattr(self, name) is None:
        raise ValueError(f"config.model.{name} is missing: {model} needs it.")

  @property
  def head_dim(self) -> int:
    return self.qkv_dim // self.num_heads

  @property
  def order(self) -> str:
    """The sublayer string ("sf" * num_layers unless sublayers or sandwich reorder it)."""
    return sublayer_order(self.num_layers, self.sublayers, self.sandwich)

  @property
  def splash_tiles(self) -> dict[str, Any]:
    """The splash kernel's tile fields the config sets (`attention.splash.splash_tiles` takes
    them; empty: its defaults)."""
    return dict(self.splash)

  @property
  def positions(self) -> dict[str, Any]:
    """What an attention layer needs of `pos_emb` (see models/attention_layer.py)."""
    return {"kind": self.pos_emb, "rotary_base": self.rotary_base}

  def layer_specs(self, num_layers: int | None = None) -> list[dict[str, Any]]:
    """One attention spec dict per attention sublayer (`num_layers`: the "s" of `order`)."""
    count = self.order.count("s") if num_layers is None else num_layers
    return layer_specs(self.attention.as_dict(), [a.as_dict() for a in self.layer_attention],
                       count)


__all__ = ["ACTIVATIONS", "CHOICES", "DTYPES", "NORMS", "IN_LAYER", "POOLINGS", "POSITIONS", "REMATS", "REQUIRED",
           "AttentionSpec", "ModelSettings", "check_choice", "check_heads", "check_order",
           "check_rotary", "layer_specs", "sublayer_order"]
