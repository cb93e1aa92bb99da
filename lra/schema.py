"""The config schema and its checks: `check(config)` before anything is imported or built.

`lra run` calls `check` right after resolving the config and its `--config.x=y` overrides (and
on every phase's config of a staged schedule), so a bad value fails at once, in one line that
names the field, its value, what it must be and what the field means, for example

  config.log_every = 0: must be a positive integer (steps between train-metric records).

The rules are one table (`FIELDS`) plus the checks that relate fields: qkv_dim divisible by
num_heads, the mesh sizes, the attention specs (a known kind, only the arguments that kind
accepts, `Kind.arguments` in `attention.kinds`, and sane sizes, `kinds.ARGUMENTS`), what each
layer's kind supports (relative positions, a memory, the sequence split: its record says), and
the Transformer-XL / compressive memory settings. A field a config lacks is not checked. What
needs jax (the global batch against the device count) is left to the trainer.

The model settings' names and rules (pos_emb, pool, remat, dtype, qkv_dim against num_heads,
rotary's even head dimension, the sublayer order) are those of `models.settings`, which the
model constructors apply too: one rule, one message, wherever it is found.

`init_from` must be an existing folder and the ListOps generator's sizes must let it make its
trees (`lra.listops_limits`: the longest tree, the int32 token count, the fraction of
draws kept at `max_depth`), so that a run and a dry run refuse them before anything compiles.

This module belongs to the trainer side and imports only ml_collections, the attention kinds'
records, the model settings and the standard library, never jax, so the config files
(`configs/`) and the command line can use it and checking a config is instant (the ListOps
check imports numpy, only for a config with the generator's fields).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping

import ml_collections

from attention import backends, kinds
from lra import listops_limits
from lra.schema_memory import COMPRESSIONS, check_memory
from models import settings as model_settings
from models.settings import DTYPES, POOLINGS, POSITIONS, REMATS

# The learning-rate schedules of the trainer (lra/optim.py; tests/schema_test.py checks they
# agree). The models' names (POSITIONS, POOLINGS, DTYPES, REMATS) are models.settings'.
SCHEDULES = ("rsqrt", "cosine", "constant")
MESH_AXES = ("data", "fsdp", "sequence", "tensor")

Rule = tuple[Callable[[Any], bool], str]  # (is the value valid, what it must be)


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def at_least(low: int) -> Rule:
  """An integer >= low."""
  text = "must be a positive integer" if low == 1 else f"must be an integer >= {low}"
  return (lambda v: _is_int(v) and v >= low), text


MAX_STEPS = 2**31 - 1   # the train state's step counter is an int32
# Fields that count steps: beside their FIELDS rule, at most MAX_STEPS.
STEP_FIELDS = ("num_train_steps", "log_every", "eval_every", "checkpoint_every", "warmup_steps",
               "pretrain.steps")


def number(low: float, high: float | None = None, *, strict: bool = False) -> Rule:
  """A finite number >= low (> low when strict), and < high when given."""
  if high is not None:
    return (lambda v: _is_number(v) and low <= v < high), f"must be a number in [{low}, {high})"
  if strict:
    return (lambda v: _is_number(v) and v > low), f"must be a finite number > {low}"
  return (lambda v: _is_number(v) and v >= low), f"must be a finite number >= {low}"


def one_of(*names: str) -> Rule:
  """One of the given names."""
  return (lambda v: v in names), f"must be one of {', '.join(names)}"


def text(what: str) -> Rule:
  """A string: `what` it names."""
  return (lambda v: isinstance(v, str)), f"must be a string ({what})"


def _model_choice(setting: str) -> tuple[str, Rule, str]:
  """The FIELDS row of a named model setting (`models.settings.CHOICES`)."""
  field, names, meaning = model_settings.CHOICES[setting]
  return field[len("config."):], one_of(*names), meaning


POSITIVE, NON_NEGATIVE = at_least(1), at_least(0)
# lra/data/pathfinder.py DIFFICULTIES and lra/data/text.py VALIDATION_CHOICES (the data modules
# import numpy and tfds; tests/schema_test.py checks that the names agree).
PATHFINDER_DIFFICULTIES = ("easy", "intermediate", "hard")
TEXT_VALIDATIONS = ("test", "holdout")

# (field, rule, what the field means)
FIELDS: tuple[tuple[str, Rule, str], ...] = (
    ("seed", NON_NEGATIVE, "the seed of parameters, dropout and data order"),
    ("batch_size", POSITIVE, "examples per training step, over all devices"),
    ("eval_batch_size", POSITIVE, "examples per evaluation step, over all devices"),
    ("num_train_steps", NON_NEGATIVE, "training steps"),
    ("log_every", POSITIVE, "steps between train-metric records"),
    ("eval_every", POSITIVE, "steps between validation passes"),
    ("checkpoint_every", POSITIVE, "steps between checkpoints"),
    ("keep_checkpoints", POSITIVE, "how many of the newest checkpoints are kept"),
    ("peer_timeout_s", POSITIVE, "seconds a process of a multi-process run waits for the "
     "others"),
    ("learning_rate", number(0), "the peak learning rate"),
    ("schedule", one_of(*SCHEDULES), "the learning-rate schedule"),
    ("warmup_steps", NON_NEGATIVE, "steps of linear learning-rate warmup"),
    ("weight_decay", number(0), "AdamW's decoupled weight decay"),
    ("grad_clip", number(0), "the global gradient-norm limit; 0 disables clipping"),
    ("adam_b1", number(0, 1), "Adam's first-moment decay"),
    ("adam_b2", number(0, 1), "Adam's second-moment decay"),
    ("adam_eps", number(0, strict=True), "Adam's denominator epsilon"),
    _model_choice("remat"),
    _model_choice("dtype"),
    ("init_from", text("a folder, or '' for none"), "a finished run's workdir or checkpoints/ "
     "folder whose parameters start this run"),
    ("init_from_hf", text("a folder, or '' for none"), "a local Hugging Face checkpoint folder"),
    ("data.data_dir", text("a folder"), "the folder of the prepared dataset"),
    ("data.manual_dir", text("a folder"), "the folder of the original archives"),
    ("init_length", NON_NEGATIVE, "the max_length of the init_from run when shorter (its "
     "learned positions are tiled); 0 = the same length"),
    ("pretrain.steps", NON_NEGATIVE, "self-pretraining steps of protocol spt; 0 = half"),
    ("pretrain.learning_rate", number(0), "the pretraining learning rate; 0 = learning_rate"),
    ("model.mask_rate", (lambda v: _is_number(v) and 0 < v < 1, "must be a number in (0, 1)"),
     "the fraction of tokens masked (mlm) or "
     "predicted (mpnet) in self-pretraining"),
    ("model.num_layers", POSITIVE, "transformer blocks"),
    ("model.num_heads", POSITIVE, "attention heads"),
    ("model.emb_dim", POSITIVE, "the model width"),
    ("model.qkv_dim", POSITIVE, "the total query/key/value width over all heads"),
    ("model.mlp_dim", POSITIVE, "the hidden width of each block's MLP"),
    ("model.classifier_dim", POSITIVE, "the hidden width of the classifier head"),
    ("model.dropout", number(0, 1), "the dropout rate"),
    _model_choice("pos_emb"),
    ("model.rotary_base", number(0, strict=True), "the base of the rotary frequencies; the "
     "longest wavelength is 2 pi base tokens"),
    _model_choice("pool"),
    # The data fields of the generated and split tasks (each only where the task has it;
    # before max_length, which some of them set: Pathfinder's is resolution squared).
    ("data.num_train", POSITIVE, "generated training examples"),
    ("data.num_val", POSITIVE, "generated validation examples"),
    ("data.num_test", POSITIVE, "generated test examples"),
    ("data.seed", NON_NEGATIVE, "the seed of the data generator"),
    ("data.gen_min_length", NON_NEGATIVE, "ListOps examples are longer than this many tokens"),
    ("data.gen_max_length", POSITIVE, "ListOps examples are shorter than this many tokens"),
    ("data.max_depth", POSITIVE, "the depth of ListOps trees (the root is at depth 1)"),
    ("data.max_args", at_least(2), "the most arguments of a ListOps operator"),
    ("data.num_generated", POSITIVE, "Pathfinder images generated per split set"),
    ("data.resolution", POSITIVE, "the Pathfinder image side in pixels"),
    ("data.generator_seed", NON_NEGATIVE, "the seed of the Pathfinder generator"),
    ("data.difficulty", one_of(*PATHFINDER_DIFFICULTIES), "the Pathfinder contour difficulty"),
    ("data.validation", one_of(*TEXT_VALIDATIONS), "the text task's validation split: LRA's "
     "test split, or a held-out part of train"),
    ("data.holdout_fraction", (lambda v: _is_number(v) and 0 < v < 1, "must be a number in "
     "(0, 1)"), "the fraction of the train reviews held out for validation"),
    ("data.holdout_seed", NON_NEGATIVE, "the seed of the held-out reviews"),
    ("data.doc_bytes", POSITIVE, "bytes kept of each retrieval document"),
    ("data.max_length", POSITIVE, "tokens per training sequence"),
    ("data.eval_length", NON_NEGATIVE, "the evaluation window; 0 means data.max_length"),
    ("data.eval_context", NON_NEGATIVE, "tokens of context before each scored evaluation span"),
)

_MISSING = object()


def arg_items(arg: str | None) -> dict[str, str]:
  """The `key=value` items of a `get_config` argument such as "attention=band,size=small", as
  text (`configs.common.parse_arg` converts them against each config's defaults)."""
  out = {}
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    out[key.strip()] = value.strip()
  return out


def _get(config: Any, dotted: str) -> Any:
  node = config
  for name in dotted.split("."):
    if not isinstance(node, (Mapping, ml_collections.ConfigDict)) or name not in node:
      return _MISSING
    node = node[name]
  return node


def _refuse(field: str, value: Any, rule: Rule, meaning: str) -> None:
  if not rule[0](value):
    raise ValueError(f"{field} = {value!r}: {rule[1]} ({meaning}).")


def _check_listops_generator(config: Any) -> None:
  """The ListOps generator's sizes against the trees it can make (`lra.listops_limits`)."""
  low, high = _get(config, "data.gen_min_length"), _get(config, "data.gen_max_length")
  depth, args = _get(config, "data.max_depth"), _get(config, "data.max_args")
  if not all(_is_int(v) for v in (low, high, depth, args)) or not _get(config, "data.generate"):
    return
  listops_limits.check(low, high, depth, args)


def _check_fields(config: ml_collections.ConfigDict, prefix: str = "") -> None:
  for field, rule, meaning in FIELDS:
    if field.startswith(prefix):
      value = _get(config, field)
      if value is not _MISSING:
        _refuse(f"config.{field}", value, rule, meaning)
  for field in STEP_FIELDS:
    value = _get(config, field) if field.startswith(prefix) else _MISSING
    if _is_int(value) and value > MAX_STEPS:
      raise ValueError(f"config.{field} = {value}: must be at most {MAX_STEPS} (the train "
                       f"state's step counter is int32).")
  if "data.".startswith(prefix) or prefix.startswith("data."):
    low, high = _get(config, "data.gen_min_length"), _get(config, "data.gen_max_length")
    if _is_int(low) and _is_int(high) and high - low < 2:
      raise ValueError(f"config.data.gen_max_length = {high}: must be at least "
                       f"config.data.gen_min_length + 2 = {low + 2} (examples are kept when "
                       f"gen_min_length < tokens < gen_max_length).")
    _check_listops_generator(config)


def _check_heads(model: Any) -> None:
  model_settings.check_heads(model.get("num_heads"), model.get("qkv_dim"))


def _check_mesh(mesh: Any) -> None:
  if mesh is _MISSING:
    return
  for axis, size in dict(mesh).items():
    if axis not in MESH_AXES:
      raise ValueError(f"config.mesh.{axis}: unknown mesh axis; valid: {', '.join(MESH_AXES)}.")
    if not (_is_int(size) and (size >= 1 or size == -1)):
      raise ValueError(f"config.mesh.{axis} = {size!r}: must be a positive integer or -1 "
                       f"(devices along the {axis} axis; -1: all the remaining ones).")
  if list(dict(mesh).values()).count(-1) > 1:
    raise ValueError(f"config.mesh = {dict(mesh)}: at most one axis may be -1 (all the "
                     f"remaining devices).")


def _check_dilation(field: str, value: Any) -> None:
  values = value if isinstance(value, (tuple, list)) else (value,)
  if not values or not all(_is_int(d) and d >= 1 for d in values):
    raise ValueError(f"{field} = {value!r}: must be a positive integer or a tuple of one "
                     f"positive integer per head (the band's dilation).")


def _check_alpha(field: str, value: Any) -> None:
  """entmax's alpha: "learned" (one per head), or a fixed number in [1, 2]."""
  if value == "learned":
    return
  try:
    number = None if isinstance(value, bool) else float(value)
  except (TypeError, ValueError):
    number = None
  if number is None or not 1 <= number <= 2:
    raise ValueError(f"{field} = {value!r}: must be 'learned' or a number in [1, 2] (entmax's "
                     f"alpha: 1 is softmax, 2 sparsemax).")


def check_attention(spec: Mapping[str, Any], where: str, default_kind: Any = None) -> None:
  """Checks one attention spec (`kind` plus arguments) found at `where` (for the message).

  A spec without `kind` (a `layer_attention` entry) has `default_kind`.
  """
  kind = spec.get("kind", default_kind)
  if kind not in kinds.KINDS:
    raise ValueError(f"{where}.kind = {kind!r}: unknown attention kind; valid: "
                     f"{', '.join(kinds.names())}.")
  accepted = kinds.get(kind).arguments
  for name, value in spec.items():
    if name == "kind":
      continue
    if name == model_settings.IMPLEMENTATION:
      if value not in backends.IMPLEMENTATIONS:
        raise ValueError(f"{where}.{name} = {value!r}: must be one of "
                         f"{', '.join(backends.IMPLEMENTATIONS)} (auto: the fastest exact one "
                         f"on the platform).")
      continue
    if name not in accepted:
      valid = (f"takes no argument {name!r}; valid: {', '.join(accepted)}" if accepted
               else "takes no arguments; remove it")
      raise ValueError(f"{where}.{name} = {value!r}: {kind} {valid}.")
    if name in kinds.ARGUMENTS and value is not None:
      low, meaning = kinds.ARGUMENTS[name]
      _refuse(f"{where}.{name}", value, at_least(low), meaning)
    if name == "dilation":
      _check_dilation(f"{where}.{name}", value)
    if name == "alpha":
      _check_alpha(f"{where}.{name}", value)


def attention_sublayers(model: Any) -> int:
  """The number of attention sublayers (num_layers, or the "s" count of model.sublayers)."""
  sublayers = model.get("sublayers") or ""
  return sublayers.count("s") if sublayers else model.get("num_layers")


def _check_order(model: Any) -> None:
  """model.sublayers (a string of s and f) and model.sandwich (k in [0, num_layers - 1])."""
  model_settings.check_order(model.get("num_layers"), model.get("sublayers", ""),
                             model.get("sandwich", 0))


def _check_positions(model: Any) -> None:
  """Relative positions only with the kinds that compute them; rotary needs even head dims."""
  pos = model.get("pos_emb")
  model_settings.check_rotary(pos, model.get("num_heads"), model.get("qkv_dim"))
  if pos != "relative" or "attention" not in model:
    return
  default = model.attention.get("kind")
  for entry in (model.attention, *(model.get("layer_attention") or ())):
    kind = dict(entry).get("kind", default)
    if not kinds.get(kind).relative:
      relative = kinds.names_where(lambda k: k.relative)
      raise ValueError(f"config.model.pos_emb = 'relative': attention {kind!r} has no relative "
                       f"positions; valid kinds: {', '.join(relative)} (or another "
                       f"pos_emb: {', '.join(p for p in POSITIONS if p != 'relative')}).")


def _check_layer_attention(model: Any) -> None:
  layers = tuple(model.get("layer_attention") or ())
  num_layers = attention_sublayers(model)
  if layers and len(layers) != num_layers:
    entries = f"{len(layers)} entr{'y' if len(layers) == 1 else 'ies'}"
    raise ValueError(f"config.model.layer_attention has {entries}: must have none or one dict "
                     f"per attention layer ({num_layers}: config.model.num_layers, or the 's' of "
                     f"config.model.sublayers).")
  default_kind = model.attention.get("kind")
  for i, entry in enumerate(layers):
    where = f"config.model.layer_attention[{i}]"
    if not isinstance(entry, (Mapping, ml_collections.ConfigDict)):
      raise ValueError(f"{where} = {entry!r}: must be a dict of attention arguments (empty: "
                       f"the default config.model.attention).")
    check_attention(entry, where, default_kind)


def _check_sequence_split(config: ml_collections.ConfigDict) -> None:
  """With the length split over devices, every layer's kind must be able to run split."""
  mesh = _get(config, "mesh")
  if mesh is _MISSING or dict(mesh).get("sequence", 1) in (1, None):
    return
  model = config.model
  default = model.attention.get("kind")
  for entry in (model.attention, *(model.get("layer_attention") or ())):
    kind = dict(entry).get("kind", default)
    if not kinds.get(kind).sequence_parallel:
      split = kinds.names_where(lambda k: k.sequence_parallel)
      raise ValueError(
          f"config.mesh.sequence = {mesh['sequence']}: attention {kind!r} cannot run with the "
          f"sequence split over devices; use --attention {', '.join(split[:-1])} or "
          f"{split[-1]}, or --config.mesh.sequence=1.")


def _check_implementations(config: ml_collections.ConfigDict) -> None:
  """A backend named in the attention specs (`implementation`, `attention.backends`) must compute
  every layer it applies to exactly, and cannot be asked of the paths that compute attention
  their own way (relative positions, the sequence split over devices)."""
  model = config.model
  specs = model_settings.layer_specs(model.attention.to_dict(),
                                     model.get("layer_attention") or (),
                                     attention_sublayers(model))
  mesh = _get(config, "mesh")
  split = mesh is not _MISSING and dict(mesh).get("sequence", 1) not in (1, None)
  for i, spec in enumerate(specs):
    requested = spec.get(model_settings.IMPLEMENTATION) or backends.AUTO
    if requested in (backends.AUTO, "xla"):
      continue
    field = f"config.model.attention.{model_settings.IMPLEMENTATION} = {requested!r}"
    if model.get("pos_emb") == "relative":
      raise ValueError(f"{field}: relative positions (pos_emb='relative') are computed by the "
                       f"xla implementation only; use auto or xla.")
    if split:
      raise ValueError(f"{field}: the sequence split over devices (config.mesh.sequence > 1) "
                       f"runs the xla implementation only; use auto or xla.")
    args = {k: v for k, v in spec.items() if k not in ("kind", model_settings.IMPLEMENTATION)}
    reason = backends.unable(spec.get("kind"), requested, args,
                             global_tokens=bool(model.get("num_global", 0)))
    if reason is not None:
      raise ValueError(f"{field} (layer {i}): {reason} Use auto to pick one that does, or xla.")


def _check_init_from_hf(config: ml_collections.ConfigDict) -> None:
  """`init_from_hf`: a local Hugging Face checkpoint folder of a supported architecture (its
  config.json is read; the tensors when the run starts). A user gives it or `init_from`, not
  both (`launch.checks.check_config`); a later phase of a staged run has both, and starts from
  the previous phase's parameters in the checkpoint's architecture."""
  path = config.get("init_from_hf") if hasattr(config, "get") else None
  if not path:
    return
  if not isinstance(path, str):
    raise ValueError(f"config.init_from_hf = {path!r}: must be a folder path (a local Hugging "
                     f"Face checkpoint) or '' for none.")
  from models import pretrained
  try:
    pretrained.read_config(path)
  except pretrained.CheckpointError as e:
    raise ValueError(f"config.init_from_hf: {e}") from None


def _check_init_from(config: ml_collections.ConfigDict) -> None:
  """`init_from`: a local folder that exists (the run reads its newest checkpoint once it has
  compiled and prepared its data; a bucket path is left to it)."""
  path = config.get("init_from") if hasattr(config, "get") else None
  if not path or not isinstance(path, str) or "://" in path:
    return
  local = os.path.expanduser(path)
  if not os.path.isdir(local):
    what = "is a file" if os.path.exists(local) else "does not exist"
    raise ValueError(f"config.init_from = {path!r}: {what}; give a finished run's workdir or "
                     f"its checkpoints/ folder, whose parameters start this run, or '' for "
                     f"none.")


def check_task(config: ml_collections.ConfigDict, task: str) -> None:
  """`config.task` must be the task whose config file made `config` (`configs/<task>.py`):
  the file's data, model and sizes are that task's, so another task cannot run on them."""
  if config.get("task") != task:
    raise ValueError(f"config.task = {config.get('task')!r}: configs/{task}.py is the config "
                     f"of task {task!r}; run `lra run {config.get('task')}` for another task "
                     f"(its own config file), or leave config.task as it is.")


def _check_splash(tiles: Any) -> None:
  """config.model.splash: the TPU splash kernel's tiles (`attention.splash_tiles.Tiles`)."""
  from attention import splash_tiles as splash   # no jax
  try:
    splash.splash_tiles(dict(tiles))
  except (TypeError, ValueError) as e:
    raise ValueError(f"config.model.splash.{e}") from None


def check(config: ml_collections.ConfigDict, *, context: str = "") -> None:
  """Raises ValueError (one line, prefixed by `context`) at the first invalid value."""
  try:
    _check_fields(config)
    _check_init_from(config)
    _check_init_from_hf(config)
    _check_mesh(_get(config, "mesh"))
    model = _get(config, "model")
    if model is not _MISSING:
      _check_heads(model)
      _check_order(model)
      _check_positions(model)
      if "splash" in model:
        _check_splash(model.splash)
      if "attention" in model:
        check_attention(model.attention, "config.model.attention")
        _check_layer_attention(model)
        _check_sequence_split(config)
        _check_implementations(config)
      if "memory_length" in model:   # Transformer-XL / compressive memory (configs/charlm.py)
        check_memory(config)
  except ValueError as e:
    if context:
      raise ValueError(f"{context}{e}") from None
    raise


def check_data(config: ml_collections.ConfigDict) -> None:
  """Checks only the `data.*` fields (for `lra data prepare`)."""
  _check_fields(config, prefix="data.")


__all__ = ["COMPRESSIONS", "DTYPES", "FIELDS", "MESH_AXES", "POOLINGS", "POSITIONS", "REMATS",
           "SCHEDULES", "arg_items", "attention_sublayers", "check", "check_attention",
           "check_data", "check_memory", "check_task"]
