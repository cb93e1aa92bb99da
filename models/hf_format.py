"""The Hugging Face checkpoint format, shared by the importers (`models.pretrained` for encoders,
`models.pretrained_seq2seq` for encoder-decoders): reading a folder, the one-line error, the
import report, and how a tensor maps to one of ours and back.

A checkpoint folder is what `save_pretrained` writes: `config.json` and `model.safetensors` (or
the shards that `model.safetensors.index.json` lists), read with safetensors' NumPy loader, so
no torch is needed and nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
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
}
# The way back (export): our array -> the Hugging Face tensor.
INVERSES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "copy": lambda w: w, "heads": lambda w: w.reshape(-1),
    "linear": lambda w: w.reshape(w.shape[0], -1).T,
    "heads_out": lambda w: w.reshape(-1, w.shape[-1]).T}


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


__all__ = ["ACTIVATIONS", "CheckpointError", "INVERSES", "Report", "TRANSFORMS", "field", "read",
           "read_json", "target", "tile_positions"]
