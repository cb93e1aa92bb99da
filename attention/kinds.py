"""One record per attention kind: the single list of kind names and what each kind needs.

A `Kind` says everything the rest of the codebase needs to know about one attention kind: the
primitive it calls (a function of the `attention` package), the dense mask builders in
`attention.masks` that define its pattern, whether it can be causal (and why not when it cannot),
whether its query and key are one shared projection, the NNX class in `models.attention_extras`
that owns its per-layer arrays, the config arguments it gets by default and every config
argument it accepts. `KINDS` is the one literal registry of names, and `get(name)` the one check
of a name: an unknown name raises a ValueError listing every valid one.

This module is pure Python and imports neither jax nor numpy, so config files can read the names
and defaults without loading jax (`from attention import kinds` loads no primitive).

Adding a kind: a file in `attention/` with its function (and its dense mask in
`attention/masks.py`), one record in `KINDS` below (with its `arguments`), and, when the kind
owns per-layer arrays (parameters, buffers, seeds), an extras class in
`models/attention_extras.py` named by the record.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

Defaults = Callable[[int, int], dict[str, Any]]


def _no_arguments(window: int, max_length: int) -> dict[str, Any]:
  del window, max_length
  return {}


@dataclasses.dataclass(frozen=True)
class Kind:
  """What the layer, the configs and the trainer need to know about one attention kind.

  Attributes:
    name: the config name (`model.attention.kind`).
    module: the module of the `attention` package holding the function (`attention.<module>`).
    function: the primitive's name, exported as `attention.<function>`; it is called as
      `fn(q, k, v, key_mask=..., **args)`, or `fn(qk, v, ...)` when `shared_qk`.
    masks: names of the dense builders in `attention.masks` that define the kind's pattern (its
      specification in tests); empty when the kind attends every pair or approximates dense
      attention.
    causal: True when the primitive accepts `causal=True`, else the reason it cannot be causal
      (shown to whoever asks for it in a language model).
    shared_qk: the query and key are one projection (Reformer's shared-QK); the layer then owns
      no key kernel.
    extras: name of the class in `models.attention_extras` that owns the kind's per-layer
      arrays and consumes some config arguments, or None when the kind needs none.
    defaults: `(window, max_length) -> dict` of the kind's arguments in the task configs, sized
      by `window` (a rough "how far can a query see" knob shared by the local kinds) and the
      model's longest sequence.
    arguments: every config argument the kind accepts (`model.attention.<name>`), sorted: the
      primitive's keyword arguments that a config can set (not q, k, v, key_mask, query_mask,
      causal, array arguments such as `mask`, nor what the extras class supplies) plus the
      extras class's `CONSUMES`. `configs.validate` refuses any other name;
      tests/validate_test.py checks the tuple against the signatures.
  """

  name: str
  module: str
  function: str
  masks: tuple[str, ...] = ()
  causal: bool | str = True
  shared_qk: bool = False
  extras: str | None = None
  defaults: Defaults = _no_arguments
  arguments: tuple[str, ...] = ()

  def __post_init__(self):
    if self.causal is not True and not (isinstance(self.causal, str) and self.causal):
      raise ValueError(f"kind {self.name!r}: causal must be True or the reason it cannot be "
                       f"causal, got {self.causal!r}.")
    unknown = set(self.defaults(8, 64)) - set(self.arguments)
    if unknown:
      raise ValueError(f"kind {self.name!r}: defaults set {sorted(unknown)}, which are not in "
                       f"its arguments {self.arguments}.")

  @property
  def supports_causal(self) -> bool:
    """Whether the primitive can run with `causal=True`."""
    return self.causal is True

  def check_causal(self) -> None:
    """Raises ValueError with the reason when this kind cannot be causal."""
    if not self.supports_causal:
      raise ValueError(f"attention {self.name!r} cannot be causal: {self.causal}")


def _block(window: int) -> int:
  return max(4, window // 2)


def _lsh_defaults(window: int, max_length: int) -> dict[str, Any]:
  del window
  chunk = 64 if max_length >= 1024 else 16
  return {"num_hashes": 2, "chunk_size": chunk,
          "num_buckets": 2 * max(1, round(max_length / (2 * chunk)))}


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("dot_product", "dot_product", "dot_product_attention"),
    Kind("band", "band", "band_attention", masks=("longformer_mask",),
         defaults=lambda window, max_length: {"window": window},
         arguments=("block_size", "dilation", "max_global", "window")),
    Kind("bigbird", "sparse_patterns", "bigbird_attention", masks=("bigbird_mask",),
         causal="BigBird's global and random blocks are bidirectional (bigbird_attention has "
                "no causal mode); use sparse, block_local or band for language models.",
         extras="BigBirdSeed",
         defaults=lambda window, max_length: {
             "block_size": _block(window), "num_global_blocks": 2, "num_random_blocks": 3},
         arguments=("block_size", "num_global_blocks", "num_random_blocks", "seed")),
    Kind("block_local", "sparse_patterns", "block_local_attention",
         masks=("block_local_mask",),
         defaults=lambda window, max_length: {"block_size": max(4, window)},
         arguments=("block_size",)),
    Kind("block_sparse", "block_sparse", "block_sparse_attention",
         masks=("block_layout_mask",), extras="BlockSparseLayout",
         defaults=lambda window, max_length: {
             "block_size": _block(window), "window_blocks": 1, "global_blocks": 1},
         arguments=("block_size", "global_blocks", "window_blocks")),
    Kind("favor", "favor", "favor_attention", extras="FavorFeatures",
         defaults=lambda window, max_length: {"num_features": 256, "redraw": False},
         arguments=("chunk_size", "kernel", "num_features", "redraw")),
    Kind("flash", "flash", "flash_attention", arguments=("block_size",)),
    Kind("linear", "linear", "linear_attention", arguments=("chunk_size",)),
    Kind("linformer", "linformer", "linformer_attention",
         causal="Linformer projects keys and values along the length axis, so every "
                "compressed key mixes future positions; it cannot be causal.",
         extras="LinformerProjections",
         defaults=lambda window, max_length: {"k": 256 if max_length >= 1024 else 32},
         arguments=("k", "sharing")),
    Kind("lsh", "lsh", "lsh_attention", masks=("lsh_pair_counts",), shared_qk=True,
         extras="LshKey", defaults=_lsh_defaults,
         arguments=("chunk_size", "num_buckets", "num_hashes")),
    Kind("sparse", "sparse_patterns", "sparse_attention", masks=("strided_mask", "fixed_mask"),
         defaults=lambda window, max_length: {"pattern": "fixed", "stride": max(4, window)},
         arguments=("block_size", "num_summary_offsets", "pattern", "stride",
                    "summary_width")),
    Kind("synthesizer", "synthesizer", "synthesizer_attention", extras="SynthesizerParams",
         defaults=lambda window, max_length: {"components": "random+dot_product"},
         arguments=("components", "hidden", "k")),
)}


def names() -> tuple[str, ...]:
  """Every valid kind name, sorted."""
  return tuple(sorted(KINDS))


def get(name: str) -> Kind:
  """The record of kind `name`; raises ValueError listing the valid names when it is unknown."""
  try:
    return KINDS[name]
  except (KeyError, TypeError):
    raise ValueError(
        f"unknown attention {name!r}; valid names: {', '.join(names())}.") from None


def defaults(name: str, *, window: int, max_length: int) -> dict[str, Any]:
  """Default config arguments of kind `name` in a model over `max_length` tokens (a new dict)."""
  return dict(get(name).defaults(window, max_length))


__all__ = ["KINDS", "Kind", "defaults", "get", "names"]
