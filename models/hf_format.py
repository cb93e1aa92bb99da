"""The Hugging Face checkpoint format, shared by the importers (`models.pretrained` for encoders,
`models.pretrained_seq2seq` for encoder-decoders): reading a folder, the one-line error, the
import report, and how a tensor maps to one of ours and back.

A checkpoint folder is what `save_pretrained` writes: `config.json` and `model.safetensors` (or
the shards that `model.safetensors.index.json` lists), read with safetensors' NumPy loader, so
no torch is needed and nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from typing import Any, Callable

import numpy as np

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "relu": "relu"}


class CheckpointError(ValueError):
  """A checkpoint folder that cannot be imported; the message is one line."""


@dataclasses.dataclass
class Report:
  """What `load` did: the architecture, the settings built, each tensor's place in our model,
  the checkpoint's tensors our model has no use for, and notes (positions copied, ...)."""

  architecture: str
  settings: dict[str, Any]
  mapped: dict[str, str] = dataclasses.field(default_factory=dict)
  unused: list[str] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)

  def __str__(self) -> str:
    lines = [f"{self.architecture}: {len(self.mapped)} tensors mapped, {len(self.unused)} unused"]
    lines += [f"  {hf} -> {ours}" for hf, ours in self.mapped.items()]
    lines += [f"  unused: {name}" for name in self.unused]
    lines += [f"  note: {note}" for note in self.notes]
    return "\n".join(lines)


def read_json(path: str) -> dict[str, Any]:
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: not a folder (give a local Hugging Face checkpoint folder "
                          f"with config.json and model.safetensors).")
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise CheckpointError(f"{config_path}: missing (a Hugging Face checkpoint folder has it).")
  try:
    with open(config_path) as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{config_path}: not readable JSON ({e}).") from None
  if not isinstance(config, dict):
    raise CheckpointError(f"{config_path}: must hold a JSON object.")
  return config


def read(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(config.json as a dict, every tensor of the folder by name as float32 or int arrays)."""
  config = read_json(path)
  from safetensors.numpy import load_file   # imported here: reading configs needs no tensors
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f).get("weight_map", {}).values()))
  else:
    files = ["model.safetensors"]
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      raise CheckpointError(f"{file}: missing (only safetensors checkpoints are read: save with "
                            f"save_pretrained(..., safe_serialization=True)).")
    try:
      tensors.update(load_file(file))
    except Exception as e:  # safetensors raises its own error types for damaged files
      raise CheckpointError(f"{file}: not a readable safetensors file ({e}).") from None
  return config, tensors


def write(path: str, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
  """Writes a checkpoint folder `path` (`model.safetensors`, `config.json`) all at once: both
  files go into a new folder beside it (`.NAME.partial-*`), which is then renamed to `path`, so
  a process killed at any moment leaves `path` as it was (absent, or an empty folder) and never
  half a checkpoint; the partial folder it may leave is not read and can be deleted. `path`
  must not exist or be an empty folder (an export never mixes with other files)."""
  from safetensors.numpy import save_file
  path = os.path.abspath(path)
  if os.path.lexists(path) and not (os.path.isdir(path) and not os.path.islink(path)
                                    and not os.listdir(path)):
    raise CheckpointError(f"{path}: exists and is not an empty folder; export into a new or "
                          f"empty folder.")
  parent, name = os.path.split(path)
  os.makedirs(parent, exist_ok=True)
  partial = os.path.join(parent, f".{name}.partial-{os.getpid()}-{os.urandom(4).hex()}")
  os.mkdir(partial)
  try:
    save_file(tensors, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(partial, "config.json"), "w") as f:
      json.dump(config, f, indent=2, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    with open(os.path.join(partial, "model.safetensors"), "rb") as f:
      os.fsync(f.fileno())
    try:
      os.replace(partial, path)   # replaces an empty folder in one step (rename(2))
    except OSError as e:
      if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
        raise
      raise CheckpointError(f"{path}: another process wrote it meanwhile; its files are kept, "
                            f"export into a new or empty folder.") from None
  except BaseException:
    import shutil
    shutil.rmtree(partial, ignore_errors=True)
    raise


def field(config: dict[str, Any], name: str, path: str, default: Any = None) -> Any:
  value = config.get(name, default)
  if value is None:
    raise CheckpointError(f"{path}/config.json: field {name!r} is missing (a "
                          f"{config.get('model_type')} config has it).")
  return value


# How a tensor becomes one of ours, by name: (its Hugging Face shape given ours, the map).
#   copy: the same array; heads: a bias [H*Dh] -> [H, Dh]; linear: a torch Linear weight
#   [out, in] -> our kernel [in, out] (the query [E, H, Dh]); heads_out: the output projection's
#   weight [E, H*Dh] -> [H, Dh, E].
TRANSFORMS: dict[str, tuple[Callable[[tuple[int, ...]], tuple[int, ...]],
                            Callable[[np.ndarray, tuple[int, ...]], np.ndarray]]] = {
    "copy": (lambda shape: shape, lambda w, shape: w),
    "heads": (lambda shape: (int(np.prod(shape)),), lambda w, shape: w.reshape(shape)),
    "linear": (lambda shape: (int(np.prod(shape[1:])), shape[0]),
               lambda w, shape: w.T.reshape(shape)),
    "heads_out": (lambda shape: (shape[-1], int(np.prod(shape[:-1]))),
                  lambda w, shape: w.T.reshape(shape)),
    # BART's final_logits_bias is a [1, V] buffer; ours is [V].
    "row": (lambda shape: (1, *shape), lambda w, shape: w.reshape(shape)),
}
# The way back (export): our array -> the Hugging Face tensor.
INVERSES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "copy": lambda w: w, "heads": lambda w: w.reshape(-1),
    "linear": lambda w: w.reshape(w.shape[0], -1).T,
    "heads_out": lambda w: w.reshape(-1, w.shape[-1]).T, "row": lambda w: w.reshape(1, -1)}


def target(model, path: str):
  node = model
  for part in path.split("."):
    node = node[int(part)] if part.isdigit() else getattr(node, part)
  return node


def tile_positions(table: np.ndarray, offset: int, rows: int) -> np.ndarray:
  """Longformer's copy: the rows after `offset` repeated to fill `rows` positions."""
  body = table[offset:]
  reps = -(-rows // body.shape[0])
  return np.concatenate([table[:offset], np.tile(body, (reps, 1))[:rows]], axis=0)



def assign(model, path: str, kind: str, entries, tensors: dict[str, np.ndarray], report: Report,
           *, positions: str, source_length: int, offset: int, what: str = "positions",
           optional: dict[str, str] | None = None) -> None:
  """Writes each checkpoint tensor of `entries` ((Hugging Face name, our variable's path, one of
  TRANSFORMS) triples) into `model`, recording it in `report.mapped`. The learned position table
  `positions` (`source_length` rows after `offset`) is tiled over a longer one, noted in
  `report.notes` as `what`. A tensor of `optional` may be missing (its note is recorded); any other
  missing tensor, or a wrong shape, raises CheckpointError naming it."""
  optional = optional or {}
  for hf, ours, how in entries:
    if hf not in tensors:
      if hf in optional:
        report.notes.append(optional[hf])
        continue
      raise CheckpointError(f"{path}: tensor {hf!r} is missing (a {kind} checkpoint with this "
                            f"config.json has it).")
    value = np.asarray(tensors[hf], np.float32)
    variable = target(model, ours)
    shape = tuple(variable.get_value().shape)
    if ours == positions and shape[0] != value.shape[0]:
      if value.shape[0] - offset != source_length:
        raise CheckpointError(f"{path}: tensor {hf!r} has {value.shape[0]} rows, but "
                              f"config.json makes it {source_length + offset}.")
      value = tile_positions(value, offset, shape[0] - offset)
      report.notes.append(f"{what}: {source_length} copied to {shape[0] - offset}")
    hf_shape, transform = TRANSFORMS[how]
    if tuple(value.shape) != hf_shape(shape):
      raise CheckpointError(f"{path}: tensor {hf!r} has shape {tuple(value.shape)}, but this "
                            f"config.json makes it {hf_shape(shape)} (our {ours}: {shape}).")
    variable.set_value(transform(value, shape).astype(variable.get_value().dtype))
    report.mapped[hf] = ours
  report.unused = sorted(n for n in tensors if n not in report.mapped)

__all__ = ["ACTIVATIONS", "CheckpointError", "INVERSES", "Report", "TRANSFORMS", "assign", "field",
           "read", "read_json", "target", "tile_positions", "write"]
